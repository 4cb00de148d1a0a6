"""GPTQ: rounding a layer's weights so that its *outputs* move least, not each weight alone.

Rounding to nearest (``ops/weight_quant.py``, what ``quantization="fp8"`` does at load) treats
every weight on its own. A layer's output is X W^T, though, and the errors of the weights of
one row add up over the inputs: an error on input j can be paid back by nudging the weights of
inputs still to be rounded, in proportion to how input j's activations correlate with theirs.
GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") does exactly that, one input column at a time. It needs the inputs'
second moments, the Hessian of the layer's squared output error,

    H = sum over calibration tokens of x x^T        [in, in]

and then, for each column j in turn: round it, and spread its error e_j over the columns not
yet rounded through the inverse Hessian, W[:, k] -= e_j * Hinv[j, k] / Hinv[j, j]. Columns go
in order of falling H[j, j] ("act order"): the inputs with the largest activations are
rounded first, while every other column can still absorb their error. The grid and the
scales are the round-to-nearest scheme's (one scale per output channel, the row's largest
|w| on the grid's largest value): only which grid point each weight lands on changes, so the
result is an ordinary fp8 or int8 weight that every kernel multiplies as it is.

Act order and the lazy batches come from the paper's published code; the paper's own algorithm
also quantizes the layers one after another on the quantized layers' outputs, where this takes
every Hessian from the float model in one pass. It needs calibration inputs;
``calibration_samples`` makes them from the model itself (text it samples from its first token
on, after LLM-QAT's data-free generation, Liu et al. 2023, which starts from a random token and
picks the first few greedily), so no data set is downloaded. ``pagedllm quantize`` runs it and
saves the result as a checkpoint
(``model/quantized_checkpoint.py``): GPTQ is a step before serving, as llm-compressor's is
before vLLM, never work done at load.
"""

import torch
from torch import nn

from ..ops.weight_quant import (
    FP8_MAX,
    QuantizedWeight,
    dequantize_weight,
    quantize_fp8,
    quantize_int8,
)
from .quantization import decoder_stack

GPTQ_SCHEMES = ("fp8", "int8")  # a scale per output channel: GPTQ keeps it and moves codes
QUANTIZE = {"fp8": quantize_fp8, "int8": quantize_int8}
GRID_MAX = {"fp8": FP8_MAX, "int8": 127}  # the code a row's largest |w| lands on


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers a quantized checkpoint stores quantized: all but a tied LM head
    (which is the float embedding table, as ``quantize_model`` leaves it)."""
    embedding = decoder_stack(model).embed_tokens.weight
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.weight.data_ptr() != embedding.data_ptr()}


# --8<-- [start:hessians]
def collect_hessians(model: nn.Module, run) -> dict[str, torch.Tensor]:
    """{layer name: H [in, in]}: the sum of x x^T over every input row x each quantized
    linear layer of model saw while run() ran (forward hooks, float32 sums as the
    paper's code keeps them). Every layer's H is held at once: 0.5 GB for SmolLM2-135M,
    tens of GB for an 8B model, which would need them a decoder layer at a time."""
    linears = quantized_linears(model)
    hessians = {name: torch.zeros(m.in_features, m.in_features, device=m.weight.device)
                for name, m in linears.items()}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [T, in]
        hessians[name] += x.T @ x  # [in, in]

    hooks = [m.register_forward_hook(lambda _m, args, _out, name=name: add(name, args[0]))
             for name, m in linears.items()]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return hessians
# --8<-- [end:hessians]


def _round(columns: torch.Tensor, scheme: str, absmax: torch.Tensor) -> torch.Tensor:
    """columns [out, c] (float32) rounded to the scheme's grid with the whole rows' scales
    (absmax [out]: scale * the grid's largest code), as floats [out, c]: the twin's quantizer,
    so GPTQ's grid is exactly the one round to nearest uses."""
    q = QUANTIZE[scheme](columns, absmax)
    return dequantize_weight(q, torch.float32)


# --8<-- [start:gptq]
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor,
                  scheme: str = "fp8", damp: float = 0.01,
                  block_size: int = 128) -> QuantizedWeight:
    """W [out, in] (in the dtype the model computes in: the scales are rounded
    to it) and H [in, in] -> the scheme's QuantizedWeight, its codes chosen by
    GPTQ. damp: added to H's diagonal, as a share of its mean, so that H can be
    inverted when some inputs never varied."""
    if scheme not in GPTQ_SCHEMES:
        raise ValueError(f"GPTQ here keeps one scale per output channel: scheme "
                         f"must be one of {GPTQ_SCHEMES}, got {scheme!r}")
    out, n = weight.shape
    if hessian.shape != (n, n):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}; a weight "
                         f"with {n} inputs needs [{n}, {n}]")
    rtn = QUANTIZE[scheme](weight)  # round to nearest: its scales are GPTQ's
    # [out]: what gives float32 columns rtn's scales, already in weight's dtype
    # (for a 16-bit scale, scale * 448 or * 127 and the division back are exact
    # in float32; a float32 scale may come back within one unit of its last bit)
    absmax = rtn.scales.float() * GRID_MAX[scheme]
    H = hessian.to("cpu", torch.float64).clone()  # solved in float64, on the CPU
    if not torch.isfinite(H).all():
        raise ValueError("hessian holds NaN or inf: the layer's calibration "
                         "inputs were not all finite")
    dead = H.diagonal() == 0  # an input that was always 0: its column rounds
    H[dead, dead] = 1.0
    # act order: the inputs with the largest activations first
    order = torch.argsort(H.diagonal(), descending=True)
    W = weight.detach().float()[:, order].clone()  # [out, in], in that order
    H = H[order][:, order]
    H.diagonal().add_(damp * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row j says what rounding column j owes
    # the later columns, once the columns before it are fixed.
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    Hinv = Hinv.to(W.device, torch.float32)
    Q = torch.empty_like(W)  # [out, in]
    for start in range(0, n, block_size):  # lazy batch updates, a block a time
        end = min(start + block_size, n)
        block = W[:, start:end].clone()  # [out, b]
        errors = torch.empty_like(block)  # [out, b]
        for j in range(end - start):
            d = Hinv[start + j]  # [in]
            Q[:, start + j] = _round(block[:, j:j + 1], scheme, absmax)[:, 0]
            errors[:, j] = (block[:, j] - Q[:, start + j]) / d[start + j]
            # the block's later columns absorb it
            block[:, j:] -= errors[:, j:j + 1] * d[start + j:end]
        # and so do the columns after the block, all at once
        W[:, end:] -= errors @ Hinv[start:end, end:]
    Q = Q[:, torch.argsort(order)]  # [out, in], back in the inputs' order
    codes = QUANTIZE[scheme](Q, absmax).qweight  # grid points: their own codes
    return QuantizedWeight(scheme, codes, rtn.scales, None, rtn.shape)
# --8<-- [end:gptq]


def output_error(weight: torch.Tensor, qw: QuantizedWeight,
                 hessian: torch.Tensor) -> float:
    """GPTQ's objective, sum over the calibration rows x of |x (W - Q)^T|^2 =
    trace((W - Q) H (W - Q)^T): how far the quantized layer's outputs moved."""
    diff = (weight.detach().float() - dequantize_weight(qw, torch.float32)).double()
    return float(torch.einsum("oi,ij,oj->", diff, hessian.double(), diff))
