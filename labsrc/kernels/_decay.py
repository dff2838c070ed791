"""The segment-sum tile the chunked kernels take their decays from (see :mod:`labsrc.decay` for why).

``chunk_segsum(a, BLOCK)`` returns the ``(BLOCK, BLOCK)`` tile ``seg[t, s] = a[s+1] + ... + a[t]`` for
``s <= t`` and ``-inf`` above the diagonal, as :func:`labsrc.decay.segsum` does: the log-decay from position
``s`` to position ``t`` of a chunk, summed directly (a masked ``tl.cumsum`` down the columns) instead of as
``cs[t] - cs[s]``, which loses every small log-decay after a very negative one and turns ``-inf`` into NaN.
Its last row is the log-decay from each position to the chunk's end. Rows past the end of the sequence must
hold 0 (no decay), never NaN.
"""
from __future__ import annotations

from labsrc.kernels._triton import tl, triton

__all__ = ["chunk_segsum", "last_row"]


@triton.jit
def chunk_segsum(a, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    # terms[k, s] = a[k] where k > s, else 0; a running sum down each column then gives
    # sum_{s < k <= t} a[k]
    terms = tl.where(rows[:, None] > rows[None, :], a[:, None], 0.0)
    seg = tl.cumsum(terms, 0)
    return tl.where(rows[:, None] >= rows[None, :], seg, float("-inf"))


@triton.jit
def last_row(seg, BLOCK: tl.constexpr):
    # seg[BLOCK - 1, :]: the log-decay from each position to the chunk's end (no -inf
    # mask in that row)
    rows = tl.arange(0, BLOCK)
    return tl.sum(tl.where(rows[:, None] == BLOCK - 1, seg, 0.0), 0)
