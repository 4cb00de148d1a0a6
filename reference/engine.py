"""LLMEngine: one step = schedule -> run the model on the scheduled tokens -> sample -> append
-> free what finished. Requests come and go between steps (add_request, abort_request)."""

import itertools

import torch

from .cache import NoCache
from .cache_engine import ContiguousKVCache, PagedKVCache
from .generate import check_prompt
from .kv_storage import BatchKV
from .outputs import CompletionOutput, RequestOutput
from .sampler import check_stop, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus

KV_LAYOUTS = ("paged", "contiguous")
POLICIES = ("max", "pow2", "oracle")


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_gpu_blocks: int,
                 swap_space_blocks: int = 0, kv_layout: str = "paged",
                 reservation_policy: str = "max", scheduler_config: SchedulerConfig,
                 enable_prefix_caching: bool = False, seed: int = 0):
        cfg = model.config
        sc = scheduler_config
        _check_engine_args(kv_layout, reservation_policy, sc, block_size, num_gpu_blocks)
        if enable_prefix_caching and kv_layout != "paged":
            raise ValueError("enable_prefix_caching shares blocks: it needs kv_layout='paged'")
        param = next(model.parameters())
        if kv_layout == "paged":
            self.kv = PagedKVCache(cfg, block_size, num_gpu_blocks, swap_space_blocks,
                                   param.dtype, param.device, enable_prefix_caching)
        else:
            self.kv = ContiguousKVCache(cfg, num_gpu_blocks * block_size, reservation_policy,
                                        sc.max_model_len, param.dtype, param.device)
        self.model, self.tokenizer, self.config = model, tokenizer, sc
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.scheduler = Scheduler(sc, self.kv)
        self.groups: dict[str, SequenceGroup] = {}
        self.seed_stream = torch.Generator().manual_seed(seed)  # for requests without a seed
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self.device = param.device

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams) -> None:
        """Queue a request; a bad one raises ValueError and leaves everything else as it was."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        max_len = self.config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len = "
                             f"{max_len}")
        if params.n > 1 and not isinstance(self.kv, PagedKVCache):
            raise ValueError(f"n = {params.n}: parallel samples share the prompt's blocks, "
                             "which needs kv_layout='paged'")
        most = min(len(ids) + params.max_tokens, max_len)
        # At worst every sample holds its own copy of everything (after a recompute).
        if self.kv.never_fits(most, copies=params.n):
            raise ValueError(f"request {request_id!r} needs up to {params.n} x {most} tokens "
                             "of KV memory, more than the whole KV pool holds: it could never "
                             "finish; lower n or max_tokens, or give the pool more blocks")
        seed = params.seed if params.seed is not None else int(
            torch.randint(2**62, (1,), generator=self.seed_stream))
        group = SequenceGroup(request_id, [], params, next(self._arrivals), seed, prompt=text)
        group.seqs.append(Sequence(next(self._seq_ids), ids, generator=group.generator_for(0)))
        self.groups[request_id] = group
        self.scheduler.add(group)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        vocab = self.model.config.vocab_size
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return None, check_prompt(prompt["prompt_token_ids"], vocab)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            return prompt, check_prompt(self.tokenizer(prompt)["input_ids"], vocab)
        return None, check_prompt(prompt, vocab)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is None:
            raise ValueError(f"no request with id {request_id!r} is in the engine")
        self.scheduler.remove(group)
        for seq in group.unfinished_seqs():
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        del self.groups[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------
    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests this step touched."""
        sched = self.scheduler.schedule()
        if sched.scheduled:
            logits = self._execute(sched)  # [number of sampling sequences, vocab]
            rows = iter(logits)
            for item in sched.scheduled:
                kind = "prefill_tokens" if item.seq.is_prefill else "decode_tokens"
                self.scheduler.counters[kind] += item.num_tokens
                samples = item.samples
                item.seq.num_computed_tokens += item.num_tokens
                self.kv.mark_computed(item.seq)  # full blocks become findable by later prompts
                if samples:
                    row = next(rows)
                    for seq in self._fork_samples(item.group, item.seq):
                        self._append_token(item.group, seq, row)
                        if seq.is_finished and not item.group.is_finished:
                            self.kv.free_seq(seq)  # a finished sample's blocks go back now
        touched = list(dict.fromkeys(item.group for item in sched.scheduled))
        for group in touched:
            if group.is_finished and self.config.batching == "continuous":
                self.scheduler.remove(group)  # its memory is free for the next step
        self.scheduler.finish_static_batch_if_done()
        outputs = [self._output(g) for g in touched]
        for group in touched:
            if group.is_finished:
                self.groups.pop(group.request_id, None)
        return outputs
    # --8<-- [end:step]

    # --8<-- [start:execute]
    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """One forward over every scheduled token of every sequence, laid flat."""
        ids, positions, parts, logits_rows = [], [], [], []
        for item in sched.scheduled:
            start = item.seq.num_computed_tokens
            ids += item.seq.token_ids[start: start + item.num_tokens]
            positions += range(start, start + item.num_tokens)
            parts.append((item.num_tokens, self.kv.view(item.seq)))
            if item.samples:
                logits_rows.append(len(ids) - 1)  # the sequence's last row predicts its next
        for n in sched.padding_rows:  # static batching computes pad rows, then discards them
            if n:
                ids += [0] * n
                positions += range(n)
                parts.append((n, NoCache()))
        ids_t = torch.tensor(ids, device=self.device)  # [T]
        pos_t = torch.tensor(positions, device=self.device)  # [T]
        return self.model(ids_t, pos_t, BatchKV(parts), logits_rows=logits_rows)  # [S, vocab]
    # --8<-- [end:execute]

    # --8<-- [start:fork_samples]
    def _fork_samples(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        """The sequences that draw a token from this sequence's logits. After the prompt of an
        n > 1 request, that is n sequences: n - 1 children fork from the parent, sharing every
        prompt block (reference counts up, nothing copied), each with its own generator."""
        if seq.output_token_ids or len(group.seqs) >= group.sampling_params.n:
            return [seq]
        for index in range(1, group.sampling_params.n):
            child = Sequence(next(self._seq_ids), list(seq.prompt_token_ids),
                             num_computed_tokens=seq.num_computed_tokens,
                             status=SequenceStatus.RUNNING,
                             generator=group.generator_for(index), index=index)
            self.kv.fork(seq, child)
            group.seqs.append(child)
        return list(group.seqs)
    # --8<-- [end:fork_samples]

    def _append_token(self, group: SequenceGroup, seq: Sequence, logits: torch.Tensor) -> None:
        params = group.sampling_params
        token, logprob, top = sample(logits, params, seq.generator,
                                     len(seq.output_token_ids), self.eos_token_id)
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs.append({token: logprob, **top})
        text = seq.output_text
        if self.tokenizer is not None:  # incremental detokenization: decode what exists now
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        reason, stop_reason, text = check_stop(
            seq.token_ids, len(seq.output_token_ids), text, params, self.eos_token_id,
            self.config.max_model_len, len(seq.prompt_token_ids))
        seq.output_text = text
        if reason is not None:
            seq.status, seq.finish_reason, seq.stop_reason = (SequenceStatus.FINISHED, reason,
                                                              stop_reason)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        completions = [CompletionOutput(
            seq.index, seq.output_text, list(seq.output_token_ids), seq.cumulative_logprob,
            list(seq.logprobs) if group.sampling_params.logprobs is not None else None,
            seq.finish_reason, seq.stop_reason) for seq in group.seqs]
        return RequestOutput(group.request_id, group.prompt,
                             list(group.seqs[0].prompt_token_ids), completions,
                             group.is_finished)

    def stats(self) -> dict:
        c = self.scheduler.counters
        total, free = self.kv.num_total_blocks, self.kv.num_free_blocks
        return {
            "kv_layout": "paged" if isinstance(self.kv, PagedKVCache) else "contiguous",
            "blocks_total": total, "blocks_used": total - free,
            "usage": (total - free) / total if total else 0.0,
            "preemptions_recompute": c["preemptions_recompute"],
            "preemptions_swap": c["preemptions_swap"], "swap_ins": c["swap_ins"],
            "swapped_blocks": self.kv.num_swapped_blocks,
            "cow_copies": self.kv.num_cow_copies,
            **self._prefix_cache_stats(),
            "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
        }


    def _prefix_cache_stats(self) -> dict:
        cache = getattr(getattr(self.kv, "manager", None), "prefix_cache", None)
        if cache is None:
            return {}
        return {"prefix_cache_hit_blocks": cache.hit_blocks,
                "prefix_cache_hit_tokens": cache.hit_tokens,
                "blocks_cached": len(cache.block_of)}


def _check_engine_args(kv_layout, policy, sc: SchedulerConfig, block_size, num_gpu_blocks):
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout {kv_layout!r} is unknown; choose one of {KV_LAYOUTS}")
    if policy not in POLICIES:
        raise ValueError(f"reservation policy {policy!r} is unknown; choose one of {POLICIES}")
    if sc.preemption_mode not in ("recompute", "swap"):
        raise ValueError(f"preemption_mode {sc.preemption_mode!r} is unknown; choose "
                         "'recompute' or 'swap'")
    if sc.preemption_mode == "swap" and kv_layout != "paged":
        raise ValueError("preemption_mode 'swap' moves blocks: it needs kv_layout='paged'")
    if sc.batching not in ("continuous", "static"):
        raise ValueError(f"batching {sc.batching!r} is unknown; choose 'continuous' or 'static'")
    if sc.batching == "static" and kv_layout != "contiguous":
        raise ValueError("batching='static' is the traditional baseline: it reserves each "
                         "request's memory up front and never preempts, so it needs "
                         "kv_layout='contiguous'")
    if sc.max_num_seqs < 1 or block_size < 1 or num_gpu_blocks < 1:
        raise ValueError("max_num_seqs, block_size and num_gpu_blocks must be >= 1")
    if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < sc.max_model_len:
        raise ValueError(f"max_num_batched_tokens ({sc.max_num_batched_tokens}) must be >= "
                         f"max_model_len ({sc.max_model_len}) unless enable_chunked_prefill: a "
                         "whole prompt must fit in one step")
