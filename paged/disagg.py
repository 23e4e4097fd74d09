"""Disaggregated prefill and decode (guide §15, after DistServe and Splitwise): two engines in two processes.

    with DisaggregatedLLM(model="smollm2", block_size=16) as llm:    # the same generate() as LLM
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
        llm.transfer_stats()   # blocks_sent, bytes_sent, seconds

A prefill worker runs every prompt through its own LLMEngine and samples the first token. If that token does not end
the request, its engine's KV connector (`kv_connector.KVProducer`) keeps the blocks the prompt fills and copies them
out at the end of the step, every layer's K and V as one tensor [2, num_layers, num_blocks, block_size, num_kv_heads,
head_dim], which goes to a decode worker over torch.distributed (gloo on a CPU, NCCL between two GPUs); the request
itself (token ids, sampling parameters, metrics) goes over a pipe beside it. The decode worker receives the blocks
into a staging buffer of that shape, gives them to its engine's connector (`kv_connector.KVConsumer`) and adds the
request: the scheduler admits it as any other, and the connector fills the blocks allocated for it before the step.
There the prompt's last token is computed again, for the logits of the first output token, as vLLM V1's decode side
does, and the request decodes to its end. The two run at once: while the decode worker decodes request i, the
prefill worker already prefills request i + 1, so a long prompt never stalls the decode steps of running requests,
which is the whole point.

    caller --requests--> prefill worker --header (pipe) + K/V blocks (torch.distributed)--> decode worker
       ^------------------------ outputs, heartbeats, errors (pipes) ---------------------------/

The caller only supervises: it validates the model and the engine arguments before it spawns anything and every
prompt before anything is sent, collects outputs in prompt order, and watches both processes from the moment they
start. A worker that dies or raises (while starting or later), or says nothing for `timeout` seconds while requests
are in flight, makes the constructor or generate() raise a WorkerError (a RuntimeError) naming it; both workers are
then stopped, so nothing is left running (close() also runs on garbage collection and at interpreter exit).

What matches the colocated LLM: greedy tokens (both engines run the same forward pass; a block arrives bit-exact;
batch composition can change the last bits of a logit, as between two LLM runs with other batch-mates). Seeded
sampling draws from the same stream: the decode worker's sequence seeds its generator as LLM's does and draws the
first token again from it, the token the prefill worker drew. Unseeded sampling uses each worker's own generator, so
it differs from LLM's. One completion per request (n = 1). A sequence the decode worker preempts is recomputed
there, as in LLM.
"""

import dataclasses
import hashlib
import inspect
import multiprocessing.connection
import os
import socket
import time
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm.auto import tqdm

from paged.config import SETTINGS, EngineConfig
from paged.core.sequence import Request, RequestMetrics, RequestOutput
from paged.engine.sampler import decode_logprobs
from paged.geometry import KVGeometry, cdiv
from paged.kv_connector import KVConsumer, KVProducer
from paged.model.attention_backends import ATTENTION_BACKENDS
from paged.model.loader import check_model
from paged.sampling_params import SamplingParams
from paged.validation import as_prompt_list, block_size_of, integer, prompt_token_ids, real

PREFILL_RANK, DECODE_RANK = 0, 1
HEARTBEAT_S = 1.0  # a busy worker says it is alive at least this often

# One direction of the links a handoff may cross between machines' GPUs, in bytes/s (datasheet peaks; a real
# transfer gets less). The handoff of a request costs its prompt's K/V bytes over one of these.
LINKS = {
    "PCIe Gen5 x16": 64e9,  # 32 GT/s x 16 lanes each way, before 128b/130b coding (~63 after)
    "NVLink 4 (H100 SXM)": 450e9,  # 900 GB/s per GPU, both directions together
    "RDMA, 400 Gb/s InfiniBand NDR": 50e9,  # one NIC; a DGX H100 has eight
}


def handoff_seconds(num_bytes: int, link: str) -> float:
    """The time to move num_bytes of K/V over one of LINKS at its peak bandwidth."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {sorted(LINKS)}, got {link!r}")
    return num_bytes / LINKS[link]


class WorkerError(RuntimeError):
    """A worker died, raised, or stopped answering; the pair is closed."""


@dataclasses.dataclass
class Handoff:
    """What travels over the pipe beside a request's K/V blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    num_blocks: int
    digest: str | None  # sha256 of the blocks' bytes as sent, when verify_transfers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kv_digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---- the workers (each in its own process) -------------------------------------------------------------------------


def _build_llm(model_spec, device, config: EngineConfig, model_args: dict, kv_connector):
    from paged.engine.llm import LLM

    if model_spec == "smollm2":
        model = "smollm2"
    else:
        from transformers import AutoModelForCausalLM

        hf_config, state_dict = model_spec
        model = AutoModelForCausalLM.from_config(hf_config)
        model.load_state_dict(state_dict)
    return LLM(model=model, device=device, config=config, kv_connector=kv_connector, **model_args)


def _worker_main(role, model_spec, config, model_args, device, port, num_threads, verify, caller_conn, peer_conn):
    """Entry point of both workers: build the engine, join the process group, serve until told to stop."""
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        connector = KVProducer() if role == "prefill" else KVConsumer()
        llm = _build_llm(model_spec, device, config, model_args, connector)
        backend = "nccl" if torch.device(device).type == "cuda" and torch.cuda.device_count() > 1 else "gloo"
        # A send may wait long for a crowded decode pool to make room; liveness is the caller's watch, not this.
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=PREFILL_RANK if role == "prefill" else DECODE_RANK,
            world_size=2,
            timeout=timedelta(days=1),
        )
        engine = llm.engine
        caller_conn.send(("ready", engine.config))  # completed with the model's limits and the pool's size
        worker = PrefillWorker if role == "prefill" else DecodeWorker
        worker(engine, caller_conn, peer_conn, backend, verify).serve()
        dist.destroy_process_group()
        for space in (engine.swap_space, engine.prefix_tier):  # os._exit below skips the tiers' own clean-up
            if space is not None:
                space.tier.close()
    except BaseException:
        try:
            caller_conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    caller_conn.close()
    os._exit(0)  # skip the interpreter's teardown (seconds of C++ destructors here); nothing is left to flush


class _Worker:
    def __init__(self, engine, caller_conn, peer_conn, backend, verify):
        self.engine, self.caller, self.peer = engine, caller_conn, peer_conn
        self.host_staging = backend == "gloo" and engine.device.type == "cuda"  # gloo moves host tensors only
        self.verify = verify
        self.last_message = time.monotonic()

    def tell_caller(self, *message) -> None:
        self.caller.send(message)
        self.last_message = time.monotonic()

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_message >= HEARTBEAT_S:
            self.tell_caller("alive")


class PrefillWorker(_Worker):
    """Runs each prompt (its engine samples only the first token), then sends the request and its blocks on: its
    engine's KVProducer saved them at the end of the step, for each request whose first token did not end it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.original_params: dict[str, SamplingParams] = {}

    def serve(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests() or self.caller.poll():
                message = self.caller.recv()
                if message[0] == "stop":
                    self.peer.send(("stop",))
                    return
                for request_id, prompt, token_ids, params, arrival in message[1]:
                    self.original_params[request_id] = params
                    request = engine.make_request(token_ids, dataclasses.replace(params, max_tokens=1), request_id)
                    request.prompt, request.metrics.arrival_time = prompt, arrival
                    # decoded elsewhere unless max_tokens or the model's length end it at its first token
                    remote = params.max_tokens > 1 and len(token_ids) + 1 < engine.max_model_len
                    request.kv_transfer_params = {"do_remote_decode": remote}
                    engine.add_request(request)
                continue
            outputs = engine.step()
            sent = {self._send(saved.request, saved.kv) for saved in engine.kv_connector.take_saved()}
            for output in outputs:
                del self.original_params[output.request_id]
                if output.request_id not in sent:
                    self.tell_caller("done", output)  # its first token ended it
            self.heartbeat()

    def _send(self, request, kv: torch.Tensor) -> str:
        """A request to the decode worker: its header over the pipe, its prompt's blocks kv [2, layers, num_blocks,
        block_size, heads, dim] over torch.distributed. Returns its id."""
        if self.host_staging:
            kv = kv.cpu()
        params = self.original_params[request.request_id]
        self.peer.send(
            (
                "handoff",
                Handoff(
                    request.request_id,
                    request.prompt,
                    request.prompt_token_ids,
                    params,
                    request.metrics,
                    kv.shape[2],
                    kv_digest(kv) if self.verify else None,
                ),
            )
        )
        dist.send(kv, dst=DECODE_RANK)
        return request.request_id


class DecodeWorker(_Worker):
    """Takes handed-off requests in as its pool has room for them, and decodes them to the end: its engine's
    KVConsumer holds their blocks until the scheduler admits them, then loads them into the pool."""

    def __init__(self, *args):
        super().__init__(*args)
        self.pending: Handoff | None = None  # announced, its blocks not yet received (no room yet)
        self.stopping = False

    def serve(self) -> None:
        engine = self.engine
        while True:
            if (
                self.pending is None
                and not self.stopping
                and (not engine.has_unfinished_requests() or self.peer.poll())
            ):
                message = self.peer.recv()
                if message[0] == "stop":
                    self.stopping = True
                else:
                    self.pending = message[1]
            if self.pending is not None and self._has_room(self.pending):
                self._receive(self.pending)
                self.pending = None
                continue
            if not engine.has_unfinished_requests():
                if self.pending is not None:
                    raise RuntimeError(
                        f"request {self.pending.request_id} does not fit the idle decode pool "
                        f"(a bug: requests are validated to fit it)"
                    )
                if self.stopping:
                    return
                continue
            for output in engine.step():
                self.tell_caller("done", output)
            self.heartbeat()

    def _has_room(self, handoff: Handoff) -> bool:
        """Whether a seat and the free blocks wait for it, after those the requests already waiting will take."""
        scheduler, manager = self.engine.scheduler, self.engine.block_manager
        if len(scheduler.running) + len(scheduler.waiting) >= scheduler.max_num_seqs:
            return False
        lengths = [seq.num_tokens for seq in scheduler.waiting] + [len(handoff.prompt_token_ids)]
        return sum(cdiv(n + 1, manager.block_size) for n in lengths) <= manager.num_free_blocks  # and a decode step

    def _receive(self, handoff: Handoff) -> None:
        """The request's blocks into a staging buffer, given to the connector; the request into the engine, its
        first token to be sampled here (its metrics keep when it arrived and was first scheduled)."""
        engine = self.engine
        start = time.perf_counter()
        storage = engine.kv_cache.storage  # [2, layers, num_blocks, block_size, heads, dim]
        shape = (2, storage.shape[1], handoff.num_blocks, *storage.shape[3:])
        staging = torch.empty(shape, dtype=storage.dtype, device="cpu" if self.host_staging else storage.device)
        dist.recv(staging, src=PREFILL_RANK)
        seconds = time.perf_counter() - start
        metrics = RequestMetrics(handoff.metrics.arrival_time, handoff.metrics.first_scheduled_time)
        engine.kv_connector.receive(handoff.request_id, staging)
        engine.add_request(
            Request(handoff.request_id, handoff.prompt, handoff.prompt_token_ids, handoff.params, metrics)
        )
        received = kv_digest(staging) if self.verify else None
        self.tell_caller(
            "transfer",
            {
                "request_id": handoff.request_id,
                "num_blocks": handoff.num_blocks,
                "num_bytes": staging.numel() * staging.element_size(),
                "seconds": seconds,
                "sent_digest": handoff.digest,
                "received_digest": received,
            },
        )


# ---- the caller's side ---------------------------------------------------------------------------------------------


def _model_spec(model):
    """What a worker needs to build the model: the bundled model's name, or a transformers Llama's config and
    weights (a spawned process cannot share the caller's module object)."""
    if isinstance(model, str) and model == "smollm2":
        return model
    if isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "model"):
        check_model(model)
        return model.config, {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    raise ValueError(f"model must be 'smollm2' (the bundled model) or a transformers Llama model object, got {model!r}")


def check_engine_args(config, block_size: int, device: torch.device, engine_args: dict) -> tuple[EngineConfig, dict]:
    """Make, in the caller, every check the workers' engines would make on engine_args that needs no engine, so that
    a bad argument is a ValueError naming it before any worker is spawned. config: the model's (a LlamaConfig).
    Returns the engines' EngineConfig and the arguments that build the model (dtype, attention_backend)."""
    from paged.engine.llm import LLM
    from paged.engine.llm_engine import pool_blocks

    parameters = inspect.signature(LLM).parameters
    taken = {"model", "tokenizer", "block_size", "device", "config", "kv_connector"}  # DisaggregatedLLM's own
    for name in engine_args:
        if name not in parameters or name in taken:
            raise ValueError(
                f"{name!r} is not an engine argument of DisaggregatedLLM; engine_args may be "
                f"{', '.join(sorted(parameters.keys() - taken))}"
            )
    settings = EngineConfig(block_size=block_size, **{k: v for k, v in engine_args.items() if k in SETTINGS})
    if settings.preemption_mode != "recompute":
        raise ValueError(
            f"preemption_mode {settings.preemption_mode!r} is not available for DisaggregatedLLM; use 'recompute'"
        )
    if settings.enable_lora:
        raise ValueError("enable_lora is not available for DisaggregatedLLM: its generate() takes no lora_request")
    model_args = {k: v for k, v in engine_args.items() if k not in SETTINGS}
    dtype = model_args.get("dtype")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = model_args.get("attention_backend")
    if backend is not None and backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} or None, got {backend!r}")
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, but the workers run on {device}")
    geometry = KVGeometry.from_config(config, dtype)
    if settings.num_blocks is None:  # the pool must hold a block of this model
        pool_blocks(geometry, settings.kv_cache_memory, block_size)
    settings.offload.check_blocks(geometry.block_bytes(block_size))
    return settings, model_args


def _stop_process(process, grace_s: float) -> None:
    """Wait grace_s for the worker to exit by itself, then kill it (SIGKILL also ends a stopped process)."""
    process.join(grace_s)
    if process.is_alive():
        process.kill()
    process.join()


class DisaggregatedLLM:
    """LLM's generate() over a prefill worker and a decode worker in two processes (see the module docstring).

    engine_args go to both engines (num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, enable_prefix_caching, seed, dtype). timeout: seconds the caller waits for any word
    from the workers while requests are in flight (a busy worker speaks every second) before it gives up and stops
    them; startup_timeout: the same for a worker to build its engine.
    num_threads: torch threads in each worker (None: torch's default); 1 splits a 2-core machine in two.
    verify_transfers: hash every transfer on both sides (transfer_log() shows both digests).
    """

    def __init__(
        self,
        model="smollm2",
        block_size: int = 16,
        *,
        device: str | torch.device | None = None,
        timeout: float = 120.0,
        startup_timeout: float = 600.0,
        num_threads: int | None = 1,
        verify_transfers: bool = False,
        tokenizer=None,
        **engine_args,
    ):
        timeout, startup_timeout = real("timeout", timeout), real("startup_timeout", startup_timeout)
        for name, seconds in (("timeout", timeout), ("startup_timeout", startup_timeout)):
            if seconds <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {seconds}")
        if num_threads is not None:
            num_threads = integer("num_threads", num_threads, low=1)
        block_size = block_size_of(block_size)
        spec = _model_spec(model)
        devices = self._devices(device)
        if spec == "smollm2":
            from transformers import AutoConfig

            from paged.model.loader import convert_gguf_to_cache

            config = AutoConfig.from_pretrained(convert_gguf_to_cache())
        else:
            config = spec[0]
        settings, model_args = check_engine_args(config, block_size, torch.device(devices["prefill"]), engine_args)
        self.timeout = timeout
        self.tokenizer = tokenizer
        if spec == "smollm2" and tokenizer is None:
            from transformers import AutoTokenizer

            from paged.model.loader import convert_gguf_to_cache

            self.tokenizer = AutoTokenizer.from_pretrained(convert_gguf_to_cache())
        self._processes, self._conns, self._log, self._closed = {}, {}, [], False
        self._grace_s = [5.0]  # how long close() waits for a worker to stop by itself; short after a failure
        self._request_counter = 0
        context = mp.get_context("spawn")
        peer_prefill, peer_decode = context.Pipe()
        port = free_port()
        for role, peer in (("prefill", peer_prefill), ("decode", peer_decode)):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_worker_main,
                name=f"paged-{role}-worker",
                daemon=True,
                args=(
                    role,
                    spec,
                    settings,
                    model_args,
                    devices[role],
                    port,
                    num_threads,
                    verify_transfers,
                    theirs,
                    peer,
                ),
            )
            self._processes[role], self._conns[role] = process, ours
        for process in self._processes.values():
            process.start()
        self._finalizer = weakref.finalize(
            self, DisaggregatedLLM._shutdown, self._processes, self._conns, self._grace_s
        )
        peer_prefill.close(), peer_decode.close()
        try:
            self.configs = self._wait_ready(startup_timeout)
        except BaseException:
            self._abort()
            raise

    @staticmethod
    def _devices(device) -> dict[str, str]:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and torch.cuda.device_count() > 1:
            return {"prefill": "cuda:0", "decode": "cuda:1"}
        return {"prefill": str(device), "decode": str(device)}

    @property
    def pids(self) -> dict[str, int]:
        return {role: process.pid for role, process in self._processes.items()}

    def _wait_ready(self, timeout: float) -> dict[str, EngineConfig]:
        """Each worker's EngineConfig, with its model's limits and its pool's size, as it says it is ready. Both
        are watched from the start: the first to die or raise is named at once, whichever it is (a worker waits
        for its peer to join before it is ready, so one that dies leaves the other waiting, silent)."""
        configs, deadline = {}, time.monotonic() + timeout
        while len(configs) < 2:
            role, kind, payload = self._next_message(
                ("prefill", "decode"), max(deadline - time.monotonic(), 0), "startup_timeout"
            )
            if kind != "ready":
                self._abort()
                raise WorkerError(f"the {role} worker said {kind!r} before it was ready; both workers were stopped")
            configs[role] = payload
        return configs

    def _next_message(
        self, roles=("prefill", "decode"), timeout: float | None = None, timeout_name: str = "timeout"
    ) -> tuple:
        """The next message from one of the workers, as (role, kind, payload); a WorkerError (and both workers
        stopped) if one dies, raises, or none says anything for `timeout` seconds."""
        timeout = self.timeout if timeout is None else timeout
        by_object = {}
        for role in roles:
            by_object[self._conns[role]] = role
            by_object[self._processes[role].sentinel] = role
        ready = multiprocessing.connection.wait(list(by_object), timeout)
        if not ready:
            self._abort()
            raise WorkerError(
                f"no answer from the {' or '.join(roles)} worker in {timeout:g} s "
                f"({timeout_name}); both workers were stopped"
            )
        for obj in ready:  # messages first: a worker that raised says why before it exits
            if obj in self._conns.values():
                role = by_object[obj]
                try:
                    message = obj.recv()
                except (EOFError, OSError):
                    continue
                if message[0] == "error":  # a peer that died is the cause, the error only its echo
                    self._raise_death(wait_s=1.0, roles={"prefill", "decode"} - {role})
                    self._abort()
                    raise WorkerError(f"the {role} worker failed; both workers were stopped:\n{message[1]}")
                return role, message[0], (message[1] if len(message) > 1 else None)
        self._raise_death(wait_s=self.timeout)
        self._abort()
        raise WorkerError(
            f"the {' or '.join(roles)} worker closed its pipe but did not exit; both workers were stopped"
        )

    def _raise_death(self, wait_s: float, roles=("prefill", "decode")) -> None:
        """If a worker has exited (or does within wait_s), stop the other and raise a WorkerError naming it."""
        sentinels = {self._processes[role].sentinel: role for role in roles}
        dead = multiprocessing.connection.wait(list(sentinels), wait_s)
        if not dead:
            return
        role = sentinels[dead[0]]
        process = self._processes[role]
        process.join()
        self._abort()
        raise WorkerError(
            f"the {role} worker (pid {process.pid}) died with exit code {process.exitcode}; both workers were stopped"
        )

    # ---- the public API -------------------------------------------------------------------------------------------

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`, as LLM.generate's."""
        if self._closed:
            raise WorkerError("this DisaggregatedLLM is closed (closed by close(), or after a worker failed)")
        prompts = as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        batch = [self._checked(prompt, params) for prompt, params in zip(prompts, sampling_params)]
        if not batch:
            return []
        self._raise_death(wait_s=0)
        try:
            try:
                self._conns["prefill"].send(("requests", batch))
            except OSError:  # its end of the pipe is gone: it died a moment ago
                self._raise_death(wait_s=self.timeout)
                raise
            done: dict[str, RequestOutput] = {}
            with tqdm(total=len(batch), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while len(done) < len(batch):
                    _, kind, payload = self._next_message()
                    if kind == "done":  # the workers have no tokenizer: the text is made here
                        completion = payload.outputs[0]
                        completion.text = self._decode(completion.token_ids)
                        decode_logprobs(completion.logprobs or [], self.tokenizer)
                        done[payload.request_id] = payload
                        bar.update()
                    elif kind == "transfer":
                        self._log.append(payload)
        except BaseException:  # an interrupt must not leave half a batch in the workers
            self._abort()
            raise
        return [done[request_id] for request_id, *_ in batch]

    def _checked(self, prompt, params) -> tuple:
        """One request as the prefill worker takes it, after the checks of both workers' configs: the prefill
        worker runs the prompt and samples one token, the decode worker holds it to its last token."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"n must be 1 for DisaggregatedLLM (one completion per request), got {params.n}")
        token_ids = prompt_token_ids(prompt, self.tokenizer)
        self.configs["prefill"].check_prompt(token_ids, 1, pool="the prefill worker's KV pool")
        self.configs["decode"].check_prompt(token_ids, params.max_tokens, pool="the decode worker's KV pool")
        request_id = str(self._request_counter)
        self._request_counter += 1
        return request_id, prompt if isinstance(prompt, str) else None, token_ids, params, time.perf_counter()

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def transfer_stats(self) -> dict:
        """Totals over every handoff so far: blocks and bytes of K/V moved, and the seconds the decode worker spent
        receiving them into its pool."""
        return {
            "blocks_sent": sum(t["num_blocks"] for t in self._log),
            "bytes_sent": sum(t["num_bytes"] for t in self._log),
            "seconds": sum(t["seconds"] for t in self._log),
        }

    def transfer_log(self) -> list[dict]:
        """One record per handoff: request_id, num_blocks, num_bytes, seconds, and with verify_transfers the
        sha256 of the blocks as the prefill worker sent them and as the decode worker's pool holds them."""
        return [dict(t) for t in self._log]

    def close(self) -> None:
        """Stop both workers (politely, then by force); safe to call twice."""
        self._closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer()

    def _abort(self) -> None:
        """close() after a failure: a worker that does not stop at once is killed."""
        self._grace_s[0] = 0.5
        self.close()

    @staticmethod
    def _shutdown(processes: dict, conns: dict, grace_s: list[float]) -> None:
        try:
            conns["prefill"].send(("stop",))
        except (OSError, ValueError):
            pass
        for process in processes.values():
            if process.pid is not None:
                _stop_process(process, grace_s[0])
        for conn in conns.values():
            conn.close()

    def __enter__(self) -> "DisaggregatedLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
