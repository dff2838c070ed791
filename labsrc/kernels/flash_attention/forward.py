"""The FlashAttention forward in Triton (one program per query block and head, the keys streamed through an
online softmax), its autotune configs and its wrapper, with the autograd function that pairs it with the
backward.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.flash_attention.backward import _flash_backward
from labsrc.kernels.flash_attention.common import (LOG2E, _batch_chunks, _bucket, _capability,
                                                   _check_attention_args, _default_scale, _launch_flags)
from labsrc.kernels.flash_attention.naive import flash_attention_ref
from labsrc.kernels.flash_attention.softmax import _attend_blocks, _softmax_finish


def _flash_configs() -> list:
    if runtime.INTERPRETED:
        # The interpreter runs every program one after another in NumPy: fewer, bigger
        # tiles are faster, and one configuration means no benchmarking. 64 x 64 still
        # leaves several query blocks and a full/diagonal split at the test lengths
        # (129, 257), so the block-skipping paths are exercised.
        return [
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)
        ]
    # Only shapes that compile without register spills at D = 128 on their architecture
    # (`python -m labsrc.gpucheck --compile-only`). Each thread holds its share of q,
    # the fp32 accumulator (BLOCK_M x D), the scores and their bf16 copy: a 128-query
    # block needs 8 warps (at 4 warps every 128-row shape spilled, 100-2900 bytes), and
    # 128 x 128 spilled even at 8 warps (180-760 bytes). 64 x 128 at 4 warps spilled too
    # (1-1.7 KB), and on Ampere 64 x 64 at 4 warps with only 2 stages (64 bytes).
    # Hopper: deeper software pipelines (228 KB of shared memory per SM)
    if _capability()[0] >= 9:
        shapes = [
            (128, 64, 8, 3),
            (128, 64, 8, 4),
            (128, 32, 8, 3),
            (64, 64, 4, 4),
            (64, 64, 8, 3),
            (64, 32, 4, 3),
        ]
    # Ampere and older: 164 KB (A100) or 100 KB (consumer) of shared memory, shallower
    # pipelines
    else:
        shapes = [
            (128, 64, 8, 4),
            (128, 32, 8, 3),
            (64, 128, 8, 3),
            (64, 64, 4, 3),
            (64, 64, 8, 3),
            (64, 32, 4, 4),
        ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


@triton.autotune(
    configs=_flash_configs(),
    key=["TQ_BUCKET", "TK_BUCKET", "BLOCK_D", "CAUSAL", "PRECISION"],
)
@triton.jit
def _flash_attention_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    Hq,
    Tq,
    Tk,
    D,
    GROUP,
    qk_scale,
    TQ_BUCKET,
    TK_BUCKET,  # used only as autotuning keys
    CAUSAL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one block of BLOCK_M queries of one (batch, query head). Axis 0
    # walks the query blocks so that programs launched together share the same K/V head
    # and hit the same lines in L2.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # Batch and head offsets in 64 bits: b * stride_qb passes 2^31 elements for a few
    # GiB of K/V cache.
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    # grouped-query attention: pick the shared K/V head, never copy it
    hkv = hq // GROUP

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # head dims like 48, 80, 96 are padded up to BLOCK_D, a power of two
    d_mask = offs_d < D

    q_ptrs = (
        Q
        + b * stride_qb
        + hq * stride_qh
        + offs_m[:, None] * stride_qm
        + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < Tq) & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Bottom-right causal alignment: query i sees keys j <= i + diag.
    diag = Tk - Tq
    if CAUSAL:
        # Causal block skipping: keys past the last row's diagonal are never loaded at
        # all...
        hi = tl.minimum(Tk, start_m + BLOCK_M + diag)
        # ...and keys up to the first row's diagonal are visible to every row, so they
        # need no mask.
        full_end = (
            tl.maximum(tl.minimum(start_m + diag + 1, Tk), 0) // BLOCK_N * BLOCK_N
        )
    else:
        hi = Tk
        full_end = Tk // BLOCK_N * BLOCK_N

    # running row maximum (log2 units)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m)
    # running sum of p @ v, not yet divided by l
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = (
        K
        + b * stride_kb
        + hkv * stride_kh
        + offs_n0[:, None] * stride_kn
        + offs_d[None, :]
    )
    v_base = (
        V
        + b * stride_vb
        + hkv * stride_vh
        + offs_n0[:, None] * stride_vn
        + offs_d[None, :]
    )
    acc, l_i, m_i = _attend_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n0,
        d_mask,
        0,
        full_end,
        Tk,
        diag,
        qk_scale,
        BLOCK_N,
        False,
        CAUSAL,
        UPCAST,
        PRECISION,
    )
    acc, l_i, m_i = _attend_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base + full_end * stride_kn,
        v_base + full_end * stride_vn,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n0,
        d_mask,
        full_end,
        hi,
        Tk,
        diag,
        qk_scale,
        BLOCK_N,
        True,
        CAUSAL,
        UPCAST,
        PRECISION,
    )

    # Normalise once at the end (FlashAttention-2), not after every block. A row that
    # saw no key has l = 0 and acc = 0: the defined output 0 and log-sum-exp -inf.
    out, lse2 = _softmax_finish(acc, l_i, m_i)
    o_ptrs = (
        O
        + b * stride_ob
        + hq * stride_oh
        + offs_m[:, None] * stride_om
        + offs_d[None, :]
    )
    tl.store(
        o_ptrs,
        out.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < Tq) & d_mask[None, :],
    )
    if WRITE_LSE:
        # log(sum exp(s)) = (m + log2(l)) * ln 2, with s in natural units; -inf for an
        # empty row.
        tl.store(
            LSE + b * stride_lb + hq * stride_lh + offs_m,
            lse2 * 0.6931471805599453,
            mask=offs_m < Tq,
        )


# ----------------------------------------------------------------------------------------------------------------
# Wrappers.
# ----------------------------------------------------------------------------------------------------------------
def flash_attention(q, k, v, causal=False, sm_scale=None, return_lse=False, out=None, lse_out=None):
    """FlashAttention: ``softmax(q k^T * sm_scale) v`` without building the score matrix, differentiable.

    Args:
        q: queries ``(B, Hq, Tq, D)``, float32/float16/bfloat16, 16 <= D <= 128, at most 65535 heads
            (``GRID_AXIS_LIMIT``; a batch with more than 65535 (batch x head) programs is launched in chunks).
        k, v: keys and values ``(B, Hkv, Tk, D)`` of q's dtype; ``Hq`` must be a multiple of ``Hkv`` (GQA).
            Any strides are accepted (expanded views included) as long as the last (head) dimension is
            contiguous and one (batch, head) slice spans fewer than 2^31 elements.
        causal: query ``i`` sees keys ``j <= i + (Tk - Tq)`` (bottom-right aligned, see the module docstring).
            A row that sees no key (``Tq > Tk``) gives output 0 and log-sum-exp ``-inf``.
        sm_scale: factor on the scores, ``1/sqrt(D)`` by default; a finite positive number whose product with
            log2(e) is a normal float32 (the kernels receive it as one).
        return_lse: also return the natural-log log-sum-exp of each row, ``(B, Hq, Tq)`` float32.
        out, lse_out: optional tensors to write into (same shapes; ``out`` in q's dtype). Tests pass
            NaN-filled buffers here to prove the kernel writes every element. Not accepted when the call
            records a graph (see below): autograd must own the output it differentiates.

    Returns:
        ``out`` ``(B, Hq, Tq, D)`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Autograd: when gradients are enabled and any of q, k, v requires grad, the call goes through a
    ``torch.autograd.Function`` that saves q, k, v, the output and the log-sum-exp (``O(T)`` extra memory,
    not the ``O(T^2)`` probabilities) and whose backward is :func:`flash_attention_backward`. Otherwise (no
    input requires grad, or under ``torch.no_grad()``) the plain forward runs and nothing is saved. ``lse``
    is returned without a gradient (it is marked non-differentiable).
    """
    _check_attention_args(q, k, v, causal, sm_scale, out, lse_out)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        if out is not None or lse_out is not None:
            raise ValueError("out and lse_out cannot be used when q, k or v require grad: autograd needs to own "
                             "the output it differentiates (drop out=/lse_out=, or call under torch.no_grad())")
        result, lse = _FlashAttentionFunction.apply(q, k, v, causal, sm_scale)
        return (result, lse) if return_lse else result
    write_lse = return_lse or lse_out is not None
    out, lse_out = _flash_forward(q, k, v, causal, sm_scale, out, lse_out, write_lse)
    return (out, lse_out) if return_lse else out


def _flash_forward(q, k, v, causal, sm_scale, out, lse_out, write_lse):
    """Launch the forward kernel on checked arguments; allocates ``out`` (and ``lse_out`` if it is written)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if write_lse and lse_out is None:
        lse_out = torch.empty((B, Hq, Tq), device=q.device, dtype=torch.float32)
    if not HAS_TRITON:  # no Triton on this machine (it has Linux wheels only): the reference computes
        ref, lse = flash_attention_ref(q, k, v, causal, sm_scale, return_lse=True)
        out.copy_(ref)
        if write_lse:
            lse_out.copy_(lse)
        return out, lse_out
    lse_arg = lse_out if write_lse else out  # a placeholder pointer: the kernel never touches it then
    upcast, precision = _launch_flags(q.dtype)
    qk_scale = _default_scale(D, sm_scale) * LOG2E  # fold log2(e) in once, so the kernel uses exp2 only

    for b0, b1 in _batch_chunks(B, Hq):  # one launch unless B * Hq > 65535 (grid axis 1)
        def grid(meta, nb=b1 - b0):
            return (triton.cdiv(Tq, meta["BLOCK_M"]), nb * Hq)

        _flash_attention_kernel[grid](
            q[b0:b1], k[b0:b1], v[b0:b1], out[b0:b1], lse_arg[b0:b1],
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse_out.stride(0) if write_lse else 0, lse_out.stride(1) if write_lse else 0,
            Hq, Tq, Tk, D, Hq // Hkv, qk_scale,
            _bucket(Tq), _bucket(Tk),
            CAUSAL=causal, WRITE_LSE=write_lse, UPCAST=upcast, PRECISION=precision,
            BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return out, lse_out


class _FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward kernel saves what the backward kernels recompute P from.

    Saved: q, k, v (views, not copies), the output and the fp32 log-sum-exp -- ``O(B * Hq * Tq * D)``, never
    the ``Tq x Tk`` probabilities. The log-sum-exp output is marked non-differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out, lse = _flash_forward(q, k, v, causal, sm_scale, None, None, write_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = _flash_backward(dout, q, k, v, out, lse, ctx.causal, ctx.sm_scale,
                                     need_dq=need_q, need_dkdv=need_k or need_v)
        return dq, (dk if need_k else None), (dv if need_v else None), None, None
