"""accepted_lengths: speculative decoding's verification, one program per proposed run.

A sequence that proposed k tokens d_0..d_{k-1} ran them through the target model beside its
last token, in one forward, and the sampler drew a token t_j from each of the k + 1 rows. The
counter-based sampler makes t_j exactly the token plain decoding would draw at that position
if the sequence so far were its tokens plus d_0..d_{j-1}. So the exact rule (the torch twin,
``pagedllm.reference.ops.spec_decode.accepted_lengths``) is:

    accepted = the length of the leading run of j with d_j == t_j (j < num_draft),

and the sequence emits t_0..t_accepted. Nothing here is random and nothing is approximate:
the kernel returns the twin's integers, never a token of its own.

Why a kernel for a handful of integers: on CUDA the sampled tokens are on the GPU. The twin
runs ``==``, ``&``, ``cumprod`` and ``sum`` as four launches over [B, K] temporaries; this is
one launch that reads each run's targets and proposals once and writes one integer per run,
on the device where the sampler left the tokens.

Grid: one program per run (B of them). A program loads its run's K proposals and first K
targets as one tile of BLOCK_K = next power of two >= K lanes (K is num_speculative_tokens,
at most 64: one tile always holds it), marks each lane that *rejects* — a proposal differing
from the target's token, or a lane past num_draft (no proposal there) — and takes the smallest
rejecting lane. Lanes past K count as rejecting at K, so a run whose every proposal matched
returns K, and K = 0 returns 0. The minimum is the leading run: the twin's cumprod-and-sum
written as one reduction.
"""

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops.spec_decode import accepted_lengths as accepted_lengths_reference

from .runtime import kernel_runner


# --8<-- [start:kernel]
@triton.jit
def _accepted_lengths_kernel(
    target_ptr,                   # [B, K + 1] int64: the target's token at each row of a run
    draft_ptr,                    # [B, K] int64: the proposals, padding past num_draft[b]
    num_draft_ptr,                # [B] int64: how many proposals run b made
    out_ptr,                      # [B] int64: proposals accepted
    stride_target, stride_draft,  # row strides, in elements
    K,                            # proposals per run, padding included
    BLOCK_K: tl.constexpr,
):
    run = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)  # [BLOCK_K]: proposal positions
    in_run = j < K
    target = tl.load(target_ptr + run * stride_target + j, mask=in_run, other=0)
    draft = tl.load(draft_ptr + run * stride_draft + j, mask=in_run, other=0)
    num_draft = tl.load(num_draft_ptr + run)
    kept = (target == draft) & (j < num_draft)  # [BLOCK_K]
    # the first lane that does not keep its proposal; lanes past K reject at K (all kept)
    first_rejected = tl.where(kept | ~in_run, K, j)  # [BLOCK_K]
    tl.store(out_ptr + run, tl.min(first_rejected, axis=0).to(tl.int64))
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def accepted_lengths(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                     num_draft: torch.Tensor) -> torch.Tensor:
    """Triton version of ``pagedllm.reference.ops.spec_decode.accepted_lengths``:
    target_ids [B, K + 1] int64, draft_ids [B, K] int64 (padding past num_draft[b] is
    ignored), num_draft [B] int64 -> [B] int64, how many leading proposals equal the target's
    tokens. The same integers as the twin."""
    runner = kernel_runner(_accepted_lengths_kernel, target_ids, draft_ids, num_draft)
    if runner is None:
        return accepted_lengths_reference(target_ids, draft_ids, num_draft)
    B, K = draft_ids.shape
    if target_ids.shape[0] != B or target_ids.shape[1] < K or num_draft.shape != (B,):
        raise ValueError(f"accepted_lengths: target_ids {tuple(target_ids.shape)} must be "
                         f"[B, K + 1] and num_draft {tuple(num_draft.shape)} [B] for "
                         f"draft_ids [B, K] = {tuple(draft_ids.shape)}")
    out = torch.empty(B, dtype=torch.int64, device=draft_ids.device)  # [B]
    if B == 0:
        return out
    # the last dimension contiguous, int64 (ids may arrive as int32 from a caller)
    target = target_ids.to(torch.int64)
    draft = draft_ids.to(torch.int64)
    target = target if target.stride(-1) == 1 else target.contiguous()
    draft = draft if draft.stride(-1) == 1 or K == 0 else draft.contiguous()
    runner[(B,)](target, draft, num_draft.to(torch.int64).contiguous(), out,
                 target.stride(0), draft.stride(0), K,
                 BLOCK_K=triton.next_power_of_2(max(K, 1)))
    return out
# --8<-- [end:launcher]
