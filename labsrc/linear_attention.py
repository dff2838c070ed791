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
import numbers

import torch
import torch.nn.functional as F

from labsrc.decay import segsum

__all__ = ["FEATURE_MAPS", "phi", "linear_attention", "softmax_attention", "orthogonal_projection",
           "performer_features", "favor_attention", "linear_attention_recurrent", "lightning_attention",
           "gated_delta_rule_recurrent", "gated_delta_rule_chunked", "check_linear_inputs",
           "check_delta_inputs", "state_bytes", "fla_naive"]

FEATURE_MAPS = ("elu1", "relu", "identity")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, T, H, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; put all tensors on one device")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, T, H, V) with B, T, H of q {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    if min(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) < 1:
        raise ValueError(f"B, H, K and V must be positive, got q {tuple(q.shape)} and v {tuple(v.shape)}")


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

def _check_chunk(chunk_size, name="chunk_size"):
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{name} must be a positive int, got {chunk_size!r}")


def _check_scale(scale):
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number or None, got {scale!r}")


def _check_state(initial_state, q, v):
    if initial_state is None:
        return
    if not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"initial_state must be a torch.Tensor or None, got {type(initial_state).__name__}")
    B, _, H, K = q.shape
    shape = (B, H, K, v.shape[-1])
    if tuple(initial_state.shape) != shape:
        raise ValueError(f"initial_state must have shape (B, H, K, V) = {shape}, got {tuple(initial_state.shape)}")
    if initial_state.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"initial_state must be float32 (or float64), got {initial_state.dtype}")
    if initial_state.device != q.device:
        raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_linear_inputs(q, k, v, decay, scale, initial_state, output_final_state, chunk_size=1,
                        chunk_name="chunk_size"):
    """The checks shared by :func:`linear_attention_recurrent`, :func:`lightning_attention` and the kernel
    ``chunk_linear_attention``: shapes ``(B, T, H, K)``/``(B, T, H, V)``, one float dtype, ``decay`` a
    ``(H,)`` tensor of per-step decays in ``(0, 1]`` (or None), ``scale`` positive, the state ``(B, H, K, V)``."""
    _check_qkv(q, k, v)
    if decay is not None:
        if not isinstance(decay, torch.Tensor):
            raise TypeError(f"decay must be a torch.Tensor of shape (H,) or None, got {type(decay).__name__}")
        if tuple(decay.shape) != (q.shape[2],):
            raise ValueError(f"decay must have shape (H,) = ({q.shape[2]},), got {tuple(decay.shape)}")
        if not decay.is_floating_point():
            raise TypeError(f"decay must be a float tensor, got {decay.dtype}")
        if decay.device != q.device:
            raise ValueError(f"decay is on {decay.device} but q is on {q.device}")
        if bool(((decay <= 0) | (decay > 1)).any()):
            raise ValueError("decay must lie in (0, 1] (the factor the state is multiplied by per step)")
    _check_scale(scale)
    _check_state(initial_state, q, v)
    _check_flag("output_final_state", output_final_state)
    _check_chunk(chunk_size, chunk_name)


def check_delta_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size=1):
    """The checks shared by the gated-delta-rule references and the kernel ``chunk_gated_delta_rule``:
    ``g`` and ``beta`` ``(B, T, H)`` float tensors, ``g <= 0`` (the log of the decay), ``beta`` in ``[0, 1]``
    (NaN passes the checks and propagates, as in the reference), plus the checks of
    :func:`check_linear_inputs`."""
    _check_qkv(q, k, v)
    for name, t in (("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, T, H), got {type(t).__name__}")
        if tuple(t.shape) != tuple(q.shape[:3]):
            raise ValueError(f"{name} must have shape (B, T, H) = {tuple(q.shape[:3])}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if bool((g > 0).any()):
        raise ValueError("g must be <= 0: it is the log of the decay alpha = exp(g) in (0, 1]")
    if bool(((beta < 0) | (beta > 1)).any()):
        raise ValueError("beta must lie in [0, 1] (the delta rule's step size)")
    _check_scale(scale)
    _check_state(initial_state, q, v)
    _check_flag("output_final_state", output_final_state)
    _check_chunk(chunk_size)


def _work(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _init_state(initial_state, q, v, work):
    B, _, H, K = q.shape
    if initial_state is None:
        return torch.zeros(B, H, K, v.shape[-1], dtype=work, device=q.device)
    return initial_state.to(work).clone()


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


def lightning_attention(q, k, v, decay=None, block_size: int = 64, scale: float = 1.0, initial_state=None,
                        output_final_state: bool = False):
    """:func:`linear_attention_recurrent` block by block (Lightning attention, Qin et al.): inside a block of
    ``n`` tokens the output is a masked ``n x n`` product with decay ``lambda^(i-j)`` (intra-block), plus the
    state carried in from earlier blocks, decayed by ``lambda^(i+1)`` (inter-block); the state then advances
    once per block. No cumulative sum over the whole sequence is ever formed, and the decays between two
    positions are segment sums (:func:`labsrc.decay.segsum`), exact for the smallest decays a float holds.
    Same arguments and results."""
    check_linear_inputs(q, k, v, decay, scale, initial_state, output_final_state, block_size, "block_size")
    work = _work(q)
    B, T, H, K = q.shape
    S = _init_state(initial_state, q, v, work)
    log_lam = (torch.zeros(H, dtype=work, device=q.device) if decay is None else decay.to(work).log())
    qs, ks, vs = (x.to(work).transpose(1, 2) for x in (q, k, v))         # (B, H, T, D)
    qs = qs * scale
    out = []
    for s in range(0, T, block_size):
        qb, kb, vb = qs[:, :, s:s + block_size], ks[:, :, s:s + block_size], vs[:, :, s:s + block_size]
        n = qb.shape[2]
        steps = log_lam[:, None].expand(H, n)                       # (H, n): log lambda per step
        gam = steps.cumsum(-1)                                      # log lambda^(i+1)
        seg = segsum(steps)                                         # log lambda^(i-j), -inf above the diagonal
        intra = ((qb @ kb.transpose(-1, -2)) * seg.exp()) @ vb
        inter = (qb * gam.exp()[None, :, :, None]) @ S
        out.append(intra + inter)
        S = (S * gam[:, -1].exp()[None, :, None, None]
             + (kb * seg[:, -1].exp()[None, :, :, None]).transpose(-1, -2) @ vb)
    o = torch.cat(out, 2).transpose(1, 2).to(v.dtype)
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


def gated_delta_rule_chunked(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                             output_final_state: bool = False, chunk_size: int = 64):
    """:func:`gated_delta_rule_recurrent` chunk by chunk (the WY/UT form of Yang et al.), same arguments and
    results.

    Inside a chunk, with ``gamma_i`` the cumulative log decay from the chunk's start to token ``i``:

    * ``A = strictly_lower(diag(beta) K K^T * exp(gamma_i - gamma_j))`` and ``T = (I + A)^{-1}`` (the UT
      transform: one triangular solve replaces the token-by-token recursion);
    * ``W = T diag(beta exp(gamma)) K`` and ``U = T diag(beta) V``; the chunk's corrected values are
      ``V_new = U - W S`` given the state ``S`` carried in;
    * ``O = diag(exp(gamma)) Q S + lower(Q K^T * exp(gamma_i - gamma_j)) V_new``;
    * ``S <- exp(gamma_last) S + (K * exp(gamma_last - gamma))^T V_new``.

    The factors ``exp(gamma_i - gamma_j)`` and ``exp(gamma_last - gamma)`` are computed from segment sums of
    ``g`` (:func:`labsrc.decay.segsum`), never as differences of the cumulative sums: after one very negative
    ``g`` those lose every later small ``g`` in float32 spacing. ``g = -inf`` is a decay of exactly zero: the
    state is reset, as in the recurrent form. The last chunk may be shorter (any ``T >= 1``); nothing is
    padded. A NaN in an input reaches every output
    of its chunk (the chunk's products mix all its tokens, and 0 * NaN is NaN) and every later output of
    its head, where the recurrent form only reaches the later ones.
    """
    check_delta_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    work = _work(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, T, H, K = q.shape
    S = _init_state(initial_state, q, v, work)
    qs, ks, vs = (x.to(work).transpose(1, 2) for x in (q, k, v))        # (B, H, T, D)
    qs = qs * scale
    gs, bs = (x.to(work).transpose(1, 2) for x in (g, beta))            # (B, H, T)
    out = []
    for s in range(0, T, chunk_size):
        qc, kc, vc = qs[:, :, s:s + chunk_size], ks[:, :, s:s + chunk_size], vs[:, :, s:s + chunk_size]
        bc = bs[:, :, s:s + chunk_size]
        gc = gs[:, :, s:s + chunk_size]
        gam = gc.cumsum(-1)                                            # (B, H, n)
        n = qc.shape[2]
        seg = segsum(gc)                                               # gamma_i - gamma_j, summed directly
        decay = seg.exp()                                              # 0 above the diagonal
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        strict = torch.eye(n, dtype=torch.bool, device=q.device).logical_not() & lower
        a = torch.where(strict, (bc[..., None] * kc) @ kc.transpose(-1, -2) * decay, torch.zeros_like(decay))
        eye = torch.eye(n, dtype=work, device=q.device).expand_as(a)
        tmat = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)   # (I + A)^-1
        w = tmat @ (kc * (bc * gam.exp())[..., None])
        u = tmat @ (vc * bc[..., None])
        v_new = u - w @ S
        o = (qc * gam.exp()[..., None]) @ S + ((qc @ kc.transpose(-1, -2)) * decay) @ v_new
        out.append(o)
        S = S * gam[..., -1].exp()[..., None, None] + (kc * seg[..., -1, :].exp()[..., None]).transpose(-1, -2) @ v_new
    o = torch.cat(out, 2).transpose(1, 2).to(v.dtype)
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
