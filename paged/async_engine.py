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
  - stop strings end a completion here: its text is cut before the string (stop_strings.py, as offline), and its
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

from .engine import LLMEngine
from .metrics import StepRecord, read_step
from .validation import prompt_token_ids
from .sampling import Logprob, SamplingParams
from .sequence import RequestMetrics
from .stop_strings import check_stop_strings, stop_hold_back

IDLE_POLL_S = 0.5   # an idle loop wakes this often to notice a shutdown
NUM_TRACED_STEPS = 4096   # the loop keeps the record of this many of its latest steps (AsyncLLM.steps)


@dataclass
class CompletionDelta:
    """What one completion gained in one step."""
    index: int
    text: str                     # new text, whole characters only
    token_ids: list[int]          # new token ids
    finish_reason: str | None     # "stop" or "length" on its last delta, else None
    logprobs: list[dict[int, Logprob]] | None = None   # one per new token, when SamplingParams.logprobs asked


@dataclass
class StreamOutput:
    """One step's news for one request. The last one has finished=True and the request's engine timestamps; the
    first one carries the prompt's log-probabilities when the request asked for them."""
    request_id: str
    num_prompt_tokens: int
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics | None = None   # engine clock (time.perf_counter): arrival, first token, each token
    completion_token_times: list[list[float]] | None = None   # with metrics: each completion's own token times
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # RequestOutput.prompt_logprobs' shape
    num_cached_tokens: int = 0   # prompt tokens found in the prefix cache (vLLM's num_cached_tokens)


@dataclass
class SequenceUpdate:
    """What the loop saw of one completion after a step, before any text (vLLM's EngineCoreOutput, per sequence)."""
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None     # the engine's, once the sequence has finished there
    stop_reason: str | int | None


@dataclass
class EngineOutput:
    """One step's news for one request, as the loop hands it over."""
    updates: list[SequenceUpdate]
    num_cached_tokens: int
    prompt_logprobs: list | None = None       # on the first one, when the request asked
    finished: StreamOutput | None = None      # every completion ended in the engine: what the metrics hook saw


@dataclass(frozen=True)
class LoopStep:
    """One turn of the serving loop that ran an engine step: the step itself (metrics.StepRecord: its start and
    duration on the engine's clock, its prompt chunks, decodes and preemptions), the part of it spent in the model's
    forward pass, and the loop's own work that turn around the step (taking arrivals and aborts, handing each
    request its new token ids, the metrics hook), which every stream waits for too."""
    step: StepRecord
    forward_time: float     # seconds of the step inside the model's forward pass
    loop_time: float        # seconds of the turn outside engine.step()
    num_waiting: int        # sequences waiting for a seat after the step
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
        self.prefix_offset = 0    # window start: tokens before it are never decoded again
        self.read_offset = 0      # tokens before it have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """The text new_ids add; with final=True whatever is held back comes out too."""
        self.token_ids += new_ids
        if self.tokenizer is None:
            return ""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return after[len(before):]
        return ""


class CompletionTracker:
    """The loop's view of one completion: the tokens sent, its text, its stop strings (stop_strings.py). With stop
    strings cut from the text, the last (longest stop string - 1) characters are held back until the next token
    shows they do not begin one."""

    def __init__(self, tokenizer, stop: tuple[str, ...], logprobs: bool = False,
                 include_stop_str_in_output: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output   # vLLM's: a stop string's or token's text stays
        self.logprobs = logprobs  # pass on the sequence's log-probabilities with its tokens
        self.hold = stop_hold_back(stop, include_stop_str_in_output)
        self.text = ""            # decoded so far
        self.num_emitted = 0      # characters of text already sent
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
        stopped_at_token = finish == "stop" and update.stop_reason is None   # not at a stop string the engine found
        if stopped_at_token and new_ids and not self.include_stop_str_in_output:
            text_ids = new_ids[:-1]
        self.text += self.detokenizer.push(text_ids, final=finish is not None)
        end = len(self.text) if finish is not None else len(self.text) - self.hold
        found = check_stop_strings(self.text, len(self.text) - searched, self.stop, self.include_stop_str_in_output)
        if found is not None:   # a stop string, perhaps straddling old and new text
            self.text, end, finish = self.text[:found[1]], found[1], "stop"
        delta = self.text[self.num_emitted:max(end, self.num_emitted)]
        self.num_emitted += len(delta)
        self.finish_reason = finish
        return CompletionDelta(update.index, delta, new_ids, finish, logprobs)


class _Stream:
    """One request as the loop tracks it: its engine Request, its completions, and where its outputs go."""

    def __init__(self, request_id, prompt, params, lora_request, stop, fill_max_tokens, loop, accepted):
        self.request_id = request_id
        self.prompt, self.params, self.lora_request = prompt, params, lora_request
        self.stop, self.fill_max_tokens = stop, fill_max_tokens
        self.loop = loop
        self.accepted = accepted          # asyncio.Future: resolved when the engine took it, or its ValueError
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request = None
        self.arrival_time: float | None = None   # engine clock, when add_request was called
        self.completions: list[CompletionTracker] = []   # the consumer's: text and stop strings
        self.token_times: list[list[float]] = []   # the loop's, engine clock: when each completion's tokens came
        self.num_sent: list[int] = []              # the loop's: tokens of each completion handed over
        self.finish_sent: list[bool] = []          # the loop's: each completion's end handed over
        self.num_outputs = 0   # EngineOutputs sent

    def send(self, item) -> None:
        """From the loop's thread to the consumer's event loop (an output, or an exception to raise there)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the consumer's event loop has closed: nobody is listening
            pass


class AsyncLLM:
    """An LLMEngine stepped by a background thread, fed and read from asyncio. `on_step(engine, finished)` runs
    in that thread after each step and each round of arrivals and aborts, before the step's outputs are sent
    (finished: the StreamOutputs of requests that ended); the server updates its Prometheus metrics there.
    A request's arrival time is when add_request was called, on the engine's clock: the wait for a step in
    progress to end counts in its TTFT, as it does for the user."""

    def __init__(self, engine: LLMEngine, on_step=None):
        self.engine = engine
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}    # the loop thread's only
        self._stopped = threading.Event()
        self.steps: collections.deque[LoopStep] = collections.deque(maxlen=NUM_TRACED_STEPS)  # the latest, in order
        self._thread = threading.Thread(target=self._run, name="paged-engine-loop", daemon=True)
        self._thread.start()

    # ---- the asyncio side -------------------------------------------------------------------------------

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          lora_request=None, stop: tuple[str, ...] = (), fill_max_tokens: bool = False) -> _Stream:
        """Hand a request to the loop and wait until the engine has taken it. Raises the engine's ValueError if it
        cannot be served (nothing is then queued). fill_max_tokens=True replaces params.max_tokens by what the
        model's context (and the KV pool) leave after the prompt, OpenAI's default for chat; otherwise a prompt
        plus max_tokens beyond the context is refused. A text prompt is tokenized on the loop's thread: a server
        tokenizes it beforehand (off the loop) and passes token ids. A stop
        token's text (one of stop_token_ids') is left out of the text unless params.include_stop_str_in_output,
        as vLLM does."""
        if self._stopped.is_set():
            raise RuntimeError("the engine loop has stopped")
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id or uuid.uuid4().hex, prompt, params, lora_request, tuple(stop),
                         fill_max_tokens, loop, loop.create_future())
        stream.arrival_time = self.engine.clock()   # it arrived now, though the loop may be in a step
        self._inbox.put(("add", stream))
        try:
            await stream.accepted
        except asyncio.CancelledError:   # the caller left before the engine answered: undo the add, if it happened
            self.abort(stream.request_id)
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
            if not finished:
                self.abort(stream.request_id)

    def _process(self, stream: _Stream, news: EngineOutput) -> StreamOutput | None:
        """The text and stop strings of a step's news, in the consumer's event loop (vLLM's output processor). A
        completion that meets a stop string is aborted in the engine; its text ends before the string."""
        deltas = []
        for update in news.updates:
            completion = stream.completions[update.index]
            delta = completion.advance(update)
            if delta is not None:
                deltas.append(delta)
                if completion.finish_reason is not None and update.finish_reason is None:   # a stop string
                    self._inbox.put(("abort_sequence", (stream.request_id, update.index)))
        if not deltas:
            return None
        done = all(c.finish_reason is not None for c in stream.completions)
        output = StreamOutput(stream.request_id, len(stream.request.prompt_token_ids), deltas, done,
                              prompt_logprobs=news.prompt_logprobs, num_cached_tokens=news.num_cached_tokens)
        if done:   # the engine's timestamps: as the loop saw them at the end, or now, if a stop string ended it
            final = news.finished or self._finished_output(stream)
            output.metrics, output.completion_token_times = final.metrics, final.completion_token_times
        return output

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       lora_request=None, stop: tuple[str, ...] = ()):
        """add_request, then its outputs: an async iterator of StreamOutput."""
        stream = await self.add_request(prompt, params, request_id, lora_request, stop)
        async for output in self.stream_outputs(stream):
            yield output

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def abort(self, request_id: str) -> None:
        """Stop a request (from any thread); its blocks return to the pool before the next step."""
        self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: requests still in flight are aborted and their consumers get an error."""
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    # ---- the loop's thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            messages = []
            if not self.engine.has_unfinished_requests():   # idle: wait for something to arrive
                try:
                    messages.append(self._inbox.get(timeout=IDLE_POLL_S))
                except queue.Empty:
                    continue
            while True:
                try:
                    messages.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            turn_start = time.perf_counter()
            ended = []   # requests whose last completion a stop string aborted
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
                    finished = self.engine.step()
                except Exception as error:   # the step was undone; nobody may wait on it forever
                    self._fail_running(error)
                else:
                    step_time = time.perf_counter() - step_start
                    step = read_step(self.engine, self.engine.num_steps, clock_start, step_time, finished)
                    news = self._collect()
            if messages or news:   # the hook first: when a client has its last token, /metrics counts it
                self._notify(ended + [output.finished for _, output in news if output.finished is not None])
            for stream, output in news:
                stream.send(output)
            if step is not None:
                scheduler = self.engine.scheduler
                self.steps.append(LoopStep(step, self.engine.last_forward_time,
                                           time.perf_counter() - turn_start - step_time,
                                           len(scheduler.waiting) + len(scheduler.swapped), len(scheduler.running)))
        self._fail_all(RuntimeError("the engine loop has stopped"))

    def _add(self, stream: _Stream) -> None:
        try:
            token_ids = prompt_token_ids(stream.prompt, self.engine.tokenizer)
            params = stream.params
            room = self.engine.max_model_len - len(token_ids)
            if room < 1:   # the prompt alone: no max_tokens could help
                self.engine.config.check_prompt(token_ids, 1)
            if stream.fill_max_tokens:   # what the context leaves, and the pool: a request must fit it whole
                stats = self.engine.kv_stats()
                pool_room = stats["num_blocks"] * stats["block_size"] - len(token_ids)
                params = dataclasses.replace(params, max_tokens=max(1, min(room, pool_room)))
            elif token_ids and params.max_tokens > room:
                raise ValueError(f"max_tokens ({params.max_tokens}) + the prompt ({len(token_ids)} tokens) is more "
                                 f"than the model's context of {self.engine.max_model_len} tokens (max_model_len); "
                                 f"lower max_tokens to at most {max(room, 0)}")
            request = self.engine.make_request(token_ids, params, stream.request_id, stream.lora_request)
            request.metrics.arrival_time = stream.arrival_time
            self.engine.add_request(request)
        except Exception as error:   # ValueError for a bad request; anything else is still this request's alone
            stream.loop.call_soon_threadsafe(_settle, stream.accepted, error)
            return
        stream.request = request
        stream.completions = [CompletionTracker(self.engine.tokenizer, stream.stop + tuple(params.stop),
                                                params.logprobs is not None, params.include_stop_str_in_output)
                              for _ in range(params.n)]
        stream.token_times = [[] for _ in range(params.n)]
        stream.num_sent, stream.finish_sent = [0] * params.n, [False] * params.n
        self._streams[stream.request_id] = stream
        stream.loop.call_soon_threadsafe(_settle, stream.accepted, None)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _abort_sequence(self, request_id: str, index: int) -> list[StreamOutput]:
        """A completion its consumer stopped at a stop string; if it was the request's last, the request is over
        (returned, for the metrics hook)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return []
        self.engine.abort_sequence(request_id, index)
        if not stream.request.is_finished:
            return []
        del self._streams[request_id]
        return [self._finished_output(stream)]

    def _finished_output(self, stream: _Stream) -> StreamOutput:
        """A request at its end, with the engine's timestamps, as the metrics hook and the last output carry it."""
        request, metrics = stream.request, stream.request.metrics
        metrics.finished_time = metrics.finished_time or self.engine.clock()
        return StreamOutput(stream.request_id, len(request.prompt_token_ids), [], True,
                            dataclasses.replace(metrics, token_times=list(metrics.token_times)),
                            [list(times) for times in stream.token_times],
                            num_cached_tokens=request.num_cached_tokens)

    def _collect(self) -> list[tuple[_Stream, EngineOutput]]:
        """Each request's new token ids this step, to be sent; a request that ended leaves the loop. No text:
        the consumers decode it (AsyncLLM._process)."""
        news = []
        for request_id, stream in list(self._streams.items()):
            request, updates = stream.request, []
            for seq in request.seqs:
                index, sent = seq.index, stream.num_sent[seq.index]
                new_ids = seq.output_token_ids[sent:]
                if not new_ids and (not seq.is_finished or stream.finish_sent[index]):
                    continue
                stream.num_sent[index] += len(new_ids)
                stream.finish_sent[index] = seq.is_finished
                stream.token_times[index] += request.metrics.token_times[-1:] * len(new_ids)   # one step's time
                updates.append(SequenceUpdate(index, new_ids, seq.logprobs[sent:] if seq.params.logprobs is not None
                                              else None, seq.finish_reason if seq.is_finished else None,
                                              seq.stop_reason))
            if not updates:
                continue
            output = EngineOutput(updates, request.num_cached_tokens)
            if stream.num_outputs == 0 and request.params.prompt_logprobs is not None:   # the prompt is done by now
                output.prompt_logprobs = [None, *request.prompt_logprobs]
            stream.num_outputs += 1
            if request.is_finished:
                output.finished = self._finished_output(stream)
                del self._streams[request_id]
            news.append((stream, output))
        return news

    def _fail_running(self, error: BaseException) -> None:
        """A step failed (and was undone): the requests it held are aborted with the error. Requests still in the
        inbox did not take part in it, and are added next round."""
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.send(error)
        self._streams.clear()

    def _fail_all(self, error: BaseException) -> None:
        self._fail_running(error)
        while True:   # requests that never reached the engine
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                payload.loop.call_soon_threadsafe(_settle, payload.accepted, error)

    def _notify(self, finished: list[StreamOutput]) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine, finished)
            except Exception:   # a metrics hook must never stop the serving loop
                pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
