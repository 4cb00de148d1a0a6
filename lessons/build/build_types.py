"""The build-it track's shared types: what its pieces hand each other. Given: nothing to write.

    Sequence          one request: its prompt, the tokens generated so far, and how many of its
                      tokens already have K/V in the cache
    ScheduledSeq      one sequence in one step, and how many of its tokens the step computes
    SchedulerOutput   the scheduler's decision for one step (milestone 3)
    StepInputs        the step's flat tensors (milestone 5)
    Parts             one implementation of every piece; the engine (milestone 7) is built from
                      a Parts, so that each piece can be yours or the solution's

The names follow vLLM and pagedllm's reference tier (reference/engine/sequence.py,
reference/engine/scheduler.py, reference/engine/step_inputs.py), cut down to what a greedy
engine without swapping or beams needs. Parallel sampling has no type of its own: for its
requests of n = 2 samples, milestone 7's test forks each sequence after its prefill into a
second Sequence that shares its blocks (BlockManager.fork), and both decode greedily.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)  # identity: two requests with the same prompt are still two
class Sequence:
    seq_id: int  # unique; the block manager keys its block tables by it
    prompt_token_ids: list[int]
    max_tokens: int  # the request finishes once it has generated this many tokens
    arrival: int  # admission and preemption order: lower arrived first
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    status: str = WAITING  # WAITING (no blocks), RUNNING (holds blocks) or FINISHED

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computed this step, from position seq.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """Does this step reach the sequence's last token, so that a next token is drawn?
        (Read it before the step's update moves num_computed_tokens on.)"""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # in the order they run
    preempted: list[Sequence] = field(default_factory=list)  # gave up their blocks this step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)


@dataclass
class StepInputs:
    """B sequences scheduled, T tokens computed, S of the sequences sample a next token."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache once this step's are stored
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b's rows are [b]:[b + 1]
    logits_indices: torch.Tensor  # [S] int64: the rows whose logits are sampled


@dataclass
class Parts:
    """One implementation of every piece of the track. origin says whose each piece is."""

    allocate_kv_cache: Callable  # milestone 1, kv_cache.py
    store_kv: Callable
    paged_attention: Callable
    copy_blocks: Callable
    BlockManager: type  # milestone 2 (and 4), block_manager.py
    Scheduler: type  # milestone 3, scheduler.py
    PrefixCache: type  # milestone 4, prefix_cache.py
    build_step_inputs: Callable  # milestone 5, step_inputs.py
    sample: Callable  # milestone 6, sampler.py
    origin: dict[str, str] = field(default_factory=dict)  # piece -> "yours" | "solution (...)"
