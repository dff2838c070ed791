"""Round-to-nearest: the packed INT4/INT8 weight format (``QuantizedWeight``: codes, scales, zero points per
group), quantizing and dequantizing it, and the output error a quantized layer makes.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from labsrc.kernels.kv_quant.codes import pack_codes, unpack_codes


FP16_MAX = 65504.0
SUPPORTED_BITS = (2, 3, 4, 8)


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
