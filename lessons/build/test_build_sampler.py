"""Milestone 6, the sampler: greedy rows, drawn rows that follow the distribution they should,
top-k, and randomness from the generator only.

    pytest lessons/build/test_build_sampler.py

Each test runs on the solution and on lessons/build/sampler.py (skipped until written). The
draws use fixed seeds, so a test that passes keeps passing.
"""

import pytest
import torch

PIECE = "sampler"
N = 20000  # rows per distribution test: a frequency is then within 0.015 of its probability


def draw(impl, logits_row, temperature: float, top_k: int = -1, seed: int = 0):
    logits = torch.tensor(logits_row).repeat(N, 1)  # [N, vocab]
    tokens = impl.sample(logits, torch.full((N,), temperature), torch.full((N,), top_k),
                         torch.Generator().manual_seed(seed))
    return torch.bincount(tokens, minlength=len(logits_row)).double() / N  # [vocab]


def test_greedy(impl):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9],
                           [5.0, 5.0, 1.0, 5.0],  # a tie: the lowest id
                           [-float("inf"), -2.0, -3.0, -float("inf")]])
    for temperature in (0.0, 1e-6):
        tokens = impl.sample(logits, torch.full((3,), temperature), torch.full((3,), -1),
                             torch.Generator().manual_seed(0))
        assert tokens.dtype == torch.int64 and tokens.shape == (3,)
        assert tokens.tolist() == [1, 0, 1], (
            f"temperature {temperature} is greedy: the most likely token, the lowest id "
            f"among equals; got {tokens.tolist()}"
            f"\ntemperature {temperature}: 그리디입니다. 가장 가능성이 높은 토큰, 같으면 가장 "
            f"작은 id; 결과 {tokens.tolist()}")


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_distribution(impl, temperature):
    logits = [2.0, 1.0, 0.0, -1.0, -float("inf")]
    want = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=0)
    got = draw(impl, logits, temperature)
    assert got[4] == 0, ("a token whose logit is -inf must never be drawn"
                         "\n로짓이 -inf인 토큰은 절대 뽑히면 안 됩니다")
    assert torch.allclose(got, want, atol=0.015), (
        f"at temperature {temperature}, {N} draws gave frequencies {got.tolist()}, expected "
        f"{want.tolist()} (softmax of logits / temperature)"
        f"\ntemperature {temperature}에서 {N}번 뽑은 빈도 {got.tolist()}, 기대값 {want.tolist()} "
        "(logits / temperature의 소프트맥스)")


def test_top_k(impl):
    got = draw(impl, [3.0, 1.0, 1.0, 0.0, 2.0], 1.0, top_k=2)
    assert got[1] == got[2] == got[3] == 0, (
        f"top_k 2 keeps tokens 0 and 4 only, drew {got.tolist()}"
        f"\ntop_k 2는 토큰 0과 4만 남기는데, 뽑은 것: {got.tolist()}")
    want = torch.softmax(torch.tensor([3.0, 2.0], dtype=torch.float64), dim=0)
    assert torch.allclose(got[[0, 4]], want, atol=0.015), (
        "then the softmax over those two"
        "\n그다음 그 둘에 대한 소프트맥스")
    tied = draw(impl, [3.0, 1.0, 1.0, 0.0], 1.0, top_k=2)
    assert tied[1] > 0 and tied[2] > 0 and tied[3] == 0, (
        "tokens 1 and 2 tie for second place: top_k 2 keeps both (a cut may not split a "
        f"tie by id), drew {tied.tolist()}"
        "\n토큰 1과 2가 2위 동점입니다: top_k 2는 둘 다 남깁니다(잘라내기가 동점을 id로 가르면 안 "
        f"됩니다). 뽑은 것: {tied.tolist()}")
    for off in (0, -1, 4, 100):
        every = draw(impl, [0.5, 0.0, 0.2, 0.1], 1.0, top_k=off)
        assert (every > 0).all(), (f"top_k {off} keeps every token, drew {every.tolist()}"
                                   f"\ntop_k {off}: 모든 토큰을 남깁니다. 뽑은 것: "
                                   f"{every.tolist()}")


def test_randomness_comes_from_the_generator(impl):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    temps, top_k = torch.ones(64), torch.full((64,), -1)
    torch.manual_seed(1)
    a = impl.sample(logits, temps, top_k, torch.Generator().manual_seed(11))
    torch.manual_seed(2)
    b = impl.sample(logits, temps, top_k, torch.Generator().manual_seed(11))
    assert torch.equal(a, b), ("the same generator seed gave different tokens: draw with the "
                               "generator passed in, not torch's global random state"
                               "\n같은 generator 시드가 다른 토큰을 냈습니다: torch의 전역 난수 "
                               "상태가 아니라 전달받은 generator로 뽑으세요")
    c = impl.sample(logits, temps, top_k, torch.Generator().manual_seed(12))
    assert not torch.equal(a, c), ("another seed, the same 64 tokens: nothing was drawn"
                                   "\n다른 시드인데 같은 토큰 64개: 아무것도 뽑지 않았습니다")


def test_mixed_rows_and_untouched_logits(impl):
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7, 1e-7, 1.3])
    tokens = impl.sample(logits, temps, torch.tensor([-1, 5, -1, -1, 3, 1]),
                         torch.Generator().manual_seed(0))
    assert torch.equal(logits, before), ("the sampler changed the logits it was given"
                                         "\n샘플러가 전달받은 로짓을 바꿨습니다")
    greedy = logits.argmax(dim=-1)
    for row in (0, 2, 4):
        assert tokens[row] == greedy[row], (f"row {row} is greedy, whatever the other rows do"
                                            f"\n행 {row}: 다른 행과 상관없이 그리디입니다")
    assert tokens[5] == greedy[5], ("top_k 1 leaves only the most likely token"
                                    "\ntop_k 1은 가장 가능성이 높은 토큰만 남깁니다")
    assert tokens[1] in logits[1].topk(5).indices, ("row 1 draws among its 5 most likely"
                                                    "\n행 1은 가장 가능성이 높은 5개 가운데서 "
                                                    "뽑습니다")
