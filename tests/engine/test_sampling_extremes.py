"""Every sampling field at its extremes, on both tiers (issue 38, item 6): a value is either
refused at the door (a ValueError naming the field) or sampled with finite arithmetic — valid
tokens, finite logprobs, no NaN anywhere in the sampler (a NaN distribution's argmax is token 0,
whatever the logits say) — and greedy decoding gives the same tokens in both tiers.

The case that was broken: a tiny positive repetition_penalty divides a seen token's positive
logit past float32's largest number; +inf there (or after a small temperature divides it again)
made the softmax NaN and every drawn token 0. The sampler now saturates such a quotient at
float32's largest number, so the seen tokens win, as the penalty asks.
"""

import math

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.reference.ops import sampling as ops
from pagedllm.reference.ops.sampling import FLOAT32_MAX

PROMPT_IDS = [5, 9, 14, 3, 27, 8, 40, 11]
PROMPT = {"prompt_token_ids": PROMPT_IDS}
MAX_TOKENS = 10
TINY_REPETITION = (1e-37, 1e-45, 1e-300, 5e-324)  # 1e-45 is subnormal in float32, 1e-300 is 0

# The accepted extremes: (case id, SamplingParams fields).
ACCEPTED = [
    ("temperature-smallest-that-draws", dict(temperature=1e-5)),
    ("temperature-just-greedy", dict(temperature=9.99e-6)),
    ("temperature-huge", dict(temperature=1e30)),
    ("temperature-float32-max", dict(temperature=FLOAT32_MAX)),
    ("top_p-tiny", dict(top_p=1e-300)),
    ("top_p-smallest-double", dict(top_p=5e-324)),
    ("top_k-1", dict(top_k=1)),
    ("top_k-huge", dict(top_k=2**80)),
    ("min_p-near-1", dict(min_p=1 - 1e-9)),
    ("min_p-1", dict(min_p=1.0)),
    *[(f"repetition_penalty-{r:g}", dict(repetition_penalty=r)) for r in TINY_REPETITION],
    ("repetition_penalty-huge", dict(repetition_penalty=1e30)),
    ("repetition_penalty-float32-max", dict(repetition_penalty=FLOAT32_MAX)),
    ("presence_penalty-2", dict(presence_penalty=2.0)),
    ("presence_penalty--2", dict(presence_penalty=-2.0)),
    ("frequency_penalty-2", dict(frequency_penalty=2.0)),
    ("frequency_penalty--2", dict(frequency_penalty=-2.0)),
    ("logit_bias-+100", dict(logit_bias={7: 100.0})),
    ("logit_bias--100", dict(logit_bias={t: -100.0 for t in PROMPT_IDS})),
    ("logit_bias-every-token--100", "every token -100"),  # built with the vocabulary
    ("tiny-repetition-and-tiny-temperature", dict(repetition_penalty=1e-37, temperature=1e-5)),
    ("tiny-repetition-and-huge-temperature",
     dict(repetition_penalty=1e-45, temperature=FLOAT32_MAX)),
    ("tiny-repetition-and-cuts",
     dict(repetition_penalty=1e-40, top_k=3, top_p=0.5, min_p=0.5, temperature=2e-5)),
    ("tiny-repetition-and-bias-and-negative-penalties",
     dict(repetition_penalty=1e-38, logit_bias={5: 100.0, 9: -100.0},
          presence_penalty=-2.0, frequency_penalty=-2.0)),
    ("huge-repetition-and-negative-penalties",
     dict(repetition_penalty=FLOAT32_MAX, presence_penalty=-2.0, frequency_penalty=-2.0,
          logit_bias={t: -100.0 for t in PROMPT_IDS})),
]


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["llama3"]


@pytest.fixture(scope="module")
def llm(tier, path):
    return tier.LLM(path, block_size=4)


@pytest.fixture
def nan_watch(monkeypatch) -> list[str]:
    """What the sampler computed that was not finite: the penalised logits (a blocked token's
    -inf aside, nothing may be +-inf or NaN) and the drawn rows' distributions. Both tiers on
    a CPU sample through these functions (the optimized tier's launcher falls back to them)."""
    problems: list[str] = []
    apply_penalties, top_k_top_p = ops.apply_penalties, ops._top_k_top_p

    def watched_penalties(logits, penalties):
        out = apply_penalties(logits, penalties)
        bad = torch.isnan(out) | (torch.isinf(out) & torch.isfinite(logits))
        if bool(bad.any()):
            problems.append(f"penalised logits {out[bad][:4].tolist()}")
        return out

    def watched_cut(scaled, top_k, top_p, min_p=None):
        probs = top_k_top_p(scaled, top_k, top_p, min_p)
        if not bool(torch.isfinite(scaled[scaled != float("-inf")]).all()):
            problems.append("temperature-scaled logits of +inf or NaN")
        if not bool(torch.isfinite(probs).all()):
            problems.append("a drawn row's distribution is not finite")
        return probs

    monkeypatch.setattr(ops, "apply_penalties", watched_penalties)
    monkeypatch.setattr(ops, "_top_k_top_p", watched_cut)
    return problems


def fields(case, vocab: int) -> dict:
    if case == "every token -100":
        return dict(logit_bias={t: -100.0 for t in range(vocab)})
    return dict(case)


def generate(tier, llm, **params):
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2, **params}
    out = llm.generate([PROMPT], tier.SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert llm.stats()["blocks_used"] == 0
    return out


def check_sane(out, vocab: int) -> None:
    """Valid tokens, each with a finite logprob, and a finite total."""
    assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length"
    assert all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids), out.token_ids
    assert len(out.logprobs) == MAX_TOKENS
    for token, top in zip(out.token_ids, out.logprobs, strict=True):
        assert token in top and all(math.isfinite(v) for v in top.values()), top
    assert math.isfinite(out.cumulative_logprob)


@pytest.mark.parametrize("case", [c for _, c in ACCEPTED], ids=[i for i, _ in ACCEPTED])
@pytest.mark.parametrize("mode", ["drawn", "greedy"])
def test_extreme_values_sample_finite_logprobs_and_valid_tokens(tier, llm, nan_watch, case,
                                                                mode):
    vocab = llm.engine.vocab_size
    params = fields(case, vocab)
    params = ({"temperature": 1.0, "seed": 7, **params} if mode == "drawn"
              else {**params, "temperature": 0.0})
    out = generate(tier, llm, **params)
    check_sane(out, vocab)
    assert not nan_watch, nan_watch
    if (params.get("repetition_penalty", 1.0) < 1e-30 and not params.get("logit_bias")
            and params["temperature"] <= 1.0):
        # A seen token's positive logit divided by a tiny penalty outweighs any unseen
        # token's (unless a huge temperature flattens everything): every token is one of the
        # prompt or of the output before it (the random model gives some seen token a
        # positive logit at every step of this prompt).
        for i, token in enumerate(out.token_ids):
            assert token in PROMPT_IDS + out.token_ids[:i], (i, out.token_ids)


@pytest.mark.parametrize("r", TINY_REPETITION)
def test_a_tiny_repetition_penalty_does_not_end_in_token_0(tier, llm, r):
    """The defect itself: drawn at temperature 1 and 1e-4, every token was 0 (NaN's argmax)."""
    for temperature in (1.0, 1e-4):
        out = generate(tier, llm, repetition_penalty=r, temperature=temperature, seed=3)
        assert out.token_ids != [0] * MAX_TOKENS
        assert set(out.token_ids) <= set(PROMPT_IDS), out.token_ids


@pytest.fixture(scope="module")
def both(path):
    return reference.LLM(path, block_size=4), optimized.LLM(path, block_size=4)


@pytest.mark.parametrize("case", [c for _, c in ACCEPTED], ids=[i for i, _ in ACCEPTED])
def test_greedy_tokens_are_the_same_in_both_tiers(both, case):
    ref, opt = both
    params = {**fields(case, ref.engine.vocab_size), "temperature": 0.0}
    assert generate(reference, ref, **params).token_ids == \
        generate(optimized, opt, **params).token_ids


REFUSED = [
    ("temperature", -1e-300), ("temperature", float("inf")), ("temperature", float("nan")),
    ("temperature", 1e39),
    ("top_p", 0.0), ("top_p", 1 + 1e-15), ("top_p", float("nan")),
    ("top_k", 0), ("top_k", -2),
    ("min_p", -1e-300), ("min_p", 1 + 1e-9), ("min_p", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -5e-324),
    ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
    ("repetition_penalty", 1e39),
    ("presence_penalty", 2.0000001), ("presence_penalty", -float("inf")),
    ("presence_penalty", float("nan")),
    ("frequency_penalty", -2.0000001), ("frequency_penalty", float("inf")),
    ("frequency_penalty", float("nan")),
    ("logit_bias", {7: 100.000001}), ("logit_bias", {7: -1e30}),
    ("logit_bias", {7: float("inf")}), ("logit_bias", {7: float("-inf")}),
]


@pytest.mark.parametrize("field, value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_values_past_the_extremes_are_refused_by_name(tier, field, value):
    with pytest.raises(ValueError, match=field) as err:
        tier.SamplingParams(**{field: value})
    assert err.value.field == field
