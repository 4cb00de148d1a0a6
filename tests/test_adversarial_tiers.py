"""Adversarial checks of the optimized tier against the reference: the same arguments accepted
or refused the same way, the same tokens on inputs that reach the CPU attention path's decode
buckets and padded prefill batch, and an engine that survives a failing op."""

import random
from dataclasses import replace

import pytest
import torch

import pagedllm.optimized as O
import pagedllm.reference as R
from pagedllm.optimized import OPTIMIZED_BACKEND


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
    return [[(c.token_ids, round(c.cumulative_logprob, 4),
              [sorted(d) for d in c.logprobs or []]) for c in o.outputs] for o in outs]


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
    results = []
    for tier in (R, O):
        llm = tier.LLM(checkpoints[family], max_model_len=256, **kwargs)
        results.append((outputs(llm.generate(prompts, params, use_tqdm=False)),
                        [[s.tokens for s in o.sequences]
                         for o in llm.beam_search(prompts[2:6], beam)]))
    assert results[0] == results[1]


@pytest.mark.parametrize("op, after", [("paged_attention", 5), ("sample", 2),
                                       ("swap_blocks", 1), ("rms_norm", 9)])
def test_an_op_failing_once_leaves_the_optimized_engine_usable(checkpoints, op, after):
    calls = {"n": 0}
    original = getattr(OPTIMIZED_BACKEND, op)

    def broken(*args, **kw):
        calls["n"] += 1
        if calls["n"] == after:
            raise RuntimeError(f"injected failure in {op}")
        return original(*args, **kw)

    kwargs = dict(block_size=2, num_gpu_blocks=24, preemption_mode="swap", swap_space_blocks=64)
    llm = O.LLM(checkpoints["llama"], backend=replace(OPTIMIZED_BACKEND, **{op: broken}),
                **kwargs)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + i))} for i in range(3)]
    params = R.SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.groups
    again = llm.generate(prompts, params, use_tqdm=False)
    fresh = R.LLM(checkpoints["llama"], **kwargs).generate(prompts, params, use_tqdm=False)
    assert outputs(again) == outputs(fresh)
