"""Who runs a kernel: the GPU, the Triton interpreter, or the kernel's torch twin.

Every launcher in this package starts with ``runner = kernel_runner(kernel, *tensors)``:

- CUDA tensors: the compiled Triton kernel.
- CPU tensors with ``TRITON_INTERPRET=1`` in the environment: the same kernel source, run by
  Triton's interpreter (numpy, one program at a time). This is how CI checks every kernel
  without a GPU; it is slow, so keep its shapes small.
- CPU tensors otherwise: ``None``, and the launcher calls its twin in ``reference/ops``.

``launch_hook`` lets a caller see every launch made this way before it runs (the compile check
in ``compile_check.py`` records them); without one, launches are not wrapped at all.

Triton decides between compiling and interpreting when ``@triton.jit`` runs, that is when a kernel
module is imported. Deciding here instead, at every launch, means the order in which tests import
modules and set the environment variable does not matter.
"""

import os
import sys
from contextlib import contextmanager
from functools import cache

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the interpreter (read at every launch)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")


@cache
def _interpreted(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


@contextmanager
def _interpretable_helpers(fn):
    """While an interpreted kernel runs: every @triton.jit function it may call — triton.language's
    own (tl.sum, tl.max, tl.cdiv, ...) and the helpers in the kernel's module — swapped for its
    interpreted twin, then put back.

    When triton was imported without TRITON_INTERPRET those were built for compiling, and an
    interpreted kernel calling one fails with "Cannot call @triton.jit'd outside of the scope of
    a kernel". Swapping only for the launch leaves the compiled ones to CUDA launches.
    """
    namespaces = [vars(m) for name, m in list(sys.modules.items())
                  if m is not None and name.startswith("triton.language")]
    namespaces.append(fn.__globals__)
    swapped = []
    for namespace in namespaces:
        for attr, value in list(namespace.items()):
            if isinstance(value, JITFunction):
                swapped.append((namespace, attr, value))
                namespace[attr] = _interpreted(value.fn)
    try:
        yield
    finally:
        for namespace, attr, value in swapped:
            namespace[attr] = value


_hooks: list = []  # hook(kernel, grid, args, kwargs) for every launch while any is installed


@contextmanager
def launch_hook(hook):
    """While the block runs, call ``hook(kernel, grid, args, kwargs)`` before every launch made
    through ``kernel_runner`` (any thread; hooks must not launch kernels themselves)."""
    _hooks.append(hook)
    try:
        yield hook
    finally:
        _hooks.remove(hook)


class _HookedLaunch:
    """``runner[grid](...)``, calling the installed hooks with the launch first."""

    def __init__(self, kernel, runner):
        self.kernel, self.runner = kernel, runner

    def __getitem__(self, grid):
        launch = self.runner[grid]

        def hooked(*args, **kwargs):
            for hook in list(_hooks):  # a copy: another thread may remove its hook meanwhile
                hook(self.kernel, grid, args, kwargs)
            return launch(*args, **kwargs)
        return hooked


class _InterpretedLaunch:
    """``runner[grid](...)`` for the interpreter, with the kernel's helpers interpretable."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpretable_helpers(self.fn):
                return _interpreted(self.fn)[grid](*args, **kwargs)
        return launch


def kernel_runner(kernel, *tensors: torch.Tensor):
    """The object to launch as ``runner[grid](...)`` for these tensors, or None for the twin.

    All tensors must be on one kind of device: a launcher never moves data behind the caller.
    """
    on_cuda = {t.is_cuda for t in tensors}
    if len(on_cuda) > 1:
        raise ValueError("a kernel's tensors must all be on CUDA or all on the CPU, got both")
    if on_cuda == {True} and not interpreting():
        runner = kernel
    elif interpreting():
        runner = _InterpretedLaunch(getattr(kernel, "fn", kernel))  # the plain Python function
    else:
        return None
    return _HookedLaunch(kernel, runner) if _hooks else runner
