"""Linear attention, random features, Lightning attention and the gated delta rule, from scratch in PyTorch.

Everything here uses flash-linear-attention's layout: queries and keys ``(B, T, H, K)``, values
``(B, T, H, V)``, per-token gates ``(B, T, H)``, recurrent states ``(B, H, K, V)``.

* :func:`phi` -- the feature maps; :func:`linear_attention` -- Katharopoulos et al.'s linear attention: ``exp(q.k)`` replaced by
  ``phi(q).phi(k)``, normalised by ``phi(q).sum_s phi(k_s)`` (no ``1/sqrt(d)`` scale), causal or not.
* :func:`performer_features`, :func:`orthogonal_projection`, :func:`favor_attention` -- Performer's FAVOR+
  random features, positive (``exp``) or trigonometric (``sin``/``cos``), whose inner products estimate the
  softmax kernel ``exp(q.k)`` without bias.
* :func:`linear_attention_recurrent` and :func:`lightning_attention` -- unnormalised causal linear attention
  with an optional per-head decay ``lambda_h`` (RetNet, Lightning attention), ``S_t = lambda S_{t-1} + k_t v_t^T``
  and ``o_t = scale * q_t^T S_t``: token by token, and block by block (intra-block quadratic, inter-block
  through the state).
* :func:`gated_delta_rule_recurrent` and :func:`gated_delta_rule_chunked` -- the gated delta rule
  ``S_t = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T`` with ``alpha_t = exp(g_t)``, token by
  token and chunk by chunk (the WY/UT form), in flash-linear-attention's conventions.

The state is kept ``(K, V)`` (keys index rows), as in flash-linear-attention; the source text writes the same
update for the transposed ``(V, K)`` state, ``S_t = S_{t-1} - beta_t (S_{t-1} k_t - v_t) k_t^T``.
The shared argument checks (:func:`check_linear_inputs`, :func:`check_delta_inputs`) are also the Triton
wrappers' checks in :mod:`labsrc.kernels.linear_attention`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# the chunked forms and the checks live beside their kernels (CONTRIBUTING: kernels import nothing above them)
from labsrc.kernels.linear_attention import (_FLOATS, _check_chunk, _check_flag, _check_qkv, _check_scale,
                                             _check_state, _init_state, _work, check_delta_inputs,
                                             check_linear_inputs, gated_delta_rule_chunked, lightning_attention)

__all__ = ["FEATURE_MAPS", "phi", "linear_attention", "softmax_attention", "orthogonal_projection",
           "performer_features", "favor_attention", "linear_attention_recurrent", "lightning_attention",
           "gated_delta_rule_recurrent", "gated_delta_rule_chunked", "check_linear_inputs",
           "check_delta_inputs", "state_bytes", "fla_naive"]

FEATURE_MAPS = ("elu1", "relu", "identity")
# --------------------------------------------------------------------------------------- linear attention

def phi(x: torch.Tensor, kind: str = "elu1") -> torch.Tensor:
    """``phi(x)``: ``elu(x) + 1`` (Katharopoulos et al., positive), ``relu(x)`` or the identity."""
    if kind == "elu1":
        return F.elu(x) + 1
    if kind == "relu":
        return F.relu(x)
    if kind == "identity":
        return x
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {kind!r}")


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str = "elu1",
                     causal: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Katharopoulos et al.'s normalised linear attention, ``(B, T, H, K)`` queries/keys, ``(B, T, H, V)``
    values: ``o_t = phi(q_t)^T sum_s phi(k_s) v_s^T / (phi(q_t)^T sum_s phi(k_s) + eps)`` over ``s <= t``
    (causal) or all ``s``. No ``1/sqrt(K)`` scale. Computed in float32 (float64 stays float64), returned in
    ``v``'s dtype.

    The causal form is computed here as the masked ``T x T`` product (the quadratic form, a reference); the
    recurrent form is :func:`linear_attention_recurrent` with a value column of ones for the denominator.
    """
    _check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    fq, fk = (phi(x.to(work), feature_map) for x in (q, k))
    vv = v.to(work)
    if causal:
        scores = torch.einsum("bthk,bshk->bhts", fq, fk)
        T = q.shape[1]
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), 0.0)
        num = torch.einsum("bhts,bshv->bthv", scores, vv)
        den = scores.sum(-1).transpose(1, 2)[..., None]
    else:
        kv = torch.einsum("bshk,bshv->bhkv", fk, vv)          # (K x V) per head: the associativity trick
        num = torch.einsum("bthk,bhkv->bthv", fq, kv)
        den = torch.einsum("bthk,bhk->bth", fq, fk.sum(1))[..., None]
    return (num / (den + eps)).to(v.dtype)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      scale: float | None = None) -> torch.Tensor:
    """Softmax attention in the same layout, ``softmax(scale * q k^T) v`` (``scale`` default ``K**-0.5``)."""
    _check_qkv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.einsum("bthk,bshk->bhts", q.to(work), k.to(work)) * scale
    if causal:
        T = q.shape[1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("bhts,bshv->bthv", s.softmax(-1), v.to(work)).to(v.dtype)


# ------------------------------------------------------------------------------------------- Performer

def orthogonal_projection(m: int, d: int, generator: torch.Generator | None = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(m, d)`` random projection for FAVOR+: blocks of ``d`` orthogonal rows (QR of a Gaussian matrix),
    each row rescaled to the norm of a ``d``-dimensional Gaussian vector (chi distribution), so every row is
    marginally ``N(0, I_d)`` while rows within a block are exactly orthogonal."""
    for name, n in (("m", m), ("d", d)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    blocks = []
    for _ in range(-(-m // d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        qmat, r = torch.linalg.qr(g)
        qmat = qmat * torch.sign(torch.diagonal(r))[None, :]      # a Haar-distributed orthogonal matrix
        blocks.append(qmat.T)
    w = torch.cat(blocks)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1)
    return (w * norms[:, None]).to(dtype)


def performer_features(x: torch.Tensor, proj: torch.Tensor, kind: str = "positive") -> torch.Tensor:
    """FAVOR+ features of ``x (..., d)`` with projection ``proj (m, d)`` such that
    ``E[phi(q) . phi(k)] = exp(q . k)`` (the softmax kernel; scale ``q`` and ``k`` by ``d**-0.25`` first for
    ``exp(q.k / sqrt(d))``).

    * ``"positive"``: ``exp(w_i.x - |x|^2/2) / sqrt(m)``, ``m`` features, all positive;
    * ``"trig"``: ``exp(|x|^2/2) [sin(w_i.x), cos(w_i.x)] / sqrt(m)``, ``2m`` features of either sign.

    Computed in float32 (float64 stays float64).
    """
    if kind not in ("positive", "trig"):
        raise ValueError(f"kind must be 'positive' or 'trig', got {kind!r}")
    if not isinstance(proj, torch.Tensor) or proj.dim() != 2 or proj.shape[1] != x.shape[-1]:
        raise ValueError(f"proj must be an (m, d) tensor with d = {x.shape[-1]}, got "
                         f"{tuple(proj.shape) if isinstance(proj, torch.Tensor) else type(proj).__name__}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(work)
    wx = x @ proj.to(work).T
    half_sq = (x * x).sum(-1, keepdim=True) / 2
    m = proj.shape[0]
    if kind == "positive":
        return torch.exp(wx - half_sq) / math.sqrt(m)
    return torch.exp(half_sq) * torch.cat([torch.sin(wx), torch.cos(wx)], -1) / math.sqrt(m)


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, proj: torch.Tensor,
                    kind: str = "positive", causal: bool = False) -> torch.Tensor:
    """Performer's estimate of ``softmax(q k^T / sqrt(d)) v``: :func:`performer_features` of
    ``q / d**0.25`` and ``k / d**0.25`` used as the feature maps of linear attention (no ``eps``)."""
    _check_qkv(q, k, v)
    d = q.shape[-1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    fq = performer_features(q.to(work) * d ** -0.25, proj, kind)
    fk = performer_features(k.to(work) * d ** -0.25, proj, kind)
    vv = v.to(work)
    if causal:
        T = q.shape[1]
        a = torch.einsum("bthm,bshm->bhts", fq, fk)
        a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), 0.0)
        num, den = torch.einsum("bhts,bshv->bthv", a, vv), a.sum(-1).transpose(1, 2)[..., None]
    else:
        num = torch.einsum("bthm,bhmv->bthv", fq, torch.einsum("bshm,bshv->bhmv", fk, vv))
        den = torch.einsum("bthm,bhm->bth", fq, fk.sum(1))[..., None]
    return (num / den).to(v.dtype)


# ------------------------------------------------------------------------------- shared argument checks

# ---------------------------------------------------------------------- decayed linear attention (Lightning)

def linear_attention_recurrent(q, k, v, decay=None, scale: float = 1.0, initial_state=None,
                               output_final_state: bool = False):
    """Causal linear attention as an RNN: ``S_t = lambda_h S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    ``q, k (B, T, H, K)``, ``v (B, T, H, V)``, ``decay (H,)`` in ``(0, 1]`` or None (no decay), state
    ``(B, H, K, V)``. No normaliser (append a column of ones to ``v`` to get Katharopoulos's denominator).
    Returns ``(o, final_state)``: ``o`` in ``v``'s dtype, the state in float32 (float64 for float64 inputs), or
    None unless ``output_final_state``.
    """
    check_linear_inputs(q, k, v, decay, scale, initial_state, output_final_state)
    work = _work(q)
    S = _init_state(initial_state, q, v, work)
    lam = torch.ones(q.shape[2], dtype=work, device=q.device) if decay is None else decay.to(work)
    qs, ks, vs = q.to(work) * scale, k.to(work), v.to(work)
    out = []
    for t in range(q.shape[1]):
        S = lam[None, :, None, None] * S + ks[:, t, :, :, None] * vs[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", qs[:, t], S))
    o = torch.stack(out, 1).to(v.dtype)
    return o, (S if output_final_state else None)


# ------------------------------------------------------------------------------------- gated delta rule

def gated_delta_rule_recurrent(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                               output_final_state: bool = False):
    """The gated delta rule token by token, in flash-linear-attention's conventions.

    For each head, with the state ``S (K, V)``::

        S   <- exp(g_t) * S                        # gate (forget)
        S   <- S + beta_t * k_t (v_t - S^T k_t)^T   # one step of online regression of v on k
        o_t  = S^T (scale * q_t)

    ``q, k (B, T, H, K)``, ``v (B, T, H, V)``, ``g (B, T, H)`` the log of the decay (``<= 0``; ``-inf`` is a
    decay of exactly zero, a reset of the state), ``beta
    (B, T, H)`` in ``[0, 1]``, ``scale`` default ``K ** -0.5``, state ``(B, H, K, V)``. Any ``T >= 1``.
    Returns ``(o, final_state)``: ``o`` in ``v``'s dtype, the state float32 (float64 for float64 inputs) or
    None unless ``output_final_state``. The keys are used as given (flash-linear-attention's layers
    L2-normalise them first, which keeps ``|k| = 1`` and the update a contraction).
    """
    check_delta_inputs(q, k, v, g, beta, scale, initial_state, output_final_state)
    work = _work(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = _init_state(initial_state, q, v, work)
    qs, ks, vs = q.to(work) * scale, k.to(work), v.to(work)
    alpha, bt = g.to(work).exp(), beta.to(work)
    out = []
    for t in range(q.shape[1]):
        kt = ks[:, t]
        S = alpha[:, t, :, None, None] * S
        err = vs[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt)              # what S predicts for k_t, wrong by
        S = S + bt[:, t, :, None, None] * kt[..., None] * err[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", qs[:, t], S))
    o = torch.stack(out, 1).to(v.dtype)
    return o, (S if output_final_state else None)


# ------------------------------------------------------------------------------------------- arithmetic

def state_bytes(kind: str, *, n_heads: int, head_dim: int, value_dim: int | None = None, n_kv_heads=None,
                tokens: int = 1, bytes_per_element: float = 2.0, state_bytes_per_element: float = 4.0) -> float:
    """Bytes one layer keeps per sequence after ``tokens`` tokens: a softmax layer's KV cache grows,
    ``2 * n_kv_heads * head_dim * tokens * bytes_per_element``; a linear/delta layer's state does not,
    ``n_heads * head_dim * value_dim * state_bytes_per_element`` (fp32 states)."""
    if kind == "softmax":
        kv = n_heads if n_kv_heads is None else n_kv_heads
        return 2.0 * kv * head_dim * tokens * bytes_per_element
    if kind == "linear":
        return float(n_heads * head_dim * (head_dim if value_dim is None else value_dim) * state_bytes_per_element)
    raise ValueError(f"kind must be 'softmax' or 'linear', got {kind!r}")


def fla_naive(*, missing_ok: bool = False):
    """flash-linear-attention's own PyTorch references (code we did not write), imported quietly:
    ``(naive_recurrent_gated_delta_rule, naive_chunk_gated_delta_rule)``. Note their argument orders differ:
    the recurrent one takes ``(q, k, v, beta, g, ...)``, the chunked one ``(q, k, v, g, beta, chunk_size, ...)``.

    fla-core imports Triton, which has Linux wheels only: on macOS and Windows the import fails. With
    ``missing_ok=True`` this returns ``None`` then, so that a chapter can skip the comparison and say so.

    Importing ``fla`` on a machine without a GPU warns that Triton "is not supported on current platform, roll
    back to CPU" (true and expected here: only the naive references are used, which are plain PyTorch), that
    flash-attn is not installed (used by fla's NSA module, not by these references), and torch warns about
    fla's use of ``torch.jit.script_method``. Those three warnings, and only those, are silenced for the
    import. Raises ``ImportError`` when fla-core (the ``dev`` extra) is not installed.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform",
                                category=UserWarning)
        warnings.filterwarnings("ignore", message="Flash Attention is not installed", category=ImportWarning)
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        try:
            from fla.ops.gated_delta_rule.naive import (naive_chunk_gated_delta_rule,
                                                        naive_recurrent_gated_delta_rule)
        except ImportError:
            if missing_ok:
                return None
            raise
    return naive_recurrent_gated_delta_rule, naive_chunk_gated_delta_rule
