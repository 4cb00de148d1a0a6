"""Exercise (lesson 4, "Static versus continuous batching"): one step of continuous batching.

Every step the scheduler rebuilds the batch from the queues. Write what one step of the
reference scheduler decides, with vLLM's rules and chunked prefill off (lesson 4):

- Requests waiting for their prefill are admitted first come, first served. A request is
  admitted when all three budgets allow it: one more sequence stays within max_num_seqs
  (counting the running ones), its whole prompt fits in what is left of the step's
  max_num_batched_tokens, and the pool has a free block for every block its prompt fills. The
  first request that does not fit stops admission: nobody behind it jumps ahead.
- A step that admitted anyone only prefills: it computes every admitted prompt whole, and the
  running requests get no token in it.
- Otherwise every running request decodes one token, in arrival order, each costing one token
  of the budget (a request that finds the budget spent skips this step and keeps its blocks).
  A decode writes the K/V of the token sampled last step; it takes a new block when the
  request's last block is full.

Check your work with

    pytest lessons/exercises/test_batching_exercise.py

The test runs the real Scheduler (reference/engine/scheduler.py) over a stream of arriving
requests on a paged KV pool and compares your step with the scheduler's at every step it takes
without preemption (preemption is lesson 5's exercise). Until you edit this file the test
reports your version as skipped and checks only the solution.
"""


def continuous_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                    num_free_blocks: int, block_size: int, max_num_seqs: int,
                    max_num_batched_tokens: int) -> tuple[dict[str, int], int]:
    """One scheduling step: ({request_id: tokens computed this step}, free blocks after it).

    running: (request_id, num_cached) for each running request, in arrival order. Each has one
    sequence whose blocks hold the K/V of its first num_cached tokens; its decode this step
    computes token num_cached (the one sampled at the end of the last step).
    waiting: (request_id, prompt_len) for each waiting request, in arrival order, prompt_len
    being the tokens its prefill computes.
    num_free_blocks: free blocks of block_size slots in the pool. The pool has fewer than 100
    blocks, so vLLM's admission watermark (1 % of the pool) is zero here.

    A request that computes nothing this step is left out of the dict.

    Example: nothing waits, two requests run holding 4 and 5 tokens in blocks of 4, 3 blocks
    are free: ({"a": 1, "b": 1}, 2).
    """
    # Decide first which kind of step this is: that needs the admission loop to run.
    # Two counts change as you admit: the sequences running and the tokens left in the budget.
    # Lesson 3's blocks_needed tells you how many blocks a prompt fills.
    raise NotImplementedError("exercise: implement continuous_step")
