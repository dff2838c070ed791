"""State-space scans in Triton: a first-order linear scan, Mamba's selective scan and Mamba-2's chunked SSD.

Three kernels, each beside the PyTorch reference it is tested against (in :mod:`labsrc.ssm`):

* :func:`linear_scan` -- ``h_t = a_t h_{t-1} + b_t`` along the last dimension of ``(..., l)`` tensors. One
  program per row walks the row in blocks of ``BLOCK_L``; inside a block ``tl.associative_scan`` combines
  the pairs ``(a, b)`` with the operator ``(a1, b1) o (a2, b2) = (a1 a2, a2 b1 + b2)`` (a parallel scan in
  ``log2 BLOCK_L`` rounds), and the last ``h`` of a block is carried into the next, so any ``l`` works.
* :func:`selective_scan` -- Mamba's selective scan, same arguments and results as
  :func:`labsrc.ssm.selective_scan_ref`. One program per (batch, channel) holds an ``(BLOCK_L, BLOCK_N)``
  tile of discretised pairs ``(exp(delta A), delta B u)`` and scans it along the sequence with the same
  combine, carrying the ``(n,)`` state between blocks; ``y = <x_t, C_t> + D u``, gated by ``silu(z)``.
* :func:`ssd` -- Mamba-2's SSD, same arguments and results as :func:`labsrc.ssm.ssd_chunked`. One program per
  (batch, head, block of head dims) keeps the state ``S (BLOCK_P, BLOCK_N)`` in registers and walks the
  chunks: the intra-chunk output is two ``tl.dot`` (``C B^T`` masked by the decay, times ``dt x``), the
  inter-chunk output one more (``C S^T``), and the state update a fourth. The decays between two steps of a
  chunk come from segment sums of ``dt A`` (:func:`labsrc.kernels._decay.chunk_segsum`), never from
  differences of prefix sums, so extreme gates (a very negative ``dt A``, or ``A = -inf``: a decay of exactly
  zero) give the recurrence's result rather than O(1) errors or NaN.

Conventions: inputs are float32, float16 or bfloat16 (``dt``, ``A``, ``D``, ``delta_bias`` and
``initial_state`` are read as float32); the scans upcast every tile to float32 right after its load, and the
state and all arithmetic are float32. ``ssd``'s four products keep ``x``, ``B``, ``C`` in their 16-bit input
dtype and split the float32 factor they multiply into a 16-bit high and low part, two tensor-core products
accurate to about ``2^-16`` (:mod:`labsrc.kernels._dots`; float32 inputs multiply in true fp32). The output has
the dtype of ``x``/``u``/``b`` and states come back float32. Every tensor the
kernels read is first made contiguous in the dtype they expect (``.to(dtype).contiguous()``), so strided
and expanded views are read correctly. The kernels are inference-only: inputs that require grad while a graph
is recorded are refused (``ValueError``). Non-finite inputs behave as in the references: a NaN reaches every
later output of its row/channel/head through the state (and, in ``ssd``, the earlier steps of its own chunk,
where the masked product computes ``0 * NaN``), never another row, channel or head.

Launch limits, checked up front: one row/channel/head's offsets are 64-bit, grid axis 0 holds at most
``2^31 - 1`` programs; ``n`` (the state size) is at most 256 and ``ssd``'s ``chunk_size`` a power of two from
16 to 256 (``tl.dot`` needs tiles of at least 16, and a chunk's ``(Q, Q)`` and ``(Q, N)`` tiles must fit in
registers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labsrc import runtime
from labsrc.decay import segsum
from labsrc.kernels._decay import chunk_segsum, last_row
from labsrc.kernels._dots import exact_dot, split_dot
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["linear_scan", "selective_scan", "ssd", "linear_scan_ref", "selective_scan_ref", "ssd_ref",
           "MAX_STATE", "MIN_CHUNK", "MAX_CHUNK"]


# ------------------------------------------- the references, in plain PyTorch (chapter 7 builds them)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor(name: str, t, dims: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    return t


def _shape(name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {tuple(expected)}, got {tuple(t.shape)}")


def _same_device(**tensors) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "put every tensor on one device")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_selective_scan_args(u, delta, A, B, C, D=None, z=None, delta_bias=None) -> tuple[int, int, int, int]:
    """Validate :func:`selective_scan_ref`'s arguments; return ``(b, d, l, n)``.

    Raises ``TypeError`` for a non-tensor or a non-float dtype and ``ValueError`` for a shape or device
    mismatch, naming the argument and the expected shape.
    """
    _tensor("u", u, 3)
    bsz, d, l = u.shape
    if l < 1 or d < 1 or bsz < 1:
        raise ValueError(f"u must have non-empty (b, d, l) dimensions, got {tuple(u.shape)}")
    _tensor("delta", delta, 3)
    _shape("delta", delta, (bsz, d, l), "(b, d, l)")
    _tensor("A", A, 2)
    if A.shape[0] != d or A.shape[1] < 1:
        raise ValueError(f"A must have shape (d, n) with d = {d}, got {tuple(A.shape)}")
    n = A.shape[1]
    _tensor("B", B, 3)
    _shape("B", B, (bsz, n, l), "(b, n, l)")
    _tensor("C", C, 3)
    _shape("C", C, (bsz, n, l), "(b, n, l)")
    if D is not None:
        _tensor("D", D, 1)
        _shape("D", D, (d,), "(d,)")
    if z is not None:
        _tensor("z", z, 3)
        _shape("z", z, (bsz, d, l), "(b, d, l)")
    if delta_bias is not None:
        _tensor("delta_bias", delta_bias, 1)
        _shape("delta_bias", delta_bias, (d,), "(d,)")
    _same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    return bsz, d, l, n


def check_ssd_args(x, dt, A, B, C, D=None, initial_state=None, chunk_size=None) -> tuple[int, int, int, int, int, int]:
    """Validate the SSD arguments (:func:`ssd_recurrent`, :func:`ssd_chunked`); return ``(b, l, h, p, g, n)``."""
    _tensor("x", x, 4)
    bsz, l, h, p = x.shape
    if min(bsz, l, h, p) < 1:
        raise ValueError(f"x must have non-empty (b, l, h, p) dimensions, got {tuple(x.shape)}")
    _tensor("dt", dt, 3)
    _shape("dt", dt, (bsz, l, h), "(b, l, h)")
    _tensor("A", A, 1)
    _shape("A", A, (h,), "(h,)")
    _tensor("B", B, 4)
    if B.shape[:2] != (bsz, l) or B.shape[2] < 1 or B.shape[3] < 1:
        raise ValueError(f"B must have shape (b, l, g, n) with (b, l) = {(bsz, l)}, got {tuple(B.shape)}")
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"B's group count g = {g} must divide the number of heads h = {h}")
    _tensor("C", C, 4)
    _shape("C", C, (bsz, l, g, n), "(b, l, g, n)")
    if D is not None:
        _tensor("D", D, 1)
        _shape("D", D, (h,), "(h,)")
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4)
        _shape("initial_state", initial_state, (bsz, h, p, n), "(b, h, p, n)")
    if chunk_size is not None:
        _positive_int("chunk_size", chunk_size)
    _same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=initial_state)
    return bsz, l, h, p, g, n


def check_linear_scan_args(a, b, h0=None) -> int:
    """Validate :func:`linear_scan_ref`'s arguments; return the length ``l``."""
    _tensor("a", a)
    _tensor("b", b)
    if a.dim() < 1 or a.shape[-1] < 1:
        raise ValueError(f"a must have at least one dimension with length l >= 1, got {tuple(a.shape)}")
    if tuple(b.shape) != tuple(a.shape):
        raise ValueError(f"b must have the shape of a, {tuple(a.shape)}, got {tuple(b.shape)}")
    if h0 is not None:
        _tensor("h0", h0)
        if tuple(h0.shape) != tuple(a.shape[:-1]):
            raise ValueError(f"h0 must have shape a.shape[:-1] = {tuple(a.shape[:-1])}, got {tuple(h0.shape)}")
    _same_device(a=a, b=b, h0=h0)
    return a.shape[-1]


def _selective_prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    cd = _compute_dtype(u, delta, A, B, C, D, z, delta_bias)
    delta = delta.to(cd)
    if delta_bias is not None:
        delta = delta + delta_bias.to(cd)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    return cd, delta


def _selective_finish(y, u, D, z, cd):
    if D is not None:
        y = y + D.to(cd)[:, None] * u.to(cd)
    if z is not None:
        y = y * F.silu(z.to(cd))
    return y.to(u.dtype)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    """Mamba's selective scan (the layout and semantics of ``mamba_ssm``'s ``selective_scan_ref``).

    For each batch ``b`` and channel ``d`` a state ``x (n,)`` runs over the sequence::

        delta = softplus(delta + delta_bias)              (each part only when asked)
        x_t   = exp(delta_t * A[d]) * x_{t-1} + delta_t * B_t * u_t
        y_t   = <x_t, C_t> + D[d] * u_t, then y * silu(z) when z is given

    Shapes: ``u, delta, z (b, d, l)``; ``A (d, n)``; ``B, C (b, n, l)``; ``D, delta_bias (d,)``. Returns ``y``
    ``(b, d, l)`` in ``u``'s dtype, and with ``return_last_state`` also ``x_{l-1}`` ``(b, d, n)`` (compute dtype).

    Here the recurrence is evaluated for all channels at once, one time step per iteration: the ``l``
    sequential steps are what a scan kernel parallelises.
    """
    cd, delta = _selective_prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    bsz, d, l = u.shape
    uc = u.to(cd)
    dA = torch.exp(delta[..., None] * A.to(cd)[None, :, None, :])  # (b, d, l, n)
    dBu = (delta * uc)[..., None] * B.to(cd).transpose(1, 2)[:, None]  # (b, d, l, n)
    Ct = C.to(cd).transpose(1, 2)  # (b, l, n)
    x = torch.zeros(bsz, d, A.shape[1], dtype=cd, device=u.device)
    ys = []
    for t in range(l):
        x = dA[:, :, t] * x + dBu[:, :, t]
        ys.append((x * Ct[:, None, t]).sum(-1))
    y = _selective_finish(torch.stack(ys, -1), u, D, z, cd)
    return (y, x) if return_last_state else y


def scan_combine(left: tuple, right: tuple) -> tuple:
    """Compose two steps of ``h -> a h + b``: first ``left = (a1, b1)``, then ``right = (a2, b2)``.

    ``a2 (a1 h + b1) + b2 = (a1 a2) h + (a2 b1 + b2)``, so the pair of the two steps is
    ``(a1 a2, a2 b1 + b2)``. The operator is associative (not commutative), which is all a parallel scan needs.
    """
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def linear_scan_ref(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + b_t`` along the last dimension of ``(..., l)`` tensors, by the scan operator.

    Implemented with Hillis-Steele doubling (``log2 l`` rounds of :func:`scan_combine` over the whole
    sequence): the parallel algorithm, in PyTorch. ``h0`` (shape ``a.shape[:-1]``) enters as ``b_0 += a_0 h0``.
    Returns ``h`` in ``b``'s dtype (computed in float32, float64 for float64 inputs).
    """
    l = check_linear_scan_args(a, b, h0)
    cd = _compute_dtype(a, b, h0)
    A, Bv = a.to(cd).clone(), b.to(cd).clone()
    if h0 is not None:
        Bv[..., 0] = Bv[..., 0] + A[..., 0] * h0.to(cd)
    step = 1
    while step < l:
        # element t absorbs the prefix ending at t - step: (A, B)[t] = combine((A, B)[t-step], (A, B)[t])
        A_new, B_new = scan_combine((A[..., :-step], Bv[..., :-step]), (A[..., step:], Bv[..., step:]))
        A = torch.cat([A[..., :step], A_new], -1)
        Bv = torch.cat([Bv[..., :step], B_new], -1)
        step *= 2
    return Bv.to(b.dtype)


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """``(b, l, g, n) -> (b, l, h, n)``: head ``i`` reads group ``i // (h // g)``."""
    return t.repeat_interleave(h // t.shape[2], dim=2)


def ssd_chunked(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64):
    """Mamba-2's chunked SSD algorithm: the same result as :func:`ssd_recurrent`, computed chunk by chunk.

    The sequence is cut into chunks of ``chunk_size`` (the last one padded with ``dt = 0`` and log-decay 0,
    which neither decay nor write the state). With ``a_t = dt_t A`` and ``cs_t`` its cumulative sum inside a
    chunk:

    1. *intra-chunk* (the quadratic, attention-like form): ``y_t += sum_{s <= t} (C_t . B_s)
       exp(a_{s+1} + ... + a_t) dt_s x_s`` -- a masked matrix product, on tensor cores in a real kernel;
    2. *chunk states*: ``P_c = sum_s exp(a_{s+1} + ... + a_last) dt_s x_s B_s^T``, what chunk ``c`` adds to
       the state;
    3. *state passing* (a scan over chunks): ``S_{c+1} = exp(cs_last) S_c + P_c``, from ``initial_state``;
    4. *inter-chunk output*: ``y_t += exp(cs_t) S_c C_t`` -- the state chunk ``c`` starts from, decayed to ``t``.

    Then ``y += D x``. Arguments and returns as in :func:`ssd_recurrent` (plus ``chunk_size``, a positive int;
    any ``l >= 1`` works). The decays between two positions (steps 1 and 2) are segment sums
    (:func:`labsrc.decay.segsum`), never ``exp(cs_t - cs_s)``: that difference loses the small log-decays that
    follow a very negative one, and turns a log-decay of ``-inf`` (``A = -inf``: a decay of exactly zero, which
    resets the state as in the recurrence) into NaN. Work: ``O(l Q (n + p))`` for chunk size ``Q`` against the recurrence's
    ``O(l n p)`` in ``l`` sequential steps; only ``l / Q`` steps (3) are sequential.
    """
    bsz, l, h, p, g, n = check_ssd_args(x, dt, A, B, C, D, initial_state, chunk_size)
    cd = _compute_dtype(x, dt, A, B, C, D, initial_state)
    Q = int(chunk_size)
    nc = -(-l // Q)
    pad = nc * Q - l
    xc = F.pad(x.to(cd), (0, 0, 0, 0, 0, pad)).reshape(bsz, nc, Q, h, p)
    dtc = F.pad(dt.to(cd), (0, 0, 0, pad)).reshape(bsz, nc, Q, h)
    Bh = F.pad(_heads(B.to(cd), h), (0, 0, 0, 0, 0, pad)).reshape(bsz, nc, Q, h, n)
    Ch = F.pad(_heads(C.to(cd), h), (0, 0, 0, 0, 0, pad)).reshape(bsz, nc, Q, h, n)
    # log-decay of each step, (b, c, h, Q); padded steps get 0 (not 0 * A, which is NaN for A = -inf)
    a = F.pad(dt.to(cd) * A.to(cd), (0, 0, 0, pad)).reshape(bsz, nc, Q, h).permute(0, 1, 3, 2)
    cs = torch.cumsum(a, -1)  # (b, c, h, Q): from the chunk's start, a sum of terms of one sign
    seg = segsum(a)  # (b, c, h, t, s): log-decay from s to t, summed directly
    xdt = xc * dtc[..., None]  # dt_s x_s, (b, c, Q, h, p)

    # 1. intra-chunk: a (Q x Q) lower-triangular "attention" per chunk and head
    Lmask = torch.exp(seg)  # (b, c, h, t, s), 0 above the diagonal
    scores = torch.einsum("bcthn,bcshn->bchts", Ch, Bh) * Lmask
    y = torch.einsum("bchts,bcshp->bcthp", scores, xdt)

    # 2. what each chunk writes into the state, decayed to the chunk's end
    to_end = torch.exp(seg[..., -1, :])  # (b, c, h, Q): from each step to the chunk's end
    P = torch.einsum("bchs,bcshp,bcshn->bchpn", to_end, xdt, Bh)

    # 3. state passing between chunks (sequential over nc = ceil(l / Q) chunks)
    S = torch.zeros(bsz, h, p, n, dtype=cd, device=x.device) if initial_state is None else initial_state.to(cd)
    chunk_decay = torch.exp(cs[..., -1])  # (b, c, h)
    starts = []
    for c in range(nc):
        starts.append(S)
        S = chunk_decay[:, c, :, None, None] * S + P[:, c]
    starts = torch.stack(starts, 1)  # (b, c, h, p, n)

    # 4. the start state's contribution to each position of its chunk
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", Ch, starts, torch.exp(cs).permute(0, 1, 3, 2))

    y = y.reshape(bsz, nc * Q, h, p)[:, :l]
    if D is not None:
        y = y + D.to(cd)[:, None] * x.to(cd)
    return y.to(x.dtype), S


# The reference SSD is the chunked form (chapter 7 builds it; labsrc.ssm has it from here).
ssd_ref = ssd_chunked

MAX_STATE = 256          # n: one (BLOCK_L, BLOCK_N) / (BLOCK_Q, BLOCK_N) tile per program
MIN_CHUNK, MAX_CHUNK = 16, 256   # ssd's chunk: tl.dot needs >= 16; a (Q, Q) fp32 tile of 256^2 is the most
GRID_AXIS0_LIMIT = 2**31 - 1
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _scan_combine(a1, b1, a2, b2):
    # (a1, b1) then (a2, b2): h -> a2 (a1 h + b1) + b2 = (a1 a2) h + (a2 b1 + b2)
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _linear_scan_kernel(a_ptr, b_ptr, h0_ptr, out_ptr, L, BLOCK_L: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * L                                   # 64-bit: rows * L may pass 2^31
    offs = tl.arange(0, BLOCK_L)
    # h_{-1}: zeros unless the caller passed h0
    carry = tl.load(h0_ptr + row).to(tl.float32)
    for start in range(0, L, BLOCK_L):
        idx = start + offs
        mask = idx < L
        # lanes past the end hold the identity (1, 0): they leave the scan, and the
        # carry, unchanged
        a = tl.load(a_ptr + base + idx, mask=mask, other=1.0).to(tl.float32)
        b = tl.load(b_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        # prefix compositions in the block
        a_cum, b_cum = tl.associative_scan((a, b), 0, _scan_combine)
        # apply each prefix to the state entering the block
        h = a_cum * carry + b_cum
        tl.store(out_ptr + base + idx, h.to(out_ptr.dtype.element_ty), mask=mask)
        # the block's last h
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, h, 0.0), axis=0)


@triton.jit
def _selective_scan_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, y_ptr, last_ptr,
    n_channels, L, N, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    bi = pid // n_channels
    di = pid % n_channels
    # u, delta, z, y are (b, d, l): row (bi, di)
    row = pid.to(tl.int64) * L
    bc = bi.to(tl.int64) * N * L                     # B, C are (b, n, l)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_row = tl.load(A_ptr + di * N + offs_n, mask=mask_n, other=0.0)          # A[d, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + di)
    if HAS_D:
        d_skip = tl.load(D_ptr + di)
    x = tl.zeros([BLOCK_N], dtype=tl.float32)         # the state entering the block
    for start in range(0, L, BLOCK_L):
        idx = start + offs_l
        mask_l = idx < L
        u = tl.load(u_ptr + row + idx, mask=mask_l, other=0.0).to(tl.float32)
        dl = tl.load(delta_ptr + row + idx, mask=mask_l, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dl = dl + bias
        if SOFTPLUS:  # torch's softplus: log(1 + e^x), and x itself above 20
            dl = tl.where(dl > 20.0, dl, tl.log(1.0 + tl.exp(tl.minimum(dl, 20.0))))
        dl = tl.where(mask_l, dl, 0.0)                # past the end: no decay, no input
        m2 = mask_l[:, None] & mask_n[None, :]
        bt = tl.load(
            B_ptr + bc + offs_n[None, :] * L + idx[:, None], mask=m2, other=0.0
        ).to(tl.float32)
        ct = tl.load(
            C_ptr + bc + offs_n[None, :] * L + idx[:, None], mask=m2, other=0.0
        ).to(tl.float32)
        dA = tl.exp(dl[:, None] * a_row[None, :])     # (BLOCK_L, BLOCK_N) decays
        dBu = (dl * u)[:, None] * bt                  # (BLOCK_L, BLOCK_N) inputs
        a_cum, b_cum = tl.associative_scan((dA, dBu), 0, _scan_combine)
        # the state at every step of the block
        xs = a_cum * x[None, :] + b_cum
        y = tl.sum(xs * ct, axis=1)                   # <x_t, C_t>
        if HAS_D:
            y = y + d_skip * u
        if HAS_Z:
            z = tl.load(z_ptr + row + idx, mask=mask_l, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))               # silu(z) gate
        tl.store(y_ptr + row + idx, y.to(y_ptr.dtype.element_ty), mask=mask_l)
        x = tl.sum(tl.where(offs_l[:, None] == BLOCK_L - 1, xs, 0.0), axis=0)
    tl.store(last_ptr + pid.to(tl.int64) * N + offs_n, x, mask=mask_n)


@triton.jit
def _ssd_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    s0_ptr,
    y_ptr,
    sT_ptr,
    L,
    H,
    G,
    P,
    N,
    HAS_D: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    bi = pid_bh // H
    hi = pid_bh % H
    gi = hi // (H // G)  # the B/C group this head reads
    offs_q = tl.arange(0, BLOCK_Q)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    a_h = tl.load(A_ptr + hi)
    state_off = pid_bh.to(tl.int64) * P * N + offs_p[:, None] * N + offs_n[None, :]
    mask_s = mask_p[:, None] & mask_n[None, :]
    if HAS_INIT:
        S = tl.load(s0_ptr + state_off, mask=mask_s, other=0.0)
    else:
        S = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_D:
        d_skip = tl.load(D_ptr + hi)
    for start in range(0, L, BLOCK_Q):
        t = start + offs_q
        mask_t = t < L
        # (b, l) index of each step of the chunk
        tok = bi.to(tl.int64) * L + t
        # 0 past the end: no-op steps
        dt = tl.load(dt_ptr + tok * H + hi, mask=mask_t, other=0.0)
        mx = mask_t[:, None] & mask_p[None, :]
        # x, B, C stay in their input dtype: each product below has one of them as its
        # second operand
        xv = tl.load(
            x_ptr + (tok * H + hi)[:, None] * P + offs_p[None, :], mask=mx, other=0.0
        )
        mbc = mask_t[:, None] & mask_n[None, :]
        bc_off = (tok * G + gi)[:, None] * N + offs_n[None, :]
        Bm = tl.load(B_ptr + bc_off, mask=mbc, other=0.0)  # (Q, N)
        Cm = tl.load(C_ptr + bc_off, mask=mbc, other=0.0)  # (Q, N)
        # log-decay of each step; 0 past the end (never 0 * -inf)
        a = dt * tl.where(mask_t, a_h, 0.0)
        # cs_t = a_0 + ... + a_t inside the chunk
        cs = tl.cumsum(a, axis=0)
        total = tl.sum(a, axis=0)  # the whole chunk's log-decay
        # a_{s+1} + ... + a_t, summed directly; -inf above
        seg = chunk_segsum(a, BLOCK_Q)
        # 1. intra-chunk: (C B^T) o decay, a causal (Q, Q) "attention" matrix, times dt
        # x (dt on its columns)
        scores = exact_dot(Cm, tl.trans(Bm), UPCAST, PRECISION)
        decay = tl.exp(seg)  # 0 above the diagonal
        y = split_dot(
            scores * decay * dt[None, :],
            xv,
            tl.zeros([BLOCK_Q, BLOCK_P], dtype=tl.float32),
            SPLIT,
            UPCAST,
            PRECISION,
        )  # (Q, P)
        # 2. inter-chunk: the start state read by C, C S^T = (S C^T)^T, decayed to each
        # step
        y_in = split_dot(
            S,
            tl.trans(Cm),
            tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32),
            SPLIT,
            UPCAST,
            PRECISION,
        )
        y += tl.trans(y_in) * tl.exp(cs)[:, None]
        if HAS_D:
            y += d_skip * xv.to(tl.float32)
        tl.store(
            y_ptr + (tok * H + hi)[:, None] * P + offs_p[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mx,
        )
        # 3. state passing: decay the state over the chunk, add what the chunk writes
        # (decayed to its end) from each step to the chunk's end
        w = tl.exp(last_row(seg, BLOCK_Q))
        S = split_dot(
            tl.trans(xv.to(tl.float32) * (dt * w)[:, None]),
            Bm,
            tl.exp(total) * S,
            SPLIT,
            UPCAST,
            PRECISION,
        )
    tl.store(sT_ptr + state_off, S, mask=mask_s)


# ----------------------------------------------------------------------------------------------------------
# Wrapper checks
# ----------------------------------------------------------------------------------------------------------

def _check_kernel_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "meta":
        raise ValueError(f"{name} must hold data; got a tensor on the meta device")
    if HAS_TRITON and not runtime.INTERPRETED and t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device for the compiled Triton kernels, got {t.device}")


def _check_dtypes(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16 for the kernel, got {t.dtype} "
                            "(the reference in labsrc.ssm also takes float64)")


def _check_no_grad(**tensors) -> None:
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad: the SSM kernels are inference-only (no backward); "
                                 "call under torch.no_grad() or detach the inputs")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_grid(programs: int) -> None:
    if programs > GRID_AXIS0_LIMIT:
        raise ValueError(f"{programs} programs exceed the launch limit of {GRID_AXIS0_LIMIT} on grid axis 0")


def _packed(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``t`` contiguous in ``dtype`` (its own dtype if None). ``.to`` alone keeps strided/expanded views."""
    if t is None:
        return None
    return t.to(dtype or t.dtype).contiguous()


def _alloc(shape, device, dtype) -> torch.Tensor:
    """Every output buffer comes from here (the tests swap in NaN-filled buffers: each element is written)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs ask for true fp32 dots ("ieee") rather than TF32, so that fp32 means fp32 on a GPU too;
    # 16-bit inputs split their products instead (labsrc.kernels._dots) and never use this precision
    return "ieee"


# ----------------------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------------------

def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + b_t`` along the last dimension, with ``tl.associative_scan``.

    Args:
        a, b: ``(..., l)`` tensors of one dtype (float32/float16/bfloat16), ``l >= 1``; any strides.
        h0: the state before step 0, shape ``a.shape[:-1]`` (zeros when None).

    Returns:
        ``h`` of ``b``'s shape and dtype (computed in float32). Same result as
        :func:`labsrc.ssm.linear_scan_ref`.
    """
    l = check_linear_scan_args(a, b, h0)
    _check_dtypes(a=a, b=b, h0=h0)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    _check_kernel_device("a", a)
    _check_no_grad(a=a, b=b, h0=h0)
    rows = a.numel() // l
    _check_grid(rows)
    if not HAS_TRITON:
        return linear_scan_ref(a, b, h0)
    a2 = _packed(a).reshape(rows, l)
    b2 = _packed(b).reshape(rows, l)
    h0f = (torch.zeros(rows, device=a.device, dtype=torch.float32) if h0 is None
           else _packed(h0, torch.float32).reshape(rows))
    out = _alloc((rows, l), a.device, b.dtype)
    if rows:
        block = min(256 if runtime.INTERPRETED else 1024, triton.next_power_of_2(l))
        _linear_scan_kernel[(rows,)](a2, b2, h0f, out, l, BLOCK_L=block)
    return out.reshape(b.shape)


def _ssd_configs() -> list:
    """The SSD launch on this GPU: the head-dim block, warps and pipeline stages (one entry; a list so that
    ``python -m labsrc.gpucheck --compile-only`` compiles it for each architecture, as it does attention's).

    Each program holds its ``(BLOCK_P, N)`` fp32 state, a chunk's ``(Q, Q)`` and ``(Q, P)`` fp32 tiles and the
    16-bit operands of seven products in registers, and the compile check finds little room: at the GPU
    profile's chunk of 32 steps and ``n = 64`` or ``128``, Ampere compiles without spills only with 32 head
    dims per program on 8 warps without software pipelining, Hopper with 64 on 8 warps (Ampere spilled
    130-1700 bytes with 64, Hopper 48 with 32). Chunks of 64 spilled on every shape tried (170 bytes to 42 KB),
    hence the bench's GPU chunk of 32 (:mod:`labsrc.bench.ssm`; the result is the same up to rounding).
    """
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_P": 64}, num_warps=4, num_stages=1)]
    from labsrc.kernels import flash_attention
    hopper = flash_attention._capability()[0] >= 9
    return [triton.Config({"BLOCK_P": 64 if hopper else 32}, num_warps=8, num_stages=1)]


def scan_warps(block_l: int, block_n: int) -> int:
    """Warps for the selective scan: each thread holds its share of seven (BLOCK_L, BLOCK_N) fp32 tiles (B, C,
    the decays, the inputs, the two scanned tensors, the states). A full 8192-value tile (512 steps of n = 16)
    spilled 64 bytes on sm_80 and sm_90 with 4 warps (``python -m labsrc.gpucheck --compile-only``); 8 warps
    hold it without spilling."""
    return 8 if block_l * block_n >= 8192 else 4


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False):
    """Mamba's selective scan on the GPU (or the interpreter): same arguments and results as
    :func:`labsrc.ssm.selective_scan_ref`.

    Args:
        u, delta, z: ``(b, d, l)``; A: ``(d, n)`` with ``n <= 256``; B, C: ``(b, n, l)``; D, delta_bias:
            ``(d,)``. float32/float16/bfloat16, any strides; A, D, delta_bias are read as float32.
        delta_softplus, return_last_state: bools, as in the reference.

    Returns:
        ``y (b, d, l)`` in ``u``'s dtype, and with ``return_last_state`` the state after the last step
        ``(b, d, n)`` float32.
    """
    bsz, d, l, n = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    _check_bool("delta_softplus", delta_softplus)
    _check_bool("return_last_state", return_last_state)
    _check_dtypes(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    _check_kernel_device("u", u)
    _check_no_grad(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    if n > MAX_STATE:
        raise ValueError(f"A has state size n = {n}; the kernel holds the state in one tile of at most "
                         f"{MAX_STATE}")
    _check_grid(bsz * d)
    if not HAS_TRITON:
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    f32 = torch.float32
    y = _alloc((bsz, d, l), u.device, u.dtype)
    last = _alloc((bsz, d, n), u.device, f32)
    u_, dl_, B_, C_, z_ = (_packed(t) for t in (u, delta, B, C, z))
    A_, D_, bias_ = _packed(A, f32), _packed(D, f32), _packed(delta_bias, f32)
    block_n = triton.next_power_of_2(n)
    cap = 4096 if runtime.INTERPRETED else 8192      # elements of one (BLOCK_L, BLOCK_N) fp32 tile
    block_l = max(16, min(triton.next_power_of_2(l), cap // block_n))
    _selective_scan_kernel[(bsz * d,)](
        u_, dl_, A_, B_, C_, D_ if D_ is not None else A_, z_ if z_ is not None else u_,
        bias_ if bias_ is not None else A_, y, last, d, l, n,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        BLOCK_L=block_l, BLOCK_N=block_n, num_warps=scan_warps(block_l, block_n))
    return (y, last) if return_last_state else y


def ssd(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64):
    """Mamba-2's chunked SSD on the GPU (or the interpreter): same arguments and results as
    :func:`labsrc.ssm.ssd_chunked`.

    Args:
        x: ``(b, l, h, p)``; dt: ``(b, l, h)`` (positive); A: ``(h,)``; B, C: ``(b, l, g, n)`` with
            ``h % g == 0`` and ``n <= 256``; D: ``(h,)``; initial_state: ``(b, h, p, n)``.
            float32/float16/bfloat16, any strides; dt, A, D and initial_state are read as float32.
        chunk_size: the kernel's chunk, a power of two from 16 to 256 (the result does not depend on it,
            up to rounding).

    Returns:
        ``(y, final_state)``: ``y (b, l, h, p)`` in ``x``'s dtype, ``final_state (b, h, p, n)`` float32.
    """
    bsz, l, h, p, g, n = check_ssd_args(x, dt, A, B, C, D, initial_state, chunk_size)
    if chunk_size & (chunk_size - 1) or not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be a power of two from {MIN_CHUNK} to {MAX_CHUNK} for the kernel "
                         f"(tl.dot needs tiles of at least 16), got {chunk_size}")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=initial_state)
    _check_kernel_device("x", x)
    _check_no_grad(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=initial_state)
    if n > MAX_STATE:
        raise ValueError(f"B has state size n = {n}; the kernel holds the state in one tile of at most {MAX_STATE}")
    _check_grid(bsz * h)
    if not HAS_TRITON:
        return ssd_chunked(x, dt, A, B, C, D, initial_state, chunk_size)
    f32 = torch.float32
    y = _alloc((bsz, l, h, p), x.device, x.dtype)
    final = _alloc((bsz, h, p, n), x.device, f32)
    x_, B_, C_ = _packed(x), _packed(B), _packed(C)
    dt_, A_, D_, s0_ = _packed(dt, f32), _packed(A, f32), _packed(D, f32), _packed(initial_state, f32)
    config = _ssd_configs()[0]
    block_p = max(16, min(config.kwargs["BLOCK_P"], triton.next_power_of_2(p)))
    grid = (bsz * h, triton.cdiv(p, block_p))
    _ssd_kernel[grid](
        x_, dt_, A_, B_, C_, D_ if D_ is not None else A_, s0_ if s0_ is not None else final, y, final,
        l, h, g, p, n,
        HAS_D=D is not None, HAS_INIT=initial_state is not None, SPLIT=x.dtype != torch.float32,
        UPCAST=runtime.INTERPRETED, PRECISION=_precision(x.dtype),
        BLOCK_Q=chunk_size, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(n)),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y, final
