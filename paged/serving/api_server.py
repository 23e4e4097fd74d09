"""An OpenAI-compatible HTTP server over the paged engine (guide §13: what a user of a serving engine meets).

    python -m paged serve --port 8000 [--api-key KEY] [--lora-modules pirate=adapters/pirate]

FastAPI and uvicorn carry the HTTP: the routes are functions on one APIRouter (`router`, as vLLM's api_router), which
read what they serve from app.state (build_app puts it there), and the requests and responses they take and give are
the pydantic models of serving/protocol.py. An engine loop (engine/async_llm.py) steps the engine while requests come
and go, so every client shares every step: in an engine core process of its own under `python -m paged serve`
(serving/engine_core.py), in a thread of this process for build_app(llm) in a notebook or a test. Routes, as vLLM's
server names them:
  POST /v1/completions        prompt (text, or a list of token ids) -> text
  POST /v1/chat/completions   messages -> the tokenizer's chat template -> text
  GET  /v1/models             the base model and each LoRA adapter, served by name (guide §16)
  GET  /health                200 while the engine loop runs
  GET  /metrics               Prometheus text, vLLM's metric names (running, waiting, KV-cache usage, prefix-cache
                              queries and hits, preemptions, TTFT, time per output token, inter-token latency,
                              end-to-end latency, prompt and generation tokens, finished requests)
Request fields: model, max_tokens (chat: also max_completion_tokens), temperature, top_p, top_k, n, seed, stop
(a string or a list of them), stop_token_ids, ignore_eos (vLLM's extra fields), stream with stream_options
.include_usage (usage in a last chunk, as OpenAI and vLLM do), vLLM's return_token_ids (each choice also
carries its token ids), and log-probabilities in OpenAI's two shapes: /v1/completions takes `logprobs: N` and
answers with tokens, token_logprobs, top_logprobs (the chosen token and the N most likely) and text_offset;
/v1/chat/completions takes `logprobs: true` with `top_logprobs: N` and answers with one entry per token (token,
logprob, bytes, its N most likely). N is at most 20; the values are the model's, before temperature, top-k and
top-p (vLLM's default). /v1/completions also takes a batch of prompts, echo and vLLM's prompt_logprobs.
vLLM's extra fields min_p and include_stop_str_in_output mean what they mean in SamplingParams.

`python -m paged serve` runs the engine as `vllm serve` runs it on a CPU (server_defaults): every prompt chunked,
prefix caching on, and a token budget sized at start-up for this machine (serving/token_budget.py), so that no step runs
so many prompt tokens that the streams waiting on it stall; a step with no stream waiting on it runs its first prompt
whole. `LLM`'s offline defaults are left as they are.

With `stream: true` the answer is server-sent events, one chunk per engine step that produced text, then
`data: [DONE]`. A client that disconnects aborts its request: its blocks go back to the pool at once.
Every bad request gets HTTP 400 with OpenAI's error object {"error": {"message", "type", "param", "code"}},
`param` naming the field: the request model's check that failed, or the `.argument` of the ArgumentError
(paged/validation.py) that SamplingParams or the engine raised; with --api-key, a request to /v1 without
`Authorization: Bearer KEY` gets 401.
"""

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hmac
import re
import socket
import threading
import time
import uuid
from typing import Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from paged.engine.async_llm import AsyncLLM, StreamOutput
from paged.lora import LoRARequest, read_adapter_config
from paged.sampling_params import Logprob, SamplingParams
from paged.serving.engine_core import AsyncMPClient
from paged.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    StreamOptions,
    TokenizeRequest,
    UsageInfo,
)
from paged.serving.token_budget import MAX_TOKEN_BUDGET, size_token_budget
from paged.validation import ArgumentError, prompt_token_ids

# sampling fields this engine's sampler does not implement, with the value that leaves the logits as they are: a
# request that sets one to anything else gets a 400 naming it, never an answer that ignored it
NEUTRAL_SAMPLING = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "logit_bias": {},
}


def is_json(value) -> bool:
    """Whether value goes into a JSON answer as it is (a tokenizer's settings hold objects too)."""
    if isinstance(value, (list, tuple)):
        return all(map(is_json, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v) for k, v in value.items())
    return value is None or isinstance(value, (str, int, float, bool))


class BadRequest(Exception):
    """A request the server refuses with HTTP 400; param names the field at fault."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


class EngineFailure(Exception):
    """The engine could not take a request for a reason of its own (its loop stopped): HTTP 500."""


class ChunkedBodyLimit:
    """A body sent without a Content-Length (in chunks) is read here first, and refused with 413 as soon as it grows
    past max_body_bytes; one within the limit goes on to the app as if it had just arrived. (A body with a
    Content-Length is judged by that header, before it is read.)"""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or any(name == b"content-length" for name, _ in scope["headers"]):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                response = error_response(
                    f"the request body (over {size} bytes, in chunks) is larger than this "
                    f"server takes ({self.max_body_bytes} bytes)",
                    None,
                    413,
                )
                return await response(scope, receive, send)
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)


def error_body(
    message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"
) -> ErrorResponse:
    """OpenAI's error object."""
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def error_response(
    message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error_body(message, param, status, kind).model_dump(), status_code=status)


# ---- log-probabilities in OpenAI's two shapes ------------------------------------------------------------------


LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for a log-probability of -inf, which JSON cannot carry


def token_text(token_id: int, logprob: Logprob) -> str:
    """A token as OpenAI's logprobs name it: its text, or vLLM's "token_id:N" when there is no tokenizer."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def top_entries(entry: dict[int, Logprob], num_top: int) -> dict[int, Logprob]:
    """The chosen token (first) and the num_top most likely of an entry that may hold more of them."""
    return {token_id: lp for i, (token_id, lp) in enumerate(entry.items()) if i == 0 or lp.rank <= num_top}


def completion_logprobs(
    entries: list[dict[int, Logprob] | None], text_offset: int, num_top: int, first_text: str = ""
) -> tuple[dict, int]:
    """/v1/completions' logprobs for some tokens (an entry each: the chosen token first, then the most likely):
    their texts, their log-probabilities, a map of each position's num_top alternatives and the chosen one, and
    where each token's text begins, counted from text_offset. An echoed prompt's first token has no entry
    (None): its text is first_text, its log-probability and map null. Returns it and the offset after the last
    token."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            tokens.append(first_text)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen_id, chosen = next(iter(entry.items()))
            tokens.append(token_text(chosen_id, chosen))
            token_logprobs.append(max(chosen.logprob, LOGPROB_FLOOR))
            top_logprobs.append(
                {token_text(i, lp): max(lp.logprob, LOGPROB_FLOOR) for i, lp in top_entries(entry, num_top).items()}
            )
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }, text_offset


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None], num_top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs field: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the token and its num_top most likely alternatives."""
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": max(lp.logprob, LOGPROB_FLOOR),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in top_entries(entry, num_top).items()
        }
        for entry in entries
    ]


@functools.cache
def byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, which Llama 3, Qwen and SmolLM2 share), read backwards: each of its
    256 characters -> the byte it stands for. Printable bytes stand for themselves; the others are shifted past
    255 in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """A token's own UTF-8 bytes. Its decoded text alone says U+FFFD where the token holds part of a multi-byte
    character, so then the bytes come from the vocabulary's piece: a byte-level BPE piece (GPT-2's alphabet) or
    a SentencePiece byte piece (<0xE2>)."""
    if tokenizer is None or "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return [int(piece[3:5], 16)]
    alphabet = byte_of_char()
    if all(char in alphabet for char in piece):
        return [alphabet[char] for char in piece]
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[dict[int, Logprob]], num_top: int, tokenizer=None) -> dict:
    """/v1/chat/completions' logprobs: per token its text, log-probability and UTF-8 bytes, and the num_top most
    likely tokens at its position in the same form."""

    def item(token_id: int, logprob: Logprob) -> dict:
        text = token_text(token_id, logprob)
        return {
            "token": text,
            "logprob": max(logprob.logprob, LOGPROB_FLOOR),
            "bytes": token_bytes(tokenizer, token_id, text),
        }

    content = []
    for entry in entries:
        chosen_id, chosen = next(iter(entry.items()))
        ranked = sorted(entry.items(), key=lambda pair: pair[1].rank)[:num_top]
        content.append({**item(chosen_id, chosen), "top_logprobs": [item(i, lp) for i, lp in ranked]})
    return {"content": content, "refusal": None}


# ---- metrics ----------------------------------------------------------------------------------------------

KEEP_FINISHED = 1024  # finished requests whose engine timestamps ServerMetrics.finished keeps, for a notebook
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """A Prometheus registry of the server's own, with vLLM's metric names, fed by the engine loop's thread."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no *_created samples beside each counter and histogram
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", **labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", **labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", **labels)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", **labels
        )
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", **labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", **labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated by finished requests", **labels)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted (sent back to wait)", **labels)
        self.success = Counter("vllm:request_success", "Requests finished", **labels)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, **labels
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean gap between a completion's output tokens",
            buckets=LATENCY_BUCKETS,
            **labels,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Each gap between two tokens of a completion",
            buckets=LATENCY_BUCKETS,
            **labels,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, **labels
        )
        self.model_name = model_name
        self.finished = collections.OrderedDict()  # request id -> engine timestamps, the last KEEP_FINISHED
        for metric in self.registry._names_to_collectors.values():  # every series shows from the start, at 0
            metric.labels(model_name)
        self._seen = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "num_preemptions": 0}

    def on_step(self, stats: dict, finished: list[StreamOutput]) -> None:
        """stats: the engine's kv_stats() after a turn of its loop; finished: the requests that ended in it."""
        name = self.model_name
        self.running.labels(name).set(stats["num_running"])
        self.waiting.labels(name).set(stats["num_waiting"])
        self.kv_usage.labels(name).set(stats["usage"])
        for key, counter in (
            ("prefix_query_tokens", self.prefix_queries),
            ("prefix_hit_tokens", self.prefix_hits),
            ("num_preemptions", self.preemptions),
        ):
            counter.labels(name).inc(max(0, stats[key] - self._seen[key]))
            self._seen[key] = stats[key]
        for output in finished:
            m = output.metrics
            self.finished[output.request_id] = m
            while len(self.finished) > KEEP_FINISHED:
                self.finished.popitem(last=False)
            self.success.labels(name).inc()
            self.prompt_tokens.labels(name).inc(output.num_prompt_tokens)
            self.generation_tokens.labels(name).inc(len(m.token_times))
            if m.first_token_time is not None:
                self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
            for times in output.completion_token_times:  # each completion's own gaps: n of them interleave
                gaps = [b - a for a, b in zip(times, times[1:])]
                for gap in gaps:
                    self.itl.labels(name).observe(gap)
                if gaps:
                    self.tpot.labels(name).observe(sum(gaps) / len(gaps))
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its generator when sending stops, also when the client went away
    (Starlette leaves it suspended then), so that the generator's cleanup runs at once."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


# ---- the application --------------------------------------------------------------------------------------


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_BODY_BYTES = 64 * 2**20  # a request body larger than this gets a 413 before it is read
OPEN_PATHS = ("/health", "/metrics")  # served without the API key, as in vLLM


def host_name(host_header: str) -> str:
    """The host of a Host header, without its port: "[::1]:8000" -> "::1", "localhost:8000" -> "localhost"."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


def surrogate_field(value, path: str = "") -> str | None:
    """The first field of a parsed JSON body whose text holds a lone UTF-16 surrogate ("\\ud800", which JSON may
    carry but UTF-8 cannot), e.g. "messages[0].content"; None if there is none."""
    if isinstance(value, str):
        return path if any("\ud800" <= char <= "\udfff" for char in value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and surrogate_field(key) is not None:
            return inner
        if (found := surrogate_field(item, inner)) is not None:
            return found
    return None


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the routes serve, kept in app.state.served: the model's name, its adapters by name, and the limits a
    request is checked against before the engine sees it."""

    name: str
    adapters: dict[str, LoRARequest]
    tokenizer: object
    max_model_len: int
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class Guard:
    """What every request is checked for before anything else reads it (app.state.guard)."""

    allowed_hosts: tuple[str, ...] | None
    api_key: str | None
    max_body_bytes: int


def build_app(
    llm,
    model_name: str = "smollm2",
    lora_modules: dict[str, str] | None = None,
    api_key: str | None = None,
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI application serving `llm` under `model_name`, each adapter of lora_modules {name: folder} as a
    model of its own. `llm`: a paged.LLM (made with enable_lora=True if lora_modules are given), whose loop then runs
    in a thread of this process (AsyncLLM), or an AsyncMPClient, an engine core in a process of its own that
    registered the same adapters when it started (serving/engine_core.py; `python -m paged serve`). allowed_hosts: the host
    names a request's Host header may give (loopback by default, so that a web page cannot reach a server on this
    machine through a DNS name of its own); None accepts any, for a server bound to a public address."""
    lora_modules = dict(lora_modules or {})
    if model_name in lora_modules:
        raise ValueError(
            f"lora_modules: the adapter name {model_name!r} is the served model's name; requests for "
            f"the base model would run under the adapter. Give the adapter another name"
        )
    adapters = lora_requests(lora_modules)
    metrics = ServerMetrics(model_name)
    if isinstance(llm, AsyncMPClient):  # the engine runs in its own process, its adapters registered there
        served = ServedModel(model_name, adapters, llm.tokenizer, llm.max_model_len, llm.vocab_size)
    else:
        if lora_modules and llm.engine.lora is None:
            raise ValueError("lora_modules needs an LLM made with enable_lora=True")
        for adapter in adapters.values():  # read and checked now, before the engine loop owns the engine
            llm.engine.lora.resolve(adapter)
        served = ServedModel(
            model_name, adapters, llm.tokenizer, llm.engine.max_model_len, llm.engine.config.vocab_size
        )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if isinstance(llm, AsyncMPClient):
            llm.on_step = metrics.on_step
            app.state.async_llm = llm
        else:
            app.state.async_llm = AsyncLLM(llm.engine, on_step=metrics.on_step)
        yield
        app.state.async_llm.shutdown()

    app = FastAPI(title="paged", lifespan=lifespan)
    app.state.served, app.state.metrics = served, metrics
    app.state.guard = Guard(allowed_hosts, api_key, max_body_bytes)
    app.add_middleware(ChunkedBodyLimit, max_body_bytes=max_body_bytes)
    app.middleware("http")(guard)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(BadRequest, bad_request)
    app.add_exception_handler(EngineFailure, engine_failure)
    app.include_router(router)
    return app


async def guard(request: Request, call_next):
    """The Host header, the body's size and the API key, before anything else reads the request."""
    settings: Guard = request.app.state.guard
    host = host_name(request.headers.get("host", ""))
    if settings.allowed_hosts is not None and host not in settings.allowed_hosts:
        return error_response(
            f"the Host header {host!r} is not one this server answers to ({', '.join(settings.allowed_hosts)})",
            None,
            400,
        )
    length = request.headers.get("content-length", "0")
    if not length.isdigit() or int(length) > settings.max_body_bytes:
        return error_response(
            f"the request body ({length} bytes) is larger than this server takes ({settings.max_body_bytes} bytes)",
            None,
            413,
        )
    if settings.api_key is not None and request.url.path not in OPEN_PATHS:
        sent = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(sent, f"Bearer {settings.api_key}".encode()):
            return error_response(
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                None,
                401,
                "authentication_error",
            )
    return await call_next(request)


async def invalid_body(request: Request, error: RequestValidationError):
    """A body the request models refuse: a 400 whose param is the first field at fault."""
    errors = error.errors()
    if errors[0].get("type") == "json_invalid":
        return error_response(f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}", None)

    def loc(e):  # the path inside the body; pydantic also names each branch of a union it tried (a str)
        return [part for part in e.get("loc", ()) if part != "body"]

    # the first field at fault; of the branches tried for it, one that reached an element of a list
    same_field = [e for e in errors if loc(e)[:1] == loc(errors[0])[:1]]
    first = max(same_field, key=lambda e: any(isinstance(part, int) for part in loc(e)))
    path = loc(first)
    index = next((part for part in path[1:] if isinstance(part, int)), None)
    param = (f"{path[0]}" + (f"[{index}]" if index is not None else "")) if path else None
    return error_response(f"{param or 'body'}: {first.get('msg')} (got {first.get('input')!r:.80})", param)


async def bad_request(request: Request, error: BadRequest):
    return error_response(error.message, error.param)


async def engine_failure(request: Request, error: EngineFailure):
    return error_response(f"the engine failed: {error}", None, 500, "internal_error")


def served_model(request: Request) -> ServedModel:
    """The routes' dependency: what app.state serves."""
    return request.app.state.served


Served = Annotated[ServedModel, Depends(served_model)]
router = APIRouter()


@router.get("/health")
async def health(request: Request):
    async_llm = request.app.state.async_llm
    problem = None if async_llm.is_running else "the engine loop has stopped"
    try:
        async_llm.check_health()
    except RuntimeError as error:  # a tensor-parallel worker died
        problem = str(error)
    return JSONResponse({"error": problem} if problem else {}, status_code=503 if problem else 200)


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def show_available_models(served: Served):
    created = int(time.time())
    cards = [
        ModelCard(id=served.name, created=created, root=served.name, parent=None, max_model_len=served.max_model_len)
    ]
    cards += [
        ModelCard(id=name, created=created, root=adapter.lora_path, parent=served.name)
        for name, adapter in served.adapters.items()
    ]
    return ModelList(data=cards).model_dump()


def need_tokenizer(served: ServedModel, route: str) -> None:
    if served.tokenizer is None:
        raise BadRequest(f"{route} needs a tokenizer, and this model is served without one", None)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, served: Served):
    need_tokenizer(served, "/tokenize")
    check_text(body)
    tokenizer = served.tokenizer
    ids = await asyncio.to_thread(
        lambda: tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    )
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, served: Served):
    need_tokenizer(served, "/detokenize")
    if not all(0 <= t < served.vocab_size for t in body.tokens):
        raise BadRequest(f"tokens must lie in [0, {served.vocab_size}) (the model's vocabulary size)", "tokens")
    return {"prompt": await asyncio.to_thread(served.tokenizer.decode, body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(served: Served):
    need_tokenizer(served, "/tokenizer_info")
    tokenizer = served.tokenizer
    settings = {key: value for key, value in tokenizer.init_kwargs.items() if is_json(value)}
    return {
        **settings,
        "tokenizer_class": type(tokenizer).__name__,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


@router.post("/v1/completions")
async def create_completion(request: Request, body: CompletionRequest):
    prompts = body.prompt
    batch = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
    return await respond(request, body, prompts if batch else [prompts], body.max_tokens, chat=False)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, body: ChatCompletionRequest, served: Served):
    tokenizer = served.tokenizer
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest("messages: this model has no chat template; use /v1/completions", "messages")
    check_text(body)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # the template refused these messages (roles that must alternate, ...)
        raise BadRequest(f"messages: the chat template refused them: {error}", "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await respond(request, body, [prompt], max_tokens, chat=True)


# ---- what the two generating routes share -------------------------------------------------------------------


def check_text(body: BaseModel) -> None:
    """A lone surrogate in any text of the body is refused, naming the field: no tokenizer takes it."""
    field = surrogate_field(body.model_dump())
    if field is not None:
        raise BadRequest(
            f"{field} holds a lone UTF-16 surrogate, which is not text; send valid Unicode",
            field.split(".")[0].split("[")[0],
        )


def sampling_params(
    served: ServedModel, body: SamplingRequest, max_tokens: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    if body.model != served.name and body.model not in served.adapters:
        raise BadRequest(
            f"model {body.model!r} is not served here; the models are {[served.name, *served.adapters]}", "model"
        )
    for name, neutral in NEUTRAL_SAMPLING.items():
        if getattr(body, name) not in (None, neutral):
            raise BadRequest(
                f"{name} is not supported by this engine's sampler; leave it out or send {neutral!r}", name
            )
    if getattr(body, "best_of", None) not in (None, body.n):
        raise BadRequest(
            f"best_of ({body.best_of}) must equal n ({body.n}): this server returns every completion it samples",
            "best_of",
        )
    kwargs = {
        "n": body.n,
        "ignore_eos": body.ignore_eos,
        "seed": body.seed,
        "stop_token_ids": body.stop_token_ids or [],
        "logprobs": body.logprobs,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "prompt_logprobs": prompt_logprobs,
    }
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        kwargs["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    try:
        return SamplingParams(**kwargs)
    except ArgumentError as error:
        if error.argument == "logprobs" and isinstance(body, ChatCompletionRequest):  # chat's count: top_logprobs
            raise BadRequest(str(error).replace("logprobs", "top_logprobs", 1), "top_logprobs") from None
        raise BadRequest(str(error), error.argument) from None


async def token_ids_of(served: ServedModel, prompt, param: str) -> list[int]:
    """A prompt's token ids; text is tokenized in a worker thread, so that a huge prompt does not stall the
    engine loop or the event loop, and checked against the context before the engine sees it."""
    try:
        ids = (
            await asyncio.to_thread(prompt_token_ids, prompt, served.tokenizer)
            if isinstance(prompt, str)
            else prompt_token_ids(prompt, served.tokenizer)
        )
    except ValueError as error:
        raise BadRequest(str(error), param) from None
    if len(ids) >= served.max_model_len:
        raise BadRequest(
            f"prompt has {len(ids)} tokens; the model holds at most {served.max_model_len} "
            f"(max_model_len) including at least one new token",
            param,
        )
    return ids


async def start(
    request: Request,
    body: SamplingRequest,
    prompt: list[int],
    params: SamplingParams,
    fill_max_tokens: bool,
    request_id: str,
    param: str,
):
    """Hand one prompt to the engine; param: the field that holds it, which an error about the prompt names."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(not s for s in stop):
        raise BadRequest("stop strings must not be empty", "stop")
    try:
        return await request.app.state.async_llm.add_request(
            prompt,
            params,
            request_id,
            request.app.state.served.adapters.get(body.model),
            tuple(stop),
            fill_max_tokens=fill_max_tokens,
        )
    except ArgumentError as error:
        raise BadRequest(str(error), param if error.argument == "prompt" else error.argument) from None
    except ValueError as error:  # the request's, about no field of it (its adapter's folder, say)
        raise BadRequest(str(error), None) from None
    except Exception as error:  # not the request's fault
        raise EngineFailure(str(error)) from None


async def collect(request: Request, streams: list) -> list | None:
    """Every output of each non-streamed request; if the client disconnects first, they are aborted."""
    async_llm = request.app.state.async_llm

    async def gather(stream):
        return [output async for output in async_llm.stream_outputs(stream)]

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.gather(*map(gather, streams))
    watch = asyncio.create_task(disconnected())
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work not in done:
        work.cancel()  # stream_outputs aborts each request as it closes
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return None
    watch.cancel()
    return work.result()


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def base_request_id(request: Request, body: SamplingRequest) -> str:
    """vLLM's: the X-Request-Id header's, else the body's request_id, else a fresh one."""
    return request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex


async def respond(request: Request, body: SamplingRequest, prompts: list, max_tokens: int | None, chat: bool):
    """/v1/completions' and /v1/chat/completions' answer, streamed or whole. prompts: the request's prompts (a chat
    has one), as text or token ids."""
    served: ServedModel = request.app.state.served
    async_llm, tokenizer = request.app.state.async_llm, served.tokenizer
    check_text(body)
    base_id = base_request_id(request, body)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
    echo = getattr(body, "echo", False)
    if max_tokens == 0 and not echo:
        raise BadRequest("max_tokens must be >= 1 (0 only with echo: true, to score the prompt)", "max_tokens")
    num_prompt_top = [
        n for n in (getattr(body, "prompt_logprobs", None), body.logprobs if echo else None) if n is not None
    ]
    params = sampling_params(
        served,
        body,
        1 if max_tokens == 0 else max_tokens,  # with 0, its token is dropped
        max(num_prompt_top) if num_prompt_top else None,
    )
    keep_output = max_tokens != 0
    param = "messages" if chat else "prompt"
    token_ids = [
        await token_ids_of(served, p, param if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)
    ]
    streams = []
    try:
        for i, ids in enumerate(token_ids):
            engine_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"  # vLLM's ids
            streams.append(
                await start(
                    request,
                    body,
                    ids,
                    params,
                    max_tokens is None,
                    engine_id,
                    param if len(prompts) == 1 else f"prompt[{i}]",
                )
            )
    except BaseException:  # one prompt of a batch refused: the others are not served either
        for stream in streams:
            async_llm.abort(stream.request_id)
        raise
    created = int(time.time())
    options = body.stream_options or StreamOptions()
    text_offsets = collections.defaultdict(int)  # completions' text_offset, per choice, across chunks

    def logprobs_of(index: int, entries, prompt_entries=None, first_text: str = "") -> dict | None:
        if entries is None:
            return None
        if chat:
            return chat_logprobs(entries, params.logprobs, tokenizer)
        shaped, text_offsets[index] = completion_logprobs(
            (prompt_entries or []) + entries, text_offsets[index], params.logprobs, first_text
        )
        return shaped

    def first_token_text(i: int) -> str:
        return tokenizer.decode(token_ids[i][:1]) if tokenizer is not None else f"token_id:{token_ids[i][0]}"

    def prompt_text(i: int) -> str:
        return (
            prompts[i]
            if isinstance(prompts[i], str)
            else tokenizer.decode(token_ids[i])
            if tokenizer is not None
            else ""
        )

    def choice(i: int, delta, first: bool, prompt_logprobs, whole: bool = False):
        """A choice for prompt i's delta (whole: the completion's every delta in one); the first of each
        completion carries the echo and prompt_logprobs (the request's, from its first output)."""
        text = delta.text if keep_output else ""
        entries = (delta.logprobs or []) if keep_output else []
        index = i * params.n + delta.index
        fields = {
            "index": index,
            "finish_reason": delta.finish_reason,
            "logprobs": logprobs_of(
                index,
                entries if params.logprobs is not None else None,
                prompt_logprobs if first and echo else None,
                first_token_text(i),
            ),
        }
        if body.return_token_ids:
            fields["token_ids"] = delta.token_ids if keep_output else []
            if first and not chat:
                fields["prompt_token_ids"] = token_ids[i]
        if chat and whole:
            return ChatCompletionResponseChoice(message=ChatMessage(content=text), **fields)
        if chat:
            return ChatCompletionResponseStreamChoice(
                delta=DeltaMessage(role="assistant", content=text)
                if first
                else DeltaMessage(content=text)
                if text or delta.finish_reason is None
                else DeltaMessage(),
                **fields,
            )
        if first and getattr(body, "prompt_logprobs", None) is not None:
            fields["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs, body.prompt_logprobs)
        return CompletionResponseChoice(text=(prompt_text(i) if first and echo else "") + text, **fields)

    chunk_type = ChatCompletionStreamResponse if chat else CompletionStreamResponse
    headers = {"x-request-id": base_id}
    if body.stream:

        async def events():
            num_prompt = num_cached = num_out = 0
            try:
                for i, stream in enumerate(streams):
                    started, done, prompt_logprobs = set(), False, None
                    try:
                        async for output in async_llm.stream_outputs(stream):
                            prompt_logprobs = output.prompt_logprobs or prompt_logprobs
                            if not started:
                                num_prompt += output.num_prompt_tokens
                                num_cached += output.num_cached_tokens
                            num_out += sum(len(d.token_ids) for d in output.completions) if keep_output else 0
                            choices = []
                            for delta in output.completions:
                                choices.append(choice(i, delta, delta.index not in started, prompt_logprobs))
                                started.add(delta.index)
                            done = output.finished
                            so_far = (
                                UsageInfo.of(num_prompt, num_out, num_cached)
                                if options.continuous_usage_stats
                                else None
                            )
                            yield sse(
                                chunk_type(
                                    id=response_id, created=created, model=body.model, choices=choices, usage=so_far
                                )
                            )
                    finally:  # closed early: the client went away, or the engine failed
                        if not done:
                            for stream in streams[i:]:
                                async_llm.abort(stream.request_id)
                if options.include_usage:
                    yield sse(
                        chunk_type(
                            id=response_id,
                            created=created,
                            model=body.model,
                            choices=[],
                            usage=UsageInfo.of(num_prompt, num_out, num_cached),
                        )
                    )
            except Exception as error:  # the engine failed mid-answer: say so in the stream
                yield sse(error_body(f"the engine failed: {error}", None, 500, "internal_error"))
            yield "data: [DONE]\n\n"

        return ClosingStreamingResponse(events(), media_type="text/event-stream", headers=headers)

    try:
        results = await collect(request, streams)
    except Exception as error:
        return error_response(f"the engine failed: {error}", None, 500, "internal_error")
    if results is None:  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    choices, num_out = [], 0
    for i, outputs in enumerate(results):
        merged = {}  # completion index -> one delta holding all its deltas
        for output in outputs:
            for delta in output.completions:
                if delta.index not in merged:
                    merged[delta.index] = dataclasses.replace(
                        delta, token_ids=list(delta.token_ids), logprobs=list(delta.logprobs or [])
                    )
                else:
                    whole = merged[delta.index]
                    whole.text += delta.text
                    whole.token_ids += delta.token_ids
                    whole.logprobs += delta.logprobs or []
                    whole.finish_reason = delta.finish_reason or whole.finish_reason
        num_out += sum(len(d.token_ids) for d in merged.values()) if keep_output else 0
        choices += [choice(i, merged[index], True, outputs[0].prompt_logprobs, whole=True) for index in sorted(merged)]
    num_prompt = sum(outputs[-1].num_prompt_tokens for outputs in results)
    num_cached = sum(outputs[0].num_cached_tokens for outputs in results)
    response = (ChatCompletionResponse if chat else CompletionResponse)(
        id=response_id,
        created=created,
        model=body.model,
        choices=choices,
        usage=UsageInfo.of(num_prompt, num_out, num_cached),
    )
    return JSONResponse(response.model_dump(), headers=headers)


# ---- running it -------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int | None = None, timeout: float = 30.0):
    """Run the app with uvicorn in a background thread (for a notebook or a test); yields its base URL
    (http://host:port) once it accepts connections, and stops the server on exit."""
    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="paged-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port} within {timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


def lora_requests(lora_modules: dict[str, str]) -> dict[str, LoRARequest]:
    """{name: folder} -> {name: LoRARequest}, numbered from 1 in the order given."""
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(lora_modules.items())}


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """["pirate=adapters/pirate", ...] -> {"pirate": "adapters/pirate"}."""
    modules = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=folder, got {item!r}")
        modules[name] = path
    return modules


def adapter_rank(path: str) -> int:
    """The rank r an adapter folder's adapter_config.json declares, the largest of its rank_pattern's too; a
    ValueError naming the file if it is malformed."""
    config = read_adapter_config(path)
    return max(
        [
            int(config["r"]),
            *(
                int(r)
                for r in (config.get("rank_pattern") or {}).values()
                if isinstance(r, int) and not isinstance(r, bool)
            ),
        ]
    )


UNCHUNKED_TOKEN_BUDGET = 2048  # vllm serve's on a CPU, for a server told not to chunk prompts


def server_defaults() -> dict:
    """The engine settings `python -m paged serve` uses unless told otherwise, vllm serve's on a CPU: every prompt
    chunked, prefix caching on, up to 128 sequences. Its token budget (None here) is sized for the machine once the
    model is loaded (serving/token_budget.py), and a step with no decode in it may then run its first prompt whole
    (max_idle_prefill_tokens). `LLM`'s own defaults, for offline batches, are unchanged."""
    return {
        "block_size": 16,
        "num_blocks": None,
        "max_num_seqs": 128,
        "max_num_batched_tokens": None,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
    }


def serving_llm(model="smollm2", **settings):
    """An LLM with the server's defaults (server_defaults), any of them overridden by settings. Returns it and, when
    its token budget was left to the machine (max_num_batched_tokens None), the TokenBudget it was sized to."""
    from paged.engine.llm import LLM

    settings = {**server_defaults(), **settings}
    budget = settings.pop("max_num_batched_tokens")
    if budget is None and not settings["enable_chunked_prefill"]:
        budget = UNCHUNKED_TOKEN_BUDGET  # every prompt must fit one step: no budget sized for short steps
    settings.setdefault("max_idle_prefill_tokens", None if budget else MAX_TOKEN_BUDGET)  # a sized budget's stretch
    llm = LLM(model=model, max_num_batched_tokens=budget or MAX_TOKEN_BUDGET, **settings)
    if budget is not None:
        return llm, None
    sized = size_token_budget(llm.engine)
    llm.engine.set_max_num_batched_tokens(sized.budget)
    return llm, sized


def main(args) -> None:
    """`python -m paged serve`: start the engine core process (serving/engine_core.py), which loads the model; build the app
    over it; serve until interrupted."""
    lora_modules = parse_lora_modules(args.lora_modules or [])
    served_name = args.served_model_name or args.model
    if served_name in lora_modules:  # before the model loads
        raise ValueError(
            f"--lora-modules names an adapter {served_name!r}, the served model's name; requests for "
            f"the base model would run under it. Give the adapter another name"
        )
    lora_kwargs = {}
    if lora_modules:
        lora_kwargs = {
            "enable_lora": True,
            "max_loras": len(lora_modules),
            "max_lora_rank": max(adapter_rank(p) for p in lora_modules.values()),
        }
    settings = dict(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        device=args.device,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        **lora_kwargs,
    )
    client = AsyncMPClient.start(args.model, settings, lora_modules)
    try:
        sized = client.token_budget
        if sized is not None:
            print(
                f"token budget: {sized.budget} tokens a step (here a step takes {sized.fixed * 1e3:.0f} ms + "
                f"{sized.per_token * 1e3:.2f} ms a token; --max-num-batched-tokens sets it)",
                flush=True,
            )
        loopback = args.host in LOOPBACK_HOSTS or args.host.startswith("127.")
        app = build_app(
            client,
            served_name,
            lora_modules,
            args.api_key,
            allowed_hosts=(*LOOPBACK_HOSTS, args.host) if loopback else None,
        )
        print(f"serving {served_name} on http://{args.host}:{args.port}/v1", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        client.shutdown()
