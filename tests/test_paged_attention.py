"""Paged KV storage and paged attention compute exactly what dense attention computes.

Unused slots of the pool are filled with NaN: a read past a sequence's length, or through a
wrong block, puts NaN into the output and fails the comparison.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.reference import ContiguousCache, load_model
from pagedllm.reference.attention import causal_attention
from pagedllm.reference.block_manager import BlockSpaceManager
from pagedllm.reference.generate import generate_many
from pagedllm.reference.kv_storage import KVStorage, SequenceKV, swap_blocks
from pagedllm.reference.paged_attention import paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def filled_pool(seq_lens, num_blocks=24, sliding_window=None):
    """A NaN-poisoned pool holding random K/V for sequences of the given lengths, interleaved."""
    manager = BlockSpaceManager(BLOCK, num_blocks)
    storage = KVStorage(1, num_blocks * BLOCK, KV_HEADS, HEAD_DIM, BLOCK)
    storage.fill_(float("nan"))
    dense = []
    for seq_id in range(len(seq_lens)):
        manager.allocate(seq_id, 1)
    for _ in range(max(seq_lens) - 1):  # grow round-robin, so blocks of sequences interleave
        for seq_id, n in enumerate(seq_lens):
            if manager.num_tokens(seq_id) < n:
                manager.append_slot(seq_id)
    for seq_id, n in enumerate(seq_lens):
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
        storage.write(0, torch.tensor(manager.slot_mapping(seq_id, range(n))), k, v)
        dense.append((k, v))
    return manager, storage, dense


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(window):
    seq_lens = [1, 4, 5, 13, 9]  # a single token, exactly one block, one past, several blocks
    manager, storage, dense = filled_pool(seq_lens)
    table = manager.block_table(3)
    assert table != list(range(table[0], table[0] + len(table)))  # scattered, not contiguous
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM)
    got = paged_attention(q, storage.k[0], storage.v[0],
                          [manager.block_table(i) for i in range(len(seq_lens))], seq_lens,
                          HEAD_DIM**-0.5, window)
    for b, (n, (k, v)) in enumerate(zip(seq_lens, dense, strict=True)):
        pos = torch.arange(n)
        want = causal_attention(q[b: b + 1], k, v, pos[-1:], pos, HEAD_DIM**-0.5, window)
        torch.testing.assert_close(got[b: b + 1], want, atol=1e-6, rtol=1e-5)
    assert not torch.isnan(got).any()


def test_reading_past_the_length_is_caught_by_the_poison():
    manager, storage, _ = filled_pool([6])
    q = torch.randn(1, HEADS, HEAD_DIM)
    out = paged_attention(q, storage.k[0], storage.v[0], [manager.block_table(0)], [7], 1.0)
    assert torch.isnan(out).all()  # slot 7 was never written: the poison shows


def test_copy_blocks_and_swap_move_every_layer():
    storage = KVStorage(2, 4 * BLOCK, KV_HEADS, HEAD_DIM, BLOCK)
    for layer in range(2):
        storage.k[layer].normal_()
        storage.v[layer].normal_()
    storage.copy_blocks([(1, 3)])
    for cache in (*storage.k, *storage.v):
        assert torch.equal(cache[3], cache[1])
    cpu = KVStorage(2, 2 * BLOCK, KV_HEADS, HEAD_DIM, BLOCK)
    swap_blocks(storage, cpu, [(2, 0)])
    for gpu_cache, cpu_cache in zip((*storage.k, *storage.v), (*cpu.k, *cpu.v), strict=True):
        assert torch.equal(cpu_cache[0], gpu_cache[2])


def test_sequence_view_feeds_the_model(checkpoints):
    """A model step through SequenceKV equals one through the per-sequence cache."""
    model = load_model(checkpoints["llama3"])
    cfg = model.config
    manager = BlockSpaceManager(BLOCK, 16)
    storage = KVStorage(cfg.num_layers, 16 * BLOCK, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    storage.fill_(float("nan"))
    manager.allocate(0, 3)  # another sequence's blocks first, so ours are not at block 0
    manager.allocate(1, 10)
    view = SequenceKV(storage, lambda pos: manager.slot_mapping(1, pos))
    ids = torch.randint(0, cfg.vocab_size, (11,))
    with torch.no_grad():
        model(ids[:10], torch.arange(10), view)
        manager.append_slot(1)
        step = model(ids[10:], torch.arange(10, 11), view)[-1]
        cache = ContiguousCache(cfg.num_layers, 11, cfg.num_kv_heads, cfg.head_dim)
        full = model(ids, torch.arange(11), cache)[-1]
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
