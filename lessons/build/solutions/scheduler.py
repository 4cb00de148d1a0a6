"""Solution of milestone 3: continuous batching with budgets and preemption by recompute."""

from collections import deque

from build_types import FINISHED, RUNNING, WAITING, ScheduledSeq, SchedulerOutput, Sequence


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._admit(out)
        if not out.scheduled:  # a step that prefills decodes nothing
            self._decode(out)
        return out

    def _admit(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.waiting:
            seq = self.waiting[0]
            left = self.max_num_batched_tokens - out.num_batched_tokens
            if (len(self.running) >= self.max_num_seqs or len(seq) > left
                    or not bm.can_allocate(len(seq), seq.token_ids)):
                break  # first come, first served: nobody jumps the head of the queue
            self.waiting.popleft()
            bm.allocate(seq.seq_id, len(seq), seq.token_ids)
            seq.num_computed_tokens = bm.num_cached_tokens(seq.seq_id)
            seq.status = RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, seq.num_uncomputed_tokens))

    def _decode(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        queue = deque(sorted(self.running, key=lambda s: s.arrival))
        self.running = []
        while queue:
            seq = queue.popleft()
            if out.num_batched_tokens >= self.max_num_batched_tokens:
                self.running.append(seq)  # no budget left this step; it keeps its blocks
                continue
            while not bm.can_append(seq.seq_id):
                victim = queue.pop() if queue else seq  # the latest arrival gives way
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                _, copy = bm.append_slot(seq.seq_id)
                if copy is not None:
                    out.blocks_to_copy.append(copy)
                out.scheduled.append(ScheduledSeq(seq, 1))
                self.running.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq.seq_id)  # all of its blocks: recompute from scratch later
        seq.num_computed_tokens = 0
        seq.status = WAITING
        self.waiting.appendleft(seq)  # it arrived before everyone waiting
        out.preempted.append(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, next_tokens: list[int]) -> None:
        sampling = [item for item in out.scheduled if item.samples]  # before counts move
        if len(next_tokens) != len(sampling):
            raise ValueError(f"{len(next_tokens)} next tokens for {len(sampling)} sequences "
                             "that sample this step")
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.mark_computed(item.seq.seq_id, item.seq.token_ids,
                                             item.seq.num_computed_tokens)
        for item, token in zip(sampling, next_tokens, strict=True):
            seq = item.seq
            seq.output_token_ids.append(int(token))
            if len(seq.output_token_ids) >= seq.max_tokens:
                seq.status = FINISHED
                self.block_manager.free(seq.seq_id)
                self.running.remove(seq)
