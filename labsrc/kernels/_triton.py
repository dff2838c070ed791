"""Triton for the kernel modules, or a stand-in where Triton is not installed.

Triton publishes Linux wheels only, so on macOS and Windows (and anywhere ``pip`` left it out) the lab runs
without it: every kernel wrapper then validates its arguments exactly as before and calls its PyTorch
reference (``<name>_ref``) instead of launching, and :func:`labsrc.runtime.stamp` says so. The kernel
modules import ``triton`` and ``tl`` from here so that their ``@triton.jit`` functions still *define*
without Triton: the stand-in's decorators return the plain Python function, which is never launched but can
still be shown (``inspect.getsource``) and read in the chapters.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import labsrc  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from labsrc import runtime

__all__ = ["triton", "tl", "HAS_TRITON"]

HAS_TRITON = runtime.HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl
else:
    def _decorator(*args, **kwargs):
        """``@jit``, ``@jit(...)``, ``@autotune(...)``, ``@heuristics(...)``: hand back the function."""
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    class _Config:
        """Stands for ``triton.Config``: remembers its arguments, launches nothing."""

        def __init__(self, kwargs=None, **options):
            self.kwargs, self.options = dict(kwargs or {}), options

    class _Constexpr:
        """Stands for ``tl.constexpr`` in annotations."""

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

    tl = SimpleNamespace(constexpr=_Constexpr, TRITON_MAX_TENSOR_NUMEL=1048576)
    triton = SimpleNamespace(jit=_decorator, autotune=_decorator, heuristics=_decorator, Config=_Config,
                             cdiv=lambda a, b: -(-a // b), next_power_of_2=_next_power_of_2, language=tl,
                             __version__=None)
    del math
