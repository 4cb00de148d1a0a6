"""A solution to lesson 5's exercise: a decode step with preemption, recompute or swap.

Requests are served in arrival order. One whose last block is full needs a free block; while
none is free, the latest arrival not yet served is preempted (all its blocks at once), and when
nobody later is left the request preempts itself. Swap moves the victim's blocks to the CPU
pool if they fit there; otherwise, and in recompute mode, the blocks are freed and the victim
will prefill its prompt and every token generated so far (num_cached + 1 tokens) again.
"""

from collections import deque


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def decode_step(running: list[tuple[str, int]], num_free_blocks: int, num_free_cpu_blocks: int,
                block_size: int, mode: str) -> dict:
    """One decode step of the running requests, with preemption when the pool runs out."""
    result = {"decoded": [], "swapped": [], "recomputed": [], "prefill_again": {}}
    free, free_cpu = num_free_blocks, num_free_cpu_blocks
    queue = deque(running)
    while queue:
        request_id, num_cached = queue.popleft()
        needs_block = num_cached % block_size == 0  # its last block is full
        while needs_block and free == 0:
            victim, victim_cached = queue.pop() if queue else (request_id, num_cached)
            blocks = blocks_needed(victim_cached, block_size)
            free += blocks  # all or nothing: every block it holds
            if mode == "swap" and blocks <= free_cpu:
                free_cpu -= blocks
                result["swapped"].append(victim)
            else:  # recompute, or swap with no room left in the CPU pool
                result["recomputed"].append(victim)
                result["prefill_again"][victim] = victim_cached + 1  # the sampled token too
            if victim == request_id:
                break
        else:
            free -= needs_block
            result["decoded"].append(request_id)
    result["free_blocks"], result["free_cpu_blocks"] = free, free_cpu
    return result
