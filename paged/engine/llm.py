"""The `LLM` facade (guide §11): vLLM's offline API (`vllm.LLM`) over the paged engine.

    llm = LLM(model="smollm2", block_size=16)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

`LLM.generate` queues every prompt on its LLMEngine (engine/llm_engine.py) and steps it until all are done, with a
progress bar. Every request is validated before anything is queued, so a bad prompt raises a `ValueError` and leaves
the engine as it was; beam search runs on the same engine (beam_search.py).
"""

import contextlib

import torch
from tqdm.auto import tqdm

from paged.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from paged.core.sequence import RequestOutput
from paged.engine.llm_engine import LLMEngine
from paged.engine.multiproc_executor import MultiprocExecutor
from paged.lora import LoRARequest
from paged.model.attention_backends import default_attention_backend
from paged.model.loader import load_model, model_config
from paged.model.tensor_parallel import check_tensor_parallel
from paged.sampling_params import SamplingParams
from paged.speculative import resolve_draft
from paged.validation import as_prompt_list


def check_tensor_parallel_settings(config: EngineConfig, kv_connector) -> None:
    """The features a tensor-parallel engine does not run, refused by name: each keeps K/V or weights of its own
    (a draft model, adapters, tiers, a connector) that would have to be split across the ranks as well."""
    refused = {
        "speculative_config": config.speculative is not None,
        "enable_lora": config.enable_lora,
        "preemption_mode='swap'": config.preemption_mode == "swap",
        "kv_offloading_size": config.kv_offloading_size is not None,
        "kv_connector": kv_connector is not None,
    }
    for name, given in refused.items():
        if given:
            raise ValueError(
                f"{name} cannot be used with tensor_parallel_size > 1: the engine splits only the "
                f"model and its KV pool across ranks"
            )


class LLM:
    """vLLM's offline API over the paged engine.

        llm = LLM(model="smollm2", block_size=16)
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    `model` is "smollm2" (the bundled model), a checkpoint folder of a Llama, Mistral, Qwen2 or Qwen3, the name of
    one in the local Hugging Face cache ("Qwen/Qwen3-0.6B"), or a transformers model object (for tests: random
    weights); see models.load_model.
    KV offload (guide §15, `offload.py`): `preemption_mode="swap"` with `swap_space` GiB of swap tier;
    `kv_offloading_size` GiB of tier for the prefix cache; `kv_offload_dir`: a folder for both tiers as
    memory-mapped files (a disk tier) instead of host memory, files of this engine's own (kv_offload_files()).
    `tensor_parallel_size=N` splits the model across N ranks, this process and N - 1 workers
    (model/tensor_parallel.py, engine/multiproc_executor.py); kv_cache_memory and num_blocks are then per rank.
    """

    def __init__(
        self,
        model="smollm2",
        tokenizer=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_idle_prefill_tokens: int | None = None,
        enable_chunked_prefill: bool = False,
        preemption_mode: str = "recompute",
        attention_backend: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        speculative_config: dict | None = None,
        swap_space: float = 1.0,
        kv_offloading_size: float | None = None,
        kv_offload_dir: str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        config: EngineConfig | None = None,
        kv_connector=None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool | None = None,
        cudagraph_capture_sizes: list[int] | None = None,
    ):
        """config: every engine setting at once (a disaggregation worker gets it so), in place of the keywords.
        kv_connector: a KVProducer or KVConsumer (kv_connector.py), as disaggregation's workers use."""
        if config is None:  # checks them all
            config = EngineConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory=kv_cache_memory,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_idle_prefill_tokens=max_idle_prefill_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                preemption_mode=preemption_mode,
                swap_space=swap_space,
                kv_offloading_size=kv_offloading_size,
                kv_offload_dir=kv_offload_dir,
                speculative_config=speculative_config,
                enable_lora=enable_lora,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                enforce_eager=enforce_eager,
                cudagraph_capture_sizes=cudagraph_capture_sizes,
            )
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(config.seed)
        backend = attention_backend or default_attention_backend(device)
        executor = None
        if tensor_parallel_size != 1:
            check_tensor_parallel_settings(config, kv_connector)
            check_tensor_parallel(model_config(model), tensor_parallel_size)
            executor = MultiprocExecutor.start(tensor_parallel_size, model, dtype, device, backend)
        try:
            target, tokenizer = load_model(
                model, tokenizer, device, dtype, backend, tensor_parallel=None if executor is None else executor.group
            )
            draft = None
            if config.speculative is not None and config.speculative.method == "draft_model":
                draft = resolve_draft(config.speculative, target, backend)
            self.engine = LLMEngine(
                target, tokenizer, config, draft_model=draft, kv_connector=kv_connector, executor=executor
            )
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        self.tokenizer = tokenizer

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Every rank's answer to its Worker's `method` (multiproc_executor.Worker: "kv_cache_info", ...), rank
        0's first, as vLLM's collective_rpc; needs tensor_parallel_size > 1."""
        if self.engine.executor is None:
            raise ValueError("collective_rpc needs an LLM made with tensor_parallel_size > 1")
        return self.engine.executor.collective_rpc(method, args)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (they stop anyway when the LLM is collected or Python exits)."""
        if self.engine.executor is not None:
            self.engine.executor.shutdown()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`. lora_request: one adapter
        for every prompt, or a list with one per prompt (None entries run on the base model)."""
        prompts = as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        elif not isinstance(lora_request, (list, tuple)) or len(lora_request) != len(prompts):
            raise ValueError(
                f"lora_request must be a LoRARequest, None, or a list of one per prompt "
                f"({len(prompts)}), got {lora_request!r}"
            )
        engine = self.engine
        engine.require_idle("generate")
        with engine.lora.transaction() if engine.lora is not None else contextlib.nullcontext():
            requests = [
                engine.make_request(p, sp, lora_request=lr)  # validate all first
                for p, sp, lr in zip(prompts, sampling_params, lora_request)
            ]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            try:
                for request in requests:
                    engine.add_request(request)
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        done[output.request_id] = output
                        bar.update()
            except BaseException:  # an interrupt or an error must not leave half a batch in the pool
                for request in requests:
                    engine.abort_request(request.request_id)
                raise
        return [done[request.request_id] for request in requests]

    def beam_search(self, prompts, beam_width: int = 4, max_tokens: int = 32, length_penalty: float = 1.0):
        """Beam search whose beams share blocks; returns one BeamSearchOutput per prompt, best beam first."""
        from paged.beam_search import beam_search

        return beam_search(self.engine, as_prompt_list(prompts), beam_width, max_tokens, length_penalty)

    def kv_stats(self) -> dict:
        return self.engine.kv_stats()

    def kv_offload_files(self) -> dict[str, str]:
        """The files this engine's tiers live in with kv_offload_dir ("swap", "prefix"): its own, deleted when
        the engine is collected or the interpreter exits."""
        tiers = {"swap": self.engine.swap_space, "prefix": self.engine.prefix_tier}
        return {
            kind: str(space.tier.path)
            for kind, space in tiers.items()
            if space is not None and space.tier.path is not None
        }

    def spec_stats(self) -> dict:
        return self.engine.spec_stats()

    def lora_stats(self) -> dict:
        """The adapters registered, the slots' contents, loads and evictions (guide §16); needs enable_lora=True."""
        if self.engine.lora is None:
            raise ValueError("lora_stats needs an engine made with enable_lora=True")
        return self.engine.lora.stats()
