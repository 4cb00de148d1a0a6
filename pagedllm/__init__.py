"""pagedllm: how an LLM serving engine manages KV-cache memory, in readable and in fast code.

The tiers live in sub-packages: ``pagedllm.reference`` (plain PyTorch, the specification),
``pagedllm.optimized`` and ``pagedllm.kernels`` (Triton), ``pagedllm.serving`` (CLI and server).
"""

import os

__version__ = "0.1.0"

# The tiers sit in the checkout's top-level folders (reference/, optimized/, ...), which an
# install maps to pagedllm.<tier> (pyproject's package-dir). In a source checkout, search that
# root too, so that a bare checkout on PYTHONPATH imports the same files an editable install
# does; an install's site-packages has no pyproject.toml beside the package, so it is left alone.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if (os.path.isfile(os.path.join(_root, "pyproject.toml"))
        and os.path.isdir(os.path.join(_root, "reference")) and _root not in __path__):
    __path__.append(_root)
del _root
