"""The step's ops compute exactly what dense attention computes, on any query shape.

Unused slots of the pool are filled with NaN: a read past a sequence's length, or through a
wrong block, puts NaN into the output and fails the comparison.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from pagedllm.optimized.attention import attend, cpu_paged_attention, plan_attention
from pagedllm.optimized.backend import CPU_BACKEND
from pagedllm.reference import ContiguousCache, load_model
from pagedllm.reference.engine.generate import generate_many
from pagedllm.reference.kv import BlockSpaceManager, CacheEngine
from pagedllm.reference.model import AttentionMetadata, PagedAttention
from pagedllm.reference.ops import REFERENCE_BACKEND, causal_attention, paged_attention, store_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def filled_pool(seq_lens, num_blocks=24):
    """A NaN-poisoned pool holding random K/V for sequences of the given lengths, interleaved."""
    manager = BlockSpaceManager(BLOCK, num_blocks)
    cache = CacheEngine(1, KV_HEADS, HEAD_DIM, BLOCK, num_blocks)
    cache.fill_(float("nan"))
    dense = []
    for seq_id in range(len(seq_lens)):
        manager.allocate(seq_id, 1)
    for _ in range(max(seq_lens) - 1):  # grow round-robin, so blocks of sequences interleave
        for seq_id, n in enumerate(seq_lens):
            if manager.num_tokens(seq_id) < n:
                manager.append_slot(seq_id)
    for seq_id, n in enumerate(seq_lens):
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
        store_kv(k, v, cache.gpu_k[0], cache.gpu_v[0],
                 torch.tensor(manager.slot_mapping(seq_id, range(n))))
        dense.append((k, v))
    return manager, cache, dense


def tables(manager, n, pad: int = 0):
    width = max(len(manager.block_table(i)) for i in range(n))
    return torch.tensor([manager.block_table(i) + [pad] * (width - len(manager.block_table(i)))
                         for i in range(n)], dtype=torch.int32)


@pytest.mark.parametrize("attention", [paged_attention, cpu_paged_attention],
                         ids=["reference", "optimized-cpu"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1, 1], [1, 4, 2, 13, 1], [1, 3, 5, 7, 9]])
def test_paged_attention_matches_dense_for_every_query_shape(window, query_lens, attention):
    """Decodes (1 query), chunks and whole prompts (up to seq_len queries), mixed in one batch:
    the reference's definition, and the optimized tier's vectorized CPU path."""
    seq_lens = [1, 4, 5, 13, 9]  # a single token, exactly one block, one past, several blocks
    manager, cache, dense = filled_pool(seq_lens)
    table = manager.block_table(3)
    assert table != list(range(table[0], table[0] + len(table)))  # scattered, not contiguous
    query_lens = [min(q, n) for q, n in zip(query_lens, seq_lens, strict=True)]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), HEADS, HEAD_DIM)
    got = attention(q, cache.gpu_k[0], cache.gpu_v[0], tables(manager, len(seq_lens)),
                          torch.tensor(seq_lens, dtype=torch.int32), starts, HEAD_DIM**-0.5,
                          window)
    for b, (n, (k, v)) in enumerate(zip(seq_lens, dense, strict=True)):
        pos = torch.arange(n)
        rows = slice(int(starts[b]), int(starts[b + 1]))
        want = causal_attention(q[rows], k, v, pos[n - query_lens[b]:], pos, HEAD_DIM**-0.5,
                                window)
        torch.testing.assert_close(got[rows], want, atol=1e-6, rtol=1e-5)
    assert not torch.isnan(got).any()


def test_reading_past_the_length_is_caught_by_the_poison():
    manager, cache, _ = filled_pool([6])
    q = torch.randn(1, HEADS, HEAD_DIM)
    out = paged_attention(q, cache.gpu_k[0], cache.gpu_v[0], tables(manager, 1),
                          torch.tensor([7]), torch.tensor([0, 1]), 1.0)
    assert torch.isnan(out).all()  # slot 7 was never written: the poison shows


def test_store_kv_skips_padding_slots():
    cache = CacheEngine(1, KV_HEADS, HEAD_DIM, BLOCK, 2)
    cache.fill_(float("nan"))
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    store_kv(k, v, cache.gpu_k[0], cache.gpu_v[0], torch.tensor([5, -1, 2]))
    flat = cache.gpu_k[0].view(-1, KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[2], k[2])
    assert torch.isnan(flat[[0, 1, 3, 4, 6, 7]]).all()  # -1 wrote nowhere, not to the last slot


@pytest.mark.parametrize("backend", [REFERENCE_BACKEND, CPU_BACKEND],
                         ids=["reference", "optimized"])
def test_cache_engine_swaps_out_in_and_copies_every_layer(backend):
    cache = CacheEngine(2, KV_HEADS, HEAD_DIM, BLOCK, 4, num_cpu_blocks=2, backend=backend)
    for t in (*cache.gpu_k, *cache.gpu_v):
        t.normal_()
    before = [t.clone() for t in (*cache.gpu_k, *cache.gpu_v)]
    cache.apply(blocks_to_swap_out=[(2, 0)], blocks_to_swap_in=[], blocks_to_copy=[(1, 3)])
    for now, then, cpu in zip((*cache.gpu_k, *cache.gpu_v), before,
                              (*cache.cpu_k, *cache.cpu_v), strict=True):
        assert torch.equal(cpu[0], then[2]) and torch.equal(now[3], then[1])
    cache.apply(blocks_to_swap_out=[], blocks_to_swap_in=[(0, 0)], blocks_to_copy=[])
    for now, then in zip((*cache.gpu_k, *cache.gpu_v), before, strict=True):
        assert torch.equal(now[0], then[2])


def test_paged_context_feeds_the_model(checkpoints):
    """A prefill then a decode through the paged context equal one per-sequence pass."""
    model = load_model(checkpoints["llama3"])
    cfg = model.config
    manager = BlockSpaceManager(BLOCK, 16)
    cache = CacheEngine(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, 16)
    cache.fill_(float("nan"))
    manager.allocate(0, 3)  # another sequence's blocks first, so ours are not at block 0
    manager.allocate(1, 10)
    ids = torch.randint(0, cfg.vocab_size, (11,))

    def context(start, end):
        blocks = manager.block_table(1)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(manager.slot_mapping(1, range(start, end))),
            block_tables=torch.tensor([blocks], dtype=torch.int32),
            seq_lens=torch.tensor([end]), query_start_loc=torch.tensor([0, end - start]),
            seq_lens_cpu=torch.tensor([end]), query_start_loc_cpu=torch.tensor([0, end - start]))
        return PagedAttention(md, cache.gpu_k, cache.gpu_v)

    with torch.no_grad():
        model(ids[:10], torch.arange(10), context(0, 10))
        manager.append_slot(1)
        step = model(ids[10:], torch.arange(10, 11), context(10, 11))[-1]
        full = model(ids, torch.arange(11), ContiguousCache(cfg.num_layers, 11, cfg.num_kv_heads,
                                                            cfg.head_dim))[-1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["mistral", "opt"])
def test_paged_slabs_per_sequence_and_transformers_agree_on_a_batch(checkpoints, family):
    model = load_model(checkpoints[family])
    prompts = [[7, 8, 9], list(range(20, 45)), list(range(60, 77)), [3] * 9]
    new = 20
    paged = generate_many(model, prompts, new, kv_layout="paged", block_size=4)
    per_seq = generate_many(model, prompts, new, kv_layout="per-sequence")
    slabs = generate_many(model, prompts, new, kv_layout="slabs", policy="pow2")
    assert paged == per_seq == slabs
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, ours in zip(prompts, paged, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           do_sample=False)[0, len(prompt):].tolist()
        assert ours == want


def test_a_small_pool_is_refused_clearly(checkpoints):
    model = load_model(checkpoints["llama"])
    with pytest.raises(ValueError, match="more than the whole pool"):
        generate_many(model, [list(range(40))], 4, kv_layout="paged", block_size=4,
                      num_blocks=5)
    with pytest.raises(ValueError, match="kv_layout 'banana' is unknown"):
        generate_many(model, [[1]], 1, kv_layout="banana")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), window=st.sampled_from([None, 1, 3, 9]), pad=st.sampled_from([0, -1, 39]))
def test_the_optimized_cpu_plan_matches_the_reference_op(data, window, pad):
    """Random mixes of decodes (spread over several length buckets), chunks and whole prompts,
    block tables padded with block 0, with -1 or with another sequence's block: the optimized
    tier's CPU path equals the reference op, on a NaN-poisoned pool, and one step's plans serve
    a second layer's caches as they serve the first's."""
    seq_lens = data.draw(st.lists(st.integers(1, 23), min_size=1, max_size=6), label="seq_lens")
    query_lens = [data.draw(st.sampled_from([1, 1, n, max(1, n // 2)]), label="q_len")
                  for n in seq_lens]
    manager, cache, _ = filled_pool(seq_lens, num_blocks=40)
    _, second, _ = filled_pool(seq_lens, num_blocks=40)  # another layer: same tables, new K/V
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    table = tables(manager, len(seq_lens))
    padded = tables(manager, len(seq_lens), pad)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(int(starts[-1]), HEADS, HEAD_DIM)
    plan = plan_attention(padded, lens, starts, cache.gpu_k[0].shape[1], window)  # once a step
    for layer in (cache, second):
        want = paged_attention(q, layer.gpu_k[0], layer.gpu_v[0], table, lens, starts, 0.5,
                               window)
        got = attend(plan, q, layer.gpu_k[0], layer.gpu_v[0], 0.5)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert not torch.isnan(got).any()
