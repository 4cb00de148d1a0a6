"""Solution of milestone 7: the engine's step, which runs every other piece once per step."""

import itertools
from dataclasses import replace

import torch
from build_types import Parts, SchedulerOutput, Sequence

from pagedllm.reference.model import AttentionMetadata, PagedAttention
from pagedllm.reference.ops import REFERENCE_BACKEND


class MiniEngine:
    # -- given: the same in lessons/build/engine.py -----------------------------------------
    def __init__(self, model: torch.nn.Module, parts: Parts, num_blocks: int,
                 block_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                 enable_prefix_caching: bool = False):
        cfg = model.config
        param = next(model.parameters())
        self.model, self.parts = model, parts
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.k_caches, self.v_caches = parts.allocate_kv_cache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            param.dtype, param.device)
        prefix_cache = parts.PrefixCache(block_size) if enable_prefix_caching else None
        self.block_manager = parts.BlockManager(num_blocks, block_size, prefix_cache)
        self.scheduler = parts.Scheduler(self.block_manager, max_num_seqs,
                                         max_num_batched_tokens)
        # The model's layers write and read K/V through these two ops: milestone 1's.
        self.backend = replace(REFERENCE_BACKEND, store_kv=parts.store_kv,
                               paged_attention=parts.paged_attention)
        self.generator = torch.Generator(device=param.device).manual_seed(0)
        self._seq_ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], max_tokens: int) -> Sequence:
        """Queue a greedy request; refuse one that could never run in this engine."""
        n = len(prompt_token_ids) + max_tokens
        if not prompt_token_ids or max_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_tokens >= 1")
        if -(-n // self.block_size) > self.num_blocks or n > self.max_num_batched_tokens:
            raise ValueError(f"a request of {n} tokens needs more than the pool of "
                             f"{self.num_blocks} blocks of {self.block_size} or the step's "
                             f"budget of {self.max_num_batched_tokens} tokens: once preempted "
                             "it could never be prefilled again")
        arrival = next(self._seq_ids)
        seq = Sequence(arrival, list(prompt_token_ids), max_tokens, arrival)
        self.scheduler.add(seq)
        return seq

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Every prompt's greedy tokens, in the order of the prompts."""
        seqs = [self.add_request(p, max_tokens) for p in prompts]
        while self.scheduler.has_unfinished():
            out = self.step()
            if not out.scheduled and not out.preempted:
                raise RuntimeError("a step scheduled nothing while requests are unfinished: "
                                   "the engine would loop forever (check the scheduler's "
                                   "admission and the block manager's can_allocate)")
        return [list(s.output_token_ids) for s in seqs]

    # -- milestone 7 --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        # Copy-on-write: a copied block must hold its source's K/V before anyone writes it.
        self.parts.copy_blocks(self.k_caches, self.v_caches, out.blocks_to_copy)
        if not out.scheduled:
            return out
        inputs = self.parts.build_step_inputs(out, self.block_manager)
        device = self.k_caches[0].device
        metadata = AttentionMetadata(
            slot_mapping=inputs.slot_mapping.to(device),
            block_tables=inputs.block_tables.to(device),
            seq_lens=inputs.seq_lens.to(device),
            query_start_loc=inputs.query_start_loc.to(device),
            seq_lens_cpu=inputs.seq_lens, query_start_loc_cpu=inputs.query_start_loc)
        attn = PagedAttention(metadata, self.k_caches, self.v_caches, self.backend)
        logits = self.model(inputs.input_ids.to(device), inputs.positions.to(device), attn,
                            logits_indices=inputs.logits_indices.to(device))  # [S, vocab]
        S = logits.shape[0]
        greedy = torch.zeros(S, device=device)  # every request of this engine is greedy
        no_top_k = torch.full((S,), -1, dtype=torch.int64, device=device)
        tokens = self.parts.sample(logits, greedy, no_top_k, self.generator)  # [S]
        self.scheduler.update(out, tokens.tolist())
        return out
