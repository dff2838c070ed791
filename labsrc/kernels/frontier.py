"""Differential attention with its two softmaxes fused in one Triton kernel, and its PyTorch reference.

Differential attention (the DIFF Transformer, {cite}`ye2024diff`) computes two causal attention maps
from two query/key pairs over the same values and subtracts them:

    out = softmax(q1 k1^T s + causal) v - lam[h] * softmax(q2 k2^T s + causal) v

with ``s = sm_scale`` (``1/sqrt(D)`` by default) and ``lam`` one weight per head. Noise that both maps put on
the same keys (common mode) cancels; what the first map puts on the right key and the second does not stays.
The per-head normalisation and the ``(1 - lambda_init)`` scale that follow in the paper are not part of
this kernel (see :func:`labsrc.frontier.diff_head_norm`).

Layouts: ``q1, k1, q2, k2 (B, H, T, D)``, ``v (B, H, T, Dv)`` (the paper's values are twice as wide as its
queries: ``Dv`` may differ from ``D``), ``lam`` a float or a ``(H,)`` tensor. The mask is the square causal
one (query ``i`` sees keys ``j <= i``). The output is ``(B, H, T, Dv)`` in ``q1.dtype``; scores, both softmax
states and both accumulators are fp32. A NaN in a visible query, key or value gives NaN in that row, as in
the reference (every row sees at least its own key, so no row is empty).

The kernel (:func:`diff_attention_fused`) runs one program per block of ``BLOCK_M`` queries of one
``(batch, head)``: grid ``(cdiv(T, BLOCK_M), B * H)``. It loads the two query tiles once, then streams the
visible key blocks: per block it loads ``k1``, ``k2`` and ``v`` once, computes the two score tiles with
``tl.dot``, folds each into its own online softmax (two running maxima, two row sums, two accumulators) and
multiplies *the same* ``v`` tile into both accumulators. Compared with two calls of
:func:`labsrc.kernels.flash_attention.flash_attention` it reads ``v`` once instead of twice and writes the output
once instead of twice plus a subtraction pass. Under the Triton interpreter bf16 tiles are upcast to fp32
after loading (``tl.dot`` on bf16 returns garbage there); compiled on a GPU they go to the tensor cores as
they are.

Inference only: the wrapper refuses inputs that require grad while a graph is recorded (the reference is
differentiable; the models of the chapter train through PyTorch's attention).
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.flash_attention import (GRID_AXIS_LIMIT, LOG2E, MAX_HEAD_DIM, MIN_HEAD_DIM, _online_softmax_step,
                                      _softmax_finish)

__all__ = ["diff_attention_fused", "diff_attention_ref", "GRID_AXIS_LIMIT"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_INT32_OFFSET = 2**31 - 1


# ----------------------------------------------------------------------------------------------------------
# Checks shared by the reference and the wrapper
# ----------------------------------------------------------------------------------------------------------
def _check_args(q1, k1, q2, k2, v, lam, sm_scale, out, *, allow_float64):
    names = (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2), ("v", v))
    for name, t in names:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, T, D), got shape {tuple(t.shape)}")
    dtypes = _DTYPES + ((torch.float64,) if allow_float64 else ())
    if q1.dtype not in dtypes:
        allowed = "float32, float16, bfloat16" + (" or float64" if allow_float64 else "")
        raise TypeError(f"q1 must be {allowed}, got {q1.dtype}")
    for name, t in names[1:]:
        if t.dtype != q1.dtype:
            raise TypeError(f"{name} must have the dtype of q1 ({q1.dtype}), got {t.dtype}")
        if t.device != q1.device:
            raise ValueError(f"{name} must be on the device of q1 ({q1.device}), got {t.device}")
    B, H, T, D = q1.shape
    if min(B, H, T) < 1:
        raise ValueError(f"q1 must be non-empty, got shape {tuple(q1.shape)}")
    for name, t in names[1:4]:
        if tuple(t.shape) != tuple(q1.shape):
            raise ValueError(f"{name} must have the shape of q1 {tuple(q1.shape)}, got {tuple(t.shape)}")
    if tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"v must be (B={B}, H={H}, T={T}, Dv), got {tuple(v.shape)}")
    for name, d in (("q1", D), ("v", v.shape[3])):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {d} of {name} is not supported: it must be between {MIN_HEAD_DIM} and "
                             f"{MAX_HEAD_DIM}")
    if isinstance(lam, torch.Tensor):
        if not lam.is_floating_point():
            raise TypeError(f"lam must be a float or a floating-point (H,) tensor, got {lam.dtype}")
        if tuple(lam.shape) != (H,):
            raise ValueError(f"lam must hold one weight per head, shape ({H},), got {tuple(lam.shape)}")
        if lam.device != q1.device:
            raise ValueError(f"lam must be on the device of q1 ({q1.device}), got {lam.device}")
    elif isinstance(lam, bool) or not isinstance(lam, numbers.Real):
        raise TypeError(f"lam must be a real number or a (H,) tensor, got {type(lam).__name__}")
    elif not math.isfinite(lam):
        raise ValueError(f"lam must be finite, got {lam}")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
            raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
        if not (math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        want = (B, H, T, v.shape[3])
        if tuple(out.shape) != want or out.dtype != q1.dtype or out.device != q1.device:
            raise ValueError(f"out must be {want} in {q1.dtype} on {q1.device}; got {tuple(out.shape)}, "
                             f"{out.dtype} on {out.device}")
        if out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
        if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
            raise ValueError(f"out must not be an expanded view (its elements overlap in memory), got strides "
                             f"{out.stride()}")


def _scale(D, sm_scale):
    return 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)


def _lam_vector(lam, H, device, dtype):
    if isinstance(lam, torch.Tensor):
        return lam.to(device=device, dtype=dtype)
    return torch.full((H,), float(lam), device=device, dtype=dtype)


def diff_attention_ref(q1, k1, q2, k2, v, lam, sm_scale=None, return_maps=False):
    """Differential attention written directly: two causal softmax maps, one subtraction.

    ``out = softmax(q1 k1^T s + M) v - lam[h] softmax(q2 k2^T s + M) v`` with the causal mask ``M`` and
    ``s = sm_scale`` (``1/sqrt(D)`` by default). Shapes and rules as in the module docstring; the arithmetic
    is fp32 (fp64 for fp64 inputs, which only the reference accepts). With ``return_maps`` also returns the
    two probability maps ``(B, H, T, T)``. Differentiable.
    """
    _check_args(q1, k1, q2, k2, v, lam, sm_scale, None, allow_float64=True)
    B, H, T, D = q1.shape
    compute = torch.float64 if q1.dtype == torch.float64 else torch.float32
    s = _scale(D, sm_scale)
    mask = torch.ones(T, T, dtype=torch.bool, device=q1.device).triu(1)
    a1 = torch.softmax(((q1.to(compute) @ k1.to(compute).transpose(-1, -2)) * s).masked_fill(mask, float("-inf")), -1)
    a2 = torch.softmax(((q2.to(compute) @ k2.to(compute).transpose(-1, -2)) * s).masked_fill(mask, float("-inf")), -1)
    lv = _lam_vector(lam, H, q1.device, compute)[None, :, None, None]
    out = ((a1 - lv * a2) @ v.to(compute)).to(q1.dtype)
    return (out, a1, a2) if return_maps else out


# ----------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _diff_attention_kernel(
    Q1, K1, Q2, K2, V, LAM, O, stride_q1b, stride_q1h, stride_q1t, stride_k1b,
    stride_k1h, stride_k1t, stride_q2b, stride_q2h, stride_q2t, stride_k2b, stride_k2h,
    stride_k2t, stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, H, T,
    D, DV, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program = BLOCK_M queries of one (batch, head); batch and head offsets in 64
    # bits.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # head dims are padded to powers of two; padded lanes load 0
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    m_rows = offs_m < T

    # The two query tiles stay in registers for the whole program.
    q_mask = m_rows[:, None] & d_mask[None, :]
    q1 = tl.load(
        Q1
        + b * stride_q1b
        + h * stride_q1h
        + offs_m[:, None] * stride_q1t
        + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    q2 = tl.load(
        Q2
        + b * stride_q2b
        + h * stride_q2h
        + offs_m[:, None] * stride_q2t
        + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)

    # Two independent online-softmax states: (m, l, acc) for each map.
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Causal block skipping: keys past the block's last query are never loaded.
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + offs_n0
        n_rows = offs_n < T
        k_mask = n_rows[:, None] & d_mask[None, :]
        k1 = tl.load(
            K1
            + b * stride_k1b
            + h * stride_k1h
            + offs_n[:, None] * stride_k1t
            + offs_d[None, :],
            mask=k_mask,
            other=0.0,
        )
        k2 = tl.load(
            K2
            + b * stride_k2b
            + h * stride_k2h
            + offs_n[:, None] * stride_k2t
            + offs_d[None, :],
            mask=k_mask,
            other=0.0,
        )
        # the values are loaded ONCE and feed both accumulators
        v = tl.load(
            V
            + b * stride_vb
            + h * stride_vh
            + offs_n[:, None] * stride_vt
            + offs_dv[None, :],
            mask=n_rows[:, None] & dv_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
            v = v.to(tl.float32)
        visible = (offs_n[None, :] <= offs_m[:, None]) & n_rows[None, :]
        # scores in log2 units (log2(e) folded into qk_scale), masked to -inf where not
        # visible
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * qk_scale
        s1 = tl.where(visible, s1, float("-inf"))
        s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * qk_scale
        s2 = tl.where(visible, s2, float("-inf"))
        m1, l1, alpha1, p1 = _online_softmax_step(m1, l1, s1)
        m2, l2, alpha2, p2 = _online_softmax_step(m2, l2, s2)
        acc1 = tl.dot(
            p1.to(v.dtype), v, acc1 * alpha1[:, None], input_precision=PRECISION
        )
        acc2 = tl.dot(
            p2.to(v.dtype), v, acc2 * alpha2[:, None], input_precision=PRECISION
        )

    out1, _ = _softmax_finish(acc1, l1, m1)
    out2, _ = _softmax_finish(acc2, l2, m2)
    lam = tl.load(LAM + h)
    out = out1 - lam * out2              # the subtraction happens in registers, in fp32
    tl.store(
        O
        + b * stride_ob
        + h * stride_oh
        + offs_m[:, None] * stride_ot
        + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=m_rows[:, None] & dv_mask[None, :],
    )


def _blocks(T, D):
    """BLOCK_M = BLOCK_N: 16 under the interpreter and for short sequences, 64 on a GPU otherwise (32 for
    head dims over 64: with two score tiles and a 2D-wide value tile, 64 x 64 blocks spilled registers even at
    eight warps, `python -m labsrc.gpucheck --compile-only`)."""
    if runtime.INTERPRETED or T <= 16:
        return 16
    return 64 if T >= 64 and D <= 64 else 32


def _dense_last(t):
    """``t`` itself when its last dimension is dense (the kernel takes every other stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def diff_attention_fused(q1, k1, q2, k2, v, lam, sm_scale=None, out=None):
    """Causal differential attention in one Triton kernel; equal to :func:`diff_attention_ref`.

    Args:
        q1, k1, q2, k2: ``(B, H, T, D)`` the two query/key pairs, float32/float16/bfloat16, ``16 <= D <= 128``.
        v: ``(B, H, T, Dv)`` the values (``16 <= Dv <= 128``), shared by both maps.
        lam: the weight of the second map, a float or one per head ``(H,)`` (read as contiguous float32).
        sm_scale: the score scale of both softmaxes, ``1/sqrt(D)`` by default.
        out: an optional ``(B, H, T, Dv)`` output buffer in q1's dtype (written in place).

    Any strides are read as they are (expanded views included); a last dimension that is not dense is copied
    first. Returns ``(B, H, T, Dv)`` in ``q1.dtype``. Raises ``TypeError``/``ValueError`` naming the
    argument for a wrong type, dtype, shape, device or output buffer, for inputs that require grad
    (inference only) and for a launch beyond Triton's limits (more than 65535 (batch, head) pairs, a
    (batch, head) slice past 2^31 - 1 elements).
    """
    _check_args(q1, k1, q2, k2, v, lam, sm_scale, out, allow_float64=False)
    tensors = (q1, k1, q2, k2, v) + ((lam,) if isinstance(lam, torch.Tensor) else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("diff_attention_fused is inference-only (no backward): an input requires grad. Run it "
                         "under torch.no_grad(), or train through diff_attention_ref")
    B, H, T, D = q1.shape
    Dv = v.shape[3]
    if B * H > GRID_AXIS_LIMIT:
        raise ValueError(f"B * H = {B * H} (batch, head) pairs exceed the launch limit of {GRID_AXIS_LIMIT} "
                         f"programs on grid axis 1; call it on slices of the batch")
    for name, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2), ("v", v)):
        if (T - 1) * abs(t.stride(2)) + t.shape[3] > MAX_INT32_OFFSET:
            raise ValueError(f"{name}: one (batch, head) slice spans more than 2^31 - 1 elements, past the "
                             f"kernel's 32-bit position offsets")
    if HAS_TRITON and not runtime.INTERPRETED and q1.device.type != "cuda":
        raise ValueError(f"q1 must be on a CUDA device for the compiled Triton kernel, got {q1.device}")
    if out is None:
        out = torch.empty((B, H, T, Dv), device=q1.device, dtype=q1.dtype)
    if not HAS_TRITON:  # no Triton here (Linux wheels only): the reference computes the same thing
        return out.copy_(diff_attention_ref(q1, k1, q2, k2, v, lam, sm_scale))
    q1, k1, q2, k2, v = (_dense_last(t) for t in (q1, k1, q2, k2, v))
    lam_v = _lam_vector(lam, H, q1.device, torch.float32).contiguous()
    upcast = runtime.INTERPRETED and q1.dtype == torch.bfloat16
    precision = "ieee" if q1.dtype == torch.float32 else "tf32"
    block = _blocks(T, D)
    _diff_attention_kernel[(triton.cdiv(T, block), B * H)](
        q1, k1, q2, k2, v, lam_v, out,
        q1.stride(0), q1.stride(1), q1.stride(2),
        k1.stride(0), k1.stride(1), k1.stride(2),
        q2.stride(0), q2.stride(1), q2.stride(2),
        k2.stride(0), k2.stride(1), k2.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        H, T, D, Dv, _scale(D, sm_scale) * LOG2E,
        UPCAST=upcast, PRECISION=precision,
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(Dv)), num_warps=8)  # 4 warps spilled (816-5052 bytes)
    return out
