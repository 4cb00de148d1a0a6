"""Checks lesson 4's exercise: one continuous-batching step against the real scheduler.

    pytest lessons/exercises/test_batching_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/batching_exercise.py (skipped while it still raises NotImplementedError).
conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is Scheduler (reference/engine/scheduler.py) over a PagedKVCacheManager. The test
plays the engine's part without a model: requests arrive over time, every scheduled sequence
computes its tokens, a sequence that reaches its last token gets a next one, and a request that
has all its tokens is removed (its blocks go back to the pool). Before every step it hands your
function the queues and the free blocks, then compares your answer with what the scheduler
scheduled and with the free blocks the pool has after the step.
"""

import random
from collections import Counter

import pytest
from scheduler_steps import finish_step, make_group  # this folder: what these tests share

from pagedllm.reference.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.reference.kv.kv_cache_manager import PagedKVCacheManager

EXERCISE = "batching_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def continuous_step(impl):
    return impl.use("continuous_step", [], [], 1, 1, 1, 1)


def snapshot(scheduler: Scheduler):
    """What your function is given: the queues in arrival order and the free blocks."""
    kv = scheduler.kv
    running = [(g.request_id, kv.manager.num_tokens(g.seqs[0].seq_id))
               for g in sorted(scheduler.running, key=lambda g: g.arrival)]
    waiting = [(g.request_id, g.seqs[0].num_uncomputed_tokens) for g in scheduler.waiting]
    return running, waiting, kv.num_free_blocks


def run(continuous_step, seed: int, block_size: int, num_gpu_blocks: int, max_num_seqs: int,
        max_num_batched_tokens: int, coverage: Counter) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
    scheduler = Scheduler(config, PagedKVCacheManager(block_size, num_gpu_blocks))
    arrivals = 0
    for step in range(120):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):  # requests arrive between steps
            prompt = rng.randint(1, min(max_num_batched_tokens, 4 * block_size))
            scheduler.add(make_group(f"r{arrivals}", prompt, rng.randint(1, 12), arrivals))
            arrivals += 1
        running, waiting, free = snapshot(scheduler)
        out = scheduler.schedule()
        if not out.preempted:  # a step with preemption is lesson 5's exercise
            real = {item.group.request_id: item.num_tokens for item in out.scheduled}
            got, free_after = continuous_step(running, waiting, free, block_size,
                                              max_num_seqs, max_num_batched_tokens)
            case = (f"step {step}: running {running}, waiting {waiting}, {free} free blocks of "
                    f"{block_size}, max_num_seqs {max_num_seqs}, max_num_batched_tokens "
                    f"{max_num_batched_tokens}")
            assert got == real, (f"scheduled {got}, the scheduler scheduled {real}; {case}"
                                 f"\n여러분의 스케줄 {got}, 스케줄러의 스케줄 {real}; {case}")
            assert free_after == scheduler.kv.num_free_blocks, (
                f"{free_after} free blocks after the step, the pool has "
                f"{scheduler.kv.num_free_blocks}; {case}"
                f"\n스텝 뒤 빈 블록: 여러분 {free_after}개, 풀 {scheduler.kv.num_free_blocks}개; "
                f"{case}")
            coverage["steps"] += 1
            coverage["prefill steps" if waiting and set(real) <= {w for w, _ in waiting}
                     and real else "decode steps"] += 1
            if waiting and len(real) < len(waiting) and any(w in real for w, _ in waiting):
                coverage["admission stopped part-way"] += 1
            if waiting and not real.keys() & {w for w, _ in waiting}:
                coverage["nobody admitted though someone waits"] += 1
        finish_step(scheduler, out)


def test_the_docstring_example(continuous_step):
    got = continuous_step([("a", 4), ("b", 5)], [], 3, 4, 8, 64)
    assert got == ({"a": 1, "b": 1}, 2), (
        f"got {got}: both decode; a's 4 tokens fill its block, so its 5th takes a new one"
        f"\n결과 {got}: 둘 다 디코드합니다. a의 토큰 4개가 블록을 채우므로 5번째 토큰은 새 블록을 "
        "받습니다")


def test_admission_only_prefills(continuous_step):
    got = continuous_step([("a", 4), ("b", 5)], [("c", 6), ("d", 3)], 10, 4, 8, 64)
    assert got == ({"c": 6, "d": 3}, 7), (
        f"got {got}: c and d are admitted (2 + 1 blocks), and a step that admits only prefills"
        f"\n결과 {got}: c와 d를 받아들이고(블록 2 + 1개), 요청을 받아들인 스텝은 프리필만 합니다")


def test_head_of_line_blocking(continuous_step):
    got = continuous_step([("a", 2)], [("c", 40), ("d", 3)], 20, 4, 8, 32)
    assert got == ({"a": 1}, 20), (
        f"got {got}: c's 40 tokens exceed the budget of 32, so d may not jump ahead, and a "
        "decodes (its block has room)"
        f"\n결과 {got}: c의 토큰 40개가 예산 32를 넘으므로 d는 앞질러 갈 수 없고, a는 "
        "디코드합니다(블록에 자리가 있습니다)")


CONFIGS = [  # block_size, num_gpu_blocks, max_num_seqs, max_num_batched_tokens
    (4, 40, 4, 32),  # the sequence limit binds
    (4, 24, 8, 32),  # memory binds (and preempts now and then)
    (2, 60, 6, 9),  # the token budget binds: prompts wait for a step of their own
    (16, 12, 5, 64),
    (1, 90, 3, 6),
]


@pytest.mark.parametrize("seed", range(3))
def test_matches_the_scheduler(continuous_step, seed):
    coverage = Counter()
    for config in CONFIGS:
        run(continuous_step, seed, *config, coverage)
    for what in ["prefill steps", "decode steps", "admission stopped part-way",
                 "nobody admitted though someone waits"]:  # the workload tried every rule
        assert coverage[what] >= 5, (f"the test's workload has too few {what}: {coverage}"
                                     f"\n테스트 워크로드에 '{what}' 경우가 너무 적습니다: "
                                     f"{coverage}")
