"""A quantized tensor: its groups (per token, per channel, per group of channels), KVarN's per-channel
normalising statistics, and quantizing and dequantizing whole tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labsrc.kernels.kv_quant.codes import (FP16_MAX, GRANULARITIES, STORE_BYTES, SUPPORTED_BITS, _MIN_STD, _check_bits,
                                   _check_granularity, _check_group_size, _check_int, _check_x, _overflow_error,
                                   _scale_zero, pack_codes, pack_unit, packed_width, quantize_codes, unpack_codes)


# ----------------------------------------------------------------------------------------------- statistics
@dataclass
class ChannelStats:
    """Per-channel mean and standard deviation, each of shape ``(..., head_dim)`` (e.g. ``(n_kv_heads, head_dim)``).

    The leading dimensions broadcast against the leading dimensions of the tensor being quantized (all but the
    token axis): stats of shape ``(H, D)`` serve a cache tensor ``(B, H, T, D)``. They are kept in fp16, the
    way they are stored next to the cache, so both must be finite and within fp16's range (``|mean|`` and
    ``std`` at most 65504); ``std`` must not be negative. A std below ``1e-4`` (a constant channel) is raised
    to ``1e-4`` so that normalising never divides by zero. Anything else raises a ``ValueError`` naming the
    field.
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __post_init__(self):
        for name in ("mean", "std"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"ChannelStats.{name} must be a floating torch.Tensor")
        if self.mean.shape != self.std.shape:
            raise ValueError(f"ChannelStats mean shape {tuple(self.mean.shape)} != std shape {tuple(self.std.shape)}")
        if self.mean.dim() < 1:
            raise ValueError("ChannelStats tensors need at least a channel dimension")
        if self.mean.device != self.std.device:
            raise ValueError(f"ChannelStats.mean is on {self.mean.device} but ChannelStats.std on {self.std.device}")
        for name in ("mean", "std"):
            t = getattr(self, name).float()
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"ChannelStats.{name} must be finite, got NaN or inf")
            if bool((t.abs() > FP16_MAX).any()):
                raise ValueError(f"ChannelStats.{name} has values beyond fp16's range (|x| <= {FP16_MAX:g}), "
                                 f"largest {float(t.abs().max()):g}")
        if bool((self.std < 0).any()):
            raise ValueError(f"ChannelStats.std must be >= 0, got {float(self.std.min()):g}")
        self.mean = self.mean.to(torch.float16)
        self.std = self.std.float().clamp_min(_MIN_STD).to(torch.float16)

    @property
    def nbytes(self) -> int:
        """Stored bytes: fp16 mean and std."""
        return (self.mean.numel() + self.std.numel()) * STORE_BYTES

    def to(self, device) -> "ChannelStats":
        """The statistics on ``device`` (``self`` when already there: no copy and no second validation)."""
        if self.mean.device == torch.device(device) and self.std.device == self.mean.device \
                and self.mean.dtype == self.std.dtype == torch.float16:
            return self
        return ChannelStats(self.mean.to(device), self.std.to(device))

    @staticmethod
    def of(x: torch.Tensor) -> "ChannelStats":
        """Statistics of ``x`` itself, over its token axis: shape ``x.shape[:-2] + (head_dim,)``."""
        x = _check_x(x).float()
        if x.shape[-2] == 0:
            raise ValueError("x has no tokens to measure statistics over (shape (..., 0, head_dim))")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x holds NaN or inf, so its own channel statistics are undefined; "
                             "pass calibrated stats or finite x")
        try:
            return ChannelStats(x.mean(dim=-2), x.std(dim=-2, unbiased=False))
        except ValueError as e:
            raise ValueError(f"statistics of x cannot be stored: {e}") from None


@dataclass
class KVStats:
    """Calibrated statistics of one layer: ``k`` and ``v`` are :class:`ChannelStats` of shape ``(H_kv, D)``."""

    k: ChannelStats
    v: ChannelStats

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _resolve_stats(x: torch.Tensor, stats: ChannelStats | None) -> ChannelStats:
    if stats is None:
        return ChannelStats.of(x)
    if not isinstance(stats, ChannelStats):
        raise TypeError(f"stats must be a ChannelStats, got {type(stats).__name__}")
    lead, d = tuple(x.shape[:-2]), x.shape[-1]
    if stats.mean.shape[-1] != d:
        raise ValueError(f"stats have {stats.mean.shape[-1]} channels but x has head_dim {d}")
    try:
        ok = torch.broadcast_shapes(tuple(stats.mean.shape[:-1]), lead) == lead
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"stats of shape {tuple(stats.mean.shape)} do not broadcast to x's leading shape {lead} "
                         f"(expected (..., {d}) with leading dims broadcastable to {lead})")
    return stats.to(x.device)


def _groups(x: torch.Tensor, g: int, fill: float) -> torch.Tensor:
    """View ``(..., T, D)`` as ``(..., G, g, D)``, padding a trailing partial group with ``fill``."""
    t = x.shape[-2]
    n_groups = -(-t // g)
    pad = n_groups * g - t
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:-2], pad, x.shape[-1]), fill)], dim=-2)
    return x.reshape(*x.shape[:-2], n_groups, g, x.shape[-1])


def _expand(p: torch.Tensor, g: int, t: int) -> torch.Tensor:
    """Per-group parameters ``(..., G, C)`` repeated to per-token ``(..., T, C)``."""
    return p.repeat_interleave(g, dim=-2)[..., :t, :]


@dataclass
class QuantizedTensor:
    """A quantized ``(..., tokens, head_dim)`` tensor: packed codes, fp16 steps and zero points, optional stats.

    ``scale``/``zero`` have shape ``(..., G, 1)`` for ``"group"`` (``G = ceil(T/g)``), ``(..., T, 1)`` for
    ``"token"`` and ``(..., G, D)`` for ``"channel"``. :meth:`dequantize` rebuilds the tensor in its original
    dtype; :attr:`nbytes` counts every byte stored. The fields are plain attributes (a cache reorders them in
    place), so :meth:`validate` checks that they still agree before anything reads the buffers.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    stats: ChannelStats | None
    bits: int
    group_size: int
    granularity: str
    shape: tuple
    dtype: torch.dtype
    stats_shared: bool = False  # calibrated stats stored once per layer, not with every tensor

    def validate(self, name: str = "qt") -> "QuantizedTensor":
        """Check that the buffers match ``shape``, ``bits``, ``group_size`` and ``granularity`` (returns self).

        Raises TypeError/ValueError naming the field (``{name}.packed``, ``{name}.scale``, ...): packed codes
        uint8 ``(..., T, D*bits/8)``, fp16 ``scale``/``zero`` of the granularity's shape, statistics with
        ``D`` channels broadcasting to the leading dims, everything on one device. Reading buffers sized by
        metadata they do not match would read out of bounds in a kernel, or silently misalign groups.
        """
        shape = self.shape
        if not isinstance(shape, tuple) or len(shape) < 2 or \
                not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"{name}.shape must be a tuple (..., tokens, head_dim) of non-negative ints, got {shape!r}")
        if shape[-1] == 0:
            raise ValueError(f"{name}.shape has head_dim 0")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{name}.bits must be one of {SUPPORTED_BITS}, got {self.bits!r}")
        _check_int(self.group_size, f"{name}.group_size")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{name}.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity == "token" and self.group_size != 1:
            raise ValueError(f"{name}.group_size must be 1 for granularity 'token', got {self.group_size}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"{name}.dtype must be a floating dtype, got {self.dtype!r}")
        *lead, t, d = shape
        per, _ = pack_unit(self.bits)
        if d % per:
            raise ValueError(f"{name}.shape has head_dim {d}, not a multiple of {per} ({self.bits}-bit codes)")
        want = {"packed": (*lead, t, packed_width(d, self.bits))}
        n_groups = -(-t // self.group_size)
        want["scale"] = want["zero"] = (*lead, n_groups, d if self.granularity == "channel" else 1)
        for part, dtype in (("packed", torch.uint8), ("scale", torch.float16), ("zero", torch.float16)):
            buf = getattr(self, part)
            if not isinstance(buf, torch.Tensor):
                raise TypeError(f"{name}.{part} must be a torch.Tensor, got {type(buf).__name__}")
            if buf.dtype != dtype:
                raise TypeError(f"{name}.{part} must have dtype {dtype}, got {buf.dtype}")
            if tuple(buf.shape) != want[part]:
                raise ValueError(f"{name}.{part} has shape {tuple(buf.shape)} but {name}.shape={shape}, "
                                 f"bits={self.bits}, group_size={self.group_size} ({self.granularity!r}) "
                                 f"need {want[part]}")
        device = self.packed.device
        for part in ("scale", "zero"):
            if getattr(self, part).device != device:
                raise ValueError(f"{name}.{part} is on {getattr(self, part).device} but {name}.packed on {device}")
        if self.stats is not None:
            if not isinstance(self.stats, ChannelStats):
                raise TypeError(f"{name}.stats must be a ChannelStats or None, got {type(self.stats).__name__}")
            st = self.stats.mean
            if st.shape[-1] != d:
                raise ValueError(f"{name}.stats have {st.shape[-1]} channels but {name}.shape has head_dim {d}")
            try:
                ok = torch.broadcast_shapes(tuple(st.shape[:-1]), tuple(lead)) == tuple(lead)
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"{name}.stats of shape {tuple(st.shape)} do not broadcast to {name}'s leading "
                                 f"shape {tuple(lead)}")
            if st.device != device:
                raise ValueError(f"{name}.stats are on {st.device} but {name}.packed on {device}")
        return self

    @property
    def codes(self) -> torch.Tensor:
        """The unpacked integer codes, uint8 of shape ``shape``."""
        return unpack_codes(self.packed, self.bits)

    def steps(self) -> torch.Tensor:
        """The quantization step of every element in the units of the original tensor: ``s * sigma_j``."""
        self.validate()
        t = self.shape[-2]
        s = _expand(self.scale.float(), self.group_size, t).expand(self.shape)
        if self.stats is not None:
            s = s * self.stats.std.float().unsqueeze(-2)
        return s

    def dequantize(self) -> torch.Tensor:
        """``q * s + z``, then ``* sigma_j + mu_j`` when normalised, cast back to the original dtype.

        A group stored with NaN step and zero point (it held a NaN or an infinity) comes back as NaN.
        """
        self.validate()
        t = self.shape[-2]
        q = self.codes.float()
        x = q * _expand(self.scale.float(), self.group_size, t) + _expand(self.zero.float(), self.group_size, t)
        if self.stats is not None:
            x = x * self.stats.std.float().unsqueeze(-2) + self.stats.mean.float().unsqueeze(-2)
        return x.to(self.dtype)

    def nbytes_breakdown(self) -> dict:
        """Bytes of each stored part: ``codes``, ``scales``, ``zeros``, ``stats`` (0 when shared or absent)."""
        stats = 0 if (self.stats is None or self.stats_shared) else self.stats.nbytes
        return {"codes": self.packed.numel() * self.packed.element_size(),
                "scales": self.scale.numel() * self.scale.element_size(),
                "zeros": self.zero.numel() * self.zero.element_size(), "stats": stats}

    @property
    def nbytes(self) -> int:
        """Every byte this tensor stores: packed codes + fp16 scales + fp16 zero points + fp16 statistics."""
        return sum(self.nbytes_breakdown().values())


def quantize(x: torch.Tensor, bits: int = 4, group_size: int = 128, normalize: bool = True,
             stats: ChannelStats | None = None, granularity: str = "group",
             stats_shared: bool | None = None) -> QuantizedTensor:
    """Quantize ``x`` of shape ``(..., tokens, head_dim)`` to ``bits`` bits (2, 3, 4 or 8).

    * ``group_size``: tokens per quantization group (``"group"`` and ``"channel"`` granularity; ignored for
      ``"token"``). A trailing partial group is allowed.
    * ``normalize``: KVarN's per-channel normalisation ``(x - mu_j) / sigma_j`` before quantizing. ``stats``
      (a :class:`ChannelStats`, e.g. from :func:`calibrate`) supplies ``mu, sigma``; with ``stats=None`` they
      are measured on ``x`` itself (an oracle, stored with the tensor).
    * ``granularity``: ``"group"`` (KVarN: one step per ``group_size`` tokens, shared by the channels),
      ``"token"`` (one step per token) or ``"channel"`` (KIVI keys: one step per channel per group).
    * ``stats_shared``: whether ``nbytes`` leaves the statistics out because they are stored once per layer
      (default: True for calibrated ``stats``, False for statistics measured on ``x``).

    Returns a :class:`QuantizedTensor`; ``.dequantize()`` gives the reconstruction, ``.nbytes`` the storage.
    A group holding NaN or inf dequantizes to NaN; a group whose fp16 step or zero point would overflow
    raises a ``ValueError`` naming it (module docstring, "Two edge cases").
    """
    _check_x(x)
    _check_bits(bits)
    group_size = _check_group_size(group_size)
    _check_granularity(granularity)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if stats is not None and not normalize:
        raise ValueError("stats were given but normalize=False; pass normalize=True to use them")
    shared = (stats is not None) if stats_shared is None else bool(stats_shared)
    xf = x.float()
    st = None
    if normalize:
        st = _resolve_stats(x, stats)
        xf = (xf - st.mean.float().unsqueeze(-2)) / st.std.float().unsqueeze(-2)
    t = x.shape[-2]
    g = 1 if granularity == "token" else group_size
    dims = -2 if granularity == "channel" else (-2, -1)
    xmin = _groups(xf, g, math.inf).amin(dim=dims)
    xmax = _groups(xf, g, -math.inf).amax(dim=dims)
    # Groups holding a NaN or an infinity of x itself: NaN step and zero point (module docstring).
    bad = _groups(~torch.isfinite(x), g, False).any(dim=dims)
    if granularity != "channel":
        xmin, xmax, bad = xmin.unsqueeze(-1), xmax.unsqueeze(-1), bad.unsqueeze(-1)
    s, z = _scale_zero(xmin, xmax, bits)
    nan = torch.tensor(float("nan"), dtype=torch.float16, device=s.device)
    s, z = torch.where(bad, nan, s), torch.where(bad, nan, z)
    # A finite group without a finite fp16 step or zero point: its range is beyond fp16 (normalised values
    # of finite x can even overflow fp32 when a calibrated std is tiny).
    over = ~bad & ~(torch.isfinite(s) & torch.isfinite(z))
    if bool(over.any()):
        i = tuple(int(j) for j in over.nonzero()[0])
        raise _overflow_error("x", i, float(xmin[i]), float(xmax[i]), bits, normalized=normalize)
    q = quantize_codes(xf, _expand(s, g, t), _expand(z, g, t), bits)
    return QuantizedTensor(pack_codes(q, bits), s, z, st, bits, g, granularity, tuple(x.shape), x.dtype,
                           stats_shared=shared if st is not None else False)


def fake_quantize(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """Quantize then dequantize: ``quantize(x, **kwargs).dequantize()``."""
    return quantize(x, **kwargs).dequantize()


def quantize_per_token(x: torch.Tensor, bits: int = 4) -> QuantizedTensor:
    """The baseline: one step and zero point per token over its channels, no normalisation."""
    return quantize(x, bits=bits, group_size=1, normalize=False, granularity="token")


def quantize_per_channel(x: torch.Tensor, bits: int = 4, group_size: int = 128) -> QuantizedTensor:
    """KIVI's key quantization: one step per channel per group of ``group_size`` tokens."""
    return quantize(x, bits=bits, group_size=group_size, normalize=False, granularity="channel")
