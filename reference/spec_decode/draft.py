"""A draft model proposes: a small model of the target's vocabulary guesses k tokens, one step
at a time, and the target checks them all in one forward.

The draft runs on the engine's own machinery: the tier's model runner (the same class as the
target's), ``prepare_inputs`` for its steps, and a paged KV cache of its own
(``PagedKVCacheManager``) holding, for every sequence it drafts for, the K/V of the tokens it
has computed. Each engine step, before the target's forward:

1. sync: the draft's copy of each sequence keeps the computed tokens it shares with the target
   (the accepted ones) and gives back the slots of the rest (``truncate_slots``: the same
   rollback as the target's), then takes the target's new tokens;
2. round 0 computes what the draft has not seen yet (the whole prompt the first time; then the
   one or two tokens the target emitted) and draws the first proposal; rounds 1..k-1 compute the
   previous proposal and draw the next.

The draft draws with the target's sampling row — the same temperature, top-k/top-p and, above
all, the same counters (stream, output position): the two draws are coupled through the same
uniform numbers (the Gumbel-max trick), so where the two distributions are close the draft
draws the very token the target will, and it is accepted.
"""

from dataclasses import replace

import torch

from ..engine.runner_factory import create_model_runner, load_engine_model
from ..engine.scheduler import SchedulerOutput
from ..engine.sequence import Sequence, next_seq_id
from ..engine.step_inputs import prepare_inputs
from ..kv import KVCacheConfig, PagedKVCacheManager
from ..model import load_config


class _DraftGroup:
    """What prepare_inputs reads of a group, for the draft's copy of one sequence: the
    target group's sampling parameters and streams, no prompt logprobs, one sequence."""

    is_beam_search = False
    prompt_logprobs = None

    def __init__(self, group, seq: Sequence):
        self.sampling_params, self.seqs, self.target = group.sampling_params, [seq], group

    def unfinished_seqs(self) -> list[Sequence]:
        return self.seqs

    def stream_for(self, index: int) -> int:
        return self.target.stream_for(index)


class DraftModelProposer:
    def __init__(self, config, num_target_blocks: int):
        """config: the target's EngineConfig; the draft takes its options (dtype, device,
        block size, budgets, tier) with its own model and a pool as large, in tokens, as
        the target's plus every sequence's lookahead."""
        spec = config.speculative_config
        sc = config.scheduler_config
        lookahead = -(-(spec.num_speculative_tokens + 1) // config.block_size)
        num_blocks = num_target_blocks + sc.max_num_seqs * lookahead
        self.config = replace(
            config, model_dir=spec.draft_model_dir,
            model_config=load_config(spec.draft_model_dir), num_gpu_blocks=num_blocks,
            swap_space_blocks=0, enable_prefix_caching=False, quantization=None,
            quantization_skip=(), kv_cache_dtype="auto", calculate_kv_scales=False,
            tensor_parallel_size=1, speculative_config=None)
        self.runner = create_model_runner(self.config, load_engine_model(self.config))
        # the draft's own layers' spec: a windowed draft gives its blocks back as the target's
        groups = self.runner.get_kv_cache_spec(config.block_size)
        self.kv = PagedKVCacheManager(config.block_size, num_blocks, kv_cache_groups=groups)
        self.runner.initialize_kv_cache(KVCacheConfig(num_blocks, 0, groups))
        self.device = next(self.runner.model.parameters()).device
        self.vocab_size = self.config.model_config.vocab_size
        self.budget = sc.max_num_batched_tokens
        self.copies: dict[int, Sequence] = {}  # target seq id -> the draft's copy

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's copy of seq, holding K/V for the tokens it shares with seq only."""
        copy = self.copies.get(seq.seq_id)
        if copy is None:
            copy = Sequence(next_seq_id(), list(seq.prompt_token_ids), index=seq.index)
            self.kv.open_seq(copy)
            self.copies[seq.seq_id] = copy
        target, held = seq.output_token_ids, copy.output_token_ids
        num_prompt = len(seq.prompt_token_ids)
        same = 0  # outputs in common
        while same < min(len(target), len(held)) and target[same] == held[same]:
            same += 1
        # at least the newest token is computed again: its logits draw the first proposal
        copy.num_computed_tokens = min(copy.num_computed_tokens, num_prompt + same, len(seq) - 1)
        self.kv.truncate_slots(copy, copy.num_computed_tokens)  # the rejected ones' slots
        copy.output_token_ids = list(target)
        return copy

    def _drop(self, seq_id: int) -> None:
        copy = self.copies.pop(seq_id)
        self.kv.free_seq(copy)

    # --8<-- [start:propose]
    @torch.inference_mode()
    def propose(self, wanted: list) -> list[list[int]]:
        """wanted: (group, seq, k) per sequence -> up to k proposals each."""
        for seq_id in set(self.copies) - {seq.seq_id for _, seq, _ in wanted}:
            self._drop(seq_id)  # finished, preempted, or not drafting now
        proposals = {seq.seq_id: [] for _, seq, _ in wanted}
        active = [(group, seq, self._sync(seq), k) for group, seq, k in wanted]
        for round_ in range(max((k for *_, k in wanted), default=0)):
            sched, budget = SchedulerOutput(), self.budget
            for group, _, copy, k in active:
                n = copy.num_uncomputed_tokens  # round 0: what it has not seen; then 1
                draft = _DraftGroup(group, copy)
                if round_ >= k or n > budget or not self.kv.can_allocate_slots(draft, n):
                    continue  # done, or no room this step: it proposes what it has
                budget -= n
                self.kv.allocate_slots(copy, n)
                sched.add(draft, copy, n)
            if not sched.scheduled:
                break
            inputs = prepare_inputs(sched, self.kv, self.vocab_size, None, self.device)
            logits = self.runner.execute(inputs)
            tokens = self.runner.sample(logits[:len(inputs.rows)], inputs.sampling)
            for item, token in zip(sched.scheduled, tokens.token_ids.tolist(), strict=True):
                item.seq.num_computed_tokens += item.num_tokens
                item.seq.output_token_ids.append(token)
            scheduled = {id(item.seq) for item in sched.scheduled}
            active = [a for a in active if id(a[2]) in scheduled]
            for _, seq, copy, _ in active:
                proposals[seq.seq_id].append(copy.output_token_ids[-1])
        return [proposals[seq.seq_id] for _, seq, _ in wanted]
    # --8<-- [end:propose]
