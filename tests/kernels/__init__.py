"""Triton kernels against their torch twins, on the CPU through the interpreter."""
