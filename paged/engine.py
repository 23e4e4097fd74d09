"""The engine (guide §11): `LLMEngine.step()` = schedule -> execute -> sample, and the `LLM` facade on top.

    engine = LLMEngine(...); engine.add_request(prompt, params); while engine.has_unfinished_requests(): engine.step()

`LLM.generate` does exactly that for a list of prompts, with a progress bar. Every request is validated before
anything is queued, so a bad prompt raises a `ValueError` and leaves the engine as it was.
"""

import itertools
import time

import torch
from tqdm.auto import tqdm

from .block_manager import BlockManager, cdiv
from .geometry import KVGeometry
from .kv_cache import KVCache
from .model import AttentionMetadata, PagedLlama
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sequence import CompletionOutput, Request, RequestMetrics, RequestOutput, Sequence, SequenceStatus

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes of K/V pool when num_blocks is not given


class LLMEngine:
    def __init__(self, model: PagedLlama, tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = False,
                 enable_prefix_caching: bool = False, seed: int = 0, clock=time.perf_counter):
        self.model = model
        self.clock = clock  # seconds; a driver replaying a trace may pass a simulated clock
        self.tokenizer = tokenizer
        self.device = model.device
        self.max_model_len = model.max_position
        if num_blocks is None:
            num_blocks = KVGeometry.from_config(model.config, model.dtype).pool_blocks(kv_cache_memory, block_size)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)  # validates both sizes
        self.kv_cache = KVCache(len(model.layers), model.num_kv_heads, model.head_dim, num_blocks, block_size,
                                dtype=model.dtype, device=self.device)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_id = getattr(model.config, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self._seq_counter = itertools.count()
        self.num_steps = 0
        self.last_schedule = None
        self.forward_observers = []  # callables(plan) run before each forward pass, for widgets and measurements

    # ---- requests in and out ----------------------------------------------------------------------------

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and validate one prompt; raises ValueError and changes nothing if it cannot be served."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer; pass token ids")
            text, token_ids = prompt, self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        vocab = self.model.embed_tokens.shape[0]
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}) (the model's vocabulary size)")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the model holds at most {self.max_model_len} "
                             f"(max_model_len) including at least one new token")
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if cdiv(longest, self.block_manager.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {longest} tokens "
                             f"can never fit the KV pool of {capacity} tokens ({self.block_manager.num_blocks} blocks "
                             f"of {self.block_manager.block_size}); raise num_blocks or lower max_tokens")
        if not self.scheduler.enable_chunked_prefill and len(token_ids) > self.scheduler.max_num_batched_tokens:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                             f"({self.scheduler.max_num_batched_tokens}); raise it or enable_chunked_prefill=True")
        if request_id is None:
            request_id = str(next(self._request_counter))
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return Request(request_id, text, token_ids, params, RequestMetrics(arrival_time=self.clock()))

    def add_request(self, request: Request) -> str:
        """Queue a request made by make_request. One sequence prefills the prompt; with n > 1 it forks the
        other n - 1 when the prompt is done, and they all share the prompt's blocks (copy-on-write)."""
        self.scheduler.add(self._new_sequence(request))
        self.requests[request.request_id] = request
        return request.request_id

    def _new_sequence(self, request: Request) -> Sequence:
        index = len(request.seqs)
        generator = None
        if request.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(request.params.seed + index)
        seq = Sequence(next(self._seq_counter), request, index, generator)
        request.seqs.append(seq)
        return seq

    def fork(self, parent: Sequence) -> Sequence:
        """A running copy of parent that shares all its blocks; the first write to a shared block copies it."""
        child = self._new_sequence(parent.request)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self.scheduler.running.append(child)
        return child

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool at once."""
        request = self.requests.pop(request_id)
        self.scheduler.abort([seq for seq in request.seqs if not seq.is_finished])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one iteration ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample; returns the requests that finished."""
        plan = self.last_schedule = self.scheduler.schedule()  # kept for timelines and widgets
        if not plan.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any waiting sequence (a bug: requests are "
                                   "validated to fit the pool)")
            return []
        sampled_seqs, logits = self.execute(plan)
        rows = list(range(len(sampled_seqs)))
        for row, seq in enumerate(list(sampled_seqs)):
            while len(seq.request.seqs) < seq.params.n:  # the prompt is done: fork the other completions
                sampled_seqs.append(self.fork(seq))
                rows.append(row)
        if len(rows) > logits.shape[0]:  # forks sample from their parent's row
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        tokens = sample(logits, [seq.params for seq in sampled_seqs], [seq.generator for seq in sampled_seqs],
                        self.generator)
        now = self.clock()
        finished = []
        for seq, token in zip(sampled_seqs, tokens):
            seq.token_ids.append(token)
            seq.request.metrics.first_token_time = seq.request.metrics.first_token_time or now
            if self._check_stop(seq, token):
                finished.append(seq)
        self.scheduler.finish(finished)
        return [self._finish_request(request) for request in {seq.request.request_id: seq.request
                                                              for seq in finished}.values()
                if request.is_finished]

    def execute(self, plan) -> tuple[list[Sequence], torch.Tensor]:
        """Run the scheduled tokens through the model. Returns the sequences whose next token is due and their
        logits [len(sequences), vocab]; the caller samples (step) or searches (beam_search)."""
        self.num_steps += 1
        for observe in self.forward_observers:  # the tables are as this step uses them, copies made or queued
            observe(plan)
        now = self.clock()
        for seq, _ in plan.scheduled:
            seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now
        # Single-token decodes first, then prefill chunks: the layout AttentionMetadata describes.
        batch = [item for item in plan.scheduled if item[1] == 1] + [item for item in plan.scheduled if item[1] > 1]
        input_ids, positions, meta, sampled_seqs, logits_indices = self._prepare_inputs(batch)
        if plan.blocks_to_copy:  # copy-on-write: private copies of shared blocks, before anyone writes
            sources, targets = zip(*plan.blocks_to_copy)
            self.kv_cache.copy_blocks(list(sources), list(targets))
        logits = self.model.forward(input_ids, positions, meta, self.kv_cache, logits_indices)
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
        return sampled_seqs, logits

    def _prepare_inputs(self, batch: list[tuple[Sequence, int]]):
        """Flatten the batch into token ids, positions, slots and per-sequence block tables."""
        input_ids, positions, slots, logits_indices, sampled_seqs = [], [], [], [], []
        tables, context_lens, query_lens = [], [], []
        for seq, num_new in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.block_manager.slot_mapping(seq.seq_id, start, end)
            tables.append(self.block_manager.block_tables[seq.seq_id])
            context_lens.append(end)
            query_lens.append(num_new)
            if end == seq.num_tokens:  # the chunk reaches the sequence's last token: sample its next one
                logits_indices.append(len(input_ids) - 1)
                sampled_seqs.append(seq)
        num_decodes = sum(1 for n in query_lens if n == 1)
        device = self.device

        def table_tensor(rows):  # int32 [len(rows), longest row], padded with block 0
            width = max((len(r) for r in rows), default=0)
            return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)

        int32 = dict(dtype=torch.int32, device=device)
        prefill_query_lens = torch.tensor(query_lens[num_decodes:], **int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=num_decodes,
            decode_block_tables=table_tensor(tables[:num_decodes]),
            decode_context_lens=torch.tensor(context_lens[:num_decodes], **int32),
            prefill_block_tables=table_tensor(tables[num_decodes:]),
            prefill_query_start_loc=torch.nn.functional.pad(prefill_query_lens.cumsum(0), (1, 0)).to(torch.int32),
            prefill_context_lens=torch.tensor(context_lens[num_decodes:], **int32))
        return (torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                meta, sampled_seqs, torch.tensor(logits_indices, dtype=torch.int64, device=device))

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return False
        seq.status = SequenceStatus.FINISHED
        return True

    def _finish_request(self, request: Request) -> RequestOutput:
        request.metrics.finished_time = self.clock()
        del self.requests[request.request_id]
        return self.output_of(request)

    def output_of(self, request: Request) -> RequestOutput:
        outputs = [CompletionOutput(seq.index, self._decode(seq.output_token_ids), list(seq.output_token_ids),
                                    seq.finish_reason) for seq in request.seqs]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.is_finished, request.metrics)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---- the pool, in numbers -----------------------------------------------------------------------------

    def kv_stats(self) -> dict:
        manager = self.block_manager
        used = manager.num_blocks - manager.num_free_blocks
        live_tokens = sum(seq.num_computed_tokens for seq in self.scheduler.running)
        return {
            "num_blocks": manager.num_blocks,
            "block_size": manager.block_size,
            "num_free_blocks": manager.num_free_blocks,
            "num_used_blocks": used,
            "num_cached_blocks": manager.num_cached_blocks,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prefix_query_tokens": self.scheduler.prefix_query_tokens,
            "usage": used / manager.num_blocks,
            "live_tokens": live_tokens,
            "bytes_per_block": self.kv_cache.nbytes // manager.num_blocks,
            "pool_bytes": self.kv_cache.nbytes,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
        }


def as_prompt_list(prompts) -> list:
    """One prompt (a string or a list of token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class LLM:
    """vLLM's offline API over the paged engine.

        llm = LLM(model="smollm2", block_size=16)
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    `model` is "smollm2" (the bundled model) or a transformers Llama model object (for tests: random weights).
    """

    def __init__(self, model="smollm2", tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY, enable_prefix_caching: bool = False,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = False,
                 preemption_mode: str = "recompute", attention_backend: str | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None, seed: int = 0):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if preemption_mode != "recompute":
            raise ValueError(f"preemption_mode {preemption_mode!r} is not available yet; use 'recompute'")
        torch.manual_seed(seed)
        if isinstance(model, str):
            if model != "smollm2":
                raise ValueError(f"model must be 'smollm2' (the bundled model) or a transformers model, got {model!r}")
            from .models import load_hf_model
            hf_model, tokenizer = load_hf_model(dtype=dtype, device=device)
        else:
            hf_model = model.to(device=device, dtype=dtype).eval()
        backend = attention_backend or ("triton" if device.type == "cuda" else "cpu")
        self.engine = LLMEngine(PagedLlama(hf_model, backend), tokenizer, block_size=block_size,
                                num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                enable_chunked_prefill=enable_chunked_prefill,
                                enable_prefix_caching=enable_prefix_caching, seed=seed)
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        prompts = as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        engine = self.engine
        requests = [engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]  # validate all first
        for request in requests:
            engine.add_request(request)
        ours = {request.request_id for request in requests}
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            try:
                while len(done) < len(requests):
                    for output in engine.step():
                        if output.request_id in ours:
                            done[output.request_id] = output
                            bar.update()
            except BaseException:  # an interrupt or an error must not leave half a batch in the pool
                for request in requests:
                    if request.request_id not in done and request.request_id in engine.requests:
                        engine.abort_request(request.request_id)
                raise
        return [done[request.request_id] for request in requests]

    def beam_search(self, prompts, beam_width: int = 4, max_tokens: int = 32, length_penalty: float = 1.0):
        """Beam search whose beams share blocks; returns one BeamSearchOutput per prompt, best beam first."""
        from .beam_search import beam_search
        prompts = as_prompt_list(prompts)
        return beam_search(self.engine, prompts, beam_width, max_tokens, length_penalty)

    def kv_stats(self) -> dict:
        return self.engine.kv_stats()
