"""Where KV memory goes: naive slab reservation against paged allocation, over a trace in time (guide §1, §3, §8).

Before PagedAttention, a serving system gave each request one contiguous slab of KV slots when it was admitted,
sized for the most tokens it might ever hold. We simulate three ways to size the slab, as the paper's Figure 2
does for Orca:

    "max"     the model's maximum length (what existing systems did: the output length is unknown)
    "pow2"    the true final length rounded up to a power of two (a buddy-style allocator that knows the length)
    "oracle"  exactly the true final length (no real system knows it; the best a slab can do)

Slabs live in a first-fit arena, one contiguous address space of token slots, so external fragmentation is
real: a request that fits in the total free space but in no single hole has to wait. Against them, paged
allocation hands out fixed-size blocks from a pool, one more whenever a request's last block fills; its only
waste is the unfilled tail of each request's last block (< block_size slots). When the pool runs dry it
preempts the most recently admitted request (recompute: its blocks go back, it re-queues at the front). The
simulation re-admits it like any request, at no extra step; `recomputed_tokens` counts what a real engine would
prefill again (the victim's prompt and output so far), so that a comparison of steps can show that cost beside it.

Time runs in decode steps. A request admitted at a step is prefilled and yields its first token, so it holds
input_len + 1 tokens after that step and input_len + output_len when it finishes and frees its memory.
Every KV slot is, at every step, in exactly one of five states:

    live       holds a token's K and V
    reserved   held for a token this request will write later
    internal   held by a request but never written (slab beyond the final length, tail of the last block)
    external   free, while the next waiting request fits in the total free space but in no hole
    free       free, and not stranded

Utilisation is live / (live + reserved + internal): the fraction of reserved KV that holds tokens. The paper
(arXiv 2309.06180, Figure 2) measures 20.4 % (max), 26.8 % (pow2), 38.2 % (oracle) of KV memory holding token
states in Orca, and 96.3 % in vLLM.
"""

import bisect
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from paged.analysis.traces import TraceRequest
from paged.geometry import blocks_for_tokens

NAIVE_POLICIES = ("max", "pow2", "oracle")
PAPER_ORCA_USAGE = {"max": 0.204, "pow2": 0.268, "oracle": 0.382}  # token states / KV memory, paper Fig. 2
PAPER_VLLM_USAGE = 0.963

FREE, LIVE, RESERVED, INTERNAL, EXTERNAL = range(5)  # slot states, in the order of Breakdown's fields
STATE_NAMES = ("free", "live", "reserved", "internal", "external")


def reservation_tokens(policy: str, final_len: int, max_model_len: int) -> int:
    """Slots a naive slab reserves for a request that will end at final_len tokens."""
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return 1 << (final_len - 1).bit_length()
    if policy == "oracle":
        return final_len
    raise ValueError(f"policy must be one of {NAIVE_POLICIES}, got {policy!r}")


class FirstFitArena:
    """A contiguous address space of `capacity` token slots. A slab goes into the lowest-addressed hole that fits."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.holes = [(0, capacity)]  # (start, length), sorted by start, never adjacent (coalesced)

    def allocate(self, size: int) -> int | None:
        """Start address of a new slab of `size` slots, or None when no single hole is large enough."""
        for i, (start, length) in enumerate(self.holes):
            if length >= size:
                if length == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + size, length - size)
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Return a slab; merge it with the holes on either side."""
        i = bisect.bisect(self.holes, (start, size))
        if i < len(self.holes) and start + size == self.holes[i][0]:  # touches the next hole
            size += self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:  # touches the previous hole
            start, size = self.holes[i - 1][0], self.holes[i - 1][1] + size
            i -= 1
            del self.holes[i]
        self.holes.insert(i, (start, size))

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)


@dataclass(eq=False)
class SimulatedRequest:
    """A request while the simulation holds it. Its memory is a list of slot addresses in token order."""

    request: TraceRequest
    generated: int = 0  # output tokens so far
    slab_start: int = -1  # naive: first slot of its slab
    slab_size: int = 0  # naive: slots in its slab
    blocks: list[int] = field(default_factory=list)  # paged: physical block ids, in token order

    @property
    def length(self) -> int:
        """Tokens in its KV cache."""
        return self.request.input_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated == self.request.output_len


class NaiveSlabs:
    """One contiguous slab per request, sized by `policy` at admission, placed first-fit."""

    def __init__(self, capacity: int, policy: str, max_model_len: int):
        reservation_tokens(policy, 1, max_model_len)  # validates the policy name
        self.policy, self.max_model_len = policy, max_model_len
        self.arena = FirstFitArena(capacity)
        self.name = f"naive-{policy}"

    def admission_slots(self, seq: SimulatedRequest) -> int:
        return reservation_tokens(self.policy, seq.request.final_len, self.max_model_len)

    def admit(self, seq: SimulatedRequest) -> bool:
        size = self.admission_slots(seq)
        start = self.arena.allocate(size)
        if start is None:
            return False
        seq.slab_start, seq.slab_size = start, size
        return True

    def ensure_slot(self, seq: SimulatedRequest) -> bool:
        return True  # the slab already covers the final length

    def release(self, seq: SimulatedRequest) -> None:
        self.arena.free(seq.slab_start, seq.slab_size)
        seq.slab_start, seq.slab_size = -1, 0

    def allocated(self, seq: SimulatedRequest) -> int:
        return seq.slab_size

    def addresses(self, seq: SimulatedRequest) -> np.ndarray:
        return np.arange(seq.slab_start, seq.slab_start + seq.slab_size)  # [slab_size]

    def can_place(self, slots: int) -> bool:
        return slots <= self.arena.largest_hole

    @property
    def free_slots(self) -> int:
        return self.arena.free_slots


class PagedBlocks:
    """Fixed-size blocks from a pool; a request holds ceil(length / block_size) of them, anywhere in the pool."""

    def __init__(self, capacity: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = capacity // block_size
        self.free_blocks = deque(range(self.num_blocks))  # FIFO: a freed block goes to the back
        self.name = f"paged-{block_size}"

    def admission_slots(self, seq: SimulatedRequest) -> int:
        return blocks_for_tokens(seq.length + 1, self.block_size) * self.block_size

    def admit(self, seq: SimulatedRequest) -> bool:
        needed = self.admission_slots(seq) // self.block_size
        if needed > len(self.free_blocks):
            return False
        seq.blocks = [self.free_blocks.popleft() for _ in range(needed)]
        return True

    def ensure_slot(self, seq: SimulatedRequest) -> bool:
        """Make room for the token this step writes; False when the pool has no free block."""
        if seq.length < len(seq.blocks) * self.block_size:
            return True
        if not self.free_blocks:
            return False
        seq.blocks.append(self.free_blocks.popleft())
        return True

    def release(self, seq: SimulatedRequest) -> None:
        self.free_blocks.extend(seq.blocks)
        seq.blocks = []

    def allocated(self, seq: SimulatedRequest) -> int:
        return len(seq.blocks) * self.block_size

    def addresses(self, seq: SimulatedRequest) -> np.ndarray:
        offsets = np.arange(self.block_size)  # [block_size]
        return (np.array(seq.blocks)[:, None] * self.block_size + offsets).ravel()  # [num_blocks * block_size]

    def can_place(self, slots: int) -> bool:
        return slots <= self.free_slots

    @property
    def free_slots(self) -> int:
        return len(self.free_blocks) * self.block_size


@dataclass(frozen=True)
class Breakdown:
    """Slots of a KV pool by state at one moment; the five fields sum to the capacity."""

    free: int
    live: int
    reserved: int
    internal: int
    external: int

    @property
    def capacity(self) -> int:
        return self.free + self.live + self.reserved + self.internal + self.external

    @property
    def allocated(self) -> int:
        return self.live + self.reserved + self.internal

    @property
    def utilisation(self) -> float:
        """Fraction of allocated slots that hold a token (1.0 when nothing is allocated)."""
        return self.live / self.allocated if self.allocated else 1.0

    @property
    def wasted_fraction(self) -> float:
        """Fraction of allocated slots that hold no token."""
        return 1 - self.utilisation


def breakdown(allocator, running: list[SimulatedRequest], stranded: bool = False) -> Breakdown:
    """Count slots by state. A sequence's slots beyond its length up to its final length are reserved, the
    rest internal. stranded: the next waiting request fits in the free total but in no hole."""
    live = reserved = internal = 0
    for seq in running:
        held = allocator.allocated(seq)
        will_fill = min(held, seq.request.final_len)
        live += seq.length
        reserved += will_fill - seq.length
        internal += held - will_fill
    free = allocator.free_slots
    return Breakdown(
        free=0 if stranded else free, live=live, reserved=reserved, internal=internal, external=free if stranded else 0
    )


def slot_states(allocator, running: list[SimulatedRequest], capacity: int, stranded: bool) -> np.ndarray:
    """The state of every slot of the pool, as a memory map: int8 [capacity], codes FREE..EXTERNAL."""
    states = np.full(capacity, EXTERNAL if stranded else FREE, dtype=np.int8)
    for seq in running:
        addresses = allocator.addresses(seq)  # [allocated] physical slots in token order
        positions = np.arange(len(addresses))
        states[addresses] = np.where(
            positions < seq.length, LIVE, np.where(positions < seq.request.final_len, RESERVED, INTERNAL)
        )
    return states


@dataclass
class SimulationResult:
    """Per-step columns of a simulation and, every `layout_every` steps, the pool's memory map."""

    scheme: str  # "naive-max", "naive-pow2", "naive-oracle" or "paged-<block_size>"
    capacity: int  # token slots in the pool
    steps: np.ndarray  # int [num_records] step index of each record
    counts: np.ndarray  # int [num_records, 5] slots per state, columns FREE..EXTERNAL
    running: np.ndarray  # int [num_records] requests holding memory
    waiting: np.ndarray  # int [num_records] requests that have arrived and wait to be admitted
    max_slack: np.ndarray  # int [num_records] the largest allocated - length of any running request
    layouts: dict  # step -> int8 [capacity] slot states
    preemptions: int
    recomputed_tokens: int  # tokens the preempted requests held, which a recompute prefills again
    finished: int
    final_free_slots: int

    @property
    def utilisation(self) -> np.ndarray:
        """[num_records] live / allocated at each step (1.0 when nothing is allocated)."""
        allocated = self.counts[:, [LIVE, RESERVED, INTERNAL]].sum(1)
        return np.where(allocated > 0, self.counts[:, LIVE] / np.maximum(allocated, 1), 1.0)

    @property
    def live_share(self) -> np.ndarray:
        """[num_records] live / capacity at each step: the share of the whole KV pool holding tokens, which is what
        the vLLM paper's Figure 2 reports (reservation, fragmentation and free space all count against it)."""
        return self.counts[:, LIVE] / self.capacity

    @property
    def loaded(self) -> np.ndarray:
        """[num_records] bool: steps with a request waiting for memory, i.e. the pool is the bottleneck."""
        return self.waiting > 0

    def summary(self) -> dict:
        """Means over the loaded steps (over every step with a running request if none was loaded)."""
        mask = self.loaded if self.loaded.any() else self.running > 0
        fractions = self.counts[mask].mean(0) / self.capacity  # [5]
        return {
            "scheme": self.scheme,
            "utilisation": float(self.utilisation[mask].mean()),
            **{f"{name}_fraction": float(f) for name, f in zip(STATE_NAMES, fractions)},
            "max_concurrency": int(self.running.max()),
            "mean_concurrency": float(self.running[mask].mean()),
            "num_steps": int(self.steps[-1]) + 1,
            "loaded_steps": int(self.loaded.sum()),
            "stranded_steps": int((self.counts[:, EXTERNAL] > 0).sum()),
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
        }


def make_allocator(scheme, capacity: int, max_model_len: int):
    """scheme: a naive policy name ("max", "pow2", "oracle") or a paged block size (a power of two)."""
    if isinstance(scheme, str):
        return NaiveSlabs(capacity, scheme, max_model_len)
    blocks_for_tokens(0, scheme)  # validates the block size
    if scheme > capacity:
        raise ValueError(f"block_size ({scheme}) must be <= capacity ({capacity} slots)")
    return PagedBlocks(capacity, scheme)


def simulate(
    trace: list[TraceRequest],
    scheme,
    capacity: int,
    max_model_len: int = 2048,
    step_time: float = 0.05,
    max_num_seqs: int | None = None,
    layout_every: int = 0,
) -> SimulationResult:
    """Serve `trace` first come, first served, in a pool of `capacity` token slots, one decode step at a time.

    scheme: "max" | "pow2" | "oracle" (naive slabs) or a block size (paged).
    step_time: seconds per decode step, to turn arrival times into steps.
    max_num_seqs: cap on running requests (None: memory is the only limit).
    layout_every: record the pool's memory map every that many steps (0: never).
    """
    if not trace:
        raise ValueError("trace must hold at least one request")
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive number of token slots, got {capacity!r}")
    if step_time <= 0:
        raise ValueError(f"step_time must be > 0 seconds, got {step_time}")
    if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
        raise ValueError(f"max_num_seqs must be a positive integer or None, got {max_num_seqs!r}")
    if not isinstance(layout_every, int) or layout_every < 0:
        raise ValueError(f"layout_every must be an integer >= 0, got {layout_every!r}")
    allocator = make_allocator(scheme, capacity, max_model_len)
    for request in trace:
        if request.final_len > max_model_len:
            raise ValueError(
                f"request {request.request_id} ends at {request.final_len} tokens, "
                f"more than max_model_len ({max_model_len})"
            )
        largest = SimulatedRequest(request, generated=request.output_len - 1)  # as it writes its last token
        if allocator.admission_slots(largest) > capacity:
            raise ValueError(f"request {request.request_id} needs more than the pool's capacity ({capacity} slots)")
    pending = deque(sorted(trace, key=lambda r: r.arrival_time))
    waiting: deque[SimulatedRequest] = deque()
    running: list[SimulatedRequest] = []  # in admission order: the last is preempted first
    rows, layouts, preemptions, recomputed, finished, step = [], {}, 0, 0, 0, 0
    while pending or waiting or running:
        if not waiting and not running:  # idle: jump to the next arrival
            step = max(step, int(np.ceil(pending[0].arrival_time / step_time)))
        while pending and pending[0].arrival_time <= step * step_time:
            waiting.append(SimulatedRequest(pending.popleft()))
        while waiting and (max_num_seqs is None or len(running) < max_num_seqs) and allocator.admit(waiting[0]):
            running.append(waiting.popleft())
        i = 0
        while i < len(running):  # oldest first: each writes one token
            if allocator.ensure_slot(running[i]):
                running[i].generated += 1
                i += 1
            else:  # pool dry: preempt the newest, perhaps running[i] itself
                victim = running.pop()
                allocator.release(victim)
                waiting.appendleft(victim)
                preemptions += 1
                recomputed += victim.length
        need = allocator.admission_slots(waiting[0]) if waiting else 0
        stranded = bool(waiting) and allocator.free_slots >= need and not allocator.can_place(need)
        counts = breakdown(allocator, running, stranded)
        slack = max((allocator.allocated(seq) - seq.length for seq in running), default=0)
        rows.append(
            (
                step,
                counts.free,
                counts.live,
                counts.reserved,
                counts.internal,
                counts.external,
                len(running),
                len(waiting),
                slack,
            )
        )
        if layout_every and step % layout_every == 0:
            layouts[step] = slot_states(allocator, running, capacity, stranded)
        for seq in running:
            if seq.done:
                allocator.release(seq)
                finished += 1
        running = [seq for seq in running if not seq.done]
        step += 1
    table = np.array(rows, dtype=np.int64).reshape(-1, 9)  # [num_records, 9]
    return SimulationResult(
        scheme=allocator.name,
        capacity=capacity,
        steps=table[:, 0],
        counts=table[:, 1:6],
        running=table[:, 6],
        waiting=table[:, 7],
        max_slack=table[:, 8],
        layouts=layouts,
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        finished=finished,
        final_free_slots=allocator.free_slots,
    )


def compare(
    trace: list[TraceRequest], capacity: int, block_sizes=(8, 16, 32, 64, 128), max_model_len: int = 2048, **kwargs
) -> list[SimulationResult]:
    """The three naive policies, then paged allocation at each block size, on the same trace and pool."""
    return [simulate(trace, scheme, capacity, max_model_len, **kwargs) for scheme in (*NAIVE_POLICIES, *block_sizes)]


# (input_len, output_len, generated so far): the guide's four lengths, 120, 1,900, 60 and 800 tokens live (2,880),
# each reserving 2,048 slots. The guide gives only those lengths; where each request ends (ours) splits the empty
# slots into reserved and never written, not their sum.
FOUR_REQUESTS = [
    (100, 220, 20),  #   120 live, ends at   320
    (900, 1100, 1000),  # 1,900 live, ends at 2,000
    (40, 320, 20),  #    60 live, ends at   360
    (300, 820, 500),  #   800 live, ends at 1,120
]


@dataclass(frozen=True)
class Snapshot:
    breakdown: Breakdown
    states: np.ndarray  # int8 [capacity] the memory map


def four_request_example(block_size: int = 16, max_model_len: int = 2048) -> dict[str, Snapshot]:
    """The guide's four-request snapshot: four requests mid-decode, 2,880 tokens live in all.

    Naive "max" reservation gives each 2,048 slots: 8,192 reserved, 2,880 used, 64.8 % wasted (920 slots
    reserved for tokens still to come, 4,392 never to be written). Paged at block size 16 holds 181 blocks
    (2,896 slots) in the same 8,192-slot pool: 16 slots, 0.55 %, wasted.
    """
    capacity = len(FOUR_REQUESTS) * max_model_len
    result = {}
    for name, allocator in (
        ("naive", NaiveSlabs(capacity, "max", max_model_len)),
        ("paged", PagedBlocks(capacity, block_size)),
    ):
        seqs = []
        for i, (n_in, n_out, n_gen) in enumerate(FOUR_REQUESTS):
            seq = SimulatedRequest(TraceRequest(i, n_in, n_out, 0.0), generated=n_gen - 1)
            allocator.admit(seq)  # holds room for the token it writes next ...
            seq.generated += 1  # ... which is its n_gen-th
            seqs.append(seq)
        result[name] = Snapshot(breakdown(allocator, seqs), slot_states(allocator, seqs, capacity, stranded=False))
    return result
