"""The plain PyTorch references the kernels are tested against: attention, its backward, and decoding
against a cache. They refuse what the kernels refuse (the checks of :mod:`.common`), but take float64 and
any device.
"""
from __future__ import annotations

import torch

from labsrc.kernels.flash_attention.common import (_check_attention_args, _check_decode_args, _check_grad_out,
                                                   _default_scale)


# ----------------------------------------------------------------------------------------------------------------
# Plain PyTorch references: the definition the kernels are tested against.
# ----------------------------------------------------------------------------------------------------------------
def flash_attention_ref(q, k, v, causal=False, sm_scale=None, return_lse=False):
    """Attention written the obvious way: build the full score matrix, mask it, softmax it.

    Args:
        q: queries ``(B, Hq, Tq, D)``.
        k, v: keys and values ``(B, Hkv, Tk, D)`` with ``Hq % Hkv == 0`` (grouped-query attention).
        causal: mask so that query ``i`` sees keys ``j <= i + (Tk - Tq)`` (bottom-right aligned).
        sm_scale: the factor applied to ``q @ k^T``; ``1 / sqrt(D)`` by default.
        return_lse: also return the log-sum-exp of each row of scaled scores, ``(B, Hq, Tq)`` in fp32.

    Returns:
        The output ``(B, Hq, Tq, D)`` in ``q.dtype`` (and the log-sum-exp). The arithmetic is fp32 (fp64 for
        fp64 inputs, which only the reference accepts: tests use it as ground truth); a row that sees no key
        (causal with ``Tq > Tk``) gives output 0 and log-sum-exp ``-inf``.
    """
    _check_attention_args(q, k, v, causal, sm_scale, None, None, need_kernel_device=False, allow_float64=True)
    scale = _default_scale(q.shape[-1], sm_scale)
    group = q.shape[1] // k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    # The reference may repeat K/V: it is the definition, not the fast path.
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    if causal:
        tq, tk = q.shape[2], k.shape[2]
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (tk - tq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no visible key
    # exp(s - lse) is the softmax; for an empty row use 0 instead of exp(-inf - -inf) = nan.
    finite = torch.isfinite(lse)
    probs = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    out = (probs @ vf).to(q.dtype)
    return (out, lse) if return_lse else out


def flash_attention_backward_ref(dout, q, k, v, causal=False, sm_scale=None, return_bounds=False):
    """The gradients of attention written out by hand: the formulas the backward kernels implement.

    With ``S = q k^T * scale``, ``P = softmax(S)`` (masked keys and rows that see no key give ``P = 0``),
    ``O = P v`` and the incoming gradient ``dO``:

    * ``dV = P^T dO``
    * ``dP = dO V^T``
    * ``dS = P * (dP - delta)`` with ``delta_i = sum_j P_ij dP_ij = rowsum(dO_i * O_i)`` (the softmax
      Jacobian applied row by row)
    * ``dQ = dS K * scale`` and ``dK = dS^T Q * scale``

    With grouped-query attention a K/V head serves ``Hq // Hkv`` query heads, so its ``dK`` and ``dV`` are the
    sums over those heads.

    Args:
        dout: the gradient of the output ``(B, Hq, Tq, D)``.
        q, k, v, causal, sm_scale: as for :func:`flash_attention_ref`.
        return_bounds: also return, for each gradient, the sum of the magnitudes of the terms it adds up
            (same shapes, in the compute dtype). Each gradient is a long sum whose terms cancel (with a single
            key dq is exactly 0), so its rounding error is relative to this bound, not to the result: tests
            and the bench compare gradients as ``|got - truth| <= atol + rtol * (bound + |truth|)``. The
            bounds are ``scale * (P (|dO| |V|^T + delta')) |K|`` for dq, the transposed form with ``|Q|`` for
            dk, and ``P^T |dO|`` for dv, where ``delta'_i = sum_d |dO_id O_id|`` bounds delta's own error
            (a cancelling sum, computed from O rounded to the input dtype, as FlashAttention does).

    Returns:
        ``(dq, dk, dv)`` in the dtypes of ``q, k, v``, computed in fp32 (fp64 for fp64 inputs); with
        ``return_bounds``, ``((dq, dk, dv), (bound_dq, bound_dk, bound_dv))``.
    """
    _check_attention_args(q, k, v, causal, sm_scale, None, None, need_kernel_device=False, allow_float64=True)
    _check_grad_out(dout, q)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = _default_scale(D, sm_scale)
    group = Hq // Hkv
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, dof = q.to(compute), k.to(compute), v.to(compute), dout.to(compute)
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (Tk - Tq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    out = probs @ vf
    dv = probs.transpose(-1, -2) @ dof  # (B, Hq, Tk, D): one term per query head
    dp = dof @ vf.transpose(-1, -2)
    delta = (dof * out).sum(-1, keepdim=True)
    ds = probs * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    # Grouped-query attention: sum the per-query-head terms of each K/V head.
    dk = dk.view(B, Hkv, group, Tk, D).sum(2)
    dv = dv.view(B, Hkv, group, Tk, D).sum(2)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if not return_bounds:
        return grads
    terms = probs * (dof.abs() @ vf.abs().transpose(-1, -2) + (dof * out).abs().sum(-1, keepdim=True))
    bounds = ((terms @ kf.abs()) * scale,
              ((terms.transpose(-1, -2) @ qf.abs()) * scale).view(B, Hkv, group, Tk, D).sum(2),
              (probs.transpose(-1, -2) @ dof.abs()).view(B, Hkv, group, Tk, D).sum(2))
    return grads, bounds


def decode_attention_ref(q, k_cache, v_cache, seq_lens, sm_scale=None):
    """One query per sequence against the first ``seq_lens[b]`` cached keys of sequence ``b``.

    Args:
        q: the new queries ``(B, Hq, D)``.
        k_cache, v_cache: ``(B, Hkv, Tmax, D)``; only the first ``seq_lens[b]`` positions of row ``b`` count.
        seq_lens: ``(B,)`` integer lengths in ``[1, Tmax]``.
        sm_scale: the factor applied to ``q @ k^T``; ``1 / sqrt(D)`` by default.

    Returns:
        ``(B, Hq, D)`` in ``q.dtype``, computed one sequence at a time in fp32 (fp64 for fp64 inputs).
    """
    _check_decode_args(q, k_cache, v_cache, seq_lens, sm_scale, None, None, need_kernel_device=False,
                       allow_float64=True)
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        qb = q[b : b + 1, :, None, :]
        outs.append(flash_attention_ref(qb, k_cache[b : b + 1, :, :n], v_cache[b : b + 1, :, :n], sm_scale=sm_scale))
    return torch.cat(outs)[:, :, 0, :]
