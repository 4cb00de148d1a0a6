"""Checks lesson 6's exercise: the split of a step's token budget under chunked prefill.

    pytest lessons/exercises/test_chunked_prefill_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/chunked_prefill_exercise.py (skipped while it still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is Scheduler (reference/engine/scheduler.py) with enable_chunked_prefill=True over
a PagedKVCacheManager large enough that memory never binds. The test plays the engine's part
without a model (tokens computed, a next token drawn when a sequence reaches its last token,
finished requests removed) and compares your split with the scheduler's before every step.
"""

import random
from collections import Counter

import pytest
from scheduler_steps import finish_step, make_group  # this folder: what these tests share

from pagedllm.reference.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.reference.kv.kv_cache_manager import PagedKVCacheManager

EXERCISE = "chunked_prefill_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def chunked_step(impl):
    return impl.use("chunked_step", [], [], 1, 1)


def run(chunked_step, seed: int, budget: int, max_num_seqs: int, coverage: Counter) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True)
    scheduler = Scheduler(config, PagedKVCacheManager(16, num_gpu_blocks=2000))
    arrivals = 0
    for step in range(100):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            prompt = rng.choice([rng.randint(1, 8), rng.randint(1, 3 * budget)])
            scheduler.add(make_group(f"r{arrivals}", prompt, rng.randint(1, 20), arrivals))
            arrivals += 1
        running = [(g.request_id, g.seqs[0].num_uncomputed_tokens)
                   for g in sorted(scheduler.running, key=lambda g: g.arrival)]
        waiting = [(g.request_id, g.seqs[0].num_uncomputed_tokens) for g in scheduler.waiting]
        out = scheduler.schedule()
        assert not out.preempted, ("the test's pool is too small: nothing should be preempted"
                                   "\n테스트의 풀이 너무 작습니다: 아무것도 선점되면 안 됩니다")
        real = {item.group.request_id: item.num_tokens for item in out.scheduled}
        got = chunked_step(running, waiting, budget, max_num_seqs)
        case = (f"step {step}: running {running}, waiting {waiting}, max_num_batched_tokens "
                f"{budget}, max_num_seqs {max_num_seqs}")
        assert got == real, (f"you scheduled {got}, the scheduler scheduled {real}; {case}"
                             f"\n여러분의 스케줄 {got}, 스케줄러의 스케줄 {real}; {case}")
        coverage["chunks cut short"] += sum(
            real.get(r, 0) < n for r, n in running + waiting if r in real)
        coverage["decodes beside a chunk"] += any(n == 1 for r, n in running if r in real) and (
            any(real[r] > 1 for r in real))
        coverage["budget spent before a running request"] += any(r not in real
                                                                for r, _ in running)
        coverage["sequence limit stops admission"] += bool(waiting) and (
            len(running) == max_num_seqs)
        finish_step(scheduler, out)


def test_the_docstring_example(chunked_step):
    got = chunked_step([("a", 1), ("b", 1)], [("c", 100)], 32, 8)
    assert got == {"a": 1, "b": 1, "c": 30}, (
        f"got {got}: the decodes take 2 tokens, the new prompt starts with a 30-token chunk"
        f"\n결과 {got}: 디코드가 토큰 2개를 쓰고, 새 프롬프트는 30토큰짜리 청크로 시작합니다")


def test_a_running_chunk_goes_before_new_prompts(chunked_step):
    got = chunked_step([("a", 1), ("b", 50)], [("c", 4)], 32, 8)
    assert got == {"a": 1, "b": 31}, (
        f"got {got}: b's prompt continues with what is left (31), nothing is left for c"
        f"\n결과 {got}: b의 프롬프트는 남은 예산(31)만큼 이어 가고, c에게는 남는 것이 없습니다")


def test_the_sequence_limit(chunked_step):
    got = chunked_step([("a", 1), ("b", 1)], [("c", 4), ("d", 4)], 32, 3)
    assert got == {"a": 1, "b": 1, "c": 4}, (f"got {got}: max_num_seqs 3 leaves room for c only"
                                             f"\n결과 {got}: max_num_seqs 3이면 c의 자리만 "
                                             "남습니다")


@pytest.mark.parametrize("budget, max_num_seqs", [(32, 8), (8, 4), (16, 16), (5, 8), (64, 3)])
def test_matches_the_scheduler(chunked_step, budget, max_num_seqs):
    coverage = Counter()
    for seed in range(3):
        run(chunked_step, seed, budget, max_num_seqs, coverage)
    for what in ["chunks cut short", "decodes beside a chunk"]:  # the workload tried the rules
        assert coverage[what] >= 3, (f"the test's workload has too few {what}: {coverage}"
                                     f"\n테스트 워크로드에 '{what}' 경우가 너무 적습니다: "
                                     f"{coverage}")
