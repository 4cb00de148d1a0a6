"""Structured outputs' token bitmask on the logits, as one Triton kernel: an elementwise pass.

**What it computes.** Exactly what its twin ``pagedllm.reference.ops.sampling.apply_token_bitmask``
computes, out of place: for logits ``[S, vocab]`` float32 and the grammars' bitmask ``[S, W]``
int32 (token t is bit ``t % 32`` of word ``t // 32``, xgrammar's layout), every token whose bit
is 0 becomes -inf and every other logit is copied as it is, so the result is bit for bit the
twin's. One program per (row, tile of ``BLOCK`` tokens) reads the tile's logits and the
``BLOCK / 32`` words that cover it.

**Why not xgrammar's kernel.** xgrammar ships ``apply_token_bitmask_inplace`` (CUDA, Triton and
CPU backends). It writes into the logits in place, and the sampler still needs the raw logits
for the logprobs it reports, so it would need a copy anyway; and a kernel of this package is
compiled for every GPU target by ``compile_check`` and tested against its twin under the
interpreter, which a library's internal kernel is not. The twin is tested against xgrammar's
own function (``tests/unit/test_token_bitmask.py``), so all three agree.
"""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import kernel_runner
from pagedllm.reference.ops.sampling import apply_token_bitmask as reference_apply_token_bitmask

BLOCK = 1024  # tokens per program: 32 int32 words of the bitmask
_NEG_INF = tl.constexpr(float("-inf"))


# --8<-- [start:token_bitmask_kernel]
@triton.jit
def _token_bitmask_kernel(
    logits_ptr, out_ptr,  # [S, vocab] float32 each, contiguous
    bitmask_ptr,  # [S, words] int32, contiguous: bit t % 32 of word t // 32 is token t
    vocab, words,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    at = row.to(tl.int64) * vocab + tokens
    x = tl.load(logits_ptr + at, mask=inside, other=0.0)
    word = tl.load(bitmask_ptr + row.to(tl.int64) * words + tokens // 32, mask=inside,
                   other=0)
    allowed = ((word >> (tokens % 32)) & 1) != 0  # & 1: >> on int32 copies the sign bit in
    tl.store(out_ptr + at, tl.where(allowed, x, _NEG_INF), mask=inside)
# --8<-- [end:token_bitmask_kernel]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, vocab] -> the same with -inf where the bitmask forbids the token; the
    twin's signature and bits."""
    runner = kernel_runner(_token_bitmask_kernel, logits, bitmask)
    if runner is None:
        return reference_apply_token_bitmask(logits, bitmask)
    logits = logits.float().contiguous()
    bitmask = bitmask.to(torch.int32).contiguous()
    S, vocab = logits.shape
    out = torch.empty_like(logits)
    if S and vocab:
        runner[(S, triton.cdiv(vocab, BLOCK))](logits, out, bitmask, vocab, bitmask.shape[1],
                                               BLOCK=BLOCK)
    return out
