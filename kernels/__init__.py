"""Triton kernels, one file per op, each beside its torch twin in ``reference/ops``; ``backend.py``
bundles them as ``TRITON_BACKEND``.

Run from the repository root (``python -m``, ``python -c``, pytest), ``kernels/`` is also
importable as a top-level ``kernels``: the name of a Hugging Face package that transformers
requires and imports when it loads a model. Imported under that name, this file hands the
import over to that package, so that ``import kernels`` means the same inside the checkout as
outside it; as ``pagedllm.kernels`` it imports nothing (triton loads with the kernel files).
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:  # not installed: the import fails as it would outside the checkout
        raise ModuleNotFoundError("No module named 'kernels' (pagedllm's Triton kernels are "
                                  "pagedllm.kernels)", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
