"""What tensor parallelism costs and saves, in numbers (guide §1, §2, §8, §15).

Tensor parallelism (TP) cuts every layer of a model over N devices, Megatron-style: each rank holds 1/N of every
weight matrix and 1/N of the attention heads, so it also holds the K and V of only its own KV heads. The cache of
chapter 1 is then cut the same way:

    bytes per token per rank = 2 (K and V) * num_layers * (KV heads on this rank) * head_dim * bytes per element

with max(1, num_kv_heads / N) KV heads on a rank. Past N = num_kv_heads there are not enough heads to go round,
and vLLM gives each rank one head anyway, so every head is stored N / num_kv_heads times (replicated): the cache per
rank stops shrinking while the weights per rank go on shrinking. One block table serves every rank (a block id
names the same tokens on each), so the pool has as many blocks as its fullest rank can hold.

What it costs: the partial sums of a row-parallel matrix must be added up across ranks, one all-reduce after
attention's output projection and one after the MLP's down projection, in every layer (plus one for a
vocabulary-parallel embedding). A ring all-reduce makes each rank send, and receive, 2 (N - 1) / N times the
tensor's bytes. What it saves: in a memory-bound decode step each rank reads 1/N of the weights, in parallel.
`tp_step_seconds` sets the two against each other; `measure_all_reduce` times a real all-reduce between processes
(gloo, on CPU cores); `parallel_plans` compares TP with data parallelism, N whole copies of the engine.

The guide's own memory figures for Llama-3-70B on H100s (§1: two cards, "maybe 20 GB per card for KV cache";
§8: four cards, "~50 GiB free per card for KV") come out of `deployment`. Nothing here imports the engine.
"""

import multiprocessing
import os
import socket
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from paged.geometry import H100_MEMORY, H100_SXM_BANDWIDTH, H100_SXM_BF16_FLOPS, LLAMA3_70B_PARAMS, KVGeometry

GB = 1e9
# NVLink 4 on an H100 SXM: 18 links, 900 GB/s per GPU counting both directions together (NVIDIA's H100 datasheet).
# A ring all-reduce sends and receives at once, so each direction carries its bytes at half that: 450 GB/s (chapter
# 10's LINKS table uses the same figure).
NVLINK4_H100_TOTAL = 900e9
NVLINK4_H100_ONE_WAY = NVLINK4_H100_TOTAL / 2
# The fixed cost of one all-reduce call (launch, synchronisation, the first hop). No datasheet states it; this round
# figure is an assumption of the model, and chapter 14 checks that its conclusions hold from 5 to 50 µs.
ASSUMED_NVLINK_LATENCY = 10e-6
VLLM_GPU_MEMORY_UTILIZATION = 0.92  # vLLM's default share of a card (vllm/config/cache.py, 0.32.0; 0.9 before)


# the models -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What sharding needs to know of a Llama-like model."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    num_params: float | None = None  # when given, used instead of counting the matrices

    def geometry(self, element_bytes: int) -> KVGeometry:
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            element_bytes=element_bytes,
            num_attention_heads=self.num_attention_heads,
        )

    @property
    def params(self) -> float:
        """Weights: per layer q, k, v, o, the gated MLP's three matrices and two norms; the embedding (and the LM
        head unless tied); the final norm."""
        if self.num_params is not None:
            return self.num_params
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embeddings + h

    def weight_bytes(self, element_bytes: int) -> float:
        return self.params * element_bytes


SMOLLM2 = ModelShape(
    "SmolLM2-135M",
    num_layers=30,
    hidden_size=576,
    num_attention_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tied_embeddings=True,
)
LLAMA3_70B = ModelShape(
    "Llama-3-70B",
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=128256,
    tied_embeddings=False,
    num_params=LLAMA3_70B_PARAMS,
)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# which rank holds which KV heads --------------------------------------------------------------------------------------
def kv_heads_by_rank(num_kv_heads: int, tp_size: int) -> list[tuple[int, ...]]:
    """The global KV head ids each rank holds, rank by rank.

    N <= heads: contiguous runs, as even as they go (with N dividing the heads, as vLLM requires, heads / N each).
    N > heads: one head per rank, rank r holding head r * heads // N, so that each head is held by N / heads
    consecutive ranks (vLLM's replication: head = rank // (N / heads)).
    """
    _positive_int("num_kv_heads", num_kv_heads)
    _positive_int("tp_size", tp_size)
    if tp_size >= num_kv_heads:
        return [(rank * num_kv_heads // tp_size,) for rank in range(tp_size)]
    return [
        tuple(range(rank * num_kv_heads // tp_size, (rank + 1) * num_kv_heads // tp_size)) for rank in range(tp_size)
    ]


def kv_head_copies(num_kv_heads: int, tp_size: int) -> list[int]:
    """How many ranks store each KV head: 1 each up to N = num_kv_heads, N / num_kv_heads each beyond."""
    copies = [0] * num_kv_heads
    for heads in kv_heads_by_rank(num_kv_heads, tp_size):
        for head in heads:
            copies[head] += 1
    return copies


def vllm_accepts(num_attention_heads: int, num_kv_heads: int, tp_size: int) -> bool:
    """vLLM's rule for a tensor-parallel size: it divides the query heads, and divides the KV heads (or, past them,
    is a multiple of them), so that every rank gets the same number of each (QKVParallelLinear)."""
    if num_attention_heads % tp_size:
        return False
    return num_kv_heads % tp_size == 0 if tp_size <= num_kv_heads else tp_size % num_kv_heads == 0


def first_replicating_tp_size(num_attention_heads: int, num_kv_heads: int) -> int | None:
    """The smallest tensor-parallel size vLLM accepts at which a KV head is stored on more than one rank; None
    when no size it accepts replicates (the query heads run out first)."""
    return next(
        (
            n
            for n in range(num_kv_heads + 1, num_attention_heads + 1)
            if vllm_accepts(num_attention_heads, num_kv_heads, n)
        ),
        None,
    )


# the pool on each rank ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPool:
    """One rank's share of the KV cache."""

    rank: int
    kv_head_ids: tuple[int, ...]  # global KV head ids this rank holds
    bytes_per_token: int  # K and V of one token over all layers, this rank's heads only
    block_bytes: int  # one block over all layers, this rank's heads only


def rank_pools(geometry: KVGeometry, tp_size: int, block_size: int = 16) -> list[RankPool]:
    """Every rank's heads and bytes. A rank's bytes are the whole cache's times its share of the heads: chapter 1's
    KVGeometry does the arithmetic, the heads do the cutting."""
    per_head_token = geometry.bytes_per_token // geometry.num_kv_heads
    per_head_block = geometry.block_bytes(block_size) // geometry.num_kv_heads
    return [
        RankPool(rank, heads, per_head_token * len(heads), per_head_block * len(heads))
        for rank, heads in enumerate(kv_heads_by_rank(geometry.num_kv_heads, tp_size))
    ]


def bytes_per_token_per_rank(geometry: KVGeometry, tp_size: int) -> int:
    """K and V of one token on the fullest rank: bytes_per_token * max(1, heads / N) / heads when N divides evenly."""
    return max(pool.bytes_per_token for pool in rank_pools(geometry, tp_size))


def blocks_per_rank(geometry: KVGeometry, tp_size: int, free_bytes_per_rank: float, block_size: int = 16) -> int:
    """Blocks in the pool when every rank has free_bytes_per_rank for KV. One block table serves all ranks, so a
    block id must exist on each: the fullest rank sets the count."""
    return int(free_bytes_per_rank // max(pool.block_bytes for pool in rank_pools(geometry, tp_size, block_size)))


# the guide's deployments ----------------------------------------------------------------------------------------------
def free_kv_bytes_per_card(card_bytes: float, weight_bytes: float, tp_size: int, utilization: float = 1.0) -> float:
    """What a card has left for KV when it holds 1/N of the weights and may use `utilization` of its memory.
    Activations, the CUDA context and workspace come out of this too, so it is an upper bound."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    return card_bytes * utilization - weight_bytes / _positive_int("tp_size", tp_size)


@dataclass(frozen=True)
class Deployment:
    """A model over N cards with tensor parallelism: what each card keeps for KV and what that holds."""

    tp_size: int
    card_bytes: float
    weight_bytes: float
    utilization: float
    free_bytes_per_card: float  # card * utilization - weights / N
    bytes_per_token_per_rank: int
    blocks: int  # the pool's blocks: the same ids on every card
    tokens: int  # tokens the pool holds: each card holds its heads' share of every one of them
    requests: int  # requests of context_len tokens that fit at once
    context_len: int

    @property
    def fits(self) -> bool:
        return self.free_bytes_per_card > 0


def deployment(
    geometry: KVGeometry,
    weight_bytes: float,
    tp_size: int,
    card_bytes: float = H100_MEMORY,
    utilization: float = 1.0,
    context_len: int = 2048,
    block_size: int = 16,
) -> Deployment:
    """The guide's arithmetic made per card: weights split N ways, the cache split N ways by heads.

    The tokens a card holds are the tokens the whole node holds: every card stores its heads' K and V of every
    token, so the node's capacity in tokens is one card's free memory over one rank's bytes per token."""
    free = free_kv_bytes_per_card(card_bytes, weight_bytes, tp_size, utilization)
    blocks = blocks_per_rank(geometry, tp_size, max(free, 0), block_size)
    tokens = blocks * block_size
    return Deployment(
        tp_size=tp_size,
        card_bytes=card_bytes,
        weight_bytes=weight_bytes,
        utilization=utilization,
        free_bytes_per_card=free,
        bytes_per_token_per_rank=bytes_per_token_per_rank(geometry, tp_size),
        blocks=blocks,
        tokens=tokens,
        requests=tokens // context_len,
        context_len=context_len,
    )


# the all-reduce -------------------------------------------------------------------------------------------------------
def ring_all_reduce_bytes(num_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and as many it receives) in a ring all-reduce of a num_bytes tensor: a reduce-scatter
    and an all-gather, each N - 1 steps of a 1/N chunk."""
    return 2 * (_positive_int("world_size", world_size) - 1) / world_size * num_bytes


def all_reduce_seconds(
    num_bytes: float, world_size: int, bandwidth: float, latency: float = ASSUMED_NVLINK_LATENCY
) -> float:
    """The alpha-beta model: a fixed cost per call plus the ring's bytes over one direction of the link.
    Zero on one rank: there is nothing to add up."""
    if world_size == 1:
        return 0.0
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"bandwidth must be > 0 and latency >= 0, got {bandwidth}, {latency}")
    return latency + ring_all_reduce_bytes(num_bytes, world_size) / bandwidth


def all_reduces_per_step(num_layers: int, vocab_parallel_embedding: bool = True) -> int:
    """All-reduces of a forward pass: after o_proj and after down_proj in every layer, and one after a
    vocabulary-parallel embedding (each rank looked up only the tokens of its slice of the vocabulary)."""
    return 2 * num_layers + (1 if vocab_parallel_embedding else 0)


def all_reduce_bytes(num_tokens: int, hidden_size: int, element_bytes: int) -> int:
    """One all-reduce of a step: the hidden states of every token of the step, [num_tokens, hidden_size]."""
    return num_tokens * hidden_size * element_bytes


@dataclass(frozen=True)
class Link:
    """What one tensor-parallel group runs on: each device's memory bandwidth and the link between them."""

    name: str
    memory_bandwidth: float  # bytes/s one device reads its weights at
    link_bandwidth: float  # bytes/s, one direction
    link_latency: float  # seconds, fixed cost of one all-reduce
    shared_memory: bool = False  # True: the ranks share one memory system (cores of one CPU), so splitting the
    #                                weights does not split the time to read them


H100_NVLINK = Link("H100 SXM over NVLink 4", H100_SXM_BANDWIDTH, NVLINK4_H100_ONE_WAY, ASSUMED_NVLINK_LATENCY)


def tp_step_seconds(model: ModelShape, tp_size: int, link: Link, num_tokens: int, element_bytes: int = 2) -> dict:
    """A memory-bound step at tensor-parallel size N: each rank reads its 1/N of the weights (all of them, on a
    shared memory system), then the step's all-reduces. KV reads, which split the same way, and compute are left
    out: this is the part that sharding changes."""
    weights = model.weight_bytes(element_bytes) / (1 if link.shared_memory else tp_size) / link.memory_bandwidth
    calls = all_reduces_per_step(model.num_layers)
    size = all_reduce_bytes(num_tokens, model.hidden_size, element_bytes)
    comm = calls * all_reduce_seconds(size, tp_size, link.link_bandwidth, link.link_latency)
    return {
        "tp_size": tp_size,
        "weights_s": weights,
        "all_reduce_s": comm,
        "step_s": weights + comm,
        "all_reduces": calls if tp_size > 1 else 0,
        "bytes_per_all_reduce": size,
    }


def tp_prefill_seconds(
    model: ModelShape,
    tp_size: int,
    link: Link,
    num_tokens: int,
    element_bytes: int = 2,
    flops: float = H100_SXM_BF16_FLOPS,
    efficiency: float = 0.5,
) -> dict:
    """A compute-bound prefill of num_tokens at tensor-parallel size N: 2 FLOPs per weight per token, split N
    ways, at `efficiency` of `flops` per device (attention's own FLOPs left out); then the step's all-reduces, whose
    bytes grow with the tokens as the FLOPs do. Their ratio does not depend on num_tokens once the latency is
    small beside the bytes."""
    compute = 2 * model.params * num_tokens / tp_size / (flops * efficiency)
    size = all_reduce_bytes(num_tokens, model.hidden_size, element_bytes)
    comm = all_reduces_per_step(model.num_layers) * all_reduce_seconds(
        size, tp_size, link.link_bandwidth, link.link_latency
    )
    return {
        "tp_size": tp_size,
        "compute_s": compute,
        "all_reduce_s": comm,
        "step_s": compute + comm,
        "bytes_per_all_reduce": size,
    }


# measuring an all-reduce ----------------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def smollm2_sizes(decode_seqs: int = 32, prefill_chunk: int = 512, element_bytes: int = 4) -> dict[str, int]:
    """Bytes of one all-reduce in two SmolLM2 steps (hidden 576, fp32): a decode step of decode_seqs sequences
    (one token each) and a prefill chunk of prefill_chunk tokens."""
    return {
        "decode step": all_reduce_bytes(decode_seqs, SMOLLM2.hidden_size, element_bytes),
        "prefill chunk": all_reduce_bytes(prefill_chunk, SMOLLM2.hidden_size, element_bytes),
    }


WARMUP_CALLS = 3  # untimed all-reduces of every size before the timed ones


def _all_reduce_rank(rank: int, world_size: int, addr: str, port: int, sizes, repeats: int, results) -> None:
    """One rank of measure_all_reduce, in a spawned process: join the group the torchrun way (environment
    variables), time each size `repeats` times after a barrier, check the sums, and rank 0 reports the fastest."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    try:
        fastest, correct = {}, True
        for size in sizes:  # connections and buffers set up
            for _ in range(WARMUP_CALLS):
                dist.all_reduce(torch.ones(size // 4))
        for size in sizes:
            tensor = torch.empty(size // 4, dtype=torch.float32)  # [size / 4] fp32
            times = []
            for _ in range(repeats):
                tensor.fill_(rank + 1)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - start)
            correct &= bool(torch.all(tensor == world_size * (world_size + 1) / 2))
            fastest[size] = min(times)
        if rank == 0:
            results.put((fastest, correct))
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class AllReduceTimes:
    world_size: int
    fastest: dict[int, float]  # bytes of the tensor -> seconds of the fastest all-reduce of that size
    correct: bool  # every rank ended with the sum of all ranks' tensors


def measure_all_reduce(world_size: int = 2, sizes=None, repeats: int = 20, timeout: float = 120.0) -> AllReduceTimes:
    """Time torch.distributed.all_reduce over gloo between world_size spawned processes on this host (fp32 tensors
    of `sizes` bytes, default SmolLM2's decode step and prefill chunk); the fastest of `repeats` calls per size.
    The fastest, not the median: a call that waits for the operating system to wake the other rank's process takes
    milliseconds longer, and on a shared or virtual machine a third of the calls or more can do so, which moves the
    median from run to run by more than the bytes do.

    Works from a notebook: the ranks run a function of this module in fresh interpreters (spawn), which all exit
    before this returns, or are killed if they have not within `timeout` seconds."""
    _positive_int("world_size", world_size)
    if world_size < 2:
        raise ValueError("world_size must be at least 2: an all-reduce on one rank moves nothing")
    sizes = sorted(set(sizes or smollm2_sizes().values()))
    if any(size < 4 or size % 4 for size in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes (fp32), got {sizes}")
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    ranks = [
        context.Process(
            target=_all_reduce_rank,
            args=(rank, world_size, "127.0.0.1", port, sizes, repeats, results),
            daemon=True,
            name=f"all-reduce-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        for process in ranks:
            process.join(max(deadline - time.monotonic(), 0))
        failed = [p for p in ranks if p.exitcode != 0]
        if failed:
            raise RuntimeError(
                f"all-reduce rank(s) {[ranks.index(p) for p in failed]} failed or timed out "
                f"(exit codes {[p.exitcode for p in failed]})"
            )
        fastest, correct = results.get()
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
        results.close()
    return AllReduceTimes(world_size, fastest, correct)


def fit_all_reduce(times: AllReduceTimes) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of the alpha-beta model fitted to measured times: time = latency + ring bytes /
    bandwidth, weighted so that small and large tensors count alike (relative error)."""
    ring = np.array([ring_all_reduce_bytes(size, times.world_size) for size in times.fastest])
    seconds = np.array(list(times.fastest.values()))
    slope, intercept = np.polyfit(ring, seconds, 1, w=1 / seconds)
    slope = max(slope, 1e-15)
    latency = intercept if intercept > 0 else float(seconds.min())
    return float(latency), float(1 / slope)


def measure_read_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes per second `device` reads memory at, with the threads torch is allowed on a CPU: the memory bandwidth a
    rank's weight read sees. The fastest of three ways of reading num_bytes of fp32, each the median of `repeats`
    after a warm-up: a sum, a matrix-vector product (the BLAS a matmul uses) and a copy (which reads and writes
    num_bytes). How close each comes to the memory's rate depends on the vector instructions torch and the BLAS
    use, so no one of them is the rate everywhere."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [num_bytes / 4]
    matrix, vector = data.view(1024, -1), torch.ones(num_bytes // 4 // 1024, device=device)  # [1024, n], [n]
    copy = torch.empty_like(data)
    reads = [
        (num_bytes, lambda: data.sum().item()),  # .item(): the read has ended
        (num_bytes, lambda: torch.mv(matrix, vector)[0].item()),
        (2 * num_bytes, lambda: copy.copy_(data)[0].item()),
    ]  # bytes moved, how
    rates = []
    for moved, read in reads:
        read()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            times.append(time.perf_counter() - start)
        rates.append(moved / statistics.median(times))
    return max(rates)


def launch_env(nnodes: int, nproc_per_node: int, master_addr: str, master_port: int = 29500) -> list[dict]:
    """The environment torchrun gives each process of a multi-node job, node by node and process by process: the
    rendezvous (MASTER_ADDR, MASTER_PORT), the global RANK and WORLD_SIZE that init_process_group("env://") reads,
    LOCAL_RANK (which GPU of its node a process takes) and GROUP_RANK (torchrun's name for the node's index)."""
    _positive_int("nnodes", nnodes)
    _positive_int("nproc_per_node", nproc_per_node)
    return [
        {
            "GROUP_RANK": node,
            "LOCAL_RANK": local,
            "RANK": node * nproc_per_node + local,
            "WORLD_SIZE": nnodes * nproc_per_node,
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": master_port,
        }
        for node in range(nnodes)
        for local in range(nproc_per_node)
    ]


# data parallelism: N whole engines behind a router --------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelPlan:
    """num_cards cards as dp_size replicas of a tp_size-card engine."""

    tp_size: int
    dp_size: int
    fits: bool  # the weights leave room for KV on every card
    kv_bytes_per_card: float
    tokens_per_replica: int  # the most tokens one request (or one replica's batch) can hold
    tokens_total: int  # all replicas together
    requests_total: int  # requests of context_len tokens all replicas hold at once
    all_reduces_per_step: int  # per replica's forward pass; 0 without tensor parallelism
    weight_copies: int  # how many times the node stores the whole model


def parallel_plans(
    model: ModelShape,
    num_cards: int,
    card_bytes: float = H100_MEMORY,
    element_bytes: int = 2,
    utilization: float = 1.0,
    context_len: int = 2048,
    block_size: int = 16,
) -> list[ParallelPlan]:
    """Every way to use num_cards cards as dp_size replicas of tp_size cards (tp_size * dp_size = num_cards),
    with tp_size among the sizes vLLM accepts for the model. Replicas share nothing: not weights, not KV, not
    the prefix cache."""
    geometry, weights = model.geometry(element_bytes), model.weight_bytes(element_bytes)
    plans = []
    for tp in range(1, num_cards + 1):
        if num_cards % tp or not vllm_accepts(model.num_attention_heads, model.num_kv_heads, tp):
            continue
        d = deployment(geometry, weights, tp, card_bytes, utilization, context_len, block_size)
        dp = num_cards // tp
        plans.append(
            ParallelPlan(
                tp_size=tp,
                dp_size=dp,
                fits=d.fits,
                kv_bytes_per_card=max(d.free_bytes_per_card, 0),
                tokens_per_replica=d.tokens,
                tokens_total=dp * d.tokens,
                requests_total=dp * d.requests,
                all_reduces_per_step=all_reduces_per_step(model.num_layers) if tp > 1 else 0,
                weight_copies=dp,
            )
        )
    return plans
