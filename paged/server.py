"""An OpenAI-compatible HTTP server over the paged engine (guide §13: what a user of a serving engine meets).

    python -m paged serve --port 8000 [--api-key KEY] [--lora-modules pirate=adapters/pirate]

FastAPI and uvicorn carry the HTTP; `AsyncLLM` (async_engine.py) steps the engine in a background thread while
requests come and go, so every client shares every step. Routes, as vLLM's server names them:
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
top-p (vLLM's default). A request holds one prompt (a batch of prompts is a 400).
vLLM's extra fields min_p and include_stop_str_in_output mean what they mean in SamplingParams.

With `stream: true` the answer is server-sent events, one chunk per engine step that produced text, then
`data: [DONE]`. A client that disconnects aborts its request: its blocks go back to the pool at once.
Every bad request gets HTTP 400 with OpenAI's error object {"error": {"message", "type", "param", "code"}},
`param` naming the field; with --api-key, a request to /v1 without `Authorization: Bearer KEY` gets 401.
"""

import asyncio
import collections
import contextlib
import json
import re
import socket
import threading
import time
import uuid
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .async_engine import AsyncLLM, StreamOutput
from .lora import LoRARequest
from .sampling import Logprob, SamplingParams

# ---- requests ---------------------------------------------------------------------------------------------

Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's and vLLM's servers do."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    user: StrictStr | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None          # the N most likely tokens at each position, besides the chosen one


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False               # each token's log-probability
    top_logprobs: StrictInt | None = None      # and its N most likely alternatives (needs logprobs)


class BadRequest(Exception):
    """A request the server refuses with HTTP 400; param names the field at fault."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


def error_response(message: str, param: str | None, status: int = 400,
                   kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error object."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


def field_of(message: str) -> str | None:
    """The request field a ValueError from the engine names: its messages begin with the argument's name."""
    word = re.match(r"[a-z_]+", message)
    return word.group(0) if word and word.group(0) in REQUEST_FIELDS else None


# ---- log-probabilities in OpenAI's two shapes ------------------------------------------------------------------


def token_text(token_id: int, logprob: Logprob) -> str:
    """A token as OpenAI's logprobs name it: its text, or vLLM's "token_id:N" when there is no tokenizer."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(entries: list[dict[int, Logprob]], text_offset: int) -> tuple[dict, int]:
    """/v1/completions' logprobs for some tokens (an entry each: the chosen token first, then the most likely):
    their texts, their log-probabilities, a map of each position's alternatives, and where each token's text
    begins, counted from text_offset. Returns it and the offset after the last token."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        chosen_id, chosen = next(iter(entry.items()))
        tokens.append(token_text(chosen_id, chosen))
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({token_text(i, lp): lp.logprob for i, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, text_offset


def chat_logprobs(entries: list[dict[int, Logprob]], num_top: int) -> dict:
    """/v1/chat/completions' logprobs: per token its text, log-probability and UTF-8 bytes, and the num_top most
    likely tokens at its position in the same form."""
    def item(token_id: int, logprob: Logprob) -> dict:
        text = token_text(token_id, logprob)
        return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        chosen_id, chosen = next(iter(entry.items()))
        ranked = sorted(entry.items(), key=lambda pair: pair[1].rank)[:num_top]
        content.append({**item(chosen_id, chosen), "top_logprobs": [item(i, lp) for i, lp in ranked]})
    return {"content": content, "refusal": None}


# ---- metrics ----------------------------------------------------------------------------------------------

KEEP_FINISHED = 1024   # finished requests whose engine timestamps ServerMetrics.finished keeps, for a notebook
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """A Prometheus registry of the server's own, with vLLM's metric names, fed by the engine loop's thread."""

    def __init__(self, model_name: str):
        disable_created_metrics()   # no *_created samples beside each counter and histogram
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", **labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", **labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", **labels)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      **labels)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", **labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", **labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated by finished requests",
                                         **labels)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted (sent back to wait)", **labels)
        self.success = Counter("vllm:request_success", "Requests finished", **labels)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              **labels)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Mean gap between a request's output tokens", buckets=LATENCY_BUCKETS, **labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Each gap between two output tokens",
                             buckets=LATENCY_BUCKETS, **labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, **labels)
        self.model_name = model_name
        self.finished = collections.OrderedDict()   # request id -> engine timestamps, the last KEEP_FINISHED
        for metric in self.registry._names_to_collectors.values():   # every series shows from the start, at 0
            metric.labels(model_name)
        self._seen = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "num_preemptions": 0}

    def on_step(self, engine, finished: list[StreamOutput]) -> None:
        name = self.model_name
        stats = engine.kv_stats()
        self.running.labels(name).set(stats["num_running"])
        self.waiting.labels(name).set(stats["num_waiting"])
        self.kv_usage.labels(name).set(stats["usage"])
        for key, counter in (("prefix_query_tokens", self.prefix_queries), ("prefix_hit_tokens", self.prefix_hits),
                             ("num_preemptions", self.preemptions)):
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
            gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
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


def build_app(llm, model_name: str = "smollm2", lora_modules: dict[str, str] | None = None,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving `llm` (a paged.LLM; made with enable_lora=True if lora_modules are given)
    under `model_name`, each adapter of lora_modules {name: folder} as a model of its own."""
    lora_modules = dict(lora_modules or {})
    if lora_modules and llm.engine.lora is None:
        raise ValueError("lora_modules needs an LLM made with enable_lora=True")
    adapters = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(lora_modules.items())}
    for adapter in adapters.values():   # read and checked now, before the engine loop owns the engine
        llm.engine.lora.resolve(adapter)
    metrics = ServerMetrics(model_name)
    engine = llm.engine
    tokenizer = llm.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.async_llm = AsyncLLM(engine, on_step=metrics.on_step)
        yield
        app.state.async_llm.shutdown()

    app = FastAPI(title="paged", lifespan=lifespan)
    app.state.metrics = metrics

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response("missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                      None, 401, "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        errors = error.errors()
        if errors[0].get("type") == "json_invalid":
            return error_response(f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                                  None)

        def loc(e):   # the path inside the body; pydantic also names each branch of a union it tried (a str)
            return [part for part in e.get("loc", ()) if part != "body"]

        # the first field at fault; of the branches tried for it, one that reached an element of a list
        same_field = [e for e in errors if loc(e)[:1] == loc(errors[0])[:1]]
        first = max(same_field, key=lambda e: any(isinstance(part, int) for part in loc(e)))
        path = loc(first)
        index = next((part for part in path[1:] if isinstance(part, int)), None)
        param = (f"{path[0]}" + (f"[{index}]" if index is not None else "")) if path else None
        return error_response(f"{param or 'body'}: {first.get('msg')} (got {first.get('input')!r:.80})", param)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return error_response(error.message, error.param)

    @app.get("/health")
    async def health():
        running = app.state.async_llm.is_running
        return JSONResponse({} if running else {"error": "the engine loop has stopped"},
                            status_code=200 if running else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        cards = [{"id": model_name, "object": "model", "created": created, "owned_by": "paged",
                  "root": model_name, "parent": None, "max_model_len": engine.max_model_len}]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "paged",
                   "root": adapter.lora_path, "parent": model_name} for name, adapter in adapters.items()]
        return {"object": "list", "data": cards}

    def sampling_params(body: _Common, max_tokens: int | None) -> SamplingParams:
        if body.model != model_name and body.model not in adapters:
            raise BadRequest(f"model {body.model!r} is not served here; the models are "
                             f"{[model_name, *adapters]}", "model")
        kwargs = {"n": body.n, "ignore_eos": body.ignore_eos, "seed": body.seed,
                  "stop_token_ids": body.stop_token_ids or [], "logprobs": body.logprobs,
                  "include_stop_str_in_output": body.include_stop_str_in_output}
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
        except ValueError as error:
            field = field_of(str(error))
            if field == "logprobs" and isinstance(body, ChatCompletionRequest):   # chat's count is top_logprobs
                raise BadRequest(str(error).replace("logprobs", "top_logprobs", 1), "top_logprobs") from None
            raise BadRequest(str(error), field) from None

    async def start(body: _Common, prompt, max_tokens: int | None, request_id: str):
        params = sampling_params(body, max_tokens)
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if any(not s for s in stop):
            raise BadRequest("stop strings must not be empty", "stop")
        try:
            return params, await app.state.async_llm.add_request(
                prompt, params, request_id, adapters.get(body.model), tuple(stop), fill_max_tokens=max_tokens is None)
        except ValueError as error:
            message = str(error)
            raise BadRequest(message, field_of(message) if not message.startswith("prompt") else
                             ("messages" if isinstance(body, ChatCompletionRequest) else "prompt")) from None

    async def collect(request: Request, stream):
        """Every output of a non-streamed request; if the client disconnects first, the request is aborted."""
        async def gather():
            return [output async for output in app.state.async_llm.stream_outputs(stream)]

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.create_task(gather()), asyncio.create_task(disconnected())
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()   # stream_outputs aborts the request as it closes
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return None
        watch.cancel()
        return work.result()

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(chunk: dict) -> str:
        return f"data: {json.dumps(chunk)}\n\n"

    async def respond(request: Request, body: _Common, prompt, max_tokens, chat: bool):
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        params, stream = await start(body, prompt, max_tokens, request_id)
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": body.model}
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        text_offsets = collections.defaultdict(int)   # completions' text_offset, per choice, across chunks

        def logprobs_of(index: int, entries) -> dict | None:
            if entries is None:
                return None
            if chat:
                return chat_logprobs(entries, params.logprobs)
            shaped, text_offsets[index] = completion_logprobs(entries, text_offsets[index])
            return shaped

        def choice(delta, first: bool) -> dict:
            out = {"index": delta.index, "logprobs": logprobs_of(delta.index, delta.logprobs),
                   "finish_reason": delta.finish_reason}
            if chat:
                out["delta"] = ({"role": "assistant", "content": delta.text} if first else
                                {"content": delta.text} if delta.text or delta.finish_reason is None else {})
            else:
                out["text"] = delta.text
            if body.return_token_ids:
                out["token_ids"] = delta.token_ids
            return out

        if body.stream:
            async def events():
                started = set()
                num_prompt, num_out, done = 0, 0, False
                try:
                    async for output in app.state.async_llm.stream_outputs(stream):
                        num_prompt = output.num_prompt_tokens
                        num_out += sum(len(d.token_ids) for d in output.completions)
                        choices = []
                        for delta in output.completions:
                            choices.append(choice(delta, delta.index not in started))
                            started.add(delta.index)
                        done = output.finished
                        yield sse({**head, "choices": choices, "usage": None})
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage(num_prompt, num_out)})
                except Exception as error:   # the engine failed mid-answer: say so in the stream
                    yield sse({"error": {"message": f"the engine failed: {error}", "type": "internal_error",
                                         "param": None, "code": 500}})
                finally:   # closed early: the client went away
                    if not done:
                        app.state.async_llm.abort(request_id)
                yield "data: [DONE]\n\n"
            return ClosingStreamingResponse(events(), media_type="text/event-stream")

        try:
            outputs = await collect(request, stream)
        except Exception as error:
            return error_response(f"the engine failed: {error}", None, 500, "internal_error")
        if outputs is None:   # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        texts, token_ids, logprobs, reasons = {}, {}, {}, {}
        for output in outputs:
            for delta in output.completions:
                texts[delta.index] = texts.get(delta.index, "") + delta.text
                token_ids.setdefault(delta.index, []).extend(delta.token_ids)
                logprobs.setdefault(delta.index, []).extend(delta.logprobs or [])
                reasons[delta.index] = delta.finish_reason or reasons.get(delta.index)
        choices = []
        for index in sorted(texts):
            item = {"index": index, "logprobs": logprobs_of(index, logprobs[index] if params.logprobs is not None
                                                            else None), "finish_reason": reasons[index]}
            if chat:
                item["message"] = {"role": "assistant", "content": texts[index]}
            else:
                item["text"] = texts[index]
            if body.return_token_ids:
                item["token_ids"] = token_ids[index]
            choices.append(item)
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": body.model, "choices": choices,
                "usage": usage(outputs[-1].num_prompt_tokens, sum(map(len, token_ids.values())))}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await respond(request, body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise BadRequest("messages: this model has no chat template; use /v1/completions", "messages")
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False,
                                               add_generation_prompt=True)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, prompt, max_tokens, chat=True)

    return app


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
    """The rank r an adapter folder's adapter_config.json declares."""
    with open(f"{path}/adapter_config.json") as f:
        return int(json.load(f)["r"])


def main(args) -> None:
    """`python -m paged serve`: load the model, build the app, serve until interrupted."""
    from . import LLM

    lora_modules = parse_lora_modules(args.lora_modules or [])
    lora_kwargs = {}
    if lora_modules:
        lora_kwargs = {"enable_lora": True, "max_loras": len(lora_modules),
                       "max_lora_rank": max(adapter_rank(p) for p in lora_modules.values())}
    llm = LLM(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
              device=args.device, seed=args.seed, **lora_kwargs)
    app = build_app(llm, args.served_model_name or args.model, lora_modules, args.api_key)
    print(f"serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
