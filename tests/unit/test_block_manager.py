"""The paged allocator's invariants, under random sequences of every operation (hypothesis).

A shadow copy of the KV contents rides along: each sequence writes its own token values into
the slots append_slot hands out (carrying out copy-on-write and swap pairs as the storage
would), and must always read back exactly what it wrote. A sharing bug shows up as a sequence
reading another's token.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.reference.kv.block_manager import BlockSpaceManager

BLOCK_SIZE, GPU_BLOCKS, CPU_BLOCKS = 4, 12, 6


class PagedAllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = BlockSpaceManager(BLOCK_SIZE, GPU_BLOCKS, CPU_BLOCKS)
        self.slots = {"gpu": {}, "cpu": {}}  # device -> slot -> value written there
        self.expected = {}  # seq_id -> the values it wrote, in position order
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _on(self, device):
        return [s for s, t in self.m.tables.items() if t.device == device]

    def _write(self, seq_id, position, value):
        self.slots["gpu"][self.m.slot(seq_id, position)] = value

    @rule(num_tokens=st.integers(1, 20))
    def allocate(self, num_tokens):
        seq_id = self._new_id()
        if not self.m.can_allocate(num_tokens):
            before = (self.m.num_free_gpu_blocks, dict(self.m.tables))
            with pytest.raises((RuntimeError, ValueError)):
                self.m.allocate(seq_id, num_tokens)
            assert before == (self.m.num_free_gpu_blocks, dict(self.m.tables))
            return
        self.m.allocate(seq_id, num_tokens)
        self.expected[seq_id] = [(seq_id, p) for p in range(num_tokens)]
        for p in range(num_tokens):
            self._write(seq_id, p, (seq_id, p))

    @precondition(lambda self: self._on("gpu"))
    @rule(data=st.data())
    def append(self, data):
        seq_id = data.draw(st.sampled_from(self._on("gpu")))
        if not self.m.can_append(seq_id):
            return
        slot, copy = self.m.append_slot(seq_id)
        if copy:  # what the storage does: copy the shared block before anyone writes
            src, dst = copy
            for off in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + off in self.slots["gpu"]:
                    self.slots["gpu"][dst * BLOCK_SIZE + off] = self.slots["gpu"][
                        src * BLOCK_SIZE + off]
        # No live sequence other than this one may hold the block it now writes into.
        block = slot // BLOCK_SIZE
        assert self.m.gpu.ref_counts[block] == 1, "writing a block that is still shared"
        position = len(self.expected[seq_id])
        value = (seq_id, position, "new")
        self.slots["gpu"][slot] = value
        self.expected[seq_id].append(value)

    @precondition(lambda self: self._on("gpu"))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._on("gpu")))
        child = self._new_id()
        self.m.fork(parent, child)
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.m.tables)))
        self.m.free(seq_id)
        del self.expected[seq_id]
        with pytest.raises(ValueError, match="holds no blocks"):
            self.m.free(seq_id)  # a double free is refused

    def _move(self, seq_id, src, dst, can, move):
        if not can(seq_id):
            return
        for old, new in move(seq_id):
            for off in range(BLOCK_SIZE):
                if old * BLOCK_SIZE + off in self.slots[src]:
                    self.slots[dst][new * BLOCK_SIZE + off] = self.slots[src][
                        old * BLOCK_SIZE + off]

    @precondition(lambda self: self._on("gpu"))
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self._on("gpu")))
        self._move(seq_id, "gpu", "cpu", self.m.can_swap_out, self.m.swap_out)

    @precondition(lambda self: self._on("cpu"))
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(self._on("cpu")))
        if not self.m.can_swap_in(seq_id) and len(self.m.tables[seq_id].blocks) > (
                self.m.num_free_gpu_blocks):
            with pytest.raises(ValueError, match="nothing was moved"):
                self.m.swap_in(seq_id)  # no room: refused, state unchanged
            assert self.m.tables[seq_id].device == "cpu"
            return
        self._move(seq_id, "cpu", "gpu", self.m.can_swap_in, self.m.swap_in)

    @invariant()
    def counts_match_block_tables(self):
        for pool in (self.m.gpu, self.m.cpu):
            refs = [0] * pool.num_blocks
            for table in self.m.tables.values():
                if table.device == pool.device:
                    for block in table.blocks:
                        refs[block] += 1
            assert refs == pool.ref_counts  # never negative, never stale
            assert all(c >= 0 for c in pool.ref_counts)
            used = sum(1 for c in pool.ref_counts if c > 0)
            assert used + pool.num_free == pool.num_blocks
            assert not any(pool.ref_counts[b] for b in pool.free_list)
            assert len(set(pool.free_list)) == pool.num_free

    @invariant()
    def every_sequence_reads_what_it_wrote(self):
        for seq_id, values in self.expected.items():
            table = self.m.tables[seq_id]
            assert table.num_tokens == len(values)
            got = [self.slots[table.device].get(self.m.slot(seq_id, p))
                   for p in range(len(values))]
            assert got == values, f"sequence {seq_id} reads another's KV"

    def teardown(self):
        for seq_id in list(self.m.tables):
            self.m.free(seq_id)
        assert self.m.num_free_gpu_blocks == GPU_BLOCKS  # nothing leaked
        assert self.m.num_free_cpu_blocks == CPU_BLOCKS


PagedAllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                   deadline=None)
TestPagedAllocator = PagedAllocatorMachine.TestCase


def test_slot_mapping_and_block_growth():
    m = BlockSpaceManager(block_size=4, num_gpu_blocks=8)
    assert m.allocate(0, 6) == [0, 1]  # 6 tokens: two blocks, the second half full
    assert m.allocate(1, 3) == [2]
    assert m.slot(0, 5) == 1 * 4 + 1
    assert m.append_slot(0) == (1 * 4 + 2, None)  # room in block 1
    m.append_slot(0)
    slot, copy = m.append_slot(0)  # block 1 full: a fresh block, 3
    assert (slot, copy) == (3 * 4, None) and m.block_table(0) == [0, 1, 3]


def test_copy_on_write_of_a_shared_last_block():
    m = BlockSpaceManager(block_size=4, num_gpu_blocks=8)
    m.allocate(0, 6)
    m.fork(0, 1)
    assert m.gpu.ref_counts[:2] == [2, 2]
    slot, copy = m.append_slot(1)  # the child writes first: it gets a private copy of block 1
    assert copy == (1, 2) and slot == 2 * 4 + 2
    assert m.block_table(1) == [0, 2] and m.gpu.ref_counts[:3] == [2, 1, 1]
    assert m.append_slot(0) == (1 * 4 + 2, None)  # the parent now owns block 1 alone


def test_bad_input_leaves_the_state_unchanged():
    m = BlockSpaceManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=1)
    with pytest.raises(ValueError, match="more than the whole pool of 3"):
        m.allocate(0, 13)
    assert m.num_free_gpu_blocks == 3 and not m.tables
    m.allocate(0, 8)
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate(0, 1)
    with pytest.raises(ValueError, match="needs 2 blocks, 1 are free; nothing was moved"):
        m.swap_out(0)
    assert m.block_table(0) == [0, 1] and m.num_free_cpu_blocks == 1
    m.free(0)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.free(0)
    assert m.num_free_gpu_blocks == 3
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockSpaceManager(0, 4)


def test_swap_in_without_room_is_refused():
    m = BlockSpaceManager(block_size=2, num_gpu_blocks=2, num_cpu_blocks=2)
    m.allocate(0, 4)
    m.swap_out(0)
    m.allocate(1, 3)  # takes both GPU blocks back
    assert not m.can_swap_in(0)
    with pytest.raises(ValueError, match="nothing was moved"):
        m.swap_in(0)
    assert m.tables[0].device == "cpu" and m.num_free_cpu_blocks == 0
