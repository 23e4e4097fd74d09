"""The online driver (guide §13): a trace's requests fed to an LLMEngine as they arrive, and what happened to each.

`replay(engine, trace, rate)` adds each request when its Poisson arrival time comes (`rate` requests/s) while it
steps the engine, and returns every request's record and every step's. Time comes from one of two clocks:
  - "simulated" (the default): a clock that moves only when the driver moves it. Each step costs what a `StepCost`
    model says from the step's shape, and an idle engine jumps to the next arrival. When every request generates
    its trace length (`ignore_eos`), the scheduler's decisions depend only on lengths, so the same trace gives the
    same numbers on every run, on every machine, and with any model of the same context length.
  - "real": time.perf_counter, arrivals wait in real time; for benchmarks, and to measure a StepCost.
Both start at 0 when the replay starts. The records are the serving metrics of `paged/engine/metrics.py`.
"""

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from paged.analysis.step_cost import SMOLLM2_CPU, StepCost
from paged.analysis.traces import TraceRequest
from paged.core.sequence import RequestOutput
from paged.engine.llm_engine import LLMEngine
from paged.engine.metrics import SLO, RequestRecord, StepRecord, read_step, summarize
from paged.sampling_params import SamplingParams


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
    requests: list[RequestRecord]  # in trace order
    outputs: list[RequestOutput]  # in trace order
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
    gaps = np.random.default_rng(seed).exponential(1.0, size=num_requests)  # [num_requests], mean 1
    return np.cumsum(gaps) / rate


def trace_prompt(request: TraceRequest, vocab_size: int, seed: int = 0) -> list[int]:
    """Random token ids of the request's input length, the same for the same request and seed."""
    return np.random.default_rng([seed, request.request_id]).integers(0, vocab_size, request.input_len).tolist()


def replay(
    engine: LLMEngine,
    trace: list[TraceRequest],
    rate: float | None = None,
    *,
    clock: str = "simulated",
    step_cost: StepCost = SMOLLM2_CPU,
    static_batch_size: int | None = None,
    prompts: list[str | list[int]] | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
) -> ReplayResult:
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
                    request.metrics.arrival_time = arrivals[i]  # it arrived then, even if we look only now
                    engine.add_request(request)
                    live[request.request_id], token_times[request.request_id] = request, []
                    room -= 1
            if not engine.has_unfinished_requests():
                now.wait_until(arrivals[pending[0]])  # idle: jump (or sleep) to the next arrival
                continue
            start = now()
            finished = engine.step()
            step = read_step(engine, len(steps), start, 0.0, finished)
            if clock == "simulated":  # the clock stood still inside step(); the step's tokens appear at its end
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
    records = [
        RequestRecord.from_output(outputs[i], token_times[i], sum(seq.num_preemptions for seq in live[i].seqs))
        for i in ids
    ]
    return ReplayResult(records, [outputs[i] for i in ids], steps)
