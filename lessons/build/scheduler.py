"""Milestone 3 of the build-it track: the scheduler (lessons/build/03-scheduler.md).

Write schedule and update. Check your work with

    pytest lessons/build/test_build_scheduler.py

The scheduler decides, before every step, which sequences run and how many tokens each
computes, and books their KV blocks through the block manager (yours from milestone 2, or
any object with its methods). It touches no tensor. The rules are vLLM's (without chunked
prefill or swapping):

- Continuous batching: the batch is rebuilt every step; a finished sequence's place and
  blocks go to a waiting one at the next step.
- A step either prefills or decodes. It admits waiting sequences and prefills them if it can
  admit any; otherwise it decodes every running sequence by one token.
- First come, first served: sequences are admitted in the order they were added; when the
  first waiting one cannot be admitted, nobody behind it is.
- Budgets per step: at most max_num_seqs sequences running, at most max_num_batched_tokens
  tokens computed (a decode costs 1, a prefill every token it computes; a prefill is never
  split), and the blocks the block manager has. The cached count is known only after
  allocate, so a waiting sequence is admitted only if its whole length, len(seq), fits in
  what the step's budget has left; the step then counts the tokens it computes.
- A decode step decodes the running sequences in arrival order while the token budget
  lasts; those left over when it is spent skip the step, keeping their blocks (no
  preemption).
- A sequence admitted gets blocks for all its tokens, and its num_computed_tokens becomes
  what the block manager reports as cached (prefix caching, milestone 4; 0 before): the
  prefill computes the rest.
- Preemption by recompute: when a running sequence cannot get a slot for its next token, the
  latest-arrived running sequence not yet scheduled this step (possibly itself) gives up all
  its blocks, until the slot is found. A preempted sequence keeps its output tokens, has no
  K/V any more, and waits at the front of the queue; it will be prefilled again, prompt and
  outputs together.
"""

from collections import deque

from build_types import (  # noqa: F401 - what a scheduler works with
    FINISHED,
    RUNNING,
    WAITING,
    ScheduledSeq,
    SchedulerOutput,
    Sequence,
)


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()  # in arrival order, preempted ones in front
        self.running: list[Sequence] = []  # holding blocks
        self.num_preemptions = 0  # sequences preempted so far

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step: the sequences to run with their token counts, in arrival order
        within the step; the sequences preempted; the (src, dst) block copies that
        append_slot asked for. Sets each sequence's status (build_types.WAITING, RUNNING)."""
        raise NotImplementedError("milestone 3: write Scheduler.schedule")

    def update(self, out: SchedulerOutput, next_tokens: list[int]) -> None:
        """After the step's forward: the tokens out scheduled have K/V now.

        next_tokens: one token for each scheduled sequence whose step reached its last token
        (ScheduledSeq.samples), in the order of out.scheduled. Every scheduled sequence's
        num_computed_tokens moves on, and the block manager is told (mark_computed); the
        sampling ones get their token. A sequence with max_tokens output tokens is finished:
        status build_types.FINISHED, blocks freed, no longer running."""
        raise NotImplementedError("milestone 3: write Scheduler.update")
