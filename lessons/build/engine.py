"""Milestone 7 of the build-it track: the engine (lessons/build/07-engine.md).

Write MiniEngine.step. Check your work with

    pytest lessons/build/test_build_engine.py

The engine is built from a build_types.Parts: one implementation of every earlier piece,
yours where you have written it (build_track.compose). Use the pieces through self.parts,
self.block_manager and self.scheduler, never by importing them: then the same engine runs on
yours or on the solutions'. The model is pagedllm's reference model; its forward is

    model(input_ids [T], positions [T], attn, logits_indices=[S]) -> logits [S, vocab]

where attn is the attention context pagedllm.reference.model.PagedAttention(metadata,
k_caches, v_caches, backend): each layer stores its K/V and attends through the backend's
store_kv and paged_attention, which __init__ below made yours (milestone 1). metadata is a
pagedllm.reference.model.AttentionMetadata (reference/model/attention.py) of six tensors:
slot_mapping, block_tables, seq_lens and query_start_loc on the model's device, and
seq_lens_cpu and query_start_loc_cpu, the same values as seq_lens and query_start_loc as
CPU tensors.

한국어:
엔진 직접 만들기 트랙의 마일스톤 7: 엔진(lessons/build/07-engine.md).

MiniEngine.step을 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/build/test_build_engine.py

엔진은 build_types.Parts로 만들어집니다: 앞선 모든 조각의 구현이 하나씩 들어 있으며, 여러분이
작성한 조각은 여러분의 것입니다(build_track.compose). 조각들은 import하지 말고 self.parts,
self.block_manager, self.scheduler를 통해 쓰세요: 그래야 같은 엔진이 여러분의 조각으로도, 해답의
조각으로도 돌아갑니다. 모델은 pagedllm의 레퍼런스 모델이며, 그 forward는 다음과 같습니다.

    model(input_ids [T], positions [T], attn, logits_indices=[S]) -> logits [S, vocab]

여기서 attn은 어텐션 컨텍스트 pagedllm.reference.model.PagedAttention(metadata, k_caches,
v_caches, backend)입니다: 각 레이어는 백엔드의 store_kv와 paged_attention을 거쳐 자기 K/V를
저장하고 어텐션하며, 아래의 __init__이 이 둘을 여러분의 것으로 만들어 두었습니다(마일스톤 1).
metadata는 pagedllm.reference.model.AttentionMetadata (reference/model/attention.py)이며 텐서 여섯
개로 되어 있습니다: 모델의 디바이스에 있는 slot_mapping, block_tables, seq_lens, query_start_loc,
그리고 seq_lens, query_start_loc과 같은 값을 CPU 텐서로 가진 seq_lens_cpu,
query_start_loc_cpu입니다.
"""

import itertools
from dataclasses import replace

import torch
from build_types import Parts, SchedulerOutput, Sequence

from pagedllm.reference.model import AttentionMetadata, PagedAttention  # noqa: F401 - for step
from pagedllm.reference.ops import REFERENCE_BACKEND


class MiniEngine:
    # -- given: the same in lessons/build/solutions/engine.py -------------------------------
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
    def step(self) -> SchedulerOutput:
        """One step of the engine; returns the scheduler's output for it.

        Schedule; carry out the block copies the scheduler asked for before anything is
        written; if something is scheduled, build the step's inputs, run the model forward
        once over all of them (no gradients), take one greedy token per sampling row
        (self.parts.sample, temperature 0, top_k -1, self.generator) and give them to the
        scheduler's update.
        """
        raise NotImplementedError("milestone 7: write MiniEngine.step")
