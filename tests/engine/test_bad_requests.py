"""Bad requests and engine arguments are refused at the door, in every tier, with a message that
names the field and the limit; nothing half-accepted is left behind."""

import pytest

from pagedllm.reference.model.config import load_config

from ..conftest import baseline_refusal


@pytest.fixture(scope="module")
def llm(tier, checkpoints):
    return tier.LLM(checkpoints["llama"], block_size=4)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number"),
    (dict(top_p=float("nan")), ValueError, "top_p must be a finite number"),
    (dict(n=2.0), TypeError, "n must be an integer"),
    (dict(n=True), TypeError, "n must be an integer"),
    (dict(top_k=2.5), TypeError, "top_k must be an integer"),
    (dict(logprobs=1.0), TypeError, "logprobs must be an integer"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 18446744073709551615\]"),
    (dict(seed=2**64), ValueError, "seed must be in"),
    (dict(max_tokens="8"), TypeError, "max_tokens must be an integer"),
    (dict(stop=[""]), ValueError, "stop must be a non-empty string"),
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids must be a list"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids must be >= 0"),
])
def test_bad_sampling_values(tier, kwargs, error, message):
    with pytest.raises(error, match=message):
        tier.SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(beam_width=2.0, max_tokens=4), TypeError, "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), ValueError,
     "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=0), ValueError, "max_tokens must be >= 1"),
])
def test_bad_beam_values(tier, kwargs, error, message):
    with pytest.raises(error, match=message):
        tier.BeamSearchParams(**kwargs)


def test_limits_that_need_the_model(tier, llm):
    vocab = llm.engine.vocab_size
    prompt = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=f"logprobs = {vocab + 1} is more than the vocabulary"):
        llm.generate(prompt, tier.SamplingParams(logprobs=vocab + 1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids \[257\] are outside the vocabulary"):
        llm.generate(prompt, tier.SamplingParams(stop_token_ids=[vocab], min_tokens=2),
                     use_tqdm=False)
    seed_max = tier.SamplingParams(n=3, seed=2**64 - 1, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompt, seed_max, use_tqdm=False)[0]  # seed + index wraps, no overflow
    assert len(outs.outputs) == 3
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups


def test_prompts_in_the_wrong_form_are_not_coerced(tier, llm):
    with pytest.raises(TypeError, match="flat list of integers"):
        llm.generate([1, 2, 3], use_tqdm=False)
    with pytest.raises(TypeError, match="must hold integer token ids, got '1'"):
        llm.generate({"prompt_token_ids": ["1", "2"]}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"must hold integer token ids, got 1\.0"):
        llm.generate({"prompt_token_ids": [1.0, 2.0]}, use_tqdm=False)
    with pytest.raises(TypeError, match="must be a list of token ids"):
        llm.generate({"prompt_token_ids": "1 2 3"}, use_tqdm=False)
    with pytest.raises(TypeError, match="params must be SamplingParams or BeamSearchParams"):
        llm.engine.add_request("x", [1, 2], {"temperature": 0})
    assert not llm.engine.has_unfinished_requests() and not llm.engine.groups


def test_a_tiny_temperature_is_greedy(tier, llm):
    prompt = {"prompt_token_ids": list(range(5, 15))}
    greedy = llm.generate(prompt, tier.SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)[0]
    tiny = llm.generate(prompt, tier.SamplingParams(temperature=1e-6, max_tokens=8, seed=3),
                        use_tqdm=False)[0]
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(set(greedy.outputs[0].token_ids)) > 1  # not "always token 0"


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(max_model_len=0), "max_model_len must be >= 1"),
    (dict(max_model_len=-5), "max_model_len must be >= 1"),
    (dict(dtype="int8"), "dtype 'int8' is not supported"),
    (dict(dtype="banana"), "dtype 'banana' is not supported"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(enable_chunked_prefill=True, max_num_batched_tokens=0),
     "max_num_batched_tokens must be >= 1"),
    (dict(kv_layout="contiguous", num_gpu_blocks=4, block_size=16),
     "reserves max_model_len = 256 slots per request, more than the whole pool of 64"),
    (dict(kv_cache_memory=10), "holds no block"),
    (dict(seed=-1), r"seed must be in \[0, 18446744073709551615\], got -1"),
    (dict(seed=2**64), "seed must be in"),
    (dict(device="meta"), "device 'meta': the engine runs on 'cpu' or 'cuda'"),
])
def test_bad_engine_arguments(tier, checkpoints, kwargs, message):
    if kwargs.get("kv_layout") == "contiguous":
        message = baseline_refusal(tier, message)
    with pytest.raises(ValueError, match=message):
        tier.LLM(checkpoints["llama"], **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed="3"), "seed must be an integer"),
    (dict(backend=print), "backend must be a pagedllm.reference.ops.Backend"),
    (dict(backend=print), "got <built-in function print>"),
])
def test_engine_arguments_of_the_wrong_type(tier, checkpoints, kwargs, message):
    with pytest.raises(TypeError, match=message):
        tier.LLM(checkpoints["llama"], **kwargs)


def test_every_bit_of_the_engine_seed_counts(tier, checkpoints):
    """Requests without a seed draw theirs from the engine's seed, all 64 bits of it."""
    params = tier.SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    runs = [tier.LLM(checkpoints["llama"], seed=seed).generate(prompt, params, use_tqdm=False)
            for seed in (1, 2**32 + 1, 1)]
    tokens = [r[0].outputs[0].token_ids for r in runs]
    assert tokens[0] == tokens[2] and tokens[0] != tokens[1]


def test_beam_search_is_validated_like_generate(tier, checkpoints):
    path = checkpoints["opt"]  # learned positions: a position past the table is an IndexError
    positions = load_config(path).max_position_embeddings
    llm = tier.LLM(path, block_size=4)
    with pytest.raises(ValueError, match="longer than max_model_len"):
        llm.beam_search({"prompt_token_ids": [1] * (positions + 1)},
                        tier.BeamSearchParams(beam_width=2, max_tokens=4))
    out = llm.beam_search({"prompt_token_ids": [1] * (positions - 3)},
                          tier.BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))
    assert all(len(s.tokens) == 3 for s in out[0].sequences)  # stopped at max_model_len
    assert llm.stats()["blocks_used"] == 0


def test_aborting_a_swapped_request_forgets_its_swapped_blocks(tier, checkpoints):
    llm = tier.LLM(checkpoints["llama"], block_size=2, num_gpu_blocks=16,
                   preemption_mode="swap", swap_space_blocks=64)
    engine = llm.engine
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": list(range(1 + i, 9 + i))},
                           tier.SamplingParams(max_tokens=20, ignore_eos=True))
    while not engine.scheduler.swapped:
        engine.step()
    for group in list(engine.scheduler.swapped):
        engine.abort_request(group.request_id)
    assert llm.stats()["swapped_blocks"] == 0 and llm.stats()["swapped"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.stats()["blocks_used"] == 0


def test_a_request_larger_than_the_pool_says_how_large(tier, checkpoints):
    llm = tier.LLM(checkpoints["llama"], block_size=4, num_gpu_blocks=4)  # 16 token slots
    prompt = {"prompt_token_ids": list(range(1, 11))}
    with pytest.raises(ValueError, match=r"needs up to 30 tokens of KV memory"):
        llm.generate(prompt, tier.SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match=r"needs up to 2 x 30 tokens"):
        llm.generate(prompt, tier.SamplingParams(n=2, max_tokens=20), use_tqdm=False)
    assert llm.generate(prompt, tier.SamplingParams(max_tokens=4), use_tqdm=False)[0].finished


def test_sampling_values_at_the_edges_of_float32_and_int64(tier, llm):
    """A top_k past the vocabulary (even past int64) keeps everything, a top_p too small for
    float32 keeps the most likely token, a temperature past float32 is refused."""
    prompt = {"prompt_token_ids": [1, 2, 3]}
    greedy = llm.generate(prompt, tier.SamplingParams(temperature=0, max_tokens=4),
                          use_tqdm=False)[0].outputs[0].token_ids
    tiny_p = llm.generate(prompt, tier.SamplingParams(top_p=1e-300, seed=1, max_tokens=4),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert tiny_p == greedy
    huge_k = tier.SamplingParams(top_k=2**63 - 1, seed=1, max_tokens=4)
    no_k = tier.SamplingParams(seed=1, max_tokens=4)
    assert llm.generate(prompt, huge_k, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate(prompt, no_k, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"temperature must be at most 3.40282e\+38"):
        tier.SamplingParams(temperature=1e39)
