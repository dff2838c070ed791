"""Tree attention for speculative decoding: verify every branch of a draft tree in one target forward.

A draft tree holds ``N`` candidate tokens (nodes); node ``i`` continues the path through its ancestors. The
target scores all ``N`` nodes at once: node ``i``'s query attends to the whole cached prefix (``P`` keys) and,
among the tree's own keys, only to its ancestors and itself (SpecInfer's *tree attention*,
{cite}`miao2023specinfer`). One forward then gives, at every node, the target's distribution for the next
token on that node's path.

* :func:`tree_attention_ref`: the plain PyTorch definition (a dense ``N x (P + N)`` mask, softmax, weights).
* :func:`tree_attention`: a Triton kernel. One program owns ``BLOCK_M`` tree queries of one (batch, query
  head); it streams the prefix's key blocks with no mask (every node sees the whole prefix), then the tree's
  key blocks under the ancestor mask, with the online softmax of :mod:`labsrc.kernels.flash_attention` (its
  ``_online_softmax_step`` and ``_softmax_finish``, so the same empty-row rule: a row that sees no key gives
  output 0). Grouped-query attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``.

Layout: ``q (B, Hq, N, D)``; ``k, v (B, Hkv, P + N, D)`` with the prefix first and the ``N`` tree nodes last
(the order the target's KV cache holds them after the tree is appended); ``tree_mask (N, N)`` or
``(B, N, N)``, ``tree_mask[i, j]`` true when node ``j`` is node ``i`` or one of its ancestors (see
:func:`labsrc.speculative.tree_attention_mask`). Inference only: inputs that require grad are refused.
Non-finite inputs propagate as in the reference (a NaN key poisons the rows that see it).
Under the interpreter bf16 tiles are upcast to fp32 after loading (``tl.dot`` on bf16 returns garbage there).
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.flash_attention import (LOG2E, _batch_chunks, _check_device, _check_float_dtype,
                                      _check_head_dim, _check_heads_on_grid, _check_kv_match_q,
                                      _check_last_dim_contiguous, _check_offsets, _check_out, _check_scale,
                                      _check_tensor, _default_scale, _kernel_operand, _launch_flags, _online_softmax_step,
                                      _softmax_finish)

__all__ = ["tree_attention", "tree_attention_ref", "MAX_TREE_NODES"]

MAX_TREE_NODES = 4096   # the ancestor mask of one sequence is N x N int8 values read with 32-bit offsets


def _check_tree_args(q, k, v, tree_mask, sm_scale, out, need_kernel_device=True, allow_float64=False):
    _check_tensor("q", q, 4, "(B, Hq, N, D)")
    _check_tensor("k", k, 4, "(B, Hkv, P + N, D)")
    _check_tensor("v", v, 4, "(B, Hkv, P + N, D)")
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    _check_float_dtype("q", q, allow_float64=allow_float64)
    _check_float_dtype("k", k, like=q)
    _check_float_dtype("v", v, like=q)
    for name, t in (("q", q), ("k", k), ("v", v), ("tree_mask", tree_mask)):
        _check_device(name, t, q, need_kernel_device)
    if tree_mask.dtype.is_floating_point or tree_mask.dtype.is_complex:
        raise TypeError(f"tree_mask must be a bool (or integer 0/1) tensor, got {tree_mask.dtype}")
    _check_scale(sm_scale)
    B, Hq, N, D = q.shape
    Hkv, T = _check_kv_match_q(q, k, v)
    if min(B, Hq, N, D, Hkv) < 1:
        raise ValueError(f"q and k must be non-empty, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if T < N:
        raise ValueError(f"k must hold the prefix and then the N={N} tree nodes (length P + N >= N), got length {T}")
    if Hq % Hkv != 0:
        raise ValueError(f"q's heads Hq={Hq} must be a multiple of k's heads Hkv={Hkv} (grouped-query attention)")
    _check_head_dim(D)
    if tree_mask.dim() not in (2, 3) or tuple(tree_mask.shape[-2:]) != (N, N) or (
            tree_mask.dim() == 3 and tree_mask.shape[0] != B):
        raise ValueError(f"tree_mask must have shape (N, N) = ({N}, {N}) or (B, N, N) = ({B}, {N}, {N}), "
                         f"got {tuple(tree_mask.shape)}")
    if N > MAX_TREE_NODES:
        raise ValueError(f"a tree of N={N} nodes exceeds the limit of {MAX_TREE_NODES} (MAX_TREE_NODES)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_last_dim_contiguous(name, t)
    if need_kernel_device:
        if any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
            raise ValueError("tree_attention is inference-only (no backward): q, k and v must not require grad "
                             "(call it under torch.no_grad() or detach them)")
        _check_heads_on_grid("Hq", Hq)
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_offsets(name, t, 2)
    _check_out("out", out, q.shape, q)
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have the same dtype as q ({q.dtype}), got {out.dtype}")


def tree_attention_ref(q, k, v, tree_mask, sm_scale=None):
    """Plain PyTorch tree attention (the definition the kernel is tested against).

    Node ``i`` attends to every prefix key and to tree key ``j`` where ``tree_mask[i, j]``. Computed in fp32
    (fp64 for fp64 inputs); returns ``(B, Hq, N, D)`` in q's dtype; a row that sees no key gives 0.
    """
    _check_tree_args(q, k, v, tree_mask, sm_scale, None, need_kernel_device=False, allow_float64=True)
    B, Hq, N, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    P = T - N
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = tree_mask.to(torch.bool)
    mask = mask.expand(B, N, N) if mask.dim() == 2 else mask
    full = torch.cat([torch.ones(B, N, P, dtype=torch.bool, device=q.device), mask], dim=-1)  # (B, N, T)
    group = Hq // Hkv
    kf = k.to(work).repeat_interleave(group, dim=1)
    vf = v.to(work).repeat_interleave(group, dim=1)
    s = (q.to(work) @ kf.transpose(-1, -2)) * _default_scale(D, sm_scale)
    s = s.masked_fill(~full[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m) | torch.isnan(m), m, torch.zeros_like(m))
    w = torch.exp(s - m)
    denom = w.sum(-1, keepdim=True)
    out = (w @ vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.to(q.dtype)


def _tree_configs() -> list:
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # Trees are small (N <= a few hundred nodes), prefixes long: short query blocks, long key blocks. Of the
    # six shapes this list had, only 32 x 128 with 8 warps compiled without register spills on both sm_80 and
    # sm_90 at D = 128 (the others spilled 12-552 bytes on one or both, `python -m labsrc.gpucheck
    # --compile-only`); 16 x 64 with 4 warps was clean on sm_80 only.
    shapes = [(32, 128, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@triton.autotune(
    configs=_tree_configs(), key=["N_BUCKET", "P_BUCKET", "BLOCK_D", "PRECISION"]
)
@triton.jit
def _tree_attention_kernel(
    Q,
    K,
    V,
    MASK,
    O,
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
    stride_mb,
    Hq,
    N,
    P,
    D,
    GROUP,
    qk_scale,
    N_BUCKET,
    P_BUCKET,  # autotuning keys only
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = BLOCK_M tree nodes (queries) of one (batch, query head).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    hkv = hq // GROUP

    # tree node indices of this block's queries
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m_valid = offs_m < N

    q = tl.load(
        Q
        + b * stride_qb
        + hq * stride_qh
        + offs_m[:, None] * stride_qm
        + offs_d[None, :],
        mask=m_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    mask_base = MASK + b * stride_mb

    # Phase 1: the cached prefix. Every node sees every prefix key: only the ragged end
    # is masked.
    for start_n in range(0, P, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < P) & d_mask[None, :]
        k = tl.load(
            k_base + offs_n[:, None] * stride_kn + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(offs_n[None, :] < P, s, float("-inf"))
        m_new, l_i, alpha, p = _online_softmax_step(m_i, l_i, s)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # Phase 2: the tree's own keys (positions P .. P + N - 1), visible only along the
    # ancestor mask.
    for start_t in range(0, N, BLOCK_N):
        # tree node indices of this key block
        offs_t = start_t + offs_n0
        t_valid = offs_t < N
        kv_mask = t_valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + (P + offs_t)[:, None] * stride_kn + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_base + (P + offs_t)[:, None] * stride_vn + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        anc = tl.load(mask_base + offs_m[:, None] * N + offs_t[None, :],
                      mask=m_valid[:, None] & t_valid[None, :], other=0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(anc != 0, s, float("-inf"))
        m_new, l_i, alpha, p = _online_softmax_step(m_i, l_i, s)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out, _lse2 = _softmax_finish(acc, l_i, m_i)
    tl.store(
        O
        + b * stride_ob
        + hq * stride_oh
        + offs_m[:, None] * stride_om
        + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=m_valid[:, None] & d_mask[None, :],
    )


def tree_attention(q, k, v, tree_mask, sm_scale=None, out=None):
    """Attention of ``N`` tree nodes to a cached prefix and to their own ancestors, in one launch.

    Args:
        q: ``(B, Hq, N, D)``, float32/float16/bfloat16, 16 <= D <= 128; any strides with a contiguous head dim.
        k, v: ``(B, Hkv, P + N, D)`` in q's dtype: ``P`` prefix keys then the tree's ``N`` keys; ``Hq % Hkv == 0``.
        tree_mask: ``(N, N)`` or ``(B, N, N)`` bool or 0/1 integers, ``[i, j]`` true when node ``j`` is node ``i``
            or an ancestor of it (any strides: it is packed to contiguous int8 before the launch).
        sm_scale: factor on the scores, ``1/sqrt(D)`` by default.
        out: optional ``(B, Hq, N, D)`` buffer in q's dtype to write into (not an expanded view).

    Returns ``(B, Hq, N, D)`` in q's dtype. Inference only (refuses inputs that require grad).
    """
    _check_tree_args(q, k, v, tree_mask, sm_scale, out)
    B, Hq, N, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    P = T - N
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if not HAS_TRITON:
        out.copy_(tree_attention_ref(q, k, v, tree_mask, sm_scale))
        return out
    mask = _kernel_operand(tree_mask.to(torch.bool).expand(B, N, N) if tree_mask.dim() == 2
                           else tree_mask.to(torch.bool), torch.int8)
    upcast, precision = _launch_flags(q.dtype)
    qk_scale = _default_scale(D, sm_scale) * LOG2E
    for b0, b1 in _batch_chunks(B, Hq):
        def grid(meta, nb=b1 - b0):
            return (triton.cdiv(N, meta["BLOCK_M"]), nb * Hq)

        _tree_attention_kernel[grid](
            q[b0:b1], k[b0:b1], v[b0:b1], mask[b0:b1], out[b0:b1],
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            mask.stride(0),
            Hq, N, P, D, Hq // Hkv, qk_scale,
            triton.next_power_of_2(N), triton.next_power_of_2(max(P, 1)),
            UPCAST=upcast, PRECISION=precision,
            BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return out
