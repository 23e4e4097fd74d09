"""Speculative decoding's block operations under random sequences of propose / accept / reject / fork / free
(hypothesis): the pool's books balance, rejected drafts' blocks come back at once, and their slots are reused."""

from helpers import assert_ref_counts_exact
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.core.block_manager import AllocStatus, BlockManager
from paged.geometry import cdiv


class SpeculativeBlocksMachine(RuleBasedStateMachine):
    """Each sequence has `computed` tokens with K/V and one more token to run; a proposal of k drafts grows its
    table to computed + 1 + k tokens as the scheduler does (copy-on-write for shared blocks), and a verify that
    keeps a of them rolls back to computed + 1 + a."""

    @initialize(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4, 8]))
    def make(self, num_blocks, block_size):
        self.manager = BlockManager(num_blocks, block_size)
        self.computed: dict[int, int] = {}  # seq_id -> tokens with K/V
        self.proposed: dict[int, list[int]] = {}  # seq_id -> slots of the verify's positions, while proposed
        self.next_id = 0
        self.reused = 0

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens):
        if self.manager.can_allocate(num_tokens) is AllocStatus.OK:
            self.manager.allocate(self.next_id, num_tokens)
            self.computed[self.next_id] = num_tokens
            self.next_id += 1

    @precondition(lambda self: set(self.computed) - set(self.proposed))
    @rule(data=st.data(), k=st.integers(1, 6))
    def propose(self, data, k):
        seq_id = data.draw(st.sampled_from(sorted(set(self.computed) - set(self.proposed))))
        start = self.computed[seq_id]
        if self.manager.can_allocate(start + 1 + k, seq_id, write_from=start) is not AllocStatus.OK:
            return  # the scheduler drops the drafts when the pool has no room for them
        self.manager.allocate(seq_id, start + 1 + k, write_from=start)
        self.manager.take_pending_copies()
        self.proposed[seq_id] = self.manager.slot_mapping(seq_id, start, start + 1 + k)

    @precondition(lambda self: self.proposed)
    @rule(data=st.data(), fraction=st.floats(0, 1))
    def verify(self, data, fraction):
        """Accept all drafts (fraction 1) or reject from some point on."""
        seq_id = data.draw(st.sampled_from(sorted(self.proposed)))
        slots = self.proposed.pop(seq_id)
        k = len(slots) - 1
        accepted = int(fraction * k)
        self.computed[seq_id] += 1 + accepted
        free_before = self.manager.num_free_blocks
        dropped = self.manager.truncate(seq_id, self.computed[seq_id])
        assert self.manager.num_free_blocks == free_before + len(dropped)  # drafts' blocks are never shared
        if accepted < k:  # the next token goes where the first rejected draft went
            position, table = self.computed[seq_id], self.manager.block_tables[seq_id]
            size = self.manager.block_size
            if position // size < len(table):
                assert table[position // size] * size + position % size == slots[1 + accepted]
                self.reused += 1

    @precondition(lambda self: set(self.computed) - set(self.proposed))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(set(self.computed) - set(self.proposed))))
        self.manager.fork(parent, self.next_id)
        self.computed[self.next_id] = self.computed[parent]
        self.next_id += 1

    @precondition(lambda self: self.computed)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.computed)))
        self.manager.free(seq_id)
        del self.computed[seq_id]
        self.proposed.pop(seq_id, None)

    @invariant()
    def books_balance(self):
        if not hasattr(self, "manager"):
            return
        manager = self.manager
        assert_ref_counts_exact(manager)
        for seq_id, table in manager.block_tables.items():
            if seq_id in self.proposed:
                assert len(table) * manager.block_size >= self.computed[seq_id] + len(self.proposed[seq_id])
            else:  # no block past the tokens the sequence keeps
                assert len(table) == cdiv(self.computed[seq_id], manager.block_size)

    def teardown(self):
        if hasattr(self, "manager"):
            for seq_id in list(self.computed):
                self.manager.free(seq_id)
            assert self.manager.num_free_blocks == self.manager.num_blocks  # nothing leaked


TestSpeculativeBlocks = SpeculativeBlocksMachine.TestCase
TestSpeculativeBlocks.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
