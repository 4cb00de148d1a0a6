"""A solution to lesson 8's exercise: the blocks one beam step frees, copies and takes.

After the forks and the free, a block is held by the new beams whose parent's table lists it;
the old beams' blocks that no chosen parent lists drop to count zero and are freed. Every new
beam then appends one token. If num_tokens is a multiple of block_size the last blocks are
full and every new beam takes a fresh block. Otherwise the new beams sharing one last block all
write into it: all but the last of them copy it first, and the last writes in place.
"""

from collections import Counter


def beam_step_blocks(tables: list[list[int]], num_tokens: int, block_size: int,
                     parents: list[int]) -> tuple[list[int], list[int], int]:
    """(freed, copied, new_blocks) for one beam step."""
    old = {block for table in tables for block in table}
    kept = {block for p in set(parents) for block in tables[p]}
    freed = sorted(old - kept)
    if num_tokens % block_size == 0:  # every last block is full: a fresh block per new beam
        return freed, [], len(parents)
    writers = Counter(tables[p][-1] for p in parents)  # new beams per shared last block
    copied = sorted(block for block, n in writers.items() for _ in range(n - 1))
    return freed, copied, len(copied)
