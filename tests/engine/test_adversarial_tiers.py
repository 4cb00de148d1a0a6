"""Adversarial checks of the optimized tier against the reference: the same arguments accepted
or refused the same way, the same tokens on inputs that reach the CPU attention path's decode
buckets and padded prefill batch, and an engine that survives a failing op."""

import functools
import random
from dataclasses import replace

import pytest
import torch

import pagedllm.optimized as O
import pagedllm.reference as R
from pagedllm.optimized import CPU_BACKEND
from pagedllm.reference.model.config import load_config
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from ..conftest import failing_backend


def test_gpu_memory_utilization_is_checked_on_the_cpu_too(checkpoints):
    path = checkpoints["llama"]
    for bad, error in ((5, ValueError), (0, ValueError), ("0.9", TypeError),
                       (float("nan"), ValueError)):
        with pytest.raises(error, match="gpu_memory_utilization"):
            O.LLM(path, gpu_memory_utilization=bad)
        with pytest.raises(error, match="gpu_memory_utilization"):  # unused when sized: still
            O.LLM(path, num_gpu_blocks=8, gpu_memory_utilization=bad)


def test_positional_arguments_and_a_torch_dtype_mean_the_same_in_both_tiers(checkpoints):
    path = checkpoints["llama"]
    for tier in (R, O):
        llm = tier.LLM(path, torch.float32, "cpu", 4, 32)  # dtype, device, block_size, blocks
        assert (llm.engine.kv.block_size, llm.stats()["blocks_total"]) == (4, 32)


def outputs(outs):
    """What must be identical between the tiers: tokens and each step's top-logprob tokens."""
    return [[(c.token_ids, [sorted(d) for d in c.logprobs or []]) for c in o.outputs]
            for o in outs]


def cumulative_logprobs(outs):
    return [c.cumulative_logprob for o in outs for c in o.outputs]


# float32: the optimized tier adds the same products in another order (weights stored [in, out]
# on the CPU, one fused attention op), so logprobs agree to float32 rounding, not bit for bit.
LOGPROB_TOL = 1e-4


@pytest.mark.parametrize("family, kwargs", [
    ("llama", dict(enable_prefix_caching=True, block_size=4)),
    ("mistral", dict(block_size=8)),  # sliding window 16, prompts far longer
    ("qwen3", dict(enable_chunked_prefill=True, max_num_batched_tokens=48, block_size=4)),
])
def test_long_mixed_batches_give_the_reference_tokens(checkpoints, family, kwargs):
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(20)]
    lens = [1, 2, 17, 40, 95, 150, 210, 6, 64, 33]  # decodes spread wide: several buckets
    prompts = [{"prompt_token_ids": (shared if i % 2 else []) + [rng.randrange(256)
                                                                  for _ in range(n)]}
               for i, n in enumerate(lens)]
    params = [R.SamplingParams(n=1 + i % 3, temperature=0 if i % 3 == 0 else 0.8, seed=i,
                               max_tokens=10, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    beam = R.BeamSearchParams(beam_width=3, max_tokens=5)
    results, logprobs = [], []
    for tier in (R, O):
        llm = tier.LLM(checkpoints[family], max_model_len=256, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append((outputs(outs), [[s.tokens for s in o.sequences]
                                        for o in llm.beam_search(prompts[2:6], beam)]))
        logprobs.append(cumulative_logprobs(outs))
    assert results[0] == results[1]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=LOGPROB_TOL)


@pytest.mark.parametrize("op, after", [("paged_attention", 5), ("sample", 2),
                                       ("swap_blocks", 1), ("rms_norm", 9)])
def test_an_op_failing_once_leaves_the_optimized_engine_usable(checkpoints, op, after):
    kwargs = dict(block_size=2, num_gpu_blocks=24, preemption_mode="swap", swap_space_blocks=64)
    llm = O.LLM(checkpoints["llama"], backend=failing_backend(op, after, CPU_BACKEND),
                **kwargs)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + i))} for i in range(3)]
    params = R.SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups
    again = llm.generate(prompts, params, use_tqdm=False)
    fresh = R.LLM(checkpoints["llama"], **kwargs).generate(prompts, params, use_tqdm=False)
    assert outputs(again) == outputs(fresh)


def test_a_model_mixing_windowed_and_full_layers_gives_the_reference_tokens(tmp_path):
    """One plan per sliding window in a step: a Qwen2 with a windowed middle layer between two
    full ones, prompts much longer than the window, chunked prefill."""
    cfg = tiny_config("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
                      max_window_layers=1,
                      layer_types=["full_attention", "sliding_attention", "full_attention"])
    path = write_random_checkpoint(tmp_path / "qwen2-mixed", cfg, seed=0, init_std=0.2)
    assert load_config(path).sliding_windows == (None, 6, None)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)]}
               for n in (1, 3, 20, 40, 9, 70)]
    params = R.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = [outputs(tier.LLM(path, block_size=4, max_model_len=128,
                                enable_chunked_prefill=True, max_num_batched_tokens=32)
                       .generate(prompts, params, use_tqdm=False)) for tier in (R, O)]
    assert results[0] == results[1]


def test_a_wrapped_attention_op_keeps_working(checkpoints):
    """A wrapper of the optimized op (functools.wraps, as timers and profilers write them) is
    called with the reference's arguments, whatever its signature, and the tokens are the plain
    tier's: no op is handed a keyword another op could not take."""
    op = CPU_BACKEND.paged_attention
    calls = {"strict": 0, "open": 0}

    @functools.wraps(op)
    def strict(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
               sliding_window=None):
        calls["strict"] += 1
        return op(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                  sliding_window)

    @functools.wraps(op)
    def open_(*args, **kwargs):
        calls["open"] += 1
        assert not kwargs
        return op(*args, **kwargs)

    prompts = [{"prompt_token_ids": list(range(2 + i, 9 + 3 * i))} for i in range(4)]
    params = R.SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    plain = O.LLM(checkpoints["llama"], block_size=4).generate(prompts, params, use_tqdm=False)
    for name, wrapper in (("strict", strict), ("open", open_)):
        llm = O.LLM(checkpoints["llama"], block_size=4,
                    backend=replace(CPU_BACKEND, paged_attention=wrapper))
        assert outputs(llm.generate(prompts, params, use_tqdm=False)) == outputs(plain)
        assert calls[name] > 0
