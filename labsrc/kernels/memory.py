"""kNN-memory attention (the Memorizing Transformer's combination), in Triton, with its PyTorch reference.

Each query attends twice, with two separate softmaxes, and a per-head gate mixes the two results
{cite}`wu2022memorizing`:

* *local* attention: causal attention over the keys of its own context ``k_local``/``v_local``
  (bottom-right aligned, as everywhere in the lab: query ``i`` sees keys ``j <= i + (Tk - T)``);
* *memory* attention: attention over the ``K`` rows ``mem_k[b, h, i]``/``mem_v[b, h, i]`` that a kNN search
  retrieved for that query (each query has its own rows);
* ``out = g * attn_mem + (1 - g) * attn_local`` with ``g = sigmoid(gate[h])``, ``gate`` the learned per-head
  logit ``b_g``. Both softmaxes scale the scores by ``sm_scale`` (``1/sqrt(D)`` by default).

Layouts: ``q (B, H, T, D)``, ``k_local``/``v_local`` ``(B, Hkv, Tk, D)`` with ``H % Hkv == 0`` (query head
``h`` reads local head ``h // (H // Hkv)``), ``mem_k``/``mem_v`` ``(B, H, T, K, D)`` (``K >= 0``: ``K = 0`` is an
empty memory), ``gate (H,)``, and optionally ``mem_valid (B, H, T, K)``, a bool mask of the retrieved rows that
are real. An approximate index can find fewer than ``K`` rows for a query
(:meth:`labsrc.memory.KVMemory.search` pads the rest and says which are real): a row with ``mem_valid`` False
is never read, so it takes no weight in the memory softmax (a zero key would otherwise score 0 and take its
share, and a padded row's NaN could not leak in either). The output is ``(B, H, T, D)`` in ``q.dtype``; the
arithmetic is fp32.

The softmax rule shared with :mod:`labsrc.kernels.flash_attention`: a set of scores that are all ``-inf``
contributes nothing, and a softmax with no finite score gives 0. So a query that sees no local key (only when
``T > Tk``) has ``attn_local = 0``, and an empty memory (``K = 0``, or no valid row) has ``attn_mem = 0``: the
output is then the
other attention times its weight, not renormalised (the gate is a mix, not a softmax over the two). A NaN in
a query, a visible key or value gives NaN in that row, as in the reference.

The kernel (:func:`knn_memory_attention`) runs one program per query row ``(b, h, t)``: grid ``(T, B * H)``.
The program loads its query once (a ``BLOCK_D`` vector in registers), streams its visible local keys in
blocks of ``BLOCK_N`` with an online softmax, then streams its own ``K`` retrieved rows in blocks of
``BLOCK_K`` with a second online softmax, and writes the gated mix. One query per program means the scores
are a broadcast multiply and a row sum, not a ``tl.dot`` (a dot needs at least 16 rows on each side): this is
the decode shape (one new token per sequence, as in flash-decoding), where the retrieved rows are gathered
per query anyway and no two queries share a memory tile. A prefill version would block several queries of one
head together for the local part, as :func:`labsrc.kernels.flash_attention.flash_attention` does. Because there is
no ``tl.dot``, bf16 runs natively under the interpreter too (no upcast is needed).

Inference only: the wrapper refuses inputs that require grad while a graph is recorded (the reference is
differentiable, so a gate can be trained through it).
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.flash_attention import (LOG2E, MAX_HEAD_DIM, MIN_HEAD_DIM, _online_softmax_step,
                                      _softmax_finish)

__all__ = ["knn_memory_attention", "knn_memory_attention_ref", "GRID_AXIS_LIMIT"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRID_AXIS_LIMIT = 65535       # programs on grid axis 1 (B * H)
GRID_AXIS0_LIMIT = 2**31 - 1  # programs on grid axis 0 (T)
MAX_ROWS = 2**20              # Triton's largest tile: a BLOCK_K x BLOCK_D tile must stay below it


# ----------------------------------------------------------------------------------------------------------
# Checks shared by the reference and the wrapper
# ----------------------------------------------------------------------------------------------------------
def _check_tensor(name, t, ndim, dims):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(t.shape)}")


def _check_args(q, k_local, v_local, mem_k, mem_v, gate, sm_scale, out, *, allow_float64, mem_valid=None):
    _check_tensor("q", q, 4, "(B, H, T, D)")
    _check_tensor("k_local", k_local, 4, "(B, Hkv, Tk, D)")
    _check_tensor("v_local", v_local, 4, "(B, Hkv, Tk, D)")
    _check_tensor("mem_k", mem_k, 5, "(B, H, T, K, D)")
    _check_tensor("mem_v", mem_v, 5, "(B, H, T, K, D)")
    _check_tensor("gate", gate, 1, "(H,)")
    dtypes = _DTYPES + ((torch.float64,) if allow_float64 else ())
    if q.dtype not in dtypes:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, t in (("k_local", k_local), ("v_local", v_local), ("mem_k", mem_k), ("mem_v", mem_v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
    if not gate.is_floating_point():
        raise TypeError(f"gate must be a floating-point tensor (the per-head gate logits), got {gate.dtype}")
    for name, t in (("k_local", k_local), ("v_local", v_local), ("mem_k", mem_k), ("mem_v", mem_v),
                    ("gate", gate)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    B, H, T, D = q.shape
    if min(B, H, T) < 1:
        raise ValueError(f"q must be non-empty, got shape {tuple(q.shape)}")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} of q is not supported: it must be between {MIN_HEAD_DIM} and "
                         f"{MAX_HEAD_DIM}")
    if tuple(v_local.shape) != tuple(k_local.shape):
        raise ValueError(f"v_local must have the shape of k_local {tuple(k_local.shape)}, got "
                         f"{tuple(v_local.shape)}")
    Bk, Hkv, Tk, Dk = k_local.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k_local must be (B={B}, Hkv, Tk, D={D}), got {tuple(k_local.shape)}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"k_local's heads Hkv={Hkv} must divide q's heads H={H} (grouped-query attention)")
    if Tk < 1:
        raise ValueError(f"k_local must hold at least one key, got Tk={Tk}")
    if mem_k.shape[:3] != (B, H, T) or mem_k.shape[4] != D:
        raise ValueError(f"mem_k must be (B={B}, H={H}, T={T}, K, D={D}), got {tuple(mem_k.shape)}")
    if tuple(mem_v.shape) != tuple(mem_k.shape):
        raise ValueError(f"mem_v must have the shape of mem_k {tuple(mem_k.shape)}, got {tuple(mem_v.shape)}")
    if tuple(gate.shape) != (H,):
        raise ValueError(f"gate must hold one logit per head, shape ({H},), got {tuple(gate.shape)}")
    if mem_valid is not None:
        if not isinstance(mem_valid, torch.Tensor):
            raise TypeError(f"mem_valid must be a bool torch.Tensor or None, got {type(mem_valid).__name__}")
        if mem_valid.dtype != torch.bool:
            raise TypeError(f"mem_valid must be a bool tensor (True for a real retrieved row), got {mem_valid.dtype}")
        if tuple(mem_valid.shape) != tuple(mem_k.shape[:4]):
            raise ValueError(f"mem_valid must have shape (B, H, T, K) = {tuple(mem_k.shape[:4])}, got "
                             f"{tuple(mem_valid.shape)}")
        if mem_valid.device != q.device:
            raise ValueError(f"mem_valid must be on the device of q ({q.device}), got {mem_valid.device}")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
            raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
        if not (math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must match q: shape {tuple(q.shape)}, {q.dtype} on {q.device}; got "
                             f"{tuple(out.shape)}, {out.dtype} on {out.device}")
        if out.shape[-1] > 1 and out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
        if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
            raise ValueError(f"out must not be an expanded view (its elements overlap in memory), got "
                             f"strides {out.stride()}")


def _scale(D, sm_scale):
    return 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)


def _softmax_attend(scores, values):
    """``softmax(scores) @ values`` over the last axis of ``scores``; a row whose scores are all ``-inf`` (or
    that has none) gives 0, and a NaN score makes its row NaN, as in the kernel."""
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    empty = lse == float("-inf")
    probs = torch.where(empty, 0.0, torch.exp(scores - torch.where(empty, 0.0, lse)))
    return (probs.unsqueeze(-2) @ values).squeeze(-2)


def knn_memory_attention_ref(q, k_local, v_local, mem_k, mem_v, gate, sm_scale=None, return_parts=False,
                             mem_valid=None):
    """The Memorizing Transformer's gated mix of local and memory attention, written directly.

    ``out = sigmoid(gate[h]) * softmax(q mem_k^T s) mem_v + (1 - sigmoid(gate[h])) * softmax(q k_local^T s
    + causal) v_local`` per head ``h``, ``s = sm_scale``, the memory softmax over the rows ``mem_valid`` marks
    real (all of them when it is None). Shapes and rules as in the module docstring. The
    arithmetic is fp32 (fp64 for fp64 inputs, which only the reference accepts). With ``return_parts`` also
    returns ``(attn_mem, attn_local)``, each ``(B, H, T, D)`` in the compute dtype. Differentiable.
    """
    _check_args(q, k_local, v_local, mem_k, mem_v, gate, sm_scale, None, allow_float64=True, mem_valid=mem_valid)
    B, H, T, D = q.shape
    Hkv, Tk = k_local.shape[1], k_local.shape[2]
    scale = _scale(D, sm_scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(compute)
    kl = k_local.to(compute).repeat_interleave(H // Hkv, dim=1)
    vl = v_local.to(compute).repeat_interleave(H // Hkv, dim=1)
    local_scores = (qf @ kl.transpose(-1, -2)) * scale                       # (B, H, T, Tk)
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    local_scores = local_scores.masked_fill(j > i + (Tk - T), float("-inf"))
    attn_local = _softmax_attend(local_scores, vl[:, :, None].expand(B, H, T, Tk, D))
    mk, mv = mem_k.to(compute), mem_v.to(compute)
    if mem_valid is not None:  # a padded row is never read: no score, no value (not even a NaN one)
        mk, mv = (x.masked_fill(~mem_valid[..., None], 0.0) for x in (mk, mv))
    mem_scores = torch.einsum("bhtd,bhtkd->bhtk", qf, mk) * scale  # (B, H, T, K)
    if mem_valid is not None:
        mem_scores = mem_scores.masked_fill(~mem_valid, float("-inf"))
    attn_mem = _softmax_attend(mem_scores, mv)
    g = torch.sigmoid(gate.to(compute))[None, :, None, None]
    out = (g * attn_mem + (1 - g) * attn_local).to(q.dtype)
    return (out, attn_mem, attn_local) if return_parts else out


# ----------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _knn_memory_attention_kernel(
    Q, KL, VL, MK, MV, MM, G, O, stride_qb, stride_qh, stride_qt, stride_klb,
    stride_klh, stride_kln, stride_vlb, stride_vlh, stride_vln, stride_mkb, stride_mkh,
    stride_mkt, stride_mkn, stride_mvb, stride_mvh, stride_mvt, stride_mvn, stride_mmb,
    stride_mmh, stride_mmt, stride_mmn, stride_ob, stride_oh, stride_ot, H, GROUP, T,
    TK, K, D, qk_scale, HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per query row: axis 0 is the position t, axis 1 the (batch, head)
    # pair. Every offset is int64, so no product of an index and a stride can overflow
    # 32 bits.
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    # the local K/V head this query head reads (GQA)
    hk = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    # D is padded to a power of two; padded lanes load 0
    d_mask = offs_d < D
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + t * stride_qt + offs_d,
        mask=d_mask,
        other=0.0,
    )
    q = q.to(tl.float32)

    # --- local attention: keys j < hi are visible (bottom-right causal), streamed in
    # blocks of BLOCK_N. The running state is kept as 1-row tiles so that the
    # online-softmax helpers of the FlashAttention kernel apply unchanged: m (1,) the
    # row maximum, l (1,) the row sum, acc (1, BLOCK_D) the output.
    m_l = tl.full((1,), float("-inf"), tl.float32)
    l_l = tl.zeros((1,), tl.float32)
    acc_l = tl.zeros((1, BLOCK_D), tl.float32)
    hi = tl.minimum(TK, t + TK - T + 1)
    kl_base = KL + b * stride_klb + hk * stride_klh
    vl_base = VL + b * stride_vlb + hk * stride_vlh
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        n_mask = offs_n < hi
        tile_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            kl_base + offs_n[:, None] * stride_kln + offs_d[None, :],
            mask=tile_mask,
            other=0.0,
        )
        # one query: the scores are a broadcast multiply and a row sum (log2 units,
        # scale folded in)
        s = tl.sum(q[None, :] * k.to(tl.float32), 1) * qk_scale
        s = tl.where(n_mask, s, float("-inf"))[None, :]
        m_l, l_l, alpha, p = _online_softmax_step(m_l, l_l, s)
        v = tl.load(
            vl_base + offs_n[:, None] * stride_vln + offs_d[None, :],
            mask=tile_mask,
            other=0.0,
        )
        acc_l = (
            acc_l * alpha[:, None] + tl.sum(tl.trans(p) * v.to(tl.float32), 0)[None, :]
        )
    out_l, _ = _softmax_finish(acc_l, l_l, m_l)

    # --- memory attention: this query's own K retrieved rows, a second softmax of its
    # own.
    m_m = tl.full((1,), float("-inf"), tl.float32)
    l_m = tl.zeros((1,), tl.float32)
    acc_m = tl.zeros((1, BLOCK_D), tl.float32)
    mk_base = MK + b * stride_mkb + h * stride_mkh + t * stride_mkt
    mv_base = MV + b * stride_mvb + h * stride_mvh + t * stride_mvt
    mm_base = MM + b * stride_mmb + h * stride_mmh + t * stride_mmt
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_mask = offs_k < K
        if HAS_VALID:
            # rows the search did not find (padding) are treated like rows past K: never
            # read
            k_mask = k_mask & (
                tl.load(mm_base + offs_k * stride_mmn, mask=k_mask, other=0) != 0
            )
        tile_mask = k_mask[:, None] & d_mask[None, :]
        mk = tl.load(
            mk_base + offs_k[:, None] * stride_mkn + offs_d[None, :],
            mask=tile_mask,
            other=0.0,
        )
        s = tl.sum(q[None, :] * mk.to(tl.float32), 1) * qk_scale
        s = tl.where(k_mask, s, float("-inf"))[None, :]
        m_m, l_m, alpha, p = _online_softmax_step(m_m, l_m, s)
        mv = tl.load(
            mv_base + offs_k[:, None] * stride_mvn + offs_d[None, :],
            mask=tile_mask,
            other=0.0,
        )
        acc_m = (
            acc_m * alpha[:, None] + tl.sum(tl.trans(p) * mv.to(tl.float32), 0)[None, :]
        )
    out_m, _ = _softmax_finish(acc_m, l_m, m_m)

    # --- the gate: g = sigmoid(b_h), one scalar per head, mixes the two normalised
    # outputs.
    g = 1.0 / (1.0 + tl.exp(-tl.load(G + h)))
    out = g * out_m + (1.0 - g) * out_l
    tl.store(O + b * stride_ob + h * stride_oh + t * stride_ot + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=d_mask[None, :])


def _blocks(D, K):
    """Tile sizes: BLOCK_D pads the head dim; the key and row blocks keep a tile at 4096 fp32 values."""
    block_d = triton.next_power_of_2(D)
    block_n = max(16, 4096 // block_d)
    block_k = max(16, min(block_n, triton.next_power_of_2(max(K, 1))))
    return block_n, block_k, block_d


def _dense_last(t):
    """``t`` itself when its last dimension is dense (the kernel takes every other stride), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def knn_memory_attention(q, k_local, v_local, mem_k, mem_v, gate, sm_scale=None, out=None, mem_valid=None):
    """Gated local + memory attention in one Triton kernel; equal to :func:`knn_memory_attention_ref`.

    Args:
        q: ``(B, H, T, D)`` queries, float32/float16/bfloat16, ``16 <= D <= 128``.
        k_local, v_local: ``(B, Hkv, Tk, D)`` local keys and values (``H % Hkv == 0``), causal bottom-right.
        mem_k, mem_v: ``(B, H, T, K, D)`` the rows retrieved for each query (``K = 0``: empty memory).
        gate: ``(H,)`` the per-head gate logits ``b``; ``g = sigmoid(b)`` weighs the memory.
        sm_scale: the score scale of both softmaxes, ``1/sqrt(D)`` by default.
        out: an optional output buffer of q's shape and dtype (written in place).
        mem_valid: ``(B, H, T, K)`` bool, True for a real retrieved row (None: all are real). Rows marked
            False are never read and take no weight, as rows past ``K`` would.

    Every tensor may be a strided or expanded view: the kernel reads through the strides (a last dimension
    that is not dense is copied first); ``gate`` is read as contiguous float32. Returns ``(B, H, T, D)`` in
    ``q.dtype``. Raises ``TypeError``/``ValueError`` naming the argument for a wrong type, dtype, shape,
    device or output buffer, for inputs that require grad (inference only) and for a launch beyond
    Triton's limits (more than 65535 (batch, head) pairs, more than 2^31 - 1 positions).
    """
    _check_args(q, k_local, v_local, mem_k, mem_v, gate, sm_scale, out, allow_float64=False, mem_valid=mem_valid)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_local, v_local, mem_k, mem_v, gate)):
        raise ValueError("knn_memory_attention is inference-only (no backward): an input requires grad. Run it "
                         "under torch.no_grad(), or train through knn_memory_attention_ref")
    B, H, T, D = q.shape
    if B * H > GRID_AXIS_LIMIT:
        raise ValueError(f"B * H = {B * H} (batch, head) pairs exceed the launch limit of {GRID_AXIS_LIMIT} "
                         f"programs on grid axis 1; call it on slices of the batch")
    if T > GRID_AXIS0_LIMIT:
        raise ValueError(f"T = {T} positions exceed the launch limit of {GRID_AXIS0_LIMIT} programs on grid "
                         f"axis 0")
    if HAS_TRITON and not runtime.INTERPRETED and q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device for the compiled Triton kernel, got {q.device}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if not HAS_TRITON:  # no Triton here (Linux wheels only): the reference computes the same thing
        return out.copy_(knn_memory_attention_ref(q, k_local, v_local, mem_k, mem_v, gate, sm_scale,
                                                  mem_valid=mem_valid))
    K, Tk, Hkv = mem_k.shape[3], k_local.shape[2], k_local.shape[1]
    q, k_local, v_local, mem_k, mem_v = (_dense_last(t) for t in (q, k_local, v_local, mem_k, mem_v))
    g = gate.to(torch.float32).contiguous()
    # the mask as bytes, read through its strides (an expanded mask stays expanded); q stands in when absent
    mm = mem_valid.to(torch.uint8) if mem_valid is not None else None
    mm_strides = mm.stride() if mm is not None else (0, 0, 0, 0)
    block_n, block_k, block_d = _blocks(D, K)
    _knn_memory_attention_kernel[(T, B * H)](
        q, k_local, v_local, mem_k, mem_v, mm if mm is not None else q, g, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_local.stride(0), k_local.stride(1), k_local.stride(2),
        v_local.stride(0), v_local.stride(1), v_local.stride(2),
        mem_k.stride(0), mem_k.stride(1), mem_k.stride(2), mem_k.stride(3),
        mem_v.stride(0), mem_v.stride(1), mem_v.stride(2), mem_v.stride(3),
        *mm_strides,
        out.stride(0), out.stride(1), out.stride(2),
        H, H // Hkv, T, Tk, K, D, _scale(D, sm_scale) * LOG2E,
        HAS_VALID=mem_valid is not None, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4)
    return out
