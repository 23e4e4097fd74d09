"""The ranks of a tensor-parallel engine as processes (guide §15): one scheduler, N model shards.

    rank 0 (the engine's own process)          ranks 1 .. N-1 (workers)
    schedule, block tables, step inputs
    broadcast the step  ---------------------> receive the step
    block copies on its pool                   block copies on its pool
    forward on its shard  <-- all-reduces -->  forward on its shard
    sample from the gathered logits

Rank 0 decides everything once; a worker holds no scheduler, no block manager and no request: only its shard of
the weights and a KV pool of its own KV heads, in which it writes and reads at the slots the step tells it. The
block tables it receives are rank 0's, so the same block id means the same tokens on every rank.

On one machine, LLM(tensor_parallel_size=N) spawns the N - 1 workers (torch.multiprocessing) and they find rank 0 on
a loopback port. Across machines, a launcher starts every process with torchrun's environment variables
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE): rank 0 runs the engine (`python -m paged serve
--tensor-parallel-size N`), every other rank runs `python -m paged worker`, which receives its model and settings
from rank 0. (vLLM starts its ranks on other nodes with Ray, or with its own launcher.)

A worker that dies closes its connections: rank 0's next collective fails, and the engine raises an error naming the
rank; a watcher thread notices a spawned worker's exit even while the engine is idle (`check_health`). A step
interrupted between its broadcast and its last collective leaves the ranks out of step; the engine then refuses
further steps, saying so, and a new LLM starts clean. Shutting down (`LLM.shutdown`, or when the LLM is collected
or the interpreter exits) stops every worker.
"""

import contextlib
import datetime
import multiprocessing.connection
import os
import threading
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing

from paged.engine.kv_cache import KVCache
from paged.model.tensor_parallel import TensorParallelGroup

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)  # for every rank to reach rank 0's store
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


class Worker:
    """One rank's shard of the model and its KV pool, and what rank 0 asks of it."""

    def __init__(self, group: TensorParallelGroup, model, kv_cache: KVCache | None = None):
        self.group, self.model, self.kv_cache = group, model, kv_cache

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        model = self.model
        self.kv_cache = KVCache(
            len(model.layers),
            model.num_kv_heads,
            model.head_dim,
            num_blocks,
            block_size,
            dtype=model.dtype,
            device=model.device,
        )

    def execute_model(self, step: dict) -> None:
        """The step's block copies, then the forward pass on this rank's shard (whose logits rank 0 gathers)."""
        step = {
            name: value.to(self.model.device) if isinstance(value, torch.Tensor) else value
            for name, value in step.items()
        }
        if step["blocks_to_copy"]:
            sources, targets = zip(*step["blocks_to_copy"])
            self.kv_cache.copy_blocks(list(sources), list(targets))
        meta = step["meta"]
        meta.__dict__.update(
            {name: value.to(self.model.device) for name, value in vars(meta).items() if isinstance(value, torch.Tensor)}
        )
        self.model.forward(step["input_ids"], step["positions"], meta, self.kv_cache, step["logits_indices"])

    def kv_cache_info(self) -> dict:
        """This rank's pool: which KV heads of the whole model it holds, and its size."""
        shard, pool = self.group.shard, self.kv_cache
        return {
            "rank": self.group.rank,
            "kv_head_ids": list(shard.kv_heads),
            "q_head_ids": list(shard.q_heads),
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "pool_bytes": pool.nbytes,
            "bytes_per_token": pool.nbytes // (pool.num_blocks * pool.block_size),
            "shape": tuple(pool.storage.shape),
        }

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """K and V of these blocks in every layer, [2, layers, len(block_ids), block_size, its KV heads, head_dim],
        on the CPU: what this rank's pool holds for them."""
        return self.kv_cache.storage[:, :, block_ids].cpu()


def run_worker(rank: int, size: int, address: str, port: int, num_threads: int | None = None) -> None:
    """A worker rank's whole life: join rank 0, load its shard, then run what rank 0 broadcasts until told to stop
    (or until rank 0 is gone)."""
    import pickle

    from transformers.utils import logging as hf_logging

    from paged.model.loader import load_model

    hf_logging.disable_progress_bar()  # rank 0 shows how the loading goes
    if num_threads:
        torch.set_num_threads(num_threads)
    store = dist.TCPStore(address, port, size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    init = pickle.loads(store.get("paged/init"))  # what rank 0 put there for every rank
    device = torch.device(init["device"], rank if init["device"] == "cuda" else None)
    group = TensorParallelGroup(rank, size, store, device)
    model, _ = load_model(
        init["model"], None, device, init["dtype"], init["backend"], with_tokenizer=False, tensor_parallel=group
    )
    worker = Worker(group, model)
    while True:
        try:
            kind, method, args = group.receive_object()
        except RuntimeError:  # rank 0 is gone
            return
        if kind == "stop":
            return
        result = getattr(worker, method)(*args)
        if kind == "rpc":
            group.send_to_driver(result)


def spawn_ranks() -> bool:
    """True unless this process was started by a torchrun-style launcher (the other ranks are its business)."""
    return not all(name in os.environ for name in TORCHRUN_VARIABLES)


class Health:
    """Whether the ranks can still run a step, shared with the watcher thread and the finalizer."""

    failure: str | None = None  # why not
    closed: bool = False  # shut down on purpose


class MultiprocExecutor:
    """Rank 0's handle on the other ranks: it broadcasts each step and each call, watches the workers it spawned,
    and stops them. Made by `start`."""

    def __init__(self, group: TensorParallelGroup, processes: list):
        self.group, self.processes = group, processes
        self.local_worker: Worker | None = None  # rank 0's own, set once the engine has its pool
        self.health = Health()
        self._finalizer = weakref.finalize(self, close, self.health, processes)
        if processes:
            threading.Thread(target=watch, args=(self.health, processes), name="paged-tp-watcher", daemon=True).start()

    @classmethod
    def start(cls, size: int, model, dtype, device: torch.device, backend: str) -> "MultiprocExecutor":
        """Rank 0 of `size`: spawn the workers on this machine, or, started by a torchrun-style launcher, wait for
        the ranks it started (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
        import pickle

        if spawn_ranks():
            address, port = "127.0.0.1", 0
        else:
            address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            if (int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])) != (size, 0):
                raise ValueError(
                    f"tensor_parallel_size is {size} and this process is RANK {os.environ['RANK']} of "
                    f"WORLD_SIZE {os.environ['WORLD_SIZE']}: the engine runs on RANK 0 of a world of "
                    f"tensor_parallel_size ranks; the other ranks run `python -m paged worker`"
                )
        store = dist.TCPStore(address, port, size, is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        model_spec = model.cpu() if isinstance(model, torch.nn.Module) else model  # the workers unpickle it
        store.set(
            "paged/init", pickle.dumps({"model": model_spec, "dtype": dtype, "device": device.type, "backend": backend})
        )
        processes = []
        if spawn_ranks():
            context = torch.multiprocessing.get_context("spawn")
            threads = max(1, (os.cpu_count() or 1) // size)
            for rank in range(1, size):
                process = context.Process(
                    target=run_worker, args=(rank, size, address, store.port, threads), name=f"rank {rank}", daemon=True
                )
                process.start()
                processes.append(process)
        try:
            group = TensorParallelGroup(0, size, store, device)
        except BaseException:
            close(Health(), processes)
            raise
        return cls(group, processes)

    def check_health(self) -> None:
        """A RuntimeError saying why, if the ranks can no longer run a step."""
        if self.health.closed:
            raise RuntimeError("the engine's tensor-parallel workers were shut down")
        if self.health.failure is not None:
            raise RuntimeError(f"the tensor-parallel engine cannot run: {self.health.failure}; make a new LLM")

    def _send(self, message) -> None:
        self.check_health()
        try:
            self.group.broadcast_object(message)
        except RuntimeError as error:
            raise self._failed(error) from error

    def _failed(self, error: BaseException) -> RuntimeError:
        """The ranks are out of step (a worker died, or a step was cut short): no further step may run."""
        for process in self.processes:
            process.join(timeout=2)  # a dead worker's exit code
        if self.health.failure is None:
            dead = [p for p in self.processes if p.exitcode is not None]
            self.health.failure = (
                ", ".join(died(p) for p in dead) or f"a step was cut short ({type(error).__name__}: {error})"
            )
        return RuntimeError(f"the tensor-parallel engine cannot run: {self.health.failure}; make a new LLM")

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        self._send(("call", "initialize_cache", (num_blocks, block_size)))

    @contextlib.contextmanager
    def execute_model(self, inputs, blocks_to_copy: list[tuple[int, int]]):
        """Send the step to every worker; inside, rank 0 makes its copies and runs its forward pass. Anything
        raised before rank 0's forward pass ends leaves the ranks out of step: the executor fails."""
        self._send(
            (
                "call",
                "execute_model",
                (
                    {
                        "input_ids": on_cpu(inputs.input_ids),
                        "positions": on_cpu(inputs.positions),
                        "logits_indices": on_cpu(inputs.logits_indices),
                        "blocks_to_copy": list(blocks_to_copy),
                        "meta": meta_on_cpu(inputs.meta),
                    },
                ),
            )
        )
        try:
            yield
        except BaseException as error:
            failure = self._failed(error)
            if isinstance(error, RuntimeError):
                raise failure from error
            raise

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Every rank's answer to Worker.method(*args), rank 0's first (vLLM's collective_rpc)."""
        self._send(("rpc", method, tuple(args)))
        try:
            return [getattr(self.local_worker, method)(*args)] + [
                self.group.receive_from(rank) for rank in range(1, self.group.size)
            ]
        except RuntimeError as error:
            raise self._failed(error) from error

    def shutdown(self) -> None:
        """Tell every worker to stop, then wait for them (idempotent)."""
        if self.health.closed:
            return
        self.health.closed = True
        if self.health.failure is None:
            with contextlib.suppress(RuntimeError):
                self.group.broadcast_object(("stop", None, ()))
            for process in self.processes:
                process.join(timeout=5)
        self._finalizer()


def died(process) -> str:
    return f"tensor-parallel worker {process.name} (pid {process.pid}) died with exit code {process.exitcode}"


def watch(health: Health, processes: list) -> None:
    """Wait for any spawned worker to exit: one that exits before the engine shuts down is named at once."""
    ready = multiprocessing.connection.wait([process.sentinel for process in processes])
    if not health.closed and health.failure is None:
        process = next(p for p in processes if p.sentinel in ready)
        process.join(timeout=1)
        health.failure = died(process)


def close(health: Health, processes: list) -> None:
    """Stop the workers still running (those told to stop have had their time): terminate, then kill."""
    health.closed = True
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on the CPU that owns just its elements: a view of the runner's input buffers would pickle all of
    them."""
    return tensor.cpu().clone() if tensor.device.type == "cpu" else tensor.cpu()


def meta_on_cpu(meta):
    """A copy of AttentionMetadata with its tensors on the CPU, for pickling to the other ranks."""
    import copy

    meta = copy.copy(meta)
    meta.__dict__.update({name: on_cpu(value) for name, value in vars(meta).items() if isinstance(value, torch.Tensor)})
    return meta
