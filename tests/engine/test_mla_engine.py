"""Multi-head latent attention in the engine: DeepSeek-V2's latent row in the paged pool.

Each token and layer keeps one row of kv_lora_rank + qk_rope_head_dim numbers in the pool's
blocks (``MLAAttentionSpec``: no V tensor); the step's prompts and chunks attend in the expanded
form, its decodes in the absorbed form (``PagedAttention.attend_latent``). The tokens are
transformers' and the one-sequence loop's (``ContiguousLatentCache``), both tiers, through
chunked prefill, prefix caching, forks and both preemptions.
"""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from pagedllm.reference.kv import MLAAttentionSpec
from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from .greedy_runs import check_shared_prefix_workload, greedy, no_leak, single_sequence_loop

BLOCK = 4
INIT_STD = 0.1  # large enough that greedy tokens depend on every position


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    config = tiny_config("deepseek_v2", max_position_embeddings=512)
    return write_random_checkpoint(tmp_path_factory.mktemp("mla") / "deepseek_v2", config,
                                   seed=0, init_std=INIT_STD)


@pytest.fixture(scope="module")
def loop(latent):
    """Greedy tokens of the one-sequence loop over a contiguous latent cache."""
    return single_sequence_loop(latent)


def test_tokens_equal_transformers_from_a_latent_pool(tier, latent, loop):
    """Three prompts, 40 tokens each, over a pool whose every slot starts NaN: the latent row
    is all the pool holds per token and layer, and the tokens are transformers'."""
    prompts = [list(range(3 + 5 * i, 20 + 5 * i)) for i in range(3)]
    hf = AutoModelForCausalLM.from_pretrained(latent, dtype=torch.float32)
    llm = tier.LLM(latent, block_size=BLOCK, num_gpu_blocks=64)
    (group,) = llm.engine.kv_cache_config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, MLAAttentionSpec)
    cfg = llm.engine.config.model_config
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    pool = llm.engine.cache_engine
    assert pool.gpu_v == [] and pool.gpu_k[0].shape == (64, BLOCK, 1, width)
    assert llm.stats()["kv_bytes_per_token"] == cfg.num_layers * width * 4  # float32
    pool.fill_(float("nan"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tier, 40),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
        want = want[0, len(prompt):].tolist()  # transformers stops at end-of-text
        assert out.outputs[0].token_ids[:len(want)] == want
        assert out.outputs[0].token_ids == loop(tuple(prompt), 40)
    no_leak(llm)


request = st.tuples(st.integers(1, 2), st.integers(3, 30), st.booleans(), st.integers(1, 30))


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(request, min_size=2, max_size=4),
       mode=st.sampled_from(["swap", "recompute"]), prefix=st.booleans(),
       chunked=st.booleans())
def test_preemption_forks_chunks_and_prefix_hits_keep_the_tokens(tier, latent, loop, reqs,
                                                                  mode, prefix, chunked):
    """n > 1 samples (their latent blocks shared, copied on write), a shared prefix (found in
    the cache: its decode reads latents another request wrote), chunks of 16 tokens (expanded
    over latents written by earlier steps) and a pool small enough to preempt."""
    check_shared_prefix_workload(tier, latent, loop, reqs, mode, prefix, chunked,
                                 num_gpu_blocks=32)


def test_a_tight_pool_preempts_both_ways(tier, latent, loop):
    prompts = [list(range(10 * i, 10 * i + 12)) for i in range(4)]
    for mode in ("swap", "recompute"):
        llm = tier.LLM(latent, block_size=BLOCK, num_gpu_blocks=30, preemption_mode=mode,
                       swap_space_blocks=64)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tier, 48),
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == loop(tuple(prompt), 48)
        assert llm.stats()[f"preemptions_{mode}"] > 0
        no_leak(llm)


@pytest.mark.parametrize(("option", "value"), [("kv_cache_dtype", "int8"),
                                               ("kv_cache_dtype", "fp8"),
                                               ("tensor_parallel_size", 2)])
def test_what_the_latent_cache_does_not_do_is_refused_by_name(tier, latent, option, value):
    with pytest.raises(ValueError, match=option):
        tier.LLM(latent, block_size=BLOCK, num_gpu_blocks=16, **{option: value})


def test_the_planner_prices_the_latent_row_as_the_engine_allocates(tier, latent):
    llm = tier.LLM(latent, block_size=BLOCK, num_gpu_blocks=20)
    pool = llm.engine.cache_engine
    per_block = sum(t[0].nbytes for t in pool.gpu_k)  # one block's row in every layer
    size = kv_size(latent, "float32")
    assert size.bytes_per_block(BLOCK) == per_block == llm.engine.kv_cache_config.bytes_per_block
    assert size.bytes_per_token * BLOCK == per_block
    assert pool.nbytes() == 20 * per_block


def test_the_triton_decode_kernel_in_the_engine_s_context(latent, loop, monkeypatch):
    """The engine's attend_latent with the Triton absorbed-decode kernel (under the
    interpreter) handed in as the backend's op: the loop's tokens."""
    import importlib
    from dataclasses import replace

    from pagedllm import reference
    from pagedllm.reference.ops import REFERENCE_BACKEND

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = importlib.import_module("pagedllm.kernels.mla_decode").paged_mla_attention
    backend = replace(REFERENCE_BACKEND, name="mla-kernel", paged_mla_attention=kernel)
    llm = reference.LLM(latent, block_size=BLOCK, num_gpu_blocks=32, backend=backend)
    llm.engine.cache_engine.fill_(float("nan"))
    prompts = [list(range(3, 14)), list(range(40, 47))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(reference, 8),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == loop(tuple(prompt), 8)
