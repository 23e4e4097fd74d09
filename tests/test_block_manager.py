"""The block manager's invariants under random operation sequences (hypothesis), and its admission answers."""

import pytest
from helpers import assert_ref_counts_exact
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.core.block_manager import AllocStatus, Block, BlockManager, FreeBlockQueue, NoFreeBlocksError


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences grow, fork and finish at random; the pool's books must balance after every operation."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def make(self, num_blocks, block_size):
        self.manager = BlockManager(num_blocks, block_size)
        self.lengths: dict[int, int] = {}  # seq_id -> tokens its table must cover
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 100))
    def add_sequence(self, num_tokens):
        status = self.manager.can_allocate(num_tokens)
        free_before = self.manager.num_free_blocks
        if status is AllocStatus.OK:
            self.manager.allocate(self.next_id, num_tokens)
            self.lengths[self.next_id] = num_tokens
            self.next_id += 1
        else:
            with pytest.raises(NoFreeBlocksError):
                self.manager.allocate(self.next_id, num_tokens)
            assert self.manager.num_free_blocks == free_before and self.next_id not in self.manager.block_tables
            needed = -(-num_tokens // self.manager.block_size)
            assert (status is AllocStatus.NEVER) == (needed > self.manager.num_blocks)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), extra=st.integers(1, 40))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        target = self.lengths[seq_id] + extra
        if self.manager.can_allocate(target, seq_id) is AllocStatus.OK:
            self.manager.allocate(seq_id, target)
            self.lengths[seq_id] = target

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.lengths)))
        self.manager.fork(parent, self.next_id)
        self.lengths[self.next_id] = self.lengths[parent]
        self.next_id += 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), keep=st.integers(0, 100))
    def truncate(self, data, keep):
        """Speculative decoding's rollback: the table shrinks to the tokens kept; shared blocks stay shared."""
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        keep = min(keep, self.lengths[seq_id])
        table = list(self.manager.block_tables[seq_id])
        free_before = self.manager.num_free_blocks
        dropped = self.manager.truncate(seq_id, keep)
        assert dropped == table[len(self.manager.block_tables[seq_id]) :][::-1]
        now_free = sum(1 for b in dropped if self.manager.ref_count(b) == 0)
        assert self.manager.num_free_blocks == free_before + now_free
        self.lengths[seq_id] = keep

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        self.manager.free(seq_id)
        del self.lengths[seq_id]

    @invariant()
    def books_balance(self):
        if not hasattr(self, "manager"):
            return
        manager = self.manager
        assert_ref_counts_exact(manager)
        for seq_id, table in manager.block_tables.items():
            assert len(table) * manager.block_size >= self.lengths[seq_id]
            assert len(table) == -(-self.lengths[seq_id] // manager.block_size)  # no block more than needed

    def teardown(self):
        if hasattr(self, "manager"):
            for seq_id in list(self.lengths):
                self.manager.free(seq_id)
            assert self.manager.num_free_blocks == self.manager.num_blocks  # nothing leaked


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_free_queue_is_fifo_and_removes_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2] and queue.num_free == 4


def test_slot_mapping_follows_the_block_table():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate(0, 3)  # takes block 0
    manager.allocate(1, 6)  # takes blocks 1, 2
    manager.allocate(0, 9)  # grows into blocks 3, 4
    assert manager.block_tables[0] == [0, 3, 4]
    assert manager.slot_mapping(0, 2, 9) == [2, 3, 12, 13, 14, 15, 16]
    assert manager.slot_mapping(1, 0, 6) == [4, 5, 6, 7, 8, 9]


def test_truncate_gives_back_blocks_past_the_kept_tokens_but_never_a_cached_one():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(20))
    manager.allocate(0, 13)  # blocks 0..3: tokens 0..12, room for 3 more
    manager.cache_full_blocks(0, tokens, 8)  # blocks 0, 1 hold accepted tokens 0..7
    assert manager.truncate(0, 9) == [3]  # tokens 9..12 were rejected: block 3 held only those
    assert manager.block_tables[0] == [0, 1, 2] and manager.num_free_blocks == 5
    assert manager.truncate(0, 2) == [2]  # block 1 is in the prefix cache: it stays
    assert manager.block_tables[0] == [0, 1] and manager.num_cached_blocks == 2
    manager.free(0)
    assert manager.num_free_blocks == 8


@pytest.mark.parametrize("block_size", [0, -16, 3, 24, 16.0])
def test_block_size_must_be_a_positive_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=block_size)


def test_admission_answers_ok_later_never():
    manager = BlockManager(num_blocks=4, block_size=16)
    assert manager.can_allocate(64) is AllocStatus.OK
    assert manager.can_allocate(65) is AllocStatus.NEVER
    manager.allocate(0, 40)
    assert manager.can_allocate(16) is AllocStatus.OK
    assert manager.can_allocate(17) is AllocStatus.LATER
    manager.free(0)
    assert manager.can_allocate(64) is AllocStatus.OK
