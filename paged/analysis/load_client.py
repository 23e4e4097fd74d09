"""Load on a server over HTTP, measured as a client sees it (guide §13): the numbers of `vllm bench serve`.

`run_load` sends streamed completion requests to any OpenAI-compatible server (this package's `python -m paged
serve`, or `vllm serve`): Poisson arrivals at a rate, or a fixed number in flight. Each request is a prompt of
random token ids with a ShareGPT- or Alpaca-like length (`paged.analysis.traces`), asking for exactly its trace output length
(`ignore_eos`, an extra field both servers take). The client stamps, on its own clock, when it sent each request,
when each chunk arrived (one per engine step that produced tokens) and when the stream ended; those become `paged.engine.metrics.RequestRecord`s, so the
engine's summaries apply: TTFT, TPOT, ITL (the gaps between chunks, as vLLM's benchmark counts them), end-to-end
latency and goodput. While the load runs, /metrics can be polled to follow the server's KV-cache usage and queues.
"""

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from paged.analysis.replay import poisson_arrivals
from paged.analysis.traces import ALPACA, SHAREGPT, make_trace
from paged.engine.metrics import SLO, RequestRecord, percentiles, summarize

PROFILES = {"sharegpt": SHAREGPT, "alpaca": ALPACA}
TOKEN_ID_RANGE = (1000, 20000)  # random prompt ids from here: real words in any tokenizer of 32k+ entries


@dataclass(frozen=True)
class LoadRequest:
    prompt: list[int]  # token ids
    max_tokens: int


@dataclass
class LoadResult:
    records: list[RequestRecord]  # the requests that completed, in order of sending
    duration: float  # seconds from the first send to the last completion
    failures: list[str]  # one message per request that failed
    samples: list[dict] = field(default_factory=list)  # /metrics polled: {"t", "kv_usage", "running", "waiting"}

    def summary(self, slo: SLO | None = None) -> dict:
        """Throughputs, mean / median / p90 / p99 of TTFT, TPOT, ITL and e2e, and goodput under slo."""
        if not self.records:
            return {"requests": 0, "failures": len(self.failures)}
        row = summarize(self.records, self.duration, slo)
        for name, values in (
            ("ttft", [r.ttft for r in self.records]),
            ("tpot", [r.tpot for r in self.records if r.tpot is not None]),
            ("itl", [gap for r in self.records for gap in r.itl]),
            ("e2e", [r.e2e_latency for r in self.records]),
        ):
            row[f"{name}_mean"] = float(np.mean(values)) if values else float("nan")
            row.update({f"{name}_{p}": v for p, v in percentiles(values, (50, 90, 99)).items()})
        row["failures"] = len(self.failures)
        return row


def make_requests(
    num_prompts: int, profile: str = "sharegpt", seed: int = 0, max_input_len: int = 1024, max_output_len: int = 1024
) -> list[LoadRequest]:
    """num_prompts requests with the profile's lengths (those of paged.analysis.traces for a 2,048-token model) clipped to
    max_input_len and max_output_len, prompts of random token ids; seeded."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    for name, value in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    trace = make_trace(PROFILES[profile], num_prompts, seed)
    rng = np.random.default_rng(seed)
    return [
        LoadRequest(
            rng.integers(*TOKEN_ID_RANGE, min(r.input_len, max_input_len)).tolist(), min(r.output_len, max_output_len)
        )
        for r in trace
    ]


async def stream_one(
    client: httpx.AsyncClient,
    model: str,
    request: LoadRequest,
    index: int,
    start: float,
) -> RequestRecord:
    """Send one streamed completion; returns its record in seconds since start (time.perf_counter)."""
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter() - start
    chunk_times, num_tokens = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):  # a step's tokens arrived (their text may wait for a whole character)
                chunk_times.append(time.perf_counter() - start)
    if not chunk_times:
        raise RuntimeError("the stream ended without a token")
    return RequestRecord(
        str(index),
        len(request.prompt),
        num_tokens or len(chunk_times),
        sent,
        sent,
        chunk_times[0],
        chunk_times[-1],
        tuple(chunk_times),
    )


def metric_values(text: str) -> dict[str, float]:
    """The first sample of every metric in a Prometheus text page."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return values


async def poll_metrics(client: httpx.AsyncClient, start: float, interval: float, samples: list[dict]) -> None:
    """Append the server's KV-cache usage and queue lengths every interval seconds, until cancelled."""
    while True:
        try:
            values = metric_values((await client.get("/metrics")).text)
            samples.append(
                {
                    "t": time.perf_counter() - start,
                    "kv_usage": values.get("vllm:kv_cache_usage_perc", math.nan),
                    "running": values.get("vllm:num_requests_running", math.nan),
                    "waiting": values.get("vllm:num_requests_waiting", math.nan),
                }
            )
        except httpx.HTTPError:
            pass
        await asyncio.sleep(interval)


async def run_load(
    base_url: str,
    model: str,
    requests: list[LoadRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    poll_interval: float | None = None,
    timeout: float = 600.0,
) -> LoadResult:
    """Send every request, Poisson arrivals at request_rate (inf: all at once), at most max_concurrency in
    flight; with poll_interval, /metrics is sampled that often while the load runs."""
    arrivals = (
        poisson_arrivals(len(requests), request_rate, seed) if math.isfinite(request_rate) else np.zeros(len(requests))
    )
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connections = httpx.Limits(max_connections=(max_concurrency or len(requests)) + 1)
    failures: list[str] = []
    samples: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=connections) as client:
        start = time.perf_counter()

        async def one(index: int, request: LoadRequest):
            await asyncio.sleep(max(0.0, arrivals[index] - (time.perf_counter() - start)))
            async with limit:
                try:
                    return await stream_one(client, model, request, index, start)
                except (httpx.HTTPError, RuntimeError) as error:
                    failures.append(f"request {index}: {error}")
                    return None

        poller = asyncio.create_task(poll_metrics(client, start, poll_interval, samples)) if poll_interval else None
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        end = time.perf_counter() - start
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    records = [r for r in results if r is not None]
    return LoadResult(records, end - min((r.arrival_time for r in records), default=0.0), failures, samples)


async def first_model(base_url: str, api_key: str | None = None) -> str:
    """The id of the first model a server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
