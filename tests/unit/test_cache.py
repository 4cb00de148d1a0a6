"""A KV cache changes the cost of generation, never its result."""

import pytest
import torch

from pagedllm.reference import ContiguousCache, NoCache, generate, load_model

from ..conftest import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_and_uncached_generation_agree(checkpoints, family):
    model = load_model(checkpoints[family])
    prompt = list(range(3, 30))  # 27 tokens + 24 new: past the Mistral window of 16
    assert generate(model, prompt, 24, cache="contiguous") == generate(model, prompt, 24,
                                                                       cache="none")


def test_seeded_sampling_agrees_with_and_without_cache(checkpoints):
    model = load_model(checkpoints["llama3"])
    runs = [generate(model, [5, 6, 7], 20, temperature=0.8, cache=cache,
                     seed=7)
            for cache in ("contiguous", "none", "contiguous")]
    assert runs[0] == runs[1] == runs[2]
    other_seed = generate(model, [5, 6, 7], 20, temperature=0.8,
                          seed=8)
    assert other_seed != runs[0]


def test_decode_step_logits_match_full_recompute(checkpoints):
    """Prefill then one decode step through the cache equals one pass over everything."""
    model = load_model(checkpoints["qwen3"])
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (11,))
    with torch.no_grad():
        full = model(ids, torch.arange(11), NoCache())[-1]
        cache = ContiguousCache(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
        model(ids[:10], torch.arange(10), cache)
        assert cache.num_cached_tokens == 10
        step = model(ids[10:], torch.arange(10, 11), cache)[-1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)


def test_contiguous_cache_reserves_up_front_and_refuses_overflow():
    cache = ContiguousCache(num_layers=2, max_len=8, num_kv_heads=2, head_dim=4)
    assert cache.nbytes() == 2 * 2 * 8 * 2 * 4 * 4  # K and V, layers, slots, heads, dim, fp32
    k = torch.randn(9, 2, 4)
    with pytest.raises(ValueError, match="reserved for 8 tokens"):
        cache.store_and_fetch(0, torch.arange(9), k, k)


def test_eos_stops_generation(checkpoints):
    model = load_model(checkpoints["llama"])
    free_run = generate(model, [1, 2, 3], 16)
    eos = free_run[5]
    stopped = generate(model, [1, 2, 3], 16, eos_token_id=eos)
    assert stopped == free_run[: free_run.index(eos) + 1]
