"""Quantized KV caches in the Triton kernels, against the torch twins, through the interpreter.

store_kv must store exactly the twin's bytes and scales (attention reads what was written, and
the engine's tiers must agree token for token), so its comparisons are bit for bit: every
format, every input dtype, and rows chosen to break a careless kernel (all zeros, negative
zeros, one huge outlier per head, subnormal inputs, values past e4m3's 448 with a scale of 1,
exact ties of every rounding step, int4's rows of one repeated value and zero points that bf16
rounds above the row's minimum). Slots the kernel must not touch start as NaN bytes (fp8) or
garbage with NaN scales (int8; int4's scales and zeros) and must come out unchanged.

paged_attention dequantizes tiles in registers; it is compared with the twin in float32 on the
same stored cache, for every query shape of a step (decodes, a chunk after a cached prefix, a
whole prompt, a prefix-cache hit), flash-decoding's split path, sliding windows, GQA and MQA, a
head size that is not a power of two. Every slot no sequence wrote is poisoned: NaN bytes for
fp8, NaN *scales* (and garbage data) for int8, NaN scales *and zeros* for int4, so a kernel that
reads one, or scales (or shifts) a masked key by its slot's scale (zero), returns NaN. int4 is
also checked on rows far from zero, where its zero-point terms are most of every score.

The interpreter runs one program at a time: the shapes are small.
"""

import itertools
import json
import zlib

import pytest
import torch

from pagedllm.kernels.compile_check import Recorder
from pagedllm.kernels.paged_attention import paged_attention
from pagedllm.kernels.runtime import launch_hook
from pagedllm.kernels.store_kv import store_kv
from pagedllm.reference.ops import kv_cache_format
from pagedllm.reference.ops import paged_attention as paged_attention_reference
from pagedllm.reference.ops import store_kv as store_kv_reference
from pagedllm.reference.ops.kv_quant import calculated_scale

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernel_runner reads it at every launch


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bits of a tensor, as integers (NaN == NaN, -0 != +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def poisoned_pool(kv_cache_dtype, shape, gen):
    """(k_cache, v_cache, k_scale, v_scale) of a format, [num_blocks, block_size, kv_heads,
    head_dim] before packing, every slot poisoned: NaN fp8 bytes, or random integer data with NaN
    per-token-head scales (int4: [..., 2], NaN scales and zeros). fp8's per-tensor scales are
    left to the caller (None here)."""
    fmt = kv_cache_format(kv_cache_dtype)
    stored = (*shape[:3], fmt.storage_head_dim(shape[3]))
    if fmt.scales == "per_tensor":
        nan = torch.full(stored, float("nan")).to(fmt.storage_dtype)
        return nan, nan.clone(), None, None
    data = [torch.randint(0, 256, stored, generator=gen, dtype=torch.uint8).view(
        fmt.storage_dtype) for _ in range(2)]
    scale_shape = (*shape[:3], 2) if fmt.zero_point else shape[:3]
    scales = [torch.full(scale_shape, float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    return (*data, *scales)


# ----------------------------------------------------------------------------------------------
# store_kv: the twin's bytes and scales, exactly

# Exact ties of each rounding step: with a row's largest |x| 127, int8's scale is exactly 1
# and x.5 rounds up (torch.round would go to even); 1.0625, 1.1875 sit between e4m3 neighbours,
# 7.9375 rounds up to 8 (a carry into the exponent), 1.5 * 2**-9 between two e4m3 subnormals.
TIES = [127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1.0625, -1.1875, 7.9375, 1.5 * 2**-9, 3 * 2**-10,
        1.125, 6.5]
# int4 (asymmetric): a row from -8 to 7 has scale 1 and zero -8, so x - zero = k + 0.5 is a tie
INT4_TIES = [-8.0, 7.0, -7.5, -0.5, 0.5, 6.5, -2.5, 3.5, 1.5, -6.5]
# ... from 0 to 15: scale 1, zero 0; and past the top level (15.25, rounded down) clamps at 15
INT4_TIES_POSITIVE = [0.0, 15.0, 14.5, 0.5, 7.5, 2.5, 11.5, 1.5]


def adversarial_rows(num_tokens, kv_heads, head_dim, dtype, gen) -> torch.Tensor:
    """[num_tokens, kv_heads, head_dim] in dtype: the rows that break a careless quantizer,
    then random ones."""
    x = torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * 3
    x[0] = 0.0  # a zero row: scale 1
    x[1] = -0.0
    x[1, 0, :3] = torch.tensor([0.0, -0.0, 1.0])  # mostly negative zeros
    for h in range(kv_heads):  # one outlier per head drowns the row's other values
        x[2, h, int(torch.randint(head_dim, (1,), generator=gen))] = 1e4 if h % 2 else -3e4
    tiny = torch.finfo(dtype).tiny  # the smallest normal number of the input dtype
    x[3] = torch.randn(kv_heads, head_dim, generator=gen) * tiny / 4  # subnormal inputs
    # Past e4m3's largest value (448): with a scale of 1 these clamp; fp16 stops at 65504.
    big = [448.0, -448.0, 464.0, 479.0, 480.0, -600.0, 1e4, -6e4, 60000.0]
    x[4] = torch.tensor(big * head_dim)[:head_dim]
    x[5] = torch.tensor(TIES * head_dim)[:head_dim]
    x[6] = torch.tensor(INT4_TIES * head_dim)[:head_dim]
    x[7] = torch.tensor(INT4_TIES_POSITIVE * head_dim)[:head_dim]
    # int4: one value repeated (range 0: scale 1, the zero bf16's rounding of it, which is not
    # the value), and a minimum that bf16 rounds up (from fp32: x - zero < 0 clamps to level 0)
    x[8] = 3.3
    x[8, 1:] = -1e-3
    x[9] = torch.linspace(-1.00390625, 2.3, head_dim)  # -1 - 2**-8: a bf16 tie, rounds to -1
    x[9, 0, 0] = -1.001953125  # -1 - 2**-9: rounds to -1 too
    x[10] = torch.randn(kv_heads, head_dim, generator=gen) * 0.5 + 40.0  # far from zero
    return x.to(dtype)


def check_store_kv(kv_cache_dtype, k, v, slots, block_size, num_blocks, gen):
    """Both launchers from the same poisoned pool: every byte and scale equal, padding rows and
    unused slots untouched."""
    fmt = kv_cache_format(kv_cache_dtype)
    shape = (num_blocks, block_size, k.shape[1], k.shape[2])
    pool = list(poisoned_pool(kv_cache_dtype, shape, gen))
    if fmt.scales == "per_tensor":  # K at scale 1 (the clamps bite), V at a scale that rounds
        pool[2:] = [torch.tensor([1.0]), calculated_scale(v, 200.0)]
    expected = [t.clone() for t in pool]
    store_kv_reference(k, v, *expected[:2], slots, kv_cache_dtype, *expected[2:])
    got = [t.clone() for t in pool]
    store_kv(k, v, *got[:2], slots, kv_cache_dtype, *got[2:])
    for name, g, e in zip(("k_cache", "v_cache", "k_scale", "v_scale"), got, expected,
                          strict=True):
        if g is not None:
            assert torch.equal(raw(g), raw(e)), f"{name} differs from the twin's"
    keep = slots >= 0
    flat = got[0].flatten(0, 1)  # [slots, kv_heads, stored]
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(raw(flat[untouched]), raw(pool[0].flatten(0, 1)[untouched]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_store_kv_is_bit_identical_to_the_twin(kv_cache_dtype, dtype):
    """Adversarial rows and random ones, 3 heads (a masked lane in the tile), head_dim 80 (not
    a power of two: int4's halves of 40 pad to 64), padding slots."""
    gen = seeded("store", kv_cache_dtype, dtype)
    k = adversarial_rows(14, 3, 80, dtype, gen)  # rows 0..10 adversarial, 11..13 random
    v = adversarial_rows(14, 3, 80, dtype, gen).roll(3, 0)  # rows 3..13 adversarial
    slots = torch.randperm(4 * 8, generator=gen)[:14]
    slots[12] = -1  # a padding row: random in both
    check_store_kv(kv_cache_dtype, k, v, slots, 8, 4, gen)


@pytest.mark.parametrize("kv_cache_dtype", [*QUANTIZED, "fp8"])
def test_store_kv_strided_rows_and_head_tiles(kv_cache_dtype):
    """k, v sliced out of a fused QKV output (strided), 24 heads of 128: two tiles of 16 heads
    per token (int4: of 64 bytes), the second half masked. "fp8" is e4m3's alias."""
    gen = seeded("tiles", kv_cache_dtype)
    fused = (torch.randn(5, 3, 24, 128, generator=gen) * 5).to(torch.bfloat16)
    k, v = fused[:, 1], fused[:, 2]
    assert not k.is_contiguous()
    slots = torch.tensor([3, -1, 17, 0, 30])
    check_store_kv(kv_cache_dtype, k, v, slots, 16, 2, gen)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounding_matches_torch_on_a_sweep_of_floats(kv_cache_dtype):
    """Every fp32 whose bits 13..31 span 2**-16 .. 2**16 (both signs), with the low bits zero
    (exact ties of both formats), one, or all ones: the kernel's integer rounding is torch's
    conversion, ties to even, subnormals and the carry into the exponent included."""
    high = torch.arange(0x38000000 >> 13, 0x47800000 >> 13, dtype=torch.int64) << 13
    bits = torch.cat([high | low for low in (0, 1, 0x1FFF)])
    x = torch.cat([bits, bits | (1 << 31)]).to(torch.int32).view(torch.float32)
    x = x[:x.numel() // 2048 * 2048].view(-1, 16, 128)  # [tokens, heads, head_dim]
    fmt = kv_cache_format(kv_cache_dtype)
    cache = torch.zeros(x.shape[0], 1, 16, 128, dtype=fmt.storage_dtype)
    caches = [cache.clone() for _ in range(4)]
    slots, one = torch.arange(x.shape[0]), torch.tensor([1.0])
    store_kv_reference(x, x, caches[0], caches[1], slots, kv_cache_dtype, one, one)
    store_kv(x, x, caches[2], caches[3], slots, kv_cache_dtype, one, one)
    assert torch.equal(raw(caches[2]), raw(caches[0]))


def test_store_kv_refuses_what_it_cannot_store():
    k = torch.randn(2, 2, 16)
    slots = torch.tensor([0, 1])
    int8 = torch.zeros(1, 4, 2, 16, dtype=torch.int8)
    scales = torch.zeros(1, 4, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int8 cache holds"):
        store_kv(k, k, int8.to(torch.uint8), int8.to(torch.uint8), slots, "int8", scales, scales)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        store_kv(k, k, int8, int8.clone(), slots, "int8")
    odd = torch.randn(2, 2, 15)
    with pytest.raises(ValueError, match="odd"):
        store_kv(odd, odd, torch.zeros(1, 4, 2, 7, dtype=torch.uint8),
                 torch.zeros(1, 4, 2, 7, dtype=torch.uint8), slots, "int4", scales, scales)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        store_kv(k, k, int8, int8, slots, "int2")


# ----------------------------------------------------------------------------------------------
# paged_attention: the twin's attention over the same quantized cache

# (q_len, seq_len) per sequence: a decode, a chunk after 23 cached tokens, a whole prompt, a
# prefix-cache hit (the last 3 of 35), a decode that fills its last block exactly.
MIXED = ((1, 37), (6, 29), (19, 19), (3, 35), (1, 16))
DECODES = ((1, 70), (1, 33), (1, 1))  # a batch of decodes, as flash-decoding splits them
PAD_ROWS = 2  # rows of q past the last sequence: the output must be 0 there


def quantized_batch(kv_cache_dtype, seed, block_size, head_dim, num_heads, num_kv_heads,
                    seqs=MIXED, dtype=torch.float32, shift=0.0):
    """q and a poisoned paged cache holding the sequences' K/V (standard normal, plus shift),
    quantized by the twin's store_kv into shuffled blocks. Returns (q, k_cache, v_cache,
    block_tables, seq_lens, query_start_loc, k_scale, v_scale)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = kv_cache_format(kv_cache_dtype)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned = free.pop()  # what the padding entries of the tables point at: never written
    k_cache, v_cache, k_scale, v_scale = poisoned_pool(
        kv_cache_dtype, (num_blocks, block_size, num_kv_heads, head_dim), gen)
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), poisoned, dtype=torch.int32)
    rows = []
    for b, (_, seq_len) in enumerate(seqs):
        for i in range(blocks_per_seq[b]):
            block_tables[b, i] = free.pop()
        positions = torch.arange(seq_len)  # slots past seq_len in the last block stay poisoned
        blocks = block_tables[b, positions // block_size].long()
        slots = blocks * block_size + positions % block_size  # [seq_len]
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen) + shift
        rows.append((kv.to(dtype), slots))
    if fmt.scales == "per_tensor":  # the layer's scales from its values, as calibration sets
        k_scale = calculated_scale(torch.cat([r[0][0] for r in rows]), 200.0)
        v_scale = calculated_scale(torch.cat([r[0][1] for r in rows]), 100.0)
    for (k, v), slots in rows:
        store_kv_reference(k, v, k_cache, v_cache, slots, kv_cache_dtype, k_scale, v_scale)
    starts = [0, *itertools.accumulate(q_len for q_len, _ in seqs)]
    q = torch.randn(starts[-1] + PAD_ROWS, num_heads, head_dim, generator=gen).to(dtype)
    return (q, k_cache, v_cache, block_tables,
            torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), k_scale, v_scale)


def check_attention(kv_cache_dtype, batch, window, tol, **kwargs):
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale = batch
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_reference(q.float(), k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window, kv_cache_dtype,
                                         k_scale, v_scale)
    assert not expected.isnan().any()  # the twin reads only written slots too
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          window, kv_cache_dtype, k_scale, v_scale, out=out, **kwargs)
    assert got is out and got.dtype == q.dtype
    assert not got.isnan().any(), "a row was left unwritten, or a poisoned slot was read"
    assert (got.float() - expected).abs().max().item() < tol
    last = int(query_start_loc[-1])
    assert torch.equal(got[last:], torch.zeros_like(got[last:])), "padding rows must be 0"


# id: block_size, head_dim, num_heads, num_kv_heads, sliding_window, launcher keywords
CASES = {
    "bs16-d64-gqa4": (16, 64, 8, 2, None, {}),
    "bs8-d80-gqa2-window7": (8, 80, 4, 2, 7, {}),  # int4: halves of 40
    "bs16-d64-mqa4-rows16": (16, 64, 4, 1, None, {"block_m": 16}),  # many query blocks
    "split3-bs16-d64-gqa4": (16, 64, 8, 2, None, {"num_splits": 3}),
    "split2-bs8-d80-mha-window10": (8, 80, 2, 2, 10, {"num_splits": 2}),  # empty splits
    "bs32-d16-gqa2-tile16": (32, 16, 4, 2, None, {"tile_n": 16}),  # int4: halves pad 8 to 16
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_paged_attention_matches_twin(kv_cache_dtype, case):
    block_size, head_dim, num_heads, num_kv_heads, window, kwargs = CASES[case]
    batch = quantized_batch(kv_cache_dtype, zlib.crc32(f"{kv_cache_dtype}-{case}".encode()),
                            block_size, head_dim, num_heads, num_kv_heads)
    check_attention(kv_cache_dtype, batch, window, 1e-4, **kwargs)


@pytest.mark.parametrize("num_splits,seqs", [(1, MIXED), (2, DECODES)], ids=["mixed", "split2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_paged_attention_half_precision(kv_cache_dtype, dtype, num_splits, seqs):
    """bf16 / fp16 queries: the dequantized tiles (exact in either) meet q in its dtype, the
    probabilities are rounded to it before P.V, the output once (the twin in fp32 is the truth;
    the tolerances are the unquantized kernel's)."""
    batch = quantized_batch(kv_cache_dtype, zlib.crc32(f"{kv_cache_dtype}-{dtype}".encode()),
                            16, 64, 8, 2, seqs=seqs, dtype=dtype)
    check_attention(kv_cache_dtype, batch, None, 2e-2 if dtype == torch.bfloat16 else 4e-3,
                    num_splits=num_splits)


@pytest.mark.parametrize("case", ["bs16-d64-gqa4", "split3-bs16-d64-gqa4",
                                  "bs8-d80-gqa2-window7"])
def test_int4_zero_points_on_rows_far_from_zero(case):
    """K and V around 6 (a row from about 3 to 9): the zeros carry most of every value, so the
    terms z_j * sum_d q_d of the scores and sum_j p_j z_j of the output are most of the result;
    a kernel that drops either, or adds it to one half of int4's output only, is far off."""
    block_size, head_dim, num_heads, num_kv_heads, window, kwargs = CASES[case]
    batch = quantized_batch("int4", zlib.crc32(f"far-{case}".encode()), block_size, head_dim,
                            num_heads, num_kv_heads, shift=6.0)
    check_attention("int4", batch, window, 1e-3, **kwargs)
    # and in half precision, q . k_int of 0..15 and the zero terms against a rounded q, the
    # output rounded once: around 6, one step of fp16 is 2**-8, one of bf16 2**-5 (and the
    # interpreter's cast to bf16 truncates: up to a whole step, always down)
    for dtype, tol in ((torch.float16, 1e-2), (torch.bfloat16, 8e-2)):
        batch = quantized_batch("int4", zlib.crc32(f"far-{dtype}-{case}".encode()), block_size,
                                head_dim, num_heads, num_kv_heads, shift=6.0, dtype=dtype)
        check_attention("int4", batch, window, tol, **kwargs)


def test_int4_refuses_scales_without_zeros():
    """int4's scales are (scale, zero) pairs [num_blocks, block_size, kv_heads, 2]: int8's
    layout [num_blocks, block_size, kv_heads] is refused by both launchers."""
    q, k_cache, v_cache, tables, seq_lens, starts, k_scale, v_scale = quantized_batch(
        "int4", 1, 16, 64, 4, 2, seqs=((1, 5),))
    old = k_scale[..., 0].contiguous(), v_scale[..., 0].contiguous()
    with pytest.raises(ValueError, match="kv_heads, 2"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125, None, "int4", *old)
    k = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="kv_heads, 2"):
        store_kv(k, k, k_cache, v_cache, torch.tensor([0, 1]), "int4", *old)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_paged_attention_refuses_a_cache_of_another_format(kv_cache_dtype):
    q, k_cache, v_cache, tables, seq_lens, starts, k_scale, v_scale = quantized_batch(
        kv_cache_dtype, 1, 16, 64, 4, 2, seqs=((1, 5),))
    other = "int8" if kv_cache_dtype != "int8" else "fp8_e4m3"
    with pytest.raises(ValueError, match="cache for head_dim 64 holds"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125, None, other,
                        k_scale, v_scale)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125, None,
                        kv_cache_dtype)


# ----------------------------------------------------------------------------------------------
# without the interpreter, and what the compiler is handed


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_without_interpreter_both_launchers_call_the_twins(kv_cache_dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = quantized_batch(kv_cache_dtype, 2, 16, 64, 8, 2)
    q, k_cache, v_cache, tables, seq_lens, starts, k_scale, v_scale = batch
    args = (q, k_cache, v_cache, tables, seq_lens, starts, 0.125, 5, kv_cache_dtype, k_scale,
            v_scale)
    assert torch.equal(paged_attention(*args), paged_attention_reference(*args))
    gen = seeded("fallback", kv_cache_dtype)
    k, v = adversarial_rows(11, 2, 64, torch.float32, gen), torch.randn(11, 2, 64, generator=gen)
    slots = torch.tensor([3, -1, 40, 41, 0, 9, 77, 12, 13, 79, 50])
    check_store_kv(kv_cache_dtype, k, v, slots, 16, 5, gen)  # the twin against itself: no NaN


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_reach_the_compiler_as_bytes(kv_cache_dtype):
    """Triton has no e4m3 type on sm_80 ("type fp8e4nv not supported in this architecture"):
    the launches carry uint8 caches and no fp8 type anywhere, so an A100 compiles them."""
    recorder = Recorder()
    batch = quantized_batch(kv_cache_dtype, 3, 16, 32, 4, 2, seqs=((1, 9), (4, 4)))
    q, k_cache, v_cache, tables, seq_lens, starts, k_scale, v_scale = batch
    with launch_hook(recorder):
        store_kv(q[:2, :2], q[:2, 2:], k_cache, v_cache, torch.tensor([5, 6]), kv_cache_dtype,
                 k_scale, v_scale)
        paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125, None,
                        kv_cache_dtype, k_scale, v_scale)
    launches = {launch["kernel"].split(":")[1]: launch for launch in recorder.launches.values()}
    assert set(launches) == {"_store_kv_kernel", "_paged_attention_kernel"}
    for launch in launches.values():
        assert launch["signature"]["k_cache_ptr"] == "*u8"
        assert "fp8" not in json.dumps(launch["signature"])
        assert launch["constexprs"]["KV_FORMAT"] == kv_cache_dtype
