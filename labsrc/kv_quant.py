"""KV-cache quantization from scratch: uniform asymmetric quantization, KIVI-style grouping and KVarN.

Everything here is plain PyTorch; the Triton versions of the hot paths live in :mod:`labsrc.kernels.kv_quant`.

Uniform asymmetric quantization (our convention)
------------------------------------------------
A set of values ``x`` (a *quantization group*) with ``b`` bits gets one step (scale) ``s`` and one zero point
``z``. Unlike the integer zero points of some libraries, our ``z`` is a real number in the units of ``x``: the
value that the integer code 0 stands for (just below the group's minimum). With ``L = 2**b - 1`` levels::

    z = min(x)   (rounded *down* to fp16)          s = (max(x) - z) / L   (rounded *up* to fp16)
    q = clamp(floor((x - z) / s + 1/2), 0, L)      x_hat = q * s + z

``s`` and ``z`` are stored in fp16 (two bytes each, as the source text counts them). They are rounded in the
safe direction, so the grid ``[z, z + L*s]`` still covers ``[min, max]`` and every element's error stays
within half a step, ``|x - x_hat| <= s/2`` (:func:`scale_zero`). Rounding is half-up (``floor(v + 1/2)``),
which is what the Triton kernels do too, so kernel and reference produce the same codes.

Two edge cases, handled alike here and in the kernels (:mod:`labsrc.kernels.kv_quant`):

* *A range fp16 cannot hold.* fp16's largest value is 65504, so a group whose zero point lies below -65504
  or whose step exceeds 65504 (a range above ``65504 * L``: about 2e5 at 2 bits, 1e6 at 4 bits, 1.7e7 at 8
  bits) has no fp16 ``(s, z)``. Storing ``inf`` would turn the whole group into NaN when dequantized, so
  quantizing such a group raises a ``ValueError`` that names the group and its range. We keep fp16 storage
  rather than switching to fp32 metadata so that the byte counts (:attr:`QuantizedTensor.nbytes`,
  :func:`kv_bytes`, the source's :func:`kvarn_bytes_source`) stay both honest and the ones the source text
  compares: two bytes per step and zero point is what is truly stored. With KVarN the range is the one
  *after* normalisation: a channel that was almost constant during calibration (its std is floored at
  ``1e-4``) turns a modest later deviation into a huge normalised value; the error says so.
* *NaN or infinite inputs.* A group holding a NaN, ``+inf`` or ``-inf`` gets NaN as its step and zero point
  and code 0 for every element, so the whole group dequantizes to NaN (the non-finite value is not silently
  replaced by a finite one, and its neighbours are not trusted either: their grid was meant to include it).

Grouping (``granularity``)
--------------------------
For a cache tensor of shape ``(..., tokens, head_dim)``:

* ``"token"``: one ``(s, z)`` per token, shared by its ``head_dim`` channels (the common baseline).
* ``"group"``: one ``(s, z)`` per group of ``g`` consecutive tokens, shared by all channels of the group
  (KVarN's group quantization; ``g = 1`` is the same as ``"token"``).
* ``"channel"``: one ``(s, z)`` per channel per group of ``g`` tokens (KIVI's key quantization).

A trailing partial group (tokens not a multiple of ``g``) is its own, shorter group.

KVarN (source sections 10.3.2-10.3.4)
-------------------------------------
Before quantizing, every channel ``j`` is normalised with calibrated statistics ``mu_j, sigma_j``:
``x~ = (x - mu_j) / sigma_j``; the normalised tensor is group-quantized, and dequantisation is::

    x_hat[i, j] = sigma_j * (q[i, j] * s_g + z_g) + mu_j

The source writes ``sigma_j * round((x~ - z_g)/s_g) * s_g + z_g * sigma_j`` and drops the ``+ mu_j``: without
it a channel with a non-zero mean is reconstructed around zero, so the mean must be added back (or never
subtracted). Statistics are stored in fp16 too, mean and std per channel (per KV head).

Packed layout
-------------
Codes are packed along ``head_dim`` in a *planar* layout: with ``P = 8 // b`` codes per byte and
``Dp = head_dim // P`` bytes per token, byte ``j`` holds channel ``j + k*Dp`` in bits ``[k*b, (k+1)*b)`` for
``k = 0..P-1``. (INT4: channel ``j`` in the low nibble, channel ``j + head_dim/2`` in the high nibble.) This
lets a kernel unpack a whole half of a row with one shift and mask, without interleaving.

Three bits do not divide a byte, so INT3 packs eight codes into three bytes (a 24-bit word) in the same planar
way: with ``Dw = head_dim // 8`` words per token, word ``j`` holds channel ``j + k*Dw`` in bits
``[3k, 3k+3)`` for ``k = 0..7``, and the word's low, middle and high bytes are stored as three planes of
``Dw`` bytes each (bytes ``j``, ``Dw + j``, ``2*Dw + j``). ``head_dim`` must then be a multiple of 8, and a
token costs exactly ``3 * head_dim / 8`` bytes. The Triton kernels (:mod:`labsrc.kernels.kv_quant`) read
2, 4 and 8 bits only; INT3 runs on this module's PyTorch path.

Recipes for the chapter's experiments (``cfg = model.config``, ``stats = calibrate(model, calib_ids)``)
----------------------------------------------------------------------------------------------------
* VarRatio per layer: ``[var_ratio(k).mean() for k, v in collect_kv(model, ids)]`` (per KV head before the
  mean; the same for ``v``).
* MSE with/without normalisation: ``quantization_mse(k, bits=4, group_size=128, normalize=False)`` against
  ``quantization_mse(k, bits=4, group_size=128, stats=stats[l].k)``; compare the ratio with
  ``predicted_mse_ratio(channel_variance(k).mean(dim=(0, 1)))`` (the source's "VarAvg" claim is wrong there).
* Perplexity vs length: ``token_nll(model, ids, cache).mean().exp()`` with ``cache`` one of ``None`` (FP),
  ``KVarNCache.per_token(cfg, 4)``, ``KVarNCache.kivi(cfg, 4, group_size=32, window=32)``,
  ``KVarNCache.kvarn(cfg, stats, 4, group_size=128)`` (a fresh cache per forward pass).
* Layer-wise error: ``hidden_state_errors(model, ids, cache)``; one layer only with
  ``KVarNCache(..., quantize_layers=[l])``.
* Table 10-4 ablation: per-token INT4 ``KVarNCache.per_token(cfg, 4)``; + normalisation
  ``KVarNCache(cfg, 4, 1, "token", "token", True, stats)``; group g=128 / 64 ``KVarNCache.kvarn(cfg, stats, 4, g)``;
  calibration size: ``calibrate`` on 1x and 2x the samples.
* Memory vs formula: ``cache.nbytes`` / ``cache.nbytes_breakdown()`` against ``kv_bytes(...)`` and the
  source's ``kvarn_bytes_source(...)``.
* Probe accuracy per cache: ``probe_accuracy(model, samples, lambda: KVarNCache.kvarn(cfg, stats))``.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

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


# ----------------------------------------------------------------------------------------------- measurements
def channel_variance(x: torch.Tensor) -> torch.Tensor:
    """Variance of each channel over the token axis: ``(..., T, D) -> (..., D)`` (population variance)."""
    return _check_x(x).float().var(dim=-2, unbiased=False)


def var_ratio(x: torch.Tensor) -> torch.Tensor:
    """VarRatio (source eq. in 10.3.2): ``max_j Var(x[:, j]) / min_j Var(x[:, j])`` over tokens.

    ``x`` is ``(..., T, D)``; the ratio is computed for each leading index (e.g. each head), shape ``x.shape[:-2]``.
    """
    v = channel_variance(x)
    return v.amax(-1) / v.amin(-1).clamp_min(torch.finfo(torch.float32).tiny)


def group_range(x: torch.Tensor, group_size: int, stats: ChannelStats | None = None) -> torch.Tensor:
    """The range (max - min) of each block of ``group_size`` tokens by all channels: what one shared step spans.

    ``x`` is ``(..., T, D)``; with ``stats`` every channel is first normalised, ``(x - mean) / std`` (the
    statistics stored in fp16, as the quantizer uses them), so the range is in units of each channel's
    standard deviation. ``group_size=1`` gives each token's range over its channels (the per-token
    quantizer's). A trailing partial group is a group. Returns ``(..., ceil(T / group_size))`` in fp32; a
    block holding NaN gives NaN.
    """
    x = _check_x(x).float()
    group_size = _check_group_size(group_size)
    t = x.shape[-2]
    if t == 0:
        raise ValueError("x has no tokens (shape (..., 0, head_dim)), so it has no groups")
    if stats is not None:
        if not isinstance(stats, ChannelStats):
            raise TypeError(f"stats must be a ChannelStats, got {type(stats).__name__}")
        if stats.mean.shape[-1] != x.shape[-1]:
            raise ValueError(f"stats have {stats.mean.shape[-1]} channels but x has head_dim {x.shape[-1]}")
        st = stats.to(x.device)
        x = (x - st.mean.float().unsqueeze(-2)) / st.std.float().unsqueeze(-2)
    n_groups = -(-t // group_size)
    pad = n_groups * group_size - t
    if pad:
        # Pad with copies of the last token: they change neither the max nor the min of the last group.
        x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
    blocks = x.reshape(*x.shape[:-2], n_groups, group_size * x.shape[-1])
    out = blocks.amax(-1) - blocks.amin(-1)
    return torch.where(torch.isnan(blocks).any(-1), torch.full_like(out, float("nan")), out)


def mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``y`` against ``x`` (a 0-d fp32 tensor)."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    return (x.float() - y.float()).pow(2).mean()


def relative_mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``mse(x, y) / mean(x**2)``: the error relative to the signal's power."""
    return mse(x, y) / x.float().pow(2).mean().clamp_min(torch.finfo(torch.float32).tiny)


def quantization_mse(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """MSE of the quantize-dequantize round trip of ``x`` (``kwargs`` as for :func:`quantize`)."""
    return mse(x, fake_quantize(x, **kwargs))


def predicted_mse_ratio(channel_var, per_channel_steps: bool = False) -> float:
    """Predicted ``MSE(without normalisation) / MSE(with normalisation)`` for channels of the given variances.

    Derivation (uniform quantizer, errors uniform in a step, zero-mean channels). A step ``D`` gives
    ``MSE = D**2 / 12``; the step is the group's range over ``L = 2**b - 1`` and the range of a channel of
    variance ``v_j`` is about ``c * sqrt(v_j)`` (``c ~ 6`` for a Gaussian).

    *One step shared by all channels of a group* (per-token and KVarN group quantization). Without
    normalisation the widest channel sets the range, ``D = c * sqrt(max_j v_j) / L``, and every element pays
    ``D**2/12``: ``MSE_plain = c**2 * max_j v_j / (12 L**2)``. After normalisation every channel has unit
    variance, the step is ``c / L`` in normalised units, and dequantising multiplies channel ``j``'s error by
    ``sigma_j``: ``MSE_norm = c**2 * mean_j v_j / (12 L**2)``. Hence::

        MSE_plain / MSE_norm = max_j v_j / mean_j v_j        (>= 1, and <= VarRatio = max/min)

    *A step per channel* (KIVI keys): ``MSE_plain,j = c**2 v_j / (12 L**2) = MSE_norm,j``, so the ratio is 1;
    normalising adds nothing a per-channel step does not already do.

    The source (10.3.6) states the gain is ``mean_j v_j`` ("VarAvg"). That ratio compares per-channel-step
    error in the original units with the normalised error left in normalised units, i.e. it forgets that
    dequantising multiplies errors by ``sigma_j``; it is not unit-free (scaling K by 2 would multiply the
    claimed gain by 4), so it cannot be a gain. Non-zero channel means widen a shared range further, so with
    uneven means the measured gain of normalisation exceeds this prediction.
    """
    try:
        v = torch.as_tensor(channel_var, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"channel_var must be a sequence or tensor of numbers, got {type(channel_var).__name__}") from None
    if v.numel() == 0:
        raise ValueError("channel_var is empty")
    if (v <= 0).any() or not torch.isfinite(v).all():
        raise ValueError("channel variances must be positive and finite")
    if per_channel_steps:
        return 1.0
    return float(v.max() / v.mean())


# ----------------------------------------------------------------------------------------------- byte counts
def kvarn_bytes_source(n_tokens: int, n_layers: int, n_heads: int, head_dim: int, group_size: int = 128,
                       bits: int = 4) -> float:
    """The source's memory formula (10.3.4), literally:
    ``2 * L * H * d_h * (n * b/8 + n/g * 2 * 2 + d_h * 2)`` bytes.

    Multiplying the whole bracket by ``d_h`` charges a step and zero point per *channel* per group, and
    ``d_h**2 * 2`` bytes of statistics per head, where the text itself says sigma costs ``2 * d_h`` bytes per
    head; it also leaves out the mean. :func:`kv_bytes` counts what is actually stored.
    """
    _check_int(n_tokens, "n_tokens", 0)
    for name, val in (("n_layers", n_layers), ("n_heads", n_heads), ("head_dim", head_dim)):
        _check_int(val, name)
    _check_group_size(group_size)
    _check_bits(bits)
    return 2 * n_layers * n_heads * head_dim * (n_tokens * bits / 8 + n_tokens / group_size * 2 * 2 + head_dim * 2)


def kv_bytes(n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, bits: int | None = 4,
             group_size: int = 128, granularity: str = "group", stats: bool = True, window: int = 0,
             batch: int = 1, fp_bytes: int = 2) -> int:
    """Bytes a KV cache stores, K and V over all layers (``bits=None``: unquantized at ``fp_bytes`` per value).

    Quantized tokens cost ``ceil(d_h * bits / 8)`` bytes each, plus two fp16 numbers (step, zero point) per
    quantization group: per ``g`` tokens (``"group"``), per token (``"token"``) or per channel per ``g``
    tokens (``"channel"``). ``stats=True`` adds fp16 mean and std per channel per KV head per layer (stored
    once, not per sequence). The last ``window`` tokens are kept at ``fp_bytes`` per value.

    The steps, zero points and statistics are counted at 2 bytes (``STORE_BYTES``) because that is what
    :func:`quantize` stores: a group whose parameters do not fit in fp16 is refused, never widened.
    """
    _check_int(n_tokens, "n_tokens", 0)
    for name, val in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                      ("batch", batch), ("fp_bytes", fp_bytes)):
        _check_int(val, name)
    _check_int(window, "window", 0)
    if bits is None:
        return 2 * n_layers * batch * n_kv_heads * n_tokens * head_dim * fp_bytes
    _check_bits(bits)
    _check_group_size(group_size)
    _check_granularity(granularity)
    w = min(window, n_tokens)
    nq = n_tokens - w
    if granularity == "token":
        n_params = nq
    elif granularity == "group":
        n_params = -(-nq // group_size)
    else:
        n_params = -(-nq // group_size) * head_dim
    per_head = -(-nq * head_dim * bits // 8) + n_params * 2 * STORE_BYTES + w * head_dim * fp_bytes
    total = 2 * n_layers * batch * n_kv_heads * per_head
    if stats:
        total += 2 * n_layers * n_kv_heads * 2 * head_dim * STORE_BYTES
    return total


# ----------------------------------------------------------------------------------------------- calibration
def _as_id_batches(data, tokenizer, max_length) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        data = [data] if data.dim() == 2 else [data.unsqueeze(0)] if data.dim() == 1 else None
        if data is None:
            raise ValueError("input_ids tensor must be 1-D or 2-D")
    if isinstance(data, (str, bytes)):
        raise TypeError("texts_or_input_ids must be a list of texts, not a single string")
    try:
        data = list(data)
    except TypeError:
        raise TypeError(f"texts_or_input_ids must be a list of texts or token-id tensors, "
                        f"got {type(data).__name__}") from None
    out = []
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("calibrating on texts needs a tokenizer (tokenizer=...)")
            ids = torch.tensor([tokenizer(item)["input_ids"]])
        else:
            ids = torch.as_tensor(item)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        if ids.dim() != 2 or ids.shape[-1] == 0 or ids.is_floating_point():
            raise ValueError(f"each calibration sample must be a non-empty 1-D/2-D integer id tensor, got {tuple(ids.shape)}")
        if max_length is not None:
            ids = ids[:, :max_length]
        out.append(ids)
    if not out:
        raise ValueError("texts_or_input_ids is empty")
    return out


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def collect_kv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``model`` on ``input_ids`` ``(B, T)`` and return each layer's cached ``(K, V)``, each ``(B, H_kv, T, D)``.

    These are the tensors a KV cache stores: keys after the RoPE rotation, values after their projection.
    """
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids.to(device), use_cache=True)
    # transformers 5 names the returned cache `cache` (reading `past_key_values` warns that it is deprecated).
    cache = out["cache"] if "cache" in out else out.past_key_values
    return [(layer.keys.detach(), layer.values.detach()) for layer in cache.layers]


def calibrate(model, texts_or_input_ids, tokenizer=None, momentum: float | None = None,
              max_length: int | None = None) -> list[KVStats]:
    """Per-layer K and V channel statistics (mean, std per KV head and channel) over a calibration set.

    Each sample (a text, with ``tokenizer``, or a 1-D/2-D tensor or list of token ids) is run through the
    model; the cached K and V of every layer are reduced over batch and tokens to a first and a second
    moment per ``(head, channel)``. With ``momentum=None`` samples are pooled exactly (weighted by their token
    counts); with ``momentum=a`` the moments are an exponential moving average, ``m <- (1-a) m + a m_sample``,
    as the source describes. Returns one :class:`KVStats` per layer with tensors of shape ``(H_kv, D)``.
    """
    if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
                                 or not (0.0 < float(momentum) <= 1.0)):
        raise ValueError(f"momentum must be in (0, 1] or None, got {momentum!r}")
    if max_length is not None:
        max_length = _check_int(max_length, "max_length")
    batches = _as_id_batches(texts_or_input_ids, tokenizer, max_length)
    moments = None  # per layer: [k_m1, k_m2, v_m1, v_m2]
    total = 0
    for ids in batches:
        kv = collect_kv(model, ids)
        n = ids.numel()
        sample = []
        for k, v in kv:
            kf, vf = k.double(), v.double()
            sample.append([kf.mean(dim=(0, 2)), kf.pow(2).mean(dim=(0, 2)),
                           vf.mean(dim=(0, 2)), vf.pow(2).mean(dim=(0, 2))])
        if moments is None:
            moments = sample
        elif momentum is None:
            moments = [[(m * total + s * n) / (total + n) for m, s in zip(ml, sl)] for ml, sl in zip(moments, sample)]
        else:
            a = float(momentum)
            moments = [[(1 - a) * m + a * s for m, s in zip(ml, sl)] for ml, sl in zip(moments, sample)]
        total += n
    out = []
    for km1, km2, vm1, vm2 in moments:
        out.append(KVStats(ChannelStats(km1.float(), (km2 - km1 ** 2).clamp_min(0).sqrt().float()),
                           ChannelStats(vm1.float(), (vm2 - vm1 ** 2).clamp_min(0).sqrt().float())))
    return out


# ----------------------------------------------------------------------------------------------- the cache
try:  # transformers is a dependency of the lab, but keep the quantizer importable without it
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError:  # pragma: no cover
    Cache, DynamicLayer = object, object


class KVarNLayer(DynamicLayer):
    """One layer of :class:`KVarNCache`: quantizes whole groups of old tokens, keeps recent ones in full precision.

    ``update()`` appends the new K/V rows to a full-precision tail; whenever the tail holds more than
    ``window`` tokens plus a whole flush unit (``group_size`` tokens, or 1 token when neither K nor V groups
    tokens), the oldest whole units are quantized (kept as :class:`QuantizedTensor`). It returns the full K/V:
    dequantized old tokens followed by the tail.

    The dequantized copy (``self.keys``/``self.values``) is a working buffer of this PyTorch simulation, so
    attention runs on exactly what a fused kernel would compute on the fly; :attr:`nbytes` counts only what a
    real quantized cache stores (codes, steps, zero points, statistics, the full-precision tail).
    """

    def __init__(self, bits: int = 4, group_size: int = 128, key_granularity: str = "group",
                 value_granularity: str = "group", normalize: bool = True, stats: KVStats | None = None,
                 window: int = 0, enabled: bool = True, quantize_partial: bool = False):
        super().__init__()
        self.bits = _check_bits(bits)
        self.group_size = _check_group_size(group_size)
        self.key_granularity = _check_granularity(key_granularity)
        self.value_granularity = _check_granularity(value_granularity)
        if stats is not None and not isinstance(stats, KVStats):
            raise TypeError(f"stats must be a KVStats (one layer of calibrate()), got {type(stats).__name__}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        if stats is not None and not normalize:
            raise ValueError("stats were given but normalize=False")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be a non-negative int, got {window!r}")
        self.normalize, self.stats, self.window, self.enabled = normalize, stats, window, enabled
        self.quantize_partial = bool(quantize_partial)
        self._partial: tuple[QuantizedTensor, QuantizedTensor] | None = None
        both_token = key_granularity == "token" and value_granularity == "token"
        self.unit = 1 if both_token else group_size
        self.cumulative_length = 0
        self.n_quantized = 0
        self.qkeys: list[QuantizedTensor] = []
        self.qvalues: list[QuantizedTensor] = []

    def _q(self, x: torch.Tensor, granularity: str, stats: ChannelStats | None) -> QuantizedTensor:
        return quantize(x, bits=self.bits, group_size=self.group_size, normalize=self.normalize, stats=stats,
                        granularity=granularity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        if not self.enabled:
            return self.keys, self.values
        tail = self.cumulative_length - self.n_quantized
        n_flush = (tail - self.window) // self.unit * self.unit if tail - self.window >= self.unit else 0
        if n_flush > 0:
            a, b = self.n_quantized, self.n_quantized + n_flush
            ks, vs = (self.stats.k, self.stats.v) if self.stats is not None else (None, None)
            qk = self._q(self.keys[..., a:b, :], self.key_granularity, ks)
            qv = self._q(self.values[..., a:b, :], self.value_granularity, vs)
            self.qkeys.append(qk)
            self.qvalues.append(qv)
            # Rebuild instead of writing in place: the returned tensors of earlier steps must stay valid.
            self.keys = torch.cat([self.keys[..., :a, :], qk.dequantize(), self.keys[..., b:, :]], dim=-2)
            self.values = torch.cat([self.values[..., :a, :], qv.dequantize(), self.values[..., b:, :]], dim=-2)
            self.n_quantized = b
        return self._serve()

    def _serve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V attention reads: the stored rows, with the incomplete group quantized if ``quantize_partial``."""
        self._partial = None
        end = self.cumulative_length - self.window
        if self.quantize_partial and end > self.n_quantized:
            # The incomplete group is served quantized (as a store that quantizes on write would) but its
            # full-precision rows are kept, so that it is quantized once more, whole, when it fills up.
            a = self.n_quantized
            ks, vs = (self.stats.k, self.stats.v) if self.stats is not None else (None, None)
            qk = self._q(self.keys[..., a:end, :], self.key_granularity, ks)
            qv = self._q(self.values[..., a:end, :], self.value_granularity, vs)
            self._partial = (qk, qv)
            keys = torch.cat([self.keys[..., :a, :], qk.dequantize(), self.keys[..., end:, :]], dim=-2)
            values = torch.cat([self.values[..., :a, :], qv.dequantize(), self.values[..., end:, :]], dim=-2)
            return keys, values
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.n_quantized = 0
        self.qkeys, self.qvalues = [], []
        self._partial = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (transformers' convention: a count <= 0).

        Only tokens still in the full-precision tail can be removed: a quantized group is not split, and its
        codes were computed with the removed tokens' range. The tail always holds the newest ``window``
        tokens, so a cache with ``window >= n`` can always roll back ``n`` tokens, which is how speculative
        decoding uses it (rejected drafts never reach the quantized store).
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove must be an int <= 0 (minus the number of tokens to drop), "
                             f"got {tokens_to_remove!r}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        tail = self.cumulative_length - self.n_quantized
        if n > tail:
            raise ValueError(f"cannot remove the newest {n} tokens: only {tail} are still in full precision "
                             f"(the older ones are quantized in whole groups); build the cache with "
                             f"window >= {n} to roll back {n} tokens")
        self.keys = self.keys[..., :-n, :]
        self.values = self.values[..., :-n, :]
        self.cumulative_length -= n
        self._serve()   # recompute the served partial group, if any, for the shorter tail

    def _map_batch(self, f: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis operation to every stored tensor (codes, steps, per-sequence stats, the tail)."""
        if not self.is_initialized or self.cumulative_length == 0:
            return
        self.keys, self.values = f(self.keys), f(self.values)
        partial = list(self._partial) if self._partial is not None else []
        for qt in self.qkeys + self.qvalues + partial:
            qt.packed, qt.scale, qt.zero = f(qt.packed), f(qt.scale), f(qt.zero)
            if qt.stats is not None and not qt.stats_shared:  # measured per sequence: (B, H, D)
                qt.stats = ChannelStats(f(qt.stats.mean), f(qt.stats.std))
            qt.shape = (qt.packed.shape[0],) + tuple(qt.shape[1:])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def nbytes_breakdown(self) -> dict:
        """Stored bytes of this layer by part: codes, scales, zeros, stats, fp_tail."""
        out = {"codes": 0, "scales": 0, "zeros": 0, "stats": 0, "fp_tail": 0}
        partial = list(self._partial) if self._partial is not None else []
        for qt in self.qkeys + self.qvalues + partial:
            for key, val in qt.nbytes_breakdown().items():
                out[key] += val
        if self.stats is not None and (self.n_quantized > 0 or self._partial is not None):
            out["stats"] += self.stats.nbytes
        if self.is_initialized:
            tail = self.cumulative_length - self.n_quantized
            if self._partial is not None:
                tail -= self._partial[0].shape[-2]
            per_token = self.keys[..., :1, :].numel() * self.keys.element_size()
            out["fp_tail"] = 2 * tail * per_token
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())


class KVarNCache(Cache):
    """A ``transformers`` cache whose layers store K and V quantized; use as
    ``model.generate(..., cache=cache)`` (transformers 5.24 name; ``past_key_values=cache`` still works, with a
    deprecation warning).

    Arguments (all layers alike):

    * ``config``: the model's config (for the number of layers).
    * ``bits`` (2/3/4/8), ``group_size`` (tokens per quantization group, and the unit in which tokens move from
      the full-precision tail to the quantized store).
    * ``key_granularity``/``value_granularity``: ``"group"``, ``"token"`` or ``"channel"`` (see the module).
    * ``normalize`` and ``stats``: KVarN normalisation with calibrated statistics (``calibrate(...)``, one
      :class:`KVStats` per layer); ``normalize=True, stats=None`` normalises each flushed chunk with its own
      statistics (stored with it).
    * ``window``: the most recent ``window`` tokens stay in full precision (KIVI's residual); up to ``window``
      newest tokens can be removed again with ``crop`` (speculative decoding's rollback).
    * ``quantize_partial``: also serve the trailing incomplete group quantized (otherwise its tokens stay in
      full precision until the group fills up, as in KIVI). Use it to compare groupings fairly at lengths
      that are not a multiple of ``group_size``.
    * ``quantize_layers``: indices of the layers to quantize (default: all); the others keep full precision,
      which isolates one layer's error to watch it propagate.

    Presets: :meth:`kvarn`, :meth:`per_token`, :meth:`kivi`. :attr:`nbytes` is the true stored size.
    """

    def __init__(self, config, bits: int = 4, group_size: int = 128, key_granularity: str = "group",
                 value_granularity: str = "group", normalize: bool = True, stats: Sequence[KVStats] | None = None,
                 window: int = 0, quantize_layers: Iterable[int] | None = None, quantize_partial: bool = False):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = int(cfg.num_hidden_layers)
        if stats is not None:
            stats = list(stats)
            if len(stats) != n_layers:
                raise ValueError(f"stats has {len(stats)} layers but the model has {n_layers}")
            from labsrc.models import config_head_dim
            want = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, config_head_dim(cfg))
            for i, st in enumerate(stats):
                if not isinstance(st, KVStats):
                    raise TypeError(f"stats[{i}] must be a KVStats, got {type(st).__name__}")
                if tuple(st.k.mean.shape) != want or tuple(st.v.mean.shape) != want:
                    raise ValueError(f"stats[{i}] have shape {tuple(st.k.mean.shape)}, expected (n_kv_heads, head_dim) = {want}")
        if quantize_layers is None:
            chosen = set(range(n_layers))
        else:
            try:  # ints, numpy or 0-d tensor integers; not floats, bools or strings
                if isinstance(quantize_layers, (str, bytes)) or \
                        any(isinstance(i, bool) for i in quantize_layers):
                    raise TypeError
                chosen = {operator.index(i) for i in quantize_layers}
            except TypeError:
                raise ValueError(f"quantize_layers must be an iterable of layer indices (ints), "
                                 f"got {quantize_layers!r}") from None
        if any(i < 0 or i >= n_layers for i in chosen):
            raise ValueError(f"quantize_layers must be in [0, {n_layers}), got {sorted(chosen)}")
        layers = [KVarNLayer(bits, group_size, key_granularity, value_granularity, normalize,
                             None if stats is None else stats[i], window, enabled=i in chosen,
                             quantize_partial=quantize_partial)
                  for i in range(n_layers)]
        super().__init__(layers=layers)

    @classmethod
    def kvarn(cls, config, stats: Sequence[KVStats] | None, bits: int = 4, group_size: int = 128, window: int = 0,
              **kw) -> "KVarNCache":
        """KVarN: calibrated per-channel normalisation, then one step per ``group_size`` tokens."""
        return cls(config, bits, group_size, "group", "group", True, stats, window, **kw)

    @classmethod
    def per_token(cls, config, bits: int = 4, window: int = 0, **kw) -> "KVarNCache":
        """The baseline: one step per token for K and V, no normalisation."""
        return cls(config, bits, 1, "token", "token", False, None, window, **kw)

    @classmethod
    def kivi(cls, config, bits: int = 4, group_size: int = 32, window: int = 32, **kw) -> "KVarNCache":
        """KIVI: keys per channel (per ``group_size`` tokens), values per token, recent ``window`` tokens in full."""
        return cls(config, bits, group_size, "channel", "token", False, None, window, **kw)

    def nbytes_breakdown(self) -> dict:
        out: dict = {}
        for layer in self.layers:
            for key, val in layer.nbytes_breakdown().items():
                out[key] = out.get(key, 0) + val
        return out

    @property
    def nbytes(self) -> int:
        """True stored bytes over all layers (quantized parts + statistics + full-precision tail)."""
        return sum(self.nbytes_breakdown().values())


# ----------------------------------------------------------------------------------------------- experiments
CacheFactory = Callable[[], "Cache | None"]


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor, cache: "Cache | None" = None) -> torch.Tensor:
    """Per-position next-token negative log-likelihood ``(B, T-1)`` of one forward pass through ``cache``.

    With a quantized cache the prefill's attention already reads the quantized K/V (what ``update`` returns),
    so ``exp(mean)`` is the perplexity under that cache.
    """
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    ids = ids.to(next(model.parameters()).device)
    kw = {} if cache is None else {"cache": cache, "use_cache": True}
    logits = model(input_ids=ids, **kw).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")


@torch.no_grad()
def hidden_state_errors(model, input_ids: torch.Tensor, cache: "Cache") -> list[float]:
    """Relative error ``||h_q - h|| / ||h||`` of every layer's output with ``cache`` against a full-precision run.

    Entry ``l`` is after layer ``l`` (the embeddings are left out), so the list shows how the error grows
    with depth; combine with ``KVarNCache(..., quantize_layers=[i])`` to follow one layer's error downstream.
    """
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    ids = ids.to(next(model.parameters()).device)
    ref = model(input_ids=ids, output_hidden_states=True).hidden_states[1:]
    got = model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True).hidden_states[1:]
    return [float((g.float() - r.float()).norm() / r.float().norm()) for g, r in zip(got, ref)]


@torch.no_grad()
def probe_accuracy(model, samples, make_cache: CacheFactory) -> float:
    """Fraction of answer spans greedy decoding gets right when the prompt runs through ``make_cache()``.

    ``samples`` are :class:`labsrc.tasks.Sample` objects (``.ids``, ``.spans``); ``make_cache`` returns a
    fresh cache per sample (or None for the plain model), e.g. ``lambda: KVarNCache.kvarn(cfg, stats)``.
    """
    device = next(model.parameters()).device
    right = []
    for s in samples:
        ids = torch.tensor([s.ids], device=device)
        cache = make_cache()
        kw = {} if cache is None else {"cache": cache, "use_cache": True}
        pred = model(input_ids=ids, **kw).logits.argmax(-1)
        right.extend(bool((pred[0, a - 1:e - 1] == ids[0, a:e]).all()) for a, e in s.spans)
    if not right:
        raise ValueError("samples have no answer spans")
    return sum(right) / len(right)
