"""A solution to lesson 3's exercise: block counts and slot mapping.

Both functions are one line of integer arithmetic. They are the same formulas as
``BlockSpaceManager.blocks_needed`` and ``BlockSpaceManager.slot`` in reference/kv/block_manager.py,
but take the block table as an argument instead of looking it up by sequence id, which is how a
GPU kernel receives it (one row of a block-table tensor per sequence).
"""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold num_tokens tokens (0 tokens need 0 blocks)."""
    # Ceiling division: add block_size - 1 so that a partial last block counts as a block, but
    # an exact multiple does not gain one. (-(-n // b) in block_manager.py is the same thing.)
    return (num_tokens + block_size - 1) // block_size


def slot_mapping(block_table: list[int], block_size: int, positions: list[int]) -> list[int]:
    """The slot (row of the flat pool of num_blocks * block_size slots) of each position."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
