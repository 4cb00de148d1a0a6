"""The optimized tier's own CPU kernels (``kernels/cpu/*.cpp``) against the twins: paged
decode attention against the reference's definition, RMSNorm, the K/V write and rotary against
the twins' results. (The matrix products are held to the twin in
``tests/engine/test_weight_quant.py``.)

Every test runs on every instruction-set path this machine has (``use_isa``: AVX-512, AVX2,
the portable scalar code; a path the CPU lacks runs its best below) and in bf16 and float32.
They skip only where the kernels did not build.
"""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedllm.kernels.cpu_ops import ISAS, cpu_extension, cpu_kernels, rotary_with_tables, use_isa
from pagedllm.kernels.cpu_ops import rms_norm as cpu_rms_norm
from pagedllm.kernels.cpu_ops import store_kv as cpu_store_kv
from pagedllm.optimized.attention import rotary_tables, rotate_half
from pagedllm.reference.ops import paged_attention, rms_norm, store_kv

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build")

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 6, 2, 64, 4, 32
DTYPES = [torch.bfloat16, torch.float32]
# the decode attention's tolerance: float32 sums in another order, rounded once to the dtype
CLOSE = {torch.bfloat16: dict(rtol=2**-7, atol=2**-7), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(params=ISAS)
def path(request):
    """Runs the test on one instruction-set path: the one asked where the machine has it,
    else the machine's best (the dispatcher's choice)."""
    machine = cpu_extension().machine_isa()
    want = request.param if ISAS.index(request.param) >= ISAS.index(machine) else machine
    with use_isa(request.param) as taken:
        assert taken == want
        yield taken


@pytest.fixture(params=DTYPES, ids=["bf16", "fp32"])
def dtype(request):
    return request.param


def poisoned_pool(seq_lens, dtype=torch.bfloat16, seed=0):
    """K/V pools whose every slot outside the sequences is NaN, and scattered tables."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    v = k.clone()
    order = torch.randperm(BLOCKS, generator=g).tolist()
    tables = []
    for n in seq_lens:
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        for t in range(n):
            b, o = blocks[t // BLOCK], t % BLOCK
            k[b, o] = torch.randn(KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            v[b, o] = torch.randn(KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        tables.append(blocks)
    width = max(map(len, tables))
    # padding entries point at block 0, which may belong to another sequence: never read
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, table


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seq_lens", [[1], [1, 4, 5, 13, 9], [17, 2]])
def test_decode_attention_reads_the_blocks_in_place_as_the_definition(seq_lens, window, path,
                                                                       dtype):
    """One query per sequence: a single token, exactly one block, one past, several."""
    k, v, table = poisoned_pool(seq_lens, dtype)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM).to(dtype)
    lens = torch.tensor(seq_lens)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    want = paged_attention(q.float(), k.float(), v.float(), table, lens, starts, 0.125,
                           window)  # [S, heads, hd] float32
    got = kernels.paged_decode_attention(q, k, v, table, lens, 0.125, window or 0)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, **CLOSE[dtype])


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 1, 32), (5, 5, 64), (9, 3, 64)])
def test_decode_attention_for_any_query_heads_a_kv_head(heads, kv_heads, head_dim, path, dtype):
    """The kernel runs a KV head and its query heads together (AVX-512: four at a time, AVX2:
    two) and sums 16 (AVX2: 8) keys' scores at once: group sizes 8, 1 and 3, lengths around
    8, 16 and 32."""
    g = torch.Generator().manual_seed(1)
    seq_lens = [15, 16, 17, 33, 1, 7, 8, 9]
    k = torch.randn(48, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(48, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    # each sequence's nine blocks scattered over the pool (sequences may share blocks: reads)
    table = torch.stack([torch.randperm(48, generator=g)[:9] for _ in seq_lens]).int()
    q = torch.randn(8, heads, head_dim, generator=g).to(dtype)
    lens, starts = torch.tensor(seq_lens), torch.arange(9, dtype=torch.int32)
    want = paged_attention(q.float(), k.float(), v.float(), table, lens, starts, 0.125, None)
    got = kernels.paged_decode_attention(q, k, v, table, lens, 0.125, 0)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **CLOSE[dtype])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("position", [3, 16])  # in a full chunk of 16 keys, in the last one
def test_a_non_finite_key_gives_its_heads_nan_as_the_definition_does(bad, position, path,
                                                                       dtype):
    k, v, table = poisoned_pool([20], dtype)
    q = torch.randn(1, HEADS, HEAD_DIM).to(dtype)
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
    torch.testing.assert_close(got.float().nan_to_num(), want.nan_to_num(), **CLOSE[dtype])


def test_decode_attention_refuses_a_length_or_block_outside_the_cache(path, dtype):
    k, v, table = poisoned_pool([5], dtype)  # two blocks: eight positions
    q = torch.randn(1, HEADS, HEAD_DIM).to(dtype)
    with pytest.raises(RuntimeError, match="has length 9; its block table holds 8"):
        kernels.paged_decode_attention(q, k, v, table, torch.tensor([9]), 0.125, 0)
    table[0, 1] = BLOCKS  # one past the pool
    with pytest.raises(RuntimeError, match=f"names block {BLOCKS} of {BLOCKS}"):
        kernels.paged_decode_attention(q, k, v, table, torch.tensor([5]), 0.125, 0)


# the path fixture holds for every example (a cap, no state): nothing to reset between them
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 9), hidden=st.sampled_from([16, 64, 576, 7, 40]),
       scale=st.floats(1e-3, 1e3), residual=st.booleans(), seed=st.integers(0, 2**16))
@example(rows=7, hidden=576, scale=25.0, residual=True, seed=1997)  # two bf16 steps, scalar path
def test_rms_norm_makes_the_twins_roundings(path, dtype, rows, hidden, scale, residual, seed):
    """Widths of whole vectors and of a tail (7, 40: under 16, and 8 past two 16s)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * scale).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    r = (torch.randn(rows, hidden, generator=g) * scale).to(dtype) if residual else None
    if r is None:
        normed = kernels.rms_norm(x, w, 1e-5)
    else:
        normed, new_residual = kernels.add_rms_norm(x, r, w, 1e-5)
    want_normed, want_residual = rms_norm(x, w, 1e-5, r)
    assert normed.dtype == dtype
    if r is not None:
        assert torch.equal(new_residual, want_residual)
    # the same roundings; the float32 sum of squares may end in another last bit, which can
    # move the bf16 `normed` by one step (2^-7 of it) before the product with the weight rounds
    # again: at most 2^-6 of the output in bf16 (seen: 2^-6.7), a few float32 steps in float32
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=0,
                               rtol=2**-6 if dtype == torch.bfloat16 else 2**-20)


def test_the_rms_norm_wrapper_is_the_twin(dtype):
    """cpu_ops.rms_norm: the kernel where it applies, the twin elsewhere; the twin's result."""
    x, w = torch.randn(3, 64).to(dtype), torch.randn(64).to(dtype)
    for residual in (None, torch.randn(3, 64).to(dtype)):
        normed, new_residual = cpu_rms_norm(x, w, 1e-5, residual)
        want_normed, want_residual = rms_norm(x, w, 1e-5, residual)
        assert torch.equal(new_residual, want_residual)
        torch.testing.assert_close(normed, want_normed, atol=0,
                                   rtol=2**-7 if dtype == torch.bfloat16 else 2**-20)


def merged_views(tokens, dtype=torch.bfloat16, seed=0, head_dim=HEAD_DIM):
    """K and V as the merged QKV product's views: rows of another stride, heads contiguous."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], dim=-1)
    return (q.view(tokens, HEADS, head_dim), k.view(tokens, KV_HEADS, head_dim),
            v.view(tokens, KV_HEADS, head_dim))


def test_store_kv_writes_what_the_twin_writes_and_skips_padding(path, dtype):
    _, k, v = merged_views(5, dtype)
    slots = torch.tensor([7, -1, 0, 127, 12])  # a padding row, the first and the last slot
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(4)]
    kernels.store_kv(k, v, caches[0], caches[1], slots)
    store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    before = caches[0].clone()
    with pytest.raises(RuntimeError, match="slot 128 is outside the cache's 128 slots"):
        kernels.store_kv(k, v, caches[0], caches[1], torch.tensor([20, 21, 22, 23, 128]))
    assert torch.equal(caches[0], before)  # refused whole, as the twin's indexing refuses


def test_the_store_kv_wrapper_writes_what_the_twin_writes(dtype):
    _, k, v = merged_views(3, dtype)
    slots = torch.tensor([5, -1, 9])
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(4)]
    cpu_store_kv(k, v, caches[0], caches[1], slots)
    store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# head_dim 64 and 32 (whole vectors), 40 and 12 (halves of 20 and 6: a tail on every path)
@pytest.mark.parametrize("tokens, head_dim", [(1, 64), (7, 64), (3, 32), (2, 40), (2, 12)])
def test_rotary_is_rotate_half_bit_for_bit(tokens, head_dim, path, dtype):
    q, k, _ = merged_views(tokens, dtype, seed=tokens, head_dim=head_dim)
    positions = torch.arange(100, 100 + tokens)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rotary_tables(positions, inv_freq, dtype)
    got_q, got_k = kernels.rotary(q, k, cos.contiguous(), sin.contiguous())
    assert got_q.dtype == dtype
    assert torch.equal(got_q, rotate_half(q, cos, sin))
    assert torch.equal(got_k, rotate_half(k, cos, sin))


def test_the_rotary_wrapper_is_rotate_half(dtype):
    """cpu_ops.rotary_with_tables: the kernel's result where it applies (None elsewhere)."""
    q, k, _ = merged_views(2, dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos, sin = rotary_tables(torch.arange(7, 9), inv_freq, dtype)
    rotated = rotary_with_tables(q, k, cos, sin)
    if rotated is not None:
        assert torch.equal(rotated[0], rotate_half(q, cos, sin))
        assert torch.equal(rotated[1], rotate_half(k, cos, sin))


def test_a_build_that_died_mid_way_does_not_hang_the_next_process(tmp_path):
    """torch's builder leaves a ``lock`` file where a builder was killed, and later processes
    would wait on it for ever; the next process removes it and loads (the built module is
    copied, so nothing compiles here)."""
    import os
    import shutil
    import subprocess
    import sys

    from pagedllm.kernels.cpu_ops import build_directory
    built = build_directory()
    moved = tmp_path / os.path.basename(built)
    shutil.copytree(built, moved)
    (moved / "lock").write_text("")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    code = "from pagedllm.kernels.cpu_ops import cpu_kernels_status as s; print(s())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert "path (this CPU runs up to" in run.stdout
    assert "left by a build that did not finish" in run.stderr
    assert "building the CPU kernels" not in run.stderr  # found built: nothing compiled
    assert not (moved / "lock").exists()
