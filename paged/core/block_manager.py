"""The block manager: a pool of fixed-size KV blocks, their reference counts, and one block table per sequence
(guide §5 "block tables", §6 "the physical pool").

Nothing here touches tensors. A block is only a number: the index of a slab of `block_size` token slots in every
layer's K and V pool (`engine/kv_cache.py`). A sequence's block table lists the blocks that hold its tokens in order, so
token t of a sequence lives in slot `table[t // block_size] * block_size + t % block_size` (its slot mapping).

The free blocks wait in a doubly linked queue, as in vLLM v1's `block_pool.py`: taking one, returning one and
pulling one out of the middle are all O(1), with no list scans. A block's reference count is the number of block
tables that hold it; it returns to the queue when that count drops to zero.

Prefix caching (guide §9, `enable_prefix_caching=True`): a full block is named by a chained hash
H(parent block's hash, its token ids, extra keys such as an adapter id), and `cached` maps hash -> block. H is
SHA-256 over a canonical encoding of those three (`hash_block_tokens`), as vLLM does, so a block has the same name
in every process: a tier on disk or another worker can look it up (guide §15). Python's `hash()` would not do: it
is salted per process. A block
whose count drops to zero keeps its contents and its hash and waits in the free queue; a new sequence whose prompt
starts with the same blocks takes them back instead of computing them again. The free queue is the LRU order of
eviction: a block taken from its head for fresh use loses its hash then, and only then.

An engine step is a transaction (guide §11, engine/journal.py): `checkpoint` returns what `restore` needs to put the
manager back as it was, cheaply (the tables are copied; the free queue and the prefix cache's names log their
changes into the record, undone in reverse), and `stop_logging` closes the logs when the step commits.
"""

import enum
import hashlib
import pickle
from dataclasses import dataclass, field

from paged.geometry import cdiv
from paged.validation import block_size_of, integer


def canonical_extra_key(extra_key):
    """The extra key of a block hash in a form that pickles alike in every process: None, an int, a str, or a
    (nested) tuple of those. Anything else (a float, a list, an object) raises a ValueError."""
    if extra_key is None or isinstance(extra_key, str):
        return extra_key
    if isinstance(extra_key, int) and not isinstance(extra_key, bool):
        return int(extra_key)  # an IntEnum, say, pickles as its plain value
    if isinstance(extra_key, tuple):
        return tuple(canonical_extra_key(part) for part in extra_key)
    raise ValueError(
        f"a prefix-cache extra key (Request.cache_key) must be None, an int, a str or a tuple of those, "
        f"got {extra_key!r} ({type(extra_key).__name__})"
    )


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_key=None) -> bytes:
    """A full block's name: the SHA-256 digest (32 bytes) of its parent's digest, its token ids and the extra key,
    pickled with a fixed protocol, so every process computes the same name for the same prefix."""
    payload = (parent_hash, tuple(int(t) for t in token_ids), canonical_extra_key(extra_key))
    return hashlib.sha256(pickle.dumps(payload, protocol=4)).digest()


class AllocStatus(enum.Enum):
    """The admission check's answer for a request."""

    OK = "ok"  # enough free blocks now
    LATER = "later"  # the pool could hold it, but other sequences hold the blocks now
    NEVER = "never"  # more blocks than the whole pool has


class NoFreeBlocksError(RuntimeError):
    """Raised when the pool is asked for more blocks than it has free; callers check first."""


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is full and registered in the prefix cache
    hash_key: tuple | None = None  # (parent hash, token ids, extra key): confirms a hash match
    prev_free: "Block | None" = field(default=None, repr=False)
    next_free: "Block | None" = field(default=None, repr=False)


class FreeBlockQueue:
    """Free blocks in the order they should be reused (oldest first), as a doubly linked list with sentinels."""

    def __init__(self, blocks: list[Block]):
        self._head, self._tail = Block(-1), Block(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        self.log: list[tuple[Block, Block | None]] | None = None  # in a transaction: (block, its prev) per change
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        if self.log is not None:
            self.log.append((block, None))
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        if self.log is not None:
            self.log.append((block, block.prev_free))
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> Block:
        if self.num_free == 0:
            raise NoFreeBlocksError("no free KV blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def undo(self, log: list[tuple[Block, Block | None]]) -> None:
        """Undo the changes in log (closed: self.log is None), newest first: each block goes back where it was."""
        for block, prev in reversed(log):
            if prev is None:  # it was appended: unlink it
                self.remove(block)
            else:  # it was removed: link it again after the block that preceded it
                block.prev_free, block.next_free = prev, prev.next_free
                prev.next_free.prev_free = prev.next_free = block
                self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


@dataclass(frozen=True)
class BlockManagerState:
    """The manager as an engine step found it (BlockManager.checkpoint): copies of its tables, and the logs its
    changes go to while the step runs, undone newest first on restore."""

    block_tables: dict[int, list[int]]
    block_hashes: dict[int, list[bytes]]
    pending_copies: list[tuple[int, int]]
    free_log: list[tuple[Block, Block | None]]  # the free queue's changes: (block, its prev; None if appended)
    renamed: list[tuple[Block, bytes | None, tuple | None]]  # (block, its hash, its key) before each change of name
    fresh: list[Block]  # blocks taken for fresh use, whose old contents may go


class BlockManager:
    """Hands out blocks to sequences and keeps their block tables. Sequences are named by integer ids."""

    hash_function = staticmethod(hash_block_tokens)  # (parent hash, token ids, extra key) -> a block's hash

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        block_size = block_size_of(block_size)
        num_blocks = integer("num_blocks", num_blocks, low=1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.cached: dict[bytes, Block] = {}  # block hash -> block holding those tokens
        self.block_hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full, registered blocks
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) block copies not yet done
        self._log: BlockManagerState | None = None  # in a transaction: the record whose logs its changes go to

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def blocks_needed(self, seq_id: int | None, num_tokens: int, write_from: int | None = None) -> int:
        """How many free blocks seq_id needs so that its table covers num_tokens tokens, counting a copy of
        every shared block it is about to write into (tokens write_from..num_tokens-1)."""
        table = self.block_tables.get(seq_id, ())
        grow = max(0, cdiv(num_tokens, self.block_size) - len(table))
        return grow + sum(
            1 for i in self._written_blocks(table, num_tokens, write_from) if self.blocks[table[i]].ref_count > 1
        )

    def _written_blocks(self, table, num_tokens: int, write_from: int | None) -> range:
        """Indices of the table's existing blocks that tokens write_from..num_tokens-1 write into."""
        if write_from is None:
            return range(0)
        return range(write_from // self.block_size, min(len(table), cdiv(num_tokens, self.block_size)))

    def can_allocate(
        self, num_tokens: int, seq_id: int | None = None, prefix_hits: list[Block] = (), write_from: int | None = None
    ) -> AllocStatus:
        """Admission: can a sequence (new, or seq_id growing) hold num_tokens tokens now, later, or never?
        prefix_hits: a new sequence's prefix-cache hits, which it takes instead of fresh blocks."""
        if cdiv(num_tokens, self.block_size) > self.num_blocks:
            return AllocStatus.NEVER
        idle_hits = sum(1 for block in prefix_hits if block.ref_count == 0)  # they leave the free queue
        needed = self.blocks_needed(seq_id, num_tokens, write_from) - len(prefix_hits)
        if needed > self.num_free_blocks - idle_hits:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(
        self, seq_id: int, num_tokens: int, prefix_hits: list[Block] = (), write_from: int | None = None
    ) -> list[int]:
        """Grow seq_id's table (creating it if new, starting with its cache hits) to cover num_tokens tokens,
        and give it private copies of shared blocks it will write into from write_from on; all or nothing.
        The copies to make are queued in pending_copies for the engine."""
        if self.can_allocate(num_tokens, seq_id, prefix_hits, write_from) is not AllocStatus.OK:
            raise NoFreeBlocksError(
                f"sequence {seq_id} cannot grow to {num_tokens} tokens: {self.num_free_blocks} blocks are free"
            )
        table = self.block_tables.setdefault(seq_id, [])
        for block in prefix_hits:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            table.append(block.block_id)
        if prefix_hits:
            self.block_hashes[seq_id] = [block.block_hash for block in prefix_hits]
        for index in self._written_blocks(table, num_tokens, write_from):
            shared = self.blocks[table[index]]
            if shared.ref_count > 1:  # copy-on-write: the others keep the original
                shared.ref_count -= 1
                table[index] = self._take_free_block().block_id
                self.pending_copies.append((shared.block_id, table[index]))
        for _ in range(cdiv(num_tokens, self.block_size) - len(table)):
            table.append(self._take_free_block().block_id)
        return table

    def _take_free_block(self) -> Block:
        block = self.free_queue.popleft()
        if self._log is not None:
            self._log.fresh.append(block)
        if block.block_hash is not None:  # evict: the least recently used cached block is reused
            self._rename(block, None, None)
        block.ref_count = 1
        return block

    def _rename(self, block: Block, block_hash: bytes | None, key: tuple | None) -> None:
        """Name block in the prefix cache by block_hash (None: take its name out), logged in a transaction."""
        if self._log is not None:
            self._log.renamed.append((block, block.block_hash, block.hash_key))
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash, block.hash_key = block_hash, key
        if block_hash is not None:
            self.cached[block_hash] = block

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- prefix caching ---------------------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int], extra_key=None) -> list[Block]:
        """The longest run of leading full blocks of a new prompt that the cache holds, confirmed token by token.
        The last prompt token is never taken from the cache: its logits are needed to sample the first output."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash, key in self.prompt_block_keys(token_ids, extra_key):
            block = self.cached.get(block_hash)
            if block is None or block.hash_key != key:
                break
            hits.append(block)
        return hits

    def prompt_block_keys(self, token_ids: list[int], extra_key=None):
        """(hash, key) of each full block of a new prompt that a cache may serve, in order: all but the block that
        holds the last prompt token. A generator: a lookup stops hashing at its first miss."""
        parent = None
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            key = self._hash_key(parent, token_ids, start, extra_key)
            parent = self.hash_function(*key)
            yield parent, key

    def _hash_key(self, parent_hash: bytes | None, token_ids: list[int], start: int, extra_key) -> tuple:
        """What names the full block of tokens start..start+block_size-1: its hash is hash_function(*key)."""
        return parent_hash, tuple(token_ids[start : start + self.block_size]), extra_key

    def cache_full_blocks(
        self, seq_id: int, token_ids: list[int], num_computed_tokens: int, extra_key=None
    ) -> list[Block]:
        """Register the blocks of seq_id that are now full of computed tokens under their chained hashes.
        Returns the blocks that entered the cache (a block already named by an earlier copy does not)."""
        if not self.enable_prefix_caching:
            return []
        registered = []
        hashes = self.block_hashes.setdefault(seq_id, [])
        table = self.block_tables[seq_id]
        for index in range(len(hashes), num_computed_tokens // self.block_size):
            key = self._hash_key(hashes[-1] if hashes else None, token_ids, index * self.block_size, extra_key)
            block_hash = self.hash_function(*key)
            hashes.append(block_hash)
            block = self.blocks[table[index]]
            if block_hash not in self.cached and block.block_hash is None:  # keep the first copy of a prefix
                self._rename(block, block_hash, key)
                registered.append(block)
        return registered

    def cache_loaded_block(self, seq_id: int, index: int, block_hash: bytes, key: tuple) -> Block | None:
        """Block `index` of seq_id's table receives, from another tier, the K/V named block_hash: count it as a
        full block of seq_id and name it in the cache, as if computed here. Returns it if it entered the cache."""
        hashes = self.block_hashes.setdefault(seq_id, [])
        assert index == len(hashes), "loaded blocks follow the sequence's cached ones"
        hashes.append(block_hash)
        block = self.blocks[self.block_tables[seq_id][index]]
        if block_hash in self.cached:
            return None
        self._rename(block, block_hash, key)
        return block

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def fork(self, parent_id: int, child_id: int, num_tokens: int | None = None) -> list[int]:
        """The child shares the parent's blocks (copy-on-write happens when one of them writes): every one, or
        those that hold the first num_tokens tokens."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = self.block_tables[parent_id]
        table = list(table if num_tokens is None else table[: cdiv(num_tokens, self.block_size)])
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.block_tables[child_id] = table
        if parent_id in self.block_hashes:
            self.block_hashes[child_id] = list(self.block_hashes[parent_id])
        return table

    def free(self, seq_id: int) -> None:
        """Drop seq_id's table; blocks nobody else holds go back to the free queue, last block first."""
        self.block_hashes.pop(seq_id, None)
        self._release(reversed(self.block_tables.pop(seq_id, [])))

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Shrink seq_id's table to the blocks that hold its first num_tokens tokens (speculative decoding, guide
        §14: blocks that hold only rejected draft tokens go back to the pool at once). Returns the dropped block
        ids, last first. Blocks already registered in the prefix cache are never dropped: they hold accepted tokens."""
        table = self.block_tables[seq_id]
        keep = max(cdiv(num_tokens, self.block_size), len(self.block_hashes.get(seq_id, ())))
        dropped = table[keep:][::-1]
        del table[keep:]
        self._release(dropped)
        return dropped

    def _release(self, block_ids) -> None:
        """One table fewer holds each block; a block nobody holds returns to the free queue, in the order given."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    # ---- transactions ---------------------------------------------------------------------------------------------

    def checkpoint(self) -> "BlockManagerState":
        """Open a transaction: from now on restore(record) can put every table, ref count, free block and cached
        name back as it is now. Costs a copy of the tables (the blocks in use), not of the pool."""
        record = BlockManagerState(
            {seq_id: list(table) for seq_id, table in self.block_tables.items()},
            {seq_id: list(hashes) for seq_id, hashes in self.block_hashes.items()},
            list(self.pending_copies),
            free_log=[],
            renamed=[],
            fresh=[],
        )
        self.free_queue.log, self._log = record.free_log, record
        return record

    def stop_logging(self) -> None:
        """Close the transaction: what it did stays."""
        self._log = self.free_queue.log = None

    def restore(self, record: "BlockManagerState", written: bool) -> list[int]:
        """Put the manager back as it was at checkpoint and close the transaction. The free queue comes back in its
        order. written: K/V tensors were written since checkpoint, into the blocks taken for fresh use; those
        blocks then keep no cached name, and the ids of sequences whose restored tables hold one of them (a
        sequence preempted in the meantime, its blocks given to another) are returned: their K/V are gone."""
        self.stop_logging()
        self.free_queue.undo(record.free_log)
        for block, block_hash, key in reversed(record.renamed):  # newest first, each name back as it was
            self._rename(block, block_hash, key)
        tables = {seq_id: list(table) for seq_id, table in record.block_tables.items()}
        self.block_tables, self.pending_copies = tables, list(record.pending_copies)
        self.block_hashes = {seq_id: list(hashes) for seq_id, hashes in record.block_hashes.items()}
        for block in self.blocks:  # a block's count is the number of tables that hold it
            block.ref_count = 0
        for table in tables.values():
            for block_id in table:
                self.blocks[block_id].ref_count += 1
        if not written:
            return []
        fresh = {block.block_id for block in record.fresh}
        for block_id in fresh:
            if self.blocks[block_id].block_hash is not None:
                self._rename(self.blocks[block_id], None, None)
        return [seq_id for seq_id, table in tables.items() if not fresh.isdisjoint(table)]

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slots of tokens start..end-1 of seq_id."""
        table, size = self.block_tables[seq_id], self.block_size
        return [table[t // size] * size + t % size for t in range(start, end)]

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count
