"""Who runs a kernel: the GPU, the Triton interpreter, or the kernel's torch twin.

Every launcher in this package starts with ``runner = kernel_runner(kernel, *tensors)``:

- CUDA tensors: the compiled Triton kernel.
- CPU tensors with ``TRITON_INTERPRET=1`` in the environment: the same kernel source, run by
  Triton's interpreter (numpy, one program at a time). This is how CI checks every kernel
  without a GPU; it is slow, so keep its shapes small.
- CPU tensors otherwise: ``None``, and the launcher calls its twin in ``reference/ops``.

Triton decides between compiling and interpreting when ``@triton.jit`` runs, that is when a kernel
module is imported. Deciding here instead, at every launch, means the order in which tests import
modules and set the environment variable does not matter.
"""

import os
from functools import cache

import torch
from triton.runtime.interpreter import InterpretedFunction


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the interpreter (read at every launch)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")


@cache
def _interpreted(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


def kernel_runner(kernel, *tensors: torch.Tensor):
    """The object to launch as ``runner[grid](...)`` for these tensors, or None for the twin.

    All tensors must be on one kind of device: a launcher never moves data behind the caller.
    """
    on_cuda = {t.is_cuda for t in tensors}
    if len(on_cuda) > 1:
        raise ValueError("a kernel's tensors must all be on CUDA or all on the CPU, got both")
    if on_cuda == {True} and not interpreting():
        return kernel
    if interpreting():
        return _interpreted(getattr(kernel, "fn", kernel))  # the plain Python function
    return None
