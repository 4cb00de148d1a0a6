"""Checks lesson 2's exercise: first-fit placement and the accounting of every slot.

    pytest lessons/exercises/test_contiguous_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/contiguous_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is ContiguousAllocator (reference/kv/contiguous_allocator.py). Requests with
random prompt and output lengths arrive, reserve a slab under the policy (max, pow2 or oracle),
decode token by token and finish in random order; a request whose slab fits nowhere waits. The
test compares your placement of every slab with the allocator's, and your five-way split of the
space with allocator.accounting(...) after every event, with and without a waiting request.
"""

import random

import pytest

from pagedllm.reference.kv.contiguous_allocator import ContiguousAllocator

EXERCISE = "contiguous_exercise"  # impl (conftest.py): the solution's file, then yours

PROBES = {"place": (1, []), "accounting": (1, [], None)}
PARTS = ("token_states", "reserved", "internal", "external", "free")


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


def simulate(seed: int, policy: str, total_slots: int, max_len: int):
    """Drive the allocator; yields (allocator, event, head of the queue) after every event."""
    rng = random.Random(seed)
    allocator = ContiguousAllocator(total_slots, policy, max_len)
    live, waiting_for = [], None
    for i in range(250):
        roll = rng.random()
        if roll < 0.3 or not live:
            prompt = rng.randint(1, max_len // 3)
            output = rng.randint(1, max_len - prompt)
            length = allocator.reservation(prompt, output)
            if allocator.can_allocate(prompt, output):
                allocator.allocate(i, prompt, output)
                live.append(i)
                waiting_for = None
            else:
                waiting_for = (prompt, output)
            yield allocator, ("alloc", i, length), waiting_for
        elif roll < 0.5:
            request_id = live.pop(rng.randrange(len(live)))
            allocator.free(request_id)
            yield allocator, ("free", request_id), waiting_for
        else:
            for request_id in live:
                if allocator.num_tokens(request_id) < allocator._slab(request_id).will_use:
                    allocator.append_slot(request_id)
            yield allocator, ("decode",), waiting_for


CASES = [("max", 10_000, 2048), ("pow2", 3000, 512), ("oracle", 3000, 512), ("pow2", 200, 64),
         ("oracle", 97, 40)]


def test_place_the_docstring_example(impl):
    place = use(impl, "place")
    got = place(10, [("alloc", "a", 4), ("alloc", "b", 3), ("free", "a"), ("alloc", "c", 5),
                     ("alloc", "d", 2)])
    assert list(got) == [0, 4, None, 0], (
        f"got {got}: after a leaves, the gaps are 4 slots at 0 and 3 at 7; c (5) fits neither, "
        "d (2) takes the first"
        f"\n결과 {got}: a가 떠나면 빈 구간은 0의 4슬롯과 7의 3슬롯입니다. c(5)는 어디에도 "
        "들어가지 않고, d(2)는 첫 구간에 들어갑니다")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy, total_slots, max_len", CASES)
def test_place_matches_the_allocator(impl, seed, policy, total_slots, max_len):
    place = use(impl, "place")
    events, starts = [], []
    for allocator, event, _ in simulate(seed, policy, total_slots, max_len):
        if event[0] == "decode":
            continue
        events.append(event)
        if event[0] == "alloc":
            starts.append(allocator.slab(event[1])[0] if allocator.holds(event[1]) else None)
    got = list(place(total_slots, events))
    assert len(got) == len(starts), (f"{len(got)} results for {len(starts)} alloc events"
                                     f"\nalloc 사건 {len(starts)}개에 결과 {len(got)}개")
    for n, (mine, real) in enumerate(zip(got, starts, strict=True)):
        assert mine == real, (
            f"alloc event {n} ({[e for e in events if e[0] == 'alloc'][n]}): you place it at "
            f"{mine}, first fit places it at {real} (policy {policy}, {total_slots} slots)"
            f"\nalloc 사건 {n} ({[e for e in events if e[0] == 'alloc'][n]}): 여러분은 {mine}에 "
            f"놓았고, 최초 적합은 {real}에 놓습니다(정책 {policy}, 슬롯 {total_slots}개)")
    assert None in starts and len(set(starts)) > 3, ("the workload should place and refuse slabs"
                                                     "\n워크로드가 슬랩을 놓기도 하고 거부하기도 "
                                                     "해야 합니다")


def test_accounting_the_docstring_example(impl):
    accounting = use(impl, "accounting")
    got = tuple(accounting(20, [(10, 6, 6, 6), (0, 8, 3, 5)], 3))
    assert got == (9, 2, 3, 2, 4), (
        f"got {got}: 3 + 6 tokens now, 2 slots still to fill, 3 never used; the gap of 2 at 8 is "
        "too small for the next request (3), the gap of 4 at 16 is not"
        f"\n결과 {got}: 지금 토큰 3 + 6개, 아직 채울 슬롯 2개, 끝내 쓰이지 않을 슬롯 3개. 8의 빈 "
        "구간 2는 다음 요청(3)에 너무 작고, 16의 빈 구간 4는 그렇지 않습니다")
    assert tuple(accounting(20, [(10, 6, 6, 6), (0, 8, 3, 5)], None))[3:] == (0, 6), (
        "with nobody waiting, no free slot is wasted yet: all 6 are free"
        "\n기다리는 요청이 없으면 아직 낭비되는 빈 슬롯은 없습니다: 6개 모두 가용입니다")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy, total_slots, max_len", CASES)
def test_accounting_matches_the_allocator(impl, seed, policy, total_slots, max_len):
    accounting = use(impl, "accounting")
    rng = random.Random(seed)
    external_seen = 0
    for allocator, event, waiting_for in simulate(seed, policy, total_slots, max_len):
        slabs = [(s.start, s.length, s.num_tokens, s.will_use) for s in allocator.slabs]
        rng.shuffle(slabs)  # any order
        for head in [waiting_for, None]:
            real = allocator.accounting(head)
            need = None if head is None else allocator.reservation(*head)
            got = tuple(accounting(total_slots, slabs, need))
            want = tuple(getattr(real, part) for part in PARTS)
            for part, mine, theirs in zip(PARTS, got, want, strict=True):
                assert mine == theirs, (
                    f"{part}: you count {mine}, the allocator {theirs}, after {event}; slabs "
                    f"{sorted(slabs)}, {total_slots} slots, next request needs {need}"
                    f"\n{part}: 여러분 {mine}, 할당기 {theirs}, 사건 {event} 뒤; 슬랩 "
                    f"{sorted(slabs)}, 슬롯 {total_slots}개, 다음 요청에 필요한 슬롯 {need}")
            external_seen += real.external > 0
    assert external_seen > 0, ("the workload should leave some gaps too small for the next request"
                               "\n워크로드가 다음 요청에 너무 작은 빈 구간을 몇 개 남겨야 합니다")
