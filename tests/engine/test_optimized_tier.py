"""The optimized tier against transformers and against the reference tier.

The engine-level suite (test_engine, test_beam_search, test_parallel_sampling, ...) already runs
over both tiers through the `tier` fixture. Here: the parity with transformers for every family,
logprobs against the reference, and the tier on the Triton kernels themselves (the interpreter)
under preemption, chunked prefill and prefix caching.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import pagedllm.optimized as optimized
import pagedllm.reference as reference
from pagedllm.optimized.layers import merge_projections
from pagedllm.reference import NoCache, load_model

from ..conftest import FAMILIES

LOGIT_TOL = 1e-4  # float32, as the reference's own parity test


def prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
            for n in (1, 7, 23, 40)]


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_model_logits_match_transformers(checkpoints, family):
    """The merged projections compute what transformers computes (40 tokens: past Mistral's
    window of 16)."""
    merged = merge_projections(load_model(checkpoints[family]))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    ids = prompts(merged.config.vocab_size)[3]["prompt_token_ids"]
    ids = torch.tensor(ids)
    with torch.no_grad():
        diff = (hf(ids[None]).logits[0] - merged(ids, torch.arange(len(ids)), NoCache())).abs()
    assert diff.max().item() <= LOGIT_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(checkpoints, family):
    path = checkpoints[family]
    llm = optimized.LLM(path, block_size=4, num_gpu_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    greedy = optimized.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts(llm.engine.vocab_size), greedy, use_tqdm=False)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                           do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want


def test_logprobs_match_the_reference(checkpoints):
    path = checkpoints["llama3"]
    params = [reference.SamplingParams(temperature=0.8, seed=4, max_tokens=8, logprobs=3,
                                       ignore_eos=True, n=2)]
    kw = dict(block_size=4, num_gpu_blocks=64)
    ref = reference.LLM(path, **kw).generate(prompts(257)[2], params, use_tqdm=False)[0]
    opt = optimized.LLM(path, **kw).generate(prompts(257)[2], params, use_tqdm=False)[0]
    for a, b in zip(ref.outputs, opt.outputs, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert max(abs(la[t] - lb[t]) for t in la) <= 1e-4


def test_the_baselines_are_refused_with_a_pointer_to_the_reference(checkpoints):
    with pytest.raises(ValueError, match=r"paged layout only.*pagedllm.reference.LLM"):
        optimized.LLM(checkpoints["llama"], kv_layout="contiguous")
    with pytest.raises(ValueError, match=r"continuous batching only.*pagedllm.reference.LLM"):
        optimized.LLM(checkpoints["llama"], batching="static")
    with pytest.raises(TypeError, match="enforce_eager must be True or False"):
        optimized.LLM(checkpoints["llama"], enforce_eager="yes")


def test_on_the_triton_kernels_under_the_interpreter(checkpoints, monkeypatch):
    """Every op a Triton kernel (interpreted), a pool small enough to preempt, chunked prefill
    and prefix caching on: the reference's tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = checkpoints["llama3"]  # 2 layers, GQA
    shared = list(range(3, 19))  # 16 tokens: whole blocks of 4 shared by every prompt
    many = [{"prompt_token_ids": shared + [20 + i] * (1 + i)} for i in range(5)]
    params = [reference.SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=10,
                                       ignore_eos=True) for i in range(5)]
    roomy = reference.LLM(path, block_size=4, num_gpu_blocks=64).generate(many, params,
                                                                         use_tqdm=False)
    llm = optimized.LLM(path, block_size=4, num_gpu_blocks=14, enable_prefix_caching=True,
                        enable_chunked_prefill=True, max_num_batched_tokens=12)
    got = llm.generate(many, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]
    stats = llm.stats()
    assert stats["preemptions_recompute"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["blocks_used"] == 0  # nothing leaked (cached blocks are free to evict)
