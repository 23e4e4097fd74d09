"""The engine behind a server (guide §13): requests arrive and leave while one loop keeps stepping.

`AsyncLLM` wraps an `LLMEngine` for asyncio code. One background thread owns the engine: it takes new requests
and aborts from a thread-safe inbox, runs `step()` while anything is unfinished, and after each step hands every
request's new token ids to that request's asyncio queue. Every request in flight shares every step, whoever sent it
(continuous batching, guide §11, now across clients). The loop does nothing else: turning token ids into text and
finding stop strings happens on the consumer's side, in its event loop, while the loop runs the next step (vLLM V1
splits its engine core and its output processor the same way, across processes).

    llm = AsyncLLM(engine)
    async for out in llm.generate(prompt, SamplingParams(max_tokens=32)):
        print(out.completions[0].text, end="")     # the text this step added (a delta)

What the loop guarantees:
  - the engine is touched only from the loop's thread, so nothing in it needs a lock;
  - text is decoded incrementally and a delta never ends inside a multi-byte character (a token holding half of
    one waits for the next token);
  - stop strings end a completion here: its text is cut before the string (engine/stop_strings.py, as offline), and its
    sequence is aborted in the engine (blocks freed) before the loop's next step begins, or the one after if that
    step had begun, while the request's other completions go on;
  - a consumer that stops listening (a client that disconnects, a cancelled task) aborts its request, and its
    blocks go back to the pool before the next step;
  - if a step raises, the engine has put itself back as it was (LLMEngine.transaction); the requests in flight
    are aborted and each waiting consumer receives the error instead of waiting forever, while requests that
    arrive meanwhile are served as usual.
"""

import asyncio
import collections
import dataclasses
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from paged.core.sequence import RequestMetrics, Sequence
from paged.engine.llm_engine import LLMEngine
from paged.engine.metrics import StepRecord, read_step
from paged.engine.stop_strings import check_stop_strings, stop_hold_back
from paged.sampling_params import Logprob, SamplingParams
from paged.validation import ArgumentError, prompt_token_ids

IDLE_POLL_S = 0.5  # an idle loop wakes this often to notice a shutdown
NUM_TRACED_STEPS = 4096  # the loop keeps the record of this many of its latest steps (AsyncLLM.steps)


@dataclass
class CompletionDelta:
    """What one completion gained in one step."""

    index: int
    text: str  # new text, whole characters only
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # "stop" or "length" on its last delta, else None
    logprobs: list[dict[int, Logprob]] | None = None  # one per new token, when SamplingParams.logprobs asked


@dataclass
class StreamOutput:
    """One step's news for one request. The last one has finished=True, and the request's engine timestamps when
    the engine had ended it by then (a stop string the consumer finds ends it in the engine a step later; the
    metrics hook gets its timestamps then); the first one carries the prompt's log-probabilities when the request
    asked for them."""

    request_id: str
    num_prompt_tokens: int
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics | None = None  # engine clock (time.perf_counter): arrival, first token, each token
    completion_token_times: list[list[float]] | None = None  # with metrics: each completion's own token times
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # RequestOutput.prompt_logprobs' shape
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's num_cached_tokens)


@dataclass
class SequenceUpdate:
    """What the loop saw of one completion after a step, before any text (vLLM's EngineCoreOutput, per sequence)."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # the engine's, once the sequence has finished there
    stop_reason: str | int | None


@dataclass
class EngineOutput:
    """One step's news for one request, as the loop hands it over."""

    updates: list[SequenceUpdate]
    num_cached_tokens: int
    prompt_logprobs: list | None = None  # on the first one, when the request asked
    finished: StreamOutput | None = None  # every completion ended in the engine: what the metrics hook saw


@dataclass(frozen=True)
class LoopStep:
    """One turn of the serving loop that ran an engine step: the step itself (metrics.StepRecord: its start and
    duration on the engine's clock, its prompt chunks, decodes and preemptions), the part of it spent in the model's
    forward pass, and the loop's own work that turn around the step (taking arrivals and aborts, handing each
    request its new token ids, the metrics hook), which every stream waits for too."""

    step: StepRecord
    forward_time: float  # seconds of the step inside the model's forward pass
    loop_time: float  # seconds of the turn outside engine.step()
    num_waiting: int  # sequences waiting for a seat after the step
    num_running: int

    @property
    def outside_forward(self) -> float:
        """Seconds of the turn not spent in the forward pass: scheduling, inputs, sampling, the loop's own work."""
        return self.step.duration - self.forward_time + self.loop_time


class IncrementalDetokenizer:
    """Text of a growing list of token ids, delta by delta. Each call decodes only a short window: the tokens
    since the last emitted text plus a few before them, which the tokenizer needs to place spaces. A window
    ending in the replacement character holds a partial UTF-8 sequence, so its text waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are never decoded again
        self.read_offset = 0  # tokens before it have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """The text new_ids add; with final=True whatever is held back comes out too."""
        self.token_ids += new_ids
        if self.tokenizer is None:
            return ""
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return after[len(before) :]
        return ""


class CompletionTracker:
    """The loop's view of one completion: the tokens sent, its text, its stop strings (engine/stop_strings.py). With stop
    strings cut from the text, the last (longest stop string - 1) characters are held back until the next token
    shows they do not begin one."""

    def __init__(
        self, tokenizer, stop: tuple[str, ...], logprobs: bool = False, include_stop_str_in_output: bool = False
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output  # vLLM's: a stop string's or token's text stays
        self.logprobs = logprobs  # pass on the sequence's log-probabilities with its tokens
        self.hold = stop_hold_back(stop, include_stop_str_in_output)
        self.text = ""  # decoded so far
        self.num_emitted = 0  # characters of text already sent
        self.finish_reason: str | None = None

    def advance(self, update: SequenceUpdate) -> CompletionDelta | None:
        """The delta an update makes, or None if nothing changed (or the completion had already ended)."""
        if self.finish_reason is not None:
            return None
        new_ids, finish = update.new_token_ids, update.finish_reason
        if not new_ids and finish is None:
            return None
        logprobs = update.new_logprobs if self.logprobs else None
        searched = len(self.text)
        text_ids = new_ids
        stopped_at_token = finish == "stop" and update.stop_reason is None  # not at a stop string the engine found
        if stopped_at_token and new_ids and not self.include_stop_str_in_output:
            text_ids = new_ids[:-1]
        self.text += self.detokenizer.push(text_ids, final=finish is not None)
        end = len(self.text) if finish is not None else len(self.text) - self.hold
        found = check_stop_strings(self.text, len(self.text) - searched, self.stop, self.include_stop_str_in_output)
        if found is not None:  # a stop string, perhaps straddling old and new text
            self.text, end, finish = self.text[: found[1]], found[1], "stop"
        delta = self.text[self.num_emitted : max(end, self.num_emitted)]
        self.num_emitted += len(delta)
        self.finish_reason = finish
        return CompletionDelta(update.index, delta, new_ids, finish, logprobs)


@dataclass
class AddRequest:
    """A request on its way to the loop: what it needs to make the engine's Request (picklable: it may cross to the
    engine core's process)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    lora_request: object
    fill_max_tokens: bool
    arrival_time: float  # engine clock (time.perf_counter), when add_request was called


class _Stream:
    """One request as its consumer sees it: the completions' text and stop strings, and where its outputs go."""

    def __init__(self, request_id: str, params: SamplingParams, stop: tuple[str, ...], tokenizer, loop):
        self.request_id = request_id
        self.loop = loop
        self.accepted = loop.create_future()  # resolved when the engine took it (its prompt's length), or an error
        self.queue: asyncio.Queue = asyncio.Queue()
        self.completions = [
            CompletionTracker(
                tokenizer, stop + tuple(params.stop), params.logprobs is not None, params.include_stop_str_in_output
            )
            for _ in range(params.n)
        ]
        self.num_prompt_tokens = 0

    def send(self, item) -> None:
        """From another thread to the consumer's event loop (an output, or an exception to raise there)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop has closed: nobody is listening
            pass


class _Running:
    """One request as the loop tracks it: its engine Request and what of it has been handed over."""

    def __init__(self, request):
        self.request = request
        n = request.params.n
        self.token_times: list[list[float]] = [[] for _ in range(n)]  # engine clock: each completion's tokens
        self.num_outputs = 0  # EngineOutputs sent


class EngineLoop:
    """The loop that owns an engine (vLLM V1's engine core busy loop): it takes requests and aborts from its inbox,
    runs `step()` while anything is unfinished, and after each step emits each request's new token ids. It emits
    messages through `emit`, a function of one tuple, from its own thread:
        ("accepted", request_id, error or None, number of prompt tokens)
        ("outputs", [(request_id, EngineOutput), ...])   after a step: each request that gained something
        ("failed", request_id, error)          a step failed (and was undone): the request is aborted
        ("stats", engine.kv_stats(), [StreamOutput of each request that ended])   after each turn that did anything,
                                                                                   when made with stats=True
    In a thread of the server's process (AsyncLLM) or in a process of its own (serving/engine_core.py), the same loop."""

    def __init__(self, engine: LLMEngine, emit, stats: bool = True):
        self.engine, self.emit, self.stats = engine, emit, stats
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.steps: collections.deque[LoopStep] = collections.deque(maxlen=NUM_TRACED_STEPS)  # the latest, in order
        self._running: dict[str, _Running] = {}

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put(("wake", None))

    def run(self) -> None:
        while not self.stopped.is_set():
            messages = []
            if not self.engine.has_unfinished_requests():  # idle: wait for something to arrive
                try:
                    messages.append(self.inbox.get(timeout=IDLE_POLL_S))
                except queue.Empty:
                    continue
            while True:
                try:
                    messages.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            turn_start = time.perf_counter()
            ended = []  # requests whose last completion a stop string aborted
            for kind, payload in messages:
                if kind == "add":
                    self._add(payload)
                elif kind == "abort":
                    self._abort(payload)
                elif kind == "abort_sequence":
                    ended += self._abort_sequence(*payload)
            news, step, step_time = [], None, 0.0
            if self.engine.has_unfinished_requests():
                step_start, clock_start = time.perf_counter(), self.engine.clock()
                try:
                    outputs = self.engine.core_step()
                except Exception as error:  # the step was undone; nobody may wait on it forever
                    self._fail_running(error)
                else:
                    step_time = time.perf_counter() - step_start
                    step = read_step(self.engine, self.engine.num_steps, clock_start, step_time, outputs.finished)
                    news = self._collect(outputs.new_tokens)
            if self.stats and (messages or news):  # first: when a client has its last token, /metrics counts it
                self.emit(
                    (
                        "stats",
                        self.engine.kv_stats(),
                        ended + [output.finished for _, output in news if output.finished is not None],
                    )
                )
            if news:
                self.emit(("outputs", news))
            if step is not None:
                scheduler = self.engine.scheduler
                self.steps.append(
                    LoopStep(
                        step,
                        self.engine.model_runner.last_forward_time,
                        time.perf_counter() - turn_start - step_time,
                        len(scheduler.waiting) + len(scheduler.swapped),
                        len(scheduler.running),
                    )
                )
        self._fail_all(RuntimeError("the engine loop has stopped"))

    def _add(self, add: AddRequest) -> None:
        try:
            token_ids = prompt_token_ids(add.prompt, self.engine.tokenizer)
            params = add.params
            room = self.engine.max_model_len - len(token_ids)
            if room < 1:  # the prompt alone: no max_tokens could help
                self.engine.config.check_prompt(token_ids, 1)
            if add.fill_max_tokens:  # what the context leaves, and the pool: a request must fit it whole
                stats = self.engine.kv_stats()
                pool_room = stats["num_blocks"] * stats["block_size"] - len(token_ids)
                params = dataclasses.replace(params, max_tokens=max(1, min(room, pool_room)))
            elif token_ids and params.max_tokens > room:
                raise ArgumentError(
                    "max_tokens",
                    f"max_tokens ({params.max_tokens}) + the prompt ({len(token_ids)} "
                    f"tokens) is more than the model's context of "
                    f"{self.engine.max_model_len} tokens (max_model_len); lower "
                    f"max_tokens to at most {max(room, 0)}",
                )
            request = self.engine.make_request(token_ids, params, add.request_id, add.lora_request)
            request.metrics.arrival_time = add.arrival_time
            self.engine.add_request(request)
        except Exception as error:  # ValueError for a bad request; anything else is still this request's alone
            self.emit(("accepted", add.request_id, error, 0))
            return
        self._running[add.request_id] = _Running(request)
        self.emit(("accepted", add.request_id, None, len(token_ids)))

    def _abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _abort_sequence(self, request_id: str, index: int) -> list[StreamOutput]:
        """A completion its consumer stopped at a stop string; if it was the request's last, the request is over
        (returned, for the metrics hook)."""
        running = self._running.get(request_id)
        if running is None:
            return []
        self.engine.abort_sequence(request_id, index)
        if not running.request.is_finished:
            return []
        del self._running[request_id]
        return [self._finished_output(request_id, running)]

    def _finished_output(self, request_id: str, running: _Running) -> StreamOutput:
        """A request at its end, with the engine's timestamps, as the metrics hook and the last output carry it."""
        request, metrics = running.request, running.request.metrics
        metrics.finished_time = metrics.finished_time or self.engine.clock()
        return StreamOutput(
            request_id,
            len(request.prompt_token_ids),
            [],
            True,
            dataclasses.replace(metrics, token_times=list(metrics.token_times)),
            [list(times) for times in running.token_times],
            num_cached_tokens=request.num_cached_tokens,
        )

    def _collect(self, new_tokens: list[tuple[Sequence, int]]) -> list[tuple[str, EngineOutput]]:
        """Each request's new token ids this step (from what the step returned), to be sent; a request that ended
        leaves the loop. No text: the consumers decode it (AsyncLLM._process)."""
        by_request: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, num_new in new_tokens:
            by_request.setdefault(seq.request.request_id, []).append((seq, num_new))
        news = []
        for request_id, seqs in by_request.items():
            running = self._running[request_id]
            request, updates = running.request, []
            for seq, num_new in sorted(seqs, key=lambda pair: pair[0].index):
                running.token_times[seq.index] += request.metrics.token_times[-1:] * num_new  # one step's time
                updates.append(
                    SequenceUpdate(
                        seq.index,
                        seq.output_token_ids[-num_new:],
                        seq.logprobs[-num_new:] if seq.params.logprobs is not None else None,
                        seq.finish_reason if seq.is_finished else None,
                        seq.stop_reason,
                    )
                )
            output = EngineOutput(updates, request.num_cached_tokens)
            if running.num_outputs == 0 and request.params.prompt_logprobs is not None:  # the prompt is done by now
                output.prompt_logprobs = [None, *request.prompt_logprobs]
            running.num_outputs += 1
            if request.is_finished:
                output.finished = self._finished_output(request_id, running)
                del self._running[request_id]
            news.append((request_id, output))
        return news

    def _fail_running(self, error: BaseException) -> None:
        """A step failed (and was undone): the requests it held are aborted with the error. Requests still in the
        inbox did not take part in it, and are added next round."""
        for request_id in list(self._running):
            self.engine.abort_request(request_id)
            self.emit(("failed", request_id, error))
        self._running.clear()

    def _fail_all(self, error: BaseException) -> None:
        self._fail_running(error)
        while True:  # requests that never reached the engine
            try:
                kind, payload = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self.emit(("accepted", payload.request_id, error, 0))


class AsyncLLM:
    """An engine's loop fed and read from asyncio. AsyncLLM(engine) runs the EngineLoop in a background thread of
    this process; engine_core.AsyncMPClient runs it in a process of its own, behind the same methods.
    `on_step(stats, finished)` runs after each turn of the loop that did anything, before that turn's outputs are
    handed out (stats: engine.kv_stats(); finished: the StreamOutputs of requests that ended); the server updates
    its Prometheus metrics there. A request's arrival time is when add_request was called, on the engine's clock
    (time.perf_counter): the wait for a step in progress to end counts in its TTFT, as it does for the user."""

    def __init__(self, engine: LLMEngine, on_step=None):
        self.on_step = on_step
        self.tokenizer, self.max_model_len, self.vocab_size = (
            engine.tokenizer,
            engine.max_model_len,
            engine.config.vocab_size,
        )
        self._streams: dict[str, _Stream] = {}  # requests whose consumer still listens
        self._closed = threading.Event()
        self.engine = engine
        self._core = EngineLoop(engine, self._dispatch, stats=on_step is not None)
        self._inbox = self._core.inbox
        self.steps = self._core.steps
        self._thread = threading.Thread(target=self._core.run, name="paged-engine-loop", daemon=True)
        self._thread.start()

    # ---- how the loop is reached (a thread here; a process in serving/engine_core.py) --------------------------------

    def _send(self, message) -> None:
        self._inbox.put(message)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed.is_set()

    def check_health(self) -> None:
        """A RuntimeError saying why, if the engine can no longer run a step."""
        self.engine.check_health()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: requests still in flight are aborted and their consumers get an error."""
        self._closed.set()
        self._core.stop()
        self._thread.join(timeout)

    # ---- the asyncio side -------------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request=None,
        stop: tuple[str, ...] = (),
        fill_max_tokens: bool = False,
    ) -> _Stream:
        """Hand a request to the loop and wait until the engine has taken it. Raises the engine's ValueError if it
        cannot be served (nothing is then queued). fill_max_tokens=True replaces params.max_tokens by what the
        model's context (and the KV pool) leave after the prompt, OpenAI's default for chat; otherwise a prompt
        plus max_tokens beyond the context is refused. A text prompt is tokenized by the loop: a server
        tokenizes it beforehand (off the loop) and passes token ids. A stop
        token's text (one of stop_token_ids') is left out of the text unless params.include_stop_str_in_output,
        as vLLM does."""
        if self._closed.is_set() or not self.is_running:
            raise RuntimeError("the engine loop has stopped")
        if request_id in self._streams:
            raise ArgumentError("request_id", f"request_id {request_id!r} is already in use")
        stream = _Stream(
            request_id or uuid.uuid4().hex, params, tuple(stop), self.tokenizer, asyncio.get_running_loop()
        )
        self._streams[stream.request_id] = stream
        arrival = time.perf_counter()  # it arrived now, though the loop may be in a step
        self._send(("add", AddRequest(stream.request_id, prompt, params, lora_request, fill_max_tokens, arrival)))
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the caller left before the engine answered: undo the add, if it happened
            self.abort(stream.request_id)
            raise
        except BaseException:
            self._streams.pop(stream.request_id, None)
            raise
        return stream

    async def stream_outputs(self, stream: _Stream):
        """The request's StreamOutputs as the steps produce them, until the finished one. If the consumer stops
        early (cancelled, or the iterator closed), the request is aborted."""
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                output = self._process(stream, item)
                if output is not None:
                    finished = output.finished
                    yield output
        finally:
            self._streams.pop(stream.request_id, None)
            if not finished:
                self.abort(stream.request_id)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request=None,
        stop: tuple[str, ...] = (),
    ):
        """add_request, then its outputs: an async iterator of StreamOutput."""
        stream = await self.add_request(prompt, params, request_id, lora_request, stop)
        async for output in self.stream_outputs(stream):
            yield output

    def abort(self, request_id: str) -> None:
        """Stop a request (from any thread); its blocks return to the pool before the next step."""
        self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    def _process(self, stream: _Stream, news: EngineOutput) -> StreamOutput | None:
        """The text and stop strings of a step's news, in the consumer's event loop (vLLM's output processor). A
        completion that meets a stop string is aborted in the engine; its text ends before the string."""
        deltas = []
        for update in news.updates:
            completion = stream.completions[update.index]
            delta = completion.advance(update)
            if delta is not None:
                deltas.append(delta)
                if completion.finish_reason is not None and update.finish_reason is None:  # a stop string
                    self._send(("abort_sequence", (stream.request_id, update.index)))
        if not deltas:
            return None
        done = all(c.finish_reason is not None for c in stream.completions)
        output = StreamOutput(
            stream.request_id,
            stream.num_prompt_tokens,
            deltas,
            done,
            prompt_logprobs=news.prompt_logprobs,
            num_cached_tokens=news.num_cached_tokens,
        )
        if done and news.finished is not None:  # the engine ended it too: its timestamps
            output.metrics, output.completion_token_times = news.finished.metrics, news.finished.completion_token_times
        return output

    # ---- what the loop emits, in the loop's thread (or the thread reading the engine core's process) ------------

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "stats":
            if self.on_step is not None:
                try:
                    self.on_step(message[1], message[2])
                except Exception:  # a metrics hook must never stop the serving loop
                    pass
            return
        if kind == "outputs":
            for request_id, output in message[1]:
                stream = self._streams.get(request_id)
                if stream is not None:  # else its consumer has gone
                    stream.send(output)
            return
        stream = self._streams.get(message[1])
        if stream is None:  # its consumer has gone
            return
        if kind == "accepted":
            _, _, error, num_prompt_tokens = message
            stream.num_prompt_tokens = num_prompt_tokens
            stream.loop.call_soon_threadsafe(_settle, stream.accepted, error)
        elif kind == "failed":  # whether it was waiting to be taken or already running
            self._streams.pop(message[1], None)
            stream.loop.call_soon_threadsafe(_settle, stream.accepted, message[2])
            stream.send(message[2])


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller, or already failed with the engine
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
