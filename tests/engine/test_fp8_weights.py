"""fp8 weights (quantization="fp8", issue 41): e4m3 codes with a scale per output channel,
activations in the model's dtype. The twin's error bound and bytes; the Triton kernel under the
interpreter and the CPU backend (the C++ product, kernels/cpu/quant_linear.cpp's fp8_matmul,
where the extension builds) give the reference tier's tokens; tensor-parallel shards keep the
whole row's scale."""

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.kernels.cpu_ops import cpu_kernels, packable
from pagedllm.optimized.quant_layers import PackedFp8Linear
from pagedllm.reference import SamplingParams
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.ops.weight_quant import (
    FP8_MAX,
    dequantize_weight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from pagedllm.serving.default_model import default_model_dir

PROMPTS = ["The for statement is used to", "Return a list of"]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=4, ignore_eos=True)


def tokens(make, runs=(GREEDY, SEEDED), **options):
    llm = make(default_model_dir(), quantization="fp8", max_num_seqs=2, max_model_len=64,
               num_gpu_blocks=16, **options)
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]
            for p in runs]


def test_e4m3_codes_keep_every_weight_within_a_sixteenth_of_itself():
    torch.manual_seed(0)
    w = torch.randn(48, 160) * 0.02
    w[3] *= 100  # a large row: its own scale, the others' steps untouched
    q = quantize_fp8(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scales.shape == (48,)
    assert float(q.qweight.float().abs().amax(dim=1).min()) == FP8_MAX  # each row's max lands
    err = (dequantize_weight(q, torch.float32) - w).abs()
    # 3 mantissa bits: half a step is 2**-4 of the value, above e4m3's smallest normal 2**-6
    bound = torch.maximum(w.abs() * 2**-4, q.scales[:, None] * 2**-10)
    assert bool((err <= bound * 1.0001).all())
    # the bytes of int8: a byte a weight and a scale a row
    assert q.nbytes() == quantize_int8(w).nbytes() == 48 * 160 + 48 * 4


def test_row_absmax_gives_a_shard_the_whole_rows_scale():
    w = torch.randn(8, 64)
    whole = quantize_fp8(w)
    half = quantize_fp8(w[:, :32], absmax=w.abs().amax(dim=1))
    assert torch.equal(half.scales, whole.scales)
    assert torch.equal(half.qweight.view(torch.uint8), whole.qweight[:, :32].view(torch.uint8))


def test_the_model_holds_fp8_layers_and_the_cpu_backend_gives_the_twins_tokens():
    ref = reference.LLM(default_model_dir(), quantization="fp8", dtype="float32",
                        num_gpu_blocks=16, max_model_len=64)
    layers = [m for m in ref.engine.model.modules()
              if isinstance(m, QuantizedLinear)]
    assert layers and all(m.quantized.scheme == "fp8" for m in layers)
    for dtype in ("float32", "bfloat16"):
        assert tokens(optimized.LLM, dtype=dtype) == tokens(reference.LLM, dtype=dtype), dtype
    # the optimized tier multiplies them on the C++ kernel, each layer it takes (16 outputs
    # and inputs at a time); the others stay the twin
    opt = optimized.LLM(default_model_dir(), quantization="fp8", dtype="float32",
                        num_gpu_blocks=16, max_model_len=64)
    held = [m for m in opt.engine.model.modules()
            if isinstance(m, PackedFp8Linear | QuantizedLinear)]
    assert held and (cpu_kernels() is None) == (not any(
        isinstance(m, PackedFp8Linear) for m in held))
    for m in held:
        if isinstance(m, QuantizedLinear):  # left the twin: no kernel, or a shape it refuses
            assert cpu_kernels() is None or not packable(*m.quantized.shape)


def test_the_triton_kernel_under_the_interpreter_gives_the_reference_tokens(monkeypatch):
    want = tokens(reference.LLM, (GREEDY,), dtype="float32")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # every kernel interpreted: greedy only
    assert tokens(optimized.LLM, (GREEDY,), dtype="float32") == want


@pytest.mark.parametrize("field,value,match", [
    ("quantization", "fp4", "quantization"),
    ("pipeline_parallel_size", 2, "tensor parallelism"),
    ("pipeline_parallel_size", 0, "pipeline_parallel_size"),
])
def test_refusals_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match) as err:
        reference.LLM(default_model_dir(), **{field: value})
    assert err.value.field == field


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_an_all_zero_row_stays_zero_in_every_dtype(scheme, dtype):
    """A dead output channel (all-zero weights, or tiny ones that fp16 cannot scale): its
    scale is the stored dtype's smallest normal, never 0, so its codes are 0, not NaN."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    w[3] = 0
    w[5] = 1e-7  # a scale of 1e-7 / 127 rounds to 0 in fp16
    qw = {"fp8": lambda: quantize_fp8(w), "int8": lambda: quantize_int8(w),
          "int4": lambda: quantize_int4(w, 32)}[scheme]()
    back = dequantize_weight(qw, torch.float32)
    assert torch.isfinite(back).all()
    assert (back[3] == 0).all()
    assert (qw.scales.float() > 0).all()
