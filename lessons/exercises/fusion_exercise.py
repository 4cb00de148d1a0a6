"""Exercise (lesson 13, "Fusing the small ops"): the memory traffic of a chain of ops, fused or not.

A chain of elementwise ops is given as a list of ``(name, reads, writes)``: the names of the
tensors each op reads and writes, in order. ``sizes`` maps every tensor name to its size in
bytes. Run one op at a time (eager torch), every op reads its inputs from memory and writes its
outputs back. Fused into one kernel, a tensor that is produced and consumed inside the chain
never leaves the chip, unless the caller needs it afterwards.

Write the two functions below. Check your work with

    pytest lessons/exercises/test_fusion_exercise.py

The test builds the op chains of the reference's rms_norm (with its residual), silu_and_mul and
rotary (reference/ops/) and compares your fused counts with what the Triton kernels load and
store. Until you edit this file the test reports your version as skipped and checks only the
solution.
"""


def unfused_bytes(ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]],
                  sizes: dict[str, int]) -> int:
    """Bytes moved when every op runs as its own kernel."""
    raise NotImplementedError("exercise: implement unfused_bytes")


def fused_bytes(ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]],
                sizes: dict[str, int], outputs: set[str]) -> int:
    """Bytes moved when the whole chain runs as one kernel.

    outputs: the tensors the rest of the model needs after the chain (they must be written).
    """
    # Which tensors must come from memory? (Hint: not the ones some op of the chain produces.)
    # How many times is a tensor read by two ops of the chain loaded?
    # Which produced tensors must go back to memory?
    raise NotImplementedError("exercise: implement fused_bytes")
