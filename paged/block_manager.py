"""The block manager: a pool of fixed-size KV blocks, their reference counts, and one block table per sequence
(guide §5 "block tables", §6 "the physical pool").

Nothing here touches tensors. A block is only a number: the index of a slab of `block_size` token slots in every
layer's K and V pool (`kv_cache.py`). A sequence's block table lists the blocks that hold its tokens in order, so
token t of a sequence lives in slot `table[t // block_size] * block_size + t % block_size` (its slot mapping).

The free blocks wait in a doubly linked queue, as in vLLM v1's `block_pool.py`: taking one, returning one and
pulling one out of the middle are all O(1), with no list scans. A block's reference count is the number of block
tables that hold it; it returns to the queue when that count drops to zero.
"""

import enum
from dataclasses import dataclass, field


class AllocStatus(enum.Enum):
    """The admission check's answer for a request."""
    OK = "ok"        # enough free blocks now
    LATER = "later"  # the pool could hold it, but other sequences hold the blocks now
    NEVER = "never"  # more blocks than the whole pool has


class NoFreeBlocksError(RuntimeError):
    """Raised when the pool is asked for more blocks than it has free; callers check first."""


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    prev_free: "Block | None" = field(default=None, repr=False)
    next_free: "Block | None" = field(default=None, repr=False)


class FreeBlockQueue:
    """Free blocks in the order they should be reused (oldest first), as a doubly linked list with sentinels."""

    def __init__(self, blocks: list[Block]):
        self._head, self._tail = Block(-1), Block(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> Block:
        if self.num_free == 0:
            raise NoFreeBlocksError("no free KV blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Hands out blocks to sequences and keeps their block tables. Sequences are named by integer ids."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks seq_id needs so that its table covers num_tokens tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.block_tables.get(seq_id, ())))

    def can_allocate(self, num_tokens: int, seq_id: int | None = None) -> AllocStatus:
        """Admission: can a sequence (new, or seq_id growing) hold num_tokens tokens now, later, or never?"""
        if cdiv(num_tokens, self.block_size) > self.num_blocks:
            return AllocStatus.NEVER
        if self.blocks_needed(seq_id, num_tokens) > self.num_free_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow seq_id's table (creating it if new) to cover num_tokens tokens; all or nothing."""
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.num_free_blocks} are free")
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(needed):
            block = self.free_queue.popleft()
            block.ref_count = 1
            table.append(block.block_id)
        return table

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        """The child shares every block of the parent (copy-on-write happens when one of them writes)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = list(self.block_tables[parent_id])
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.block_tables[child_id] = table
        return table

    def free(self, seq_id: int) -> None:
        """Drop seq_id's table; blocks nobody else holds go back to the free queue, last block first."""
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slots of tokens start..end-1 of seq_id."""
        table, size = self.block_tables[seq_id], self.block_size
        return [table[t // size] * size + t % size for t in range(start, end)]

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count
