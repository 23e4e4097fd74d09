"""Requests and sequences (guide §10, §11).

A request is one prompt with its sampling parameters; it owns one sequence per completion (`n` of them).
A sequence is a growing list of token ids plus how many of them already have K/V in the pool
(`num_computed_tokens`): the scheduler only ever asks "how many tokens does it still need to compute?", which
covers a fresh prompt, a chunk of one, a decode step, and a sequence recomputed after preemption.
"""

import enum
from dataclasses import dataclass, field

import torch

from paged.sampling_params import Logprob, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its K/V copied out to the swap tier (guide §15)
    FINISHED = "finished"


@dataclass(frozen=True)
class SequenceState:
    """A sequence as an engine step found it (Sequence.checkpoint): the lists a step only appends to, by length."""

    num_tokens: int
    num_logprobs: int
    num_computed_tokens: int
    status: SequenceStatus
    finish_reason: str | None
    stop_reason: str | None
    num_preemptions: int
    spec_token_ids: list[int]
    spec_draft_probs: torch.Tensor | None
    generator_state: torch.Tensor | None  # a seeded sequence's generator, else None


@dataclass(frozen=True)
class MetricsState:
    """A request's metrics as an engine step found them (RequestMetrics.checkpoint)."""

    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_draft_tokens: int
    num_accepted_tokens: int
    num_token_times: int


@dataclass(frozen=True)
class RequestState:
    """A request as an engine step found it (Request.checkpoint): its sequences then, each one's state."""

    num_seqs: int
    seqs: tuple[SequenceState, ...]
    num_prompt_logprobs: int
    metrics: MetricsState


class Sequence:
    def __init__(self, seq_id: int, request: "Request", index: int, generator: torch.Generator | None):
        self.seq_id = seq_id
        self.request = request
        self.index = index  # which of the request's n completions
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" (EOS, a stop token or a stop string), "length" or "abort"
        self.stop_reason: str | None = None  # the stop string that ended it (params.stop), if one did
        self.generator = generator  # seeded: its n-th draw is output position n's noise (engine/sampler.py)
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step, not yet verified
        self.spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab] draft's q, when sampled
        #                                                     with the engine's generator (no seed)
        self.logprobs: list[dict[int, Logprob]] = []  # one per output token, when params.logprobs asks for them

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_waiting(self) -> bool:
        return self.status is SequenceStatus.WAITING

    @property
    def num_seats(self) -> int:
        """Running sequences this one will count for: itself and the completions still to fork from it."""
        return 1 + self.params.n - len(self.request.seqs)

    def checkpoint(self) -> "SequenceState":
        """What an undone engine step puts back (engine/journal.py). A step only appends to token_ids and
        logprobs, so their counts are enough; a seeded generator's state is kept too: it has drawn one noise per
        output token, so after the undone step it draws the same positions' noise again."""
        return SequenceState(
            len(self.token_ids),
            len(self.logprobs),
            self.num_computed_tokens,
            self.status,
            self.finish_reason,
            self.stop_reason,
            self.num_preemptions,
            list(self.spec_token_ids),
            self.spec_draft_probs,
            None if self.generator is None else self.generator.get_state(),
        )

    def restore(self, record: "SequenceState") -> None:
        del self.token_ids[record.num_tokens :]
        del self.logprobs[record.num_logprobs :]
        self.num_computed_tokens, self.status = record.num_computed_tokens, record.status
        self.finish_reason, self.stop_reason = record.finish_reason, record.stop_reason
        self.num_preemptions = record.num_preemptions
        self.spec_token_ids, self.spec_draft_probs = list(record.spec_token_ids), record.spec_draft_probs
        if record.generator_state is not None:
            self.generator.set_state(record.generator_state)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )


@dataclass
class RequestMetrics:
    """Times of one request's life, in seconds of the engine's clock (time.perf_counter unless a driver
    replaying a trace supplies its own)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative tokens proposed for this request (guide §14)
    num_accepted_tokens: int = 0  # of those, the ones the target accepted
    token_times: list[float] = field(default_factory=list)  # when each output token was appended

    def checkpoint(self) -> "MetricsState":
        return MetricsState(
            self.first_scheduled_time,
            self.first_token_time,
            self.finished_time,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            len(self.token_times),
        )

    def restore(self, record: "MetricsState") -> None:
        self.first_scheduled_time, self.first_token_time = record.first_scheduled_time, record.first_token_time
        self.finished_time = record.finished_time
        self.num_draft_tokens, self.num_accepted_tokens = record.num_draft_tokens, record.num_accepted_tokens
        del self.token_times[record.num_token_times :]

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    cache_key: object = None  # extra key mixed into prefix-cache hashes: LoRARequest.cache_key, or None
    lora_request: object = None  # the paged.lora.LoRARequest it runs under, or None for the base model (guide §16)
    kv_transfer_params: dict | None = None  # what a KV connector reads (kv_connector.py): {"do_remote_decode": True}
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # prompt tokens 1.., as prefilled
    # (when params.prompt_logprobs asks for them)
    num_cached_tokens: int = 0  # prompt tokens whose K/V were found cached when it was last admitted

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def checkpoint(self) -> "RequestState":
        """Its sequences (those forked later are dropped on restore), prompt logprobs and metrics, for the engine
        step's journal (engine/journal.py)."""
        return RequestState(
            len(self.seqs),
            tuple(seq.checkpoint() for seq in self.seqs),
            len(self.prompt_logprobs),
            self.metrics.checkpoint(),
        )

    def restore(self, record: "RequestState") -> None:
        del self.seqs[record.num_seqs :]
        del self.prompt_logprobs[record.num_prompt_logprobs :]
        for seq, seq_record in zip(self.seqs, record.seqs):
            seq.restore(seq_record)
        self.metrics.restore(record.metrics)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None  # one per token, when SamplingParams.logprobs asked
    cumulative_logprob: float | None = None  # the sum of the chosen tokens' log-probabilities
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # when asked: None, then one per prompt token
