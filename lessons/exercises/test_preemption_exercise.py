"""Checks lesson 5's exercise: preemption victims and what recompute and swap do to them.

    pytest lessons/exercises/test_preemption_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/preemption_exercise.py (skipped while it still raises NotImplementedError).
conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is Scheduler (reference/engine/scheduler.py) over a PagedKVCacheManager whose pool
is too small for its requests. The test plays the engine's part without a model (tokens
computed, a next token drawn, finished requests removed) and, at every step that only decodes
requests that were running (no prefill, no swap-in), compares your answer with the scheduler's:
who decoded, who was swapped out or sent back to recompute, the tokens a recomputed request
prefills again, and the free blocks of both pools after the step.
"""

import random
from collections import Counter

import pytest
from scheduler_steps import finish_step, make_group  # this folder: what these tests share

from pagedllm.reference.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.reference.engine.sequence import SequenceStatus
from pagedllm.reference.kv.kv_cache_manager import PagedKVCacheManager

EXERCISE = "preemption_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def decode_step(impl):
    return impl.use("decode_step", [], 0, 0, 1, "recompute")


def real_outcome(scheduler: Scheduler, out) -> dict:
    preempted = out.preempted
    return {
        "decoded": [item.group.request_id for item in out.scheduled],
        "swapped": [g.request_id for g in preempted if g.seqs[0].status is SequenceStatus.SWAPPED],
        "recomputed": [g.request_id for g in preempted
                       if g.seqs[0].status is SequenceStatus.WAITING],
        "prefill_again": {g.request_id: g.seqs[0].num_uncomputed_tokens for g in preempted
                          if g.seqs[0].status is SequenceStatus.WAITING},
        "free_blocks": scheduler.kv.num_free_blocks,
        "free_cpu_blocks": scheduler.kv.manager.num_free_cpu_blocks,
    }


def run(decode_step, seed: int, mode: str, block_size: int, num_gpu_blocks: int,
        num_cpu_blocks: int, coverage: Counter) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, preemption_mode=mode)
    scheduler = Scheduler(config, PagedKVCacheManager(block_size, num_gpu_blocks,
                                                      num_cpu_blocks))
    arrivals = 0
    for step in range(150):
        if rng.random() < 0.3 and arrivals < 30:
            prompt = rng.randint(1, 3 * block_size)
            scheduler.add(make_group(f"r{arrivals}", prompt, rng.randint(4, 8 * block_size),
                                     arrivals))
            arrivals += 1
        running = [(g.request_id, scheduler.kv.manager.num_tokens(g.seqs[0].seq_id))
                   for g in sorted(scheduler.running, key=lambda g: g.arrival)]
        free, free_cpu = scheduler.kv.num_free_blocks, scheduler.kv.manager.num_free_cpu_blocks
        ids = {r for r, _ in running}
        out = scheduler.schedule()
        only_decodes = not out.blocks_to_swap_in and all(
            item.num_tokens == 1 and item.group.request_id in ids for item in out.scheduled)
        if running and only_decodes:
            real = real_outcome(scheduler, out)
            got = decode_step(running, free, free_cpu, block_size, mode)
            case = (f"step {step}: running {running}, {free} free GPU blocks and {free_cpu} "
                    f"free CPU blocks of {block_size}, mode {mode!r}")
            assert isinstance(got, dict), (f"decode_step returned {got!r}, not a dict"
                                           f"\ndecode_step의 반환값이 dict가 아닙니다: {got!r}")
            for key, value in real.items():
                assert got.get(key) == value, (
                    f"{key}: you say {got.get(key)!r}, the scheduler did {value!r}; {case}"
                    f"\n{key}: 여러분의 답 {got.get(key)!r}, 스케줄러가 한 일 {value!r}; {case}")
            coverage["steps"] += 1
            coverage["swapped"] += len(real["swapped"])
            coverage["recomputed"] += len(real["recomputed"])
            coverage["several victims"] += len(out.preempted) > 1
        finish_step(scheduler, out)


def test_the_docstring_example(decode_step):
    got = decode_step([("a", 8), ("b", 5)], 0, 0, 4, "recompute")
    assert got.get("decoded") == ["a"] and got.get("recomputed") == ["b"], (
        f"got {got}: a needs a block, b arrived later and gives way"
        f"\n결과 {got}: a에게 블록이 필요하고, 더 늦게 도착한 b가 자리를 내줍니다")
    assert got.get("free_blocks") == 1, (f"got {got}: b's 2 blocks are freed, a takes one"
                                         f"\n결과 {got}: b의 블록 2개가 해제되고, a가 그중 하나를 "
                                         "가져갑니다")
    assert got.get("prefill_again") == {"b": 6}, (
        f"got {got}: b prefills its 5 cached tokens and the token it sampled last"
        f"\n결과 {got}: b는 캐시에 있던 토큰 5개와 마지막에 샘플링한 토큰을 프리필합니다")


def test_the_earliest_arrival_preempts_itself(decode_step):
    got = decode_step([("a", 4)], 0, 10, 4, "swap")
    assert got.get("decoded") == [] and got.get("swapped") == ["a"], (
        f"got {got}: nobody arrived after a, so a gives way itself (to the CPU pool)"
        f"\n결과 {got}: a 뒤에 도착한 요청이 없으므로 a 자신이 자리를 내줍니다(CPU 풀로)")
    assert (got.get("free_blocks"), got.get("free_cpu_blocks")) == (1, 9), (
        f"got {got}: a's one block moves to the CPU pool"
        f"\n결과 {got}: a의 블록 하나가 CPU 풀로 옮겨 갑니다")


def test_swap_falls_back_to_recompute(decode_step):
    got = decode_step([("a", 4), ("b", 9)], 0, 2, 4, "swap")
    assert got.get("recomputed") == ["b"] and got.get("swapped") == [], (
        f"got {got}: b's 3 blocks do not fit the 2 free CPU blocks, so b is recomputed"
        f"\n결과 {got}: b의 블록 3개가 빈 CPU 블록 2개에 들어가지 않으므로 b는 재계산됩니다")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_matches_the_scheduler(decode_step, mode):
    coverage = Counter()
    for seed in range(3):
        for block_size, gpu, cpu in [(4, 16, 0), (4, 20, 6), (4, 24, 64), (2, 30, 12),
                                     (8, 10, 4), (1, 48, 30)]:
            run(decode_step, seed, mode, block_size, gpu, cpu, coverage)
    wanted = ["steps", "recomputed", "several victims"]
    wanted += ["swapped"] if mode == "swap" else []
    for what in wanted:  # the workload tried every rule
        assert coverage[what] >= 3, (f"the test's workload has too few {what}: {coverage}"
                                     f"\n테스트 워크로드에 '{what}' 경우가 너무 적습니다: "
                                     f"{coverage}")
