"""The engine in a process of its own behind the server (guide §13; vLLM V1's EngineCore and its client).

A server's process does two kinds of work: the engine's steps, and everything around the requests (HTTP, JSON,
turning token ids into text, server-sent events). In one process both need Python's global interpreter lock, so
every moment the event loop spends on a client is a moment the forward pass waits to run its next operation: under
load the steps grow longer, and every stream waits on them. vLLM V1 splits the two across processes, and so does
`python -m paged serve`:

    server process (uvicorn)                           engine core process
    HTTP, JSON, SSE; text and stop strings    --->     the EngineLoop of engine/async_llm.py: take requests and
    (AsyncMPClient: AsyncLLM's methods)      <---      aborts, step, emit each request's new token ids

They talk over a pipe, in the messages EngineLoop emits and takes (requests, aborts, token ids, the metrics hook's
stats). The engine core loads the model itself, with the server's settings, so nothing large crosses the pipe.
In a notebook or a test, build_app(llm) keeps the loop in a thread of its own process (AsyncLLM), where the engine
can be looked at while it serves.
"""

import multiprocessing
import multiprocessing.connection
import signal
import threading

from paged.engine.async_llm import AsyncLLM, EngineLoop

READY_POLL_S = 1.0  # how often the server checks that the engine core is still alive while it loads
HEALTH_POLL_S = 0.5  # how often the engine core looks for a dead tensor-parallel worker


def run_engine_core(conn, model, settings: dict, lora_modules: dict) -> None:
    """The engine core process: load the model as the server would (serving_llm), tell the server it is ready
    (its limits, the token budget it sized), then run the loop on what arrives until told to stop or until the
    server is gone."""
    from paged.serving.api_server import lora_requests, serving_llm

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it stops this process
    try:
        llm, sized = serving_llm(model, **settings)
        for adapter in lora_requests(lora_modules).values():
            llm.engine.lora.resolve(adapter)
    except Exception as error:
        conn.send(("ready", None, error))
        return
    engine, lock = llm.engine, threading.Lock()

    def emit(message) -> None:
        with lock:
            conn.send(message)

    core = EngineLoop(engine, emit)
    emit(
        (
            "ready",
            {
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.config.vocab_size,
                "token_budget": sized,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            },
            None,
        )
    )
    threading.Thread(target=take_messages, args=(conn, core), daemon=True).start()
    threading.Thread(target=watch_health, args=(engine, core, emit), daemon=True).start()
    try:
        core.run()
    finally:
        llm.shutdown()


def take_messages(conn, core: EngineLoop) -> None:
    """The server's messages into the loop's inbox; the loop stops on "stop" or when the server is gone."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        core.inbox.put(message)
    core.stop()


def watch_health(engine, core: EngineLoop, emit) -> None:
    """Tell the server when the engine can no longer run a step (a tensor-parallel worker died), even while idle."""
    while not core.stopped.wait(HEALTH_POLL_S):
        try:
            engine.check_health()
        except RuntimeError as error:
            emit(("health", str(error)))
            return


def loaded(conn, process) -> tuple:
    """The engine core's "ready" message; a RuntimeError if it dies before sending one."""
    while not conn.poll(READY_POLL_S):
        if not process.is_alive():
            break
    else:
        try:
            return conn.recv()
        except EOFError:  # it died after the poll
            pass
    process.join()
    raise RuntimeError(f"the engine core process exited with code {process.exitcode} while loading")


class AsyncMPClient(AsyncLLM):
    """AsyncLLM's methods over an engine core in its own process (vLLM's AsyncMPClient). Made by `start`, which
    returns once the model is loaded; tokenizer, max_model_len, vocab_size and token_budget come from there."""

    @classmethod
    def start(cls, model, settings: dict, lora_modules: dict | None = None) -> "AsyncMPClient":
        """Start the engine core on `model` with serving_llm's settings and the adapters {name: folder}; raises
        what loading raised there (a ValueError for a bad setting)."""
        from paged.model.loader import model_tokenizer

        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        # not a daemon: a tensor-parallel engine core starts worker processes of its own
        process = context.Process(
            target=run_engine_core,
            args=(child_conn, model, settings, dict(lora_modules or {})),
            name="paged-engine-core",
        )
        process.start()
        child_conn.close()
        _, info, error = loaded(conn, process)
        if error is not None:
            process.join()
            raise error
        client = cls.__new__(cls)
        client._connect(conn, process, info, model_tokenizer(model))
        return client

    def _connect(self, conn, process, info: dict, tokenizer) -> None:
        self.on_step = None
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, info["max_model_len"], info["vocab_size"]
        self.token_budget, self.max_num_batched_tokens = info["token_budget"], info["max_num_batched_tokens"]
        self._streams = {}
        self._closed = threading.Event()
        self._conn, self._core_process, self._send_lock = conn, process, threading.Lock()
        self._exit_lock = threading.Lock()
        self._problem: str | None = None
        self._reader = threading.Thread(target=self._read, name="paged-engine-core-reader", daemon=True)
        self._reader.start()

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the engine core is gone; the reader fails what was waiting on it
                pass

    def _read(self) -> None:
        """What the engine core emits, dispatched as AsyncLLM's loop thread would; when it is gone, every request
        still waiting gets an error."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "health":
                self._problem = message[1]
            else:
                self._dispatch(message)
        error = RuntimeError(f"the engine core process has exited (exit code {self._exit_code(timeout=5)})")
        for request_id in list(self._streams):
            self._dispatch(("failed", request_id, error))

    def _exit_code(self, timeout: float) -> int | None:
        """The engine core's exit code, waiting up to `timeout` seconds for it to exit; None while it runs.

        Its sentinel is ready once it has begun to exit (the process has closed its files), a moment before the
        exit code can be read: join waits out that moment. The threads that ask take turns, since Python's
        multiprocessing keeps no lock of its own: a thread that tries to reap a process another thread has just
        reaped reads "still running"."""
        if not multiprocessing.connection.wait([self._core_process.sentinel], timeout):
            return None
        with self._exit_lock:
            self._core_process.join()
            return self._core_process.exitcode

    @property
    def is_running(self) -> bool:
        return not self._closed.is_set() and self._exit_code(timeout=0) is None

    def check_health(self) -> None:
        if self._problem is not None:
            raise RuntimeError(self._problem)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core: its loop aborts what is in flight, and the process exits."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._send(("stop", None))
        if self._exit_code(timeout) is None:
            self._core_process.terminate()
            self._exit_code(timeout)
        self._conn.close()
