"""The optimized tier on CUDA, held to the reference tier on CUDA.

On a GPU the optimized tier runs code the CPU suite never reaches: the compiled Triton kernels,
the model runner's device-side attention metadata, CUDA graphs for decode steps (padded to the
captured batch sizes) and the KV pool sized from a profiled step (gpu_memory_utilization).

- float32: the same greedy and seeded tokens as the reference tier, on a Llama (GQA, llama3
  rope) and an OPT checkpoint;
- bfloat16, compared the vLLM way: both tiers greedy with logprobs=5; at the first token where
  they differ, each side's token must be among the other side's top-5, and the comparison stops
  there (after one difference the two continuations see different prefixes);
- CUDA graphs on (the default) and off (enforce_eager=True) give the same tokens, with a batch
  that starts above the largest captured size and shrinks through several captured sizes;
- preemption (a pool too small for the batch), chunked prefill and prefix caching give the
  tokens of a roomy run;
- gpu_memory_utilization sizes a pool from the GPU's memory, and a utilization too low for any
  KV block is refused with a ValueError.

Skipped without CUDA (tests/gpu/conftest.py).
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedllm.optimized as optimized
import pagedllm.reference as reference
from pagedllm.optimized.cuda_graphs import GRAPH_BATCH_SIZES

DEVICE = "cuda"
FAMILIES = ("llama3", "opt")
TOP = 5  # logprobs asked for in the bfloat16 comparison, as in vLLM's check_logprobs_close


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """Each test's engines (KV pools, CUDA graphs) go before the next test measures memory."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_prompts(vocab: int, lengths=(1, 6, 17, 30, 9, 23), seed: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    eos = vocab - 1  # never inside a prompt
    return [{"prompt_token_ids": torch.randint(0, eos, (n,), generator=g).tolist()}
            for n in lengths]


def mixed_params(count: int, max_tokens=(12, 16, 9, 20, 14, 18), logprobs=None) -> list:
    """Greedy and seeded sampling, alternating; each request its own length."""
    return [reference.SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=100 + i,
                                     max_tokens=max_tokens[i % len(max_tokens)],
                                     ignore_eos=True, logprobs=logprobs)
            for i in range(count)]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def run(tier, path, prompts, params, **kwargs):
    llm = tier.LLM(path, device=DEVICE, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["blocks_used"] == 0  # every request's blocks went back
    return outs, llm


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_greedy_and_seeded_tokens_match_the_reference(checkpoints, family):
    path = checkpoints[family]
    kw = dict(block_size=8, num_gpu_blocks=128)
    prompts = make_prompts(257)
    params = mixed_params(len(prompts), logprobs=2)
    params[1] = reference.SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=15,
                                         ignore_eos=True, logprobs=2)  # forks: copy-on-write
    ref, _ = run(reference, path, prompts, params, **kw)
    opt, _ = run(optimized, path, prompts, params, **kw)
    assert tokens(opt) == tokens(ref)
    for a, b in zip(ref, opt, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            for token, la, lb in zip(ca.token_ids, ca.logprobs, cb.logprobs, strict=True):
                assert abs(la[token] - lb[token]) <= 1e-3


def first_difference_is_close(a: list[int], b: list[int], la: list[dict], lb: list[dict]):
    """vLLM's check_logprobs_close: None if the sequences agree up to the first differing
    token and there each side's token is in the other's top logprobs; else what went wrong."""
    for i, (ta, tb) in enumerate(zip(a, b, strict=True)):
        if ta != tb:
            if ta not in lb[i] or tb not in la[i]:
                return (f"token {i}: {ta} vs {tb}; top-{TOP} of the first {sorted(la[i])}, "
                        f"of the second {sorted(lb[i])}")
            return None  # the continuations differ from here on: stop comparing
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tokens_agree_the_vllm_way(checkpoints, family):
    path = checkpoints[family]
    kw = dict(dtype="bfloat16", block_size=8, num_gpu_blocks=128)
    prompts = make_prompts(257, seed=6)
    params = reference.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                      logprobs=TOP)
    ref, _ = run(reference, path, prompts, params, **kw)
    opt, _ = run(optimized, path, prompts, params, **kw)
    problems = []
    for i, (a, b) in enumerate(zip(ref, opt, strict=True)):
        ca, cb = a.outputs[0], b.outputs[0]
        assert len(ca.token_ids) == len(cb.token_ids) == 24
        assert len(ca.logprobs) == len(cb.logprobs) == 24
        assert all(len(d) >= TOP for d in ca.logprobs + cb.logprobs)
        problem = first_difference_is_close(ca.token_ids, cb.token_ids, ca.logprobs,
                                            cb.logprobs)
        if problem:
            problems.append(f"prompt {i}: {problem}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_and_eager_give_the_same_tokens(checkpoints, family):
    """10 requests of different lengths, max_num_seqs 12: the first decode steps (10 rows) are
    above the largest captured size (8) and run eagerly, then the batch shrinks through the
    captured sizes 8, 4, 2 and 1 (padded up to them) as requests finish."""
    path = checkpoints[family]
    kw = dict(block_size=8, num_gpu_blocks=160, max_num_seqs=12)
    prompts = make_prompts(257, lengths=(3, 11, 1, 27, 8, 19, 33, 5, 14, 2), seed=7)
    params = mixed_params(len(prompts), max_tokens=(5, 40, 9, 26, 3, 33, 17, 12, 21, 30))
    graphs, graph_llm = run(optimized, path, prompts, params, **kw)
    eager, eager_llm = run(optimized, path, prompts, params, enforce_eager=True, **kw)
    assert tokens(graphs) == tokens(eager)
    captured = set(graph_llm.engine.runner.whole_step.graphs)
    assert captured and captured <= set(GRAPH_BATCH_SIZES) and max(captured) <= 12
    assert len(captured) >= 3  # 8, 4, 2, 1 as the batch shrinks
    assert eager_llm.engine.runner.whole_step is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_prefix_caching(checkpoints, family, preemption_mode):
    """A pool of 14 blocks of 4 tokens for 5 requests of 17 to 21 prompt tokens and 10 new
    ones: requests are preempted; prompts come in chunks of at most 12 tokens; the 16 shared
    tokens are found in the prefix cache. The tokens are those of a roomy run."""
    path = checkpoints[family]
    shared = list(range(3, 19))  # 16 tokens: 4 whole blocks shared by every prompt
    prompts = [{"prompt_token_ids": shared + [20 + i] * (1 + i)} for i in range(5)]
    params = [reference.SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=10,
                                       ignore_eos=True) for i in range(5)]
    roomy, _ = run(optimized, path, prompts, params, block_size=4, num_gpu_blocks=64)
    roomy_ref, _ = run(reference, path, prompts, params, block_size=4, num_gpu_blocks=64)
    assert tokens(roomy) == tokens(roomy_ref)
    swap = dict(swap_space_blocks=64) if preemption_mode == "swap" else {}
    tight, llm = run(optimized, path, prompts, params, block_size=4, num_gpu_blocks=14,
                     enable_prefix_caching=True, enable_chunked_prefill=True,
                     max_num_batched_tokens=12, preemption_mode=preemption_mode, **swap)
    assert tokens(tight) == tokens(roomy)
    stats = llm.stats()
    if preemption_mode == "swap":
        assert stats["preemptions_swap"] > 0 and stats["swap_ins"] > 0
        assert all(t.is_pinned() for t in llm.engine.cache_engine.cpu_k)  # async-capable
    else:
        assert stats["preemptions_recompute"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0


def test_gpu_memory_utilization_sizes_the_pool(checkpoints):
    """No num_gpu_blocks and no kv_cache_memory: the pool is what `utilization` of the GPU's
    memory leaves after the weights and a profiled step. It holds blocks, not more than that
    share of the memory, and the engine generates the reference's tokens on it."""
    path = checkpoints["llama3"]
    utilization = 0.25
    gc.collect()
    torch.cuda.empty_cache()
    prompts = make_prompts(257)
    params = mixed_params(len(prompts))
    outs, llm = run(optimized, path, prompts, params, gpu_memory_utilization=utilization)
    blocks = llm.stats()["blocks_total"]
    assert blocks > 0
    cache = llm.engine.cache_engine
    assert all(t.shape[0] == blocks and t.is_cuda for t in cache.gpu_k + cache.gpu_v)
    pool_bytes = sum(t.numel() * t.element_size() for t in cache.gpu_k + cache.gpu_v)
    assert pool_bytes <= utilization * torch.cuda.get_device_properties(0).total_memory
    del llm
    ref, _ = run(reference, path, prompts, params, block_size=16, num_gpu_blocks=64)
    assert tokens(outs) == tokens(ref)


def test_gpu_memory_utilization_sizes_an_opt_pool(checkpoints):
    """OPT's positions are learned, max_position_embeddings of them (256 in the tiny config):
    the profiling step must not run positions past them, though the step's token budget
    (max_num_batched_tokens, 2048 by default) is larger. In a subprocess: an out-of-range
    position is a device-side assert, which would end every later CUDA test of this process."""
    tiers = Path(optimized.__file__).resolve().parents[1]  # the folder holding optimized/
    code = ("import sys, pagedllm; pagedllm.__path__.append(sys.argv[1]); "
            "import pagedllm.optimized as o; "
            "llm = o.LLM(sys.argv[2], device='cuda', gpu_memory_utilization=0.1); "
            "print(llm.stats()['blocks_total'])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tiers), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    done = subprocess.run([sys.executable, "-c", code, str(tiers), str(checkpoints["opt"])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0


def test_given_sizes_are_not_profiled(checkpoints):
    llm = optimized.LLM(checkpoints["llama3"], device=DEVICE, num_gpu_blocks=37)
    assert llm.stats()["blocks_total"] == 37


@pytest.mark.parametrize("utilization", [1e-4, 1e-9])
def test_an_absurdly_low_utilization_is_refused(checkpoints, utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        optimized.LLM(checkpoints["llama3"], device=DEVICE, gpu_memory_utilization=utilization)


@pytest.mark.parametrize("utilization", [0.0, 1.5, -0.1])
def test_a_utilization_outside_0_1_is_refused(checkpoints, utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        optimized.LLM(checkpoints["llama3"], device=DEVICE, gpu_memory_utilization=utilization)


def test_swap_blocks_copies_blocks_asynchronously_to_and_from_pinned_memory():
    """The optimized swap queues one copy per block; after the stream is synchronized, both
    directions hold what the reference's swap_blocks gives."""
    from pagedllm.optimized.backend import swap_blocks
    from pagedllm.reference.ops import swap_blocks as swap_blocks_reference

    shape = (12, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
    gpu = torch.randn(shape, device=DEVICE)
    pinned = torch.zeros(shape, pin_memory=True)
    expected = torch.zeros(shape)
    out_pairs = torch.tensor([[3, 0], [7, 5], [11, 1]])  # (gpu block, cpu block)
    swap_blocks(gpu, pinned, out_pairs)
    swap_blocks_reference(gpu, expected, out_pairs)
    torch.cuda.synchronize()
    assert torch.equal(pinned, expected)
    back = torch.zeros(shape, device=DEVICE)
    in_pairs = torch.tensor([[5, 2], [0, 9]])  # (cpu block, gpu block)
    swap_blocks(pinned, back, in_pairs)
    torch.cuda.synchronize()
    assert torch.equal(back[2], gpu[7]) and torch.equal(back[9], gpu[3])
    assert not back[[0, 1, 3, 4, 5, 6, 7, 8, 10, 11]].any()
