"""Exercise (lesson 7, "Parallel sampling and copy-on-write"): what sharing saves.

A request asks for n samples of one prompt of prompt_len tokens; sample i generates
output_lens[i] tokens (at least one each), so in the end it holds the K/V of
prompt_len + output_lens[i] tokens. Blocks have block_size token slots.

Write the two functions below: how many physical blocks the request holds at the end, with the
samples sharing the prompt's blocks (fork, then copy-on-write), and with every sample holding a
copy of its own. Check your work with

    pytest lessons/exercises/test_cow_exercise.py

The test runs the real BlockSpaceManager (reference/kv/block_manager.py): it allocates the prompt,
forks n - 1 children, appends every sample's tokens, and counts the distinct physical blocks in
use. Until you edit this file the test reports your version as skipped and checks only the
solution.
"""


def blocks_without_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
    """Blocks held when each of the len(output_lens) samples stores the prompt by itself.

    Example: a 10-token prompt, 3 samples of 8 tokens, blocks of 4: each sample holds 18 tokens
    in 5 blocks, so 15 blocks.
    """
    # Each sample is an ordinary sequence of prompt_len + its output tokens.
    # Round up to whole blocks with integer arithmetic (lesson 3's blocks_needed).
    raise NotImplementedError("exercise: implement blocks_without_sharing")


def blocks_with_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
    """Blocks held when the samples fork from one prefilled prompt (copy-on-write).

    Example: the same request holds 11 blocks (lesson 7's figure).
    """
    # Which of the prompt's blocks does nobody ever write into again? Those stay shared: count
    # them once. The prompt's last block, when it is only partly filled, is written by every
    # sample (its first generated token goes there), so each sample ends up with a version of
    # its own: copies for all but the last writer, who keeps the original.
    # Every block after the prompt's belongs to one sample.
    # Check yourself on a prompt that fills its last block exactly, and on one shorter than a
    # block.
    raise NotImplementedError("exercise: implement blocks_with_sharing")
