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


def verify_runs(target_ids: list[list[int]], draft_ids: list[list[int]]) -> list[int]:
    """The rule over plain lists (one run per sequence, len(target) == len(draft) + 1),
    through the tensor op: the scheduler's call."""
    if not target_ids:
        return []
    K = max(len(d) for d in draft_ids)
    target = torch.tensor([t + [-1] * (K + 1 - len(t)) for t in target_ids],
                          dtype=torch.int64)  # [B, K + 1]
    draft = torch.tensor([d + [-2] * (K - len(d)) for d in draft_ids],
                         dtype=torch.int64).reshape(len(draft_ids), K)  # [B, K]
    num = torch.tensor([len(d) for d in draft_ids], dtype=torch.int64)  # [B]
    return accepted_lengths(target, draft, num).tolist()
