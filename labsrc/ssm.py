"""State-space models from scratch: HiPPO/S4, Mamba's selective scan, the parallel scan, Mamba-2's SSD.

Everything here is plain PyTorch (float64 where the math is taught, float32 state otherwise), written to be
read beside chapter 7 and to serve as the reference the Triton kernels in :mod:`labsrc.kernels.ssm` are
checked against. The layouts follow the code the field uses, so that the tests can compare with it:

* :func:`selective_scan_ref` has the signature and layout of ``mamba_ssm``'s ``selective_scan_ref`` (and of
  ``transformers.models.mamba.modeling_mamba.mamba_selective_scan``): ``u, delta, z (b, d, l)``,
  ``A (d, n)``, ``B, C (b, n, l)``, ``D (d,)``.
* :func:`ssd_recurrent` / :func:`ssd_chunked` have the layout of ``mamba_ssm``'s
  ``mamba_chunk_scan_combined`` (and of ``transformers.models.mamba2.modeling_mamba2.mamba2_chunk_scan``):
  ``x (b, l, h, p)``, ``dt (b, l, h)`` (already positive), ``A (h,)`` (negative), ``B, C (b, l, g, n)`` with
  ``h % g == 0`` (head ``i`` reads group ``i // (h // g)``), ``D (h,)``, ``initial_state (b, h, p, n)``.

Dtypes: the references take float16/bfloat16/float32/float64 inputs and compute in float32 (float64 when any
input is float64). Outputs come back in the dtype of ``u``/``x``; states (``last_state``, ``final_state``) in
the compute dtype, as ``mamba_ssm`` returns them. Non-finite inputs propagate: a NaN in ``x`` at step ``t``
reaches every later output of that head (channel) through the state; in :func:`ssd_chunked` it also reaches
the earlier steps of its own chunk (``0 * NaN`` in the masked intra-chunk product), never other heads.
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from labsrc.decay import segsum
# the scans' references and checks live beside their kernels (CONTRIBUTING: kernels import nothing above them)
from labsrc.kernels.ssm import (_FLOATS, _compute_dtype, _heads, _positive_int, _same_device, _selective_finish,
                                _selective_prepare, _shape, _tensor, check_linear_scan_args,
                                check_selective_scan_args, check_ssd_args, linear_scan_ref, scan_combine,
                                selective_scan_ref, ssd_chunked)

__all__ = [
    "hippo_legs", "discretize", "ssm_recurrent", "ssm_kernel", "ssm_conv", "legs_memory", "legs_reconstruct",
    "selective_scan_ref", "selective_scan_loop", "check_selective_scan_args",
    "scan_combine", "linear_scan_ref", "linear_scan_loop", "check_linear_scan_args", "blelloch_scan",
    "scan_work_depth",
    "ssd_recurrent", "ssd_chunked", "ssd_attention", "ssd_decay_mask", "check_ssd_args",
    "ssm_state_bytes",
]

# ----------------------------------------------------------------------------------------------------------
# argument checks (shared with the kernel wrappers)
# ----------------------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------------------
# S4: HiPPO, discretisation, the recurrent and convolutional faces of an LTI SSM
# ----------------------------------------------------------------------------------------------------------

def hippo_legs(N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The HiPPO-LegS matrices in S4's sign convention (float64).

    ``A[n, k] = -sqrt(2n+1) sqrt(2k+1)`` for ``n > k``, ``-(n+1)`` on the diagonal, 0 above it;
    ``B[n] = sqrt(2n+1)``. With them, ``c' = (A c + B f) / t`` keeps ``c(t)`` equal to the coefficients of
    ``f`` on ``[0, t]`` in the scaled Legendre basis (:func:`legs_memory`, :func:`legs_reconstruct`).
    """
    N = _positive_int("N", N)
    q = torch.sqrt(2 * torch.arange(N, dtype=torch.float64) + 1)
    A = torch.tril(-(q[:, None] * q[None, :]), diagonal=-1) - torch.diag(torch.arange(1, N + 1, dtype=torch.float64))
    return A, q.clone()


def _check_AB(A, B) -> bool:
    """Return True when A is diagonal (given as its diagonal, ``(N,)``), False when it is square ``(N, N)``."""
    _tensor("A", A)
    _tensor("B", B)
    if A.dim() == 1:
        diagonal = True
    elif A.dim() == 2 and A.shape[0] == A.shape[1]:
        diagonal = False
    else:
        raise ValueError(f"A must be square (N, N) or a diagonal (N,), got shape {tuple(A.shape)}")
    if B.dim() not in (1, 2) or B.shape[0] != A.shape[0]:
        raise ValueError(f"B must have shape (N,) or (N, m) with N = {A.shape[0]}, got {tuple(B.shape)}")
    return diagonal


def discretize(A: torch.Tensor, B: torch.Tensor, dt: float, method: str = "zoh") -> tuple[torch.Tensor, torch.Tensor]:
    """Discretise ``x' = A x + B u`` with step ``dt``: returns ``(Ab, Bb)`` for ``x_k = Ab x_{k-1} + Bb u_k``.

    ``A`` is square ``(N, N)`` or a diagonal ``(N,)`` (then ``Ab`` is a diagonal too); ``B`` is ``(N,)`` or
    ``(N, m)``.

    * ``"zoh"`` (zero-order hold, Mamba): ``Ab = exp(dt A)``, ``Bb = A^{-1} (exp(dt A) - I) B``
      (for a diagonal entry ``a = 0`` the limit ``dt B``);
    * ``"bilinear"`` (Tustin, S4): ``Ab = (I - dt/2 A)^{-1} (I + dt/2 A)``, ``Bb = (I - dt/2 A)^{-1} dt B``.
    """
    diagonal = _check_AB(A, B)
    if not isinstance(dt, Real) or isinstance(dt, bool) or not math.isfinite(float(dt)) or float(dt) <= 0:
        raise ValueError(f"dt must be a positive finite number, got {dt!r}")
    if method not in ("zoh", "bilinear"):
        raise ValueError(f"method must be 'zoh' or 'bilinear', got {method!r}")
    dt = float(dt)
    if diagonal:
        Bcol = B if B.dim() == 1 else B
        scale = (lambda v: v) if B.dim() == 1 else (lambda v: v[:, None])
        if method == "zoh":
            Ab = torch.exp(dt * A)
            # (exp(dt a) - 1) / a, with the limit dt where a == 0
            safe = torch.where(A == 0, torch.ones_like(A), A)
            factor = torch.where(A == 0, torch.full_like(A, dt), torch.expm1(dt * A) / safe)
        else:
            den = 1 - dt / 2 * A
            Ab = (1 + dt / 2 * A) / den
            factor = dt / den
        return Ab, scale(factor) * Bcol
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    Bm = B if B.dim() == 2 else B[:, None]
    if method == "zoh":
        Ab = torch.linalg.matrix_exp(dt * A)
        Bb = torch.linalg.solve(A, (Ab - eye) @ Bm)
    else:
        left = eye - dt / 2 * A
        Ab = torch.linalg.solve(left, eye + dt / 2 * A)
        Bb = torch.linalg.solve(left, dt * Bm)
    return Ab, (Bb if B.dim() == 2 else Bb[:, 0])


def ssm_recurrent(Ab: torch.Tensor, Bb: torch.Tensor, C: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Run the discrete LTI SSM ``x_k = Ab x_{k-1} + Bb u_k``, ``y_k = C x_k`` (``x_{-1} = 0``) step by step.

    ``Ab`` ``(N, N)`` or diagonal ``(N,)``, ``Bb`` and ``C`` ``(N,)``, ``u`` ``(..., L)``; returns ``y`` ``(..., L)``.
    Cost: ``L`` sequential steps of ``O(N^2)`` (``O(N)`` diagonal) work each.
    """
    diagonal = _check_AB(Ab, Bb)
    _tensor("C", C, 1)
    _tensor("u", u)
    if Bb.dim() != 1 or C.shape != Bb.shape:
        raise ValueError(f"Bb and C must both have shape (N,), got {tuple(Bb.shape)} and {tuple(C.shape)}")
    x = torch.zeros(*u.shape[:-1], Ab.shape[0], dtype=Ab.dtype, device=u.device)
    ys = []
    for k in range(u.shape[-1]):
        x = (x * Ab if diagonal else x @ Ab.T) + u[..., k, None].to(Ab.dtype) * Bb
        ys.append(x @ C.to(Ab.dtype))
    return torch.stack(ys, -1)


def ssm_kernel(Ab: torch.Tensor, Bb: torch.Tensor, C: torch.Tensor, L: int) -> torch.Tensor:
    """The SSM's convolution kernel ``K[l] = C Ab^l Bb`` for ``l = 0 .. L-1`` (shape ``(L,)``).

    An LTI SSM is the causal convolution ``y = K * u``: unroll the recurrence and the weight on ``u_{k-l}`` in
    ``y_k`` is ``C Ab^l Bb``, the same for every ``k``.
    """
    diagonal = _check_AB(Ab, Bb)
    L = _positive_int("L", L)
    _tensor("C", C, 1)
    v, out = Bb.clone(), []
    for _ in range(L):
        out.append(C.to(v.dtype) @ v)
        v = Ab * v if diagonal else Ab @ v
    return torch.stack(out)


def ssm_conv(K: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Apply a causal convolution kernel ``K (L,)`` to ``u (..., L)`` by FFT: ``y_k = sum_l K[l] u_{k-l}``.

    Cost ``O(L log L)`` with the whole sequence in parallel, against the recurrence's ``L`` sequential steps.
    """
    _tensor("K", K, 1)
    _tensor("u", u)
    L = u.shape[-1]
    if K.shape[0] != L:
        raise ValueError(f"K must have length L = {L} (u's last dimension), got {K.shape[0]}")
    n = 2 * L  # zero-pad so that the circular convolution is the linear one
    y = torch.fft.irfft(torch.fft.rfft(K, n=n) * torch.fft.rfft(u.to(K.dtype), n=n), n=n)
    return y[..., :L]


def legs_memory(f: torch.Tensor, N: int, A: torch.Tensor | None = None, B: torch.Tensor | None = None) -> torch.Tensor:
    """Feed the samples ``f (L,)`` through the scale-invariant LegS memory; return the states ``(L, N)``.

    The continuous memory ``c'(t) = (A c(t) + B f(t)) / t`` is discretised with the bilinear rule at step
    ``k`` (time ``t = k``, step 1): ``c_k = (I - A/2k)^{-1} ((I + A/2k) c_{k-1} + B f_k / k)``. With the
    HiPPO-LegS ``(A, B)`` (the default) ``c_k`` holds the Legendre coefficients of ``f_1 .. f_k``; pass another
    ``A`` (e.g. a random stable matrix) to see what a memory without that structure keeps.
    """
    N = _positive_int("N", N)
    if A is None or B is None:
        A, B = hippo_legs(N)
    _tensor("f", f, 1)
    f = f.to(torch.float64)
    eye = torch.eye(N, dtype=torch.float64)
    c = torch.zeros(N, dtype=torch.float64)
    out = []
    for k in range(1, f.shape[0] + 1):
        left = eye - A / (2 * k)
        c = torch.linalg.solve(left, (eye + A / (2 * k)) @ c + B * f[k - 1] / k)
        out.append(c)
    return torch.stack(out)


def legs_reconstruct(c: torch.Tensor, num_points: int) -> torch.Tensor:
    """The signal a LegS state describes: ``f(s) = sum_n c_n sqrt(2n+1) P_n(2s/t - 1)`` at ``num_points``
    evenly spaced points of ``[0, t]`` (midpoints), float64."""
    _tensor("c", c, 1)
    num_points = _positive_int("num_points", num_points)
    x = (torch.arange(num_points, dtype=torch.float64) + 0.5) / num_points * 2 - 1
    # Legendre polynomials by Bonnet's recursion: (n+1) P_{n+1} = (2n+1) x P_n - n P_{n-1}
    P = [torch.ones_like(x), x]
    for n in range(1, c.shape[0] - 1):
        P.append(((2 * n + 1) * x * P[n] - n * P[n - 1]) / (n + 1))
    P = torch.stack(P[: c.shape[0]])  # (N, num_points)
    q = torch.sqrt(2 * torch.arange(c.shape[0], dtype=torch.float64) + 1)
    return (c.to(torch.float64) * q) @ P


# ----------------------------------------------------------------------------------------------------------
# Mamba: the selective scan
# ----------------------------------------------------------------------------------------------------------

def selective_scan_loop(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        return_last_state=False):
    """The selective scan as the most literal loop: one scalar state entry per (batch, channel, n) and step.

    Slow (pure Python over every index); for tests on tiny sizes, as the independent check of
    :func:`selective_scan_ref`.
    """
    cd, delta = _selective_prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    bsz, d, l = u.shape
    n = A.shape[1]
    uc, Ac, Bc, Cc = u.to(cd), A.to(cd), B.to(cd), C.to(cd)
    y = torch.zeros(bsz, d, l, dtype=cd)
    last = torch.zeros(bsz, d, n, dtype=cd)
    for bi in range(bsz):
        for di in range(d):
            for ni in range(n):
                x = 0.0
                for t in range(l):
                    dl = float(delta[bi, di, t])
                    x = math.exp(dl * float(Ac[di, ni])) * x + dl * float(Bc[bi, ni, t]) * float(uc[bi, di, t])
                    y[bi, di, t] += x * float(Cc[bi, ni, t])
                last[bi, di, ni] = x
    y = _selective_finish(y.to(u.device), u, D, z, cd)
    return (y, last.to(u.device)) if return_last_state else y


# ----------------------------------------------------------------------------------------------------------
# the scan: h_t = a_t h_{t-1} + b_t as an associative operator on pairs
# ----------------------------------------------------------------------------------------------------------

def linear_scan_loop(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + b_t`` along the last dimension, one step at a time (``h_{-1} = h0`` or 0)."""
    l = check_linear_scan_args(a, b, h0)
    cd = _compute_dtype(a, b, h0)
    h = torch.zeros(a.shape[:-1], dtype=cd, device=a.device) if h0 is None else h0.to(cd)
    out = []
    for t in range(l):
        h = a[..., t].to(cd) * h + b[..., t].to(cd)
        out.append(h)
    return torch.stack(out, -1).to(b.dtype)


def blelloch_scan(a: torch.Tensor, b: torch.Tensor, trace: list | None = None) -> torch.Tensor:
    """Blelloch's work-efficient scan of ``h_t = a_t h_{t-1} + b_t`` (1-D, ``h_{-1} = 0``), float64.

    Up-sweep: a tree of partial compositions; down-sweep: push prefixes back down, giving the exclusive scan,
    combined with each element for the inclusive one. Lengths that are not powers of two are padded with the
    identity ``(1, 0)``. When ``trace`` is a list, each combine is appended as ``(phase, level, left, right)``
    (indices into the padded array), which is what chapter 7 draws.
    """
    _tensor("a", a, 1)
    _tensor("b", b, 1)
    if a.shape != b.shape or a.shape[0] < 1:
        raise ValueError(f"a and b must be non-empty 1-D tensors of one shape, got {tuple(a.shape)}, {tuple(b.shape)}")
    l = a.shape[0]
    size = 1 << (l - 1).bit_length()
    A = [1.0] * size
    Bv = [0.0] * size
    for i in range(l):
        A[i], Bv[i] = float(a[i]), float(b[i])
    A0, B0 = list(A), list(Bv)
    levels = size.bit_length() - 1
    for d in range(levels):  # up-sweep
        stride = 1 << (d + 1)
        for k in range(0, size, stride):
            i, j = k + (1 << d) - 1, k + stride - 1
            A[j], Bv[j] = scan_combine((A[i], Bv[i]), (A[j], Bv[j]))
            if trace is not None:
                trace.append(("up", d, i, j))
    A[size - 1], Bv[size - 1] = 1.0, 0.0  # identity at the root
    for d in reversed(range(levels)):  # down-sweep
        stride = 1 << (d + 1)
        for k in range(0, size, stride):
            i, j = k + (1 << d) - 1, k + stride - 1
            left = (A[i], Bv[i])
            A[i], Bv[i] = A[j], Bv[j]  # the left child gets the parent's prefix
            A[j], Bv[j] = scan_combine((A[j], Bv[j]), left)  # the right child: parent's prefix then left subtree
            if trace is not None:
                trace.append(("down", d, i, j))
    # exclusive prefix (A[i], Bv[i]) composed with element i gives h_i (from h_{-1} = 0)
    h = [scan_combine((A[i], Bv[i]), (A0[i], B0[i]))[1] for i in range(l)]
    return torch.tensor(h, dtype=torch.float64)


def scan_work_depth(l: int) -> dict:
    """Combine counts (work) and sequential rounds (depth) of three ways to scan ``l`` elements.

    ``sequential``: ``l - 1`` combines, depth ``l - 1``; ``hillis_steele``: ``sum_k (l - 2^k)`` combines over
    ``ceil(log2 l)`` rounds; ``blelloch`` (padded to the power of two ``P``): ``2 (P - 1)`` combines over
    ``2 log2 P`` rounds (plus the final per-element combine, one round).
    """
    l = _positive_int("l", l)
    rounds = (l - 1).bit_length()
    P = 1 << rounds
    return {
        "sequential": (l - 1, l - 1),
        "hillis_steele": (sum(l - (1 << k) for k in range(rounds)), rounds),
        "blelloch": (2 * (P - 1) + l, 2 * rounds + 1),
    }


# ----------------------------------------------------------------------------------------------------------
# Mamba-2: state-space duality (SSD)
# ----------------------------------------------------------------------------------------------------------

def ssd_recurrent(x, dt, A, B, C, D=None, initial_state=None):
    """Mamba-2's SSD layer as its recurrence, one step at a time.

    For every batch ``b`` and head ``i`` the state ``S (p, n)`` runs::

        S_t = exp(dt_t A_i) S_{t-1} + dt_t x_t B_t^T        (x_t (p,), B_t (n,) of head i's group)
        y_t = S_t C_t + D_i x_t

    Shapes as in ``mamba_chunk_scan_combined``: ``x (b, l, h, p)``, ``dt (b, l, h)`` (positive), ``A (h,)``,
    ``B, C (b, l, g, n)``, ``D (h,)``, ``initial_state (b, h, p, n)``. Returns ``(y, final_state)``: ``y`` in
    ``x``'s dtype, ``final_state (b, h, p, n)`` in the compute dtype (float32, float64 for float64 inputs).
    """
    bsz, l, h, p, g, n = check_ssd_args(x, dt, A, B, C, D, initial_state)
    cd = _compute_dtype(x, dt, A, B, C, D, initial_state)
    xc, dtc, Ac = x.to(cd), dt.to(cd), A.to(cd)
    Bh, Ch = _heads(B.to(cd), h), _heads(C.to(cd), h)
    S = torch.zeros(bsz, h, p, n, dtype=cd, device=x.device) if initial_state is None else initial_state.to(cd)
    ys = []
    for t in range(l):
        decay = torch.exp(dtc[:, t] * Ac)  # (b, h)
        S = decay[..., None, None] * S + (dtc[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + D.to(cd)[:, None] * xc
    return y.to(x.dtype), S


def ssd_decay_mask(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The 1-semiseparable decay mask ``L[b, h, t, s] = exp(sum_{s < k <= t} dt_k A_h)`` (0 above the diagonal).

    Every submatrix of ``L`` on or below the diagonal has rank 1 (``L[t, s] = e^{cs_t} e^{-cs_s}``): that is
    what "1-semiseparable" means, and why the chunked algorithm can pass a state instead of the whole matrix.
    """
    _tensor("dt", dt, 3)
    _tensor("A", A, 1)
    if dt.shape[2] != A.shape[0]:
        raise ValueError(f"A must have shape (h,) with h = {dt.shape[2]}, got {tuple(A.shape)}")
    cd = _compute_dtype(dt, A)
    a = (dt.to(cd) * A.to(cd)).permute(0, 2, 1)  # (b, h, l)
    return torch.exp(segsum(a))


def ssd_attention(x, dt, A, B, C, D=None):
    """SSD as masked attention, materialised: ``y = (L o (C B^T)) (dt x) + D x`` with ``L`` the decay mask.

    ``C`` plays the query, ``B`` the key and ``dt x`` the value; the softmax is replaced by the decay mask
    :func:`ssd_decay_mask`. ``O(l^2)`` memory: for small ``l`` only, to show that it equals the recurrence.
    Returns ``y`` (no state: attention keeps the whole past instead).
    """
    bsz, l, h, p, g, n = check_ssd_args(x, dt, A, B, C, D)
    cd = _compute_dtype(x, dt, A, B, C, D)
    Bh, Ch = _heads(B.to(cd), h), _heads(C.to(cd), h)
    M = torch.einsum("bthn,bshn->bhts", Ch, Bh) * ssd_decay_mask(dt, A).to(cd)
    y = torch.einsum("bhts,bshp->bthp", M, x.to(cd) * dt.to(cd)[..., None])
    if D is not None:
        y = y + D.to(cd)[:, None] * x.to(cd)
    return y.to(x.dtype)


def ssm_state_bytes(n_layers: int, heads: int, head_dim: int, state_size: int, conv_dim: int = 0,
                    conv_kernel: int = 0, bytes_per_el: int = 2, batch: int = 1) -> int:
    """Bytes of a Mamba-2 model's recurrent cache: per layer an SSM state ``(h, p, n)`` and a convolution
    window ``(conv_dim, conv_kernel)``. Independent of the sequence length."""
    for name, v in (("n_layers", n_layers), ("heads", heads), ("head_dim", head_dim), ("state_size", state_size),
                    ("bytes_per_el", bytes_per_el), ("batch", batch)):
        _positive_int(name, v)
    return batch * n_layers * (heads * head_dim * state_size + conv_dim * conv_kernel) * bytes_per_el
