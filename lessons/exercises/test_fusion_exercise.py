"""Checks lesson 13's exercise: memory traffic of a chain of ops, one kernel per op or fused.

    pytest lessons/exercises/test_fusion_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/fusion_exercise.py (skipped while a function still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The chains are the reference's torch code (reference/ops/layernorm.py, activation.py,
rotary.py), op by op, for T tokens of Llama-3-8B in bf16. The fused counts must equal what the
Triton kernels (kernels/rms_norm.py, silu_and_mul.py, rotary.py) load and store.
"""

import pytest

EXERCISE = "fusion_exercise"  # impl (conftest.py): the solution's file, then yours
T, HIDDEN, INTER = 8, 4096, 14336  # tokens; Llama-3-8B's hidden and intermediate sizes
BF16, F32 = 2, 4


@pytest.fixture
def impl(impl):
    """Here the module itself, once neither function raises NotImplementedError."""
    with impl.skip_if_not_attempted():
        impl.module.unfused_bytes([("op", ("a",), ("b",))], {"a": 1, "b": 1})
        impl.module.fused_bytes([("op", ("a",), ("b",))], {"a": 1, "b": 1}, {"b"})
    return impl.module


def rms_norm_chain():
    """reference/ops/layernorm.py with a residual, one torch op at a time."""
    row, row32 = T * HIDDEN * BF16, T * HIDDEN * F32
    sizes = {"x": row, "residual": row, "sum": row, "sum32": row32, "squares": row32,
             "mean": T * F32, "mean_eps": T * F32, "inv_rms": T * F32, "normed32": row32,
             "normed": row, "weight": HIDDEN * BF16, "out": row}
    ops = [("add", ("x", "residual"), ("sum",)),
           ("float", ("sum",), ("sum32",)),
           ("pow", ("sum32",), ("squares",)),
           ("mean", ("squares",), ("mean",)),
           ("add eps", ("mean",), ("mean_eps",)),
           ("rsqrt", ("mean_eps",), ("inv_rms",)),
           ("mul", ("sum32", "inv_rms"), ("normed32",)),
           ("to bf16", ("normed32",), ("normed",)),
           ("mul weight", ("weight", "normed"), ("out",))]
    return ops, sizes, {"out", "sum"}


def silu_chain():
    half = T * INTER * BF16
    sizes = {"gate": half, "up": half, "silu": half, "out": half}
    return [("silu", ("gate",), ("silu",)), ("mul", ("silu", "up"), ("out",))], sizes, {"out"}


def test_rms_norm_with_residual(impl):
    ops, sizes, outputs = rms_norm_chain()
    row = T * HIDDEN * BF16
    # the kernel: loads x, residual and weight once; stores out and the new residual
    assert impl.fused_bytes(ops, sizes, outputs) == 4 * row + HIDDEN * BF16
    assert impl.unfused_bytes(ops, sizes) == 21 * row + 6 * T * F32 + HIDDEN * BF16
    # without a caller for the new residual, the sum would never need storing
    assert impl.fused_bytes(ops, sizes, {"out"}) == 3 * row + HIDDEN * BF16


def test_silu_and_mul(impl):
    ops, sizes, outputs = silu_chain()
    half = T * INTER * BF16
    assert impl.unfused_bytes(ops, sizes) == 5 * half
    assert impl.fused_bytes(ops, sizes, outputs) == 3 * half  # gate, up in; out


def test_rotary_in_place(impl):
    """One tensor of e elements (its two halves) rotated: x * cos + rotate_half(x) * sin."""
    e = T * 32 * 128 * BF16  # q of Llama-3-8B
    table = T * 128 * F32  # cos and sin, [T, head_dim] float32
    sizes = {"first": e // 2, "second": e // 2, "neg": e // 2, "rotated": e, "x_cos": e,
             "r_sin": e, "cos": table, "sin": table, "x_out": e}
    ops = [("neg", ("second",), ("neg",)),
           ("cat", ("neg", "first"), ("rotated",)),
           ("mul cos", ("first", "second", "cos"), ("x_cos",)),
           ("mul sin", ("rotated", "sin"), ("r_sin",)),
           ("add", ("x_cos", "r_sin"), ("x_out",))]
    assert impl.unfused_bytes(ops, sizes) == 10 * e + 2 * table
    # x read once and written once; the kernel even computes cos and sin in registers from the
    # positions, so it does not load the tables either: 2 e plus a few bytes.
    assert impl.fused_bytes(ops, sizes, {"x_out"}) == 2 * e + 2 * table


def test_a_tensor_read_twice_is_loaded_once(impl):
    sizes = {"a": 100, "b": 10, "c": 10, "d": 10}
    ops = [("f", ("a",), ("b",)), ("g", ("a", "b"), ("c",)), ("h", ("a", "c"), ("d",))]
    assert impl.unfused_bytes(ops, sizes) == 3 * 100 + 5 * 10  # b and c: out once, in once
    assert impl.fused_bytes(ops, sizes, {"d"}) == 110
    assert impl.fused_bytes(ops, sizes, {"b", "d"}) == 120  # an intermediate the caller keeps


def test_fusion_never_moves_more(impl):
    for ops, sizes, outputs in (rms_norm_chain(), silu_chain()):
        assert impl.fused_bytes(ops, sizes, outputs) < impl.unfused_bytes(ops, sizes)
