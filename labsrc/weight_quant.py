"""Weight quantization from scratch: round-to-nearest INT8/INT4, LLM.int8()'s outlier split, GPTQ, AWQ, MXFP4
and MXFP4 quantization-aware training (source sections 10.6.1, 10.6.2 and 10.6.5).

Everything here is plain PyTorch; the Triton GEMMs that read the packed weights live in
:mod:`labsrc.kernels.weight_quant`.

Conventions
-----------
Weights are ``nn.Linear``'s ``(out_features, in_features) = (N, K)`` and a layer computes ``y = x @ W.T``.
Groups run along the input dimension ``K``: group ``j`` of row ``n`` is ``W[n, j*g:(j+1)*g]`` (a trailing
partial group when ``g`` does not divide ``K``, as in lab-target's 320- and 864-wide layers); per output
channel is one group of ``K``.

Uniform integer quantization (10.6.1's ``W_int = round(W / scale + zero_point)``) with ``b`` bits and
``L = 2**b - 1``::

    asymmetric:  s = (max(w, 0) - min(w, 0)) / L     z = round(-min(w, 0) / s)
    symmetric:   s = max|w| / (2**(b-1) - 1)         z = 2**(b-1)
    q = clamp(round(w / s) + z, 0, L)                w_hat = (q - z) * s

Codes are unsigned in both cases, so one dequantization rule ``(q - z) * s`` serves every kernel; the
symmetric zero point is the constant ``2**(b-1)`` (the format implies it, so it is not counted in
:attr:`QuantizedWeight.nbytes`). The grid always contains 0 (``min(w, 0)``, ``max(w, 0)``), so a zero weight
(or a column GPTQ zeroes because no activation reaches it) dequantizes to exactly 0. Steps are stored in fp16,
rounded up (so the grid still spans the group and every error stays within half a step, ``|w - w_hat| <=
s/2``), and codes are computed with the stored step; a group whose step overflows fp16 raises a
``ValueError``; an all-zero group gets step 1. ``round`` is PyTorch's round-half-to-even.

Storage: a 4-bit ``qweight`` is packed two codes per byte along ``K`` with chapter 5's planar layout
(:func:`labsrc.kv_quant.pack_codes`: byte ``j`` holds input column ``j`` in its low nibble and column
``j + K/2`` in its high nibble), other bit widths keep one code per byte. :attr:`QuantizedWeight.nbytes`
counts what a packed deployment stores: ``N*K*b/8`` bytes of codes, two bytes per step, and for asymmetric
weights one byte per zero point.

MXFP4 (OCP Microscaling v1.0)
-----------------------------
A block of 32 consecutive elements along ``K`` shares one E8M0 scale ``X = 2**(e - 127)`` (``e`` the stored
byte; 255 is NaN); each element is an E2M1 number (sign, two exponent bits, one mantissa bit: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6). The spec's conversion (section 6.3) takes
``shared_exp = floor(log2(max|V|)) - emax_elem`` with ``emax_elem = 2`` for E2M1, rounds ``V / X`` to the
nearest E2M1 value (ties to even) and clamps to +-6. torchao's default, ``ScaleCalculationMode.FLOOR``, is
this rule, read off the fp32 exponent bits of ``max|V|``; we follow it bit for bit, including its edges:

* the exponent is clamped to E8M0's range: a block whose ``max|V|`` is below ``2**-125`` (zeros, fp32
  subnormals) stores ``e = 0`` (``X = 2**-127``), yet torchao divides by ``2**-126`` (it clamps the divisor to
  the smallest normal fp32 to dodge subnormal arithmetic), so such a block dequantizes to half its value;
* a block holding NaN stores ``e = 255`` and dequantizes to NaN; its codes carry no meaning, but they are
  torchao's too: every element is divided by ``2**128 = inf`` as torchao divides it (finite elements give
  +-0, NaN and inf give NaN), and a NaN gets the code torchao's bit arithmetic gives it
  (:func:`e2m1_encode`); +-inf in a finite block gives ``e = 253`` and code +-6.

Codes are packed two per byte with the *even* element in the low nibble (torchao's ``pack_uint4``), which
differs from the planar INT4 layout above: bit-identity with torchao's packed bytes is part of the contract.

Fake quantization for QAT uses the straight-through estimator: the forward pass sees the MXFP4 round trip
of the weight, the backward pass treats the round trip as the identity (:func:`fake_quant_mxfp4`).
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass

import torch

from labsrc.kv_quant import pack_codes, unpack_codes

__all__ = [
    "QuantizedWeight", "quantize_rtn", "dequantize", "pack_int4", "unpack_int4", "hessian", "gptq_quantize",
    "awq_search_scales", "apply_awq", "absmax_int8", "int8_matmul_outlier", "outlier_columns",
    "mxfp4_quantize", "mxfp4_dequantize", "E2M1_VALUES", "e2m1_encode", "fake_quant_mxfp4",
    "layer_output_error", "LINEAR_NAMES", "linear_layers", "collect_linear_inputs", "quantize_model",
    "model_weight_bytes", "calibration_ids",
]

FP16_MAX = 65504.0
SUPPORTED_BITS = (2, 3, 4, 8)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""The eight E2M1 magnitudes, indexed by the code's low three bits (bit 3 is the sign)."""
MX_BLOCK = 32
_E2M1_EMAX = 2  # exponent of E2M1's largest normal value, 6 = 1.5 * 2**2
_F32_MIN_NORMAL = 2.0 ** -126


# ----------------------------------------------------------------------------------------------- checks
def _check_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return n


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def _check_weight(w, name: str = "w") -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {w.dtype}")
    if w.dim() != 2 or 0 in w.shape:
        raise ValueError(f"{name} must be a non-empty (out_features, in_features) matrix, got shape "
                         f"{tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} holds NaN or inf; a weight must be finite to be quantized")
    return w


def _check_acts(x, k: int, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name} must have shape (..., {k}) (in_features of the weight), got {tuple(x.shape)}")
    return x.reshape(-1, k)


def _check_group_size(group_size, k: int) -> int:
    if group_size is None:
        return k
    return min(_check_int(group_size, "group_size"), k)


# ----------------------------------------------------------------------------------------------- RTN
@dataclass
class QuantizedWeight:
    """A quantized ``(N, K)`` weight: what the kernels of :mod:`labsrc.kernels.weight_quant` take.

    Fields: ``qweight`` uint8 codes, ``(N, K/2)`` planar-packed for 4 bits (:func:`pack_int4`), ``(N, K)``
    otherwise; ``scales`` fp16 ``(N, G)`` and ``zeros`` uint8 ``(N, G)`` with ``G = ceil(K / group_size)``;
    ``bits``; ``group_size`` (``K`` for per-channel); ``shape = (N, K)``; ``symmetric``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    shape: tuple
    symmetric: bool = True

    def validate(self, name: str = "qw") -> "QuantizedWeight":
        """Check every field against the others (ValueError/TypeError naming the field)."""
        _check_bits(self.bits)
        if not (isinstance(self.shape, tuple) and len(self.shape) == 2
                and all(isinstance(s, int) and s > 0 for s in self.shape)):
            raise ValueError(f"{name}.shape must be a tuple (N, K) of positive ints, got {self.shape!r}")
        n, k = self.shape
        g = _check_int(self.group_size, f"{name}.group_size")
        groups = -(-k // g)
        width = k // 2 if self.bits == 4 else k
        if self.bits == 4 and k % 2:
            raise ValueError(f"{name}: a 4-bit weight needs an even in_features K to pack, got K = {k}")
        for field, t, dtype, shape in (("qweight", self.qweight, torch.uint8, (n, width)),
                                       ("scales", self.scales, torch.float16, (n, groups)),
                                       ("zeros", self.zeros, torch.uint8, (n, groups))):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}.{field} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"{name}.{field} must be {dtype}, got {t.dtype}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}.{field} must have shape {shape} for shape {self.shape}, "
                                 f"group_size {g} and {self.bits} bits, got {tuple(t.shape)}")
        return self

    @property
    def codes(self) -> torch.Tensor:
        """The integer codes, uint8 ``(N, K)``."""
        return unpack_int4(self.qweight) if self.bits == 4 else self.qweight

    @property
    def nbytes(self) -> int:
        """Bytes a packed deployment stores: codes at ``bits`` each, fp16 steps, and uint8 zero points when
        asymmetric (the symmetric zero point ``2**(bits-1)`` is implied by the format)."""
        n, k = self.shape
        return math.ceil(n * k * self.bits / 8) + 2 * self.scales.numel() \
            + (0 if self.symmetric else self.zeros.numel())


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``(..., K)`` (K even) to uint8 ``(..., K/2)``, column ``j`` in the low nibble of byte ``j``
    and column ``j + K/2`` in its high nibble: chapter 5's planar layout (:func:`labsrc.kv_quant.pack_codes`)."""
    return pack_codes(codes, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``(..., K/2)`` to codes ``(..., K)``."""
    return unpack_codes(packed, 4)


def _params(
    wg: torch.Tensor, bits: int, symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step (fp32 holding the fp16-rounded value) and integer zero point (fp32) of each
    row of groups ``wg (..., g)``."""
    wg = wg.float()
    if symmetric:
        s = wg.abs().amax(-1) / (2 ** (bits - 1) - 1)
        z = torch.full_like(s, 2.0 ** (bits - 1))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = (hi - lo) / (2 ** bits - 1)
    if bool((s > FP16_MAX).any()):
        raise ValueError(
            f"a group's step {float(s.max()):g} exceeds fp16's range ({FP16_MAX:g}): "
            f"the weight is too large to quantize with fp16 steps"
        )
    s = _fp16_up(s)
    # an all-zero group (or one below fp16's smallest step)
    s = torch.where(s == 0, torch.ones_like(s), s)
    if not symmetric:
        z = torch.round(-lo / s).clamp(0, 2 ** bits - 1)
    return s, z


def _fp16_up(s: torch.Tensor) -> torch.Tensor:
    """``s`` rounded *up* to the next fp16 value (as fp32): a step rounded down would leave the group's
    extreme values outside the grid, and their error could exceed half a step."""
    h = s.half()
    up = torch.nextafter(h, torch.full_like(h, float("inf")))
    return torch.where(h.float() < s, up, h).float()


def _codes(
    w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int,
) -> torch.Tensor:
    """``clamp(round(w / s) + z, 0, 2**bits - 1)`` (``s, z`` broadcast to ``w``), as
    fp32."""
    return torch.clamp(torch.round(w.float() / s) + z, 0, 2 ** bits - 1)


def _expand(p: torch.Tensor, g: int, k: int) -> torch.Tensor:
    """Per-group parameters ``(N, G)`` repeated to one per column ``(N, K)``."""
    return p.repeat_interleave(g, dim=-1)[..., :k]


def _assemble(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, g: int,
              symmetric: bool) -> QuantizedWeight:
    codes = codes.to(torch.uint8)
    n, k = codes.shape
    qweight = pack_int4(codes) if bits == 4 else codes.contiguous()
    return QuantizedWeight(qweight, s.half().contiguous(), z.to(torch.uint8).contiguous(), bits, g, (n, k),
                           symmetric)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int | None = None, symmetric: bool = True, *,
                 per_tensor: bool = False) -> QuantizedWeight:
    """Round-to-nearest quantization of ``w (N, K)``: per output channel (``group_size=None``), per group of
    ``group_size`` input columns, or per tensor (``per_tensor=True``: one step, stored once per row).

    4-bit weights need an even ``K`` (two codes per byte). Raises ValueError/TypeError naming the argument.
    """
    w = _check_weight(w)
    bits = _check_bits(bits)
    n, k = w.shape
    if bits == 4 and k % 2:
        raise ValueError(f"w has in_features K = {k}; 4-bit packing needs an even K")
    g = _check_group_size(group_size, k)
    if per_tensor:
        s, z = _params(w.reshape(1, -1), bits, symmetric)
        s, z, g = s.expand(n, 1), z.expand(n, 1), k
    else:
        groups = -(-k // g)
        pad = groups * g - k
        wp = torch.nn.functional.pad(w.float(), (0, pad)) if pad else w.float()
        # padding with zeros changes nothing: the grid contains 0 anyway
        s, z = _params(wp.reshape(n, groups, g), bits, symmetric)
    codes = _codes(w, _expand(s, g, k), _expand(z, g, k), bits)
    return _assemble(codes, s, z, bits, g, symmetric)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``(q - z) * s`` the codes stand for, ``(N, K)`` in ``dtype`` (computed in fp32)."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    qw.validate()
    n, k = qw.shape
    s = _expand(qw.scales.float(), qw.group_size, k)
    z = _expand(qw.zeros.float(), qw.group_size, k)
    return ((qw.codes.float() - z) * s).to(dtype)


def layer_output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Relative output error ``||x W^T - x W_hat^T||_F / ||x W^T||_F`` of a layer on activations ``x``."""
    x = _check_acts(x, w.shape[1]).detach().double()
    ref = x @ w.detach().double().T
    return float(torch.linalg.norm(ref - x @ w_hat.detach().double().T) / torch.linalg.norm(ref).clamp_min(1e-300))


# ----------------------------------------------------------------------------------------------- outliers
def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """Indices of the input features (columns of ``x (..., K)``) where some ``|x| >= threshold``."""
    x = x.reshape(-1, x.shape[-1])
    return torch.nonzero(x.abs().amax(0) >= threshold).flatten()


def absmax_int8(x: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8: ``(codes int8, scale fp32)`` with ``scale = max|x| / 127`` over ``dim`` (kept,
    broadcastable), or over the whole tensor when ``dim`` is None; ``x ~ codes * scale``."""
    x = x.float()
    m = x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
    scale = torch.where(m > 0, m / 127, torch.ones_like(m))
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def int8_matmul_outlier(x: torch.Tensor, w: torch.Tensor, threshold: float = 6.0,
                        return_outliers: bool = False):
    """LLM.int8()'s ``x @ w.T``: the input features where any ``|x| >= threshold`` are multiplied in full
    precision; the rest with vector-wise INT8 (one absmax scale per row of ``x`` and one per row of ``w``),
    an exact integer product, then the outer product of the two scales.

    Returns ``y (..., N)`` in fp32 (and the outlier column indices when ``return_outliers``). The error of
    the INT8 part is at most ``(|x|_1 s_w + |w|_1 s_x) / 2`` per output plus second order terms, where
    ``s`` are the two steps; with ``threshold=inf`` this is plain vector-wise INT8, and with ``threshold=0``
    (every column an outlier) it is the fp32 matmul.
    """
    w = _check_weight(w)
    lead = x.shape[:-1]
    x2 = _check_acts(x, w.shape[1]).float()
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or math.isnan(threshold) \
            or threshold < 0:
        raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
    cols = (outlier_columns(x2, threshold) if x2.shape[0]
            else torch.empty(0, dtype=torch.long))
    keep = torch.ones(w.shape[1], dtype=torch.bool)
    keep[cols] = False
    y = x2[:, cols] @ w.float()[:, cols].T
    if bool(keep.any()):
        xq, sx = absmax_int8(x2[:, keep], dim=1)
        wq, sw = absmax_int8(w.float()[:, keep], dim=1)
        # The integer product, exact: every partial sum is an integer of magnitude at
        # most K * 127^2, which fp32 holds exactly below 2^24 (K < 1040) and fp64 below
        # 2^53; a float GEMM is far faster on a CPU than an int32 one and gives the same
        # integers an INT8 tensor core accumulates in int32.
        exact = torch.float32 if xq.shape[1] * 127 ** 2 < 2 ** 24 else torch.float64
        acc = (xq.to(exact) @ wq.to(exact).T).float()
        y = y + acc * sx * sw.T
    y = y.reshape(*lead, w.shape[0])
    return (y, cols) if return_outliers else y


# ----------------------------------------------------------------------------------------------- GPTQ
def hessian(x: torch.Tensor) -> torch.Tensor:
    """``H = 2 X^T X / n`` of activations ``x (..., K)`` (``n`` rows): the Hessian of ``||W X - W_hat X||^2 / n``
    with respect to each row of ``W_hat``. Computed in float64, returned as float32 ``(K, K)``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating torch.Tensor, got {type(x).__name__}")
    x = x.reshape(-1, x.shape[-1]).double()
    if x.shape[0] == 0:
        raise ValueError("x has no rows: a Hessian needs at least one activation vector")
    return (2 * x.T @ x / x.shape[0]).float()


def gptq_quantize(
    w: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int | None = 128,
    block_size: int = 128, damp: float = 0.01, act_order: bool = False,
    symmetric: bool = True,
) -> QuantizedWeight:
    """GPTQ (Frantar et al., 2023): quantize ``w (N, K)`` column by column, spreading each column's error over
    the columns not yet quantized so that ``||W X - W_hat X||^2`` stays small.

    With ``Hinv = H^-1`` (after damping ``H += damp * mean(diag H) * I``), quantizing column ``j`` to ``q_j``
    and updating the rest by ``W[:, j+1:] -= (w_j - q_j) / Hinv[j, j] * Hinv[j, j+1:]`` is the optimal
    (OBS) compensation; the successive inverses needed are the rows of the upper Cholesky factor of
    ``H^-1``, so the whole pass uses one Cholesky factorisation. Updates are applied inside a block of
    ``block_size`` columns at once and to the columns after it lazily, as one matrix product per block.

    Columns whose ``H[j, j] = 0`` (no calibration input reaches them) are set to 0 and their diagonal to 1.
    ``group_size`` steps are found on the up-to-date columns when the pass reaches a group's first column;
    with ``act_order`` (columns in order of decreasing ``H[j, j]``) the steps are those of the contiguous
    groups of the original weight ("static groups"), so the storage format does not change.
    """
    w = _check_weight(w)
    bits = _check_bits(bits)
    n, k = w.shape
    if bits == 4 and k % 2:
        raise ValueError(f"w has in_features K = {k}; 4-bit packing needs an even K")
    if not isinstance(H, torch.Tensor) or not H.is_floating_point():
        raise TypeError(f"H must be a floating torch.Tensor, got {type(H).__name__}")
    if tuple(H.shape) != (k, k):
        raise ValueError(
            f"H must be ({k}, {k}) for a weight with K = {k} columns, got {tuple(H.shape)}"
        )
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H holds NaN or inf")
    g = _check_group_size(group_size, k)
    block_size = _check_int(block_size, "block_size")
    if not isinstance(damp, (int, float)) or isinstance(damp, bool) or not damp >= 0:
        raise ValueError(f"damp must be a non-negative number, got {damp!r}")
    W = w.clone().double()
    H = H.clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    groups = -(-k // g)
    scales = torch.zeros(n, groups, dtype=torch.float32)
    zeros = torch.zeros(n, groups, dtype=torch.float32)
    perm = torch.arange(k)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        for j in range(groups):
            # static groups: steps from the original (dead-zeroed) weight
            scales[:, j], zeros[:, j] = _params(
                W[:, j * g : (j + 1) * g], bits, symmetric
            )
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2]  # a view: in-block updates land in W
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            grp = col // g
            if not act_order and (i1 + i) % g == 0:
                scales[:, grp], zeros[:, grp] = _params(
                    W[:, i1 + i : i1 + i + g], bits, symmetric
                )
            s, z = scales[:, grp].double(), zeros[:, grp].double()
            wc = W1[:, i]
            q = (torch.clamp(torch.round(wc / s) + z, 0, 2 ** bits - 1))
            Q[:, i1 + i] = q
            err = (wc - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    codes = torch.empty_like(Q)
    codes[:, perm] = Q
    return _assemble(codes, scales, zeros, bits, g, symmetric)


# ----------------------------------------------------------------------------------------------- AWQ
def awq_search_scales(
    w: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int | None = 128,
    grid: int = 20, symmetric: bool = True,
) -> torch.Tensor:
    """AWQ (Lin et al., 2024): one positive scale per input channel, ``s = mean|x|^alpha`` (normalised so that
    ``max(s) * min(s) = 1``), with ``alpha`` in ``{0, 1/grid, ..., (grid-1)/grid}`` chosen to minimise the
    output error ``||x W^T - (x diag(s)^-1) Q(W diag(s))^T||^2`` on the calibration activations ``x (..., K)``.

    ``alpha = 0`` is plain RTN (``s = 1``), so on ``x`` the chosen scales never do worse than RTN. A channel
    that no activation reaches gets ``mean|x|`` floored at ``1e-4`` before the power.
    """
    w = _check_weight(w)
    x2 = _check_acts(x, w.shape[1]).float()
    bits = _check_bits(bits)
    grid = _check_int(grid, "grid")
    if x2.shape[0] == 0:
        raise ValueError("x has no rows: AWQ needs calibration activations")
    mean = x2.abs().mean(0).clamp_min(1e-4).double()
    ref = x2 @ w.float().T
    best, best_s = None, torch.ones(w.shape[1])
    for i in range(grid):
        s = mean ** (i / grid)
        s = (s / torch.sqrt(s.max() * s.min())).float()
        w_hat = dequantize(quantize_rtn(w.float() * s, bits, group_size, symmetric)) / s
        err = float(((ref - x2 @ w_hat.T).double() ** 2).sum())
        if best is None or err < best:
            best, best_s = err, s
    return best_s


def apply_awq(w: torch.Tensor, s: torch.Tensor, bits: int = 4, group_size: int | None = 128,
              symmetric: bool = True) -> QuantizedWeight:
    """Quantize ``W diag(s)`` (RTN); the layer then computes ``(x / s) @ dequantize(qw).T``. In a deployed
    model ``1/s`` is folded into the operation before the layer (an RMSNorm's weight or the previous linear),
    so the division costs nothing; in full precision ``(x diag(s)^-1)(W diag(s))^T = x W^T`` exactly."""
    w = _check_weight(w)
    if not isinstance(s, torch.Tensor) or s.shape != (w.shape[1],) or not bool((s > 0).all()):
        raise ValueError(f"s must be a positive tensor of shape ({w.shape[1]},), one scale per input channel")
    return quantize_rtn((w.float() * s.float()), bits, group_size, symmetric)


# ----------------------------------------------------------------------------------------------- MXFP4
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``v`` to the nearest E2M1 value, ties to even, saturating at +-6: uint8 codes 0..15 (bit 3 the
    sign, taken from ``v``'s sign bit, so -0.0 and small negatives give code 8).

    E2M1 has no NaN. A NaN gets the code torchao's conversion gives it, so that packed bytes match torchao's:
    torchao runs a NaN's bit pattern through its normal-number rounding arithmetic, which yields a magnitude
    code of 2, 3 or 4 depending on the NaN's payload (3 for the usual quiet NaN, 4 for the all-ones payload a
    bf16 NaN has), with the NaN's sign bit. The code carries no meaning: only a block whose scale is 255
    (NaN) holds NaN elements, and it dequantizes to NaN whatever its codes say."""
    v = v.float()
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
    for t in (0.25, 1.25, 2.5, 5.0):
        # midpoints whose tie rounds down to an even code
        code += (a > t).int()
    for t in (0.75, 1.75, 3.5):         # midpoints whose tie rounds up to an even code
        code += (a >= t).int()
    nan = torch.isnan(v)
    if bool(nan.any()):
        # torchao's _f32_to_floatx_unpacked for E2M1 on |v|'s bits: add the exponent
        # rebias, the rounding constant and the odd-mantissa bit, shift to the 1-bit
        # mantissa, keep the low byte
        bits = v.view(torch.int32) & 0x7FFFFFFF
        rounded = (
            bits + ((1 - 127) << 23) + ((1 << 21) - 1) + ((bits >> 22) & 1)
        ) >> 22
        code = torch.where(nan, rounded & 0xFF, code)
    return (code | (torch.signbit(v).int() << 3)).to(torch.uint8)


def _pack_even_low(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_even_low(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def mxfp4_quantize(
    x: torch.Tensor, block_size: int = MX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: ``x (..., K)`` (fp32, fp16 or bf16; ``K`` a multiple of ``block_size``) to
    ``(codes uint8 (..., K/2), scales uint8 (..., K/block_size))``: E2M1 codes two per byte (even element in
    the low nibble) and biased E8M0 exponents. The OCP rule with torchao's edges (module docstring)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    block_size = _check_int(block_size, "block_size")
    if block_size % 2:
        raise ValueError(
            f"block_size must be even (two codes per byte), got {block_size}"
        )
    if x.dim() < 1 or x.shape[-1] % block_size:
        raise ValueError(
            f"x's last dimension must be a multiple of block_size={block_size}, got shape "
            f"{tuple(x.shape)}"
        )
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = xb.abs().amax(-1, keepdim=True)
    # floor(log2(amax)) from the fp32 exponent field (a subnormal or zero amax reads as
    # -127)
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    e = torch.clamp(exp - _E2M1_EMAX, -127, 128) + 127
    e = torch.where(torch.isnan(amax), torch.full_like(e, 255), e)
    divisor = (e.to(torch.int32) << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
    codes = e2m1_encode(xb / divisor).reshape(x.shape)
    return _pack_even_low(codes), e.squeeze(-1).to(torch.uint8)


def mxfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp4_quantize`: ``E2M1(code) * 2**(scale - 127)`` (scale 255: NaN), ``(..., K)``."""
    for name, t in (("codes", codes), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"codes and scales must be uint8 (scales may be float8_e8m0fnu), got {codes.dtype} "
                        f"and {scales.dtype}")
    k = codes.shape[-1] * 2
    if codes.shape[:-1] != scales.shape[:-1] or scales.shape[-1] == 0 or k % scales.shape[-1]:
        raise ValueError(f"codes (..., K/2) and scales (..., K/block) do not match: {tuple(codes.shape)} and "
                         f"{tuple(scales.shape)}")
    block = k // scales.shape[-1]
    c = _unpack_even_low(codes).long()
    mag = E2M1_VALUES.to(codes.device)[c & 7]
    val = torch.where((c & 8) > 0, -mag, mag)
    sc = torch.ldexp(torch.ones(scales.shape, device=codes.device), scales.int() - 127)
    sc = torch.where(scales == 255, torch.full_like(sc, float("nan")), sc)
    return (val.reshape(*c.shape[:-1], -1, block) * sc[..., None]).reshape(c.shape).to(dtype)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        codes, scales = mxfp4_quantize(w.detach())
        return mxfp4_dequantize(codes, scales, w.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


def fake_quant_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """``w``'s MXFP4 round trip in the forward pass; the straight-through estimator in the backward pass
    (the gradient flows to ``w`` as if the round trip were the identity)."""
    return _STE.apply(w)


# ----------------------------------------------------------------------------------------------- a model
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_layers(model) -> list[tuple[str, torch.nn.Linear]]:
    """The decoder's linear layers ``(name, module)`` in forward order (the embedding and the output head
    stay in full precision, as GPTQ and AWQ leave them)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for name in LINEAR_NAMES:
            part = layer.self_attn if name in LINEAR_NAMES[:4] else layer.mlp
            out.append((f"layers.{i}.{name}", getattr(part, name)))
    return out


def calibration_ids(tokenizer, n_windows: int, length: int, split: str = "train", seed: int = 0) -> torch.Tensor:
    """``(n_windows, length)`` token windows from the lab corpus (BOS first), drawn at seeded offsets."""
    from labsrc.tasks import corpus_ids

    ids = corpus_ids(tokenizer, split)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n_windows,), generator=gen)
    bos = torch.tensor([tokenizer.bos_token_id])
    return torch.stack([torch.cat([bos, ids[s:s + length - 1]]) for s in starts.tolist()])


@torch.no_grad()
def collect_linear_inputs(model, input_ids: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
    """The inputs ``(tokens, K)`` each named linear layer sees when ``model`` reads ``input_ids``."""
    layers = dict(linear_layers(model))
    names = list(layers) if names is None else list(names)
    seen, hooks = {}, []
    for name in names:
        hooks.append(layers[name].register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, args[0].detach().reshape(-1, args[0].shape[-1]))))
    try:
        model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


class AWQLinear(torch.nn.Module):
    """A linear layer with AWQ's input scaling kept explicit: ``(x / s) @ W_hat^T``."""

    def __init__(self, w_hat: torch.Tensor, s: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(w_hat, requires_grad=False)
        self.register_buffer("inv_s", 1.0 / s)

    def forward(self, x):
        return torch.nn.functional.linear(x * self.inv_s.to(x.dtype), self.weight)


def _set_module(model, name: str, module) -> None:
    _, i, last = name.split(".")
    layer = model.model.layers[int(i)]
    setattr(layer.self_attn if last in LINEAR_NAMES[:4] else layer.mlp, last, module)


@torch.no_grad()
def quantize_model(model, method: str, calib_ids: torch.Tensor | None = None, bits: int = 4,
                   group_size: int | None = 128, symmetric: bool = True, **kw):
    """A copy of ``model`` whose decoder linears hold the dequantized weights of ``method``, and the weight bytes.

    ``method``: ``"rtn"``, ``"gptq"``, ``"awq"`` (both calibrated on ``calib_ids``, layer by layer: the
    inputs of layer ``i`` come from the model whose layers before ``i`` are already quantized) or
    ``"mxfp4"``. Returns ``(model_copy, bytes of the decoder linears as stored)``. The copy computes with
    dequantized fp32 weights: the same numbers the Triton GEMMs produce from the packed ones.
    """
    if method not in ("rtn", "gptq", "awq", "mxfp4"):
        raise ValueError(f"method must be 'rtn', 'gptq', 'awq' or 'mxfp4', got {method!r}")
    if method in ("gptq", "awq") and calib_ids is None:
        raise ValueError(f"{method} needs calib_ids")
    q = copy.deepcopy(model)
    total = 0
    names = [n for n, _ in linear_layers(q)]
    for i in range(len(q.model.layers)):
        layer_names = [n for n in names if n.startswith(f"layers.{i}.")]
        inputs = collect_linear_inputs(q, calib_ids, layer_names) if method in ("gptq", "awq") else {}
        mods = dict(linear_layers(q))
        for name in layer_names:
            w = mods[name].weight.float()
            if method == "mxfp4":
                codes, scales = mxfp4_quantize(w)
                mods[name].weight.copy_(mxfp4_dequantize(codes, scales))
                total += codes.numel() + scales.numel()
            elif method == "awq":
                s = awq_search_scales(w, inputs[name], bits, group_size, symmetric=symmetric, **kw)
                qw = apply_awq(w, s, bits, group_size, symmetric)
                _set_module(q, name, AWQLinear(dequantize(qw), s))
                total += qw.nbytes + 2 * s.numel()  # the fp16 scales until folded
            else:
                qw = (gptq_quantize(w, hessian(inputs[name]), bits, group_size, symmetric=symmetric, **kw)
                      if method == "gptq" else quantize_rtn(w, bits, group_size, symmetric))
                mods[name].weight.copy_(dequantize(qw))
                total += qw.nbytes
    return q, total


def model_weight_bytes(model, bytes_per_weight: float = 4.0) -> int:
    """Bytes of the decoder's linear weights stored at ``bytes_per_weight`` each (4 for fp32, 2 for fp16)."""
    return int(sum(m.weight.numel() for _, m in linear_layers(model)) * bytes_per_weight)


def torchao_mx():
    """torchao's MX functions ``(to_mx, to_dtype)``, for the tests and the chapter's comparison.

    Importing torchao on a machine without its compiled extensions logs "Failed to load ... .so" lines and
    pytree deprecation warnings; :mod:`labsrc.runtime` (imported with :mod:`labsrc`) drops exactly those two
    messages, whoever imports torchao first (transformers does, on any model load), so the page shows no stderr.
    """
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    return to_mx, to_dtype


# ----------------------------------------------------------------------------------------------- experiment
class Int8OutlierLinear(torch.nn.Module):
    """A linear layer computed by :func:`int8_matmul_outlier` (LLM.int8(): outlier features in fp32)."""

    def __init__(self, weight: torch.Tensor, threshold: float = 6.0):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.threshold = threshold

    def forward(self, x):
        return int8_matmul_outlier(x, self.weight, self.threshold).to(x.dtype)


def int8_model(model, threshold: float = 6.0):
    """A copy of ``model`` whose decoder linears run LLM.int8() (weights and activations in INT8, outlier
    features in fp32), and the weight bytes (int8 codes plus an fp16 absmax per output row)."""
    q = copy.deepcopy(model)
    total = 0
    for name, mod in linear_layers(q):
        _set_module(q, name, Int8OutlierLinear(mod.weight, threshold))
        total += mod.weight.numel() + 2 * mod.weight.shape[0]
    return q, total


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """Mean next-token loss (nats) of each window ``(n, T)``: float64 ``(n,)``."""
    out = []
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size]
        logits = model(input_ids=x).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        out.append(nll.double().mean(1))
    return torch.cat(out)


def activation_outliers(model, input_ids: torch.Tensor) -> dict[str, float]:
    """For each decoder linear, its largest input channel's max ``|x|`` over the median channel's."""
    acts = collect_linear_inputs(model, input_ids)
    out = {}
    for name, x in acts.items():
        per_channel = x.abs().amax(0)
        out[name] = float(per_channel.max() / per_channel.median().clamp_min(1e-12))
    return out


def qat_mxfp4(model, tokenizer, steps: int, lr: float = 1e-4, seq_len: int = 256, batch_size: int = 2,
              fake_quant: bool = True, seed: int = 0):
    """Fine-tune a copy of ``model`` with its decoder linears fake-quantized to MXFP4 in the forward pass
    (straight-through estimator), on the lab's training mixture (:func:`labsrc.rope_finetune.finetune`); return
    ``(copy with the trained weights quantized to MXFP4, losses, the trained full-precision copy)``.
    ``fake_quant=False`` is the control: the same steps in full precision, then MXFP4 PTQ."""
    from torch.nn.utils import parametrize

    from labsrc.rope_finetune import finetune

    class _FakeQuant(torch.nn.Module):
        def forward(self, w):
            return fake_quant_mxfp4(w)

    m = copy.deepcopy(model)
    if fake_quant:
        for _, mod in linear_layers(m):
            parametrize.register_parametrization(mod, "weight", _FakeQuant())
    losses = finetune(m, tokenizer, seq_len, steps, lr=lr, batch_size=batch_size, seed=seed)
    if fake_quant:
        for _, mod in linear_layers(m):
            parametrize.remove_parametrizations(mod, "weight", leave_parametrized=False)
    q, _ = quantize_model(m, "mxfp4")
    return q, losses, m


PROBES = ("needle", "variable_tracking")
"""The in-context probes every configuration of :func:`run_experiment` is scored on (eval-card settings:
the needle with 3 distractors, variable tracking over 2 hops; :data:`labsrc.models.train.PROBE_SETTINGS`).

Why these two: they are the eval card's probes that lab-target answers about half the time in full
precision (see its eval card), so a configuration can move them either way, and each sample is one
right-or-wrong answer, so every point has a Wilson interval. The pass key is saturated, and MQAR and passage
copying score fractions of a sample (no Wilson interval); and the budget allows two probes: at n = 100 one
probe costs 40-70 s per configuration (one thread of a busy 2-core CPU, 921-token samples; LLM.int8()'s
split product is several times slower), and the run scores 16 configurations: the stored run took 42
minutes, nice'd on a 2-core machine shared with a training run."""


ONE_ANSWER_PROBES = ("passkey", "needle", "variable_tracking")
"""The eval-card probes whose samples are each one right-or-wrong answer (what :func:`score_probes` counts)."""


def probe_context(model) -> int:
    """The probes' context: :data:`labsrc.models.train.PROBE_FRACTION` (0.9) of the context ``model`` was
    trained at, as on its eval card (room for the question at the end of a context it was trained on)."""
    from labsrc.models import train

    return int(train.PROBE_FRACTION * train.trained_context(model))


def probe_sets(tokenizer, probes, context_len: int, n: int = 100, seed: int = 0) -> dict:
    """``{probe: samples}``: the eval card's ``n`` samples at ``context_len`` tokens of each probe of
    ``probes`` (names from :data:`ONE_ANSWER_PROBES`; :func:`labsrc.models.train.probe_set`), drawn by the
    probes' own seeded generators (validation split, seeded by the probe's name and ``seed``, never by
    training's seed), so the full-precision model's answers are its eval card's, sample for sample."""
    from labsrc.models import train

    if not probes or any(p not in ONE_ANSWER_PROBES for p in probes):
        raise ValueError(f"probes must name eval-card probes with one right-or-wrong answer per sample "
                         f"({', '.join(ONE_ANSWER_PROBES)}; MQAR and passage copying score fractions of a "
                         f"sample), got {probes!r}")
    return {p: train.probe_set(tokenizer, p, context_len, n, seed) for p in probes}


def score_probes(model, sets: dict) -> dict[str, list[int]]:
    """``{probe: per-sample 1/0}``: whether greedy decoding answers each sample right (every answer span of
    it; these probes have one)."""
    from labsrc import tasks

    return {p: [int(all(r)) for r in tasks.score(model, samples)] for p, samples in sets.items()}


def run_experiment(model_name: str = "lab-target", calib_windows: int = 4, calib_len: int = 512,
                   eval_windows: int = 8, eval_len: int = 512, probe_n: int = 100, probes=PROBES,
                   probe_seed: int = 0, qat_steps: int = 60, qat_lr: float = 1e-4, seed: int = 0, log=print,
                   reuse: dict | None = None) -> dict:
    """The chapter's experiment: lab-target under every method; per-window losses and per-sample probe answers.

    Returns a JSON-ready dict: ``configs`` (name -> ``bytes`` of the decoder linears as stored, ``nll`` per
    evaluation window, ``probes``: for each probe of ``probes`` the 1/0 answer of each of its ``probe_n``
    samples at ``probe_ctx`` tokens, 0.9 of the trained context; ``seconds`` it took), ``weights`` (the
    number of decoder linear weights, so bits per weight is ``8 * bytes / weights``), the QAT loss curves,
    the layer-wise output errors of RTN, GPTQ and AWQ (4 bits, g128) on held-out activations, and the
    activation outlier ratios. ``seed`` draws the calibration and evaluation windows and the fine-tuning;
    ``probe_seed`` is the probes' own (the eval card's is 0), so the fp32 answers are the eval card's.

    The configurations run from 32 bits down to 2 (RTN and GPTQ at 4, 3 and 2 bits with groups of 128),
    so the probes trace a curve across bits instead of one saturated point.

    ``reuse``: an earlier result with the same settings; configurations (and the layer errors) it already
    holds are taken from it instead of being recomputed. Every step is deterministic (seeded windows,
    calibration and fine-tuning; one thread), so this gives the numbers a full run gives.
    """
    import time

    from labsrc import models
    from labsrc.curves import samples_digest

    model, tok = models.load(model_name)
    calib = calibration_ids(tok, calib_windows, calib_len, "train", seed)
    evals = calibration_ids(tok, eval_windows, eval_len, "validation", seed + 1)
    probe_ctx = probe_context(model)
    sets = probe_sets(tok, tuple(probes), probe_ctx, probe_n, probe_seed)
    result = {"model": model_name, "calib_windows": calib_windows, "calib_len": calib_len,
              "eval_windows": eval_windows, "eval_len": eval_len, "probe_ctx": probe_ctx,
              "probe_n": probe_n, "probe_seed": probe_seed, "probes": list(probes),
              "probe_samples_digest": {p: samples_digest(s) for p, s in sets.items()}, "configs": {}}
    old = {}
    if reuse is not None:
        same = all(reuse.get(k) == v for k, v in result.items() if k != "configs") \
            and reuse.get("qat_steps", qat_steps) == qat_steps
        if not same:
            raise ValueError("reuse holds a result with other settings; run without it")
        old = reuse.get("configs", {})
    result["qat_steps"] = qat_steps
    result["weights"] = sum(m.weight.numel() for _, m in linear_layers(model))

    def add(name, make):
        if name in old:
            result["configs"][name] = old[name]
            log(f"{name}: reused")
            return
        t = time.time()
        m, nbytes = make()
        nll = window_nll(m, evals)
        answers = score_probes(m, sets)
        result["configs"][name] = {"bytes": int(nbytes), "nll": nll.tolist(), "probes": answers,
                                   "seconds": round(time.time() - t, 1)}
        right = ", ".join(f"{p} {sum(a)}/{len(a)}" for p, a in answers.items())
        log(f"{name}: {nbytes} bytes, ppl {math.exp(float(nll.mean())):.3f}, {right} "
            f"({time.time() - t:.0f}s)")

    add("fp32", lambda: (model, model_weight_bytes(model, 4)))
    add("fp16", lambda: (copy.deepcopy(model).half().float(), model_weight_bytes(model, 2)))
    add("LLM.int8", lambda: int8_model(model))
    add("RTN INT8", lambda: quantize_model(model, "rtn", bits=8, group_size=None))
    add("RTN INT4 per-channel", lambda: quantize_model(model, "rtn", bits=4, group_size=None))
    add("RTN INT4 g128", lambda: quantize_model(model, "rtn", bits=4, group_size=128))
    add("GPTQ INT4 g128", lambda: quantize_model(model, "gptq", calib, bits=4, group_size=128))
    add("AWQ INT4 g128", lambda: quantize_model(model, "awq", calib, bits=4, group_size=128))
    add("RTN INT3 g128", lambda: quantize_model(model, "rtn", bits=3, group_size=128))
    add("GPTQ INT3 g128", lambda: quantize_model(model, "gptq", calib, bits=3, group_size=128))
    add("RTN INT2 g128", lambda: quantize_model(model, "rtn", bits=2, group_size=128))
    add("GPTQ INT2 g128", lambda: quantize_model(model, "gptq", calib, bits=2, group_size=128))
    add("MXFP4 PTQ", lambda: quantize_model(model, "mxfp4"))
    mx_bytes = quantize_model(model, "mxfp4")[1]
    if qat_steps:
        for name, fq in (("MXFP4 QAT", True), ("MXFP4 PTQ after FP fine-tune", False)):
            needed = [name] + ([] if fq else ["FP fine-tune"])
            if all(n in old for n in needed) and name in (reuse or {}).get("qat_losses", {}):
                result.setdefault("qat_losses", {})[name] = reuse["qat_losses"][name]
                for n in needed:
                    add(n, None)
                continue
            t = time.time()
            m, losses, fp_tuned = qat_mxfp4(model, tok, qat_steps, qat_lr, fake_quant=fq, seed=seed)
            result.setdefault("qat_losses", {})[name] = losses
            log(f"{name}: {qat_steps} steps in {time.time() - t:.0f}s")
            old.pop(name, None)
            add(name, lambda: (m, mx_bytes))
            if not fq:  # the fine-tuned model itself, unquantized: QAT's full-precision reference
                old.pop("FP fine-tune", None)
                add("FP fine-tune", lambda: (fp_tuned, model_weight_bytes(model, 4)))
    if reuse is not None and "layer_errors" in reuse and "outlier_ratio" in reuse:
        result["layer_errors"], result["outlier_ratio"] = reuse["layer_errors"], reuse["outlier_ratio"]
        return result
    # layer-wise output error on held-out activations (the evaluation windows) of the fp model
    held = collect_linear_inputs(model, evals[:2])
    calib_acts = collect_linear_inputs(model, calib)
    errs = {"RTN": [], "GPTQ": [], "AWQ": []}
    names = []
    for name, mod in linear_layers(model):
        w, xc, xh = mod.weight.detach().float(), calib_acts[name], held[name]
        names.append(name)
        errs["RTN"].append(layer_output_error(w, dequantize(quantize_rtn(w, 4, 128)), xh))
        errs["GPTQ"].append(layer_output_error(w, dequantize(gptq_quantize(w, hessian(xc), 4, 128)), xh))
        s = awq_search_scales(w, xc, 4, 128)
        errs["AWQ"].append(layer_output_error(w, dequantize(apply_awq(w, s, 4, 128)) / s, xh))
    result["layer_errors"] = {"layers": names, **errs}
    result["outlier_ratio"] = activation_outliers(model, evals[:2])
    return result


def main(argv=None) -> None:
    """``python -m labsrc.weight_quant [--out PATH] [--qat-steps N] ...``: run :func:`run_experiment` and
    write its JSON (the chapter's stored results, ``labsrc/data/results/weight_quant.json`` by default)."""
    import argparse
    import json
    from pathlib import Path

    from labsrc.models.stored_runs import models_stamp

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default=str(RESULTS_PATH))
    parser.add_argument("--eval-windows", type=int, default=24)
    parser.add_argument("--probe-n", type=int, default=100, help="samples per probe and configuration")
    parser.add_argument("--probes", nargs="+", default=list(PROBES),
                        help=f"eval-card probes to score every configuration on (default: {' '.join(PROBES)})")
    parser.add_argument("--calib-windows", type=int, default=8)
    parser.add_argument("--qat-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse", action="store_true",
                        help="keep the configurations already in --out (same settings) and compute the rest")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reuse = json.loads(Path(args.out).read_text()) if args.reuse and Path(args.out).is_file() else None
    result = run_experiment(calib_windows=args.calib_windows, eval_windows=args.eval_windows,
                            probe_n=args.probe_n, probes=tuple(args.probes), qat_steps=args.qat_steps,
                            log=lambda m: print(m, flush=True), reuse=reuse)
    result["command"] = (f"python -m labsrc.weight_quant --eval-windows {args.eval_windows} --probe-n "
                         f"{args.probe_n} --probes {' '.join(args.probes)} --calib-windows "
                         f"{args.calib_windows} --qat-steps {args.qat_steps}")
    result["models"] = models_stamp("lab-target")  # labsrc.models.stored_runs: tells a stale file
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


RESULTS_PATH = __import__("pathlib").Path(__file__).resolve().parent / "data" / "results" / "weight_quant.json"

if __name__ == "__main__":
    main()
