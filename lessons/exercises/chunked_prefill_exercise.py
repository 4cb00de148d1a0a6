"""Exercise (lesson 6, "Budgets and chunked prefill"): how one step splits its token budget.

With enable_chunked_prefill=True a step holds at most max_num_batched_tokens tokens, and the
reference scheduler fills it in this order (lesson 6, "Chunked prefill"):

1. The running requests, in arrival order. A request that is decoding computes one token. A
   request whose prompt is only partly computed continues with its next chunk: as many of its
   remaining tokens as the budget still allows. A request that finds the budget spent computes
   nothing this step (and stays running).
2. Then waiting requests are admitted, first come first served, into what is left: one more
   sequence must stay within max_num_seqs (counting every running request), and some budget
   must be left. An admitted prompt longer than what is left starts with a chunk of what fits.

Check your work with

    pytest lessons/exercises/test_chunked_prefill_exercise.py

The test runs the real Scheduler (reference/engine/scheduler.py) with chunked prefill over a
stream of arriving requests, prompts long and short, and compares your split with the
scheduler's at every step. The KV pool is large, so memory never limits a step here. Until you
edit this file the test reports your version as skipped and checks only the solution.
"""


def chunked_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                 max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, int]:
    """{request_id: tokens computed this step}; a request that computes none is left out.

    running: (request_id, uncomputed) for each running request, in arrival order: uncomputed is
    1 for a request that decodes, more for one still in the middle of its prompt.
    waiting: (request_id, prompt_len) for each waiting request, in arrival order.

    Example: two decoding requests, a 100-token prompt waiting, a budget of 32 and max_num_seqs
    8: {"a": 1, "b": 1, "c": 30}.
    """
    # Track the budget left as you go; it decides both the chunks and whether anyone is admitted.
    raise NotImplementedError("exercise: implement chunked_step")
