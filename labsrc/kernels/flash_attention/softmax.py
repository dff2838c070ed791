"""The online softmax, in Triton: one step over a block of keys, the final division, and the loop over blocks
that the lab's attention kernels (this family's, paged, tree, kNN-memory, differential) share.
"""
from __future__ import annotations

from labsrc.kernels._triton import tl, triton


# ----------------------------------------------------------------------------------------------------------------
# The FlashAttention forward kernel.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _online_softmax_step(m_i, l_i, s):
    """One step of the online softmax: fold a tile of scores ``s`` (log2 units) into the
    row state ``(m, l)``.

    Returns ``(m_new, l_new, alpha, p)``: the new row maximum and row sum, the factor
    ``alpha`` that rescales whatever was accumulated under the old maximum, and ``p =
    exp2(s - m_new)``.

    The one rule shared by every online-softmax update and merge in this module: **a set
    of scores that are all -inf (an empty split, a fully masked block, keys whose scores
    are -inf) contributes nothing**. While a row has seen only -inf, ``m`` stays -inf;
    subtracting 0 instead of -inf avoids ``(-inf) - (-inf) = nan``, so ``p`` and
    ``alpha`` come out as ``exp2(-inf) = 0`` and the state stays ``acc = 0, l = 0``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, alpha, p


@triton.jit
def _softmax_finish(acc, l_i, m_i):
    """Normalise the accumulated ``acc`` by the row sum and form the row's log-sum-exp
    (log2 units).

    A row that saw no key (``l = 0``) gets output 0 and log-sum-exp -inf: dividing by 1
    instead of 0 keeps ``acc = 0``, and -inf is what makes the row weigh nothing in a
    later merge (``exp2(-inf) = 0``).
    """
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
    return out, lse2


@triton.jit
def _attend_blocks(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n0, d_mask, lo,
    hi, Tk, diag, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Fold key blocks ``[lo, hi)`` into the running softmax state ``(acc, l_i, m_i)``
    of one query block.

    ``MASKED=False`` is the fast path for blocks that lie entirely inside the sequence
    and below the causal diagonal: no comparison is needed per score. ``MASKED=True``
    handles the diagonal block(s) and the ragged last block. Scores are kept in base 2
    (already multiplied by log2(e)), so each exponential is one ``exp2`` -- the hardware
    instruction -- instead of ``exp`` = ``exp2`` after a multiply.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASKED:
            kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        # Padded head-dim lanes and keys past the end load as 0: they add nothing to q.k
        # and p.v.
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # (BLOCK_M, BLOCK_N), fp32, log2 units
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            visible = offs_n[None, :] < Tk
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
        # Online softmax: a new, larger maximum rescales everything accumulated so far
        # by exp2(m_old - m_new); a row that has seen only -inf so far stays at acc = 0,
        # l = 0 (see _online_softmax_step).
        m_new, l_i, alpha, p = _online_softmax_step(m_i, l_i, s)
        # P goes to the tensor cores in the input precision (as in FlashAttention); the
        # sum stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        # The pointers arrive pointing at key `lo` and advance with the loop: no index
        # multiply per block.
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i
