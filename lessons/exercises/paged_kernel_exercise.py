"""Exercise (lesson 10, "The PagedAttention kernel"): attend through the block table, in place.

A paged cache is a pool of blocks, k_cache and v_cache of shape [num_blocks, block_size,
kv_heads, head_dim]. One sequence of seq_len tokens has its keys and values in the blocks its
block table lists, in order: position p lives in block block_table[p // block_size], at slot
p % block_size. Slots past seq_len hold garbage (the test fills them with NaN).

Write decode attention for one query of this sequence, reading the cache one block at a time
where the blocks lie: no gather of the whole sequence into a new tensor (that copy is what the
kernel exists to avoid). Check your work with

    pytest lessons/exercises/test_paged_kernel_exercise.py

The test compares your output with the reference (reference/ops/attention.py) on scattered
block tables, several block sizes and grouped-query heads. Until you edit this file the test
reports your version as skipped and checks only the solution.
"""

import torch


def attend_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: list[int], seq_len: int, scale: float) -> torch.Tensor:
    """q [heads, head_dim], the query at position seq_len - 1 -> [heads, head_dim].

    heads may be a multiple of kv_heads (grouped-query attention): query head h uses K/V head
    h // (heads // kv_heads). The query sees every key at positions 0 .. seq_len - 1.
    """
    # 1. Walk the logical blocks 0 .. ceil(seq_len / block_size) - 1. For each, look up its
    #    physical block in block_table and how many of its slots hold tokens (the last block
    #    may be partly filled: never touch a slot at or past seq_len, it may be NaN).
    # 2. From that block's keys, compute the scores q . k * scale of every query head
    #    (mind the group: which K/V head does query head h read?). Keep them.
    # 3. Softmax over all the scores of a head (you may keep them all: lesson 11 shows how to
    #    avoid that), then sum the values, again block by block, weighted by the probabilities.
    raise NotImplementedError("exercise: implement attend_in_place")
