"""The compiled paged attention kernel on a GPU against its torch twin, at engine sizes.

The interpreter tests (tests/kernels/test_paged_attention_kernel.py) cover every feature at toy
sizes; here the same comparisons run at the sizes the interpreter cannot reach: head_dim 128,
32 query / 8 K/V heads, contexts up to 8192, batches of 64, in fp32, bf16 and fp16.

The truth is always the twin in fp32 on the same (already rounded) inputs. Tolerances, max abs
error on outputs whose entries are at most about 4.5 (weighted means of N(0, 1) values):
- fp32 2e-4: the kernel multiplies in true fp32 ("ieee", no tf32) and differs from the twin
  only in summation order and exp2 vs exp, a few 1e-7 relative per key; 2e-4 leaves room for
  8192-key sums.
- fp16 4e-3: the kernel rounds the probabilities to fp16 before P·V (relative 2^-11 each, as
  FlashAttention does) and the output once (|out| * 2^-11 <= 2.2e-3).
- bf16 2e-2: the same two roundings with 3 fewer mantissa bits (2^-8): the output's own
  rounding alone is up to 4.5 * 2^-9 = 8.8e-3.
"""

import pytest
import torch

from pagedllm.kernels.paged_attention import paged_attention
from pagedllm.reference.ops import paged_attention as twin

TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def make_batch(seed, block_size, head_dim, num_heads, num_kv_heads, seqs, dtype, pad_rows=4,
               spare_blocks=16, dev="cuda"):
    """Like the interpreter tests' make_batch, vectorised on the GPU: the sequences' K/V in
    shuffled blocks, every other slot (spare blocks, slots past seq_len, the block the padding
    table entries point at) NaN."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    poisoned = int(perm[-1])
    width = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seqs), width), poisoned, dtype=torch.int32, device=dev)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    used = 0
    for b, (_, seq_len) in enumerate(seqs):
        blocks = perm[used:used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, :len(blocks)] = blocks.int()
        pos = torch.arange(seq_len, device=dev)
        slots = blocks.long()[pos // block_size] * block_size + pos % block_size
        k_cache[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen,
                                     device=dev).to(dtype)
        v_cache[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen,
                                     device=dev).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(q_len for q_len, _ in seqs) + pad_rows
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=dev).to(dtype)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    return (q, k_cache.view(cache_shape), v_cache.view(cache_shape), block_tables,
            torch.tensor([s for _, s in seqs], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32))


def check(batch, window, dtype, **kwargs):
    """Launch on a NaN-poisoned output; compare with the twin in fp32 at the dtype's tolerance."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = batch
    scale = q.shape[-1] ** -0.5
    expected = twin(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens,
                    query_start_loc, scale, window)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          window, out=out, **kwargs)
    assert got is out and not got.isnan().any()
    err = (got.float() - expected).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err}"
    last = int(query_start_loc[-1])
    assert not got[last:].any(), "padding rows must be 0"


def decode_seqs(batch, max_context, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max_context // 2, max_context + 1, (batch,), generator=gen)
    lens[0] = max_context - 3  # mid-block
    return tuple((1, int(n)) for n in lens)


# decodes, a whole prompt, a chunk of a long prompt, a prefix-cache hit, contexts mid-block
MIXED = ((1, 8187), (2048, 2048), (1, 517), (512, 3001), (37, 4099), (1, 1), (300, 300))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_splits", [None, 1, 8], ids=["heuristic", "single", "split8"])
@pytest.mark.parametrize("context", [512, 8192])
def test_decode_batch_64(dtype, num_splits, context):
    batch = make_batch(context, 16, 128, 32, 8, decode_seqs(64, context, context), dtype)
    check(batch, None, dtype, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", [None, 1000])
@pytest.mark.parametrize("num_splits", [None, 4], ids=["heuristic", "split4"])
def test_mixed_batch(dtype, window, num_splits):
    batch = make_batch(1, 16, 128, 32, 8, MIXED, dtype)
    check(batch, window, dtype, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads", [
    (8, 80, 32, 32), (32, 96, 32, 4), (16, 128, 32, 1), (16, 64, 16, 2)])
def test_shapes(dtype, block_size, head_dim, num_heads, num_kv_heads):
    seqs = ((1, 3000), (700, 700), (1, 33), (128, 1500))
    batch = make_batch(head_dim + num_kv_heads, block_size, head_dim, num_heads, num_kv_heads,
                       seqs, dtype)
    check(batch, None, dtype)
    check(batch, 257, dtype, num_splits=3)


@pytest.mark.parametrize("block_m,tile_n", [(16, 16), (64, 32), (128, 128)])
def test_tile_sizes(block_m, tile_n):
    batch = make_batch(2, 16, 128, 32, 8, MIXED, torch.bfloat16)
    check(batch, None, torch.bfloat16, block_m=block_m, tile_n=tile_n)


def test_device_metadata_needs_no_host_sync():
    """seq_lens / query_start_loc already on the GPU: same output, and no synchronisation."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        3, 16, 128, 32, 8, decode_seqs(64, 2048, 3), torch.bfloat16)
    scale = 128 ** -0.5
    host = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    seq_lens_d, query_start_loc_d = seq_lens.cuda(), query_start_loc.cuda()
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens_d, query_start_loc_d, scale)
    torch.cuda.synchronize()  # compiled and warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        device = paged_attention(q, k_cache, v_cache, block_tables, seq_lens_d,
                                 query_start_loc_d, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Device metadata uses bounds (longest context = table width * block size), so the split
    # count may differ from the host path: equal up to summation order.
    assert (device.float() - host.float()).abs().max().item() < TOLERANCE[torch.bfloat16]
