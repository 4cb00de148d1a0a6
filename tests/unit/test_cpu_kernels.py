"""The optimized tier's own CPU kernels (``optimized/csrc/cpu_ops.cpp``) against the twins:
paged decode attention against the reference's definition, RMSNorm, the K/V write and rotary
against the twins' results. (The matrix products are held to the twin in
``tests/engine/test_weight_quant.py``.)

They run where the CPU has AVX-512 BF16 (this project's machines do); elsewhere they skip, and
the tier uses the torch path these tests also cover.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.optimized.attention import rotary_tables, rotate_half
from pagedllm.kernels.cpu_ops import cpu_kernels, rotary_with_tables
from pagedllm.kernels.cpu_ops import rms_norm as cpu_rms_norm
from pagedllm.kernels.cpu_ops import store_kv as cpu_store_kv
from pagedllm.reference.ops import paged_attention, rms_norm, store_kv

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no AVX-512 BF16, or no build")

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 6, 2, 64, 4, 32


def poisoned_pool(seq_lens, seed=0):
    """bf16 K/V pools whose every slot outside the sequences is NaN, and scattered tables."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    v = k.clone()
    order = torch.randperm(BLOCKS, generator=g).tolist()
    tables = []
    for n in seq_lens:
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        for t in range(n):
            b, o = blocks[t // BLOCK], t % BLOCK
            k[b, o] = torch.randn(KV_HEADS, HEAD_DIM, generator=g).bfloat16()
            v[b, o] = torch.randn(KV_HEADS, HEAD_DIM, generator=g).bfloat16()
        tables.append(blocks)
    width = max(map(len, tables))
    # padding entries point at block 0, which may belong to another sequence: never read
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, table


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seq_lens", [[1], [1, 4, 5, 13, 9], [17, 2]])
def test_decode_attention_reads_the_blocks_in_place_as_the_definition(seq_lens, window):
    """One query per sequence: a single token, exactly one block, one past, several."""
    k, v, table = poisoned_pool(seq_lens)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM).bfloat16()
    lens = torch.tensor(seq_lens)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    want = paged_attention(q.float(), k.float(), v.float(), table, lens, starts, 0.125,
                           window)  # [S, heads, hd] float32
    got = kernels.paged_decode_attention(q, k, v, table, lens, 0.125, window or 0)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    # float32 sums in another order, rounded once to bf16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 1, 32), (5, 5, 64), (9, 3, 64)])
def test_decode_attention_for_any_query_heads_a_kv_head(heads, kv_heads, head_dim):
    """The kernel runs a KV head and its query heads together (four at a time) and sums 16
    keys' scores at once: group sizes 8 (two fours), 1 and 3, lengths around 16 and 32."""
    g = torch.Generator().manual_seed(1)
    seq_lens = [15, 16, 17, 33, 1]
    k = torch.randn(48, BLOCK, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(48, BLOCK, kv_heads, head_dim, generator=g).bfloat16()
    table = torch.randperm(48, generator=g)[:5 * 9].view(5, 9).int()
    q = torch.randn(5, heads, head_dim, generator=g).bfloat16()
    lens, starts = torch.tensor(seq_lens), torch.arange(6, dtype=torch.int32)
    want = paged_attention(q.float(), k.float(), v.float(), table, lens, starts, 0.125, None)
    got = kernels.paged_decode_attention(q, k, v, table, lens, 0.125, 0)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("position", [3, 16])  # in a full chunk of 16 keys, in the last one
def test_a_non_finite_key_gives_its_heads_nan_as_the_definition_does(bad, position):
    k, v, table = poisoned_pool([20])
    q = torch.randn(1, HEADS, HEAD_DIM).bfloat16()
    block, offset = table[0, position // BLOCK], position % BLOCK
    k[block, offset, 1, 5] = bad  # KV head 1: query heads 3, 4, 5 read it
    lens, starts = torch.tensor([20]), torch.arange(2, dtype=torch.int32)
    want = paged_attention(q.float(), k.float(), v.float(), table, lens, starts, 0.125, None)
    got = kernels.paged_decode_attention(q, k, v, table, lens, 0.125, 0)
    # a NaN key, or an infinite score (+inf - inf in the softmax), is NaN for its heads; a
    # score of -inf is a key of weight 0, as the definition makes it
    assert torch.equal(got.isnan(), want.isnan()) and not got[0, :3].isnan().any()
    if bad != bad:  # NaN
        assert got[0, 3:].isnan().all()
    torch.testing.assert_close(got.float().nan_to_num(), want.nan_to_num(), rtol=2**-7,
                               atol=2**-7)


def test_decode_attention_refuses_a_length_or_block_outside_the_cache():
    k, v, table = poisoned_pool([5])  # two blocks: eight positions
    q = torch.randn(1, HEADS, HEAD_DIM).bfloat16()
    with pytest.raises(RuntimeError, match="has length 9; its block table holds 8"):
        kernels.paged_decode_attention(q, k, v, table, torch.tensor([9]), 0.125, 0)
    table[0, 1] = BLOCKS  # one past the pool
    with pytest.raises(RuntimeError, match=f"names block {BLOCKS} of {BLOCKS}"):
        kernels.paged_decode_attention(q, k, v, table, torch.tensor([5]), 0.125, 0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), hidden=st.sampled_from([16, 64, 576]),
       scale=st.floats(1e-3, 1e3), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_makes_the_twins_roundings(rows, hidden, scale, residual, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * scale).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    r = (torch.randn(rows, hidden, generator=g) * scale).bfloat16() if residual else None
    normed, new_residual = cpu_rms_norm(x, w, 1e-5, r)
    want_normed, want_residual = rms_norm(x, w, 1e-5, r)
    assert torch.equal(new_residual, want_residual)
    # the same roundings; the float32 sum of squares may end in another last bit, which
    # moves an output by at most one bf16 step
    torch.testing.assert_close(normed.float(), want_normed.float(), rtol=2**-7, atol=0)


def merged_views(tokens, seed=0):
    """K and V as the merged QKV product's views: rows of another stride, heads contiguous."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).bfloat16()
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return (q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM),
            v.view(tokens, KV_HEADS, HEAD_DIM))


def test_store_kv_writes_what_the_twin_writes_and_skips_padding():
    _, k, v = merged_views(5)
    slots = torch.tensor([7, -1, 0, 127, 12])  # a padding row, the first and the last slot
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
              for _ in range(4)]
    cpu_store_kv(k, v, caches[0], caches[1], slots)
    store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    before = caches[0].clone()
    with pytest.raises(RuntimeError, match="slot 128 is outside the cache's 128 slots"):
        cpu_store_kv(k, v, caches[0], caches[1], torch.tensor([20, 21, 22, 23, 128]))
    assert torch.equal(caches[0], before)  # refused whole, as the twin's indexing refuses


@pytest.mark.parametrize("tokens", [1, 7])
def test_rotary_is_rotate_half_bit_for_bit(tokens):
    q, k, _ = merged_views(tokens, seed=tokens)
    positions = torch.arange(100, 100 + tokens)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos, sin = rotary_tables(positions, inv_freq, torch.bfloat16)
    got_q, got_k = rotary_with_tables(q, k, cos, sin)
    assert torch.equal(got_q, rotate_half(q, cos, sin))
    assert torch.equal(got_k, rotate_half(k, cos, sin))
