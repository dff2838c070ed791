"""Flash-decoding in Triton: the cache split among programs, each a partial softmax, then merged by their
log-sum-exps.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.flash_attention.common import (LOG2E, _bucket, _capability, _check_decode_args,
                                                   _default_num_splits, _default_scale, _kernel_operand,
                                                   _launch_flags)
from labsrc.kernels.flash_attention.naive import decode_attention_ref
from labsrc.kernels.flash_attention.softmax import _online_softmax_step, _softmax_finish


def merge_warps(block_s: int, block_d: int) -> int:
    """Warps for the split-merge kernel: its (BLOCK_S, BLOCK_D) fp32 tile lives in registers, and at 256 splits
    x 128 dims (32K values) four warps would need 256 per thread and spill (``python -m labsrc.gpucheck
    --compile-only`` showed 120 bytes on sm_80); eight warps hold it without spilling."""
    return 8 if block_s * block_d > 8192 else 4


def _decode_configs() -> list:
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)]
    stages = (3, 4) if _capability()[0] >= 9 else (2, 3)
    # BLOCK_N = 128 is left out: with D = 128 it spilled registers on sm_90 at every warp count and stage
    # depth (48-104 bytes) and on sm_80 with 8 warps (24 bytes; `python -m labsrc.gpucheck --compile-only`),
    # while 32 or 64 keys per step compile without spills and keep enough loads in flight to stream the cache.
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n in (32, 64) for w in (4, 8) for s in stages]


# ----------------------------------------------------------------------------------------------------------------
# Flash-decoding: split-K over the cache, then a log-sum-exp merge.
# ----------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_decode_configs(),
    key=["TMAX_BUCKET", "BLOCK_G", "BLOCK_D", "NUM_SPLITS", "PRECISION"],
)
@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    SEQ_LENS,
    MID_O,
    MID_LSE,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    Hkv,
    D,
    GROUP,
    NUM_SPLITS,
    qk_scale,
    TMAX_BUCKET,  # used only as an autotuning key
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one split of the cache of one (batch, K/V head), for ALL the query
    # heads that share that K/V head. Each K/V tile is loaded once and used GROUP times:
    # decode is memory-bound, so this divides the traffic per query head by GROUP -- the
    # whole point of GQA at inference time.
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    # 64-bit batch/head offsets, as in the flash kernel
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)

    # Each sequence splits its own length evenly, so ragged batches give every program
    # similar work.
    seq_len = tl.load(SEQ_LENS + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    # may be <= start: an empty split (short sequence)
    end = tl.minimum(start + split_len, seq_len)

    # query heads of this group, padded to >= 16 rows for tl.dot
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = hkv * GROUP + offs_g

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hkv * stride_vh + offs_d[None, :]
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # (BLOCK_G, BLOCK_N), log2 units
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every block inside the loop holds at least one real key, but its scores may
        # still all be -inf (keys of -inf, or an overflow in fp32): the same guarded
        # step as flash_attention, never a bare exp2(m - m).
        m_new, l_i, alpha, p = _online_softmax_step(m_i, l_i, s)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # Store the split's *normalised* output and its log-sum-exp (log2 units); an empty
    # split (no key, or only -inf scores) stores 0 and -inf, which the merge weighs by
    # exp2(-inf) = 0.
    out, lse = _softmax_finish(acc, l_i, m_i)
    mo_ptrs = (
        MID_O
        + b * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    tl.store(mo_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(MID_LSE + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    MID_O, MID_LSE, O,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    Hq, D, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (batch, query head). Split s holds o_s = softmax-weighted mean
    # over its keys and
    # lse_s = log2 sum exp2(scores); the full softmax weighs each split by its share of
    # the total mass:
    # o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s (for
    # stability).
    # The same rule as every online-softmax step here: a split with lse -inf (no key, or
    # only -inf scores)
    # weighs exp2(-inf) = 0; if every split is empty the row has no key at all and its
    # output is 0.
    pid = tl.program_id(0)
    b = (pid // Hq).to(tl.int64)
    h = (pid % Hq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    lse = tl.load(
        MID_LSE + b * stride_mlb + h * stride_mlh + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    # -inf when every split is empty (e.g. all of a sequence's scores are -inf)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)
    o = tl.load(
        MID_O
        + b * stride_mob
        + h * stride_moh
        + offs_s[:, None] * stride_mos
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        O + b * stride_ob + h * stride_oh + offs_d,
        out.to(O.dtype.element_ty),
        mask=d_mask,
    )


def decode_attention(q, k_cache, v_cache, seq_lens, sm_scale=None, num_splits=None, out=None):
    """Flash-decoding: one new query per sequence against its first ``seq_lens[b]`` cached keys.

    A first kernel splits each sequence's cached length into ``num_splits`` chunks; each program handles one
    chunk of one (sequence, K/V head) for all ``Hq // Hkv`` query heads that share it, and writes a partial
    output with its log-sum-exp. A second kernel merges the chunks exactly.

    Args:
        q: ``(B, Hq, D)`` queries, float32/float16/bfloat16, 16 <= D <= 128.
        k_cache, v_cache: ``(B, Hkv, Tmax, D)`` of q's dtype, last dimension contiguous; ``Hq % Hkv == 0``
            with at most 128 query heads per K/V head (``MAX_DECODE_GROUP``). Any other strides, expanded
            views included, are read as they are.
        seq_lens: ``(B,)`` int32/int64 valid lengths in ``[1, Tmax]``; positions past them are ignored. Any
            layout (a slice, an expanded view): it is packed into int32 before the kernel reads it.
        sm_scale: factor on the scores, ``1/sqrt(D)`` by default; a finite positive number whose product with
            log2(e) is a normal float32 (the kernels receive it as one).
        num_splits: chunks per sequence in ``[1, min(Tmax, 256)]`` (256 = ``MAX_NUM_SPLITS``, the most the
            merge kernel holds in one tile); by default enough to fill the device. Splits longer than a
            sequence's length are empty and weigh nothing in the merge.
        out: optional ``(B, Hq, D)`` tensor of q's dtype to write into.

    Returns:
        ``(B, Hq, D)`` in q's dtype, equal to attention over each sequence's first ``seq_lens[b]`` keys.

    Raises:
        ValueError: when gradients are enabled and an input requires grad. Decoding is inference; rather than
            return a result silently cut off from the graph, the call refuses (use :func:`flash_attention`
            with ``Tq = 1`` to differentiate a single query).
    """
    _check_decode_args(q, k_cache, v_cache, seq_lens, sm_scale, num_splits, out)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("decode_attention is inference-only (it has no backward pass), but q, k_cache or "
                         "v_cache requires grad: run it under torch.no_grad() or torch.inference_mode(), or use "
                         "flash_attention, which is differentiable")
    B, Hq, D = q.shape
    Hkv, Tmax = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    if not HAS_TRITON:  # no Triton on this machine: the reference attends
        ref = decode_attention_ref(q, k_cache, v_cache, seq_lens, sm_scale)
        return ref if out is None else out.copy_(ref)
    splits = int(num_splits) if num_splits is not None else _default_num_splits(B * Hkv, Tmax, q.device)
    if out is None:
        out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    mid_o = torch.empty((B, Hq, splits, D), device=q.device, dtype=torch.float32)
    mid_lse = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)
    # `.to(torch.int32)` alone returns the tensor itself when it is already int32, strided or expanded view
    # included, and the kernel reads `SEQ_LENS + b` as if it were packed: make it packed.
    lens = _kernel_operand(seq_lens, torch.int32)
    upcast, precision = _launch_flags(q.dtype)
    block_d = max(16, triton.next_power_of_2(D))
    _decode_split_kernel[(B * Hkv, splits)](
        q, k_cache, v_cache, lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        Hkv, D, group, splits, _default_scale(D, sm_scale) * LOG2E,
        _bucket(Tmax),
        UPCAST=upcast, PRECISION=precision,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
    )
    _decode_merge_kernel[(B * Hq,)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        Hq, D, splits,
        BLOCK_S=(block_s := max(2, triton.next_power_of_2(splits))), BLOCK_D=block_d,  # (>= 2: no size-1 tiles)
        num_warps=merge_warps(block_s, block_d),
    )
    return out
