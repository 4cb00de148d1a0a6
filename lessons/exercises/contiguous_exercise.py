"""Exercise (lesson 2, "Contiguous allocation and its three wastes"): slabs, placed and counted.

A contiguous KV space of total_slots token slots gives every request one slab, a run of
consecutive slots reserved at admission. Write, on plain tuples, the two things lesson 2's
allocator does: place slabs first-fit as requests come and go, and say where every slot of the
space is at one moment.

Check your work with

    pytest lessons/exercises/test_contiguous_exercise.py

The test drives the real ContiguousAllocator (reference/kv/contiguous_allocator.py) under all
three reservation policies with requests arriving, growing and finishing in random order, and
compares your placements and your accounting with the allocator's after every event. Until you
edit this file the test reports your version as skipped and checks only the solution.
"""


def place(total_slots: int, events: list[tuple]) -> list[int | None]:
    """First-fit placement of slabs; one result per "alloc" event.

    events, in order:
      ("alloc", request_id, length): a request needs a slab of length slots. Place it at the
          start of the lowest-addressed free gap that is large enough; if no gap is, the
          request is not placed (it waits) and its result is None.
      ("free", request_id): a placed request finishes; its slots are free again.

    Example: 10 slots; alloc a 4, alloc b 3, free a, alloc c 5, alloc d 2 -> [0, 4, None, 0]:
    c does not fit (the gaps are 4 and 3 slots), d goes into the first gap.
    """
    # Free gaps are the runs of slots between the slabs (and after the last one), which are
    # easiest to find with the live slabs sorted by start.
    raise NotImplementedError("exercise: implement place")


def accounting(total_slots: int, slabs: list[tuple[int, int, int, int]],
               next_need: int | None) -> tuple[int, int, int, int, int]:
    """(token_states, reserved, internal, external, free): where every slot is, now.

    slabs: (start, length, num_tokens, will_use) of every live slab, in any order: it reserves
    slots start .. start + length - 1, holds the K/V of num_tokens tokens now, and will hold
    will_use tokens when its request finishes (num_tokens <= will_use <= length).
    next_need: the slots the slab of the request at the head of the waiting queue needs, or
    None when nothing waits.

    The five parts are lesson 2's table ("Where every slot goes"); they sum to total_slots.

    Example: 20 slots, slabs (0, 8, 3, 5) and (10, 6, 6, 6), next_need 3: (9, 2, 3, 2, 4).
    """
    # Wrong answer on the example? Recount the two gaps: which of them can the next request use?
    raise NotImplementedError("exercise: implement accounting")
