"""A solution to lesson 7's exercise: blocks held by n samples of one prompt.

Every sample ends up holding ceil((prompt_len + output_len) / block_size) blocks in its block
table. Without sharing, all of them are distinct. With sharing, the prompt's full blocks,
floor(prompt_len / block_size) of them, are the same physical blocks in every table: nobody
writes into a full block again, so they are never copied. A partly filled last prompt block is
written by every sample, so it ends up as one version per sample (n - 1 copies plus the
original) and counts like a private block. Sharing therefore saves exactly
(n - 1) * floor(prompt_len / block_size) blocks.
"""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size  # ceiling division, integers only


def blocks_without_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
    """Blocks held when each sample stores the prompt by itself."""
    return sum(blocks_needed(prompt_len + out, block_size) for out in output_lens)


def blocks_with_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
    """Blocks held when the samples fork from one prefilled prompt (copy-on-write)."""
    shared = prompt_len // block_size  # full prompt blocks: in every table, stored once
    return shared + sum(blocks_needed(prompt_len + out, block_size) - shared
                        for out in output_lens)
