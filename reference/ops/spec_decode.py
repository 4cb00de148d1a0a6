"""Speculative decoding's verification: how many proposed tokens a sequence keeps.

A sequence proposed k tokens d_0..d_{k-1} (an n-gram match, a draft model). One forward of the
target model over its last token and the k proposals gives k + 1 logits rows; the sampler draws
from row j exactly the token plain decoding would draw at that output position *if* the
sequence so far were its tokens plus d_0..d_{j-1} (the counter-based race: a token is a
function of the logits and of (stream, position, token id), never of a generator's state). So
the rule is exact:

    accept d_j while it equals the target's token t_j (j = 0, 1, ...);
    at the first j where they differ (or j = k: all accepted), take t_j itself.

The sequence gains a + 1 tokens, t_0..t_a (a = the accepted count), and they are token for
token the ones plain decoding would have produced, greedy or seeded — not merely tokens of the
same distribution (a rejection sampler, vLLM's, keeps only the distribution).
"""

from collections.abc import Callable

import torch


# --8<-- [start:verify]
def accepted_lengths(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                     num_draft: torch.Tensor) -> torch.Tensor:
    """target_ids [B, K + 1] int64: the target's token at each of a run's rows;
    draft_ids [B, K] int64: the proposals (padding past num_draft[b] is ignored);
    num_draft [B] int64 -> [B] int64: how many leading proposals equal the target's
    tokens. Run b emits target_ids[b, :accepted[b] + 1]."""
    K = draft_ids.shape[1]
    proposed = torch.arange(K, device=draft_ids.device) < num_draft[:, None]  # [B, K]
    match = (target_ids[:, :K] == draft_ids) & proposed  # [B, K]
    return torch.cumprod(match.long(), dim=1).sum(dim=1)  # [B]: the leading run of matches
# --8<-- [end:verify]


def verify_runs(token_ids: torch.Tensor, first_rows: list[int], draft_ids: list[list[int]],
                accepted_lengths: Callable = accepted_lengths) -> list[int]:
    """The scheduler's call: token_ids [S] are the step's sampled tokens, where the sampler
    left them (on the GPU on CUDA); run b's k_b + 1 rows are first_rows[b], first_rows[b] + 1,
    ... and draft_ids[b] its k_b proposals. Returns each run's accepted count.

    The runs are gathered into the op's padded [B, K + 1] / [B, K] form on token_ids' device,
    and ``accepted_lengths`` (the backend's op: this twin, or the Triton kernel on CUDA)
    verifies them there: one launch over the step's runs, and only the B counts come back."""
    if not first_rows:
        return []
    B, K = len(draft_ids), max(len(d) for d in draft_ids)
    device = token_ids.device
    rows = torch.tensor(first_rows)[:, None] + torch.arange(K + 1)  # [B, K + 1]
    # a shorter run's padding rows may run past the last row: they are never compared
    rows = rows.clamp(max=token_ids.shape[0] - 1).to(device)  # [B, K + 1]
    target = token_ids.long()[rows]  # [B, K + 1]
    draft = torch.tensor([d + [-1] * (K - len(d)) for d in draft_ids],
                         dtype=torch.int64).reshape(B, K).to(device)  # [B, K]
    num = torch.tensor([len(d) for d in draft_ids], dtype=torch.int64).to(device)  # [B]
    return accepted_lengths(target, draft, num).tolist()
