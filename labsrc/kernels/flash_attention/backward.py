"""The FlashAttention-2 backward in Triton: the row sums of dO * O, then dK and dV per key block and dQ per
query block, each recomputing the probabilities from the saved log-sum-exp.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.flash_attention.common import (LOG2E, _batch_chunks, _bucket, _capability,
                                                   _check_attention_args, _check_grad_out, _check_offsets,
                                                   _check_out, _check_tensor, _default_scale, _kernel_operand,
                                                   _launch_flags)
from labsrc.kernels.flash_attention.naive import flash_attention_backward_ref


def _bwd_shapes(dkdv: bool) -> list:
    """(BLOCK_M, BLOCK_N, warps, stages) of the backward kernels on this GPU.

    The backward holds more tiles per program than the forward (q, dO, k, v and two fp32 accumulators), so its
    tiles are smaller. Each list keeps only the shapes that compile without register spills at D = 128
    (``python -m labsrc.gpucheck --compile-only``, with the alignment hints a launch gives). dK/dV (a block
    of BLOCK_N keys, stepping over queries BLOCK_M at a time) spilled in every pipelined shape with 64 or
    more queries per step (100-2000 bytes; 128 x 64 also overflowed shared memory with 3 stages), and with
    4 warps at 32 x 64: it runs 32 queries per step with 8 warps, or 64 x 64 without software pipelining.
    dQ holds one accumulator fewer: 32-64 x 64 compile cleanly on both architectures, and on Hopper
    128 x 64 with 8 warps as well (on Ampere it spilled 24-44 bytes).
    """
    hopper = _capability()[0] >= 9
    if dkdv:
        return [(32, 64, 8, 3), (32, 64, 8, 2), (64, 64, 8, 1)]
    return [(32, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3)] + ([(128, 64, 8, 3)] if hopper else [])


def _bwd_dkdv_configs() -> list:
    return _bwd_configs(dkdv=True)


def _bwd_dq_configs() -> list:
    return _bwd_configs(dkdv=False)


def _bwd_configs(dkdv: bool) -> list:
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
    shapes = _bwd_shapes(dkdv)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


# ----------------------------------------------------------------------------------------------------------------
# The FlashAttention backward kernels (FlashAttention-2's algorithm): recompute P, never store it.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_deltab, stride_deltah,
    Hq, Tq, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the term the softmax Jacobian subtracts from every dP_ij
    # of row i. One program per block of rows; computed once here instead of once per key block later.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * stride_deltab + h * stride_deltah + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _recompute_p(q, k, lse2, offs_m, offs_n, Tq, Tk, diag, qk_scale,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """The probabilities ``P = exp(S - lse)`` of one (query block, key block) tile, recomputed from q, k and
    the forward's log-sum-exp, in log2 units: ``exp2(q k^T * scale * log2(e) - lse * log2(e))``.

    ``lse2`` is +inf for a row that saw no key (its lse is -inf), so that its P is exp2(-inf) = 0: the same
    rule as the forward (an empty row contributes nothing, and gets gradient 0). Masked keys, keys past Tk
    and rows past Tq are set to 0 explicitly, whatever their scores are.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    visible = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
    return tl.where(visible, p, 0.0)


@triton.autotune(
    configs=_bwd_dkdv_configs(),
    key=["TQ_BUCKET", "TK_BUCKET", "BLOCK_D", "CAUSAL", "PRECISION"],
)
@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_lb,
    stride_lh,  # shared by LSE and DELTA, both packed (B, Hq, Tq) fp32
    Hkv,
    Tq,
    Tk,
    D,
    GROUP,
    qk_scale,
    sm_scale,
    TQ_BUCKET,
    TK_BUCKET,  # used only as autotuning keys
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one block of BLOCK_N keys of one (batch, K/V head). Its K and V
    # tiles stay in registers while the program walks the query blocks that can see
    # them, for every query head of the GQA group, accumulating dV = P^T dO and dK =
    # dS^T Q in fp32. Summing the group inside the program gives GQA's dK/dV without an
    # Hq-sized buffer and without atomics: the result is deterministic.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
    k = tl.load(
        K
        + b * stride_kb
        + hkv * stride_kh
        + offs_n[:, None] * stride_kn
        + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + b * stride_vb
        + hkv * stride_vh
        + offs_n[:, None] * stride_vn
        + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    diag = Tk - Tq  # bottom-right causal alignment: query i sees keys j <= i + diag
    if CAUSAL:
        # Queries before start_n - diag see none of these keys: start at the block
        # holding the first that does.
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    for g in range(0, GROUP):
        hq = hkv * GROUP + g
        q_base = Q + b * stride_qb + hq * stride_qh + offs_d[None, :]
        do_base = DO + b * stride_dob + hq * stride_doh + offs_d[None, :]
        row_base = b * stride_lb + hq * stride_lh
        for start_m in range(lo, Tq, BLOCK_M):
            offs_m = start_m + offs_m0
            m_mask = offs_m < Tq
            qd_mask = m_mask[:, None] & d_mask[None, :]
            q = tl.load(q_base + offs_m[:, None] * stride_qm, mask=qd_mask, other=0.0)
            do = tl.load(
                do_base + offs_m[:, None] * stride_dom, mask=qd_mask, other=0.0
            )
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + row_base + offs_m, mask=m_mask, other=float("-inf"))
            delta = tl.load(DELTA + row_base + offs_m, mask=m_mask, other=0.0)
            lse2 = tl.where(
                lse == float("-inf"), float("inf"), lse * 1.4426950408889634
            )
            p = _recompute_p(
                q, k, lse2, offs_m, offs_n, Tq, Tk, diag, qk_scale, CAUSAL, PRECISION
            )
            # dV += P^T dO, with P in the input precision for the tensor cores (as in
            # the forward).
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PRECISION)
    # S = q k^T * scale, so dK carries the scale once, applied at the end
    dk = dk * sm_scale
    tl.store(
        DK
        + b * stride_dkb
        + hkv * stride_dkh
        + offs_n[:, None] * stride_dkn
        + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV
        + b * stride_dvb
        + hkv * stride_dvh
        + offs_n[:, None] * stride_dvn
        + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.autotune(configs=_bwd_dq_configs(), key=["TQ_BUCKET", "TK_BUCKET", "BLOCK_D", "CAUSAL", "PRECISION"])
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_lb, stride_lh,
    Hq, Tq, Tk, D, GROUP, qk_scale, sm_scale,
    TQ_BUCKET, TK_BUCKET,  # used only as autotuning keys
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program = one block of BLOCK_M queries of one (batch, query head), walking the key blocks it can see
    # exactly as the forward does and accumulating dQ = dS K. A separate kernel (rather than atomic adds from
    # the dK/dV kernel) recomputes P once more but is deterministic and needs no fp32 dQ buffer.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    hkv = hq // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m_mask = offs_m < Tq
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask,
                other=0.0)
    do = tl.load(DO + b * stride_dob + hq * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=qd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row_base = b * stride_lb + hq * stride_lh
    lse = tl.load(LSE + row_base + offs_m, mask=m_mask, other=float("-inf"))
    delta = tl.load(DELTA + row_base + offs_m, mask=m_mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diag = Tk - Tq
    if CAUSAL:
        hi = tl.minimum(Tk, start_m + BLOCK_M + diag)  # keys past the last row's diagonal: never loaded
    else:
        hi = Tk
    k_base = K + b * stride_kb + hkv * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hkv * stride_vh + offs_d[None, :]
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = _recompute_p(q, k, lse2, offs_m, offs_n, Tq, Tk, diag, qk_scale, CAUSAL, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + hq * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qd_mask)


def flash_attention_backward(dout, q, k, v, out, lse, causal=False, sm_scale=None):
    """The FlashAttention-2 backward pass: ``(dq, dk, dv)`` from the forward's output and log-sum-exp.

    The forward never stores the ``Tq x Tk`` probabilities; the backward recomputes each tile of them from q,
    k and the saved log-sum-exp, ``P = exp(S - lse)``, so memory stays ``O(T)``. Three kernels:

    1. ``delta_i = rowsum(dO_i * O_i)`` (one small pass over the rows);
    2. one program per key block of each (batch, K/V head), looping over the query heads of its GQA group and
       the query blocks that see the keys: ``dV = sum P^T dO`` and ``dK = sum dS^T Q * scale`` with
       ``dS = P * (dO V^T - delta)``, accumulated in fp32 and written once (no atomics, deterministic);
    3. one program per query block of each (batch, query head): ``dQ = sum dS K * scale``.

    Rows that see no key (causal with ``Tq > Tk``) have lse -inf, get ``P = 0`` and therefore contribute
    nothing and receive ``dq = 0``. Usually called by autograd through :func:`flash_attention`; public so that
    the chapter and the tests can call it directly.

    Args:
        dout: gradient of the output ``(B, Hq, Tq, D)``, q's dtype; any strides (a non-contiguous head
            dimension, e.g. the stride-0 gradient of ``out.sum()``, is copied).
        q, k, v, causal, sm_scale: the forward's arguments (same checks as :func:`flash_attention`).
        out: the forward's output ``(B, Hq, Tq, D)``; lse: its log-sum-exp ``(B, Hq, Tq)`` float32.

    Returns:
        ``(dq, dk, dv)``, contiguous, in the dtypes and shapes of q, k, v.
    """
    _check_attention_args(q, k, v, causal, sm_scale, None, None)
    _check_grad_out(dout, q)
    _check_out("out", out, q.shape, q)
    if out.dtype != q.dtype:
        raise TypeError(f"out must have the same dtype as q ({q.dtype}), got {out.dtype}")
    _check_tensor("lse", lse, 3, "(B, Hq, Tq)")
    if tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 of shape {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
    return _flash_backward(dout, q, k, v, out, lse, causal, sm_scale, need_dq=True, need_dkdv=True)


def _flash_backward(dout, q, k, v, out, lse, causal, sm_scale, need_dq, need_dkdv):
    """Launch the three backward kernels on checked arguments (skipping dq or dk/dv when not needed)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    if not HAS_TRITON:  # no Triton on this machine: the hand-written backward reference computes
        return flash_attention_backward_ref(dout, q, k, v, causal, sm_scale)
    # The kernels read the head dimension as one contiguous run. The incoming gradient is whatever autograd
    # hands over: the gradient of out.sum() is an expanded scalar (all strides 0), so copy such a dout.
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    _check_offsets("dout", dout, 2)
    lse = _kernel_operand(lse, torch.float32)  # packed: LSE and DELTA share one (B, Hq, Tq) layout
    delta = torch.empty_like(lse)
    upcast, precision = _launch_flags(q.dtype)
    scale = _default_scale(D, sm_scale)
    block_d = max(16, triton.next_power_of_2(D))
    # No zero-fill: every element of dq, dk, dv is written by a kernel (the tests poison these buffers).
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if need_dq else None
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if need_dkdv else None
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if need_dkdv else None

    for b0, b1 in _batch_chunks(B, Hq):  # grid axis 1 holds batch x heads: at most 65535 programs
        nb = b1 - b0
        qs, ks, vs, dos = q[b0:b1], k[b0:b1], v[b0:b1], dout[b0:b1]
        _bwd_preprocess_kernel[(triton.cdiv(Tq, 64), nb * Hq)](
            out[b0:b1], dos, delta[b0:b1],
            out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            delta.stride(0), delta.stride(1),
            Hq, Tq, D,
            BLOCK_M=64, BLOCK_D=block_d,
        )
        common = dict(CAUSAL=causal, UPCAST=upcast, PRECISION=precision, BLOCK_D=block_d)
        if need_dkdv:
            def grid_kv(meta, nb=nb):
                return (triton.cdiv(Tk, meta["BLOCK_N"]), nb * Hkv)

            _bwd_dkdv_kernel[grid_kv](
                qs, ks, vs, dos, lse[b0:b1], delta[b0:b1], dk[b0:b1], dv[b0:b1],
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                dout.stride(0), dout.stride(1), dout.stride(2),
                dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2),
                lse.stride(0), lse.stride(1),
                Hkv, Tq, Tk, D, group, scale * LOG2E, scale,
                _bucket(Tq), _bucket(Tk), **common,
            )
        if need_dq:
            def grid_q(meta, nb=nb):
                return (triton.cdiv(Tq, meta["BLOCK_M"]), nb * Hq)

            _bwd_dq_kernel[grid_q](
                qs, ks, vs, dos, lse[b0:b1], delta[b0:b1], dq[b0:b1],
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                dout.stride(0), dout.stride(1), dout.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2),
                lse.stride(0), lse.stride(1),
                Hq, Tq, Tk, D, group, scale * LOG2E, scale,
                _bucket(Tq), _bucket(Tk), **common,
            )
    return dq, dk, dv
