"""LLMEngine: one step = schedule -> move blocks -> prepare inputs -> forward -> sample ->
update -> free what finished. Requests come and go between steps (add_request, abort_request).

The step, part by part (vLLM V1's seam):

    Scheduler.schedule()       SchedulerOutput: which sequences run, how many tokens each, and
                               the blocks to swap out / swap in / copy (lists, no tensors)
    CacheEngine.apply(...)     carries out those block moves on the KV tensors
    prepare_inputs(...)        StepInputs: flat tensors (input_ids, positions, slot_mapping,
                               block_tables, seq_lens, query_start_loc, logits_indices, sampling)
    model(..., PagedAttention) logits [S, vocab] for the rows that predict a next token
    backend.sample(...)        one token per row
    update                     append tokens, fork samples, select beams, check stops, free

Everything up to prepare_inputs and after sampling is bookkeeping shared by every tier; a
faster tier changes only the middle (the backend's ops, or its own model runner).
"""

import itertools
import random
from collections.abc import Callable

import torch

from ..kv import CacheEngine, ContiguousKVCacheManager, PagedKVCacheManager
from ..model import PagedAttention
from ..ops import REFERENCE_BACKEND, Backend, SamplerOutput
from .beam_search import BeamSearchParams, rank_beams, select_beams
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id
from .step_inputs import StepInputs, prepare_inputs
from .stop import check_stop
from .validation import check_int, check_token_ids

KV_LAYOUTS = ("paged", "contiguous")
POLICIES = ("max", "pow2", "oracle")

StepObserver = Callable[["LLMEngine", SchedulerOutput, StepInputs], None]


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_gpu_blocks: int,
                 swap_space_blocks: int = 0, kv_layout: str = "paged",
                 reservation_policy: str = "max", scheduler_config: SchedulerConfig,
                 enable_prefix_caching: bool = False, seed: int = 0,
                 backend: Backend = REFERENCE_BACKEND):
        cfg = model.config
        sc = scheduler_config
        _check_engine_args(kv_layout, reservation_policy, sc, block_size, num_gpu_blocks)
        check_int("seed", seed, low=0, high=2**64 - 1)  # the range of a request's seed
        check_backend(backend)
        if enable_prefix_caching and kv_layout != "paged":
            raise ValueError("enable_prefix_caching shares blocks: it needs kv_layout='paged'")
        param = next(model.parameters())
        if kv_layout == "paged":
            self.kv = PagedKVCacheManager(block_size, num_gpu_blocks, swap_space_blocks,
                                          enable_prefix_caching)
        else:
            self.kv = ContiguousKVCacheManager(num_gpu_blocks * block_size, reservation_policy,
                                               sc.max_model_len)
        self.cache_engine = CacheEngine(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv.block_size,
            self.kv.num_total_blocks, swap_space_blocks if kv_layout == "paged" else 0,
            param.dtype, param.device, backend)
        self.model, self.tokenizer, self.config = model, tokenizer, sc
        self.backend = backend
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.scheduler = Scheduler(sc, self.kv)
        self.groups: dict[str, SequenceGroup] = {}
        # Seeds for requests without one. random.Random takes every bit of the engine's seed
        # (torch's CPU generator keeps 32 of them: seeds 1 and 2**32 + 1 would be the same).
        self.seed_stream = random.Random(seed)
        self._arrivals = itertools.count()
        self.device = param.device
        self.step_observers: list[StepObserver] = []

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | BeamSearchParams) -> None:
        """Queue a request; a bad one raises ValueError and leaves everything else as it was.
        With BeamSearchParams the request is a beam search (its outputs: the best beams)."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise TypeError(f"params must be SamplingParams or BeamSearchParams, got "
                            f"{type(params).__name__}")
        text, ids = self.prompt_ids(prompt)
        max_len = self.config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len = "
                             f"{max_len}")
        beam = isinstance(params, BeamSearchParams)
        width = params.beam_width if beam else params.n
        self._check_schedulable(params, width, "beam_width" if beam else "n")
        if (beam or width > 1) and self.kv.layout != "paged":
            what = "beams" if beam else f"n = {width} parallel samples"
            raise ValueError(f"{what} share the prompt's blocks, which needs kv_layout='paged'")
        most = min(len(ids) + params.max_tokens, max_len)
        if beam:  # beams share the prompt; each may hold its own tokens and one spare block
            bn = self.kv.manager.blocks_needed
            need = bn(len(ids)) + width * (bn(most - len(ids)) + 1)
            never = need > self.kv.num_total_blocks
        else:  # at worst every sample holds its own copy of everything (after a recompute)
            never = self.kv.never_fits(most, copies=width)
        if never:
            amount = f"{width} x {most} tokens" if width > 1 else f"{most} tokens"
            raise ValueError(f"request {request_id!r} needs up to {amount} "
                             "of KV memory, more than the whole KV pool holds: it could never "
                             "finish; lower n (or beam_width) or max_tokens, or give the pool "
                             "more blocks")
        seed = getattr(params, "seed", None)
        if seed is None:
            seed = self.seed_stream.getrandbits(62)
        group = SequenceGroup(request_id, [], params, next(self._arrivals), seed, prompt=text)
        group.seqs.append(Sequence(next_seq_id(), ids))
        self.groups[request_id] = group
        self.scheduler.add(group)

    def _check_schedulable(self, params, width: int, field: str) -> None:
        """Refuse what the scheduler could never run, or the sampler never serve."""
        sc, vocab = self.config, self.vocab_size
        if width > sc.max_num_seqs:
            raise ValueError(f"{field} = {width} runs {width} sequences at once, more than "
                             f"max_num_seqs = {sc.max_num_seqs}: lower {field} or raise "
                             "max_num_seqs")
        if width > sc.max_num_batched_tokens:
            raise ValueError(f"{field} = {width} decodes {width} tokens per step, more than "
                             f"max_num_batched_tokens = {sc.max_num_batched_tokens}")
        if isinstance(params, SamplingParams):
            if params.logprobs is not None and params.logprobs > vocab:
                raise ValueError(f"logprobs = {params.logprobs} is more than the vocabulary "
                                 f"of {vocab} tokens")
            bad = [t for t in params.stop_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary; "
                                 f"valid ids are 0..{vocab - 1}")

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text, token ids or a dict."""
        vocab = self.vocab_size
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            text = prompt.get("prompt")  # optional: the text the ids came from
            if text is not None and not isinstance(text, str):
                raise TypeError(f"a dict prompt's 'prompt' must be text, got "
                                f"{type(text).__name__}")
            return text, check_prompt(prompt["prompt_token_ids"], vocab)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            return prompt, check_prompt(self.tokenizer(prompt)["input_ids"], vocab)
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"a prompt is text, a list of token ids or "
                            f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
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

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call observer(engine, scheduler_output, step_inputs) in every step, just before the
        forward: the block moves are done, the step's slots are booked (figures, tests)."""
        self.step_observers.append(observer)

    # -- the step ----------------------------------------------------------------------------
    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests this step touched.

        If anything in the step raises, the requests it was running are finished with
        finish_reason "error" and their memory freed before the exception goes on: the engine
        stays usable and every other request is untouched.
        """
        sched = None
        try:
            sched = self.scheduler.schedule()
            self.cache_engine.apply(sched.blocks_to_swap_out, sched.blocks_to_swap_in,
                                    sched.blocks_to_copy)
            if sched.scheduled:
                inputs = prepare_inputs(sched, self.kv, self.vocab_size, self.eos_token_id,
                                        self.device)
                for observe in self.step_observers:
                    observe(self, sched, inputs)
                logits = self.execute_model(inputs)  # [S, vocab]
                sampled = self.backend.sample(logits, inputs.sampling)
                self._update(sched, inputs, logits, sampled)
        except BaseException:
            self._fail_step(sched)
            raise
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

    def _fail_step(self, sched: SchedulerOutput | None) -> None:
        """Finish the failed step's requests with an error and free their memory. Which
        requests: those the step scheduled or preempted; if scheduling itself failed, every
        request holding memory (its bookkeeping may be half done)."""
        if sched is not None:
            groups = [item.group for item in sched.scheduled] + sched.preempted
        else:
            groups = [*self.scheduler.running, *self.scheduler.swapped]
        for group in dict.fromkeys(groups):
            if group.request_id not in self.groups:
                continue  # already finished and removed
            self.scheduler.remove(group)
            for seq in group.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            del self.groups[group.request_id]
        self.scheduler.finish_static_batch_if_done()

    # --8<-- [start:execute]
    @torch.inference_mode()
    def execute_model(self, inputs: StepInputs) -> torch.Tensor:
        """One forward over every scheduled token of every sequence, laid flat."""
        attn = PagedAttention(inputs.attn_metadata, self.cache_engine.gpu_k,
                              self.cache_engine.gpu_v, self.backend)
        return self.model(inputs.input_ids, inputs.positions, attn,
                          logits_indices=inputs.logits_indices)  # [S, vocab]
    # --8<-- [end:execute]

    # --8<-- [start:update]
    def _update(self, sched: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor,
                sampled: SamplerOutput) -> None:
        for item in sched.scheduled:
            kind = "prefill_tokens" if item.seq.is_prefill else "decode_tokens"
            self.scheduler.counters[kind] += item.num_tokens
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.mark_computed(item.seq)  # full blocks become findable by later prompts
        beam_rows: dict[SequenceGroup, list[int]] = {}
        tokens, logprobs = sampled.token_ids.tolist(), sampled.logprobs.tolist()
        top_ids, top_lps = sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist()
        samples: dict[int, dict[int, Sequence]] = {}  # prompt's seq id -> index -> sample
        for row in inputs.rows:  # a prompt of n > 1 samples forks before any token is added
            seq = row.item.seq
            if row.sample_index != seq.index and seq.seq_id not in samples:
                samples[seq.seq_id] = self._fork_samples(row.item.group, seq)
        for r, row in enumerate(inputs.rows):
            group, seq = row.item.group, row.item.seq
            if group.is_beam_search:
                beam_rows.setdefault(group, []).append(r)
                continue
            seq = samples.get(seq.seq_id, {}).get(row.sample_index, seq)
            num_logprobs = group.sampling_params.logprobs
            top = (dict(zip(top_ids[r][:num_logprobs], top_lps[r][:num_logprobs], strict=True))
                   if num_logprobs else {})
            self._append_token(group, seq, tokens[r], logprobs[r], top)
            if seq.is_finished and not group.is_finished:
                self.kv.free_seq(seq)  # a finished sample's blocks go back now
        for group, rows in beam_rows.items():
            self._beam_step(group, torch.log_softmax(logits[rows].float(), dim=-1))
    # --8<-- [end:update]

    # --8<-- [start:fork_samples]
    def _fork_samples(self, group: SequenceGroup, seq: Sequence) -> dict[int, Sequence]:
        """After the prompt of an n > 1 request, n - 1 children fork from the parent, sharing
        every prompt block (reference counts up, nothing copied); child i draws from stream
        seed + i."""
        for index in range(1, group.sampling_params.n):
            child = Sequence(next_seq_id(), list(seq.prompt_token_ids),
                             num_computed_tokens=seq.num_computed_tokens,
                             status=SequenceStatus.RUNNING, index=index)
            self.kv.fork(seq, child)
            group.seqs.append(child)
        return {s.index: s for s in group.seqs}
    # --8<-- [end:fork_samples]

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                      top: dict[int, float]) -> None:
        params = group.sampling_params
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs.append({token: logprob, **top})
        new_text = ""
        if self.tokenizer is not None:
            if seq.detokenizer is None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            new_text = seq.detokenizer.add(token)
            seq.output_text += new_text
        check_stop(seq, new_text, params, self.eos_token_id, self.config.max_model_len)
        if seq.is_finished and seq.detokenizer is not None and seq.stop_reason not in (
                params.stop_strings):
            seq.output_text += seq.detokenizer.flush()  # the text held back, if any

    # --8<-- [start:beam_step]
    def _beam_step(self, group: SequenceGroup, logprobs: torch.Tensor) -> None:
        """Every beam has its next-token logprobs [beams, vocab]: keep the best beam_width
        (beam, token) pairs; each survivor forks its parent, the old beams are freed."""
        params: BeamSearchParams = group.sampling_params
        beams = group.unfinished_seqs()
        assert len(beams) == logprobs.shape[0], "every beam of a group runs in the same step"
        survivors, finished = select_beams([list(b.output_token_ids) for b in beams],
                                           [b.cumulative_logprob for b in beams], logprobs,
                                           params, self.eos_token_id)
        group.finished_beams += finished
        new_beams = []
        for parent, token, score in survivors:
            parent_seq = beams[parent]
            child = Sequence(next_seq_id(), list(parent_seq.prompt_token_ids),
                             list(parent_seq.output_token_ids) + [token],
                             num_computed_tokens=parent_seq.num_computed_tokens,
                             status=SequenceStatus.RUNNING, cumulative_logprob=score)
            self.kv.fork(parent_seq, child)  # shares every block; copy-on-write at append
            new_beams.append(child)
            group.seqs.append(child)  # held by the group from now on (freed if a step fails)
        for beam in beams:  # the old generation goes; blocks its children share remain
            self.kv.free_seq(beam)
            beam.status = SequenceStatus.FINISHED
        group.seqs = new_beams
        prompt_len = len(beams[0].prompt_token_ids)
        most = max(1, min(params.max_tokens, self.config.max_model_len - prompt_len))
        if not new_beams or len(new_beams[0].output_token_ids) >= most:
            for beam in new_beams:
                self.kv.free_seq(beam)
                beam.status = SequenceStatus.FINISHED
            group.finished_beams = rank_beams(
                group.finished_beams,
                [(list(b.output_token_ids), b.cumulative_logprob) for b in new_beams], params)
            group.seqs = new_beams or beams  # a finished group keeps a sequence for its prompt
    # --8<-- [end:beam_step]

    def _output(self, group: SequenceGroup) -> RequestOutput:
        prompt_ids = list(group.seqs[0].prompt_token_ids)
        if group.is_beam_search and group.is_finished:
            completions = [CompletionOutput(
                i, self._decode(b.tokens), list(b.tokens), b.cum_logprob, None,
                "stop" if b.finished else "length") for i, b in enumerate(group.finished_beams)]
            return RequestOutput(group.request_id, group.prompt, prompt_ids, completions, True)
        completions = [CompletionOutput(
            seq.index, seq.output_text, list(seq.output_token_ids), seq.cumulative_logprob,
            list(seq.logprobs) if getattr(group.sampling_params, "logprobs", None) is not None
            else None, seq.finish_reason, seq.stop_reason) for seq in group.seqs]
        return RequestOutput(group.request_id, group.prompt, prompt_ids, completions,
                             group.is_finished)

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def stats(self) -> dict:
        c = self.scheduler.counters
        total, free = self.kv.num_total_blocks, self.kv.num_free_blocks
        return {
            "kv_layout": self.kv.layout,
            "blocks_total": total, "blocks_used": total - free,
            "usage": (total - free) / total if total else 0.0,
            "preemptions_recompute": c["preemptions_recompute"],
            "preemptions_swap": c["preemptions_swap"], "swap_ins": c["swap_ins"],
            "swapped_blocks": self.kv.num_swapped_blocks,
            "cow_copies": self.kv.num_cow_copies,
            **self.kv.prefix_cache_stats(),
            "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
        }


def check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """A non-empty list of token ids inside the vocabulary, or a ValueError saying what is wrong."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    ids = check_token_ids("prompt", prompt_ids, vocab_size)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    return ids


def check_backend(backend) -> None:
    """A Backend bundle of ops (swap one with dataclasses.replace), not None or a function."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a pagedllm.reference.ops.Backend (e.g. "
                        f"REFERENCE_BACKEND, or dataclasses.replace(REFERENCE_BACKEND, op=...)), "
                        f"got {backend!r} ({type(backend).__name__})")


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
    check_int("max_num_seqs", sc.max_num_seqs, low=1)
    check_int("block_size", block_size, low=1)
    check_int("num_gpu_blocks", num_gpu_blocks, low=1)
    check_int("max_model_len", sc.max_model_len, low=1)
    check_int("max_num_batched_tokens", sc.max_num_batched_tokens, low=1)
    if (kv_layout == "contiguous" and policy == "max"
            and num_gpu_blocks * block_size < sc.max_model_len):
        raise ValueError(f"kv_layout='contiguous' with the 'max' policy reserves max_model_len = "
                         f"{sc.max_model_len} slots per request, more than the whole pool of "
                         f"{num_gpu_blocks * block_size}: give the pool more memory, lower "
                         "max_model_len, or use reservation_policy 'pow2' or 'oracle'")
    if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < sc.max_model_len:
        raise ValueError(f"max_num_batched_tokens ({sc.max_num_batched_tokens}) must be >= "
                         f"max_model_len ({sc.max_model_len}) unless enable_chunked_prefill: a "
                         "whole prompt must fit in one step")
