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

한국어:
연습 문제(2강, "연속 할당과 세 가지 낭비"): 슬랩 놓기와 세기.

토큰 슬롯 total_slots개짜리 연속 KV 공간은 요청마다 슬랩(slab) 하나를 줍니다. 슬랩은 수락 시점에
예약되는, 연속된 슬롯의 묶음입니다. 2강의 할당기가 하는 두 가지 일을 평범한 튜플로 작성하세요:
요청이 오가는 동안 슬랩을 최초 적합(first fit)으로 놓는 일, 그리고 어느 한 순간 공간의 모든 슬롯이
어디에 속하는지 말하는 일입니다.

다음 명령으로 확인하세요:

    pytest lessons/exercises/test_contiguous_exercise.py

테스트는 실제 ContiguousAllocator(reference/kv/contiguous_allocator.py)를 세 가지 예약 정책
모두로, 요청들이 무작위 순서로 도착하고 자라고 끝나게 하며 돌리고, 사건마다 여러분의 배치와 집계를
할당기의 것과 비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고
해답만 확인합니다.
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
