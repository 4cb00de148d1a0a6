"""Checks lesson 3's exercise: block counts and slot mappings agree with the real block manager.

    pytest lessons/exercises/test_paging_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/paging_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is BlockSpaceManager (reference/kv/block_manager.py): the tests allocate sequences,
grow them one token at a time, free some so that their blocks are recycled out of order, and
after every step compare your slot mapping and block count with the manager's own.
"""

import random

import pytest

from pagedllm.reference.kv.block_manager import BlockSpaceManager

EXERCISE = "paging_exercise"  # impl (conftest.py): the solution's file, then yours


PROBES = {"slot_mapping": ([0], 1, [0]), "blocks_needed": (1, 1)}


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


def test_blocks_needed_seed_example(impl):
    blocks_needed = use(impl, "blocks_needed")
    assert blocks_needed(3200, 512) == 7, ("3200 tokens in blocks of 512: six full and one more"
                                           "\n512칸 블록에 3200토큰: 가득 찬 블록 6개와 하나 더")
    assert blocks_needed(3200, 16) == 200, ("3200 is a multiple of 16: no partial block"
                                            "\n3200은 16의 배수입니다: 일부만 찬 블록이 없습니다")
    assert blocks_needed(0, 16) == 0
    assert blocks_needed(1, 16) == 1
    assert blocks_needed(16, 16) == 1
    assert blocks_needed(17, 16) == 2


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 512])
def test_blocks_needed_matches_the_manager(impl, block_size):
    blocks_needed = use(impl, "blocks_needed")
    manager = BlockSpaceManager(block_size, num_gpu_blocks=0)
    for num_tokens in range(0, 3 * block_size + 2):
        assert blocks_needed(num_tokens, block_size) == manager.blocks_needed(num_tokens), (
            f"{num_tokens} tokens in blocks of {block_size}"
            f"\n{block_size}칸 블록에 {num_tokens}토큰")
    big = 10**18 + 1  # integer arithmetic stays exact where float division would not
    assert blocks_needed(big, block_size) == manager.blocks_needed(big)


def test_slot_mapping_worked_example(impl):
    slot_mapping = use(impl, "slot_mapping")
    # Lesson 3's figure: sequence A's block table after ten round-robin decode steps.
    assert slot_mapping([0, 1, 7, 10], 4, [9]) == [29]
    assert slot_mapping([0, 1, 7, 10], 4, [0, 3, 4, 8, 14]) == [0, 3, 4, 28, 42]
    assert slot_mapping([5], 16, []) == []


def check_against_manager(manager, slot_mapping, blocks_needed, rng):
    """Every live sequence: all its positions, then a shuffled subset, and its block count."""
    bs = manager.block_size
    for seq_id in manager.tables:
        table = manager.block_table(seq_id)
        n = manager.num_tokens(seq_id)
        every = list(range(n))
        assert slot_mapping(table, bs, every) == manager.slot_mapping(seq_id, every), (
            f"sequence {seq_id}, block table {table}, block_size {bs}"
            f"\n시퀀스 {seq_id}, 블록 테이블 {table}, block_size {bs}")
        some = rng.sample(every, k=min(n, 5))  # any order: a mapping, not a range
        assert slot_mapping(table, bs, some) == manager.slot_mapping(seq_id, some)
        if blocks_needed is not None:
            assert blocks_needed(n, bs) == len(table), (
                f"{n} tokens: the manager holds {len(table)} blocks of {bs}"
                f"\n토큰 {n}개: 관리자는 {bs}칸 블록 {len(table)}개를 가집니다")


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_mapping_matches_the_manager(impl, block_size):
    """Interleaved growth, frees and new arrivals: block tables end up scattered."""
    slot_mapping = use(impl, "slot_mapping")
    rng = random.Random(block_size)
    manager = BlockSpaceManager(block_size, num_gpu_blocks=64)
    live, next_id = [], 0
    for _ in range(300):
        action = rng.random()
        if action < 0.15 or not live:  # a new request arrives with a prompt
            prompt = rng.randint(1, 3 * block_size)
            if manager.can_allocate(prompt):
                manager.allocate(next_id, prompt)
                live.append(next_id)
                next_id += 1
        elif action < 0.25:  # a request finishes: its blocks go back to the free list
            manager.free(live.pop(rng.randrange(len(live))))
        else:  # a decode step for every running request, round-robin
            for seq_id in live:
                if manager.can_append(seq_id):
                    manager.append_slot(seq_id)
        check_against_manager(manager, slot_mapping, None, rng)
    assert next_id > 5 and any(  # the workload really scattered some block table
        manager.block_table(s) != sorted(manager.block_table(s)) for s in manager.tables)


def test_blocks_grow_on_demand(impl):
    """A sequence takes a new block exactly when its last one is full: blocks_needed(n)."""
    slot_mapping, blocks_needed = use(impl, "slot_mapping"), use(impl, "blocks_needed")
    rng = random.Random(0)
    manager = BlockSpaceManager(4, num_gpu_blocks=16)
    for seq_id, prompt in enumerate([5, 2, 9]):
        manager.allocate(seq_id, prompt)
    check_against_manager(manager, slot_mapping, blocks_needed, rng)
    for _ in range(10):
        for seq_id in range(3):
            manager.append_slot(seq_id)
            check_against_manager(manager, slot_mapping, blocks_needed, rng)
    assert manager.block_table(0) == [0, 1, 7, 10]  # the figure of lesson 3
