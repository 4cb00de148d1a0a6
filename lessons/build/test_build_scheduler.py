"""Milestone 3, the scheduler: continuous batching, first come first served, budgets, and
preemption by recompute, driven with no model (each step's next token is a dummy).

    pytest lessons/build/test_build_scheduler.py

Each test runs on the solution and on lessons/build/scheduler.py (skipped until written). The
block manager is milestone 2's: yours once written.
"""

import random

import pytest
from build_track import expect, refuses
from build_types import FINISHED, RUNNING, WAITING, Sequence

PIECE = "scheduler"
TOKEN = 7  # every "sampled" token


def make(arrival: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(arrival, list(range(100 * arrival, 100 * arrival + prompt_len)),
                    max_tokens, arrival)


def finish_step(scheduler, out) -> None:
    """The engine's part of a step, without a model: one dummy token per sampling sequence."""
    scheduler.update(out, [TOKEN] * sum(item.samples for item in out.scheduled))


def plan(out) -> list[tuple[int, int]]:
    """(arrival, tokens computed) of each scheduled sequence."""
    return [(item.seq.arrival, item.num_tokens) for item in out.scheduled]


def run(scheduler, seqs, max_steps: int = 500) -> list:
    """Add the sequences, step until all finish; every step's output, checked as it goes."""
    for seq in seqs:
        scheduler.add(seq)
    bm, outs = scheduler.block_manager, []
    while scheduler.has_unfinished():
        assert len(outs) < max_steps, ("no end in sight: is a sequence never scheduled?"
                                       "\n끝이 보이지 않습니다: 한 번도 스케줄되지 않는 시퀀스가 "
                                       "있나요?")
        out = scheduler.schedule()
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens, (
            f"step {len(outs)}: {out.num_batched_tokens} tokens, over the step's budget"
            f"\n스텝 {len(outs)}: 토큰 {out.num_batched_tokens}개, 스텝 예산 초과")
        assert len(scheduler.running) <= scheduler.max_num_seqs, (
            f"step {len(outs)}: {len(scheduler.running)} running, over max_num_seqs"
            f"\n스텝 {len(outs)}: 실행 중 {len(scheduler.running)}개, max_num_seqs 초과")
        kinds = {item.num_tokens > 1 or not item.seq.output_token_ids for item in out.scheduled}
        expect(len(kinds) <= 1, f"step {len(outs)} mixes prefills and decodes {plan(out)}: "
               "a step that admits prompts decodes nothing")
        for item in out.scheduled:
            seq = item.seq
            expect(seq.status == RUNNING, f"step {len(outs)}: sequence {seq.arrival} runs "
                   f"with status {seq.status!r}, not {RUNNING!r}")
            expect(bm.num_tokens(seq.seq_id) == len(seq), (
                f"step {len(outs)}: sequence {seq.arrival} runs with {len(seq)} tokens but "
                f"holds slots for {bm.num_tokens(seq.seq_id)}: every token computed in a step "
                "needs its slot, and only one (allocate, or append_slot for a decode)"))
            expect(seq.num_computed_tokens + item.num_tokens == len(seq),
                   f"step {len(outs)}: sequence {seq.arrival} must compute all its new tokens")
        if not out.scheduled and not out.preempted:
            pytest.fail(f"step {len(outs)} scheduled nothing with sequences unfinished"
                        f"\n스텝 {len(outs)}: 끝나지 않은 시퀀스가 있는데 아무것도 스케줄하지 "
                        "않았습니다")
        finish_step(scheduler, out)
        outs.append(out)
    for seq in seqs:
        assert seq.status == FINISHED and seq.output_token_ids == [TOKEN] * seq.max_tokens
        refuses(ValueError, f"sequence {seq.arrival} finished: its blocks go back",
                bm.block_table, seq.seq_id)
    assert bm.num_free_blocks == bm.num_blocks, ("every block is free once all finished"
                                                 "\n모두 끝나면 모든 블록이 비어 있어야 합니다")
    return outs


def test_continuous_batching(impl, parts):
    """A finished sequence's place goes to a waiting one at the next step."""
    s = impl.Scheduler(parts.BlockManager(32, 4), max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make(0, 3, 2), make(1, 5, 5), make(2, 4, 2)]
    outs = run(s, seqs)
    got = [plan(out) for out in outs]
    want = [[(0, 3), (1, 5)],  # both prompts in one step; 2 waits for max_num_seqs
            [(0, 1), (1, 1)],  # decode: 0 has its 2 tokens and leaves
            [(2, 4)],  # 2 is admitted at once, not after the whole batch
            [(1, 1), (2, 1)], [(1, 1)], [(1, 1)]]
    assert got == want, (f"steps {got}, expected {want}: rebuild the batch every step; a step "
                         "with prompts to admit only prefills"
                         f"\n스텝 {got}, 기대값 {want}: 배치는 스텝마다 새로 짜세요. 받아들일 "
                         "프롬프트가 있는 스텝은 프리필만 합니다")


def test_first_come_first_served(impl, parts):
    """The head of the queue does not fit yet: the small request behind it waits too."""
    s = impl.Scheduler(parts.BlockManager(6, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [make(0, 12, 4), make(1, 13, 2), make(2, 1, 1)]  # 3 + 4 + 1 blocks > 6
    outs = run(s, seqs)
    first = plan(outs[0])
    assert first == [(0, 12)], (f"the first step ran {first}: sequence 1 needs 4 blocks with "
                                "3 left, and sequence 2 (1 block) must not jump ahead of it"
                                f"\n첫 스텝에서 실행한 것: {first}. 시퀀스 1에는 블록 4개가 "
                                "필요한데 3개가 남았고, 시퀀스 2(블록 1개)는 그보다 앞질러 가면 "
                                "안 됩니다")
    order = list(dict.fromkeys(item.seq.arrival for out in outs for item in out.scheduled))
    assert order == [0, 1, 2], (f"first scheduled in the order {order}"
                                f"\n처음 스케줄된 순서: {order}")


def test_token_budget(impl, parts):
    s = impl.Scheduler(parts.BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=25)
    outs = run(s, [make(i, 10, 3) for i in range(4)])
    assert plan(outs[0]) == [(0, 10), (1, 10)], (
        f"25 tokens a step: two prompts of 10, not {plan(outs[0])}; a prompt is never split"
        f"\n스텝당 토큰 25개: 10토큰 프롬프트 두 개여야 합니다(결과: {plan(outs[0])}). 프롬프트는 "
        "결코 나누지 않습니다")
    assert plan(outs[1]) == [(2, 10), (3, 10)]


def test_seq_budget(impl, parts):
    s = impl.Scheduler(parts.BlockManager(64, 4), max_num_seqs=3, max_num_batched_tokens=256)
    outs = run(s, [make(i, 2, 4) for i in range(7)])
    assert plan(outs[0]) == [(0, 2), (1, 2), (2, 2)]


def test_token_budget_smaller_than_the_running(impl, parts):
    """Four sequences running, a budget of 2 tokens a step: the two earliest decode; the other
    two skip the step, keeping their blocks, and nobody is preempted."""
    bm = parts.BlockManager(16, 4)
    s = impl.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=2)
    seqs = [make(i, 1, 3) for i in range(4)]
    for seq in seqs:
        s.add(seq)
    finish_step(s, s.schedule())  # prompts of 1 token: two fit a step
    finish_step(s, s.schedule())
    running = sorted(q.arrival for q in s.running)
    assert running == [0, 1, 2, 3], (
        f"after two steps of 2 tokens, running {running}: the four 1-token prompts are "
        "prefilled two a step"
        f"\n토큰 2개짜리 스텝 두 번 뒤 실행 중: {running}. 1토큰 프롬프트 네 개는 스텝마다 두 "
        "개씩 프리필됩니다")
    held = {q.arrival: (list(bm.block_table(q.seq_id)), bm.num_tokens(q.seq_id)) for q in seqs}
    out = s.schedule()
    got = ([q.arrival for q in out.preempted], plan(out))
    assert got == ([], [(0, 1), (1, 1)]), (
        f"preempted {got[0]}, ran {got[1]}: a budget of 2 decodes the two earliest arrivals, "
        "0 and 1; 2 and 3 skip the step, and a spent budget preempts nobody"
        f"\n선점 {got[0]}, 실행 {got[1]}: 예산 2로는 가장 먼저 온 0과 1만 디코드합니다. 2와 "
        "3은 이 스텝을 건너뛰며, 예산이 바닥났다고 누구도 선점되지 않습니다")
    for q in seqs[2:]:
        assert q.status == RUNNING and q in s.running, (
            f"sequence {q.arrival} skipped the step: it is still running"
            f"\n시퀀스 {q.arrival}은 스텝을 건너뛰었을 뿐, 여전히 실행 중입니다")
        now = (list(bm.block_table(q.seq_id)), bm.num_tokens(q.seq_id))
        assert now == held[q.arrival], (
            f"sequence {q.arrival} skipped the step: it keeps its blocks and books no slot "
            f"(blocks and slots {held[q.arrival]} before, {now} after)"
            f"\n시퀀스 {q.arrival}은 스텝을 건너뛰었으므로 블록을 그대로 가지고 슬롯을 잡지 "
            f"않습니다(블록과 슬롯: 전 {held[q.arrival]}, 후 {now})")
    finish_step(s, out)
    later = [plan(o) for o in run(s, [])]
    want = [[(0, 1), (1, 1)], [(2, 1), (3, 1)], [(2, 1), (3, 1)]]
    assert later == want, (f"then ran {later}, expected {want}: the earliest arrivals get the "
                           "budget at every step, the others decode once they have finished"
                           f"\n이어서 실행: {later}, 기대값 {want}. 매 스텝 가장 먼저 온 "
                           "시퀀스가 예산을 받고, 나머지는 그들이 끝난 뒤에 디코드합니다")


def preempted_as_recompute(s, bm, out, victim) -> None:
    """A sequence preempted by recompute: no blocks, no K/V, its outputs kept, first in line."""
    first = s.waiting[0] if s.waiting else None
    assert victim.status == WAITING and first is victim and victim not in s.running, (
        f"sequence {victim.arrival} was preempted: it waits first in the queue, not running"
        f"\n시퀀스 {victim.arrival}은 선점되었습니다: 실행 목록이 아니라 큐의 맨 앞에서 기다립니다")
    assert victim.num_computed_tokens == 0 and victim.output_token_ids == [TOKEN], (
        "preempted by recompute: no K/V left, but the tokens it generated stay"
        "\n재계산으로 선점됨: K/V는 남지 않지만, 생성한 토큰은 그대로 남습니다")
    refuses(ValueError, f"preempted by recompute, sequence {victim.arrival} gives all its "
            "blocks back", bm.block_table, victim.seq_id)
    assert all(item.seq is not victim for item in out.scheduled), (
        f"sequence {victim.arrival} is both scheduled and preempted in one step"
        f"\n시퀀스 {victim.arrival}이 한 스텝에서 스케줄되고 선점되기도 했습니다")


def test_preemption_in_a_pool_one_block_too_small(impl, parts):
    """Two sequences that each end up holding 2 blocks, in a pool of 3. Which one gives way is
    your scheduler's choice; one of them must, and only one."""
    bm = parts.BlockManager(3, 4)
    s = impl.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make(0, 4, 5), make(1, 4, 5)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())  # both prefill: one block each, both full
    out = s.schedule()  # both need a new block; one is left
    assert len(out.preempted) == 1, (
        f"preempted {[q.arrival for q in out.preempted]}: one block is free and both need one, "
        "so exactly one sequence gives its blocks up (preempt only until the slot is found)"
        f"\n선점 {[q.arrival for q in out.preempted]}: 빈 블록은 하나, 둘 다 하나씩 필요하므로 "
        "꼭 한 시퀀스만 블록을 내놓습니다(슬롯을 찾을 때까지만 선점합니다)")
    victim = out.preempted[0]
    other = a if victim is b else b
    assert plan(out) == [(other.arrival, 1)], (
        f"scheduled {plan(out)}: sequence {other.arrival} takes the freed block and decodes"
        f"\n스케줄 {plan(out)}: 시퀀스 {other.arrival}이 풀린 블록을 받아 디코드합니다")
    preempted_as_recompute(s, bm, out, victim)
    assert s.num_preemptions == 1
    finish_step(s, out)
    outs = run(s, [])
    readmit = next(item for o in outs for item in o.scheduled if item.seq is victim)
    assert readmit.num_tokens == 5, (f"re-admitted, sequence {victim.arrival} computes its "
                                     "prompt and its output again: 5 tokens, not "
                                     f"{readmit.num_tokens}"
                                     f"\n다시 받아들여진 시퀀스 {victim.arrival}은 프롬프트와 "
                                     "출력을 다시 계산합니다: 토큰 5개여야 합니다(결과: "
                                     f"{readmit.num_tokens})")


def test_one_sequence_gives_way(impl, parts):
    """Sequence 0 needs a block and none is free; 1, 2 and 3 have room in theirs. Your policy
    picks who gives way (possibly 0 itself): one sequence, and every other one decodes."""
    bm = parts.BlockManager(4, 2)
    s = impl.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [make(0, 2, 3), make(1, 1, 3), make(2, 1, 3), make(3, 1, 3)]
    for seq in seqs:
        s.add(seq)  # one block each: the pool is full
    finish_step(s, s.schedule())
    out = s.schedule()
    got = ([q.arrival for q in out.preempted], plan(out))
    assert len(out.preempted) == 1, (
        f"preempted {got[0]}, ran {got[1]}: one block frees the slot sequence 0 needs, so one "
        "sequence gives way"
        f"\n선점 {got[0]}, 실행 {got[1]}: 블록 하나면 시퀀스 0에 필요한 슬롯이 생기므로, 한 "
        "시퀀스만 양보합니다")
    victim = out.preempted[0]
    others = sorted(q.arrival for q in seqs if q is not victim)
    assert sorted(got[1]) == [(arrival, 1) for arrival in others], (
        f"ran {got[1]}: every running sequence but the one preempted decodes one token"
        f"\n실행 {got[1]}: 선점된 시퀀스 말고는 실행 중인 모든 시퀀스가 토큰 하나를 디코드합니다")
    for item in out.scheduled:
        assert bm.num_tokens(item.seq.seq_id) == len(item.seq), (
            f"sequence {item.seq.arrival} runs without the slot of its next token"
            f"\n시퀀스 {item.seq.arrival}이 다음 토큰의 슬롯 없이 실행됩니다")
    preempted_as_recompute(s, bm, out, victim)
    finish_step(s, out)
    run(s, [])


def test_random_workloads_finish(impl, parts):
    """Tight pools, mixed lengths: everything finishes, within every budget, at every step."""
    for seed in range(4):
        rng = random.Random(seed)
        block_size = rng.choice([2, 4])
        seqs = [make(i, rng.randint(1, 12), rng.randint(1, 10)) for i in range(10)]
        longest = max(len(q.prompt_token_ids) + q.max_tokens for q in seqs)
        bm = parts.BlockManager(-(-longest // block_size) + rng.randint(0, 3), block_size)
        s = impl.Scheduler(bm, max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=32)
        run(s, seqs)
