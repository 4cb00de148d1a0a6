"""Weight quantization (``quantization="int8"`` / ``"int4"``): what is stored, the fast CPU
kernels against the twin, both tiers on a quantized model, and the refusals.

Tolerance between the tiers: a quantized model runs in bfloat16 (its default dtype), where the
tiers' products add in different orders (torch's weight-only kernels against dequantize-then-
multiply; the optimized tier's attention) and the logits differ by a few bf16 rounding steps,
as they do between the tiers for an unquantized bf16 model. Greedy tokens may then part at a
near-tie: compared as vLLM compares kernels, at the first differing position each tier's token
must be among the other's top logprobs, with close logprobs.
"""

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.kernels.cpu_ops import cpu_kernels
from pagedllm.optimized.quant_layers import (
    Int4PackedLinear,
    Int8PackedLinear,
    PackedBF16Linear,
    PackedEmbedding,
    PackedInt4Linear,
    PackedInt8Linear,
)
from pagedllm.reference import SamplingParams
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.ops.weight_quant import (
    dequantize_weight,
    quantize_int4,
    quantize_int8,
    quantized_linear,
)
from pagedllm.serving.default_model import default_model_dir

TIERS = {"reference": reference.LLM, "optimized": optimized.LLM}
PROMPTS = ["The for statement is used to", "Return a list of the", "This module provides"]


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


# -- what is stored -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_is_within_half_a_step(dtype):
    w = (torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]).to(dtype)  # rows of any size
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    assert q.scales.shape == (48,) and q.scales.dtype == dtype
    err = (dequantize_weight(q, torch.float32) - w.float()).abs()
    assert (err <= q.scales.float()[:, None] / 2 * 1.01).all(), "round to the nearest code"
    assert q.nbytes() < w.numel() * w.element_size()


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_groups_span_their_range_and_pack_two_codes_a_byte(group_size):
    w = torch.randn(24, 128) * 0.1
    w[3, :group_size] = 5.0  # a group of one value, and an outlier confined to its group
    w[5, :] += 2.0  # a row far from zero: a symmetric scale would waste half its levels
    q = quantize_int4(w, group_size)
    assert q.qweight.shape == (24, 64) and q.qweight.dtype == torch.uint8
    assert q.scales.shape == q.zeros.shape == (24, 128 // group_size)
    back = dequantize_weight(q, torch.float32)
    err = (back - w).abs().view(24, -1, group_size)
    assert (err <= q.scales[..., None] / 2 * 1.01 + 1e-6).all()
    # The packing: input 2i in the low nibble of byte i, input 2i + 1 in the high one.
    codes = torch.stack([q.qweight & 0xF, q.qweight >> 4], -1).view(24, 128).float()
    expect = (back.view(24, -1, group_size) - q.zeros[..., None]) / q.scales[..., None] + 8
    torch.testing.assert_close(codes, expect.view(24, 128), atol=1e-3, rtol=0)


def test_int4_refuses_a_group_that_does_not_divide_the_input():
    with pytest.raises(ValueError, match="groups of 64 do not divide an input size of 96"):
        quantize_int4(torch.randn(8, 96), 64)


# -- the fast kernels against the twin -------------------------------------------------------
def _own(packed):
    def make(layer, dtype):
        kernels = cpu_kernels()
        if kernels is None:
            pytest.skip("this CPU has no AVX-512 BF16 (or the kernel did not build)")
        return packed(layer, kernels)
    return make


FAST_INT = {"int8": Int8PackedLinear, "int4": Int4PackedLinear,
            "int8-own": _own(PackedInt8Linear), "int4-own": _own(PackedInt4Linear)}


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int8-own", None)] + [
    (scheme, g) for scheme in ("int4", "int4-own") for g in (32, 64, 128)])
def test_packed_kernels_compute_what_the_twin_computes(scheme, group_size):
    torch.manual_seed(0)
    w = (torch.randn(96, 256) * 0.05).bfloat16()
    q = quantize_int8(w) if scheme.startswith("int8") else quantize_int4(w, group_size)
    bias = torch.randn(96).bfloat16()
    layer = QuantizedLinear(q, bias)
    fast = FAST_INT[scheme](layer, torch.bfloat16)
    # own kernels: int8 takes 1-3 rows on VNNI, more as bf16; tiles of 8: full, partial, several
    for rows in (1, 2, 3, 4, 8, 9, 17):
        x = torch.randn(rows, 256).bfloat16()
        want = quantized_linear(x, q, bias)  # [rows, 96]
        got = fast(x)
        assert got.dtype == want.dtype == torch.bfloat16
        # The same float32 sums in another order, one rounding to bf16 (then the bias add):
        # at most a rounding step apart.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("rows", [1, 3, 5])  # VNNI's 24-bit rows (1-3) and the bf16 path
def test_own_int8_kernel_on_wide_ranges_zeros_and_non_finite_rows(rows):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("this CPU has no AVX-512 BF16 (or the kernel did not build)")
    torch.manual_seed(0)
    q = quantize_int8((torch.randn(32, 128) * 0.05).bfloat16())
    fast = PackedInt8Linear(QuantizedLinear(q, None), kernels)
    x = torch.randn(rows, 128).bfloat16()
    x[:, 3] = 3000.0  # an outlier channel: the rest is far below it (2^-11 and less)
    x[:, 5] = 1e-6  # below 2^-16 of the largest: rounded, by less than float32 would
    torch.testing.assert_close(fast(x).float(), quantized_linear(x, q, None).float(),
                               rtol=2**-7, atol=2**-7)
    assert torch.equal(fast(torch.zeros(rows, 128).bfloat16()), torch.zeros(rows, 32).bfloat16())
    tiny = torch.randn(rows, 128).bfloat16() * 1e-33  # far below any activation, still held
    torch.testing.assert_close(fast(tiny).float(), quantized_linear(tiny, q, None).float(),
                               rtol=2**-6, atol=0)
    x[0, 7], x[-1, 9] = float("nan"), float("inf")
    got = fast(x)
    assert got[0].isnan().all() and not got[-1].isfinite().any()  # never a finite answer


def test_own_bf16_kernel_and_the_embedding_it_serves_match_torch():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("this CPU has no AVX-512 BF16 (or the kernel did not build)")
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 160, bias=True).bfloat16()
    fast = PackedBF16Linear(layer, kernels)
    for rows in (1, 8, 13):
        x = torch.randn(rows, 256).bfloat16()
        want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(fast(x).float(), want, rtol=2**-7, atol=2**-6)
    ids = torch.tensor([0, 15, 16, 159, 7])
    assert torch.equal(PackedEmbedding(fast)(ids), layer.weight[ids])  # the rows, exactly


# -- the engine ------------------------------------------------------------------------------
def _generate(llm, max_tokens=24, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_both_tiers_run_a_quantized_model_and_agree(model_dir, scheme):
    llms = {tier: make(model_dir, quantization=scheme) for tier, make in TIERS.items()}
    outs = {tier: _generate(llm, logprobs=5) for tier, llm in llms.items()}
    for ref, opt in zip(outs["reference"], outs["optimized"], strict=True):
        assert len(ref.token_ids) == len(opt.token_ids) == 24
        pairs = zip(ref.token_ids, opt.token_ids, strict=True)
        diverged = [i for i, (a, b) in enumerate(pairs) if a != b]
        if diverged:  # a near-tie broken the other way: each is in the other's top 5
            i = diverged[0]
            a, b = ref.token_ids[i], opt.token_ids[i]
            assert b in ref.logprobs[i] and a in opt.logprobs[i], (scheme, i, a, b)
            gap = ref.logprobs[i][a] - ref.logprobs[i][b]
            assert gap < 0.1, f"{scheme}: the tiers parted at a gap of {gap:.3f} nats"
    for tier, llm in llms.items():
        stats = llm.stats()
        assert stats["quantization"] == scheme
        # Never silently unquantized: the only float layer is the tied head (the embedding's
        # table); every other product is a quantized module's.
        assert stats["float_linears"] == ["lm_head"], tier
        products = [name for name, m in llm.engine.model.named_modules()
                    if name.rsplit(".", 1)[-1].endswith("proj")]
        assert products and all(
            isinstance(llm.engine.model.get_submodule(name), QuantizedLinear | Int8PackedLinear
                       | Int4PackedLinear | PackedInt4Linear | PackedInt8Linear)
            for name in products), tier


def test_quantized_weights_take_fewer_bytes_and_skip_keeps_a_layer(model_dir):
    plain = reference.LLM(model_dir, dtype="bfloat16").stats()["weight_bytes"]
    int8 = reference.LLM(model_dir, quantization="int8").stats()["weight_bytes"]
    int4 = reference.LLM(model_dir, quantization="int4").stats()["weight_bytes"]
    assert int4 < int8 < plain
    kept = optimized.LLM(model_dir, quantization="int8", quantization_skip=("down_proj",))
    stats = kept.stats()
    assert stats["weight_bytes"] > int8
    assert sorted(stats["float_linears"]) == ["lm_head"] + [
        f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    assert _generate(kept, max_tokens=4)  # and it runs


@pytest.mark.parametrize("options, field", [
    ({"quantization": "int3"}, "quantization"),
    ({"quantization": "int4", "quantization_group_size": 48}, "quantization_group_size"),
    ({"quantization": "int8", "quantization_skip": "lm_head"}, "quantization_skip"),
])
@pytest.mark.parametrize("tier", TIERS)
def test_bad_quantization_options_are_refused_by_name(model_dir, tier, options, field):
    with pytest.raises((ValueError, TypeError), match=field):
        TIERS[tier](model_dir, **options)


def test_a_group_size_that_does_not_divide_a_layer_names_the_layer(model_dir):
    # The tiny model's MLP has 704 inputs to down_proj: groups of 256 do not divide it.
    with pytest.raises(ValueError, match=r"down_proj \(in 704\)"):
        reference.LLM(model_dir, quantization="int4", quantization_group_size=256)


# -- a GGUF file's own blocks (quantization="gguf") --------------------------------------------
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_mean_what_ggml_dequantizes_them_to(kind):
    """The blocks, read without expanding them, stand for the weights gguf's own (ggml's)
    dequantizer computes; the only difference is d and m rounded to the model's dtype."""
    import numpy as np
    from gguf.quants import GGMLQuantizationType, dequantize, quantize

    from pagedllm.reference.model.gguf import q4_blocks_to_int4

    w = np.random.default_rng(0).standard_normal((12, 128)).astype(np.float32)
    w[2] += 3.0  # a row away from zero (Q4_1's minimum matters)
    blocks = quantize(w, GGMLQuantizationType[kind])  # uint8 [12, 4 blocks * bytes]
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).copy())
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
        qw = q4_blocks_to_int4(torch.from_numpy(blocks.copy()), kind, dtype)
        assert qw.group_size == 32 and qw.qweight.shape == (12, 64)
        got = dequantize_weight(qw, torch.float32)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_gguf_refuses_a_model_that_is_not_a_gguf(model_dir):
    with pytest.raises(ValueError, match="quantization 'gguf' serves a GGUF file's own blocks"):
        reference.LLM(model_dir, quantization="gguf")
