"""Triton kernels, one file per op, each beside its torch twin in ``reference/ops``; ``backend.py``
bundles them as ``TRITON_BACKEND``.

This file imports nothing on purpose. Run from the repository root, ``kernels/`` is also
importable as a top-level ``kernels``, the name of a Hugging Face package that transformers
probes for (and imports) when it loads a model: importing triton here would make every
transformers import from the repository root pay for it, or fail where triton is absent.
"""
