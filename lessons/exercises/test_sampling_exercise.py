"""Checks lesson 16's exercise: one row's top-k / top-p cut and the exponential race agree with
the reference sampler.

    pytest lessons/exercises/test_sampling_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/sampling_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path.

The reference is reference/ops/sampling.py: ``_top_k_top_p`` (the cuts, computed here in
float64 so that your plain-Python floats can be compared closely), ``random_uniform`` (the
counter-based uniform numbers) and ``sample`` (temperature, cuts and race, batched).
"""

import math
import random

import pytest
import torch

from pagedllm.reference.ops.sampling import (
    SamplingMetadata,
    SamplingRow,
    _top_k_top_p,
    random_uniform,
    sample,
)

EXERCISE = "sampling_exercise"  # impl (conftest.py): the solution's file, then yours

PROBES = {"top_k_top_p": ([0.0, 1.0], -1, 1.0), "race": ([1.0], [0.5])}


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


def reference_cut(logits: list[float], top_k: int, top_p: float) -> list[float]:
    row = torch.tensor([logits], dtype=torch.float64)
    return _top_k_top_p(row, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float64))[
        0].tolist()


def check_cut(top_k_top_p, logits, top_k, top_p):
    got = top_k_top_p(list(logits), top_k, top_p)
    want = reference_cut(logits, top_k, top_p)
    where = f"logits {[round(z, 3) for z in logits]}, top_k {top_k}, top_p {top_p}"
    assert len(got) == len(want), (f"{where}: return one probability per token, in vocab order"
                                   f"\n{where}: 토큰마다 확률 하나를 어휘 순서대로 돌려주세요")
    kept_got = [i for i, p in enumerate(got) if p > 0]
    kept_want = [i for i, p in enumerate(want) if p > 0]
    assert kept_got == kept_want, (
        f"{where}: you kept tokens {kept_got}, the reference keeps {kept_want}. Ties survive or "
        "fall together: top_k keeps every logit >= the k-th largest, and top_p keeps a token "
        "when the mass of the tokens strictly more probable than it is below top_p (computed "
        "on the distribution that top_k left)."
        f"\n{where}: 여러분이 남긴 토큰 {kept_got}, 레퍼런스가 남기는 토큰 {kept_want}. 동점은 "
        "함께 살아남거나 함께 잘립니다: top_k는 k번째로 큰 값 이상인 로짓을 모두 남기고, top_p는 "
        "어떤 토큰보다 확률이 엄격히 큰 토큰들의 질량이 top_p보다 작으면 그 토큰을 "
        "남깁니다(top_k가 남긴 분포에서 계산합니다).")
    assert math.isclose(sum(got), 1.0, rel_tol=1e-9), (f"{where}: renormalise (sum {sum(got)})"
                                                       f"\n{where}: 재정규화하세요(합 {sum(got)})")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (
            f"{where}: token {i} has probability {g}, the reference {w}"
            f"\n{where}: 토큰 {i}의 확률이 여러분은 {g}, 레퍼런스는 {w}")


def test_cut_worked_examples(impl):
    top_k_top_p = use(impl, "top_k_top_p")
    logits = [2.0, 1.0, 1.0, 0.0]
    assert top_k_top_p(logits, -1, 1.0) == pytest.approx(reference_cut(logits, -1, 1.0)), (
        "no cut: the plain softmax"
        "\n잘라내기 없음: 그냥 소프트맥스")
    check_cut(top_k_top_p, logits, 1, 1.0)  # greedy-like: only the largest
    check_cut(top_k_top_p, logits, 2, 1.0)  # the tie at the k-th value: three tokens
    check_cut(top_k_top_p, logits, 4, 1.0)  # k = vocab: no cut
    check_cut(top_k_top_p, logits, 0, 1.0)  # k = 0: no cut
    check_cut(top_k_top_p, logits, -1, 0.7)  # both tied tokens stay (mass above them 0.53)
    check_cut(top_k_top_p, logits, -1, 0.5)  # only the first (0.53 >= 0.5 cuts the pair)
    check_cut(top_k_top_p, logits, 2, 0.8)  # top_p on what top_k left, renormalised
    check_cut(top_k_top_p, [0.5] * 5, -1, 0.1)  # all tied: nothing is more probable, all stay


@pytest.mark.parametrize("seed", range(6))
def test_cut_matches_the_reference(impl, seed):
    """Rows full of ties (logits on a coarse grid) and rows without, every kind of cut."""
    top_k_top_p = use(impl, "top_k_top_p")
    rng = random.Random(seed)
    for _ in range(60):
        vocab = rng.randint(1, 40)
        if rng.random() < 0.6:
            logits = [rng.randint(-6, 6) / 2 for _ in range(vocab)]
        else:
            logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
        top_k = rng.choice([-1, 0, 1, 2, 3, 5, vocab, vocab + 3])
        top_p = rng.choice([1.0, 0.95, 0.9, 0.75, 0.5, 0.3, 0.05])
        check_cut(top_k_top_p, logits, top_k, top_p)


def test_race_worked_examples(impl):
    race = use(impl, "race")
    # E = -log U: token 0 arrives at 0.69 / 0.5 = 1.39, token 1 at 0.11 / 0.5 = 0.21.
    assert race([0.5, 0.5], [0.5, 0.9]) == 1, ("the largest p / E wins (E = -log U)"
                                               "\np / E가 가장 큰 토큰이 이깁니다(E = -log U)")
    assert race([0.9, 0.1], [0.5, 0.5]) == 0, ("same waiting times: the more probable wins"
                                               "\n대기 시간이 같으면 확률이 더 큰 토큰이 이깁니다")
    assert race([0.0, 1.0], [1 - 2**-53, 2**-53]) == 1, (
        "a token of probability 0 never wins"
        "\n확률 0인 토큰은 절대 이기지 않습니다")
    assert race([0.5, 0.5], [0.5, 0.5]) == 0, ("an exact tie goes to the first index"
                                               "\n정확한 동점이면 첫 인덱스가 이깁니다")


@pytest.mark.parametrize("seed", range(3))
def test_race_matches_sample(impl, seed):
    """Your race on the reference's probabilities and uniform numbers picks sample's token."""
    race = use(impl, "race")
    rng = random.Random(seed)
    vocab = 50
    rows = [SamplingRow(temperature=rng.choice([0.5, 1.0, 1.7]), top_k=rng.choice([-1, 10]),
                        top_p=rng.choice([1.0, 0.8]), stream=rng.getrandbits(63),
                        position=rng.randint(0, 500)) for _ in range(64)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 2
    metadata = SamplingMetadata.from_rows(rows, vocab)
    want = sample(logits, metadata).token_ids.tolist()
    scaled = logits / metadata.temperature[:, None]
    probs = _top_k_top_p(scaled, metadata.top_k, metadata.top_p)  # what sample draws from
    u = random_uniform(metadata.streams, metadata.positions, vocab)
    for r, row in enumerate(rows):
        got = race(probs[r].tolist(), u[r].tolist())
        assert got == want[r], (
            f"row {r} ({row}): you picked token {got}, the sampler token {want[r]} "
            f"(p / E: yours {probs[r, got] / -math.log(u[r, got]):.4f}, "
            f"the sampler's {probs[r, want[r]] / -math.log(u[r, want[r]]):.4f})"
            f"\n행 {r} ({row}): 여러분이 고른 토큰 {got}, 샘플러가 고른 토큰 {want[r]} (p / E: "
            f"여러분 {probs[r, got] / -math.log(u[r, got]):.4f}, 샘플러 "
            f"{probs[r, want[r]] / -math.log(u[r, want[r]]):.4f})")


def test_race_follows_the_distribution(impl):
    """Over many independent uniforms, each token wins as often as its probability says."""
    race = use(impl, "race")
    rng = random.Random(0)
    probs = [0.5, 0.25, 0.15, 0.1, 0.0]
    draws = 20_000
    counts = [0] * len(probs)
    for _ in range(draws):
        counts[race(probs, [1.0 - rng.random() for _ in probs])] += 1  # U in (0, 1]
    for i, p in enumerate(probs):
        share = counts[i] / draws
        assert abs(share - p) < 0.015, (
            f"token {i} of probability {p} won {share:.3f} of {draws} races"
            f"\n확률 {p}인 토큰 {i}의 승률: 경주 {draws}번 중 {share:.3f}")


def test_cut_and_race_are_the_sampler(impl):
    """Temperature, your cut and your race together give sample's token on real random rows."""
    top_k_top_p, race = use(impl, "top_k_top_p"), use(impl, "race")
    vocab, gen = 30, torch.Generator().manual_seed(7)
    logits = torch.randint(-4, 5, (40, vocab), generator=gen).float() / 2  # ties everywhere
    rows = [SamplingRow(temperature=0.8, top_k=[-1, 3, 8][i % 3], top_p=[1.0, 0.9, 0.5][i % 3],
                        stream=1000 + i, position=i) for i in range(40)]
    metadata = SamplingMetadata.from_rows(rows, vocab)
    want = sample(logits, metadata).token_ids.tolist()
    u = random_uniform(metadata.streams, metadata.positions, vocab)
    for r, row in enumerate(rows):
        scaled = (logits[r] / torch.tensor(row.temperature)).tolist()  # float32, as sample does
        got = race(top_k_top_p(scaled, row.top_k, row.top_p), u[r].tolist())
        assert got == want[r], (f"row {r} ({row}): you drew token {got}, the sampler {want[r]}"
                                f"\n행 {r} ({row}): 여러분이 뽑은 토큰 {got}, 샘플러가 뽑은 토큰 "
                                f"{want[r]}")
