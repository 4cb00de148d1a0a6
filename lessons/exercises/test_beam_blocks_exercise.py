"""Checks lesson 8's exercise: the blocks a beam step frees, copies and takes.

    pytest lessons/exercises/test_beam_blocks_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/beam_blocks_exercise.py (skipped while it still raises NotImplementedError).
conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is BlockSpaceManager (reference/kv/block_manager.py), driven in the order of the
engine's _beam_step and the next step's appends: allocate the prompt for the root beam; then,
every step, fork each new beam from its parent, free every old beam, and append_slot for each
new beam in order. Survivors are drawn at random, with a bias to a few parents, as real beams
collapse onto a common ancestor.
"""

import random

import pytest

from pagedllm.reference.kv.block_manager import BlockSpaceManager

EXERCISE = "beam_blocks_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def beam_step_blocks(impl):
    return impl.use("beam_step_blocks", [[0]], 1, 1, [0])


def real_step(manager: BlockSpaceManager, beams: list[int], parents: list[int], next_id: int):
    """One beam step on the manager; returns (new beams, freed, copied, new_blocks)."""
    old = {b for beam in beams for b in manager.block_table(beam)}
    children = list(range(next_id, next_id + len(parents)))
    for child, parent in zip(children, parents, strict=True):
        manager.fork(beams[parent], child)  # fork first ...
    for beam in beams:
        manager.free(beam)  # ... then free the old generation
    freed = sorted(b for b in old if manager.gpu.ref_counts[b] == 0)
    free_before = manager.num_free_gpu_blocks
    copied = []
    for child in children:  # the next step's appends, in order
        _, copy = manager.append_slot(child)
        if copy is not None:
            copied.append(copy[0])
    return children, freed, sorted(copied), free_before - manager.num_free_gpu_blocks


def run(beam_step_blocks, seed: int, block_size: int, prompt_len: int, width: int,
        steps: int) -> dict:
    rng = random.Random(seed)
    manager = BlockSpaceManager(block_size, num_gpu_blocks=4000)
    manager.allocate(0, prompt_len)
    beams, next_id, seen = [0], 1, {"freed": 0, "copied": 0}
    for step in range(steps):
        favourites = rng.sample(range(len(beams)), k=min(len(beams), rng.randint(1, 2)))
        parents = sorted(rng.choice(favourites) if rng.random() < 0.7
                         else rng.randrange(len(beams)) for _ in range(width))
        rng.shuffle(parents)  # survivors come best first, in any parent order
        tables = [manager.block_table(b) for b in beams]
        num_tokens = manager.num_tokens(beams[0])
        got = beam_step_blocks([list(t) for t in tables], num_tokens, block_size, list(parents))
        beams, freed, copied, new_blocks = real_step(manager, beams, parents, next_id)
        next_id += len(parents)
        case = (f"step {step}: tables {tables}, {num_tokens} tokens each in blocks of "
                f"{block_size}, parents {parents}")
        assert isinstance(got, tuple) and len(got) == 3, (
            f"return (freed, copied, new_blocks), got {got!r}"
            f"\n(freed, copied, new_blocks)를 돌려주세요. 받은 값: {got!r}")
        assert list(got[0]) == freed, (
            f"freed: you say {list(got[0])}, the pool freed {freed}; {case}"
            f"\nfreed: 여러분의 답 {list(got[0])}, 풀이 해제한 블록 {freed}; {case}")
        assert list(got[1]) == copied, (
            f"copied: you say {list(got[1])}, append_slot copied {copied}; {case}"
            f"\ncopied: 여러분의 답 {list(got[1])}, append_slot이 복사한 블록 {copied}; {case}")
        assert got[2] == new_blocks, (
            f"new_blocks: you say {got[2]}, the appends took {new_blocks} blocks; {case}"
            f"\nnew_blocks: 여러분의 답 {got[2]}, append가 가져간 블록 {new_blocks}개; {case}")
        seen["freed"] += len(freed)
        seen["copied"] += len(copied)
    return seen


def test_the_docstring_example(beam_step_blocks):
    got = beam_step_blocks([[0, 1, 2]], 10, 4, [0, 0, 0])
    assert tuple(got) == ([], [2, 2], 2), (
        f"got {got}: three new beams share block 2 (2 of 4 slots used); the first two to write "
        "copy it, the third writes into the original"
        f"\n결과 {got}: 새 빔 셋이 블록 2(슬롯 4개 중 2개 사용)를 공유합니다. 먼저 쓰는 둘은 그 "
        "블록을 복사하고, 세 번째는 원본에 씁니다")


def test_a_full_last_block_is_never_copied(beam_step_blocks):
    got = beam_step_blocks([[0, 1, 3], [0, 1, 4]], 12, 4, [1, 1])
    assert tuple(got) == ([3], [], 2), (
        f"got {got}: beam 0 has no child, so its own block 3 is freed; both children of beam 1 "
        "find its last block full and take a fresh block each"
        f"\n결과 {got}: 빔 0은 자식이 없으므로 그 빔만의 블록 3이 해제됩니다. 빔 1의 두 자식은 "
        "마지막 블록이 가득 찬 것을 보고 각자 새 블록을 하나씩 받습니다")


@pytest.mark.parametrize("block_size, prompt_len, width", [
    (4, 10, 4), (4, 12, 4), (16, 19, 4), (2, 5, 6), (1, 3, 3), (8, 1, 2), (4, 7, 1)])
def test_matches_the_block_manager(beam_step_blocks, block_size, prompt_len, width):
    seen = {"freed": 0, "copied": 0}
    for seed in range(3):
        for what, n in run(beam_step_blocks, seed, block_size, prompt_len, width, 40).items():
            seen[what] += n
    if width > 1:  # the random searches did free and copy blocks
        assert seen["freed"] > 0 and (block_size == 1 or seen["copied"] > 0), seen
