"""Chunked linear attention and the chunked gated delta rule in Triton, with their PyTorch references beside.

* :func:`chunk_linear_attention` -- causal linear attention with an optional per-head decay (Lightning
  attention, RetNet): ``S_t = lambda_h S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``; equal to
  :func:`labsrc.linear_attention.lightning_attention`.
* :func:`chunk_gated_delta_rule` -- the gated delta rule of Gated DeltaNet, in flash-linear-attention's
  conventions; equal to :func:`labsrc.linear_attention.gated_delta_rule_chunked`.

Both kernels use one program per (value block, batch x head): it owns the ``BLOCK_K x BLOCK_V`` slice of the
fp32 state and walks the sequence one chunk of ``BLOCK_T`` tokens at a time. Columns of the state never mix
(every update is ``S <- a S + K^T X`` with a row-wise ``X``), so splitting the value dimension over programs
needs no communication; each program recomputes the chunk's ``T x T`` matrices for its block. The state lives
in the float32 buffer that is returned as the final state (started from a copy of ``initial_state``, or
zeros), not in registers: every product over ``K`` runs in an inner loop over ``BLOCK_KB = 16`` rows of the
state (columns of ``q`` and ``k``), and the update writes the slice back, one block of rows at a time, with a
barrier between the reads and the writes of a chunk. Held whole in registers, a 128-row state and the
operands of the products over it spilled on every configuration (``python -m labsrc.gpucheck
--compile-only``); re-read per chunk it comes from L2. Per chunk, with ``gamma`` the cumulative log decay
inside the chunk (``tl.cumsum``):

* intra-chunk: ``lower(Q K^T * exp(gamma_i - gamma_j)) X``, a masked ``BLOCK_T x BLOCK_T`` product
  (``tl.dot``, the quadratic part);
* inter-chunk: ``(Q * exp(gamma)) S``, the state carried in (``tl.dot``);
* the state update ``S <- exp(gamma_last) S + (K * exp(gamma_last - gamma))^T X``.

The differences ``gamma_i - gamma_j`` are never computed as differences: a ``tl.cumsum`` down the columns of
a masked tile sums each segment of log decays directly (:func:`labsrc.kernels._decay.chunk_segsum`), so a
very negative gate does not wipe out the small ones after it, and ``g = -inf`` (a decay of exactly zero)
resets the state as in the recurrence instead of giving NaN.

For linear attention ``X = V``. For the delta rule ``X`` is the chunk's corrected values
``V_new = T (beta V) - T (beta exp(gamma) K) S`` with ``T = (I + A)^{-1}``, ``A`` the strictly lower triangle
of ``diag(beta) K K^T * exp(gamma_i - gamma_j)``. ``A`` is nilpotent (``A^BLOCK_T = 0``), so the inverse is the
finite series ``sum_i (-A)^i``, which the kernel forms as the product ``(I - A)(I + A^2)(I + A^4)...``:
``log2(BLOCK_T)`` pairs of matrix products on the tensor cores instead of ``BLOCK_T`` dependent row updates.

Inputs may be fp32, fp16 or bf16. Float32 inputs multiply in true fp32 (``input_precision="ieee"``; the
series above amplifies TF32 rounding). Half inputs run on the 16-bit tensor cores with products accurate to
about ``2^-16`` (:mod:`labsrc.kernels._dots`): ``q``, ``k``, ``v`` stay as loaded and are exact operands, and
each computed factor (scores, the state, the series' powers, the corrected values) is split into a 16-bit
high and low part. Outputs have ``v``'s dtype, states are fp32. NaN or inf in an input propagate as in the
reference (a NaN in a chunk spreads to the state and to every later output of that head). The kernels are
inference kernels: inputs that require grad are refused. Without Triton the wrappers check their arguments
and call the references.
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import runtime
from labsrc.decay import segsum
from labsrc.kernels._decay import chunk_segsum, last_row
from labsrc.kernels._dots import exact_dot, split_dot, split_dot2, split_dot_b
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["chunk_linear_attention", "chunk_gated_delta_rule", "chunk_linear_attention_ref",
           "chunk_gated_delta_rule_ref"]

# -------------------------------------------------- the references, in plain PyTorch (chapter 8 builds them)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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


# The references the kernels are checked against: the chunked forms above.
chunk_linear_attention_ref = lightning_attention
chunk_gated_delta_rule_ref = gated_delta_rule_chunked

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_GRID_AXIS = 65535          # grid axes 1 and 2
_MAX_DIM = 256                  # K and V: the largest head dims the kernels are built and tested for
_MAX_CHUNK = 128
_BLOCK_KB = 16                  # state rows per step of the inner loops (registers: see _configs)


def _configs() -> list:
    """One configuration under the interpreter (no benchmarking there); on a GPU the warps that share a
    program's tiles are tuned per tile shape.

    One software-pipeline stage: the state is read and written through memory inside the chunk loop, so no
    load of it may be prefetched across a chunk. What fits in registers (``python -m labsrc.gpucheck
    --compile-only``, K = V = 128): with chunks of 32 tokens and 16 state rows per inner step both kernels
    compile without spills on sm_80 and sm_90 at 4 and 8 warps. Chunks of 64 spilled in every shape tried
    (the gated delta rule 300 bytes to 2 KB, linear attention up to 660 bytes at 4 warps), and so did the
    earlier form that held the whole 128-row state in registers (up to 45 KB): the GPU profile runs chunks of
    32 (:mod:`labsrc.bench.linear_attention`), the results being the same up to rounding.
    """
    if runtime.INTERPRETED:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=1) for w in (4, 8)]


@triton.jit
def _state_block(s_ptr, i_bh, kb, offs_kb, offs_v, K, V):
    """Pointers to and mask of rows ``kb + offs_kb`` of this program's state slice ``S[:, v-block]``."""
    rows = kb + offs_kb
    ptrs = s_ptr + i_bh.to(tl.int64) * K * V + rows[:, None] * V + offs_v[None, :]
    return ptrs, (rows[:, None] < K) & (offs_v[None, :] < V)


@triton.autotune(configs=_configs(), key=["BLOCK_T", "BLOCK_K", "BLOCK_V"])
@triton.jit
def _chunk_linear_attention_kernel(
        q_ptr, k_ptr, v_ptr, log_lam_ptr, s_ptr, o_ptr,
        T, H, K, V, scale,
        s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh,
        HAS_DECAY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KB: tl.constexpr,
        BLOCK_V: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // H).to(tl.int64)
    h = (i_bh % H).to(tl.int64)
    offs_kb = tl.arange(0, BLOCK_KB)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < V
    log_lam = 0.0
    if HAS_DECAY:
        log_lam = tl.load(log_lam_ptr + h)          # log(lambda_h), -inf for a decay of 0
    rows = tl.arange(0, BLOCK_T)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + rows
        mt = t < T
        tok = b * s_qb + t[:, None].to(tl.int64) * s_qt + h * s_qh          # row starts of q and k
        v_off = b * s_vb + t[:, None].to(tl.int64) * s_vt + h * s_vh + offs_v[None, :]
        v = tl.load(v_ptr + v_off, mask=mt[:, None] & mv[None, :], other=0.0)   # input dtype, as loaded
        # gamma_i = (i + 1) log(lambda) for the tokens of this chunk; padded rows add no decay
        steps = tl.where(mt, log_lam, 0.0)
        gam = tl.cumsum(steps, 0)
        seg = chunk_segsum(steps, BLOCK_T)             # gamma_i - gamma_j, summed directly (-inf above)
        # the products over K, BLOCK_KB columns of q and k (and rows of S) at a time:
        # scores = q k^T and (q S)^T = S^T q^T (q, k as loaded: the second operands, see _dots)
        scores = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        qs_t = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
        for kb in range(0, BLOCK_K, BLOCK_KB):
            mtk = mt[:, None] & (kb + offs_kb < K)[None, :]
            q = tl.load(q_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            k = tl.load(k_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            s_ptrs, s_mask = _state_block(s_ptr, i_bh, kb, offs_kb, offs_v, K, V)
            S = tl.load(s_ptrs, mask=s_mask, other=0.0)
            scores += exact_dot(q, tl.trans(k), UPCAST, PRECISION)
            qs_t = split_dot(tl.trans(S), tl.trans(q), qs_t, SPLIT, UPCAST, PRECISION)
        o = split_dot(scores * (tl.exp(seg) * scale), v, tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32),
                      SPLIT, UPCAST, PRECISION)                               # intra-chunk
        o += tl.trans(qs_t) * (tl.exp(gam) * scale)[:, None]                 # inter-chunk
        o_off = b * s_ob + t[:, None].to(tl.int64) * s_ot + h * s_oh + offs_v[None, :]
        tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        # the state update S <- lambda^C S + (K * lambda^(C-1-j))^T V, block of rows by block of rows
        w_end = tl.exp(last_row(seg, BLOCK_T))
        chunk_decay = tl.exp(tl.sum(steps, 0))
        tl.debug_barrier()                         # every thread has read the state before any writes it
        for kb in range(0, BLOCK_K, BLOCK_KB):
            mtk = mt[:, None] & (kb + offs_kb < K)[None, :]
            k = tl.load(k_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            s_ptrs, s_mask = _state_block(s_ptr, i_bh, kb, offs_kb, offs_v, K, V)
            S = tl.load(s_ptrs, mask=s_mask, other=0.0)
            S = split_dot(tl.trans(k.to(tl.float32) * w_end[:, None]), v, S * chunk_decay, SPLIT, UPCAST, PRECISION)
            tl.store(s_ptrs, S, mask=s_mask)
        tl.debug_barrier()                         # the next chunk reads the state this one wrote


@triton.autotune(configs=_configs(), key=["BLOCK_T", "BLOCK_K", "BLOCK_V"])
@triton.jit
def _chunk_gated_delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    s_ptr,
    o_ptr,
    T,
    H,
    K,
    V,
    scale,
    s_qb,
    s_qt,
    s_qh,
    s_vb,
    s_vt,
    s_vh,
    s_gb,
    s_gt,
    s_gh,
    s_bb,
    s_bt,
    s_bh,
    s_ob,
    s_ot,
    s_oh,
    LOG2_T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)  # a block of BLOCK_V value columns
    i_bh = tl.program_id(1)  # one (batch, head)
    b = (i_bh // H).to(tl.int64)
    h = (i_bh % H).to(tl.int64)
    offs_kb = tl.arange(0, BLOCK_KB)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < V
    rows = tl.arange(0, BLOCK_T)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + rows
        mt = t < T
        t64 = t.to(tl.int64)
        tok = b * s_qb + t64[:, None] * s_qt + h * s_qh  # row starts of q and k
        v_off = b * s_vb + t64[:, None] * s_vt + h * s_vh + offs_v[None, :]
        # input dtype, as loaded
        v = tl.load(v_ptr + v_off, mask=mt[:, None] & mv[None, :], other=0.0)
        # padded rows: g = 0 (no decay) and beta = 0 (no write) change nothing
        g = tl.load(g_ptr + b * s_gb + t64 * s_gt + h * s_gh, mask=mt, other=0.0)
        beta = tl.load(beta_ptr + b * s_bb + t64 * s_bt + h * s_bh, mask=mt, other=0.0)
        g, beta = g.to(tl.float32), beta.to(tl.float32)
        gam = tl.cumsum(g, 0)  # log decay from the chunk's start
        # gamma_i - gamma_j, summed directly (-inf above the diagonal)
        seg = chunk_segsum(g, BLOCK_T)
        decay = tl.exp(seg)
        # the products over K, BLOCK_KB columns of k (and rows of S) at a time: K K^T
        # and (K S)^T = S^T K^T (k as loaded is the second operand, see _dots)
        kk = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        ks_t = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
        for kb in range(0, BLOCK_K, BLOCK_KB):
            mtk = mt[:, None] & (kb + offs_kb < K)[None, :]
            k = tl.load(k_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            s_ptrs, s_mask = _state_block(s_ptr, i_bh, kb, offs_kb, offs_v, K, V)
            S = tl.load(s_ptrs, mask=s_mask, other=0.0)
            kk += exact_dot(k, tl.trans(k), UPCAST, PRECISION)
            ks_t = split_dot(tl.trans(S), tl.trans(k), ks_t, SPLIT, UPCAST, PRECISION)
        # the UT transform T = (I + A)^-1, A = strict lower part of diag(beta) K K^T o
        # decay; A^BLOCK_T = 0, so T = (I - A)(I + A^2)(I + A^4)... (LOG2_T factors)
        neg_a = -tl.where(
            rows[:, None] > rows[None, :], kk * beta[:, None] * decay, 0.0
        )
        inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0) + neg_a
        power = neg_a
        for _ in tl.static_range(LOG2_T - 1):
            power = split_dot2(
                power,
                power,
                tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32),
                SPLIT,
                UPCAST,
                PRECISION,
            )
            inv = split_dot2(inv, power, inv, SPLIT, UPCAST, PRECISION)
        # corrected values: V_new = T (beta V) - T (beta exp(gamma) K) S = T Y
        y = (
            v.to(tl.float32) * beta[:, None]
            - tl.trans(ks_t) * (beta * tl.exp(gam))[:, None]
        )
        v_new = split_dot2(
            inv,
            y,
            tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32),
            SPLIT,
            UPCAST,
            PRECISION,
        )
        # intra-chunk (masked, decayed) plus inter-chunk (the state carried in): Q K^T
        # and (Q S)^T = S^T Q^T, in a second pass over K (its tiles are not held through
        # the UT transform)
        scores = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        qs_t = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
        for kb in range(0, BLOCK_K, BLOCK_KB):
            mtk = mt[:, None] & (kb + offs_kb < K)[None, :]
            q = tl.load(q_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            k = tl.load(k_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            s_ptrs, s_mask = _state_block(s_ptr, i_bh, kb, offs_kb, offs_v, K, V)
            S = tl.load(s_ptrs, mask=s_mask, other=0.0)
            scores += exact_dot(q, tl.trans(k), UPCAST, PRECISION)
            qs_t = split_dot(tl.trans(S), tl.trans(q), qs_t, SPLIT, UPCAST, PRECISION)
        o = split_dot2(
            scores * (decay * scale),
            v_new,
            tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32),
            SPLIT,
            UPCAST,
            PRECISION,
        )
        o += tl.trans(qs_t) * (tl.exp(gam) * scale)[:, None]
        o_off = b * s_ob + t64[:, None] * s_ot + h * s_oh + offs_v[None, :]
        tl.store(
            o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :]
        )
        # the state advances once per chunk: S <- exp(gamma_last) S + K^T (v_new decayed
        # to the chunk's end), block of rows by block of rows
        v_end = v_new * tl.exp(last_row(seg, BLOCK_T))[:, None]
        chunk_decay = tl.exp(tl.sum(g, 0))
        # every thread has read the state before any writes it
        tl.debug_barrier()
        for kb in range(0, BLOCK_K, BLOCK_KB):
            mtk = mt[:, None] & (kb + offs_kb < K)[None, :]
            k = tl.load(k_ptr + tok + kb + offs_kb[None, :], mask=mtk, other=0.0)
            s_ptrs, s_mask = _state_block(s_ptr, i_bh, kb, offs_kb, offs_v, K, V)
            S = tl.load(s_ptrs, mask=s_mask, other=0.0)
            S = split_dot_b(
                tl.trans(k), v_end, S * chunk_decay, SPLIT, UPCAST, PRECISION
            )
            tl.store(s_ptrs, S, mask=s_mask)
        # the next chunk reads the state this one wrote
        tl.debug_barrier()


# ------------------------------------------------------------------------------------------------ wrappers

def _check_kernel_args(q, k, v, chunk_size, extra=()):
    """What the kernels need beyond the references' checks: a kernel dtype, sizes they can launch, no
    autograd, a device they run on."""
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16 for the kernel, got {q.dtype}")
    for name, t in extra:
        if t is not None and t.dtype not in _DTYPES + (torch.float64,):
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128 for the kernel (a power of two: tl.dot needs at "
                         f"least 16 rows, and a {_MAX_CHUNK}-token chunk is the largest T x T tile kept), "
                         f"got {chunk_size}")
    for name, n in (("K (the head dim of q and k)", K), ("V (the head dim of v)", V)):
        if n > _MAX_DIM:
            raise ValueError(f"{name} = {n} exceeds the kernel's limit of {_MAX_DIM} (the largest head dim it "
                             f"is built and tested for)")
    if B * H > _MAX_GRID_AXIS:
        raise ValueError(f"B * H = {B * H} programs exceed Triton's grid-axis limit of {_MAX_GRID_AXIS}; "
                         f"split the batch")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v) + tuple(x for _, x in extra
                                                                            if x is not None)):
        raise ValueError("the kernel is inference-only (no backward): q, k, v and the gates must not require "
                         "grad (call under torch.no_grad(), or use the PyTorch reference for training)")
    if HAS_TRITON and q.device.type != "cuda" and not runtime.INTERPRETED:
        raise ValueError(f"tensors are on {q.device}; compiled Triton kernels need CUDA tensors "
                         f"(without a GPU, import labsrc first so that the interpreter is used)")


def _dense_last(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """``x`` with a unit-stride last dimension (other strides are passed to the kernel), in ``dtype``."""
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _blocks(K, V):
    """(BLOCK_K, BLOCK_KB, BLOCK_V): the padded head dim, the rows of the state (columns of q and k) one step
    of the kernels' inner loops takes, and the value columns of one program."""
    block_k = max(16, triton.next_power_of_2(K))
    block_v = max(16, min(64, triton.next_power_of_2(V)))
    return block_k, min(block_k, _BLOCK_KB), block_v


def _state(initial_state, shape, device):
    """The state the kernels read and update in place, chunk by chunk: a float32 copy of ``initial_state``
    (never the caller's tensor), or zeros; after the launch it is the final state."""
    if initial_state is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return initial_state.to(device=device, dtype=torch.float32, copy=True).contiguous()


def _empty(*shape, dtype, device):
    """An output buffer (the tests fill it with NaN instead, so an element the kernel skips shows)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _precision():
    return "ieee"


def chunk_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None = None,
                           chunk_size: int = 64, scale: float = 1.0, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False):
    """Causal linear attention with optional per-head decay, chunk by chunk in Triton; equal to
    :func:`labsrc.linear_attention.lightning_attention` (same arguments, ``chunk_size`` is its ``block_size``).

    Args:
        q, k: ``(B, T, H, K)``, v: ``(B, T, H, V)``; float32, float16 or bfloat16, one dtype; any strides
            (a last dimension that is not dense is copied). ``K, V <= 256``, ``B * H <= 65535``, ``T >= 1``.
        decay: ``(H,)`` per-step decays ``lambda_h`` in ``(0, 1]``, or None for none.
        chunk_size: tokens per chunk, 16, 32, 64 or 128 (on a GPU, 32 or less compiles without register
            spills: see ``_configs``).
        scale: factor on the queries (1 by default: linear attention has no softmax temperature).
        initial_state: ``(B, H, K, V)`` float32 state to start from (read in fp32).
        output_final_state: also return the state after the last token, ``(B, H, K, V)`` float32.

    Returns ``(o, final_state)``: ``o`` ``(B, T, H, V)`` in ``v``'s dtype, ``final_state`` or None.
    Raises ``TypeError``/``ValueError`` naming the argument; refuses inputs that require grad.
    """
    check_linear_inputs(q, k, v, decay, scale, initial_state, output_final_state, chunk_size)
    _check_kernel_args(q, k, v, chunk_size, (("decay", decay),))
    if not HAS_TRITON:
        o, s = lightning_attention(q, k, v, decay, chunk_size, scale, initial_state, output_final_state)
        return o, (s.float() if s is not None else None)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = (_dense_last(x) for x in (q, k, v))
    if k.stride() != q.stride():            # q and k share one set of strides in the kernel
        q, k = q.contiguous(), k.contiguous()
    o = _empty(B, T, H, V, dtype=v.dtype, device=q.device)
    state = _state(initial_state, (B, H, K, V), q.device)
    # the kernel reads log(lambda): a decay in (0, 1] that float32 rounds to 0 is log 0 = -inf, a decay of zero
    log_lam = decay.to(torch.float32).log().contiguous() if decay is not None else o
    block_k, block_kb, block_v = _blocks(K, V)
    grid = (triton.cdiv(V, block_v), B * H)
    _chunk_linear_attention_kernel[grid](
        q, k, v, log_lam, state, o, T, H, K, V, float(scale),
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        HAS_DECAY=decay is not None, BLOCK_T=chunk_size, BLOCK_K=block_k, BLOCK_KB=block_kb, BLOCK_V=block_v,
        SPLIT=v.dtype != torch.float32, UPCAST=runtime.INTERPRETED, PRECISION=_precision())
    return o, (state if output_final_state else None)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, chunk_size: int = 64):
    """The gated delta rule chunk by chunk in Triton; equal to
    :func:`labsrc.linear_attention.gated_delta_rule_chunked` (same signature).

    Args:
        q, k: ``(B, T, H, K)``, v: ``(B, T, H, V)``; float32, float16 or bfloat16, one dtype; any strides.
            ``K, V <= 256``, ``B * H <= 65535``, ``T >= 1``.
        g: ``(B, T, H)`` log of the decay, ``<= 0``; beta: ``(B, T, H)`` in ``[0, 1]``; any float dtype.
        scale: factor on the queries, ``K ** -0.5`` by default.
        initial_state, output_final_state: as in :func:`chunk_linear_attention`.
        chunk_size: 16, 32, 64 or 128 (the results do not depend on it, up to rounding; on a GPU, 32 or less
            compiles without register spills: see ``_configs``).

    Returns ``(o, final_state)``: ``o`` in ``v``'s dtype, ``final_state`` float32 or None.
    """
    check_delta_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    _check_kernel_args(q, k, v, chunk_size, (("g", g), ("beta", beta)))
    if not HAS_TRITON:
        o, s = gated_delta_rule_chunked(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
        return o, (s.float() if s is not None else None)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (_dense_last(x) for x in (q, k, v))
    if k.stride() != q.stride():
        q, k = q.contiguous(), k.contiguous()
    g, beta = g.to(torch.float32), beta.to(torch.float32)     # read through their strides
    o = _empty(B, T, H, V, dtype=v.dtype, device=q.device)
    state = _state(initial_state, (B, H, K, V), q.device)
    block_k, block_kb, block_v = _blocks(K, V)
    grid = (triton.cdiv(V, block_v), B * H)
    _chunk_gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, o, T, H, K, V, float(scale),
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        LOG2_T=chunk_size.bit_length() - 1, BLOCK_T=chunk_size, BLOCK_K=block_k, BLOCK_KB=block_kb,
        BLOCK_V=block_v, SPLIT=v.dtype != torch.float32, UPCAST=runtime.INTERPRETED, PRECISION=_precision())
    return o, (state if output_final_state else None)
