"""A request inside the engine: a sequence group of one or more sequences.

A sequence is the token ids of one continuation (prompt + output so far), its status, and how
many of its tokens already have K/V in the cache (num_computed_tokens). A sequence group is what
a request becomes: its sequences (one for now; several for parallel sampling and beam search),
its sampling parameters, its seed and its arrival order, which decides who is admitted first and
who is preempted first. With n > 1 the group starts as one sequence (the prompt is prefilled
once); after the prompt's step it forks into n sequences that share the prompt's KV blocks.
"""

import enum
import itertools
from dataclasses import dataclass, field

from .beam_search import BeamSearchParams, BeamSearchSequence
from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams

_seq_ids = itertools.count()


def next_seq_id() -> int:
    """A sequence id never used before in this process (block tables are keyed by it)."""
    return next(_seq_ids)


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
    stop_search_from: int = 0  # stop strings are searched in output_text from here on
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    index: int = 0  # which of the request's n samples: it draws from stream seed + index
    detokenizer: IncrementalDetokenizer | None = None  # output text, a few tokens at a time
    # structured outputs: xgrammar's GrammarMatcher, which has accepted exactly
    # output_token_ids (structured_outputs.py); None without a grammar
    matcher: object | None = None
    # speculative decoding: the tokens proposed for the next step (the engine's proposer
    # fills them, the scheduler takes them); never part of token_ids until accepted
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without copying the whole sequence (a decode step reads one
        token of a sequence thousands long)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

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
    sampling_params: SamplingParams | BeamSearchParams
    arrival: int  # admission and preemption order: lower arrived first
    seed: int  # sample i draws its random numbers from stream seed + i (ops/sampling.py)
    prompt: str | None = None
    finished_beams: list[BeamSearchSequence] = field(default_factory=list)  # beam search only
    # With SamplingParams.prompt_logprobs: the prompt's entries so far (prompt_logprobs.py),
    # [None] at first (the first token has no logprob); None when not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # beside it: each token's rank
    grammar: object | None = None  # structured outputs: the compiled grammar (xgrammar's)

    def __post_init__(self):
        if getattr(self.sampling_params, "prompt_logprobs", None) is not None:
            self.prompt_logprobs, self.prompt_token_ranks = [None], [None]

    @property
    def reads_prefix_cache(self) -> bool:
        """May admission take this group's leading blocks from the prefix cache? Not while
        its prompt logprobs are incomplete: a cached block's positions are not computed, so
        they would have no logits (vLLM skips the lookup for such requests altogether; here
        a request preempted by recompute after its prompt's entries are all in reads it)."""
        wanted = self.prompt_logprobs
        return wanted is None or len(wanted) == len(self.seqs[0].prompt_token_ids)

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.sampling_params, BeamSearchParams)

    # --8<-- [start:generator]
    def stream_for(self, index: int) -> int:
        """Sample index's random stream: seed + index, wrapped to a signed 64-bit
        integer."""
        return (self.seed + index + 2**63) % 2**64 - 2**63
    # --8<-- [end:generator]

    @property
    def width(self) -> int:
        """Sequences the request runs at once when fully grown: n samples, or the beams."""
        params = self.sampling_params
        return params.beam_width if self.is_beam_search else params.n

    def max_running_seqs(self) -> int:
        """Sequences this group will run at once: n (or the beam width) once its prompt is
        done, even before the fork, so that max_num_seqs counts what admission commits to."""
        if len(self.seqs) == 1 and not self.seqs[0].output_token_ids:
            return self.width
        return len(self.unfinished_seqs())

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def restart_beams(self) -> None:
        """Beam search preempted by recompute starts over from its prompt, as one root
        sequence: beam search is deterministic, so it finds the same beams again."""
        self.seqs = [Sequence(next_seq_id(), list(self.seqs[0].prompt_token_ids))]
        self.finished_beams = []

    @property
    def streams(self) -> bool:
        """Does the request want its output at every step, not only once it finishes?"""
        params = self.sampling_params
        return not (isinstance(params, SamplingParams) and params.output_kind == "final_only")

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def set_status(self, status: SequenceStatus) -> None:
        for seq in self.unfinished_seqs():
            seq.status = status
