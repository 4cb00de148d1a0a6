"""A solution to lesson 6's exercise: the token budget of one step with chunked prefill.

Running requests come first, in arrival order: a decode takes 1 token, an unfinished prompt a
chunk of min(its remaining tokens, the budget left). Waiting requests are then admitted in
order while max_num_seqs allows and budget is left, each starting with a chunk of what fits.
"""


def chunked_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                 max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, int]:
    """{request_id: tokens computed this step}; a request that computes none is left out."""
    scheduled: dict[str, int] = {}
    left = max_num_batched_tokens
    for request_id, uncomputed in running:  # decodes and unfinished chunks, arrival order
        n = min(uncomputed, left)
        if n > 0:
            scheduled[request_id] = n
            left -= n
    num_seqs = len(running)
    for request_id, prompt_len in waiting:  # prompts fill what is left of the budget
        if num_seqs + 1 > max_num_seqs or left == 0:
            break  # first come, first served: nobody behind the head jumps ahead
        scheduled[request_id] = min(prompt_len, left)  # a chunk, if the prompt is longer
        num_seqs, left = num_seqs + 1, left - scheduled[request_id]
    return scheduled
