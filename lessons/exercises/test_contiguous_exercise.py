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
        "d (2) takes the first")


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
    assert len(got) == len(starts), f"{len(got)} results for {len(starts)} alloc events"
    for n, (mine, real) in enumerate(zip(got, starts, strict=True)):
        assert mine == real, (
            f"alloc event {n} ({[e for e in events if e[0] == 'alloc'][n]}): you place it at "
            f"{mine}, first fit places it at {real} (policy {policy}, {total_slots} slots)")
    assert None in starts and len(set(starts)) > 3, "the workload should place and refuse slabs"


def test_accounting_the_docstring_example(impl):
    accounting = use(impl, "accounting")
    got = tuple(accounting(20, [(10, 6, 6, 6), (0, 8, 3, 5)], 3))
    assert got == (9, 2, 3, 2, 4), (
        f"got {got}: 3 + 6 tokens now, 2 slots still to fill, 3 never used; the gap of 2 at 8 is "
        "too small for the next request (3), the gap of 4 at 16 is not")
    assert tuple(accounting(20, [(10, 6, 6, 6), (0, 8, 3, 5)], None))[3:] == (0, 6), (
        "with nobody waiting, no free slot is wasted yet: all 6 are free")


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
                    f"{sorted(slabs)}, {total_slots} slots, next request needs {need}")
            external_seen += real.external > 0
    assert external_seen > 0, "the workload should leave some gaps too small for the next request"
