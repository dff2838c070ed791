"""MXFP4: E2M1 codes in blocks of 32 sharing a power-of-two scale, their packing, and the straight-through
fake quantization that quantization-aware training uses.
"""
from __future__ import annotations

import torch

from labsrc.kernels.weight_quant.rtn import _check_int


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""The eight E2M1 magnitudes, indexed by the code's low three bits (bit 3 is the sign)."""
MX_BLOCK = 32
_E2M1_EMAX = 2  # exponent of E2M1's largest normal value, 6 = 1.5 * 2**2
_F32_MIN_NORMAL = 2.0 ** -126


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
