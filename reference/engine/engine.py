"""LLMEngine: one step = schedule -> move blocks -> prepare inputs -> forward -> sample ->
update -> free what finished. Requests come and go between steps (add_request, abort_request).

The step, part by part (vLLM V1's seam):

    Scheduler.schedule()       SchedulerOutput: which sequences run, how many tokens each, and
                               the blocks to swap out / swap in / copy (lists, no tensors)
    CacheEngine.apply(...)     carries out those block moves on the KV tensors
    prepare_inputs(...)        StepInputs: flat tensors (input_ids, positions, slot_mapping,
                               block_tables, seq_lens, query_start_loc, logits_indices, sampling)
    runner.execute(inputs)     logits [S, vocab] for the rows that predict a next token
    runner.sample(...)         one token per row
    Scheduler.update_from_output   the scheduled tokens are computed: counts move on
    update                     append tokens, fork samples, select beams, check stops, free

Everything but execute and sample is bookkeeping shared by every tier. The tier is the model
runner (``model_runner.py``), chosen once, from the config, when the engine is built.
"""

import itertools
import random
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from ..kv import CacheEngine, ContiguousKVCacheManager, PagedKVCacheManager
from ..model.loader import load_tokenizer
from ..model.quantization import float_linears, weight_bytes
from ..model.tensor_parallel import attention_heads
from ..ops import SamplerOutput
from .client import ModelLimits
from .beam_search import BeamSearchParams, rank_beams, select_beams
from .config import EngineArgs, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .parallel_runner import (
    TensorParallelRunner,
    load_rank_model,
    run_torchrun_worker,
    torchrun_rank,
)
from .prompt_logprobs import collect_prompt_logprobs
from .request_checks import check_params, check_request, prompt_ids
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id
from .step_inputs import StepInputs, prepare_inputs
from .stop import check_stop
from .structured_outputs import FIELD as STRUCTURED_OUTPUTS
from .structured_outputs import BackgroundCompiler, advance
from .validation import FieldValueError

StepObserver = Callable[["LLMEngine", SchedulerOutput, StepInputs], None]


class LLMEngine:
    """One engine for every tier: the tier is the model runner its config names."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer=None):
        """config: checked and resolved (``EngineArgs(...).create_engine_config()``); model: the
        reference model of the checkpoint, loaded in config.dtype on config.device."""
        self.config = config
        # With a quantization, the layers it left in float (skipped, or not in the GGUF's
        # blocks), named before a tier's runner rewrites the modules.
        self.float_linears = float_linears(model) if config.quantization else []
        self.runner = config.model_runner(model, config)  # the tier, chosen once
        if config.tensor_parallel_size > 1:  # model: rank 0's shard; the others start here
            self.runner = TensorParallelRunner(self.runner, config)
        cfg = config.model_config
        # None: the runner measures what the GPU has left once weights and a step are in.
        num_gpu_blocks = config.num_gpu_blocks or self.runner.profile_num_blocks()
        if config.kv_layout == "paged":
            self.kv = PagedKVCacheManager(config.block_size, num_gpu_blocks,
                                          config.swap_space_blocks, config.enable_prefix_caching)
        else:
            self.kv = ContiguousKVCacheManager(num_gpu_blocks * config.block_size,
                                               config.reservation_policy, config.max_model_len)
        self.device = next(self.runner.model.parameters()).device
        self.cache_engine = CacheEngine(
            cfg.num_layers, len(attention_heads(cfg, 0, config.tensor_parallel_size)[1]),
            cfg.head_dim, self.kv.block_size, self.kv.num_total_blocks,
            config.swap_space_blocks if config.kv_layout == "paged" else 0, config.dtype,
            self.device, self.runner.backend, config.kv_cache_dtype, config.calculate_kv_scales)
        self.runner.bind_kv_cache(self.cache_engine)
        self.tokenizer = tokenizer
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.scheduler = Scheduler(config.scheduler_config, self.kv)
        self.groups: dict[str, SequenceGroup] = {}
        # Seeds for requests without one. random.Random takes every bit of the engine's seed
        # (torch's CPU generator keeps 32 of them: seeds 1 and 2**32 + 1 would be the same).
        self.seed_stream = random.Random(config.seed)
        self._arrivals = itertools.count()
        self.step_observers: list[StepObserver] = []
        self.weight_bytes = weight_bytes(self.runner.model)  # once: the weights never change
        # structured outputs: the grammars (built by the first request with one), and the
        # requests whose grammar is still compiling (they join the scheduler when it is done)
        self._grammars: BackgroundCompiler | None = None
        self._compiling: list[tuple[SequenceGroup, Future]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Check the options (before any weight loads), then load the checkpoint's model and
        tokenizer and build the engine."""
        config = args.create_engine_config()
        if config.tensor_parallel_size > 1 and torchrun_rank():
            # torchrun runs the caller's script on every rank: here it is a worker's, which
            # serves rank 0's steps and ends with it.
            run_torchrun_worker(config)
            raise SystemExit(0)
        model = load_rank_model(config, rank=0)
        return cls(config, model, load_tokenizer(config.model_dir))

    def check_health(self) -> None:
        """Raise if the engine cannot run a step (a tensor-parallel rank has died)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """End what the engine started (a tensor-parallel engine's worker ranks, the
        grammar compiler's thread)."""
        if self._grammars is not None:
            self._grammars.shutdown()
        self.runner.shutdown()

    @property
    def model(self) -> torch.nn.Module:
        """The model the runner executes (the optimized runner's has merged projections)."""
        return self.runner.model

    @property
    def backend(self):
        return self.runner.backend  # the step's ops

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | BeamSearchParams) -> None:
        """Queue a request; a bad one raises ValueError (naming the field: request_checks.py)
        and leaves everything else as it was. With BeamSearchParams the request is a beam
        search (its outputs: the best beams)."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_params(params)
        text, ids = prompt_ids(prompt, self.tokenizer, self.vocab_size)
        check_request(request_id, len(ids), params, self.kv, self.config.scheduler_config,
                      self.vocab_size, self.config.max_logprobs)
        compiling = self._check_grammar(params)
        seed = getattr(params, "seed", None)
        if seed is None:
            seed = self.seed_stream.getrandbits(62)
        group = SequenceGroup(request_id, [], params, next(self._arrivals), seed, prompt=text)
        group.seqs.append(Sequence(next_seq_id(), ids))
        self.groups[request_id] = group
        if compiling is None:
            self.scheduler.add(group)
        elif isinstance(compiling, Future):  # a new grammar: the request waits for it
            self._compiling.append((group, compiling))
        else:
            self._set_grammar(group, compiling)
            self.scheduler.add(group)

    # --8<-- [start:compile]
    def _check_grammar(self, params):
        """A request's structured outputs: None without; the compiled grammar if it
        is cached (a dictionary lookup); else the Future of its compile on the
        compiler's thread, which does not hold up the running requests' steps."""
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return None
        if self.tokenizer is None or self.eos_token_id is None:
            raise FieldValueError(STRUCTURED_OUTPUTS, "structured outputs need the "
                                  "model's tokenizer and its EOS token; this model "
                                  "folder has none")
        if self._grammars is None:
            self._grammars = BackgroundCompiler(self.tokenizer, self.vocab_size,
                                                self.eos_token_id)
        compiled = self._grammars.lookup(spec)
        return compiled if compiled is not None else self._grammars.submit(spec)
    # --8<-- [end:compile]

    def _set_grammar(self, group: SequenceGroup, grammar) -> None:
        group.grammar = grammar
        group.seqs[0].matcher = self._grammars.matcher(grammar)  # at the grammar's start

    def _admit_compiled(self) -> list[SequenceGroup]:
        """Requests whose grammar is compiled join the scheduler (in arrival order); with
        nothing else to run, wait a little for one. Returns the requests whose compile
        failed: they finish with finish_reason "error"."""
        if not self.scheduler.has_unfinished():
            wait([f for _, f in self._compiling], timeout=0.01, return_when=FIRST_COMPLETED)
        failed, still = [], []
        for group, future in self._compiling:
            if not future.done():
                still.append((group, future))
            elif future.exception() is not None:
                group.seqs[0].status = SequenceStatus.FINISHED
                group.seqs[0].finish_reason = "error"
                failed.append(group)
            else:
                self._set_grammar(group, future.result())
                self.scheduler.add(group)
        self._compiling = still
        return failed

    def abort_request(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is None:
            raise ValueError(f"no request with id {request_id!r} is in the engine")
        self._compiling = [(g, f) for g, f in self._compiling if g is not group]
        self.scheduler.remove(group)
        for seq in group.unfinished_seqs():
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        del self.groups[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def has_request(self, request_id: str) -> bool:
        """Does the engine hold this request (queued, compiling, running)? (client.py)"""
        return request_id in self.groups

    @property
    def limits(self) -> ModelLimits:
        """What a front end checks requests against (client.py)."""
        return ModelLimits(self.config.max_model_len, self.vocab_size, self.config.max_logprobs)

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call observer(engine, scheduler_output, step_inputs) in every step, just before the
        forward: the block moves are done, the step's slots are booked (figures, tests)."""
        self.step_observers.append(observer)

    # -- the step ----------------------------------------------------------------------------
    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests this step touched.

        If anything in the step raises, the requests it was running are finished with
        finish_reason "error" and their memory freed before the exception goes on: the
        engine stays usable and every other request is untouched.
        """
        failed = self._admit_compiled() if self._compiling else []
        sched = None
        try:
            sched = self.scheduler.schedule()
            self.runner.move_blocks(sched.blocks_to_swap_out, sched.blocks_to_swap_in,
                                    sched.blocks_to_copy)
            if sched.scheduled:
                inputs = prepare_inputs(sched, self.kv, self.vocab_size, self.eos_token_id,
                                        self.device)
                for observe in self.step_observers:
                    observe(self, sched, inputs)
                logits = self.runner.execute(inputs)  # [S (+ P prompt rows), vocab]
                self.cache_engine.quant.calculate_scales = False  # fp8: set by this forward
                sampled = self.runner.sample(logits[:len(inputs.rows)], inputs.sampling)
                self.scheduler.update_from_output(sched)
                self._update(inputs, logits, sampled)
        except BaseException:
            self._fail_step(sched)
            raise
        touched = list(dict.fromkeys(item.group for item in sched.scheduled)) + failed
        self.scheduler.finish_requests(touched)
        outputs = [self._output(g) for g in touched if g.is_finished or g.streams]
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
            groups = self.scheduler.groups_holding_memory()
        for group in dict.fromkeys(groups):
            if group.request_id not in self.groups:
                continue  # already finished and removed
            self.scheduler.remove(group)
            for seq in group.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            del self.groups[group.request_id]
        self.scheduler.finish_static_batch_if_done()

    # --8<-- [start:update]
    def _update(self, inputs: StepInputs, logits: torch.Tensor, sampled: SamplerOutput) -> None:
        """The sampled tokens join their sequences: n > 1 prompts fork, beams are selected,
        stops are checked, finished samples free their blocks; prompt rows give their
        prompt logprobs."""
        collect_prompt_logprobs(inputs.prompt_rows, logits[len(inputs.rows):])
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

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                      top: dict[int, float]) -> None:
        params = group.sampling_params
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs.append({token: logprob, **top})
        new_text = ""
        # Text as it grows only where someone reads it before the end: a stream, or a stop
        # string to search for. Otherwise it is decoded once, when the sequence finishes.
        if self.tokenizer is not None and (params.stop_strings
                                           or params.output_kind == "cumulative"):
            if seq.detokenizer is None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            new_text = seq.detokenizer.add(token)
            seq.output_text += new_text
        check_stop(seq, new_text, params, self.eos_token_id, self.config.max_model_len)
        if seq.matcher is not None:  # the grammar takes the token; complete, it ends here
            advance(seq, token)
        if seq.is_finished and self.tokenizer is not None:
            if seq.detokenizer is None:
                seq.output_text = self._decode(seq.output_token_ids)
            elif seq.stop_reason not in params.stop_strings:
                seq.output_text += seq.detokenizer.flush()  # the text held back, if any

    # --8<-- [start:beam_step]
    def _beam_step(self, group: SequenceGroup, logprobs: torch.Tensor) -> None:
        """Every beam has its next-token logprobs [beams, vocab]: keep the best beam_width
        (beam, token) pairs; each survivor forks its parent, the old beams are freed."""
        params: BeamSearchParams = group.sampling_params
        beams = group.unfinished_seqs()
        assert len(beams) == logprobs.shape[0], (
            "every beam of a group runs in the same step")
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
            # held by the group from now on (freed if a step fails)
            group.seqs.append(child)
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
                [(list(b.output_token_ids), b.cumulative_logprob) for b in new_beams],
                params)
            # a finished group keeps a sequence for its prompt
            group.seqs = new_beams or beams
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
        # the prompt's entries once all are in (the same list every time: no copy)
        wanted = group.prompt_logprobs
        done = wanted is not None and len(wanted) == len(prompt_ids)
        return RequestOutput(group.request_id, group.prompt, prompt_ids, completions,
                             group.is_finished, prompt_logprobs=wanted if done else None,
                             prompt_token_ranks=group.prompt_token_ranks if done else None)

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
            "running": len(self.scheduler.running),
            # waiting for memory, or for their grammar to compile
            "waiting": len(self.scheduler.waiting) + len(self._compiling),
            "swapped": len(self.scheduler.swapped),
            # What the pool stores and costs: bytes per token count the int8/int4 scales; a
            # tensor-parallel engine's are rank 0's (its KV heads only).
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_bytes_per_token": self.cache_engine.nbytes() // max(total * self.kv.block_size, 1),
            "kv_cache_bytes": self.cache_engine.nbytes(),
            "kv_capacity_tokens": total * self.kv.block_size,
            "quantization": self.config.quantization,
            "weight_bytes": self.weight_bytes,  # of rank 0's shard when tensor-parallel
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "float_linears": self.float_linears,
        }
