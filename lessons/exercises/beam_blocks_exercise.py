"""Exercise (lesson 8, "Beam search on shared blocks"): what one beam step does to the blocks.

After a step of beam search, every surviving (parent beam, token) pair becomes a new beam. The
engine's _beam_step forks each new beam from its parent (it shares every block of the parent,
reference counts up), then frees the whole old generation; at the next step every new beam gets
the slot of its token with append_slot, which copies a shared, partly filled last block before
writing into it (copy-on-write). Write what that does to the physical blocks.

Check your work with

    pytest lessons/exercises/test_beam_blocks_exercise.py

The test runs beam steps with random survivors on the real BlockSpaceManager
(reference/kv/block_manager.py) in the order the engine uses (fork all, free the old beams,
append for every new beam) and compares your answer with the manager's reference counts, free
list and copy-on-write pairs at every step. Until you edit this file the test reports your
version as skipped and checks only the solution.
"""


def beam_step_blocks(tables: list[list[int]], num_tokens: int, block_size: int,
                     parents: list[int]) -> tuple[list[int], list[int], int]:
    """(freed, copied, new_blocks) for one beam step.

    tables: the block table of every current beam (beams share blocks, so a block may appear
    in several tables; nothing outside these beams holds them). Every beam holds num_tokens
    tokens in blocks of block_size slots.
    parents: for each new beam, in order, the index in tables of the beam it extends.

    freed:      the blocks that return to the free list when the old generation is freed,
                sorted;
    copied:     the source block of every copy-on-write the new beams' appends make, sorted
                (a block copied twice appears twice);
    new_blocks: how many blocks the appends take from the free list (fresh blocks and copies).

    Example: one beam [0, 1, 2] holding 10 tokens in blocks of 4, three new beams all extending
    it: nothing is freed, block 2 is copied twice, 2 new blocks.
    """
    # Count references: after the fork and the free, how many new beams hold each block?
    # Then, for each block that is some new beam's last one: is it full, or will the new beams
    # write into it? Only the last writer into a shared block escapes the copy.
    raise NotImplementedError("exercise: implement beam_step_blocks")
