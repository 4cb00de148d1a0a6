"""What speculation achieved, with vLLM's metric names (``vllm:spec_decode_*``, here
``pagedllm:spec_decode_*`` on /metrics and ``spec_decode_*`` in ``stats()``)."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_drafts: int = 0  # verification runs (a sequence with at least one proposal, one step)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposals equal to the target's own tokens
    # accepted_per_pos[j]: runs whose proposal j was accepted (j < num_speculative_tokens)
    accepted_per_pos: list[int] = field(default_factory=list)
    proposals_per_pos: list[int] = field(default_factory=list)  # runs that proposed a j-th

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        grow = num_draft - len(self.proposals_per_pos)
        if grow > 0:
            self.proposals_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for j in range(num_draft):
            self.proposals_per_pos[j] += 1
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def stats(self) -> dict:
        """stats()'s entries. acceptance_rate: accepted / proposed; mean_accepted_length:
        tokens a verification run emits on average, 1 + accepted / drafts (vLLM's "mean
        acceptance length")."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_num_draft_tokens_per_pos": list(self.proposals_per_pos),
            "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                            if self.num_draft_tokens else 0.0),
            "spec_decode_mean_accepted_length": (1 + self.num_accepted_tokens / self.num_drafts
                                                 if self.num_drafts else 0.0),
        }
