"""logit_bias and the three penalties as one Triton kernel: an elementwise pass over the logits.

**What it computes.** Exactly what its twin ``pagedllm.reference.ops.sampling.apply_penalties``
computes, for logits ``[S, vocab]`` float32 and each row's parameters, in vLLM's order::

    x = logit + bias                                  # logit_bias (0 for most tokens)
    x = x / r if x > 0 else x * r                     # repetition_penalty r, seen tokens only
                                                      # (an overflow -> +-FLOAT32_MAX: saturate)
    x = x - f * count                                 # frequency_penalty f, output count
    x = x - p * (count > 0)                           # presence_penalty p

**What runs in torch, and why.** The dense per-token inputs — the bias, whether a token was
seen in the prompt or the output, how many times it was generated — are scatters of a few
token ids into rows of zeros; the launcher builds them with the twin's own ``penalty_tensors``
(vLLM builds its bin counts the same way, with ``scatter_add``). The kernel then does the
arithmetic in one pass, one program per (row, tile of ``BLOCK`` tokens), instead of the twin's
five full passes over ``[S, vocab]``.

**How exact is exact.** Bit for bit: each step is one IEEE operation rounded to float32, in the
twin's order. Triton's ``/`` on float32 is an approximate division on NVIDIA GPUs, so the kernel
divides with ``tl.div_rn``; and the compiler may fuse ``x - f * count`` into one fused
multiply-add (one rounding instead of two), so the launcher turns that off
(``enable_fp_fusion=False``). The penalties therefore never make two tiers or two devices
disagree.
"""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import interpreting, kernel_runner
from pagedllm.reference.ops.sampling import FLOAT32_MAX, Penalties, penalty_tensors
from pagedllm.reference.ops.sampling import apply_penalties as reference_apply_penalties

BLOCK = 1024  # tokens per program
_FLOAT32_MAX = tl.constexpr(FLOAT32_MAX)  # exact in float32
_INF = tl.constexpr(float("inf"))


@triton.jit
def saturate(y, x):
    """The twin's ``saturate``: y (= x / a or x * a, a > 0) clamped to float32's range where x
    is finite (an overflow to +-inf becomes +-FLOAT32_MAX); where x is +-inf or NaN, y as is.
    The sampler's kernel uses it too, after its division by the temperature."""
    return tl.where(tl.abs(x) < _INF, tl.minimum(tl.maximum(y, -_FLOAT32_MAX), _FLOAT32_MAX), y)


# --8<-- [start:penalties_kernel]
@triton.jit
def _penalties_kernel(
    logits_ptr, out_ptr,  # [S, vocab] float32 each, contiguous
    bias_ptr,  # [S, vocab] float32
    seen_ptr,  # [S, vocab] int8: 1 where the token is in the prompt or the output
    counts_ptr,  # [S, vocab] int32: times the token was generated
    repetition_ptr, presence_ptr, frequency_ptr,  # [S] float32 each
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    at = row.to(tl.int64) * vocab + tokens
    x = tl.load(logits_ptr + at, mask=inside, other=0.0)
    x = x + tl.load(bias_ptr + at, mask=inside, other=0.0)
    seen = tl.load(seen_ptr + at, mask=inside, other=0) != 0
    r = tl.where(seen, tl.load(repetition_ptr + row), 1.0)
    x = saturate(tl.where(x > 0, tl.div_rn(x, r), x * r), x)
    count = tl.load(counts_ptr + at, mask=inside, other=0)
    x = x - tl.load(frequency_ptr + row) * count.to(tl.float32)
    x = x - tl.load(presence_ptr + row) * (count > 0).to(tl.float32)
    tl.store(out_ptr + at, x, mask=inside)
# --8<-- [end:penalties_kernel]


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """logits [S, vocab] float32 -> the logits after logit_bias and the penalties; the
    twin's signature and bits."""
    pen = penalties
    runner = kernel_runner(_penalties_kernel, logits, pen.repetition, pen.presence,
                           pen.frequency)
    if runner is None:
        return reference_apply_penalties(logits, penalties)
    logits = logits.float().contiguous()
    S, vocab = logits.shape
    out = torch.empty_like(logits)
    if S and vocab:
        bias, seen, counts = penalty_tensors(pen, vocab)  # [S, vocab] each
        compiled = {} if interpreting() else {"enable_fp_fusion": False}
        runner[(S, triton.cdiv(vocab, BLOCK))](
            logits, out, bias.contiguous(), seen.to(torch.int8).contiguous(),
            counts.to(torch.int32).contiguous(), pen.repetition.float().contiguous(),
            pen.presence.float().contiguous(), pen.frequency.float().contiguous(), vocab,
            BLOCK=BLOCK, **compiled)
    return out
