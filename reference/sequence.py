"""A request inside the engine: a sequence group of one or more sequences.

A sequence is the token ids of one continuation (prompt + output so far), its status, and how
many of its tokens already have K/V in the cache (num_computed_tokens). A sequence group is what
a request becomes: its sequences (one for now; several for parallel sampling and beam search),
its sampling parameters, its seed and its arrival order, which decides who is admitted first and
who is preempted first. With n > 1 the group starts as one sequence (the prompt is prefilled
once); after the prompt's step it forks into n sequences that share the prompt's KV blocks.
"""

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: no KV memory yet (new, or preempted by recompute)
    RUNNING = "running"  # holds KV blocks on the GPU, scheduled every step
    SWAPPED = "swapped"  # preempted by swap: its KV blocks wait in the CPU pool
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two sequences with the same tokens are still two
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    output_text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    generator: torch.Generator | None = None  # this sequence's own random stream
    index: int = 0  # which of the request's n samples

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the newest token lacks K/V: a prompt, or a recompute after preemption."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival: int  # admission and preemption order: lower arrived first
    seed: int  # sample i draws from torch.Generator().manual_seed(seed + i)
    prompt: str | None = None

    # --8<-- [start:generator]
    def generator_for(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + index)
    # --8<-- [end:generator]

    def max_running_seqs(self) -> int:
        """Sequences this group will run at once: n once its prompt is done, even before the
        fork, so that max_num_seqs counts what admission really commits to."""
        if len(self.seqs) == 1 and not self.seqs[0].output_token_ids:
            return self.sampling_params.n
        return len(self.unfinished_seqs())

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def set_status(self, status: SequenceStatus) -> None:
        for seq in self.unfinished_seqs():
            seq.status = status
