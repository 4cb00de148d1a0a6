"""A solution to lesson 4's exercise: one step of continuous batching, chunked prefill off.

Admission runs first, first come first served, and stops at the first request that does not fit
one of the three budgets (sequences, tokens, free blocks). If it admitted anyone the step only
prefills. Otherwise every running request decodes one token while the token budget lasts, and a
request whose last block is full (num_cached a multiple of block_size) takes a new block.
"""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def continuous_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                    num_free_blocks: int, block_size: int, max_num_seqs: int,
                    max_num_batched_tokens: int) -> tuple[dict[str, int], int]:
    """One scheduling step: ({request_id: tokens computed this step}, free blocks after it)."""
    scheduled: dict[str, int] = {}
    num_seqs, tokens_left, free = len(running), max_num_batched_tokens, num_free_blocks
    for request_id, prompt_len in waiting:  # prefills first, first come first served
        blocks = blocks_needed(prompt_len, block_size)
        if num_seqs + 1 > max_num_seqs or prompt_len > tokens_left or blocks > free:
            break  # the head does not fit: everyone behind it waits too
        scheduled[request_id] = prompt_len
        num_seqs, tokens_left, free = num_seqs + 1, tokens_left - prompt_len, free - blocks
    if scheduled:
        return scheduled, free  # a step that admitted prompts decodes nothing
    for request_id, num_cached in running:
        if tokens_left < 1:
            continue  # no budget this step; it keeps its blocks
        if num_cached % block_size == 0:
            free -= 1  # its last block is full: the new token starts a block
        scheduled[request_id] = 1
        tokens_left -= 1
    return scheduled, free
