"""The model runner (guide §11, the engine step): one scheduled step's tensor work, as vLLM V1's
`GPUModelRunner.execute_model` (vllm/v1/worker/gpu_model_runner.py) does it.

    output = model_runner.execute_model(scheduler_output)   # inputs -> block copies -> forward -> sample -> logprobs

The runner owns the model and its KV pool (and the offload tiers that copy blocks in and out of it), and the tensors
each step's inputs are written into (`input_buffers.py`). From the scheduler's plan it builds the step's inputs
(`model_inputs.step_inputs`; a decode batch padded for a CUDA graph, `cuda_graphs.py`), makes the block copies the
plan names (swap, copy-on-write, tier loads), runs the forward pass (on every tensor-parallel rank at once when an executor is
given), samples each due sequence's next token (`sampler.sample`), or verifies its drafts (`speculative.py`), and
scores the rows that ask for logprobs. It changes no sequence: the scheduler's update appends what it returns, and
the output processor (`output_processor.py`) turns that into text.
"""

import contextlib
import time
from dataclasses import dataclass

import torch

from paged.config import EngineConfig
from paged.core.block_manager import BlockManager
from paged.core.sequence import Request, Sequence
from paged.engine.cuda_graphs import DecodeGraphs
from paged.engine.input_buffers import InputBuffers
from paged.engine.kv_cache import KVCache
from paged.engine.model_inputs import step_inputs
from paged.engine.multiproc_executor import Worker
from paged.engine.sampler import sample, token_logprobs
from paged.geometry import cdiv
from paged.kv_connector import KVConnector
from paged.model import llama
from paged.model.llama import PagedLlama
from paged.offload import build_tiers
from paged.sampling_params import Logprob


@dataclass
class ModelRunnerOutput:
    """What one step computed (vLLM's ModelRunnerOutput): the sequences whose next tokens were due (forks included,
    in row order) with the tokens each appends, and the logprob entries asked for, not yet decoded to text."""

    seqs: list[Sequence]
    sampled_token_ids: list[list[int]]  # per sequence: 1 token, or 1..k + 1 after verifying k drafts
    logprobs: list[tuple[Sequence, list[dict[int, Logprob]]]]  # one entry per sampled token, for params.logprobs
    prompt_logprobs: list[tuple[Request, list[dict[int, Logprob]]]]  # the prompt tokens this step's rows predict


class ModelRunner:
    def __init__(
        self,
        model: PagedLlama,
        config: EngineConfig,
        block_manager: BlockManager,
        generator: torch.Generator,
        kv_connector: KVConnector,
        lora=None,
        speculator=None,
        executor=None,
    ):
        """generator: the engine's sampling generator (unseeded rows draw from it). lora: the LoRAManager of an
        engine made with enable_lora (guide §16). speculator: the Speculator that verifies drafts (guide §14).
        executor: the other ranks of a tensor-parallel model, model being rank 0's shard; their pools hold as
        many blocks as this one."""
        self.model, self.block_manager, self.generator = model, block_manager, generator
        self.device = model.device
        self.kv_cache = KVCache(
            len(model.layers),
            model.num_kv_heads,
            model.head_dim,
            block_manager.num_blocks,
            config.block_size,
            dtype=model.dtype,
            device=self.device,
        )
        self.swap_space, self.prefix_tier = build_tiers(config.offload, block_manager, self.kv_cache)  # guide §15
        self.kv_connector, self.lora, self.speculator, self.executor = kv_connector, lora, speculator, executor
        self.kv_written = False  # within a step: K/V tensors have been written (the step journal reads it)
        # the host's seconds in the last step's parts (a GPU may still be computing when the forward pass returns;
        # sampling then waits for it): building the inputs and making the block copies, the forward pass, sampling
        self.last_prepare_time = self.last_forward_time = self.last_sample_time = 0.0
        if executor is not None:
            executor.local_worker = Worker(executor.group, model, self.kv_cache)
            executor.initialize_cache(block_manager.num_blocks, config.block_size)
        self.config = config
        self.buffers = self.decode_graphs = None
        self.make_buffers(
            config.max_num_batched_tokens, config.max_num_seqs, cdiv(config.max_model_len, config.block_size) + 1
        )

    def make_buffers(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """The step's input buffers, and the decode graphs over them: captured on a GPU unless enforce_eager; on
        a CPU only with enforce_eager=False, and then run eagerly at their padded sizes. An engine with adapters
        or tensor-parallel ranks runs every step eagerly: an adapter's rows change with each step's batch, and the
        other ranks run their forward passes eagerly."""
        self.buffers = InputBuffers(max_num_tokens, max_num_seqs, max_blocks_per_seq, self.device)
        on_gpu = self.device.type == "cuda"
        eager = self.config.enforce_eager if self.config.enforce_eager is not None else not on_gpu
        if eager or self.lora is not None or self.executor is not None:
            return
        # the kernels that read every length on the GPU; the debug checks read the tables back, which no graph can
        capture = on_gpu and self.model.backend.name == "triton" and not llama.CHECK_KERNELS
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.buffers,
            self.config.cudagraph_capture_sizes,
            self.config.max_model_len,
            capture,
        )

    def execute_model(self, plan, running: list[Sequence]) -> ModelRunnerOutput:
        """Run the plan's forward pass, sample each due sequence (a fork samples from its parent's row), and score
        the logprobs asked for. running: the scheduler's running sequences, whose adapters stay resident. Changes
        no sequence, only the generators' states."""
        logits, sampled, prompt_rows = self.forward(plan, running)  # logits [rows, vocab]
        started = time.perf_counter()
        row_of = {seq.seq_id: row for seq, row in sampled}
        sampled += [(child, row_of[parent.seq_id]) for parent, child in plan.forks]
        tokens = self.sample(sampled, logits)
        output = ModelRunnerOutput(
            [seq for seq, _ in sampled],
            tokens,
            self.logprobs(sampled, tokens, logits),
            self.prompt_logprobs(prompt_rows, logits),
        )
        self.last_sample_time = time.perf_counter() - started
        return output

    def forward(
        self, plan, running: list[Sequence]
    ) -> tuple[torch.Tensor, list[tuple[Sequence, int]], list[tuple[Sequence, int, int]]]:
        """Run the scheduled tokens through the model. Returns the logits [rows, vocab], the sequences whose
        next token is due, each with its first row (one row, or 1 + k to verify k drafts), in row order, and the
        rows that predict prompt tokens for prompt logprobs (StepInputs.prompt_rows); execute_model samples from
        them, beam search searches them. Changes no sequence."""
        started = time.perf_counter()
        lora_batch = None
        if self.lora is not None:  # the adapters of plan.batch made resident (guide §16)
            _, lora_batch = self.lora.prepare_step(plan.batch, running)
        num_tokens = sum(num_new for _, num_new in plan.batch)
        longest = max(len(self.block_manager.block_tables[seq.seq_id]) for seq, _ in plan.batch)
        if not self.buffers.fits(num_tokens, len(plan.batch), longest):  # a larger token budget than at the start
            self.make_buffers(
                max(num_tokens, self.config.max_num_batched_tokens),
                max(len(plan.batch), self.config.max_num_seqs),
                max(longest, self.buffers.block_tables.shape[1]),
            )
        pad_sizes = () if self.decode_graphs is None else self.decode_graphs.sizes
        inputs = step_inputs(self.block_manager, plan.batch, self.device, self.buffers, pad_sizes)
        self.kv_written = True  # from here on, blocks and tier slots taken this step may be overwritten
        with (
            contextlib.nullcontext()
            if self.executor is None
            else self.executor.execute_model(inputs, plan.blocks_to_copy)
        ):  # the other ranks run the same step
            self.apply_copies(plan)
            self.kv_connector.start_load_kv(self.kv_cache, plan.kv_connector_metadata)  # K/V computed elsewhere
            forward_started = time.perf_counter()
            self.last_prepare_time = forward_started - started
            if inputs.padded_size is None:
                logits = self.model.forward(
                    inputs.input_ids,
                    inputs.positions,
                    inputs.meta,
                    self.kv_cache,
                    inputs.logits_indices,
                    lora=lora_batch,
                )
            else:  # a decode batch padded to a captured size: its real rows' logits
                logits = self.decode_graphs.run(
                    inputs.padded_size, inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices
                )[: len(plan.batch)]
            self.last_forward_time = time.perf_counter() - forward_started
        if self.prefix_tier is not None:  # the step's new cached blocks, stored as computed
            self.prefix_tier.store(plan.cached_blocks)
        return logits, inputs.sampled, inputs.prompt_rows

    def apply_copies(self, plan) -> None:
        """The block copies the plan names, in the order they must happen (guide §15): first the reads of blocks
        freed this step (swap-out), then copy-on-write's private copies of shared blocks, then the writes of
        blocks coming back (swap-in, prefix-tier loads); all before the forward pass writes or reads any K/V."""
        if plan.blocks_to_swap_out:
            self.swap_space.tier.save(plan.blocks_to_swap_out)
        if plan.blocks_to_copy:
            sources, targets = zip(*plan.blocks_to_copy)
            self.kv_cache.copy_blocks(list(sources), list(targets))
        if plan.blocks_to_swap_in:
            self.swap_space.tier.load(plan.blocks_to_swap_in)
        if plan.blocks_to_load:
            self.prefix_tier.tier.load(plan.blocks_to_load)

    def sample(self, sampled: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each sequence appends: one sampled from its row, or 1..k + 1 from verifying its k drafts over
        its rows row..row + k. Changes no sequence (the scheduler's update does), only the generators' states."""
        plain = [i for i, (seq, _) in enumerate(sampled) if not seq.spec_token_ids]
        tokens = [None] * len(sampled)
        if plain:
            plain_rows = [sampled[i][1] for i in plain]
            if plain_rows != list(range(logits.shape[0])):  # forks share their parent's row; verifies take k + 1
                logits_plain = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
            else:
                logits_plain = logits  # [len(plain), vocab]
            seqs = [sampled[i][0] for i in plain]
            picked = sample(logits_plain, [seq.params for seq in seqs], [seq.generator for seq in seqs], self.generator)
            for i, token in zip(plain, picked):
                tokens[i] = [token]
        for i, (seq, row) in enumerate(sampled):
            if seq.spec_token_ids:
                tokens[i] = self.speculator.verify(
                    seq,
                    logits[row : row + 1 + len(seq.spec_token_ids)],  # [1 + k, vocab]
                    self.generator,
                )
                self.speculator.record(seq, tokens[i])
        return tokens

    def logprobs(
        self, sampled: list[tuple[Sequence, int]], tokens: list[list[int]], logits: torch.Tensor
    ) -> list[tuple[Sequence, list[dict[int, Logprob]]]]:
        """Each sequence whose params ask for logprobs, with one entry per token it is about to append: token j of
        a sequence came from its row + j (one row, or the rows that verified its drafts)."""
        wanted = [i for i, (seq, _) in enumerate(sampled) if seq.params.logprobs is not None]
        if not wanted:
            return []
        rows = [sampled[i][1] + j for i in wanted for j in range(len(tokens[i]))]
        flat = token_logprobs(
            logits.index_select(0, torch.tensor(rows, device=logits.device)),  # [len(rows), vocab]
            [token for i in wanted for token in tokens[i]],
            [sampled[i][0].params.logprobs for i in wanted for _ in tokens[i]],
        )
        entries = []
        for i in wanted:
            entries.append((sampled[i][0], flat[: len(tokens[i])]))
            flat = flat[len(tokens[i]) :]
        return entries

    def prompt_logprobs(
        self, prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor
    ) -> list[tuple[Request, list[dict[int, Logprob]]]]:
        """The prompt tokens this step's rows predict, scored for each request (a chunk's rows follow the ones
        before it: row first_row predicts prompt token len(request.prompt_logprobs) + 1)."""
        scored = []
        for seq, first_row, count in prompt_rows:
            request = seq.request
            position = len(request.prompt_logprobs)
            scored.append(
                (
                    request,
                    token_logprobs(
                        logits[first_row : first_row + count],  # [count, vocab]
                        request.prompt_token_ids[position + 1 : position + 1 + count],
                        [request.params.prompt_logprobs] * count,
                    ),
                )
            )
        return scored
