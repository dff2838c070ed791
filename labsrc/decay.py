"""Decays between positions from per-step log-decays, computed so that extreme gates stay exact.

A gated recurrence ``S_t = exp(a_t) S_{t-1} + ...`` (the gated delta rule's ``g``, SSD's ``dt * A``,
Lightning attention's ``log(lambda)``) decays what position ``s`` wrote by ``exp(a_{s+1} + ... + a_t)`` by the
time it reaches position ``t``. The chunked algorithms need that factor for every pair ``(t, s)`` of a chunk.

The tempting way is a difference of prefix sums, ``exp(cs_t - cs_s)`` with ``cs = cumsum(a)``. It fails at the
extremes a gate is there to reach: after one very negative ``a`` (a gate that nearly resets the state) the prefix
sums are huge, and the small log-decays that follow vanish in their float32 spacing, so the decays between two
later positions come out as ``exp(0) = 1`` instead of ``exp(-0.05)``: the chunked result then differs from the
recurrence by O(1). A log-decay of ``-inf`` (a decay of exactly zero, a hard reset) gives ``-inf - (-inf) =
NaN``. :func:`segsum` sums each segment directly instead. The terms all have one sign (log-decays are ``<= 0``),
so the sum is accurate to the rounding of the segment itself, and ``-inf`` stays ``-inf``: ``exp`` of it is
the exact decay 0 the recurrence applies. The Triton kernels form the same tile with ``tl.cumsum``
(:func:`labsrc.kernels._decay.chunk_segsum`).
"""
from __future__ import annotations

import torch

__all__ = ["segsum"]


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = a[..., s+1] + ... + a[..., t]`` for ``s <= t`` (0 on the diagonal), ``-inf`` above it.

    ``a (..., T)`` holds per-step log-decays; ``exp(segsum(a))`` is the decay matrix of a chunk (0 above the
    diagonal, where a later step cannot reach an earlier one). Summed directly, as a masked cumulative sum,
    never as a difference of two prefix sums. A ``-inf`` step gives ``-inf`` for every segment that contains
    it (a decay of exactly zero) and nothing else; a NaN step gives NaN for the segments that contain it.
    """
    T = a.shape[-1]
    rep = a[..., :, None].expand(*a.shape, T)                                   # rep[..., k, s] = a[k]
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)   # k > s
    out = torch.cumsum(rep.masked_fill(~strict, 0), dim=-2)                     # sum over s < k <= t
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return out.masked_fill(~keep, -torch.inf)
