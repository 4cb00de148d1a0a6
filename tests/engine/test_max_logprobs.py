"""max_logprobs (vLLM's engine argument, default 20): the most logprobs and prompt_logprobs one
request may ask for, so that no request can make the engine hold vocabulary x prompt-tokens
floats. More is refused at the door, by name, with the limit and how to raise it; -1 lifts the
cap to the vocabulary. In every tier, and a refused request leaves the engine serving."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.reference.engine.validation import FieldTypeError, FieldValueError

PROMPT = {"prompt_token_ids": [3, 17, 200, 33, 45, 99]}
CAPS = (-1, 0, 20, 21)  # no cap, the least, vLLM's default, one above it
FIELDS = ("logprobs", "prompt_logprobs")


@pytest.fixture(scope="module")
def llms(tier, checkpoints) -> dict:
    """One LLM per cap; the default (no max_logprobs given) under None."""
    llms = {cap: tier.LLM(checkpoints["llama"], block_size=4, max_logprobs=cap)
            for cap in CAPS}
    llms[None] = tier.LLM(checkpoints["llama"], block_size=4)
    return llms


def run(llm, tier, **k):
    params = tier.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, **k)
    return llm.generate(PROMPT, params, use_tqdm=False)[0]


def assert_serves(llm, tier):
    """The engine holds nothing and a following request finishes."""
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups
    out = run(llm, tier, logprobs=1)
    assert out.finished and len(out.outputs[0].token_ids) == 2
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups


def test_the_default_is_vllms_20(tier, llms):
    llm = llms[None]
    assert llm.engine.config.max_logprobs == tier.EngineArgs("any").max_logprobs == 20
    out = run(llm, tier, logprobs=20, prompt_logprobs=20)  # the cap itself is allowed
    assert all(len(d) in (20, 21) for d in out.outputs[0].logprobs)
    assert all(len(d) in (20, 21) for d in out.prompt_logprobs[1:])


@pytest.mark.parametrize("field", FIELDS)
def test_21_is_refused_by_default_naming_the_field_the_limit_and_the_option(tier, llms, field):
    llm = llms[None]
    with pytest.raises(FieldValueError) as info:
        run(llm, tier, **{field: 21})
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field} = 21 ")
    assert "max_logprobs = 20" in message and "--max-logprobs" in message
    assert_serves(llm, tier)


@pytest.mark.parametrize("field", FIELDS)
def test_a_raised_cap_serves_what_it_allows(tier, llms, field):
    out = run(llms[21], tier, **{field: 21})
    entries = out.outputs[0].logprobs if field == "logprobs" else out.prompt_logprobs[1:]
    assert entries and all(len(d) in (21, 22) for d in entries)
    with pytest.raises(FieldValueError, match="max_logprobs = 21") as info:
        run(llms[21], tier, **{field: 22})
    assert info.value.field == field
    assert_serves(llms[21], tier)


def test_minus_1_allows_the_whole_vocabulary_and_no_more(tier, llms):
    llm = llms[-1]
    vocab = llm.engine.vocab_size
    assert vocab > 21
    out = run(llm, tier, logprobs=vocab, prompt_logprobs=vocab)
    assert all(len(d) == vocab for d in out.outputs[0].logprobs)
    assert all(len(d) == vocab for d in out.prompt_logprobs[1:])
    for field in FIELDS:
        with pytest.raises(FieldValueError, match=f"more than the vocabulary of {vocab}") as info:
            run(llm, tier, **{field: vocab + 1})
        assert info.value.field == field
    assert_serves(llm, tier)


@settings(max_examples=40, deadline=None)
@given(cap=st.sampled_from(CAPS + (None,)), field=st.sampled_from(FIELDS),
       k=st.integers(0, 300))
def test_accepted_exactly_up_to_the_cap(tier, llms, cap, field, k):
    """k is served iff k <= the cap (20 by default; the vocabulary for -1, and always at most
    the vocabulary); a refusal names the field and leaves nothing behind."""
    llm = llms[cap]
    vocab = llm.engine.vocab_size
    limit = {None: 20, -1: vocab}.get(cap, cap)
    if k <= min(limit, vocab):
        out = run(llm, tier, **{field: k})
        entries = out.outputs[0].logprobs if field == "logprobs" else out.prompt_logprobs[1:]
        assert all(min(k, vocab) <= len(d) <= k + 1 for d in entries)
    else:
        with pytest.raises(FieldValueError) as info:
            run(llm, tier, **{field: k})
        assert info.value.field == field
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups


@pytest.mark.parametrize("value, error, message", [
    (-2, FieldValueError, r"max_logprobs must be -1 or >= 0, got -2"),
    ("20", FieldTypeError, "max_logprobs must be an integer"),
    (True, FieldTypeError, "max_logprobs must be an integer"),
    (20.0, FieldTypeError, "max_logprobs must be an integer"),
])
def test_a_bad_max_logprobs_is_refused_before_the_checkpoint_is_read(tier, tmp_path, value,
                                                                     error, message):
    with pytest.raises(error, match=message) as info:
        tier.EngineArgs(tmp_path / "no-such-model", max_logprobs=value).create_engine_config()
    assert info.value.field == "max_logprobs"
