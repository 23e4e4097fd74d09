"""The engine (guide §11, §17): `LLMEngine.step()` = schedule -> execute the model -> update -> outputs.

    engine = LLMEngine(...); engine.add_request(engine.make_request(prompt, params))
    while engine.has_unfinished_requests(): engine.step()

`step()` returns the requests that finished (what `LLM.generate` waits for); `core_step()` returns as well every
sequence that gained tokens, which a server streams (vLLM V1's EngineCoreOutputs).

A step is vLLM V1's EngineCore step: the scheduler plans it (core/scheduler.py), the model runner runs it and
samples (engine/model_runner.py), the scheduler's update appends the tokens and ends what is done, and the output
processor decodes logprobs, finds stop strings and makes the RequestOutputs (engine/output_processor.py). The `LLM`
facade over it is engine/llm.py. A step happens whole or not at all (`LLMEngine.transaction`, its undo journal in
engine/journal.py): if anything in it raises (KeyboardInterrupt, an error while scheduling, in a forward observer, the forward pass, sampling, or
detokenizing), the engine is put back as it was before the step.
A KV connector (`kv_connector.py`, guide §15) is called at fixed points: the scheduler asks it what it can load when
it admits a request and whether to keep a finished request's blocks; the runner loads before the forward pass, and
the step saves what was kept after the update, which frees it.
"""

import contextlib
import dataclasses
import itertools
import time

import torch

from paged.config import EngineConfig
from paged.core.block_manager import BlockManager
from paged.core.scheduler import Scheduler
from paged.core.sequence import Request, RequestMetrics, RequestOutput, Sequence
from paged.engine.journal import StepJournal
from paged.engine.model_runner import ModelRunner
from paged.engine.output_processor import OutputProcessor
from paged.geometry import KVGeometry, dtype_bytes
from paged.kv_connector import KVConnector
from paged.lora import LoRAManager, LoRARequest
from paged.model.llama import PagedLlama
from paged.sampling_params import SamplingParams
from paged.speculative import Speculator
from paged.validation import ArgumentError, prompt_token_ids, real


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """The host's seconds in each part of one step (guide §11; benchmarks/host_time.py). On a CPU the forward pass
    is the device work itself; on a GPU the host only launches it there, and sampling first waits for it to end."""

    schedule: float  # drafts proposed, the scheduler's plan
    prepare: float  # the step's inputs built, block copies made
    forward: float  # the model's forward pass
    sample: float  # sampling, verifying drafts, logprobs
    finish: float  # the scheduler's update, the outputs (text, stop strings), the connector's saves

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.finish


@dataclasses.dataclass
class EngineCoreOutputs:
    """What one step did (vLLM V1's EngineCoreOutputs): each sequence that appended tokens, with how many (its
    last that many output tokens and log-probability entries are new), and the requests that finished."""

    new_tokens: list[tuple[Sequence, int]]
    finished: list[RequestOutput]


class LLMEngine:
    def __init__(
        self,
        model: PagedLlama,
        tokenizer=None,
        config: EngineConfig | None = None,
        *,
        clock=time.perf_counter,
        draft_model: PagedLlama | None = None,
        kv_connector: KVConnector | None = None,
        executor=None,
        **settings,
    ):
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
        self.config = config = config.for_model(
            model.max_position, model.vocab_size, eos_token_ids(model.config), num_blocks
        )
        self.model = model
        self.clock = clock  # seconds; a driver replaying a trace may pass a simulated clock
        self.device = model.device
        self.max_model_len = config.max_model_len
        self.eos_token_ids = config.eos_token_ids
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora = LoRAManager(model, config) if config.enable_lora else None
        self.kv_connector = kv_connector or KVConnector()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.speculator = (
            None
            if config.speculative is None
            else Speculator(config.speculative, draft_model, num_blocks, config.block_size)
        )  # guide §14
        self.executor = executor
        self.model_runner = ModelRunner(
            model, config, self.block_manager, self.generator, self.kv_connector, self.lora, self.speculator, executor
        )
        self.kv_cache = self.model_runner.kv_cache
        self.swap_space, self.prefix_tier = self.model_runner.swap_space, self.model_runner.prefix_tier
        self.scheduler = Scheduler(
            config, self.block_manager, self.swap_space, self.prefix_tier, self.device, self.kv_connector
        )
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids)  # holds the tokenizer
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self.num_steps = 0
        self.last_schedule = None
        self.last_step_times: StepTimes | None = None  # the last step's host seconds, part by part
        self.forward_observers = []  # callables(plan) run before each forward pass, for widgets and measurements
        self.journal = StepJournal(self)  # the step's undo log (guide §11)

    @property
    def tokenizer(self):
        """The tokenizer (None: prompts are token ids), held by the output processor, which detokenizes with it;
        make_request encodes prompts with it. Setting it sets both."""
        return self.output_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.output_processor.tokenizer = tokenizer

    # ---- requests in and out ----------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
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
            raise ArgumentError("request_id", f"request_id must be a string, got {type(request_id).__name__}")
        elif request_id in self.requests:
            raise ArgumentError("request_id", f"request_id {request_id!r} is already in use")
        if lora_request is not None:  # last: an adapter is registered only for a request that passed every check
            if self.lora is None:
                raise ValueError("lora_request needs an engine made with enable_lora=True")
            self.lora.resolve(lora_request)
        return Request(
            request_id,
            text,
            token_ids,
            params,
            RequestMetrics(arrival_time=self.clock()),
            cache_key=lora_request.cache_key if lora_request is not None else None,
            lora_request=lora_request,
        )

    def _next_request_id(self) -> str:
        """A fresh automatic id, skipping any a caller chose for a request still in flight."""
        while (request_id := str(next(self._request_counter))) in self.requests:
            pass
        return request_id

    def add_request(self, request: Request) -> str:
        """Queue a request made by make_request. One sequence prefills the prompt; with n > 1 it forks the
        other n - 1 when the prompt is done, and they all share the prompt's blocks (copy-on-write)."""
        if request.request_id in self.requests or request.seqs:
            raise ArgumentError(
                "request_id",
                f"request_id {request.request_id!r} is already in use (or the request "
                f"was added before); make a new request",
            )
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
        self.model_runner.config = self.config  # its input buffers grow on the first step that needs it

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
            raise ValueError(
                f"{caller} needs an idle engine: finish or abort its {len(self.requests)} request(s) in flight first"
            )

    # ---- one iteration ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample; returns the requests that finished.
        With speculation on, decoding sequences first propose draft tokens, which the forward pass verifies.
        A transaction: if anything in it raises, the engine is as it was before the step."""
        return self.core_step().finished

    def core_step(self) -> EngineCoreOutputs:
        """step(), returning as well each sequence that appended tokens in it: what a server streams."""
        with self.transaction():
            return self._step()

    def _step(self) -> EngineCoreOutputs:
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len, self.generator)
        plan = self.last_schedule = self.scheduler.schedule()  # kept for timelines and widgets
        if not plan.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    "the scheduler could not place any waiting sequence (a bug: requests are validated to fit the pool)"
                )
            return EngineCoreOutputs([], [])
        self.begin_forward(plan)
        scheduled = time.perf_counter()
        output = self.model_runner.execute_model(plan, self.scheduler.running)
        executed = time.perf_counter()
        num_before = [len(seq.output_token_ids) for seq in output.seqs]  # a fork's child has none yet
        finished = self.scheduler.update_from_output(
            plan, list(zip(output.seqs, output.sampled_token_ids)), now=self.clock()
        )
        stopped = self.output_processor.process_outputs(output)
        self.scheduler.abort([seq for seq, _ in stopped if not seq.is_finished])  # their blocks go back now
        for seq, stop in stopped:
            seq.finish_reason, seq.stop_reason = "stop", stop
        self.kv_connector.wait_for_save(self.kv_cache)  # the blocks of requests handed over, saved and freed
        self.scheduler.update_from_kv_xfer_finished(self.kv_connector.get_finished())
        self._release_drafts()
        finished = list(finished) + [seq for seq, _ in stopped]
        outputs = [
            self._finish_request(request)
            for request in {seq.request.request_id: seq.request for seq in finished}.values()
            if request.is_finished
        ]
        new_tokens = [
            (seq, num_new)
            for seq, before in zip(output.seqs, num_before)
            if (num_new := len(seq.output_token_ids) - before)
        ]
        runner = self.model_runner
        self.last_step_times = StepTimes(
            scheduled - started,
            runner.last_prepare_time,
            runner.last_forward_time,
            runner.last_sample_time,
            time.perf_counter() - executed,
        )
        return EngineCoreOutputs(new_tokens, outputs)

    def begin_forward(self, plan) -> None:
        """What the engine records as a plan's forward pass begins (step, and each step of a beam search):
        the step count, the forward observers' view of it, each request's first scheduled time."""
        self.num_steps += 1
        for observe in self.forward_observers:  # the tables are as this step uses them, copies made or queued
            observe(plan)
        now = self.clock()
        for seq, _ in plan.scheduled:
            seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now

    @contextlib.contextmanager
    def transaction(self):
        """Whatever runs inside happens whole or not at all: if it raises (KeyboardInterrupt included), the engine
        is put back as it was when it began, and the exception goes on (engine/journal.py says what is put back).
        step() is one; each step of a beam search too."""
        self.journal.begin()
        try:
            yield
        except BaseException:
            self.journal.rollback()
            raise
        self.journal.commit()

    def _release_drafts(self) -> None:
        if self.speculator is not None:
            self.speculator.release({seq.seq_id for seq in self.scheduler.running})

    def spec_stats(self) -> dict:
        """Speculative decoding's counts (vLLM's names); all zero when speculation is off."""
        if self.speculator is None:
            return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
        return self.speculator.stats()

    def _finish_request(self, request: Request) -> RequestOutput:
        request.metrics.finished_time = self.clock()
        del self.requests[request.request_id]
        return self.output_processor.make_request_output(request)

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


def eos_token_ids(config) -> frozenset[int]:
    """The config's end-of-sequence token ids: one id, a list of them (Llama 3 has several), or none."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def model_geometry(model: PagedLlama) -> KVGeometry:
    """The K/V layout of a model's pool (for one rank's shard: its KV heads)."""
    return KVGeometry(
        num_layers=len(model.layers),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        element_bytes=dtype_bytes(model.dtype),
        num_attention_heads=model.num_heads,
    )


def pool_blocks(geometry: KVGeometry, kv_cache_memory, block_size) -> int:
    """How many blocks kv_cache_memory bytes of K/V pool hold for this layout."""
    budget = real("kv_cache_memory", kv_cache_memory)
    block_bytes = geometry.block_bytes(block_size)
    if budget < block_bytes:
        raise ValueError(
            f"kv_cache_memory ({budget:.0f} bytes) must hold at least one KV block of {block_bytes} "
            f"bytes (block_size {block_size}); raise it, or give num_blocks"
        )
    return geometry.pool_blocks(int(budget), block_size)
