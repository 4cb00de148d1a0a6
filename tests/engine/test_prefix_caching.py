"""Prefix caching on or off gives identical tokens, in the easy case and the hard ones."""

import torch

from ..conftest import baseline_refusal

SYSTEM = list(range(100, 137))  # a 37-token "system prompt" shared by every request
BLOCK = 4


def requests(tier, n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": SYSTEM + torch.randint(0, 257, (int(k),), generator=g)
                .tolist()} for k in torch.randint(1, 12, (n,), generator=g)]
    params = [tier.SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=10,
                                  ignore_eos=True) for i in range(n)]
    return prompts, params


def run(tier, path, prompts, params, **kw):
    llm = tier.LLM(path, block_size=BLOCK, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def consistent(llm) -> None:
    manager = llm.engine.kv.manager
    cache = manager.prefix_cache
    assert all(cache.key_of[block] == key for key, block in cache.block_of.items())
    assert llm.stats()["blocks_used"] == 0 and manager.num_seqs == 0


def test_shared_system_prompt_same_tokens_fewer_prefill_tokens(tier, checkpoints):
    path = checkpoints["llama3"]
    prompts, params = requests(tier)
    off, llm_off = run(tier, path, prompts, params, max_num_seqs=1)  # one at a time: hits certain
    on, llm_on = run(tier, path, prompts, params, max_num_seqs=1, enable_prefix_caching=True)
    assert on == off
    saved = llm_on.stats()["prefix_cache_hit_tokens"]
    assert saved == 5 * (len(SYSTEM) // BLOCK) * BLOCK  # every request after the first: 9 blocks
    assert llm_on.stats()["prefill_tokens"] == llm_off.stats()["prefill_tokens"] - saved
    consistent(llm_on)


def test_a_prompt_found_whole_still_computes_its_last_token(tier, checkpoints):
    path = checkpoints["qwen3"]
    prompt = [{"prompt_token_ids": list(range(1, 1 + 4 * BLOCK))}]  # exactly 4 full blocks
    params = tier.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = tier.LLM(path, block_size=BLOCK, enable_prefix_caching=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == second
    assert llm.stats()["prefix_cache_hit_tokens"] == 3 * BLOCK  # the last block is recomputed
    consistent(llm)


def test_identical_prompts_in_one_step(tier, checkpoints):
    path = checkpoints["llama"]
    prompts = [{"prompt_token_ids": SYSTEM}] * 3
    params = tier.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    on, llm = run(tier, path, prompts, params, enable_prefix_caching=True)
    off, _ = run(tier, path, prompts, params)
    assert on == off and on[0] == on[1] == on[2]
    consistent(llm)


def test_preempted_requests_meet_their_own_cached_blocks(tier, checkpoints):
    path = checkpoints["llama3"]
    prompts, params = requests(tier, 8, seed=1)
    params = [tier.SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=30,
                                  ignore_eos=True) for p in params]  # long enough to run out
    off, _ = run(tier, path, prompts, params)
    for mode in ("recompute", "swap"):
        on, llm = run(tier, path, prompts, params, enable_prefix_caching=True,
                      num_gpu_blocks=24, preemption_mode=mode, swap_space_blocks=64)
        stats = llm.stats()
        assert on == off
        assert stats["preemptions_recompute"] + stats["preemptions_swap"] > 0
        assert stats["prefix_cache_hit_blocks"] > 0
        consistent(llm)


def test_evicted_blocks_are_reused_and_forgotten(tier, checkpoints):
    path = checkpoints["mistral"]
    params = tier.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    target = [{"prompt_token_ids": SYSTEM}]
    llm = tier.LLM(path, block_size=BLOCK, num_gpu_blocks=24, enable_prefix_caching=True)
    before = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    cache = llm.engine.kv.manager.prefix_cache
    keys_of_target = set(cache.block_of)
    # Other prompts take every block in turn: the target's cached blocks are handed out again.
    for i in range(6):
        llm.generate([{"prompt_token_ids": [i + 1] * 60}], params, use_tqdm=False)
    assert not keys_of_target <= set(cache.block_of)  # at least part of it was evicted
    consistent(llm)
    after = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
    consistent(llm)


def test_prefix_caching_needs_paged_blocks(tier, checkpoints):
    import pytest

    with pytest.raises(ValueError, match=baseline_refusal(tier, "needs kv_layout='paged'")):
        tier.LLM(checkpoints["llama"], kv_layout="contiguous", enable_prefix_caching=True)


def test_cached_blocks_in_use_cost_no_free_blocks():
    from pagedllm.reference.kv.block_manager import BlockSpaceManager

    m = BlockSpaceManager(4, 6, enable_prefix_caching=True)
    first = list(range(100, 113))  # 13 tokens: 3 full blocks and one partial
    m.allocate(0, 13, first)
    m.mark_computed(0, first, 13)
    second = first[:8] + [9, 9, 9]  # shares 2 full blocks with the running sequence
    assert m.num_new_blocks(11, second) == 1 and m.can_allocate(11, second)
    m.allocate(1, 11, second)
    assert m.tables[1].num_cached_tokens == 8 and m.num_free_gpu_blocks == 1
