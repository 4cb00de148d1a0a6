"""LLMEngine: one step = schedule -> move blocks -> prepare inputs -> forward -> sample ->
update. Requests come and go between steps (add_request, abort_request).

The step, part by part (vLLM V1's seam), each with one owner:

    _propose()                     speculative decoding only: each running sequence's proposed
                                   next tokens (spec_decode/), which the scheduler books
    Scheduler.schedule()           SchedulerOutput: which sequences run, how many tokens each,
                                   and the blocks to swap out / swap in / copy (no tensors)
    runner.move_blocks(...)        the runner carries those moves out on its KV tensors
    prepare_inputs(...)            StepInputs: flat tensors (input_ids, positions, slot_mapping,
                                   block_tables, seq_lens, query_start_loc, logits_indices)
    runner.execute(inputs)         logits [S, vocab] for the rows that predict a next token
    runner.sample(...)             one token per row
    Scheduler.update_from_output   the only change a step's results make: tokens computed and
                                   appended, samples forked, beams selected, stops checked,
                                   grammars advanced, what finished freed
    OutputProcessor.make_output    a RequestOutput per request the step touched

The engine owns no tensor and no process: the runner (``model_runner.py``, chosen once from
the config by ``runner_factory.py``, tensor-parallel or not) holds the model and the KV pool;
the scheduler and the KV manager hold the bookkeeping. Requests with a grammar still
compiling wait in ``structured_outputs/admission.py``.
"""

import itertools
import random
from collections.abc import Callable

import torch

from ..kv import ContiguousKVCacheManager, KVCacheConfig, PagedKVCacheManager, keep_every_token
from ..model.loader import load_tokenizer
from ..model.quantization import float_linears, weight_bytes
from ..spec_decode.propose import make_proposer, propose
from .beam_search import BeamSearchParams
from .client import ModelLimits
from .config import EngineArgs, EngineConfig
from .output_processor import OutputProcessor
from .outputs import ModelRunnerOutput, RequestOutput
from .request_checks import check_params, check_request, prompt_ids
from .runner_factory import create_model_runner, load_engine_model
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, next_seq_id
from .step_inputs import StepInputs, prepare_inputs
from .structured_outputs.admission import GrammarAdmission
from .validation import FieldValueError

StepObserver = Callable[["LLMEngine", SchedulerOutput, StepInputs], None]


class LLMEngine:
    """One engine for every tier: the tier is the model runner its config names."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer=None):
        """config: checked and resolved (``EngineArgs(...).create_engine_config()``); model: the
        reference model of the checkpoint (rank 0's shard when tensor-parallel), loaded in
        config.dtype on config.device."""
        self.config = config
        # With a quantization, the layers it left in float (skipped, or not in the GGUF's
        # blocks), named before a tier's runner rewrites the modules.
        self.float_linears = float_linears(model) if config.quantization else []
        self.runner = create_model_runner(config, model)  # the tier, chosen once
        # None: the runner measures what the GPU has left once weights and a step are in.
        num_gpu_blocks = config.num_gpu_blocks or self.runner.profile_num_blocks()
        if config.kv_layout == "paged":
            groups = self.runner.get_kv_cache_spec(config.block_size)
            self.kv = PagedKVCacheManager(config.block_size, num_gpu_blocks,
                                          config.swap_space_blocks, config.enable_prefix_caching,
                                          groups)
        else:
            self.kv = ContiguousKVCacheManager(num_gpu_blocks * config.block_size,
                                               config.reservation_policy, config.max_model_len)
            # a slab keeps every layer's rows to the end: one group, a tensor per layer
            groups = keep_every_token(self.runner.get_kv_cache_spec(self.kv.block_size))
        # The pool as the KV manager counts it (a slab's slots are blocks of one), for the
        # runner to allocate: it owns the tensors.
        self.kv_cache_config = KVCacheConfig(
            self.kv.num_total_blocks,
            config.swap_space_blocks if config.kv_layout == "paged" else 0, groups)
        self.runner.initialize_kv_cache(self.kv_cache_config)
        self.device = next(self.runner.model.parameters()).device
        self.vocab_size = config.model_config.vocab_size
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.output_processor = OutputProcessor(tokenizer, eos_token_id, config.max_model_len)
        # speculative runs are verified by the runner's backend (a kernel where it has one)
        self.scheduler = Scheduler(config.scheduler_config, self.kv, self.output_processor,
                                   verify_op=self.runner.backend.accepted_lengths)
        # structured outputs: requests wait there while their grammar compiles
        self.grammars = GrammarAdmission(self.vocab_size)
        self.groups: dict[str, SequenceGroup] = {}
        # Seeds for requests without one. random.Random takes every bit of the engine's seed
        # (torch's CPU generator keeps 32 of them: seeds 1 and 2**32 + 1 would be the same).
        self.seed_stream = random.Random(config.seed)
        self._arrivals = itertools.count()
        self.step_observers: list[StepObserver] = []
        self.weight_bytes = weight_bytes(self.runner.model)  # once: the weights never change
        # None without speculative_config
        self.proposer = make_proposer(config, self.kv.num_total_blocks)
        self.num_steps = 0  # engine steps run (the benchmarks' steps per output token)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Check the options (before any weight loads), then load the checkpoint's model and
        tokenizer and build the engine."""
        config = args.create_engine_config()
        return cls(config, load_engine_model(config), load_tokenizer(config.model_dir))

    def check_health(self) -> None:
        """Raise if the engine cannot run a step (a tensor-parallel rank has died)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """End what the engine started (a tensor-parallel engine's worker ranks, the
        grammar compiler's thread)."""
        self.grammars.shutdown()
        self.runner.shutdown()

    @property
    def model(self) -> torch.nn.Module:
        """The model the runner executes (the optimized runner's has merged projections)."""
        return self.runner.model

    @property
    def backend(self):
        return self.runner.backend  # the step's ops

    @property
    def tokenizer(self):
        """The model's tokenizer (None without one), the output processor's."""
        return self.output_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.output_processor.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a sequence (the tokenizer's; a test may set another)."""
        return self.output_processor.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, token_id: int | None) -> None:
        self.output_processor.eos_token_id = token_id

    @property
    def cache_engine(self):
        return self.runner.cache_engine  # the KV tensors, the runner's (rank 0's)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | BeamSearchParams) -> None:
        """Queue a request; a bad one raises ValueError (naming the field: request_checks.py)
        and leaves everything else as it was. With BeamSearchParams the request is a beam
        search (its outputs: the best beams)."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_params(params)
        if self.proposer is not None and isinstance(params, BeamSearchParams):
            raise FieldValueError("speculative_config", "beam search is refused with "
                                  "speculative_config: beams are chosen from logprobs, not "
                                  "drawn, so there is no token for a proposal to match; use an "
                                  "engine without speculation for beam search")
        text, ids = prompt_ids(prompt, self.tokenizer, self.vocab_size)
        check_request(request_id, len(ids), params, self.kv, self.config.scheduler_config,
                      self.vocab_size, self.config.max_logprobs)
        # the grammar: compiled, compiling, or None
        grammar = self.grammars.check(params, self.tokenizer, self.eos_token_id)
        seed = getattr(params, "seed", None)
        if seed is None:
            seed = self.seed_stream.getrandbits(62)
        group = SequenceGroup(request_id, [], params, next(self._arrivals), seed, prompt=text)
        group.seqs.append(Sequence(next_seq_id(), ids))
        self.groups[request_id] = group
        self.grammars.add(group, grammar, self.scheduler)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is None:
            raise ValueError(f"no request with id {request_id!r} is in the engine")
        self.grammars.remove(group)
        self.scheduler.abort(group)
        del self.groups[request_id]  # only once its memory is back: else it can be retried

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammars)

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
        failed = self.grammars.admit_compiled(self.scheduler)  # a compile that failed
        sched = None
        touched = []
        try:
            self._propose()
            sched = self.scheduler.schedule()
            self.runner.move_blocks(sched.blocks_to_swap_out, sched.blocks_to_swap_in,
                                    sched.blocks_to_copy)
            if sched.scheduled:
                inputs = prepare_inputs(sched, self.kv, self.vocab_size, self.eos_token_id,
                                        self.device)
                for observe in self.step_observers:
                    observe(self, sched, inputs)
                logits = self.runner.execute(inputs)  # [S (+ P prompt rows), vocab]
                sampled = self.runner.sample(logits[:len(inputs.rows)], inputs.sampling)
                touched = self.scheduler.update_from_output(sched, ModelRunnerOutput(
                    sampled, logits, inputs.rows, inputs.prompt_rows))
        except BaseException:
            for group in failed:  # finished before the step: nothing of theirs to free
                self.groups.pop(group.request_id, None)
            self._fail_step(sched)
            raise
        self.num_steps += 1
        outputs = [self.output_processor.make_output(g) for g in touched + failed
                   if g.is_finished or g.streams]
        for group in touched + failed:
            if group.is_finished:
                self.groups.pop(group.request_id, None)
        return outputs
    # --8<-- [end:step]

    def _propose(self) -> None:
        """Each running decode's proposed next tokens (spec_decode/propose.py), which the
        scheduler books as lookahead slots and the step verifies."""
        if self.proposer is not None:
            propose(self.proposer, self.scheduler.running, self.config)

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
                continue  # finished and removed already
            try:
                self.scheduler.abort(group, reason="error")
            except Exception:  # noqa: BLE001 - the step's own error goes on; free the others
                continue  # kept by id, so that abort_request can free it later
            del self.groups[group.request_id]

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
            "waiting": len(self.scheduler.waiting) + len(self.grammars),
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
            "num_steps": self.num_steps,
            **(self.scheduler.spec_metrics.stats() if self.proposer is not None else {}),
        }

