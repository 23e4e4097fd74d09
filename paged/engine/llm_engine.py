"""The engine (guide §11, §17): `LLMEngine.step()` = schedule -> execute -> sample -> update, and the `LLM` facade.

    engine = LLMEngine(...); engine.add_request(prompt, params); while engine.has_unfinished_requests(): engine.step()

`LLM.generate` does exactly that for a list of prompts, with a progress bar. Every request is validated before
anything is queued, so a bad prompt raises a `ValueError` and leaves the engine as it was. A step happens whole or
not at all (`LLMEngine.transaction`): if anything in it raises (KeyboardInterrupt, an error while scheduling, in a
forward observer, the forward pass, sampling, or detokenizing), the engine is put back as it was before the step.
A KV connector (`kv_connector.py`, guide §15) is called at fixed points: the scheduler asks it what it can load when
it admits a request and whether to keep a finished request's blocks; the step loads before the forward pass, and saves
what was kept after the update, which frees it.
"""

import contextlib
import dataclasses
import itertools
import os
import time

import torch
from tqdm.auto import tqdm

from paged.config import DEFAULT_KV_CACHE_MEMORY, SETTINGS, EngineConfig
from paged.core.block_manager import BlockManager
from paged.core.scheduler import Scheduler
from paged.core.sequence import CompletionOutput, Request, RequestMetrics, RequestOutput, Sequence
from paged.engine.kv_cache import KVCache
from paged.engine.model_inputs import step_inputs
from paged.engine.multiproc_executor import MultiprocExecutor, Worker
from paged.engine.sampler import decode_logprobs, sample, token_logprobs
from paged.engine.stop_strings import check_stop_strings
from paged.geometry import KVGeometry, dtype_bytes
from paged.kv_connector import KVConnector
from paged.lora import LoRAManager, LoRARequest
from paged.model.attention_backends import default_attention_backend
from paged.model.llama import PagedLlama
from paged.model.loader import load_model, model_config
from paged.model.tensor_parallel import check_tensor_parallel
from paged.sampling_params import SamplingParams
from paged.speculative import Speculator, resolve_draft
from paged.validation import as_prompt_list, prompt_token_ids, real


class LLMEngine:
    def __init__(self, model: PagedLlama, tokenizer=None, config: EngineConfig | None = None, *,
                 clock=time.perf_counter, draft_model: PagedLlama | None = None,
                 kv_connector: KVConnector | None = None, executor=None, **settings):
        """config: the engine's settings (EngineConfig), or the same as keyword arguments (block_size=16, ...).
        draft_model: the draft for speculative_config's method "draft_model" (resolve_draft makes it).
        kv_connector: where K/V come from or go to besides this pool (kv_connector.py; None: nowhere).
        executor: the other ranks of a tensor-parallel model (engine/multiproc_executor.py), model being rank 0's shard:
        each step is sent to them, and their pools hold as many blocks as this one."""
        if config is None:
            config = EngineConfig(**settings)
        elif settings:
            raise ValueError(f"give config or its settings ({', '.join(sorted(settings))}), not both")
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = pool_blocks(model_geometry(model), config.kv_cache_memory, config.block_size)
        self.config = config = config.for_model(model.max_position, model.vocab_size,
                                                eos_token_ids(model.config), num_blocks)
        self.model = model
        self.clock = clock  # seconds; a driver replaying a trace may pass a simulated clock
        self.tokenizer = tokenizer
        self.device = model.device
        self.max_model_len = config.max_model_len
        self.eos_token_ids = config.eos_token_ids
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_cache = KVCache(len(model.layers), model.num_kv_heads, model.head_dim, num_blocks, config.block_size,
                                dtype=model.dtype, device=self.device)
        self.swap_space, self.prefix_tier = config.offload.build(self.block_manager, self.kv_cache)  # guide §15
        self.lora = LoRAManager(model, config) if config.enable_lora else None
        self.kv_connector = kv_connector or KVConnector()
        self.scheduler = Scheduler(config, self.block_manager, self.swap_space, self.prefix_tier, self.device,
                                   self.kv_connector)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self._kv_written = False  # within a step: K/V tensors have been written (transaction)
        self.num_steps = 0
        self.last_schedule = None
        self.last_forward_time = 0.0  # seconds the last step spent in the model's forward pass (host time)
        self.forward_observers = []  # callables(plan) run before each forward pass, for widgets and measurements
        self.speculator = None if config.speculative is None else \
            Speculator(config.speculative, draft_model, num_blocks, config.block_size)  # guide §14
        self.executor = executor
        if executor is not None:
            executor.local_worker = Worker(executor.group, model, self.kv_cache)
            executor.initialize_cache(num_blocks, config.block_size)

    # ---- requests in and out ----------------------------------------------------------------------------

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Tokenize and validate one prompt; raises ValueError and changes nothing if it cannot be served.
        With lora_request the request runs under that adapter, read and checked here the first time it is seen.
        params.prompt_logprobs=N: the output's prompt_logprobs give each prompt token's log-probability given the
        tokens before it, and the N most likely tokens there (vLLM's prompt_logprobs). Only a prefill computes those,
        so such a request does not read the prefix cache (params.skip_reading_prefix_cache, as in vLLM); the
        blocks it fills are still cached for other requests."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        token_ids = prompt_token_ids(prompt, self.tokenizer)
        text = prompt if isinstance(prompt, str) else None
        self.config.check_prompt(token_ids, params.max_tokens, params.n)
        if request_id is None:
            request_id = self._next_request_id()
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None:  # last: an adapter is registered only for a request that passed every check
            if self.lora is None:
                raise ValueError("lora_request needs an engine made with enable_lora=True")
            self.lora.resolve(lora_request)
        return Request(request_id, text, token_ids, params, RequestMetrics(arrival_time=self.clock()),
                       cache_key=lora_request.cache_key if lora_request is not None else None,
                       lora_request=lora_request)

    def _next_request_id(self) -> str:
        """A fresh automatic id, skipping any a caller chose for a request still in flight."""
        while (request_id := str(next(self._request_counter))) in self.requests:
            pass
        return request_id

    def add_request(self, request: Request) -> str:
        """Queue a request made by make_request. One sequence prefills the prompt; with n > 1 it forks the
        other n - 1 when the prompt is done, and they all share the prompt's blocks (copy-on-write)."""
        if request.request_id in self.requests or request.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use (or the request was added "
                             f"before); make a new request")
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool at once. An unknown or finished id is ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.abort([seq for seq in request.seqs if not seq.is_finished])
        self._release_drafts()

    def abort_sequence(self, request_id: str, index: int) -> None:
        """Stop one completion of a request now (its caller found a stop string in the text); its blocks return to
        the pool at once, and the request ends with its last completion. An unknown or finished one is ignored."""
        request = self.requests.get(request_id)
        seqs = [seq for seq in request.seqs if seq.index == index and not seq.is_finished] if request else []
        if not seqs:
            return
        self.scheduler.abort(seqs)
        self._release_drafts()
        if request.is_finished:
            del self.requests[request_id]

    def set_max_num_batched_tokens(self, value: int) -> None:
        """The token budget of the steps to come, checked as any setting (a server sizes it for the machine once
        the model is loaded: serving/token_budget.py)."""
        self.config = dataclasses.replace(self.config, max_num_batched_tokens=value)
        self.scheduler.config = self.config
        self.scheduler.max_num_batched_tokens = self.config.max_num_batched_tokens

    def check_health(self) -> None:
        """A RuntimeError saying why, if the engine can no longer run a step (a tensor-parallel worker died)."""
        if self.executor is not None:
            self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def require_idle(self, caller: str) -> None:
        """Drivers that step the engine for their own requests (generate, beam search, replay) need it to
        themselves, or other callers' outputs would be taken by them."""
        if self.has_unfinished_requests():
            raise ValueError(f"{caller} needs an idle engine: finish or abort its {len(self.requests)} "
                             f"request(s) in flight first")

    # ---- one iteration ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample; returns the requests that finished.
        With speculation on, decoding sequences first propose draft tokens, which the forward pass verifies.
        A transaction: if anything in it raises, the engine is as it was before the step."""
        with self.transaction():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len, self.generator)
        plan = self.last_schedule = self.scheduler.schedule()  # kept for timelines and widgets
        if not plan.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any waiting sequence (a bug: requests are "
                                   "validated to fit the pool)")
            return []
        logits, sampled, prompt_rows = self.execute(plan)
        self._prompt_logprobs(prompt_rows, logits)
        row_of = {seq.seq_id: row for seq, row in sampled}
        sampled += [(child, row_of[parent.seq_id]) for parent, child in plan.forks]  # forks sample from its row
        tokens = self._sample(sampled, logits)
        logprobs = self._logprobs(sampled, tokens, logits)
        finished = self.scheduler.update_from_output(plan, list(zip([seq for seq, _ in sampled], tokens)),
                                                     now=self.clock())
        finished = list(finished) + self._stop_at_stop_strings(sampled, tokens)
        for seq, entries in logprobs:  # as many as the update appended (a stop may cut a verify short)
            seq.logprobs += entries[:seq.num_tokens - seq.num_prompt_tokens - len(seq.logprobs)]
        self.kv_connector.wait_for_save(self.kv_cache)  # the blocks of requests handed over, saved and freed
        self.scheduler.update_from_kv_xfer_finished(self.kv_connector.get_finished())
        self._release_drafts()
        return [self._finish_request(request) for request in {seq.request.request_id: seq.request
                                                              for seq in finished}.values()
                if request.is_finished]

    @contextlib.contextmanager
    def transaction(self):
        """Whatever runs inside happens whole or not at all: if it raises (KeyboardInterrupt included), the engine
        is put back as it was when it began, and the exception goes on. Put back: the requests in flight, their
        sequences and metrics, the scheduler's queues, the block manager (tables, ref counts, free blocks, the
        prefix cache's names), the tiers' indexes, the draft pool, the LoRA slots, the KV connector's queues, the
        sampling generators and every count. K/V tensors are not copied: a step writes past the computed tokens of
        every sequence it began with, except in blocks and tier slots it took for fresh use. If it got as far as
        writing, those lose their cached names, and a sequence it preempted whose blocks it gave to another is
        recomputed.
        step() is one; each step of a beam search too."""
        saved = self._begin()
        try:
            yield
        except BaseException:
            self._rollback(saved)
            raise
        self._commit()

    def _begin(self) -> tuple:
        self.block_manager.begin()
        for part in (self.swap_space, self.prefix_tier, self.speculator, self.kv_connector):
            if part is not None:
                part.begin()
        self._kv_written = False
        lora = None if self.lora is None else (self.lora.num_steps, list(self.lora.slots.slot_ids),
                                               list(self.lora.slots.last_used), self.lora.slots.num_loads,
                                               self.lora.slots.num_evictions)
        touched = {seq.request.request_id: seq.request for seq in self.scheduler.may_change()}
        return (dict(self.requests), [(request, request.checkpoint()) for request in touched.values()],
                self.scheduler.checkpoint(), self.generator.get_state(), self.num_steps, self.last_schedule, lora)

    def _commit(self) -> None:
        self.block_manager.commit()
        for part in (self.swap_space, self.prefix_tier, self.speculator, self.kv_connector):
            if part is not None:
                part.commit()

    def _rollback(self, saved: tuple) -> None:
        self.requests, request_states, scheduler_state, generator_state, self.num_steps, self.last_schedule, \
            lora = saved
        for request, state in request_states:
            request.restore(state)
        lost = set(self.block_manager.rollback(self._kv_written))  # sequences whose K/V the step overwrote
        if self.swap_space is not None:
            lost.update(self.swap_space.rollback(self._kv_written))
        if self.prefix_tier is not None:
            self.prefix_tier.rollback(self._kv_written)
        if self.speculator is not None:
            self.speculator.rollback()
        self.kv_connector.rollback()
        self.scheduler.restore(scheduler_state, lost)
        self.generator.set_state(generator_state)
        if lora is not None:
            self._restore_lora_slots(*lora)

    def _restore_lora_slots(self, num_steps, slot_ids, last_used, num_loads, num_evictions) -> None:
        """The adapters each slot held before the undone step: one it replaced is loaded again from the host."""
        slots = self.lora.slots
        for slot, lora_id in enumerate(slot_ids):
            if slots.slot_ids[slot] != lora_id:
                if lora_id is None:
                    slots.slot_ids[slot] = None     # empty again: whatever it holds is never read
                else:
                    slots.load(self.lora.registry[lora_id], slot)
        self.lora.num_steps, slots.last_used, slots.num_loads, slots.num_evictions = \
            num_steps, last_used, num_loads, num_evictions

    def _sample(self, sampled: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each sequence appends: one sampled from its row, or 1..k + 1 from verifying its k drafts over
        its rows row..row + k. Changes no sequence (the scheduler's update does), only the generators' states."""
        plain = [i for i, (seq, _) in enumerate(sampled) if not seq.spec_token_ids]
        tokens = [None] * len(sampled)
        if plain:
            plain_rows = [sampled[i][1] for i in plain]
            if plain_rows != list(range(logits.shape[0])):  # forks share their parent's row; verifies take k + 1
                logits_plain = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
            else:
                logits_plain = logits
            seqs = [sampled[i][0] for i in plain]
            picked = sample(logits_plain, [seq.params for seq in seqs], [seq.generator for seq in seqs],
                            self.generator)
            for i, token in zip(plain, picked):
                tokens[i] = [token]
        for i, (seq, row) in enumerate(sampled):
            if seq.spec_token_ids:
                tokens[i] = self.speculator.verify(seq, logits[row:row + 1 + len(seq.spec_token_ids)],  # [1 + k, vocab]
                                                   self.generator)
                self.speculator.record(seq, tokens[i])
        return tokens

    def _logprobs(self, sampled: list[tuple[Sequence, int]], tokens: list[list[int]],
                  logits: torch.Tensor) -> list[tuple[Sequence, list[dict]]]:
        """Each sequence whose params ask for logprobs, with one entry per token it is about to append: token j of
        a sequence came from its row + j (one row, or the rows that verified its drafts)."""
        wanted = [i for i, (seq, _) in enumerate(sampled) if seq.params.logprobs is not None]
        if not wanted:
            return []
        rows = [sampled[i][1] + j for i in wanted for j in range(len(tokens[i]))]
        flat = token_logprobs(logits.index_select(0, torch.tensor(rows, device=logits.device)),  # [len(rows), vocab]
                              [token for i in wanted for token in tokens[i]],
                              [sampled[i][0].params.logprobs for i in wanted for _ in tokens[i]])
        decode_logprobs(flat, self.tokenizer)
        entries = []
        for i in wanted:
            entries.append((sampled[i][0], flat[:len(tokens[i])]))
            flat = flat[len(tokens[i]):]
        return entries

    def _stop_at_stop_strings(self, sampled: list[tuple[Sequence, int]], tokens: list[list[int]]) -> list[Sequence]:
        """The sequences whose new text completes one of their stop strings (engine/stop_strings.py): each ends with
        finish_reason "stop" and the string as its stop_reason; one still running gives its blocks back now."""
        stopped = []
        for (seq, _), new_tokens in zip(sampled, tokens):
            if not seq.params.stop or seq.stop_reason is not None:
                continue
            output = seq.output_token_ids
            text = self._decode(output)
            before = self._decode(output[:max(0, len(output) - len(new_tokens))])
            new_char_count = len(text) - len(os.path.commonprefix([before, text]))
            found = check_stop_strings(text, new_char_count, seq.params.stop, seq.params.include_stop_str_in_output)
            if found is None:
                continue
            if not seq.is_finished:
                self.scheduler.abort([seq])
            seq.finish_reason, seq.stop_reason = "stop", found[0]
            stopped.append(seq)
        return stopped

    def _prompt_logprobs(self, prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
        """Score the prompt tokens this step's rows predict, onto each request's prompt_logprobs (in order: a
        chunk's rows follow the ones before it)."""
        for seq, first_row, count in prompt_rows:
            request = seq.request
            position = len(request.prompt_logprobs)     # row first_row predicts prompt token position + 1
            entries = token_logprobs(logits[first_row:first_row + count],                  # [count, vocab]
                                     request.prompt_token_ids[position + 1:position + 1 + count],
                                     [request.params.prompt_logprobs] * count)
            decode_logprobs(entries, self.tokenizer)
            request.prompt_logprobs += entries

    def _release_drafts(self) -> None:
        if self.speculator is not None:
            self.speculator.release({seq.seq_id for seq in self.scheduler.running})

    def spec_stats(self) -> dict:
        """Speculative decoding's counts (vLLM's names); all zero when speculation is off."""
        if self.speculator is None:
            return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                    "num_accepted_tokens_per_pos": []}
        return self.speculator.stats()

    def execute(self, plan) -> tuple[torch.Tensor, list[tuple[Sequence, int]], list[tuple[Sequence, int, int]]]:
        """Run the scheduled tokens through the model. Returns the logits [rows, vocab], the sequences whose
        next token is due, each with its first row (one row, or 1 + k to verify k drafts), in row order, and the
        rows that predict prompt tokens for prompt logprobs (StepInputs.prompt_rows); the
        caller samples (step) or searches (beam_search), then hands the result to the scheduler's update, inside
        a transaction that undoes the step if anything fails. Changes no sequence."""
        self.num_steps += 1
        for observe in self.forward_observers:  # the tables are as this step uses them, copies made or queued
            observe(plan)
        now = self.clock()
        for seq, _ in plan.scheduled:
            seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now
        lora_batch = None
        if self.lora is not None:  # the adapters of plan.batch made resident (guide §16)
            _, lora_batch = self.lora.prepare_step(plan.batch, self.scheduler.running)
        inputs = step_inputs(self.block_manager, plan.batch, self.device)
        self._kv_written = True  # from here on, blocks and tier slots taken this step may be overwritten
        with contextlib.nullcontext() if self.executor is None else \
                self.executor.execute_model(inputs, plan.blocks_to_copy):   # the other ranks run the same step
            self.apply_copies(plan)
            self.kv_connector.start_load_kv(self.kv_cache, plan.kv_connector_metadata)  # K/V computed elsewhere
            started = time.perf_counter()
            logits = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                                        inputs.logits_indices, lora=lora_batch)
            self.last_forward_time = time.perf_counter() - started
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

    def _finish_request(self, request: Request) -> RequestOutput:
        request.metrics.finished_time = self.clock()
        del self.requests[request.request_id]
        return self.output_of(request)

    def output_of(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            output = CompletionOutput(seq.index, self._text(seq), list(seq.output_token_ids), seq.finish_reason,
                                      stop_reason=self._stop_reason(seq))
            if seq.params.logprobs is not None:
                output.logprobs = list(seq.logprobs)
                output.cumulative_logprob = sum(entry[token].logprob
                                                for entry, token in zip(seq.logprobs, seq.output_token_ids))
            outputs.append(output)
        prompt_logprobs = None if request.params.prompt_logprobs is None else [None, *request.prompt_logprobs]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.is_finished, request.metrics, prompt_logprobs)

    def _text(self, seq: Sequence) -> str:
        """A completion's text; one a stop string ended is cut before it (after it with include_stop_str_in_output)."""
        text = self._decode(seq.output_token_ids)
        if seq.stop_reason is None:
            return text
        return text[:check_stop_strings(text, len(text), [seq.stop_reason], seq.params.include_stop_str_in_output)[1]]

    def _stop_reason(self, seq: Sequence) -> str | int | None:
        """vLLM's stop_reason: the stop string that ended the completion, or its stop token id; None after EOS."""
        if seq.stop_reason is not None or seq.finish_reason != "stop":
            return seq.stop_reason
        last = seq.output_token_ids[-1]
        ended_by_eos = last in self.eos_token_ids and not seq.params.ignore_eos
        return last if last in seq.params.stop_token_ids and not ended_by_eos else None

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
            "num_swapped": len(self.scheduler.swapped),
            "swap_out_blocks": self.swap_space.swap_out_blocks if self.swap_space else 0,
            "swap_in_blocks": self.swap_space.swap_in_blocks if self.swap_space else 0,
            "offload_stored_blocks": self.prefix_tier.stored_blocks if self.prefix_tier else 0,
            "offload_hit_tokens": self.prefix_tier.hit_tokens if self.prefix_tier else 0,
        }


def check_tensor_parallel_settings(config: EngineConfig, kv_connector) -> None:
    """The features a tensor-parallel engine does not run, refused by name: each keeps K/V or weights of its own
    (a draft model, adapters, tiers, a connector) that would have to be split across the ranks as well."""
    refused = {"speculative_config": config.speculative is not None, "enable_lora": config.enable_lora,
               "preemption_mode='swap'": config.preemption_mode == "swap",
               "kv_offloading_size": config.kv_offloading_size is not None, "kv_connector": kv_connector is not None}
    for name, given in refused.items():
        if given:
            raise ValueError(f"{name} cannot be used with tensor_parallel_size > 1: the engine splits only the "
                             f"model and its KV pool across ranks")


def eos_token_ids(config) -> frozenset[int]:
    """The config's end-of-sequence token ids: one id, a list of them (Llama 3 has several), or none."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def model_geometry(model: PagedLlama) -> KVGeometry:
    """The K/V layout of a model's pool (for one rank's shard: its KV heads)."""
    return KVGeometry(num_layers=len(model.layers), num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                      element_bytes=dtype_bytes(model.dtype), num_attention_heads=model.num_heads)


def pool_blocks(geometry: KVGeometry, kv_cache_memory, block_size) -> int:
    """How many blocks kv_cache_memory bytes of K/V pool hold for this layout."""
    budget = real("kv_cache_memory", kv_cache_memory)
    block_bytes = geometry.block_bytes(block_size)
    if budget < block_bytes:
        raise ValueError(f"kv_cache_memory ({budget:.0f} bytes) must hold at least one KV block of {block_bytes} "
                         f"bytes (block_size {block_size}); raise it, or give num_blocks")
    return geometry.pool_blocks(int(budget), block_size)


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

    def __init__(self, model="smollm2", tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY, enable_prefix_caching: bool = False,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = False,
                 preemption_mode: str = "recompute", attention_backend: str | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None, seed: int = 0,
                 speculative_config: dict | None = None, swap_space: float = 1.0,
                 kv_offloading_size: float | None = None, kv_offload_dir: str | None = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 config: EngineConfig | None = None, kv_connector=None, tensor_parallel_size: int = 1):
        """config: every engine setting at once (a disaggregation worker gets it so), in place of the keywords.
        kv_connector: a KVProducer or KVConsumer (kv_connector.py), as disaggregation's workers use."""
        arguments = locals()
        config = config or EngineConfig(**{name: arguments[name] for name in SETTINGS})  # checks them all
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(config.seed)
        backend = attention_backend or default_attention_backend(device)
        executor = None
        if tensor_parallel_size != 1:
            check_tensor_parallel_settings(config, kv_connector)
            check_tensor_parallel(model_config(model), tensor_parallel_size)
            executor = MultiprocExecutor.start(tensor_parallel_size, model, dtype, device, backend)
        try:
            target, tokenizer = load_model(model, tokenizer, device, dtype, backend,
                                           tensor_parallel=None if executor is None else executor.group)
            draft = None
            if config.speculative is not None and config.speculative.method == "draft_model":
                draft = resolve_draft(config.speculative, target, backend)
            self.engine = LLMEngine(target, tokenizer, config, draft_model=draft, kv_connector=kv_connector,
                                    executor=executor)
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

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list | None = None) -> list[RequestOutput]:
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
            raise ValueError(f"lora_request must be a LoRARequest, None, or a list of one per prompt "
                             f"({len(prompts)}), got {lora_request!r}")
        engine = self.engine
        engine.require_idle("generate")
        with engine.lora.transaction() if engine.lora is not None else contextlib.nullcontext():
            requests = [engine.make_request(p, sp, lora_request=lr)  # validate all first
                        for p, sp, lr in zip(prompts, sampling_params, lora_request)]
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
        return {kind: str(space.tier.path) for kind, space in tiers.items()
                if space is not None and space.tier.path is not None}

    def spec_stats(self) -> dict:
        return self.engine.spec_stats()

    def lora_stats(self) -> dict:
        """The adapters registered, the slots' contents, loads and evictions (guide §16); needs enable_lora=True."""
        if self.engine.lora is None:
            raise ValueError("lora_stats needs an engine made with enable_lora=True")
        return self.engine.lora.stats()
