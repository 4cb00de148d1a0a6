"""Checks lesson 7's exercise: blocks held by n samples of one prompt, with and without sharing.

    pytest lessons/exercises/test_cow_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/cow_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is BlockSpaceManager (reference/kv/block_manager.py). With sharing: allocate the
prompt, fork n - 1 children from it (counts up, nothing copied), then append every sample's
tokens one at a time, round-robin as the engine's steps do (append_slot copies a shared, partly
filled last block before the first write into it). Without sharing: every sample allocates the
prompt for itself. Either way, count the distinct physical blocks in use at the end.
"""

import random

import pytest

from pagedllm.reference.kv.block_manager import BlockSpaceManager

EXERCISE = "cow_exercise"  # impl (conftest.py): the solution's file, then yours


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, 1, [1], 1)


def run_manager(prompt_len: int, output_lens: list[int], block_size: int, shared: bool,
                round_robin: bool = True) -> int:
    """Distinct physical blocks in use once every sample has appended all its tokens."""
    n = len(output_lens)
    pool = sum(-(-(prompt_len + out) // block_size) for out in output_lens)
    manager = BlockSpaceManager(block_size, num_gpu_blocks=pool)
    if shared:
        manager.allocate(0, prompt_len)  # the prompt, prefilled once
        for child in range(1, n):
            manager.fork(0, child)  # the samples share every prompt block
    else:
        for i in range(n):
            manager.allocate(i, prompt_len)  # every sample stores the prompt by itself
    left = list(output_lens)
    order = ([i for step in range(max(left)) for i in range(n) if step < left[i]] if round_robin
             else [i for i in range(n) for _ in range(left[i])])
    copies = 0
    for i in order:
        _, copy = manager.append_slot(i)
        copies += copy is not None
    in_use = {b for table in manager.tables.values() for b in table.blocks}
    assert len(in_use) == pool - manager.num_free_gpu_blocks  # counts agree with the tables
    for i, out in enumerate(output_lens):
        assert manager.num_tokens(i) == prompt_len + out
    partial = prompt_len % block_size != 0
    assert copies == ((n - 1) if shared and partial else 0)  # only the partial block is copied
    return len(in_use)


def test_the_figure_of_lesson_7(impl):
    with_sharing = use(impl, "blocks_with_sharing")
    without = use(impl, "blocks_without_sharing")
    # A 10-token prompt in blocks of 4: blocks 0 and 1 full and shared, block 2 holds 2 tokens.
    assert without(10, [8, 8, 8], 4) == 15, ("each sample: 18 tokens in 5 blocks"
                                             "\n샘플마다: 블록 5개에 토큰 18개")
    assert with_sharing(10, [8, 8, 8], 4) == 11, ("2 shared blocks + 3 samples x 3 blocks"
                                                  "\n공유 블록 2개 + 샘플 3개 x 블록 3개")


CASES = [
    (10, [8, 8, 8], 4),  # the figure
    (12, [5, 5], 4),  # the prompt fills its last block exactly: nothing is copied
    (3, [2, 9, 4], 16),  # a prompt shorter than one block: nothing is shared in the end
    (23, [14, 1, 9, 30], 4),  # samples of different lengths
    (19, [58] * 4, 16),  # the Alpaca means, n = 4
    (161, [338] * 4, 16),  # the ShareGPT means, n = 4
    (7, [4] * 6, 1),  # blocks of one token: every prompt block is full
    (5, [3], 4),  # n = 1: sharing changes nothing
    (3200, [100, 412], 512),  # the seed article's block size
]


@pytest.mark.parametrize("prompt_len, output_lens, block_size", CASES)
def test_matches_the_block_manager(impl, prompt_len, output_lens, block_size):
    with_sharing = use(impl, "blocks_with_sharing")
    without = use(impl, "blocks_without_sharing")
    case = f"prompt {prompt_len}, outputs {output_lens}, block_size {block_size}"
    assert without(prompt_len, output_lens, block_size) == run_manager(
        prompt_len, output_lens, block_size, shared=False), (
        f"without sharing: {case}"
        f"\n공유 없이: {case}")
    assert with_sharing(prompt_len, output_lens, block_size) == run_manager(
        prompt_len, output_lens, block_size, shared=True), (
        f"with sharing: {case}"
        f"\n공유할 때: {case}")


def test_random_requests(impl):
    """Many random requests; the order in which samples write does not change the count."""
    with_sharing = use(impl, "blocks_with_sharing")
    without = use(impl, "blocks_without_sharing")
    rng = random.Random(7)
    for _ in range(60):
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        prompt_len = rng.randint(1, 5 * block_size)
        output_lens = [rng.randint(1, 4 * block_size) for _ in range(rng.randint(1, 6))]
        case = f"prompt {prompt_len}, outputs {output_lens}, block_size {block_size}"
        expected = run_manager(prompt_len, output_lens, block_size, shared=True)
        assert expected == run_manager(prompt_len, output_lens, block_size, shared=True,
                                       round_robin=False)
        assert with_sharing(prompt_len, output_lens, block_size) == expected, case
        assert without(prompt_len, output_lens, block_size) == run_manager(
            prompt_len, output_lens, block_size, shared=False), case
