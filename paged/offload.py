"""A second KV tier beside the pool (guide §15): swap space for preempted sequences, and a tier that keeps the
prefix cache's full blocks after the pool has evicted them.

A tier is a tensor of block-sized slots outside the pool, one slot = one block of every layer's K and V:
    tier.storage  [num_slots, 2 (K/V), num_layers, block_size, num_kv_heads, head_dim]
so a block moves between pool and tier as a unit, by one copy per block. It lives in host memory (pinned on CUDA,
so the copies run without blocking the host) or, with `kv_offload_dir`, in a memory-mapped file there: a disk
tier, slower, and real on a CPU too. Each engine owns its files: `paged-swap-XXXX.kv` and `paged-prefix-XXXX.kv`,
named afresh (so two engines, or two disaggregated workers, given one folder never share a slot), locked while the
tier lives, deleted when it is closed or collected (`LLM.kv_offload_files()` names them). A file whose owner died
without deleting it is deleted by the next engine that opens a tier in that folder.

Two uses, two tiers, two bookkeepers:
  - `SwapSpace` (`preemption_mode="swap"`, `swap_space` GiB): a preempted sequence's computed blocks are copied out
    and freed; when blocks free up it is copied back, bit for bit, and decodes on as if nothing happened. A sequence
    that shares a block (a fork's, a cached prefix's) is not swapped but recomputed: freeing a shared block frees
    nothing, and a copy brought back would split what was shared. Neither is one whose blocks the tier cannot take.
  - `PrefixTier` (`enable_prefix_caching=True, kv_offloading_size` GiB): every block that enters the prefix cache is
    also copied to the tier after the step that computed it (stored as computed, not when evicted: the copy leaves
    the pool at leisure, never in the way of the allocation that evicts the block); a prompt whose leading blocks
    miss the pool but hit the tier has them copied back instead of computed. The tier evicts least recently used.

The scheduler decides which blocks move (it touches no tensor); the engine makes the copies before the forward pass
(swap-outs, then copy-on-write, then swap-ins and tier hits) and stores the step's new cached blocks after it.
Both bookkeepers take part in the engine step's transaction (engine/journal.py: `checkpoint`, `restore`,
`stop_logging`), as the pool's does.
"""

import math
import os
import tempfile
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import torch

if os.name == "nt":
    import msvcrt
else:
    import fcntl

from paged.config import OffloadConfig
from paged.core.block_manager import Block, BlockManager
from paged.engine.kv_cache import KVCache
from paged.geometry import GiB, cdiv


def build_tiers(
    config: OffloadConfig, block_manager: BlockManager, kv_cache: KVCache
) -> tuple["SwapSpace | None", "PrefixTier | None"]:
    """The tiers the settings ask for, sized in blocks of this pool, each in a file of its own with
    kv_offload_dir."""
    block_bytes = kv_cache.nbytes // kv_cache.num_blocks
    config.check_blocks(block_bytes)
    folder = None if config.kv_offload_dir is None else Path(config.kv_offload_dir)
    if folder is not None:
        delete_stale_files(folder)
    swap = prefix = None
    if config.preemption_mode == "swap":
        swap = SwapSpace(
            block_manager, KVTier(kv_cache, int(config.swap_space * GiB) // block_bytes, folder, kind="swap")
        )
    if config.kv_offloading_size is not None:
        prefix = PrefixTier(
            block_manager, KVTier(kv_cache, int(config.kv_offloading_size * GiB) // block_bytes, folder, kind="prefix")
        )
    return swap, prefix


class KVTier:
    """num_slots block-sized slots of K/V outside the pool, handed out from a free list. In host memory, or in a
    memory-mapped file this tier owns (see TierFile): `path` names the file (one another live tier holds is
    refused), or is a folder in which a file of its own, named afresh for this `kind` of tier, is made."""

    def __init__(self, kv_cache: KVCache, num_slots: int, path: Path | None = None, kind: str | None = None):
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        pool = kv_cache.storage  # [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (num_slots, 2, pool.shape[1], *pool.shape[3:])
        self.file = None
        if path is None or num_slots == 0:
            self.storage = torch.zeros(shape, dtype=pool.dtype, pin_memory=pool.is_cuda)
        else:
            self.file = TierFile.create(Path(path), kind) if kind is not None else TierFile.claim(Path(path))
            self.storage = self.file.map(shape, pool.dtype)
        self.free_slots = deque(range(num_slots))
        self.log: list | None = None  # in a transaction: per call, the slots taken (a list) or how many given back

    @property
    def path(self) -> Path | None:
        """The file the tier lives in, or None for host memory."""
        return None if self.file is None else self.file.path

    def close(self) -> None:
        """Delete the tier's file now (it also goes when the tier is collected, or at exit); the mapped slots stay
        readable until the tier is dropped."""
        if self.file is not None:
            self.file.close()

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self, count: int) -> list[int]:
        if count > len(self.free_slots):
            raise ValueError(f"the tier has {len(self.free_slots)} free slots, {count} asked for")
        slots = [self.free_slots.popleft() for _ in range(count)]
        if self.log is not None:
            self.log.append(slots)
        return slots

    def give_back(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)
        if self.log is not None:
            self.log.append(len(slots))

    def undo(self, log: list) -> set[int]:
        """Undo the takes and give-backs in log (closed: self.log is None), newest first, so the free list is as it
        was. Returns the slots taken meanwhile: whatever they held may have been overwritten."""
        taken = set()
        for entry in reversed(log):
            if isinstance(entry, int):
                for _ in range(entry):
                    self.free_slots.pop()
            else:
                self.free_slots.extendleft(reversed(entry))
                taken.update(entry)
        return taken

    def save(self, copies: list[tuple[int, int]]) -> None:
        """(pool block, tier slot) pairs, distinct slots: every layer's K and V of the block into the slot."""
        pool = self.kv_cache.storage
        if not copies:
            return
        if pool.device == self.storage.device:  # a host pool: one gather and one scatter for all the blocks
            blocks, slots = map(list, zip(*copies))
            self.storage[slots] = pool[:, :, blocks].movedim(2, 0)  # [n, 2, layers, block_size, heads, dim]
            return
        for block, slot in copies:  # GPU to pinned host memory: one asynchronous copy per block, in stream order
            self.storage[slot].copy_(pool[:, :, block], non_blocking=True)

    def load(self, copies: list[tuple[int, int]]) -> None:
        """(tier slot, pool block) pairs, distinct blocks: the slot back into the block."""
        pool = self.kv_cache.storage
        if not copies:
            return
        if pool.device == self.storage.device:
            slots, blocks = map(list, zip(*copies))
            pool[:, :, blocks] = self.storage[slots].movedim(0, 2)  # [2, layers, n, block_size, heads, dim]
            return
        for slot, block in copies:
            pool[:, :, block].copy_(self.storage[slot], non_blocking=True)


TIER_FILE_PREFIX, TIER_FILE_SUFFIX = "paged-", ".kv"


class TierFile:
    """A tier's file, owned by one tier for its whole life: an exclusive lock on it (flock; on Windows, a lock on its
    first byte) says so to every other process, and the file is deleted when the tier is closed, collected, or the
    interpreter exits. A process killed before that leaves its file unlocked: delete_stale_files removes such files
    later."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self._finalizer = weakref.finalize(self, TierFile._release, path, fd)

    @classmethod
    def create(cls, folder: Path, kind: str) -> "TierFile":
        """A new file in folder (made if need be), paged-<kind>-XXXX.kv, under a name nobody else has."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            while True:
                fd, name = tempfile.mkstemp(prefix=f"{TIER_FILE_PREFIX}{kind}-", suffix=TIER_FILE_SUFFIX, dir=folder)
                if _lock(fd) and _is_at(fd, Path(name)):
                    return cls(Path(name), fd)
                os.close(fd)  # delete_stale_files took it in the instant before the lock: it is gone; again
        except OSError as error:
            raise ValueError(f"kv_offload_dir: cannot make a tier file in {folder} ({error})") from error

    @classmethod
    def claim(cls, path: Path) -> "TierFile":
        """The file at path (made if need be); a ValueError if another live tier holds it."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise ValueError(f"kv_offload_dir: cannot write the tier file {path} ({error})") from error
        if not _lock(fd):
            os.close(fd)
            raise ValueError(
                f"the tier file {path} belongs to another live tier (it holds the file's lock); "
                f"give each tier a file of its own"
            )
        return cls(path, fd)

    def map(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` memory-mapped on the file, cut to its size; a ValueError naming kv_offload_dir if
        the file cannot be written."""
        numel = math.prod(shape)
        try:
            os.ftruncate(self.fd, numel * dtype.itemsize)
            return torch.from_file(str(self.path), shared=True, size=numel, dtype=dtype).view(shape)
        except (OSError, RuntimeError) as error:
            self.close()
            raise ValueError(f"kv_offload_dir: cannot write the tier file {self.path} ({error})") from error

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _release(path: Path, fd: int) -> None:
        if os.name == "nt":
            os.close(fd)  # Windows deletes no file that is open
        try:
            os.unlink(path)
        except OSError:  # gone already (its folder deleted, say)
            pass
        if os.name != "nt":
            os.close(fd)  # the lock goes with the descriptor, after the file: no other tier claims it between


def _lock(fd: int) -> bool:
    """Take fd's file's exclusive lock, without waiting; False if another open file holds it."""
    try:
        if os.name == "nt":
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (BlockingIOError, PermissionError):  # Windows says a held lock with EACCES
        return False


def _is_at(fd: int, path: Path) -> bool:
    """Is the file open at fd still the one at path (not deleted or replaced meanwhile)?"""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def delete_stale_files(folder: Path) -> list[Path]:
    """Delete the tier files in folder that no live tier holds (their owner was killed before it could delete
    them); returns them. A file another process cannot open or delete is left alone."""
    deleted = []
    for path in sorted(folder.glob(f"{TIER_FILE_PREFIX}*{TIER_FILE_SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _lock(fd) and _is_at(fd, path):
                os.unlink(path)
                deleted.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return deleted


@dataclass(frozen=True)
class SwapSpaceState:
    """Swap preemption's bookkeeping as an engine step found it (SwapSpace.checkpoint)."""

    slots: dict[int, list[int]]
    swap_out_blocks: int
    swap_in_blocks: int
    tier_log: list  # the tier's takes and give-backs while the step runs (KVTier.log)


class SwapSpace:
    """Swap preemption's bookkeeping: which tier slots hold each swapped sequence's blocks, in table order."""

    def __init__(self, block_manager: BlockManager, tier: KVTier):
        self.block_manager = block_manager
        self.tier = tier
        self.slots: dict[int, list[int]] = {}  # seq_id -> tier slots of its blocks
        self.swap_out_blocks = 0  # cumulative
        self.swap_in_blocks = 0

    def can_swap_out(self, seq_id: int, num_tokens: int) -> bool:
        """Can seq_id's blocks holding its first num_tokens tokens move out whole? Not if one of them is shared."""
        table = self.block_manager.block_tables.get(seq_id, [])
        blocks = self.block_manager.blocks
        return 0 < cdiv(num_tokens, self.block_manager.block_size) <= self.tier.num_free and all(
            blocks[block_id].ref_count == 1 for block_id in table
        )

    def swap_out(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Give seq_id tier slots for its first num_tokens tokens and free its table. Returns the (pool block,
        tier slot) copies to make before the freed blocks are written again."""
        blocks = self.block_manager.block_tables[seq_id][: cdiv(num_tokens, self.block_manager.block_size)]
        self.slots[seq_id] = self.tier.take(len(blocks))
        self.block_manager.free(seq_id)
        self.swap_out_blocks += len(blocks)
        return list(zip(blocks, self.slots[seq_id]))

    def swap_in(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """A fresh table for seq_id covering num_tokens tokens (at least those swapped out), its slots released.
        Returns the (tier slot, pool block) copies to make before anyone reads the blocks. A slot released here
        is not taken again in the same step: swap-outs are scheduled (and made) before swap-ins."""
        slots = self.slots.pop(seq_id)
        table = self.block_manager.allocate(seq_id, num_tokens)
        self.tier.give_back(slots)
        self.swap_in_blocks += len(slots)
        return list(zip(slots, table))

    def discard(self, seq_id: int) -> None:
        """Forget a swapped sequence (aborted, or to be recomputed instead)."""
        self.tier.give_back(self.slots.pop(seq_id, []))

    def checkpoint(self) -> "SwapSpaceState":
        """Open a transaction: the slots and counts as they are now, and a log of the tier's takes from now on."""
        record = SwapSpaceState(
            {seq_id: list(slots) for seq_id, slots in self.slots.items()},
            self.swap_out_blocks,
            self.swap_in_blocks,
            tier_log=[],
        )
        self.tier.log = record.tier_log
        return record

    def stop_logging(self) -> None:
        self.tier.log = None

    def restore(self, record: "SwapSpaceState", written: bool) -> list[int]:
        """Back to checkpoint. written: K/V were written since, into the slots taken meanwhile; returns the swapped
        sequences whose slots were among them (their K/V are gone)."""
        self.stop_logging()
        self.slots = {seq_id: list(slots) for seq_id, slots in record.slots.items()}
        self.swap_out_blocks, self.swap_in_blocks = record.swap_out_blocks, record.swap_in_blocks
        taken = self.tier.undo(record.tier_log)
        return [seq_id for seq_id, slots in self.slots.items() if not taken.isdisjoint(slots)] if written else []

    @property
    def num_swapped(self) -> int:
        return len(self.slots)


@dataclass
class TierHit:
    block_hash: bytes
    hash_key: tuple
    slot: int


@dataclass(frozen=True)
class PrefixTierState:
    """The prefix tier as an engine step found it (PrefixTier.checkpoint): its counts, and the logs of its changes
    while the step runs."""

    stored_blocks: int
    hit_tokens: int
    entry_log: list[tuple[bytes, tuple | None]]  # (hash, its entry before: None if there was none) per change
    tier_log: list  # the tier's takes and give-backs (KVTier.log)


class PrefixTier:
    """The prefix cache's second tier: hash -> (key, slot), least recently used first."""

    def __init__(self, block_manager: BlockManager, tier: KVTier):
        self.block_manager = block_manager
        self.tier = tier
        self.entries: OrderedDict[bytes, tuple[tuple, int]] = OrderedDict()
        self.stored_blocks = 0  # cumulative: blocks copied into the tier
        self.hit_tokens = 0  # cumulative: prompt tokens loaded from the tier instead of computed
        self._log = None  # in a transaction: the record's entry_log, see PrefixTierState

    def find(self, token_ids: list[int], extra_key, skip: int) -> list[TierHit]:
        """The run of a new prompt's full blocks after its first `skip` (the pool's hits) that the tier holds."""
        hits = []
        for index, (block_hash, key) in enumerate(self.block_manager.prompt_block_keys(token_ids, extra_key)):
            if index < skip:
                continue
            entry = self.entries.get(block_hash)
            if entry is None or entry[0] != key:
                break
            hits.append(TierHit(block_hash, key, entry[1]))
        return hits

    def load(self, seq_id: int, first_index: int, hits: list[TierHit]) -> tuple[list[tuple[int, int]], list[Block]]:
        """seq_id's table, just allocated, receives the hits at indices first_index.. : name those blocks by their
        hashes in the pool's cache. Returns the (tier slot, pool block) copies to make before the step, and the
        blocks that entered the pool's cache."""
        copies, registered = [], []
        table = self.block_manager.block_tables[seq_id]
        for index, hit in enumerate(hits, start=first_index):
            self.entries.move_to_end(hit.block_hash)
            copies.append((hit.slot, table[index]))
            block = self.block_manager.cache_loaded_block(seq_id, index, hit.block_hash, hit.hash_key)
            registered += [block] if block is not None else []
        self.hit_tokens += len(hits) * self.block_manager.block_size
        return copies, registered

    def store(self, blocks: list[Block]) -> None:
        """Copy blocks just computed and cached in the pool into the tier, unless it holds their hash already;
        when it is full the least recently used entry makes room."""
        for block in blocks:
            if block.block_hash is None or self.tier.num_slots == 0:
                continue
            if block.block_hash in self.entries:
                self.entries.move_to_end(block.block_hash)
                continue
            if self.tier.num_free == 0:
                evicted, entry = self.entries.popitem(last=False)
                self._logged(evicted, entry)
                self.tier.give_back([entry[1]])
            slot = self.tier.take(1)[0]
            try:
                self.tier.save([(block.block_id, slot)])
            except BaseException:
                self.tier.give_back([slot])
                raise
            self._logged(block.block_hash, None)
            self.entries[block.block_hash] = (block.hash_key, slot)
            self.stored_blocks += 1

    def _logged(self, block_hash: bytes, entry) -> None:
        if self._log is not None:
            self._log.append((block_hash, entry))

    def checkpoint(self) -> "PrefixTierState":
        """Open a transaction: the counts as they are now, and logs of the entries' and the tier's changes."""
        record = PrefixTierState(self.stored_blocks, self.hit_tokens, entry_log=[], tier_log=[])
        self._log, self.tier.log = record.entry_log, record.tier_log
        return record

    def stop_logging(self) -> None:
        self._log = self.tier.log = None

    def restore(self, record: "PrefixTierState", written: bool) -> None:
        """Back to checkpoint: entries stored meanwhile go, evicted ones come back at the least recently used end
        (an entry only used meanwhile keeps its new place); but if written (K/V were written since), an evicted
        entry whose slot was taken again is gone."""
        self.stop_logging()
        self.stored_blocks, self.hit_tokens = record.stored_blocks, record.hit_tokens
        log = record.entry_log
        taken = self.tier.undo(record.tier_log)
        for block_hash, entry in reversed(log):
            if entry is None:
                del self.entries[block_hash]
            else:
                self.entries[block_hash] = entry
                self.entries.move_to_end(block_hash, last=False)
        for block_hash, entry in log if written else ():
            if entry is not None and self.entries.get(block_hash) is entry and entry[1] in taken:
                del self.entries[block_hash]
                self.tier.give_back([entry[1]])
