"""The sampler draws from the distribution the parameters describe, reproducibly."""

import math

import pytest
import torch

from pagedllm.reference.sampler import check_stop, sample
from pagedllm.reference.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))  # probabilities 0.5 / 0.25 / 0.15 / 0.1


def frequencies(params: SamplingParams, draws: int = 4000) -> list[float]:
    g = torch.Generator().manual_seed(0)
    counts = [0] * 4
    for _ in range(draws):
        counts[sample(LOGITS, params, g, 5, None)[0]] += 1
    return [c / draws for c in counts]


def test_greedy_picks_the_argmax_and_reports_its_logprob():
    token, logprob, top = sample(LOGITS, SamplingParams(temperature=0, logprobs=2),
                                 torch.Generator(), 0, None)
    assert token == 0 and logprob == pytest.approx(math.log(0.5))
    assert list(top) == [0, 1] and top[1] == pytest.approx(math.log(0.25))


def test_temperature_one_follows_the_distribution():
    freq = frequencies(SamplingParams(temperature=1.0))
    for got, want in zip(freq, [0.5, 0.25, 0.15, 0.1], strict=True):
        assert abs(got - want) < 0.03  # 4000 draws: standard error below 0.008


def test_top_k_and_top_p_cut_the_tail():
    assert frequencies(SamplingParams(top_k=2))[2:] == [0.0, 0.0]
    freq = frequencies(SamplingParams(top_p=0.7))  # 0.5 + 0.25 reaches 0.7: two tokens stay
    assert freq[2:] == [0.0, 0.0] and abs(freq[0] - 2 / 3) < 0.03
    assert frequencies(SamplingParams(top_p=0.5))[1:] == [0.0, 0.0, 0.0]


def test_seeded_draws_repeat():
    params = SamplingParams(temperature=0.8)
    a = [sample(LOGITS, params, g, 0, None)[0]
         for g in [torch.Generator().manual_seed(9)] for _ in range(50)]
    b = [sample(LOGITS, params, g, 0, None)[0]
         for g in [torch.Generator().manual_seed(9)] for _ in range(50)]
    assert a == b and len(set(a)) > 1


def test_min_tokens_blocks_eos_and_stop_tokens():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])
    assert sample(LOGITS, params, torch.Generator(), 0, eos_token_id=0)[0] == 2
    assert sample(LOGITS, params, torch.Generator(), 3, eos_token_id=0)[0] == 0


def test_stop_checks():
    p = SamplingParams(max_tokens=5, stop=["END"], stop_token_ids=[7])
    assert check_stop([1, 2], 2, "ab", p, 9, 100, 0) == (None, None, "ab")
    assert check_stop([1, 9], 2, "ab", p, 9, 100, 0) == ("stop", None, "ab")  # EOS
    assert check_stop([1, 7], 2, "ab", p, 9, 100, 0) == ("stop", 7, "ab")
    assert check_stop([1, 3], 2, "abEND cd", p, 9, 100, 0) == ("stop", "END", "ab")
    assert check_stop([1, 3], 5, "abc", p, 9, 100, 0) == ("length", None, "abc")
    assert check_stop([1, 3], 2, "abc", p, 9, 10, 8) == ("length", None, "abc")  # max_model_len
    ignoring = SamplingParams(ignore_eos=True)
    assert check_stop([9], 1, "", ignoring, 9, 100, 0)[0] is None
