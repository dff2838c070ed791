"""The integer codes of a quantized cache: the supported widths, a scale and zero point per group, rounding to
codes, and packing several codes into a byte or a 32-bit word and back.
"""
from __future__ import annotations

import operator

import torch


SUPPORTED_BITS = (2, 3, 4, 8)
GRANULARITIES = ("group", "token", "channel")
STORE_BYTES = 2  # scales, zero points and statistics are stored in fp16
FP16_MAX = 65504.0  # the largest finite fp16: a step, zero point or statistic must not exceed it
_MIN_STD = 1e-4  # a constant channel would otherwise divide by zero


# ----------------------------------------------------------------------------------------------- validation
def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def pack_unit(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of one packing unit: ``8 // bits`` codes in one byte for 2, 4 and 8 bits, eight codes
    in three bytes for 3 bits. ``head_dim`` must be a multiple of ``codes``; a token row of ``d`` channels
    takes ``d // codes * bytes`` bytes (``d * bits / 8``)."""
    _check_bits(bits)
    return (8, 3) if bits == 3 else (8 // bits, 1)


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes of one token row of ``head_dim`` packed ``bits``-bit codes (``head_dim * bits / 8``)."""
    codes, nbytes = pack_unit(bits)
    return head_dim // codes * nbytes


def _check_int(value, name: str, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum`` (numpy integers too; bools and floats are refused), else a
    ValueError naming ``name``."""
    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return n


def _check_group_size(group_size) -> int:
    return _check_int(group_size, "group_size")


def _check_granularity(granularity) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


def _check_x(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (..., tokens, head_dim), got shape {tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} has head_dim 0")
    return x


# ----------------------------------------------------------------------------------------------- the quantizer
def _scale_zero(xmin: torch.Tensor, xmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scale_zero` without its overflow check: a group whose ``s`` or ``z`` does not fit in fp16 comes
    back with a non-finite ``s`` or ``z``; a non-finite ``xmin``/``xmax`` gives NaN for both."""
    levels = float(2 ** bits - 1)
    xmin, xmax = xmin.float(), xmax.float()
    z = (xmin - xmin.abs() * 2.0 ** -10 - 2.0 ** -24).to(torch.float16)
    s = ((xmax - z.float()) / levels)
    s = (s + s * 2.0 ** -10 + 2.0 ** -24).to(torch.float16)
    finite = torch.isfinite(xmin) & torch.isfinite(xmax)
    nan = torch.tensor(float("nan"), dtype=torch.float16, device=s.device)
    return torch.where(finite, s, nan), torch.where(finite, z, nan)


def _overflow_error(name: str, index: tuple, lo: float, hi: float, bits: int, normalized: bool) -> ValueError:
    """The error for a group whose fp16 step or zero point would overflow (module docstring)."""
    where = "normalised values" if normalized else "values"
    hint = (" With KVarN normalisation this usually means a channel whose calibrated std is tiny (it is floored "
            f"at {_MIN_STD:g}) deviates later: recalibrate on data that exercises it, or quantize without "
            "normalisation." if normalized else
            " Use more bits, smaller groups, or rescale the tensor.")
    return ValueError(
        f"{name}: quantization group {index} holds {where} in [{lo:.6g}, {hi:.6g}]; its {bits}-bit step "
        f"(range / {2 ** bits - 1}) or zero point (the minimum) does not fit in fp16, whose largest value is "
        f"{FP16_MAX:g}, so the group would dequantize to NaN.{hint}")


def scale_zero(xmin: torch.Tensor, xmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``s`` and zero point ``z`` (both fp16) of groups with minimum ``xmin`` and maximum ``xmax``.

    ``z`` is ``xmin`` rounded down and ``s = (xmax - z) / (2**bits - 1)`` rounded up when stored in fp16 (a
    relative margin of 2^-10 plus 2^-24 is more than fp16's rounding error), so the grid still covers the
    group and no element is clamped. A constant group gets a tiny positive step and is reconstructed exactly
    up to that step.

    A group with a non-finite ``xmin`` or ``xmax`` (it held a NaN or an infinity) gets NaN for both. A
    finite group whose ``s`` or ``z`` exceeds fp16's range (``|z| > 65504`` or ``s > 65504``) raises a
    ``ValueError`` naming the group: storing ``inf`` would make the whole group dequantize to NaN.
    """
    for name, t in (("xmin", xmin), ("xmax", xmax)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating torch.Tensor, got {type(t).__name__}")
    if xmin.shape != xmax.shape:
        raise ValueError(f"xmin shape {tuple(xmin.shape)} != xmax shape {tuple(xmax.shape)}")
    _check_bits(bits)
    s, z = _scale_zero(xmin, xmax, bits)
    over = torch.isfinite(xmin) & torch.isfinite(xmax) & ~(torch.isfinite(s) & torch.isfinite(z))
    if bool(over.any()):
        i = tuple(int(j) for j in over.nonzero()[0])
        raise _overflow_error("xmin/xmax", i, float(xmin[i]), float(xmax[i]), bits, normalized=False)
    return s, z


def quantize_codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``clamp(floor((x - z)/s + 1/2), 0, 2**bits - 1)`` as uint8 (``s, z`` broadcast to ``x``).

    Where ``(x - z)/s`` is not a number (a NaN group, whose ``s`` and ``z`` are NaN) the code is 0, so the
    result never depends on how the platform casts NaN to an integer.
    """
    _check_bits(bits)
    levels = 2 ** bits - 1
    v = (x.float() - z.float()) / s.float()
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    return torch.floor(v + 0.5).clamp_(0, levels).to(torch.uint8)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``(..., D)`` into uint8 ``(..., D * bits / 8)`` bytes in the planar layout (module docstring).

    ``q`` must be an integer tensor with values in ``[0, 2**bits - 1]`` (TypeError / ValueError naming ``q``
    otherwise): a code out of range would spill into its neighbour's bits.
    """
    _check_bits(bits)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
        raise TypeError(f"q must be an integer tensor of codes, got dtype {q.dtype}")
    if q.dim() < 1:
        raise ValueError("q must have at least one (channel) dimension")
    levels = 2 ** bits - 1
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > levels):
        raise ValueError(f"q must hold {bits}-bit codes in [0, {levels}], got values in "
                         f"[{int(q.min())}, {int(q.max())}]")
    per, _ = pack_unit(bits)
    d = q.shape[-1]
    if d % per:
        raise ValueError(f"head_dim {d} must be a multiple of {per} to pack {bits}-bit codes")
    if bits == 3:  # eight codes to a 24-bit word, stored as three byte planes (module docstring)
        dw = d // 8
        word = torch.zeros(*q.shape[:-1], dw, dtype=torch.int32, device=q.device)
        for k in range(8):
            word |= q[..., k * dw:(k + 1) * dw].to(torch.int32) << (3 * k)
        return torch.cat([((word >> (8 * i)) & 255).to(torch.uint8) for i in range(3)], dim=-1)
    if per == 1:
        return q.to(torch.uint8).contiguous()
    dp = d // per
    out = torch.zeros(*q.shape[:-1], dp, dtype=torch.uint8, device=q.device)
    for k in range(per):
        out |= q[..., k * dp:(k + 1) * dp].to(torch.uint8) << (k * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(..., Dp)`` bytes to ``(..., Dp * 8 / bits)`` uint8 codes."""
    _check_bits(bits)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 bytes, got dtype {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("packed must have at least one (byte) dimension")
    if bits == 3:
        if packed.shape[-1] % 3:
            raise ValueError(f"3-bit codes are packed in three byte planes, so the byte count must be a multiple "
                             f"of 3, got {packed.shape[-1]}")
        dw = packed.shape[-1] // 3
        word = sum(packed[..., i * dw:(i + 1) * dw].to(torch.int32) << (8 * i) for i in range(3))
        return torch.cat([((word >> (3 * k)) & 7).to(torch.uint8) for k in range(8)], dim=-1)
    per = 8 // bits
    if per == 1:
        return packed
    mask = 2 ** bits - 1
    return torch.cat([(packed >> (k * bits)) & mask for k in range(per)], dim=-1)
