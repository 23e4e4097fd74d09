"""Serving metrics and the online driver (guide §13): TTFT, TPOT, end-to-end latency, goodput under an SLO.

A server is judged request by request:
    TTFT  time to first token    = first_token_time - arrival_time          (queueing + prefill)
    TPOT  time per output token  = (finished_time - first_token_time) / (num_output_tokens - 1)   (decode pace)
    e2e   end-to-end latency     = finished_time - arrival_time = TTFT + TPOT * (num_output_tokens - 1)
    ITL   inter-token latency    = each gap between two output tokens (TPOT is their mean; a stall shows in the max)
and as a whole by goodput: requests per second that meet a service-level objective (TTFT <= a and TPOT <= b).
Throughput counts every request; goodput counts only the ones a user would call served.

`replay(engine, trace, rate)` is the online driver. It feeds a trace's requests to an LLMEngine as they arrive
(Poisson arrivals at `rate` requests/s) while stepping it, and returns what happened to every request and every
step. Time comes from one of two clocks:
  - "simulated" (the default): a clock that moves only when the driver moves it. Each step costs what a `StepCost`
    model says from the step's shape, and an idle engine jumps to the next arrival. When every request generates
    its trace length (`ignore_eos`), the scheduler's decisions depend only on lengths, so the same trace gives the
    same numbers on every run, on every machine, and with any model of the same context length.
  - "real": time.perf_counter, arrivals wait in real time; for benchmarks, and to measure a StepCost.
Both start at 0 when the replay starts.
"""

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from .engine import LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput
from .step_cost import SMOLLM2_CPU, StepCost
from .traces import TraceRequest

# ---- one request ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    """One request's life in seconds of the replay's clock, with its lengths."""
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    token_times: tuple[float, ...] = ()   # when each output token appeared, if a driver watched
    num_preemptions: int = 0

    @classmethod
    def from_output(cls, output: RequestOutput, token_times=(), num_preemptions: int = 0) -> "RequestRecord":
        m = output.metrics
        return cls(output.request_id, len(output.prompt_token_ids), max(len(c.token_ids) for c in output.outputs),
                   m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                   tuple(token_times), num_preemptions)

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean gap between output tokens after the first; None for a one-token answer (it has no gap)."""
        if self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: each gap between consecutive output tokens (TPOT is their mean)."""
        return np.diff(self.token_times).tolist()


# ---- many requests ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    """A service-level objective in seconds: a request meets it if TTFT <= ttft, TPOT <= tpot and no gap between
    two of its output tokens exceeds itl (the time-between-tokens bound of Sarathi-Serve; it needs the token
    times a driver records)."""
    ttft: float = float("inf")
    tpot: float = float("inf")
    itl: float = float("inf")

    def met_by(self, record: RequestRecord) -> bool:
        return (record.ttft <= self.ttft and (record.tpot is None or record.tpot <= self.tpot)
                and max(record.itl, default=0.0) <= self.itl)


def percentiles(values, ps=(50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} with numpy's linear interpolation (as vLLM's benchmarks report)."""
    values = np.asarray(list(values), dtype=float)
    return {f"p{p}": float(np.percentile(values, p)) if values.size else float("nan") for p in ps}


def goodput(records: list[RequestRecord], duration: float, slo: SLO) -> float:
    """Requests per second that met the SLO."""
    return sum(slo.met_by(r) for r in records) / duration


def summarize(records: list[RequestRecord], duration: float, slo: SLO | None = None) -> dict:
    """The usual serving report: throughput, TTFT / TPOT / e2e mean, p50 and p99, worst inter-token gap, and
    with an SLO the share of requests that met it and the goodput."""
    tpots = [r.tpot for r in records if r.tpot is not None]
    itls = [gap for r in records for gap in r.itl]
    row = {"requests": len(records), "duration_s": duration,
           "throughput_rps": len(records) / duration,
           "output_tok_s": sum(r.num_output_tokens for r in records) / duration}
    for name, values in (("ttft", [r.ttft for r in records]), ("tpot", tpots),
                         ("e2e", [r.e2e_latency for r in records])):
        row[f"{name}_mean"] = float(np.mean(values)) if values else float("nan")
        row.update({f"{name}_{p}": v for p, v in percentiles(values, (50, 99)).items()})
    row["itl_max"] = max(itls, default=float("nan"))
    if slo is not None:
        row["slo_attainment"] = sum(slo.met_by(r) for r in records) / len(records)
        row["goodput_rps"] = goodput(records, duration, slo)
    return row


# ---- one step, and what it costs --------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the driver saw it, read from engine.last_schedule right after the step."""
    index: int
    start: float
    duration: float
    prefills: tuple[tuple[str, int], ...]   # (request_id, tokens): a prompt chunk, a whole prompt, or a recompute
    decodes: tuple[str, ...]                # request ids that computed their newest token and sampled the next
    preempted: tuple[str, ...]              # request ids this step's schedule sent back to waiting
    finished: tuple[str, ...]
    num_pairs: int                          # (query, key) pairs attention computed over all sequences

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + len(self.decodes)


# ---- the online driver ------------------------------------------------------------------------------------


class SimulatedClock:
    """engine.clock for a deterministic replay: it reads `now`, which only the driver moves."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


class WallClock:
    """engine.clock for a real-time replay: seconds of time.perf_counter since the replay started."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self()))


@dataclass
class ReplayResult:
    requests: list[RequestRecord]                   # in trace order
    outputs: list[RequestOutput]                    # in trace order
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def duration(self) -> float:
        """From the replay's start (time 0) to the last request's finish."""
        return max(r.finished_time for r in self.requests)

    def summary(self, slo: SLO | None = None) -> dict:
        return summarize(self.requests, self.duration, slo)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of a Poisson process at `rate` requests/s; float("inf") puts all at 0. The same seed at
    another rate gives the same arrivals stretched in time, so a rate sweep changes only the load."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0, size=num_requests)    # [num_requests], mean 1
    return np.cumsum(gaps) / rate


def trace_prompt(request: TraceRequest, vocab_size: int, seed: int = 0) -> list[int]:
    """Random token ids of the request's input length, the same for the same request and seed."""
    return np.random.default_rng([seed, request.request_id]).integers(0, vocab_size, request.input_len).tolist()


def read_step(engine: LLMEngine, index: int, start: float, duration: float,
              finished: list[RequestOutput]) -> StepRecord:
    """The StepRecord of the step that just ran, read from its plan (engine.last_schedule), in request ids."""
    plan = engine.last_schedule
    prefills, decodes, num_pairs = [], [], 0
    for seq, n in plan.scheduled:
        begin = plan.num_computed[seq.seq_id]        # the step computed positions [begin, begin + n)
        num_pairs += n * begin + n * (n + 1) // 2    # position p attends p + 1 keys
        if seq.seq_id in plan.decodes:
            decodes.append(seq.request.request_id)
        else:
            prefills.append((seq.request.request_id, n))
    return StepRecord(index, start, duration, tuple(prefills), tuple(decodes),
                      tuple(seq.request.request_id for seq in plan.preempted),
                      tuple(out.request_id for out in finished), num_pairs)


def replay(engine: LLMEngine, trace: list[TraceRequest], rate: float | None = None, *, clock: str = "simulated",
           step_cost: StepCost = SMOLLM2_CPU, static_batch_size: int | None = None,
           prompts: list[str | list[int]] | None = None, ignore_eos: bool = True, seed: int = 0) -> ReplayResult:
    """Serve `trace` online and report every request and step.

    rate: Poisson arrivals at this many requests/s (`poisson_arrivals`, seeded); None keeps the trace's own times.
    Each request asks for its trace output length (greedy, `ignore_eos` so that it gets exactly that many) of
    `prompts[i]` if given, else of random token ids of its input length.
    static_batch_size: None is continuous batching (every arrival goes straight to the engine, whose scheduler
    admits it at the next step); k is static batching: arrivals are handed over only when the engine is idle,
    at most k at a time, so a batch runs until its longest request is done.
    """
    if clock not in ("simulated", "real"):
        raise ValueError(f"clock must be 'simulated' or 'real', got {clock!r}")
    engine.require_idle("replay")
    if static_batch_size is not None and static_batch_size < 1:
        raise ValueError(f"static_batch_size must be >= 1 (or None), got {static_batch_size}")
    if prompts is not None and len(prompts) != len(trace):
        raise ValueError(f"prompts has {len(prompts)} entries for {len(trace)} trace requests")
    arrivals = [r.arrival_time for r in trace] if rate is None else poisson_arrivals(len(trace), rate, seed).tolist()
    pending = deque(sorted(range(len(trace)), key=lambda i: arrivals[i]))
    vocab_size = engine.model.vocab_size
    now = SimulatedClock() if clock == "simulated" else WallClock()
    saved_clock, engine.clock = engine.clock, now
    live, token_times, outputs, steps = {}, {}, {}, []
    try:
        while pending or engine.has_unfinished_requests():
            if static_batch_size is None or not engine.has_unfinished_requests():
                room = static_batch_size or len(pending)
                while pending and arrivals[pending[0]] <= now() and room:
                    i = pending.popleft()
                    prompt = prompts[i] if prompts is not None else trace_prompt(trace[i], vocab_size, seed)
                    params = SamplingParams(max_tokens=trace[i].output_len, temperature=0.0, ignore_eos=ignore_eos)
                    request = engine.make_request(prompt, params, request_id=str(trace[i].request_id))
                    request.metrics.arrival_time = arrivals[i]   # it arrived then, even if we look only now
                    engine.add_request(request)
                    live[request.request_id], token_times[request.request_id] = request, []
                    room -= 1
            if not engine.has_unfinished_requests():
                now.wait_until(arrivals[pending[0]])          # idle: jump (or sleep) to the next arrival
                continue
            start = now()
            finished = engine.step()
            step = read_step(engine, len(steps), start, 0.0, finished)
            if clock == "simulated":   # the clock stood still inside step(); the step's tokens appear at its end
                now.now += step_cost(step.num_batched_tokens, step.num_seqs, step.num_pairs)
            end = now()
            steps.append(replace(step, duration=end - start))
            for request in {seq.request.request_id: seq.request for seq, _ in engine.last_schedule.scheduled}.values():
                times = token_times[request.request_id]
                count = max(len(seq.output_token_ids) for seq in request.seqs)
                if clock == "simulated" and count and not times:
                    request.metrics.first_token_time = end
                times += [end] * (count - len(times))
            for output in finished:
                if clock == "simulated":
                    output.metrics.finished_time = end
                outputs[output.request_id] = output
    except BaseException:  # an interrupt or an error must not leave the trace's requests in the pool
        for request_id in live:
            engine.abort_request(request_id)
        raise
    finally:
        engine.clock = saved_clock
    ids = [str(r.request_id) for r in trace]
    records = [RequestRecord.from_output(outputs[i], token_times[i],
                                         sum(seq.num_preemptions for seq in live[i].seqs)) for i in ids]
    return ReplayResult(records, [outputs[i] for i in ids], steps)
