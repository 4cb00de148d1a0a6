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

한국어:
연습 문제(10강, "PagedAttention 커널"): 블록 테이블을 거쳐, 제자리에서 어텐션하기.

페이징된 캐시는 블록의 풀이며, k_cache와 v_cache는 [num_blocks, block_size, kv_heads, head_dim]
형태입니다. 토큰 seq_len개짜리 시퀀스 하나는 키와 값을 블록 테이블이 순서대로 나열하는 블록들에
둡니다: 위치 p는 블록 block_table[p // block_size]의 슬롯 p % block_size에 있습니다. seq_len 뒤의
슬롯에는 쓰레기 값이 들어 있습니다(테스트는 NaN으로 채웁니다).

이 시퀀스의 쿼리 하나에 대한 디코드 어텐션을 작성하세요. 캐시는 블록이 놓인 자리에서 블록 하나씩
읽습니다: 시퀀스 전체를 새 텐서로 모으지(gather) 마세요(그 복사를 피하려고 이 커널이 있는
것입니다). 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_paged_kernel_exercise.py

테스트는 흩어진 블록 테이블, 여러 블록 크기, 그룹 쿼리 헤드에서 여러분의 출력을
레퍼런스(reference/ops/attention.py)와 비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의
버전을 skipped로 보고하고 해답만 확인합니다.
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
