"""A solution to lesson 20's exercise: the exact verification rule, and a run's blocks.

The reference (reference/ops/spec_decode.py) verifies a whole batch of runs at once: it compares
the padded [B, K] proposals with the first K of the target's [B, K + 1] tokens and counts the
leading run of matches with a cumulative product. One run in plain Python is a loop.
"""


def verify(proposals: list[int], target_tokens: list[int]) -> tuple[int, int]:
    """(accepted, next_token): the leading proposals equal to the target's tokens, and the
    target's token right after them."""
    if len(target_tokens) != len(proposals) + 1:
        raise ValueError(f"a run of {len(proposals)} proposals has {len(proposals) + 1} rows "
                         f"of target tokens, got {len(target_tokens)}")
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, target_tokens[accepted]


def lookahead_blocks(num_computed: int, num_proposals: int, num_accepted: int,
                     block_size: int) -> tuple[int, int]:
    """(booked, kept): the blocks for the computed tokens, this step's token and the lookahead;
    then for the computed tokens, this step's token and the accepted proposals."""
    if not 0 <= num_accepted <= num_proposals:
        raise ValueError(f"num_accepted must be in [0, {num_proposals}], got {num_accepted}")
    booked = -(-(num_computed + 1 + num_proposals) // block_size)
    kept = -(-(num_computed + 1 + num_accepted) // block_size)
    return booked, kept
