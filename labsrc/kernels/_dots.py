"""Float32-accurate matrix products on 16-bit tensor cores, for the chunked scans (SSD, linear attention, the
gated delta rule).

Those kernels multiply tiles they loaded (``q``, ``k``, ``v``, SSD's ``x``, ``B``, ``C``, in the input's bf16 or
fp16) by tiles they computed in float32 (decayed scores, the state, the UT inverse), and their states must stay
float32-accurate over thousands of chunks. Three ways to run such a product on a GPU:

* ``input_precision="ieee"``: true fp32, but Triton lowers it to scalar FMAs, not tensor cores (at a 64-token
  chunk and 128-wide heads LLVM was still compiling it after 10 minutes);
* TF32 (``"tf32"``, or ``"tf32x3"`` for fp32 accuracy): tensor cores, but with 32-bit operands. On Ampere
  every warp holds a whole copy of a product's second operand in registers, and a 128 x 64 fp32 operand is 256
  registers per thread on its own: every configuration spilled, most of them catastrophically (``python -m
  labsrc.gpucheck --compile-only``);
* :func:`split_dot`: the loaded tile, exact in its own 16-bit type, is the second operand; the computed tile is
  split into a 16-bit high part and the 16-bit remainder, ``a = hi + lo``, and two 16-bit products are summed in
  fp32. ``hi`` carries 8 (bf16) or 11 (fp16) bits of ``a``'s mantissa and ``lo`` the next 8 or 11, so the
  product is good to about ``2^-16`` (bf16) relative, near fp32's ``2^-24`` and far better than TF32's
  ``2^-11``, at half the registers of a TF32 operand and bf16's tensor-core rate.

The kernels therefore arrange each product so that its second operand is a loaded tile (transposing the
product where needed: ``C S^T = (S C^T)^T``) and fold the computed per-row or per-column factors (decays,
``dt``, ``beta``) into the first. A product of two loaded tiles (``q k^T``, ``C B^T``) is exact on 16-bit
tensor cores as it is (:func:`exact_dot`). Where the loaded tile must come first (``k^T X``),
:func:`split_dot_b` splits the second operand instead, and where both are computed (the gated delta rule's
``T Y``), :func:`split_dot2` splits both in bf16 and sums the three products that matter (``hi hi``, ``hi lo``,
``lo hi``; ``lo lo`` is below ``2^-16``). Float32 inputs keep true fp32 products (``PRECISION="ieee"``).

Under the interpreter a bf16 ``tl.dot`` returns garbage, so with ``UPCAST`` the same 16-bit values are
multiplied in fp32 (exactly what the tensor cores compute, up to the order of the sums): the interpreter
tests check the split's rounding, not an idealised fp32 product. In fp16 ``hi`` must fit fp16's range (65504):
the tiles split here (decayed scores, states of unit-scale inputs) stay far below it.
"""
from __future__ import annotations

from labsrc.kernels._triton import tl, triton

__all__ = ["split_dot", "split_dot_b", "split_dot2", "exact_dot"]


@triton.jit
def split_dot(a, b, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` for a float32 tile ``a`` the kernel computed and a tile ``b`` as loaded (its dtype).

    ``SPLIT`` (16-bit ``b``): ``a`` is split into ``hi + lo`` in ``b``'s dtype and both parts are multiplied
    by ``b`` on the tensor cores. Otherwise (float32 ``b``) one product at ``PRECISION``.
    """
    if SPLIT:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        if UPCAST:
            acc = tl.dot(hi.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(lo.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(hi, b, acc)
            acc = tl.dot(lo, b, acc)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision=PRECISION)
    return acc


@triton.jit
def exact_dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` in float32 for two tiles as loaded: 16-bit tiles multiply exactly on the tensor cores (each
    product of two bf16 or fp16 numbers is exact in fp32); float32 tiles at ``PRECISION``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision=PRECISION)
    return tl.dot(a, b)


@triton.jit
def split_dot_b(a, b, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` for a tile ``a`` as loaded and a float32 tile ``b`` the kernel computed: with ``SPLIT``,
    ``b = hi + lo`` in ``a``'s dtype and two products (:func:`split_dot` with the roles swapped)."""
    if SPLIT:
        hi = b.to(a.dtype)
        lo = (b - hi.to(tl.float32)).to(a.dtype)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), hi.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a.to(tl.float32), lo.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, hi, acc)
            acc = tl.dot(a, lo, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def split_dot2(a, b, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` for two float32 tiles the kernel computed: with ``SPLIT`` both are split into bf16
    ``hi + lo`` (bf16, not the inputs' fp16: these tiles need not fit fp16's range) and the products
    ``hi hi + hi lo + lo hi`` are summed (``lo lo`` is ``2^-16`` of the product and left out)."""
    if SPLIT:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        if UPCAST:
            acc = tl.dot(a_hi.to(tl.float32), b_hi.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a_hi.to(tl.float32), b_lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a_lo.to(tl.float32), b_hi.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a_hi, b_hi, acc)
            acc = tl.dot(a_hi, b_lo, acc)
            acc = tl.dot(a_lo, b_hi, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc
