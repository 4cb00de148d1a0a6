"""Exercise (lesson 3, "Paging the KV cache"): the two pieces of arithmetic paging rests on.

A paged KV cache is a pool of physical blocks of ``block_size`` token slots each. A sequence's
block table lists, in order, the physical blocks that hold its logical blocks 0, 1, 2, ...
Write the two functions below. Check your work with

    pytest lessons/exercises/test_paging_exercise.py

The test grows and frees sequences in the real BlockSpaceManager (reference/kv/block_manager.py)
and compares your answers with the manager's at every step. Until you edit this file the test
reports your version as skipped and checks only the solution.

한국어:
연습 문제(3강, "KV 캐시 페이징"): 페이징이 기대는 두 가지 계산.

페이징된 KV 캐시는 각각 토큰 슬롯 ``block_size``개로 된 물리 블록의 풀입니다. 시퀀스의 블록
테이블은 그 시퀀스의 논리 블록 0, 1, 2, ...를 담은 물리 블록을 순서대로 나열합니다. 아래 두 함수를
작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_paging_exercise.py

테스트는 실제 BlockSpaceManager(reference/kv/block_manager.py)에서 시퀀스를 늘리고 해제하며, 매
스텝 여러분의 답을 관리자의 답과 비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을
skipped로 보고하고 해답만 확인합니다.
"""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold num_tokens tokens (0 tokens need 0 blocks).

    The seed example: 3200 tokens in blocks of 512 need 7 blocks (the last holds 128 tokens);
    in blocks of 16 they need exactly 200.
    """
    # Every block but the last is full; the last holds whatever is left over.
    # Think about what happens when num_tokens is an exact multiple of block_size:
    # 3200 // 16 + 1 would be one block too many. Use integer arithmetic only (no floats):
    # a float division can round the wrong way for large numbers.
    raise NotImplementedError("exercise: implement blocks_needed")


def slot_mapping(block_table: list[int], block_size: int, positions: list[int]) -> list[int]:
    """The slot (row of the flat pool of num_blocks * block_size slots) of each position.

    block_table[i] is the physical block that holds the sequence's logical block i, that is,
    its positions i * block_size .. (i + 1) * block_size - 1. The K/V of every token of every
    sequence lives in one flat run of slots: physical block b covers slots b * block_size ..
    (b + 1) * block_size - 1.

    Example: block_table [0, 1, 7, 10], block_size 4, positions [9] -> [29].
    """
    # For each position:
    # 1. Which logical block is it in? (integer division by block_size)
    # 2. Which physical block holds that logical block? (look it up in block_table)
    # 3. Where inside the block does it sit? (the remainder)
    # 4. The slot: the physical block's first slot plus that offset.
    # Return the slots in the order of `positions` (they need not be sorted or contiguous).
    raise NotImplementedError("exercise: implement slot_mapping")
