"""SamplingParams(prompt_logprobs=k): the logprob of every prompt token and its top k, in vLLM's
shape (first entry None), equal to transformers' log-softmax over the prompt, in both tiers;
the same whole, chunked, prefix-cached or preempted by recompute, and refused by name when
out of range."""

import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[3, 17, 200, 33, 45, 99, 120, 7, 8, 9, 250, 251, 42, 43, 44, 45, 46, 47, 48],
           [100, 101, 102, 103, 104, 105, 106, 107, 9, 8, 7],
           [5, 6]]
TOL = 1e-4  # float32 sums in another order than transformers'


@pytest.fixture(scope="module")
def expected(checkpoints):
    """transformers' log-softmax at every prompt position: entry i from position i - 1."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
                for p in PROMPTS]


def generate(llm, tier, k=2, prompts=PROMPTS, **params):
    params = tier.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                 prompt_logprobs=k, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check(outs, expected, k=2, prompts=PROMPTS):
    """outs: RequestOutputs, or their prompt_logprobs lists (then no ranks to check)."""
    for out, prompt, lp in zip(outs, prompts, expected, strict=True):
        entries = getattr(out, "prompt_logprobs", out)
        ranks = getattr(out, "prompt_token_ranks", None)
        assert entries[0] is None and len(entries) == len(prompt)
        if ranks is not None:  # 1 + how many tokens transformers finds more likely
            assert ranks[0] is None and len(ranks) == len(prompt)
            for i in range(1, len(prompt)):
                own = entries[i][prompt[i]]
                assert ranks[i] in range(int((lp[i - 1] > own + TOL).sum()) + 1,
                                         int((lp[i - 1] > own - TOL).sum()) + 2)
        for i in range(1, len(prompt)):
            top = set(lp[i - 1].topk(k).indices.tolist())
            assert set(entries[i]) == top | {prompt[i]}
            for token, value in entries[i].items():
                assert value == pytest.approx(lp[i - 1, token].item(), abs=TOL)


def test_every_prompt_token_and_its_top_k(tier, checkpoints, expected):
    llm = tier.LLM(checkpoints["llama"], block_size=4)
    outs = generate(llm, tier)
    check(outs, expected)
    alone = [generate(llm, tier, prompts=[p])[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    # k = 0: the prompt token's own logprob only; a one-token prompt: [None]
    zero = generate(llm, tier, k=0, prompts=[PROMPTS[0], [9]])
    assert [list(e) for e in zero[0].prompt_logprobs[1:]] == [[t] for t in PROMPTS[0][1:]]
    assert zero[1].prompt_logprobs == [None]
    plain = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                         tier.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.stats()["blocks_used"] == 0


def test_chunked_prefill_gives_the_same_entries(tier, checkpoints, expected):
    llm = tier.LLM(checkpoints["llama"], block_size=4, enable_chunked_prefill=True,
                   max_num_batched_tokens=5)  # the long prompt takes four steps
    engine = llm.engine
    params = tier.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                 prompt_logprobs=2)
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, params)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.prompt_logprobs)
    assert seen[0] is None  # streamed outputs of an unfinished prefill: not yet
    assert seen[-1] is not None and len(seen[-1]) == len(PROMPTS[0])
    check([seen[-1]], expected[:1], prompts=PROMPTS[:1])


def test_prefix_cache_hits_are_not_taken_by_requests_that_want_prompt_logprobs(
        tier, checkpoints, expected):
    llm = tier.LLM(checkpoints["llama"], block_size=4, enable_prefix_caching=True)
    plain = tier.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    outs = generate(llm, tier)  # every full block of these prompts is cached now
    check(outs, expected)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits  # looked up nothing
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > hits  # their blocks were cached for others


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_neither_duplicates_nor_loses_entries(tier, checkpoints, expected, mode):
    kw = dict(swap_space_blocks=64) if mode == "swap" else {}
    small = tier.LLM(checkpoints["llama"], block_size=4, num_gpu_blocks=14,
                     preemption_mode=mode, enable_prefix_caching=mode == "recompute", **kw)
    params = tier.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                 prompt_logprobs=2)
    outs = small.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = small.stats()
    assert stats[f"preemptions_{mode}"] > 0
    check(outs, expected)
    big = tier.LLM(checkpoints["llama"], block_size=4)
    alone = big.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    if mode == "recompute":  # its entries were in: the recomputed prompt read the cache
        assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["blocks_used"] == 0


def test_parallel_samples_share_one_list(tier, checkpoints, expected):
    llm = tier.LLM(checkpoints["llama"], block_size=4)
    params = tier.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True,
                                 prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    entries = out.prompt_logprobs
    assert entries[0] is None and len(entries) == len(PROMPTS[1])
    for i in range(1, len(PROMPTS[1])):
        assert entries[i][PROMPTS[1][i]] == pytest.approx(
            expected[1][i - 1, PROMPTS[1][i]].item(), abs=TOL)


@pytest.mark.parametrize("value, error, message", [
    (-1, ValueError, "prompt_logprobs must be >= 0"),
    (1.5, TypeError, "prompt_logprobs must be an integer"),
    (True, TypeError, "prompt_logprobs must be an integer"),
])
def test_bad_prompt_logprobs(tier, value, error, message):
    with pytest.raises(error, match=message) as info:
        tier.SamplingParams(prompt_logprobs=value)
    assert info.value.field == "prompt_logprobs"


def test_prompt_logprobs_above_the_vocabulary(tier, checkpoints):
    llm = tier.LLM(checkpoints["llama"], block_size=4, max_logprobs=-1)  # no cap: the vocabulary
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=f"prompt_logprobs = {vocab + 1} is more than the "
                                         f"vocabulary of {vocab} tokens") as info:
        llm.generate({"prompt_token_ids": [1, 2, 3]},
                     tier.SamplingParams(prompt_logprobs=vocab + 1), use_tqdm=False)
    assert info.value.field == "prompt_logprobs"
    out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                       tier.SamplingParams(prompt_logprobs=vocab, max_tokens=1),
                       use_tqdm=False)[0]  # the whole vocabulary is a valid k
    assert len(out.prompt_logprobs[1]) == vocab
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups
