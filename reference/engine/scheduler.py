"""Which tokens run in the next step: iteration-level (continuous) batching with preemption.

Every step the scheduler rebuilds the batch. Finished requests left at the end of the last step
(their memory is already free), so a waiting request can take their place now instead of
waiting for the whole batch to finish — the fix for request-level batching.

The rules, vLLM's:

- First come, first served: requests are admitted in arrival order; if the head of the queue
  does not fit, nobody behind it jumps ahead.
- Budgets per step: at most max_num_seqs sequences running, at most max_num_batched_tokens
  tokens computed (a decode costs 1, a prefill its prompt or its chunk), and the KV pool.
- Preemption: when a running request cannot get a slot for its next token, the latest-arrived
  running request gives up its memory, all of it (all-or-nothing), until the slot is found. By
  ``recompute`` (free its blocks, queue it at the front, prefill prompt + generated tokens
  again later) or ``swap`` (move its blocks to the CPU pool; bring them back as soon as blocks
  free up; while any request is swapped out, no new request is admitted).
- Without chunked prefill, a step either prefills newly admitted prompts or decodes the running
  ones (prefills first): a long prompt stalls every decode for a step. With chunked prefill,
  running decodes go first and prefills fill the rest of the token budget in chunks.
- Static batching (the traditional baseline): take up to max_num_seqs requests, run them until
  the last one finishes, padded to the longest prompt, then take the next batch.

The scheduler decides and books; it touches no tensor. Its output lists the sequences to run and
how many tokens each, and the data moves its decisions require — blocks to swap out, to swap
in, to copy (copy-on-write) — which the model runner carries out before the forward.

After the forward, ``update_from_output`` is the one place the step's results change the
requests and their KV bookkeeping: the tokens computed, the sampled tokens appended (text, stop
checks and grammars by the output processor), n > 1 prompts forked, beams selected, what
finished freed. vLLM V1's ``Scheduler.update_from_output``; nano-vllm's ``postprocess``.
"""

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ops.spec_decode import accepted_lengths, verify_runs
from ..spec_decode.metrics import SpecDecodeMetrics
from .beam_step import beam_step
from .output_processor import OutputProcessor
from .outputs import ModelRunnerOutput
from .prompt_logprobs import collect_prompt_logprobs
from .sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: str = "recompute"  # or "swap"
    enable_chunked_prefill: bool = False
    batching: str = "continuous"  # or "static"


@dataclass
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_tokens: int  # tokens computed this step, from position seq.num_computed_tokens on
    # speculative decoding: proposed tokens computed after them (their slots are booked as
    # lookahead); the step's logits at each say whether it is kept (update_from_output)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Does this step reach the sequence's last token, so that a next token is drawn?"""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


# --8<-- [start:scheduler_output]
@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # static batching's wasted rows
    padding_rows: list[int] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    # (gpu, cpu), (cpu, gpu) and (src, dst) block pairs
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
# --8<-- [end:scheduler_output]

    def add(self, group: SequenceGroup, seq: Sequence, num_tokens: int,
            spec_token_ids: list[int] | None = None) -> None:
        spec = spec_token_ids or []
        self.scheduled.append(ScheduledSeq(group, seq, num_tokens, spec))
        self.num_batched_tokens += num_tokens + len(spec)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv,
                 output_processor: OutputProcessor | None = None,
                 verify_op: Callable = accepted_lengths):
        self.config = config
        self.kv = kv  # PagedKVCacheManager or ContiguousKVCacheManager: bookkeeping only
        # the sampled tokens' text, stops and grammars (update_from_output)
        self.output_processor = output_processor or OutputProcessor(None, None,
                                                                    config.max_model_len)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.counters = Counter()  # preemptions by mode, swaps, prefill and decode tokens
        self.spec_metrics = SpecDecodeMetrics()  # proposals made and kept
        # speculative runs are verified by the runner's backend (its accepted_lengths: the
        # torch twin, or the Triton kernel on the GPU where the sampled tokens are)
        self.verify_op = verify_op

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def groups(self):
        return [*self.waiting, *self.running, *self.swapped]

    def remove(self, group: SequenceGroup) -> None:
        """Take a group out of whichever queue holds it and release its memory."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self.kv.free(group)  # frees only what it holds: nothing for a waiting group

    def groups_holding_memory(self) -> list[SequenceGroup]:
        return [*self.running, *self.swapped]

    def abort(self, group: SequenceGroup, reason: str = "abort") -> None:
        """End a request now (aborted, or its step failed): out of its queue, its memory
        freed, its unfinished sequences finished with `reason`."""
        self.remove(group)
        for seq in group.unfinished_seqs():
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.finish_static_batch_if_done()

    # --8<-- [start:update_from_output]
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[SequenceGroup]:
        """After the forward, the one place its results change the requests and their KV:
        the scheduled tokens are computed (counts move on; full blocks become findable by
        later prompts), prompt rows give their prompt logprobs, the sampled tokens join
        their sequences (n > 1 prompts fork first, beams are selected, stops and grammars
        are checked), and what finished frees its blocks. Returns the requests the step
        touched, for the engine to turn into outputs."""
        for item in scheduler_output.scheduled:
            kind = "prefill_tokens" if item.seq.is_prefill else "decode_tokens"
            self.counters[kind] += item.num_tokens
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.mark_computed(item.seq)
        collect_prompt_logprobs(runner_output.prompt_rows, runner_output.prompt_logits)
        self._append_sampled(runner_output)
        touched = list(dict.fromkeys(item.group for item in scheduler_output.scheduled))
        self.finish_requests(touched)
        return touched

    # --8<-- [start:append_sampled]
    def _append_sampled(self, runner_output: ModelRunnerOutput) -> None:
        output, sampled = runner_output, runner_output.sampled
        tokens, logprobs = sampled.token_ids.tolist(), sampled.logprobs.tolist()
        top_ids, top_lps = sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist()
        samples: dict[int, dict[int, Sequence]] = {}  # prompt's seq id -> index -> sample
        for row in output.rows:  # a prompt of n > 1 samples forks before any token is added
            seq = row.item.seq
            if row.sample_index != seq.index and seq.seq_id not in samples:
                samples[seq.seq_id] = self._fork_samples(row.item.group, seq)
        # first row of a run -> proposals kept (verified where the sampler left the tokens)
        accepted = self._verify(output.rows, sampled.token_ids)
        beam_rows: dict[SequenceGroup, list[int]] = {}
        for r, row in enumerate(output.rows):
            group, seq = row.item.group, row.item.seq
            if group.is_beam_search:
                beam_rows.setdefault(group, []).append(r)
                continue
            if row.offset:
                continue  # a later row of a speculative run: taken with its first row
            seq = samples.get(seq.seq_id, {}).get(row.sample_index, seq)
            num_logprobs = group.sampling_params.logprobs
            # a plain row emits its token; a run of k proposals its first accepted + 1
            kept = accepted.get(r, 0)
            for j in range(kept + 1):
                top = (dict(zip(top_ids[r + j][:num_logprobs], top_lps[r + j][:num_logprobs],
                                strict=True)) if num_logprobs else {})
                self.output_processor.append_token(group, seq, tokens[r + j],
                                                   logprobs[r + j], top)
                if seq.is_finished:
                    break  # a stop inside the run: the tokens after it are not emitted
                if j < kept:
                    seq.num_computed_tokens += 1  # an accepted proposal: its K/V is in place
            if r in accepted and not seq.is_finished:
                # the rejected proposals' slots go back; the full blocks of accepted tokens
                # become findable (the prefix cache never sees a rejected token)
                self.kv.truncate_slots(seq, seq.num_computed_tokens)
                self.kv.mark_computed(seq)
            if seq.is_finished and not group.is_finished:
                self.kv.free_seq(seq)  # a finished sample's blocks go back now
        for group, rows in beam_rows.items():
            beam_step(group, output.logits[rows], self.kv, self.output_processor.eos_token_id,
                      self.output_processor.max_model_len)

    def _verify(self, rows: list, token_ids) -> dict[int, int]:
        """Speculative runs: {first row: proposals accepted}, by the exact rule
        (ops/spec_decode.py): proposal j is kept while it equals the token the target drew
        at row j. A run's rows are consecutive, offsets 0..k; token_ids [S] is the sampler's
        tensor."""
        firsts = [r for r, row in enumerate(rows) if row.offset == 0
                  and row.item.spec_token_ids]
        drafts = [rows[r].item.spec_token_ids for r in firsts]
        kept = verify_runs(token_ids, firsts, drafts, self.verify_op)
        accepted = dict(zip(firsts, kept, strict=True))
        for r, draft in zip(firsts, drafts, strict=True):
            self.spec_metrics.observe(len(draft), accepted[r])
            self.counters["decode_tokens"] += accepted[r]  # computed: their K/V are kept
        return accepted
    # --8<-- [end:append_sampled]

    # --8<-- [start:fork_samples]
    def _fork_samples(self, group: SequenceGroup, seq: Sequence) -> dict[int, Sequence]:
        """After the prompt of an n > 1 request, n - 1 children fork from the parent,
        sharing every prompt block (reference counts up, nothing copied); child i draws
        from stream seed + i."""
        for index in range(1, group.sampling_params.n):
            child = Sequence(next_seq_id(), list(seq.prompt_token_ids),
                             num_computed_tokens=seq.num_computed_tokens,
                             status=SequenceStatus.RUNNING, index=index,
                             # its own parser, in the parent's state (no token yet)
                             matcher=None if seq.matcher is None else seq.matcher.fork())
            self.kv.fork(seq, child)
            group.seqs.append(child)
        return {s.index: s for s in group.seqs}
    # --8<-- [end:fork_samples]

    def finish_requests(self, groups: list[SequenceGroup]) -> None:
        """The step's finished groups leave; their memory is free for the next step (a static
        batch keeps its memory until its last member finishes)."""
        if self.config.batching == "continuous":
            for group in groups:
                if group.is_finished:
                    self.remove(group)
        self.finish_static_batch_if_done()
    # --8<-- [end:update_from_output]

    # --8<-- [start:schedule]
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.batching == "static":
            return self._schedule_static(out)
        if not self.config.enable_chunked_prefill:
            # prefills first; a step that admits prompts decodes nothing
            if not self.swapped:
                self._admit(out, chunked=False)
                if out.scheduled:
                    return out
            self._schedule_running(out)
            if not out.preempted:
                self._swap_in(out)
            return out
        self._schedule_running(out)  # decodes (and unfinished prefill chunks) first
        if not out.preempted:
            self._swap_in(out)
        if not self.swapped and not out.preempted:
            self._admit(out, chunked=True)  # prompts fill what is left of the token budget
        return out
    # --8<-- [end:schedule]

    def _num_running_seqs(self) -> int:
        return sum(g.max_running_seqs() for g in self.running)

    def _tokens_left(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.num_batched_tokens

    # --8<-- [start:running]
    def _schedule_running(self, out: SchedulerOutput) -> None:
        queue = deque(sorted(self.running, key=lambda g: g.arrival))
        self.running = []
        while queue:
            group = queue.popleft()
            seqs = group.unfinished_seqs()
            prefilling = [s for s in seqs if s.is_prefill]
            if prefilling:  # chunked prompts (or a recomputed group's prompts) not done yet
                for seq in prefilling:
                    self._make_room_for_chunk(group, seq, queue, out)
                    self._add_prefill(out, group, seq)
                self.running.append(group)
                continue
            if self._tokens_left(out) < len(seqs):
                self.running.append(group)  # no budget this step; it keeps its memory
                continue
            spec = self._lookahead(group, seqs, out)  # proposals that fit: no preemption
            while not self.kv.can_allocate_slots(group):
                victim = queue.pop() if queue else group  # the latest arrival gives way
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                for seq, proposals in zip(seqs, spec, strict=True):
                    out.blocks_to_copy += self.kv.allocate_slots(seq, 1, len(proposals))
                    out.add(group, seq, 1, proposals)
                self.running.append(group)
    # --8<-- [end:running]

    # --8<-- [start:lookahead]
    def _lookahead(self, group: SequenceGroup, seqs: list[Sequence],
                   out: SchedulerOutput) -> list[list[int]]:
        """Each sequence's proposals for this step (taken from seq.spec_token_ids, which the
        engine's proposer filled): cut to the token budget, and dropped altogether when the
        pool cannot book their lookahead slots now — speculation never preempts anyone."""
        spare = self._tokens_left(out) - len(seqs)  # after one token each
        spec = []
        for seq in seqs:
            proposals = seq.spec_token_ids[:max(spare, 0)]
            seq.spec_token_ids = []
            spare -= len(proposals)
            spec.append(proposals)
        k = max(map(len, spec), default=0)
        if k and not self.kv.can_allocate_slots(group, 1, k):
            return [[] for _ in seqs]
        return spec
    # --8<-- [end:lookahead]

    # --8<-- [start:admit]
    def _admit(self, out: SchedulerOutput, chunked: bool) -> None:
        while self.waiting:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()  # several only when a forked group is recomputed
            # Without chunking a sequence's prefill runs whole, so its longest one must
            # fit; a recomputed forked group may spread its sequences' prefills over
            # several steps (all n together could need more than the budget, and would
            # never be admitted). A sequence's uncomputed tokens: its prompt (+ output to
            # redo).
            longest = max(s.num_uncomputed_tokens for s in seqs)
            seqs_after = self._num_running_seqs() + group.max_running_seqs()
            if seqs_after > self.config.max_num_seqs:
                break
            left = self._tokens_left(out)
            too_long = not chunked and longest > left
            if left == 0 or too_long or not self.kv.can_admit(group, left):
                break  # FCFS: whoever is behind the head waits too
            self.waiting.popleft()
            self.running.append(group)
            for seq, blocks in zip(seqs, self.kv.admit(group), strict=True):
                seq.num_computed_tokens = blocks.num_cached_tokens  # no prefill for those
            group.set_status(SequenceStatus.RUNNING)
            for seq in seqs:
                self._add_prefill(out, group, seq)
    # --8<-- [end:admit]

    def _chunk(self, out: SchedulerOutput, seq: Sequence) -> int:
        """What fits of the sequence's uncomputed tokens this step: a chunk with chunked
        prefill, else all of them or (when the budget is spent) none."""
        n = min(seq.num_uncomputed_tokens, self._tokens_left(out))
        whole = self.config.enable_chunked_prefill or n == seq.num_uncomputed_tokens
        return n if n > 0 and whole else 0

    def _add_prefill(self, out: SchedulerOutput, group: SequenceGroup, seq: Sequence) -> None:
        """Schedule the sequence's next chunk. Where the pool books per chunk (a windowed KV
        cache group) its slots are booked now, if the pool has them; else it waits a step,
        keeping what it holds."""
        n = self._chunk(out, seq)
        if n == 0:
            return
        if self.kv.books_per_chunk:
            if not self.kv.can_allocate_slots(group, n, seqs=[seq]):
                return
            out.blocks_to_copy += self.kv.allocate_slots(seq, n)
        out.add(group, seq, n)

    def _make_room_for_chunk(self, group: SequenceGroup, seq: Sequence, queue: deque,
                             out: SchedulerOutput) -> None:
        """Where the pool books per chunk, a running prompt short of blocks for its next chunk
        preempts the latest arrivals behind it, as a decode does: the earliest prompt always
        goes on, so the step never stalls with every prompt waiting on another."""
        n = self._chunk(out, seq)
        while (self.kv.books_per_chunk and n and queue
               and not self.kv.can_allocate_slots(group, n, seqs=[seq])):
            self._preempt(queue.pop(), out)

    # --8<-- [start:swap_in]
    def _swap_in(self, out: SchedulerOutput) -> None:
        self.swapped.sort(key=lambda g: g.arrival)
        while self.swapped:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            if (self._num_running_seqs() + len(seqs) > self.config.max_num_seqs
                    or self._tokens_left(out) < len(seqs) or not self.kv.can_swap_in(group)):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += self.kv.swap_in(group)
            self.counters["swap_ins"] += 1
            group.set_status(SequenceStatus.RUNNING)
            for seq in seqs:
                if seq.is_prefill:  # swapped out halfway through a chunked prompt: go on with it
                    self._add_prefill(out, group, seq)
                else:
                    self._append(seq, out)
                    out.add(group, seq, 1)
            self.running.append(group)
    # --8<-- [end:swap_in]

    def _append(self, seq: Sequence, out: SchedulerOutput) -> None:
        """A slot for the token the sequence computes this step; a shared last block is copied
        first (copy-on-write), which the model runner does before the forward."""
        out.blocks_to_copy += self.kv.allocate_slots(seq, num_new_tokens=1)

    # --8<-- [start:preempt]
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """All-or-nothing: the group gives up every block it holds."""
        out.preempted.append(group)
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(group):
            out.blocks_to_swap_out += self.kv.swap_out(group)
            group.set_status(SequenceStatus.SWAPPED)
            self.swapped.append(group)
            self.counters["preemptions_swap"] += 1
            return
        # recompute (or swap with no CPU space left): drop the KV, prefill everything again
        self.kv.free(group)
        if group.is_beam_search:
            group.restart_beams()  # beams are deterministic: search again from the prompt
        for seq in group.unfinished_seqs():
            seq.num_computed_tokens = 0
        group.set_status(SequenceStatus.WAITING)
        self.waiting.appendleft(group)  # first in line: it arrived before everyone waiting
        self.counters["preemptions_recompute"] += 1
    # --8<-- [end:preempt]

    # --8<-- [start:static]
    def _schedule_static(self, out: SchedulerOutput) -> SchedulerOutput:
        if not self.running:  # the last batch is done: form the next one
            while (self.waiting and len(self.running) < self.config.max_num_seqs
                   and self.kv.can_admit(self.waiting[0])):
                group = self.waiting.popleft()
                self.kv.admit(group)  # slabs: nothing is ever found cached
                group.set_status(SequenceStatus.RUNNING)
                self.running.append(group)
            longest = max((len(g.seqs[0]) for g in self.running), default=0)
            for group in self.running:  # prefill, padded to the longest prompt
                out.add(group, group.seqs[0], len(group.seqs[0]))
                out.padding_rows.append(longest - len(group.seqs[0]))
            return out
        for group in self.running:  # decode; members that finished still fill their rows
            seq = group.seqs[0]
            if seq.is_finished:
                out.padding_rows.append(1)
            else:
                self._append(seq, out)
                out.add(group, seq, 1)
        return out

    def finish_static_batch_if_done(self) -> None:
        if self.config.batching == "static" and all(g.is_finished for g in self.running):
            for group in self.running:
                self.kv.free(group)  # a static batch holds its memory until its last member ends
            self.running = []
    # --8<-- [end:static]
