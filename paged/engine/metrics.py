"""Serving metrics (guide §13): TTFT, TPOT, end-to-end latency, goodput under an SLO.

A server is judged request by request:
    TTFT  time to first token    = first_token_time - arrival_time          (queueing + prefill)
    TPOT  time per output token  = (finished_time - first_token_time) / (num_output_tokens - 1)   (decode pace)
    e2e   end-to-end latency     = finished_time - arrival_time = TTFT + TPOT * (num_output_tokens - 1)
    ITL   inter-token latency    = each gap between two output tokens (TPOT is their mean; a stall shows in the max)
and as a whole by goodput: requests per second that meet a service-level objective (TTFT <= a and TPOT <= b).
Throughput counts every request; goodput counts only the ones a user would call served.

The records are filled by the serving loop (`paged/engine/async_llm.py`) and by the replay driver of the chapters
(`paged/analysis/replay.py`).
"""

from dataclasses import dataclass

import numpy as np

from paged.core.sequence import RequestOutput
from paged.engine.llm_engine import LLMEngine

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
    token_times: tuple[float, ...] = ()  # when each output token appeared, if a driver watched
    num_preemptions: int = 0

    @classmethod
    def from_output(cls, output: RequestOutput, token_times=(), num_preemptions: int = 0) -> "RequestRecord":
        m = output.metrics
        return cls(
            output.request_id,
            len(output.prompt_token_ids),
            max(len(c.token_ids) for c in output.outputs),
            m.arrival_time,
            m.first_scheduled_time,
            m.first_token_time,
            m.finished_time,
            tuple(token_times),
            num_preemptions,
        )

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
        return (
            record.ttft <= self.ttft
            and (record.tpot is None or record.tpot <= self.tpot)
            and max(record.itl, default=0.0) <= self.itl
        )


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
    row = {
        "requests": len(records),
        "duration_s": duration,
        "throughput_rps": len(records) / duration,
        "output_tok_s": sum(r.num_output_tokens for r in records) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in records]),
        ("tpot", tpots),
        ("e2e", [r.e2e_latency for r in records]),
    ):
        row[f"{name}_mean"] = float(np.mean(values)) if values else float("nan")
        row.update({f"{name}_{p}": v for p, v in percentiles(values, (50, 99)).items()})
    row["itl_max"] = max(itls, default=float("nan"))
    if slo is not None:
        row["slo_attainment"] = sum(slo.met_by(r) for r in records) / len(records)
        row["goodput_rps"] = goodput(records, duration, slo)
    return row


# ---- one step --------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the driver saw it, read from engine.last_schedule right after the step."""

    index: int
    start: float
    duration: float
    prefills: tuple[tuple[str, int], ...]  # (request_id, tokens): a prompt chunk, a whole prompt, or a recompute
    decodes: tuple[str, ...]  # request ids that computed their newest token and sampled the next
    preempted: tuple[str, ...]  # request ids this step's schedule sent back to waiting
    finished: tuple[str, ...]
    num_pairs: int  # (query, key) pairs attention computed over all sequences

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + len(self.decodes)


def read_step(
    engine: LLMEngine, index: int, start: float, duration: float, finished: list[RequestOutput]
) -> StepRecord:
    """The StepRecord of the step that just ran, read from its plan (engine.last_schedule), in request ids."""
    plan = engine.last_schedule
    prefills, decodes, num_pairs = [], [], 0
    for seq, n in plan.scheduled:
        begin = plan.num_computed[seq.seq_id]  # the step computed positions [begin, begin + n)
        num_pairs += n * begin + n * (n + 1) // 2  # position p attends p + 1 keys
        if seq.seq_id in plan.decodes:
            decodes.append(seq.request.request_id)
        else:
            prefills.append((seq.request.request_id, n))
    return StepRecord(
        index,
        start,
        duration,
        tuple(prefills),
        tuple(decodes),
        tuple(seq.request.request_id for seq in plan.preempted),
        tuple(out.request_id for out in finished),
        num_pairs,
    )
