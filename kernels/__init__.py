"""Triton kernels, one file per kernel, each beside its torch twin. Built in later issues."""
