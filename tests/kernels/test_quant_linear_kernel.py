"""kernels/quant_linear.py under the interpreter against its twin (reference/ops/weight_quant.py):
int8 and fp8 (e4m3) per channel and int4 in every group size, each activation dtype, a decode's
few rows and a prefill's many, sizes that are not multiples of a tile, a bias; and the optimized
tier running a quantized model through the kernel, with the twin's greedy tokens.

Tolerance: the twin dequantizes and sums in float32 and rounds once; the kernel feeds tl.dot
the dequantized tile in x's dtype (float32 accumulation), so bf16/fp16 results may differ by a
rounding of the weights in that dtype: a couple of the output's ulps.
"""

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.kernels.quant_linear import quant_linear
from pagedllm.reference import SamplingParams
from pagedllm.reference.ops.weight_quant import (
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantized_linear,
)
from pagedllm.serving.default_model import default_model_dir

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # relative to max |y|


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernel_runner reads it at every launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4/32", "int4/64", "int4/128"])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_quant_linear_matches_the_twin(dtype, scheme, rows):
    torch.manual_seed(rows)
    N, K = 72, 256  # N: not a multiple of the 64-wide tile
    w = (torch.randn(N, K) * 0.05).to(dtype)
    w[5] *= 40  # one large row: its own scale
    qw = quantize_int8(w) if scheme == "int8" else quantize_fp8(w) if scheme == "fp8" else \
        quantize_int4(w, int(scheme[5:]))
    x = torch.randn(rows, K).to(dtype)
    bias = torch.randn(N).to(dtype) if rows == 3 else None
    got, want = quant_linear(x, qw, bias), quantized_linear(x, qw, bias)
    assert got.shape == (rows, N) and got.dtype == dtype
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * scale)


def test_quant_linear_refuses_a_mismatched_input():
    qw = quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="x has 32 inputs, the weight 64"):
        quant_linear(torch.randn(2, 32), qw)


def test_the_optimized_tier_runs_a_quantized_model_through_the_kernel():
    """Under the interpreter the optimized tier's products are the kernel's; float32 keeps the
    tiers' tokens equal (the kernel's tile is exact in float32)."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = ["The for statement is used to", "Return a list of"]
    outs = {}
    for tier, make in (("reference", reference.LLM), ("optimized", optimized.LLM)):
        llm = make(default_model_dir(), quantization="int4", dtype="float32",
                   max_num_seqs=2, max_model_len=64, num_gpu_blocks=8)
        outs[tier] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
    assert outs["optimized"] == outs["reference"]
