"""Parallel sampling (n > 1): one prefill, n samples sharing the prompt's blocks, each with its
own generator; the same tokens whatever the batch or the memory pressure."""

import pytest
import torch

from ..conftest import baseline_refusal

PROMPT = {"prompt_token_ids": list(range(40, 63))}  # 23 tokens: the last block is partly full


def samples(tier, llm, params, others=()):
    """The n > 1 request arrives last, so it is the first to be preempted under pressure."""
    outs = llm.generate([*others, PROMPT], [tier.SamplingParams(
        temperature=0.9, seed=50 + i, max_tokens=10, ignore_eos=True) for i in range(len(others))]
        + [params], use_tqdm=False)
    assert llm.stats()["blocks_used"] == 0
    return [c.token_ids for c in sorted(outs[-1].outputs, key=lambda c: c.index)]


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["llama3"]


@pytest.fixture(scope="module")
def params(tier):
    """Four samples of one prompt."""
    return tier.SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=7, max_tokens=14,
                               ignore_eos=True)


def test_sample_i_equals_a_single_request_with_seed_plus_i(tier, path, params):
    llm = tier.LLM(path, block_size=4)
    got = samples(tier, llm, params)
    assert len(got) == 4 and len({tuple(t) for t in got}) > 1  # the samples differ
    for i, tokens in enumerate(got):
        single = tier.SamplingParams(temperature=1.0, top_p=0.95, seed=7 + i, max_tokens=14,
                                     ignore_eos=True)
        assert samples(tier, llm, single) == [tokens]
    stats = llm.stats()
    assert stats["cow_copies"] >= 3  # children copied the shared, partly filled last block


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(num_gpu_blocks=44, block_size=4),  # forces recompute preemption of forked groups
    dict(num_gpu_blocks=44, block_size=4, preemption_mode="swap", swap_space_blocks=64),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4),
])
def test_parallel_samples_do_not_depend_on_the_batch_or_memory(tier, path, params,
                                                               engine_args):
    alone = samples(tier, tier.LLM(path, block_size=4), params)
    others = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (30, 12, 25, 7)]
    llm = tier.LLM(path, **engine_args)
    assert samples(tier, llm, params, others) == alone
    if "num_gpu_blocks" in engine_args:
        stats = llm.stats()
        assert stats["preemptions_recompute"] + stats["preemptions_swap"] > 0


def test_prompt_is_prefilled_once(tier, path, params):
    llm = tier.LLM(path, block_size=4)
    samples(tier, llm, params)
    assert llm.stats()["prefill_tokens"] == 23  # not 4 x 23


def test_n_too_large_for_the_pool_is_refused(tier, path):
    llm = tier.LLM(path, block_size=4, num_gpu_blocks=40)
    with pytest.raises(ValueError, match="could never finish; lower n"):
        llm.generate(PROMPT, tier.SamplingParams(n=8, max_tokens=20), use_tqdm=False)
    assert llm.generate(PROMPT, tier.SamplingParams(n=2, max_tokens=5),
                        use_tqdm=False)[0].finished
    with pytest.raises(ValueError, match=baseline_refusal(tier, "needs kv_layout='paged'")):
        tier.LLM(path, kv_layout="contiguous").generate(PROMPT, tier.SamplingParams(n=2),
                                                        use_tqdm=False)


def test_greedy_samples_are_identical(tier, path):
    llm = tier.LLM(path)
    got = samples(tier, llm, tier.SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
    assert got[0] == got[1] == got[2]
    assert torch.tensor(got).shape == (3, 8)


def test_max_num_seqs_counts_samples_not_requests(tier, path):
    llm = tier.LLM(path, block_size=4, max_num_seqs=4)
    engine = llm.engine
    for r in ("a", "b"):
        engine.add_request(r, PROMPT, tier.SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, sum(len(g.unfinished_seqs()) for g in engine.scheduler.running))
    assert most == 3  # the second request's 3 samples wait: 6 would exceed max_num_seqs


def test_the_last_sharer_writes_in_place(path):
    """Three samples share a partly filled last block and 2 blocks are free: the first two
    writers copy it, the third owns it by then, so the group fits without preemption.
    (A unit test of the reference KV bookkeeping, not of an engine: it runs once.)"""
    from pagedllm.reference.engine.sampling_params import SamplingParams
    from pagedllm.reference.engine.sequence import Sequence, SequenceGroup
    from pagedllm.reference.kv import PagedKVCacheManager

    kv = PagedKVCacheManager(block_size=4, num_gpu_blocks=5)
    seqs = [Sequence(i, list(range(10)), [1]) for i in range(3)]  # 10 tokens + 1 new each
    group = SequenceGroup("r", seqs, SamplingParams(n=3), arrival=0, seed=0)
    kv.manager.allocate(0, 10)  # 3 blocks, the last holding 2 of 4
    kv.fork(seqs[0], seqs[1])
    kv.fork(seqs[0], seqs[2])
    for seq in seqs:
        seq.num_computed_tokens = 10
    assert kv.num_free_blocks == 2 and kv.can_allocate_slots(group, num_new_tokens=1)
    for seq in seqs:
        kv.allocate_slots(seq, num_new_tokens=1)
    assert kv.num_cow_copies == 2 and kv.num_free_blocks == 0
