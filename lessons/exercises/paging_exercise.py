"""Exercise (lesson 3, "Paging the KV cache"): the two pieces of arithmetic paging rests on.

A paged KV cache is a pool of physical blocks of ``block_size`` token slots each. A sequence's
block table lists, in order, the physical blocks that hold its logical blocks 0, 1, 2, ...
Write the two functions below. Check your work with

    pytest lessons/exercises/test_paging_exercise.py

The test grows and frees sequences in the real BlockSpaceManager (reference/kv/block_manager.py)
and compares your answers with the manager's at every step. Until you edit this file the test
reports your version as skipped and checks only the solution.
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
