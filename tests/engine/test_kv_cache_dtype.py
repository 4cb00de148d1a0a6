"""A quantized KV cache in the engine: every KV operation keeps working, scheduling still never
changes a result, both tiers agree, the pool holds the tokens its bytes buy, and bad options are
refused at construction.

Per dtype, a tight pool (recompute and swap preemption), chunked prefill and prefix caching must
give the tokens of a roomy pool. That holds because a token's stored K/V depend only on the token:
int8 / int4 compute each token's scale when it is written, and fp8's per-tensor scales are fixed
(1.0). With calculate_kv_scales the scales come from the first batch, so they depend on which
requests arrive first: there the test is that a failed first step leaves no layer calibrated.
"""

import pytest
import torch

from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from ..conftest import INIT_STD, failing_backend
from .test_engine import run  # generate, and check that every block came back

DTYPES = ("fp8", "fp8_e5m2", "int8", "int4")
SHARED = list(range(40, 60))  # a 20-token prefix several prompts share (prefix caching)


def workload(tier):
    g = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": (SHARED if i % 3 == 0 else []) +
                torch.randint(0, 250, (n,), generator=g).tolist()}
               for i, n in enumerate((5, 17, 9, 26, 3, 12, 30, 7))]
    params = [tier.SamplingParams(temperature=0 if i % 2 == 0 else 0.8, seed=7 + i,
                                  max_tokens=6 + (i * 5) % 11, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


REGIMES = {  # each a tight pool (preemption) with the prefix cache on
    "recompute": dict(num_gpu_blocks=16, block_size=4, enable_prefix_caching=True),
    "swap + chunked prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=8,
                                   num_gpu_blocks=16, block_size=4, preemption_mode="swap",
                                   swap_space_blocks=64, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def roomy(tier, checkpoints):
    prompts, params = workload(tier)
    return {dtype: run(tier, checkpoints["llama3"], prompts, params, kv_cache_dtype=dtype,
                       block_size=4)[0] for dtype in DTYPES}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_scheduling_never_changes_a_result_under_a_quantized_cache(tier, checkpoints, roomy,
                                                                   dtype, regime):
    prompts, params = workload(tier)
    tokens, stats = run(tier, checkpoints["llama3"], prompts, params, kv_cache_dtype=dtype,
                        **REGIMES[regime])
    assert tokens == roomy[dtype]
    assert stats["kv_cache_dtype"] == {"fp8": "fp8_e4m3"}.get(dtype, dtype)
    if "swap" in regime:
        assert stats["preemptions_swap"] > 0  # blocks (and their scales) really moved
    else:
        assert stats["preemptions_recompute"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0  # cached blocks were reused, scales kept


@pytest.mark.parametrize("dtype", ["int8", "int4"])  # the formats whose blocks carry scales
def test_copy_on_write_and_beam_search_on_quantized_blocks(tier, checkpoints, dtype):
    """n > 1 shares the prompt's blocks and copies the last one on write; beam search forks and
    frees blocks every step. A tight pool must give what a roomy one gives."""
    path = checkpoints["llama3"]
    prompt = {"prompt_token_ids": list(range(3, 14))}
    sampled = tier.SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=9, ignore_eos=True)
    beams = tier.BeamSearchParams(beam_width=3, max_tokens=6)
    results = []
    for engine_args in (dict(block_size=4), dict(block_size=4, num_gpu_blocks=16)):
        llm = tier.LLM(path, kv_cache_dtype=dtype, **engine_args)
        out = llm.generate([prompt], sampled, use_tqdm=False)[0]
        beam = llm.beam_search([prompt], beams)[0]
        assert llm.stats()["blocks_used"] == 0
        assert llm.stats()["cow_copies"] > 0
        results.append(([c.token_ids for c in out.outputs],
                        [s.tokens for s in beam.sequences]))
    assert results[0] == results[1]


def test_both_tiers_give_identical_tokens_per_dtype(checkpoints):
    from pagedllm import optimized, reference

    prompts, params = workload(reference)
    for dtype in DTYPES:
        ours = [run(t, checkpoints["llama3"], prompts, params, kv_cache_dtype=dtype)[0]
                for t in (reference, optimized)]
        assert ours[0] == ours[1], dtype


def test_calculated_scales_come_from_one_whole_batch(tier, checkpoints):
    """A first step that fails half way through the layers calibrates nothing: the next batch
    sets every layer's scales, exactly as on a fresh engine."""
    path = checkpoints["llama3"]
    prompts, params = workload(tier)
    broken = tier.LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True,
                      backend=failing_backend("paged_attention", 2, tier.LLM(path).engine.backend))
    with pytest.raises(RuntimeError, match="injected failure"):
        broken.generate(prompts[:2], params[:2], use_tqdm=False)
    assert broken.stats()["blocks_used"] == 0
    again = broken.generate(prompts, params, use_tqdm=False)
    fresh = tier.LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True)
    outs = fresh.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    ours, theirs = (llm.engine.cache_engine.quant for llm in (broken, fresh))
    assert all(float(s) != 1.0 for s in ours.k_scales + ours.v_scales), "every layer calibrated"
    # The same batch set them (equal up to float rounding: a swapped-in op, as the failing one
    # is, runs the optimized tier's generic attention path instead of its planned one).
    assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(ours.k_scales + ours.v_scales,
                                                                theirs.k_scales + theirs.v_scales,
                                                                strict=True))


def test_the_pool_holds_what_its_bytes_buy(tier, checkpoints):
    path, memory = checkpoints["llama3"], 2**20
    stats = {}
    for dtype in ("auto", *DTYPES):
        llm = tier.LLM(path, kv_cache_dtype=dtype, kv_cache_memory=memory)
        s = llm.stats()
        assert s["kv_bytes_per_token"] == kv_size(path, "float32", dtype).bytes_per_token
        assert s["kv_cache_bytes"] <= memory + 64  # fp8's per-layer scales: a few bytes
        stats[dtype] = s["kv_capacity_tokens"]
    # head_dim 16 in float32: 64 bytes a row; fp8 16, int8 16 + 2, int4 8 + 4.
    assert stats["fp8"] / stats["auto"] == pytest.approx(4.0, rel=0.02)
    assert stats["int8"] / stats["auto"] == pytest.approx(64 / 18, rel=0.02)
    assert stats["int4"] / stats["auto"] == pytest.approx(64 / 12, rel=0.02)


# -- refused at construction --------------------------------------------------------------------
def test_bad_kv_cache_options_are_refused(tier, checkpoints, tmp_path):
    path = checkpoints["llama3"]
    with pytest.raises(ValueError, match="auto, fp8_e4m3, fp8_e5m2, int8, int4, float16, "
                       "bfloat16, fp8, fp16, bf16") as err:
        tier.LLM(path, kv_cache_dtype="fp4")
    assert err.value.field == "kv_cache_dtype"
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        tier.LLM(path, kv_cache_dtype=torch.int8)
    with pytest.raises(ValueError, match="calculate_kv_scales") as err:
        tier.LLM(path, kv_cache_dtype="int8", calculate_kv_scales=True)
    assert err.value.field == "calculate_kv_scales"
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        tier.LLM(path, calculate_kv_scales=True)  # auto has no scales
    with pytest.raises(TypeError, match="calculate_kv_scales"):
        tier.LLM(path, kv_cache_dtype="fp8", calculate_kv_scales="yes")
    odd = write_random_checkpoint(tmp_path / "odd", tiny_config(  # OPT: no rotary to need it even
        "opt", hidden_size=60, word_embed_proj_dim=60, num_attention_heads=4),
        seed=0, init_std=INIT_STD)
    with pytest.raises(ValueError, match="head_dim 15 is odd") as err:
        tier.LLM(odd, kv_cache_dtype="int4")
    assert err.value.field == "kv_cache_dtype"
    assert tier.LLM(odd, kv_cache_dtype="int8").generate(
        [{"prompt_token_ids": [1, 2, 3]}], tier.SamplingParams(max_tokens=2),
        use_tqdm=False)[0].outputs[0].token_ids  # an odd head_dim is fine for int8


# -- 16-bit names (issue 41: source article 3's --kv-cache-dtype fp16) ---------------------------
def test_a_sixteen_bit_cache_is_the_models_own_or_one_rounded_to_it(checkpoints):
    """fp16 / float16 / bf16 / bfloat16: the model's own dtype is "auto"; beside a model of
    another dtype, a cache of that dtype (half a float32 model's bytes), and the tiers agree."""
    from pagedllm import optimized, reference

    path = checkpoints["llama3"]
    same = reference.LLM(path, dtype="bfloat16", kv_cache_dtype="bf16", num_gpu_blocks=8)
    assert same.engine.config.kv_cache_dtype == "auto"
    auto = reference.LLM(path, dtype="float32", num_gpu_blocks=8).stats()
    half = reference.LLM(path, dtype="float32", kv_cache_dtype="fp16", num_gpu_blocks=8)
    assert half.engine.config.kv_cache_dtype == "float16"
    assert half.stats()["kv_bytes_per_token"] * 2 == auto["kv_bytes_per_token"]
    prompts, params = workload(reference)
    ours = [run(t, path, prompts, params, kv_cache_dtype="fp16", **REGIMES["recompute"])[0]
            for t in (reference, optimized)]
    assert ours[0] == ours[1]
