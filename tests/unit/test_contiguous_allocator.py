"""The contiguous allocator: reservation policies, first-fit placement, exact accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.reference.kv.contiguous_allocator import (
    POLICIES,
    ContiguousAllocator,
    next_power_of_two,
)


def snapshot(a: ContiguousAllocator) -> list[tuple]:
    return [(s.request_id, s.start, s.length, s.prompt_len, s.output_len, s.num_tokens)
            for s in a.slabs]


def test_reservation_per_policy():
    assert ContiguousAllocator(4096, "max").reservation(10, 25) == 2048  # the model's max length
    assert ContiguousAllocator(4096, "pow2").reservation(10, 25) == 10 + 32  # 25 -> 32
    assert ContiguousAllocator(4096, "pow2").reservation(10, 32) == 10 + 32  # exact stays
    assert ContiguousAllocator(4096, "pow2").reservation(1500, 520) == 2048  # capped at max_len
    assert ContiguousAllocator(4096, "oracle").reservation(10, 25) == 35
    assert [next_power_of_two(n) for n in (1, 2, 3, 25, 1024, 1025)] == [1, 2, 4, 32, 1024, 2048]


def test_first_fit_takes_the_lowest_gap_that_fits():
    a = ContiguousAllocator(1000, "oracle", max_len=1000)
    assert a.allocate(0, 50, 50) == 0  # [0, 100)
    assert a.allocate(1, 100, 100) == 100  # [100, 300)
    assert a.allocate(2, 25, 25) == 300  # [300, 350)
    a.free(1)
    assert a.gaps() == [(100, 200), (350, 650)]
    assert a.allocate(3, 75, 75) == 100  # the first gap fits 150: [100, 250)
    assert a.allocate(4, 30, 30) == 350  # the 50 left at 250 is too small for 60
    assert a.gaps() == [(250, 50), (410, 590)]
    assert a.slab(3) == (100, 150)


def test_slots_are_start_plus_position():
    a = ContiguousAllocator(100, "max", max_len=40)
    a.allocate(7, 3, 5)
    a.allocate(8, 4, 5)
    start, length = a.slab(8)
    assert (start, length) == (40, 40)
    assert [a.append_slot(8) for _ in range(3)] == [start + 4, start + 5, start + 6]
    assert a.num_tokens(8) == 7


def test_accounting_by_hand():
    a = ContiguousAllocator(100, "max", max_len=50)
    a.allocate(0, 10, 20)  # slab [0, 50): 10 tokens, 20 reserved, 20 never used
    for _ in range(5):
        a.append_slot(0)
    parts = a.accounting()
    assert (parts.token_states, parts.reserved, parts.internal) == (15, 15, 20)
    assert (parts.external, parts.free) == (0, 50)  # nobody waits: the free 50 are free
    waiting = a.accounting(next_request=(1, 1))  # wants a 50-slot slab: the gap of 50 fits it
    assert (waiting.external, waiting.free) == (0, 50)
    b = ContiguousAllocator(100, "oracle", max_len=100)
    b.allocate(0, 10, 20)  # [0, 30)
    b.allocate(1, 10, 20)  # [30, 60); free gap [60, 100) of 40
    parts = b.accounting(next_request=(30, 20))  # wants 50: the 40 free slots are stranded
    assert (parts.token_states, parts.reserved, parts.internal) == (20, 40, 0)
    assert (parts.external, parts.free, parts.total) == (40, 0, 100)


def test_the_papers_max_external_fragmentation():
    """15,728 slots hold seven 2048-slot slabs; the 1,392 left can never hold an eighth."""
    a = ContiguousAllocator(15_728, "max")
    for i in range(7):
        a.allocate(i, 100, 300)
    assert not a.can_allocate(1, 1)
    parts = a.accounting(next_request=(1, 1))
    assert parts.external == 15_728 - 7 * 2048 == 1392
    assert round(100 * parts.external / 15_728, 1) == 8.9  # the paper's bar: 8.9 %


def test_free_merges_neighbouring_gaps():
    a = ContiguousAllocator(30, "oracle", max_len=30)
    for i in range(3):
        a.allocate(i, 5, 5)
    a.free(0)
    a.free(2)
    assert a.gaps() == [(0, 10), (20, 10)]
    a.free(1)
    assert a.gaps() == [(0, 30)]
    assert a.allocate(3, 20, 10) == 0  # the whole space is one gap again


# -- bad input: a clear error, and nothing changes -----------------------------------------

def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown reservation policy 'best'; choose one of max"):
        ContiguousAllocator(100, "best")
    with pytest.raises(ValueError, match="total_slots must be >= 1"):
        ContiguousAllocator(0, "max")


def test_request_larger_than_the_space_is_refused_and_changes_nothing():
    a = ContiguousAllocator(1000, "max", max_len=2048)
    with pytest.raises(ValueError, match="more than the whole KV space of 1000 slots"):
        a.allocate(0, 1, 1)  # max reserves 2048
    b = ContiguousAllocator(1000, "oracle", max_len=2048)
    b.allocate(0, 10, 10)
    before = snapshot(b)
    with pytest.raises(ValueError, match="reserves 1200 slots"):
        b.allocate(1, 600, 600)
    assert snapshot(b) == before
    with pytest.raises(ValueError, match="exceeds the model's max_len of 2048"):
        b.allocate(1, 2000, 100)
    with pytest.raises(ValueError, match="must be >= 1"):
        b.allocate(1, 0, 5)
    assert snapshot(b) == before


def test_double_free_is_refused_and_changes_nothing():
    a = ContiguousAllocator(100, "oracle", max_len=100)
    a.allocate(0, 10, 10)
    a.allocate(1, 10, 10)
    a.free(0)
    before, gaps = snapshot(a), a.gaps()
    with pytest.raises(ValueError, match="request 0 holds no slab .*freed already"):
        a.free(0)
    assert snapshot(a) == before and a.gaps() == gaps
    with pytest.raises(ValueError, match="request 5 holds no slab"):
        a.slab(5)


def test_waiting_and_misuse_errors_change_nothing():
    a = ContiguousAllocator(100, "oracle", max_len=100)
    a.allocate(0, 30, 30)
    before = snapshot(a)
    with pytest.raises(RuntimeError, match="no free gap of 60 slots \\(the largest is 40\\)"):
        a.allocate(1, 30, 30)  # fits the space, not now: the caller should wait
    with pytest.raises(ValueError, match="already holds a slab"):
        a.allocate(0, 1, 1)
    assert snapshot(a) == before
    b = ContiguousAllocator(10, "pow2", max_len=10)
    b.allocate(0, 2, 3)  # slab of 2 + 4, will use 5
    for _ in range(3):
        b.append_slot(0)
    with pytest.raises(ValueError, match="already holds all its .* 5 tokens"):
        b.append_slot(0)
    assert b.num_tokens(0) == 5


# -- properties over random sequences of reserve / append / free ---------------------------

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "append", "free"]),
                         st.integers(0, 9), st.integers(1, 40), st.integers(1, 40)),
               max_size=60)


def lowest_fit(occupied: list[bool], length: int) -> int | None:
    """First fit by brute force over an occupancy map: an independent implementation."""
    run = 0
    for slot, used in enumerate(occupied):
        run = 0 if used else run + 1
        if run == length:
            return slot - length + 1
    return None


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICIES), total=st.integers(1, 200), ops=OPS,
       waiting=st.one_of(st.none(), st.tuples(st.integers(1, 30), st.integers(1, 30))))
def test_random_sequences_keep_the_invariants(policy, total, ops, waiting):
    a = ContiguousAllocator(total, policy, max_len=64)
    occupied = [False] * total  # the reference model: which slots belong to some slab
    for op, rid, p, o in ops:
        if op == "alloc":
            length = a.reservation(p, o) if p + o <= 64 else total + 1  # too long: refused
            expected = lowest_fit(occupied, length) if length <= total else None
            if rid in a._by_id or expected is None:
                before = snapshot(a)
                with pytest.raises((ValueError, RuntimeError)):
                    a.allocate(rid, p, o)
                assert snapshot(a) == before  # a refused request changes nothing
                continue
            assert a.allocate(rid, p, o) == expected  # first fit
            occupied[expected:expected + length] = [True] * length
        elif op == "append" and rid in a._by_id:
            start, _ = a.slab(rid)
            position = a.num_tokens(rid)
            if position < a._by_id[rid].will_use:
                assert a.append_slot(rid) == start + position
            else:
                with pytest.raises(ValueError, match="already holds all"):
                    a.append_slot(rid)
                assert a.num_tokens(rid) == position
        elif op == "free" and rid in a._by_id:
            start, length = a.slab(rid)
            free_before = a.accounting().free
            a.free(rid)
            occupied[start:start + length] = [False] * length
            assert any(g <= start and start + length <= g + n for g, n in a.gaps())
            assert a.accounting().free == free_before + length  # the gap is restored
        # Slabs never overlap and stay inside the space.
        cursor = 0
        for slab in a.slabs:
            assert slab.start >= cursor and slab.length >= 1
            assert slab.prompt_len <= slab.num_tokens <= slab.will_use <= slab.length
            cursor = slab.start + slab.length
        assert cursor <= total
        assert [not used for used in occupied].count(True) == sum(n for _, n in a.gaps())
        # The five parts account for every slot, none negative.
        parts = a.accounting(waiting)
        assert parts.total == total
        assert min(parts.token_states, parts.reserved, parts.internal, parts.external,
                   parts.free) >= 0
    for rid in list(a._by_id):
        a.free(rid)
    assert a.gaps() == [(0, total)]  # everything freed: one gap, nothing leaked
