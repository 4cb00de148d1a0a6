"""repetition_penalty, presence_penalty, frequency_penalty, min_p and logit_bias: each changes the
tokens as it should, both tiers give the same tokens with them, seeded and parallel sampling keep
their guarantees, and out-of-range values are refused by name."""

import pytest

from pagedllm import optimized, reference

PROMPT = {"prompt_token_ids": [5, 9, 14, 3, 27, 8, 40, 11]}


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["llama3"]


@pytest.fixture(scope="module")
def llm(tier, path):
    return tier.LLM(path, block_size=4)


def run(tier, llm, prompt=PROMPT, **params) -> list[int]:
    params = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.0, **params}
    out = llm.generate([prompt], tier.SamplingParams(**params), use_tqdm=False)
    assert llm.stats()["blocks_used"] == 0
    return out[0].outputs[0].token_ids


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_a_large_negative_logit_bias_never_samples_the_token(tier, llm):
    greedy = run(tier, llm)
    banned = {t: -100.0 for t in set(greedy)}
    for params in ({}, {"temperature": 1.0, "seed": 3}):
        assert not set(run(tier, llm, logit_bias=banned, **params)) & set(banned)


def test_a_large_positive_logit_bias_always_samples_the_token(tier, llm):
    assert run(tier, llm, logit_bias={7: 100.0}) == [7] * 24
    assert run(tier, llm, logit_bias={7: 100.0}, temperature=1.0, seed=1) == [7] * 24


def test_min_p_one_is_greedy_like(tier, llm):
    greedy = run(tier, llm)
    for seed in (0, 1):
        assert run(tier, llm, temperature=1.0, seed=seed, min_p=1.0) == greedy
    # a small min_p still draws: some seed leaves the greedy path
    assert any(run(tier, llm, temperature=1.5, seed=s, min_p=0.01) != greedy
               for s in range(4))


def test_penalties_lower_the_repeats(tier, llm):
    greedy = run(tier, llm)
    assert repeats(greedy) > 0  # the random model repeats itself: something to lower
    assert repeats(run(tier, llm, repetition_penalty=3.0)) < repeats(greedy)
    assert repeats(run(tier, llm, frequency_penalty=2.0)) < repeats(greedy)
    assert repeats(run(tier, llm, presence_penalty=2.0)) < repeats(greedy)
    # a repetition penalty below 1 rewards what was seen instead
    assert repeats(run(tier, llm, repetition_penalty=0.3)) >= repeats(greedy)


def test_neutral_values_change_nothing(tier, llm):
    want = run(tier, llm, temperature=0.9, seed=5)
    assert run(tier, llm, temperature=0.9, seed=5, repetition_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, logit_bias={}) == want


CONTROLS = [
    dict(repetition_penalty=1.4),
    dict(presence_penalty=1.0, frequency_penalty=0.5),
    dict(frequency_penalty=-1.0, logit_bias={7: 3.0, 12: -5.0}),
    dict(min_p=0.1, top_k=20, top_p=0.9),
]


@pytest.mark.parametrize("controls", CONTROLS, ids=range(len(CONTROLS)))
def test_both_tiers_give_the_same_tokens_with_the_controls(path, controls):
    ref, opt = reference.LLM(path, block_size=4), optimized.LLM(path, block_size=4)
    for sampling in ({}, {"temperature": 0.8, "seed": 11}):
        assert run(reference, ref, **controls, **sampling) == \
            run(optimized, opt, **controls, **sampling)


def test_parallel_samples_with_penalties_equal_single_requests_under_preemption(tier, path):
    params = dict(temperature=1.0, seed=20, max_tokens=12, ignore_eos=True,
                  repetition_penalty=1.3, frequency_penalty=0.5, min_p=0.05)
    llm = tier.LLM(path, block_size=4, num_gpu_blocks=30)
    others = [{"prompt_token_ids": list(range(60, 60 + n))} for n in (30, 22)]
    outs = llm.generate([*others, PROMPT], [tier.SamplingParams(max_tokens=12, ignore_eos=True)
                                           for _ in others] + [tier.SamplingParams(n=3, **params)],
                        use_tqdm=False)
    assert llm.stats()["preemptions_recompute"] > 0
    got = [c.token_ids for c in sorted(outs[-1].outputs, key=lambda c: c.index)]
    alone = tier.LLM(path, block_size=4)
    for i, tokens in enumerate(got):
        assert run(tier, alone, **{**params, "seed": 20 + i}) == tokens


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("presence_penalty", 2.01),
    ("presence_penalty", -2.5), ("frequency_penalty", 3.0), ("frequency_penalty", -2.1),
    ("min_p", -0.1), ("min_p", 1.1), ("logit_bias", {3: 100.5}), ("logit_bias", {3: -101}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("nan")}),
])
def test_out_of_range_values_are_refused_by_name(tier, field, value):
    with pytest.raises(ValueError, match=field) as err:
        tier.SamplingParams(**{field: value})
    assert err.value.field == field


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", "1"), ("min_p", None), ("logit_bias", [1, 2]), ("logit_bias", {"3": 1}),
])
def test_wrong_types_are_refused_by_name(tier, field, value):
    with pytest.raises(TypeError, match=field) as err:
        tier.SamplingParams(**{field: value})
    assert err.value.field == field


def test_logit_bias_outside_the_vocabulary_is_refused_at_the_door(tier, llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="logit_bias") as err:
        llm.generate([PROMPT], tier.SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert err.value.field == "logit_bias"
    assert run(tier, llm, max_tokens=2)  # the engine goes on
