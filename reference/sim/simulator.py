"""Replay a request trace through a KV allocator, with no model: where does the memory go?

Memory, not arithmetic, limits how many requests an engine can run at once, so the allocator
alone decides the batch size. This simulator runs the bookkeeping of a serving engine step by
step and nothing else:

- arrivals: a request joins the waiting queue at the first step at or after its arrival time;
- decode:   every running request takes the slot of one more token per step;
- admission: first come, first served. The head of the queue is admitted when its memory fits
  (its prompt's slots: prefill); if it does not fit, everyone behind it waits too (head-of-line
  blocking), even a small request that would fit;
- finish:   a request that holds prompt + output tokens is done and frees its memory.

A request with prompt P and output O therefore holds P slots in its admission step and P + k
slots k steps later, and leaves after holding P + O. (A real engine never stores the K/V of the
very last token; counting it keeps the oracle's reservation exact and changes one slot.)

Two allocators:

- contiguous (``max``, ``pow2``, ``oracle``): ``ContiguousAllocator`` reserves a slab at
  admission that already holds every token the request will have, so a running request never
  runs out of room and is never preempted.
- paged: ``BlockSpaceManager`` with a block size. A request takes blocks for its current tokens
  at admission and one more block whenever its last block is full. When no block is free, the
  latest-arrived running request is preempted as vLLM does (recompute: its blocks are freed and
  it goes back to the front of the queue, to be prefilled again with the tokens it had), and no
  new request is admitted in that step. Admission keeps vLLM's watermark free (1 % of the blocks)
  so that a just-admitted request is not preempted at the next step.

Measured per step, after admission (the memory the step's batch runs with), in slots: token
states, reserved, internal fragmentation, external fragmentation and free, as defined in
contiguous_allocator.py. For paged, reserved and external are 0 by construction (nothing is
reserved ahead, and any free block serves any request); internal fragmentation is the empty
slots of allocated blocks (allocated slots - tokens); free is the free blocks plus the slots left
over when total_slots is not a multiple of the block size.

The shares are averaged over the steps in which some request waits for memory
(``measure="waiting"``, the default). Only then is memory the bottleneck: when nobody waits, an
empty slot costs nothing. The benchmark offers more load than any allocator can serve, so almost
every step of the run counts. ``measure="all"`` averages over every step up to the last arrival
instead, so an allocator that keeps up with a light load shows its idle memory as free.
"""

from collections import deque
from dataclasses import dataclass, field

from ..kv.block_manager import BlockSpaceManager
from ..kv.contiguous_allocator import ContiguousAllocator, KVAccounting
from .traces import Request

PARTS = ("token_states", "reserved", "internal", "external", "free")


@dataclass
class Sequence:
    """A request's progress: tokens it holds memory for, and how many it has generated."""

    request: Request
    generated: int = 0

    @property
    def id(self) -> int:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.request.prompt_len + self.generated

    @property
    def finished(self) -> bool:
        return self.generated >= self.request.output_len


class ContiguousKV:
    """The simulator's verbs over a ContiguousAllocator (policy max, pow2 or oracle)."""

    def __init__(self, total_slots: int, policy: str, max_len: int = 2048):
        self.allocator = ContiguousAllocator(total_slots, policy, max_len)
        self.total_slots = total_slots
        self.name = policy

    def check_fits(self, request: Request) -> None:
        need = self.allocator.reservation(request.prompt_len, request.output_len)
        if need > self.total_slots:
            raise ValueError(f"request {request.request_id} reserves {need} slots under policy "
                             f"{self.name!r}, more than the KV budget of {self.total_slots}")

    def can_admit(self, seq: Sequence) -> bool:
        return self.allocator.can_allocate(seq.request.prompt_len, seq.request.output_len)

    def admit(self, seq: Sequence) -> None:
        self.allocator.allocate(seq.id, seq.request.prompt_len, seq.request.output_len)

    def can_grow(self, seq: Sequence) -> bool:
        return True  # the slab was sized for every token the request will have

    def grow(self, seq: Sequence) -> None:
        self.allocator.append_slot(seq.id)

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq.id)

    def accounting(self, head: Sequence | None) -> KVAccounting:
        nxt = None if head is None else (head.request.prompt_len, head.request.output_len)
        return self.allocator.accounting(nxt)


class PagedKV:
    """The simulator's verbs over a BlockSpaceManager: blocks of block_size slots."""

    def __init__(self, total_slots: int, block_size: int = 16, watermark: float = 0.01):
        num_blocks = total_slots // block_size
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {total_slots} slots holds no block of "
                             f"{block_size}; use a smaller block_size or a larger budget")
        self.manager = BlockSpaceManager(block_size, num_blocks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.total_slots = total_slots
        self.watermark_blocks = int(watermark * num_blocks)  # vLLM's default watermark: 1 %
        self.name = f"paged (block {block_size})"

    def check_fits(self, request: Request) -> None:
        need = self.manager.blocks_needed(request.prompt_len + request.output_len)
        if need + self.watermark_blocks > self.num_blocks:
            raise ValueError(f"request {request.request_id} needs {need} blocks of "
                             f"{self.block_size} (+{self.watermark_blocks} watermark), more "
                             f"than the pool of {self.num_blocks}")

    def can_admit(self, seq: Sequence) -> bool:
        needed = self.manager.blocks_needed(seq.num_tokens)  # prompt (+ tokens before preemption)
        return self.manager.num_free_gpu_blocks - needed >= self.watermark_blocks

    def admit(self, seq: Sequence) -> None:
        self.manager.allocate(seq.id, seq.num_tokens)

    def can_grow(self, seq: Sequence) -> bool:
        return self.manager.can_append(seq.id)

    def grow(self, seq: Sequence) -> None:
        self.manager.append_slot(seq.id)

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq.id)

    # --8<-- [start:paged_accounting]
    def accounting(self, head: Sequence | None) -> KVAccounting:
        tokens = sum(t.num_tokens for t in self.manager.tables.values())
        allocated = (self.num_blocks - self.manager.num_free_gpu_blocks) * self.block_size
        # Only the last block of a sequence can have empty slots: internal = allocated - tokens.
        return KVAccounting(token_states=tokens, reserved=0, internal=allocated - tokens,
                            external=0, free=self.total_slots - allocated)
    # --8<-- [end:paged_accounting]


def make_kv(allocator: str, total_slots: int, max_len: int = 2048,
            block_size: int = 16) -> ContiguousKV | PagedKV:
    """"max", "pow2", "oracle" (contiguous) or "paged"."""
    if allocator == "paged":
        return PagedKV(total_slots, block_size)
    return ContiguousKV(total_slots, allocator, max_len)  # an unknown policy raises there


@dataclass
class SimResult:
    allocator: str
    total_slots: int
    steps: int  # steps until every request finished
    measured_steps: int  # steps averaged over (by default those in which a request waited)
    finished: int
    preemptions: int
    mean_running: float  # requests holding memory, averaged over the measured steps
    shares: dict[str, float] = field(default_factory=dict)  # part -> fraction of total_slots


# --8<-- [start:simulator]
class Simulator:
    """FCFS replay of a trace through one allocator, one decode step at a time."""

    def __init__(self, trace: list[Request], kv: ContiguousKV | PagedKV,
                 measure: str = "waiting"):
        if measure not in ("waiting", "all"):
            raise ValueError(f"measure must be 'waiting' or 'all', got {measure!r}")
        for request in trace:
            kv.check_fits(request)  # a request that can never fit would wait forever
        self.kv = kv
        self.measure = measure
        self.last_arrival = max((r.arrival for r in trace), default=0.0)
        self.pending = deque(sorted(trace, key=lambda r: (r.arrival, r.request_id)))
        self.waiting: deque[Sequence] = deque()
        # in arrival order: the last is preempted first
        self.running: list[Sequence] = []
        self.step_index = 0
        self.finished = 0
        self.preemptions = 0
        self.sums = dict.fromkeys(PARTS, 0)  # slot-steps, over measured steps
        self.running_sum = 0
        self.measured_steps = 0

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def step(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step_index:
            self.waiting.append(Sequence(self.pending.popleft()))
        preempted = self._decode()
        if not preempted:
            self._admit()
        measuring = (bool(self.waiting) if self.measure == "waiting"
                     else self.step_index <= self.last_arrival)
        if measuring:
            self._measure()  # by default: only while memory is the bottleneck
        for seq in self.running:
            if seq.finished:
                self.kv.free(seq)
                self.finished += 1
        self.running = [s for s in self.running if not s.finished]
        self.step_index += 1

    def _decode(self) -> bool:
        """One more token's slot for every request that ran last step; True if any was
        evicted."""
        preempted = False
        grown = []
        while self.running:
            seq = self.running.pop(0)  # oldest first
            while not self.kv.can_grow(seq):  # paged only: no free block
                # the latest arrival gives way
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.kv.grow(seq)
                seq.generated += 1
                grown.append(seq)
        self.running = grown
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        # recompute: drop its K/V; it is prefilled again with all its tokens
        self.kv.free(seq)
        self.waiting.appendleft(seq)  # it arrived before everyone waiting
        self.preemptions += 1

    def _admit(self) -> None:
        # FCFS: only the head of the line is considered
        while self.waiting and self.kv.can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            self.kv.admit(seq)
            self.running.append(seq)
    # --8<-- [end:simulator]

    def _measure(self) -> None:
        parts = self.kv.accounting(self.waiting[0] if self.waiting else None)
        for name in PARTS:
            self.sums[name] += getattr(parts, name)
        self.running_sum += len(self.running)
        self.measured_steps += 1

    def run(self, max_steps: int = 10_000_000) -> SimResult:
        while not self.done:
            if self.step_index >= max_steps:
                raise RuntimeError(f"trace not finished after {max_steps} steps")
            self.step()
        return self.result()

    def result(self) -> SimResult:
        n = max(self.measured_steps, 1)
        shares = {name: total / (n * self.kv.total_slots) for name, total in self.sums.items()}
        return SimResult(self.kv.name, self.kv.total_slots, self.step_index, self.measured_steps,
                         self.finished, self.preemptions, self.running_sum / n, shares)


def simulate(trace: list[Request], allocator: str, total_slots: int, max_len: int = 2048,
             block_size: int = 16, measure: str = "waiting") -> SimResult:
    """Replay trace through one allocator ("max", "pow2", "oracle" or "paged") to the end."""
    return Simulator(trace, make_kv(allocator, total_slots, max_len, block_size), measure).run()
