"""Rotary position embeddings (RoPE) and the ways of stretching them to longer contexts.

RoPE (Su et al., RoFormer) splits each head vector of size ``D`` into ``D/2`` pairs and rotates pair ``i`` at
position ``m`` by the angle ``m * theta_i`` with

    theta_i = base ** (-2 i / D),   i = 0 .. D/2 - 1.

``theta_i`` is the pair's *inverse frequency* (``inv_freq`` below): pair 0 turns by one radian per token (high
frequency, short wavelength ``2 pi``), the last pair turns slowest (wavelength close to ``2 pi * base``). Because
a query rotated by ``m theta`` and a key rotated by ``n theta`` meet in a dot product that depends only on
``(m - n) theta``, attention sees relative positions.

A model trained at context length ``L`` has only ever seen the angles ``m theta_i`` for ``m < L``. Every
context-extension method in this module changes the ``theta_i`` (and sometimes a temperature on the
attention logits) so that positions up to ``s L`` produce angles the model knows. They all return
``(inv_freq, attention_scaling)``, the same pair ``transformers`` computes from a model's ``rope_parameters``,
and the tests check that they agree with ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``:

=========  =============================================================  ======================================
method     idea                                                           transformers ``rope_type``
=========  =============================================================  ======================================
default    the original RoPE frequencies                                  ``default``
linear     position interpolation: every frequency divided by ``s``       ``linear``
ntk        static NTK-aware: a larger base, ``base * s**(d/(d-2))``        (none; equals ``dynamic`` at one length)
dynamic    NTK-aware with ``s`` recomputed from the current length        ``dynamic``
yarn       NTK-by-parts ramp per pair plus an attention temperature       ``yarn``
llama3     Llama 3.1's piecewise rule on the wavelength                   ``llama3``
=========  =============================================================  ======================================

The layout is the one Llama uses: the two members of pair ``i`` are coordinates ``i`` and ``i + D/2`` (the
"rotate half" layout), so the cos/sin tables are ``cat(freqs, freqs)``.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import NamedTuple

import torch

# the reference beside its kernel (CONTRIBUTING: kernels import nothing above them); chapter 4 uses it from here
from labsrc.kernels.rope import apply_rope_ref, check_rope_inputs, rotate_half

__all__ = [
    "METHODS", "rope_frequencies", "default_frequencies", "linear_frequencies", "ntk_frequencies",
    "dynamic_frequencies", "yarn_frequencies", "llama3_frequencies", "ntk_base", "yarn_attention_scaling",
    "yarn_correction_range", "rope_cos_sin", "rotate_half", "apply_rope_ref", "wavelengths", "max_angles",
    "AngleRange", "check_rope_inputs",
]


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------

def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_number(name: str, value, *, minimum: float | None = None, strict: bool = False) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return value


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_factor(method: str, factor) -> float:
    if factor is None:
        raise ValueError(f"method {method!r} needs factor (the context-extension ratio s >= 1)")
    if not _is_number(factor):
        raise ValueError(f"factor must be a finite number >= 1 for method {method!r}, got {factor!r}")
    if factor < 1:
        raise ValueError(f"factor must be >= 1 for method {method!r} (it is the ratio new length / trained "
                         f"length), got {factor!r}")
    return float(factor)


def _check_dim(dim, *, ntk: bool = False) -> int:
    """The rotary dimension a method function receives: an even positive int (> 2 for the NTK-aware base,
    whose exponent ``dim / (dim - 2)`` divides by zero at 2)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim (the rotary dimension) must be an even int >= 2, got {dim!r}")
    if ntk and dim <= 2:
        raise ValueError(f"the NTK-aware base needs a rotary dimension > 2, got {dim}")
    return dim


def _check_base(base) -> float:
    return _check_number("base", base, minimum=1.0, strict=True)


def _check_inv_freq(inv_freq) -> torch.Tensor:
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        raise ValueError("inv_freq must be a 1-D tensor of inverse frequencies")
    if not inv_freq.is_floating_point():
        raise ValueError(f"inv_freq must be a floating-point tensor, got {inv_freq.dtype}")
    if not bool(torch.isfinite(inv_freq).all()) or bool((inv_freq <= 0).any()):
        raise ValueError("inv_freq must hold finite positive inverse frequencies")
    return inv_freq


def _rotary_dim(head_dim, partial_rotary_factor) -> int:
    """How many coordinates of the head are rotated: ``int(head_dim * partial_rotary_factor)``, even."""
    _check_positive_int("head_dim", head_dim)
    prf = _check_number("partial_rotary_factor", partial_rotary_factor, minimum=0.0, strict=True)
    if prf > 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}")
    dim = int(head_dim * prf)
    if dim < 2 or dim % 2:
        raise ValueError(f"the rotary dimension int(head_dim * partial_rotary_factor) = {dim} must be even and "
                         f">= 2 (head_dim={head_dim}, partial_rotary_factor={partial_rotary_factor})")
    return dim


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``theta_i = base ** (-2i/dim)`` for ``i = 0 .. dim/2 - 1``, in float32 like every RoPE implementation."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


# ----------------------------------------------------------------------------------------------------------
# the methods, one small function each
# ----------------------------------------------------------------------------------------------------------

def default_frequencies(dim: int, base: float) -> tuple[torch.Tensor, float]:
    """The original RoPE: ``theta_i = base ** (-2i/dim)``, no attention scaling.

    Pair ``i`` completes one turn every ``2 pi / theta_i = 2 pi base**(2i/dim)`` tokens, a geometric ladder of
    wavelengths from ``2 pi`` (pair 0) to almost ``2 pi base`` (the last pair).
    """
    return _base_inv_freq(_check_base(base), _check_dim(dim)), 1.0


def linear_frequencies(dim: int, base: float, factor: float) -> tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al., 2023): divide every frequency by ``s``.

    Rotating by ``(m / s) theta_i`` instead of ``m theta_i`` squeezes positions ``0 .. sL`` back into the
    trained range ``0 .. L``: no pair ever sees an angle it has not seen in training. The price is resolution:
    neighbouring tokens now differ by ``theta_i / s``, so the fast pairs that told adjacent tokens apart are
    blurred ``s`` times, which is why PI needs some fine-tuning.
    """
    factor = _check_factor("linear", factor)
    inv_freq, _ = default_frequencies(dim, base)
    return inv_freq / factor, 1.0


def ntk_base(base: float, factor: float, dim: int) -> float:
    """The NTK-aware base: ``base' = base * s ** (dim / (dim - 2))``.

    Why that exponent: with base ``b'`` the slowest pair (``i = dim/2 - 1``, exponent ``(dim - 2)/dim``) has
    ``theta' = b' ** (-(dim-2)/dim) = b ** (-(dim-2)/dim) * s ** -1``, i.e. it is slowed by exactly ``s``, like
    position interpolation, while pair 0 (exponent 0) is not changed at all. Pairs in between are slowed by
    ``s ** (2i/(dim-2))``, a smooth geometric blend of "extrapolate" at high frequency and "interpolate" at
    low frequency.
    """
    dim = _check_dim(dim, ntk=True)
    base, factor = _check_base(base), _check_factor("ntk", factor)
    return base * factor ** (dim / (dim - 2))


def ntk_frequencies(dim: int, base: float, factor: float) -> tuple[torch.Tensor, float]:
    """Static NTK-aware scaling (bloc97, 2023): RoPE with the larger base :func:`ntk_base`.

    Not in ``transformers`` as its own type; it equals ``dynamic`` with ``factor=1`` evaluated at
    ``seq_len = s * max_position`` (the tests check this).
    """
    return _base_inv_freq(ntk_base(base, factor, dim), dim), 1.0


def dynamic_frequencies(dim: int, base: float, factor: float, max_position: int,
                        seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Dynamic NTK (emozilla, 2023): NTK-aware scaling whose ratio follows the current length.

    Up to the trained length ``L = max_position`` the frequencies are the default ones. Past it, the model
    uses the NTK-aware base for the ratio ``s' = factor * seq_len / L - (factor - 1)``, which is 1 at
    ``seq_len = L`` and grows linearly with the length, so short prompts lose nothing and long ones are
    stretched only as much as they need. (``transformers`` calls ``L`` ``max_position_embeddings``.)
    """
    dim, base = _check_dim(dim, ntk=True), _check_base(base)
    factor = _check_factor("dynamic", factor)
    max_position = _check_positive_int("max_position", max_position)
    if seq_len is not None:
        _check_positive_int("seq_len", seq_len)
    seq_len = max_position if seq_len is None else max(seq_len, max_position)
    ratio = factor * seq_len / max_position - (factor - 1)
    # Same order of operations as transformers, so the float64 base agrees to the last bit.
    new_base = base * ratio ** (dim / (dim - 2))
    return _base_inv_freq(new_base, dim), 1.0


def yarn_attention_scaling(factor: float, mscale=None, mscale_all_dim=None) -> float:
    """YaRN's temperature: the factor applied to cos and sin (so ``scaling**2`` multiplies every logit).

    Stretching the context makes the attention distribution flatter (more keys, similar logits). YaRN
    sharpens it again with ``sqrt(1/t) = 0.1 ln(s) + 1``. DeepSeek-style configs give two coefficients and
    use the ratio ``(0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)``; both must be non-zero for that.
    """
    def mscale_of(scale: float, coef: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coef * math.log(scale) + 1.0

    factor = _check_number("factor", factor, minimum=0.0, strict=True)
    for name, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None:
            _check_number(name, value)
    if mscale and mscale_all_dim:
        denominator = mscale_of(factor, mscale_all_dim)
        if denominator == 0:
            raise ValueError(f"mscale_all_dim={mscale_all_dim!r} makes 0.1 * mscale_all_dim * ln(factor) + 1 zero "
                             f"at factor={factor!r}: the ratio is undefined")
        return float(mscale_of(factor, mscale) / denominator)
    return mscale_of(factor)


def yarn_correction_range(dim: int, base: float, original_max_position: int, beta_fast: float,
                          beta_slow: float, truncate: bool = True) -> tuple[float, float]:
    """The pair indices ``(low, high)`` between which YaRN's ramp goes from "keep" to "interpolate".

    Over the trained length ``L`` pair ``i`` turns ``r_i = L theta_i / (2 pi)`` times. Solving
    ``r = L / (2 pi base**(2i/dim))`` for ``i`` gives ``i(r) = dim ln(L / (2 pi r)) / (2 ln base)``.
    ``low = i(beta_fast)``: pairs at or below it turn more than ``beta_fast`` times in training, so every
    angle was seen and they are kept. ``high = i(beta_slow)``: pairs above it turn less than ``beta_slow``
    times and are interpolated. ``truncate`` rounds the range outwards to whole pairs.
    """
    dim, base = _check_dim(dim), _check_base(base)
    original_max_position = _check_positive_int("original_max_position", original_max_position)
    beta_fast = _check_number("beta_fast", beta_fast, minimum=0, strict=True)
    beta_slow = _check_number("beta_slow", beta_slow, minimum=0, strict=True)
    if not isinstance(truncate, bool):
        raise ValueError(f"truncate must be a bool, got {truncate!r}")

    def index_for(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = index_for(beta_fast), index_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    # transformers clamps to dim - 1 (not dim/2 - 1); the ramp clamps anyway, kept for identical results.
    return max(low, 0), min(high, dim - 1)


def yarn_frequencies(dim: int, base: float, factor: float, original_max_position: int, *, beta_fast: float = 32,
                     beta_slow: float = 1, attention_factor=None, mscale=None, mscale_all_dim=None,
                     truncate: bool = True) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): "NTK-by-parts" interpolation plus an attention temperature.

    Each pair gets a weight ``gamma_i`` from a linear ramp over its index (see
    :func:`yarn_correction_range`): ``gamma = 1`` for fast pairs (index <= low, many turns during training:
    keep ``theta_i``, i.e. extrapolate), ``gamma = 0`` for slow pairs (index >= high, less than one turn
    in training: position-interpolate, ``theta_i / s``), and a linear blend in between:

        theta_i' = (1 - gamma_i) theta_i / s + gamma_i theta_i.

    ``attention_scaling`` multiplies cos and sin (:func:`yarn_attention_scaling` unless given).
    """
    dim, base, factor = _check_dim(dim), _check_base(base), _check_factor("yarn", factor)
    if attention_factor is None:
        attention_factor = yarn_attention_scaling(factor, mscale, mscale_all_dim)
    else:
        _check_number("attention_factor", attention_factor, minimum=0, strict=True)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1.0 / pos_freqs                 # extrapolation: the trained frequencies
    interpolate = 1.0 / (factor * pos_freqs)

    low, high = yarn_correction_range(dim, base, original_max_position, beta_fast, beta_slow, truncate)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    gamma = 1 - ramp
    return interpolate * (1 - gamma) + keep * gamma, float(attention_factor)


def llama3_frequencies(dim: int, base: float, factor: float, original_max_position: int,
                       low_freq_factor: float, high_freq_factor: float) -> tuple[torch.Tensor, float]:
    """Llama 3.1's rule: decide per pair from its wavelength ``lambda_i = 2 pi / theta_i``.

    With ``L`` the trained length: pairs with ``lambda < L / high_freq_factor`` (many turns in training) are
    kept; pairs with ``lambda > L / low_freq_factor`` (at most a few turns) are divided by ``s``; in between,
    ``theta' = (1 - a) theta / s + a theta`` with ``a = (L / lambda - low_freq_factor) / (high_freq_factor -
    low_freq_factor)`` rising from 0 to 1. The same idea as YaRN's ramp, expressed on wavelengths.
    """
    factor = _check_factor("llama3", factor)
    original_max_position = _check_positive_int("original_max_position", original_max_position)
    low_freq_factor = _check_number("low_freq_factor", low_freq_factor, minimum=0, strict=True)
    high_freq_factor = _check_number("high_freq_factor", high_freq_factor, minimum=0, strict=True)
    if high_freq_factor <= low_freq_factor:
        raise ValueError(f"high_freq_factor ({high_freq_factor:g}) must be > low_freq_factor ({low_freq_factor:g})")
    inv_freq, _ = default_frequencies(dim, base)
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled), 1.0


# ----------------------------------------------------------------------------------------------------------
# the dispatcher
# ----------------------------------------------------------------------------------------------------------

_EXTRA_PARAMS = {
    "default": set(),
    "linear": set(),
    "ntk": set(),
    "dynamic": set(),
    "yarn": {"beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"},
    "llama3": {"low_freq_factor", "high_freq_factor"},
}
METHODS: tuple[str, ...] = tuple(_EXTRA_PARAMS)
"""The methods :func:`rope_frequencies` knows."""


def rope_frequencies(head_dim: int, base: float = 10000.0, method: str = "default", factor: float | None = None,
                     original_max_position: int | None = None, seq_len: int | None = None,
                     max_position: int | None = None, **params) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling for one of :data:`METHODS`.

    Arguments mirror a ``transformers`` config: ``base`` is ``rope_theta``; ``factor`` the extension ratio
    ``s``; ``max_position`` is ``max_position_embeddings``; ``original_max_position`` is
    ``rope_parameters["original_max_position_embeddings"]`` (the pre-training length, used by yarn and
    llama3, and defaulting to ``max_position`` there as in ``transformers``); ``seq_len`` is the current length
    (dynamic only; other methods ignore it). Extra ``params``: ``partial_rotary_factor`` (all methods; only
    the first ``int(head_dim * partial_rotary_factor)`` coordinates are rotated), for yarn ``beta_fast``
    (32), ``beta_slow`` (1), ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate`` (True), for
    llama3 ``low_freq_factor`` and ``high_freq_factor`` (required). For yarn, ``factor=None`` means
    ``max_position / original_max_position``.

    Returns ``(inv_freq, attention_scaling)``: a float32 tensor of ``rotary_dim / 2`` frequencies and the
    factor that multiplies the cos/sin tables. Raises ``ValueError`` naming any unknown method, invalid or
    missing argument.
    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown RoPE method {method!r}; known methods: {', '.join(METHODS)}")
    unknown = set(params) - _EXTRA_PARAMS[method] - {"partial_rotary_factor"}
    if unknown:
        accepted = sorted(_EXTRA_PARAMS[method] | {"partial_rotary_factor"})
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} for method {method!r}; it accepts {accepted}")
    dim = _rotary_dim(head_dim, params.get("partial_rotary_factor", 1.0))
    base = _check_number("base", base, minimum=1.0, strict=True)
    if original_max_position is not None:
        _check_positive_int("original_max_position", original_max_position)
    if max_position is not None:
        _check_positive_int("max_position", max_position)

    if method == "default":
        if factor is not None and factor != 1:
            raise ValueError(f"method 'default' does not scale; factor must be None or 1, got {factor!r}")
        return default_frequencies(dim, base)
    if method == "yarn" and factor is None:
        if max_position is None or original_max_position is None:
            raise ValueError("method 'yarn' needs factor, or both max_position and original_max_position to "
                             "infer it")
        factor = max_position / original_max_position
    factor = _check_factor(method, factor)

    if method == "linear":
        return linear_frequencies(dim, base, factor)
    if method == "ntk":
        return ntk_frequencies(dim, base, factor)
    if method == "dynamic":
        if max_position is None:
            raise ValueError("method 'dynamic' needs max_position (the trained length beyond which it scales; "
                             "transformers' max_position_embeddings)")
        if seq_len is not None:
            _check_positive_int("seq_len", seq_len)
        return dynamic_frequencies(dim, base, factor, max_position, seq_len)

    # yarn and llama3 work from the pre-training length.
    if original_max_position is None:
        if max_position is None:
            raise ValueError(f"method {method!r} needs original_max_position (the pre-training length) or "
                             f"max_position")
        original_max_position = max_position
    if method == "yarn":
        beta_fast = params.get("beta_fast")
        beta_slow = params.get("beta_slow")
        beta_fast = 32.0 if beta_fast is None else _check_number("beta_fast", beta_fast, minimum=0, strict=True)
        beta_slow = 1.0 if beta_slow is None else _check_number("beta_slow", beta_slow, minimum=0, strict=True)
        if beta_fast < beta_slow:
            raise ValueError(f"beta_fast ({beta_fast:g}) must be >= beta_slow ({beta_slow:g})")
        attention_factor = params.get("attention_factor")
        if attention_factor is not None:
            _check_number("attention_factor", attention_factor, minimum=0, strict=True)
        for name in ("mscale", "mscale_all_dim"):
            if params.get(name) is not None:
                _check_number(name, params[name])
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be a bool, got {truncate!r}")
        return yarn_frequencies(dim, base, factor, original_max_position, beta_fast=beta_fast,
                                beta_slow=beta_slow, attention_factor=attention_factor,
                                mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                                truncate=truncate)
    # llama3
    for name in ("low_freq_factor", "high_freq_factor"):
        if params.get(name) is None:
            raise ValueError(f"method 'llama3' needs {name} (Llama 3.1 uses low_freq_factor=1, "
                             f"high_freq_factor=4)")
    low = _check_number("low_freq_factor", params["low_freq_factor"], minimum=0, strict=True)
    high = _check_number("high_freq_factor", params["high_freq_factor"], minimum=0, strict=True)
    if high <= low:
        raise ValueError(f"high_freq_factor ({high:g}) must be > low_freq_factor ({low:g})")
    return llama3_frequencies(dim, base, factor, original_max_position, low, high)


# ----------------------------------------------------------------------------------------------------------
# tables, the reference rotation, and what the frequencies mean
# ----------------------------------------------------------------------------------------------------------

def rope_cos_sin(inv_freq: torch.Tensor, positions, attention_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables of the rotate-half layout, ``(*positions.shape, 2 * len(inv_freq))``.

    ``positions`` is an int (meaning ``arange(positions)``) or an integer tensor. Angles are computed in
    float32 (``position * inv_freq``), duplicated as ``cat(freqs, freqs)`` because coordinates ``i`` and
    ``i + D/2`` form pair ``i``, multiplied by ``attention_scaling`` and cast to ``dtype`` last, exactly as
    ``LlamaRotaryEmbedding`` does.
    """
    _check_inv_freq(inv_freq)
    if isinstance(positions, int) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"positions must be a non-negative int (a table of that many rows), got {positions}")
        positions = torch.arange(positions, device=inv_freq.device)
    if (not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex()
            or positions.dtype == torch.bool):
        raise ValueError(f"positions must be an int or an integer tensor, got {positions!r}")
    attention_scaling = _check_number("attention_scaling", attention_scaling)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def wavelengths(inv_freq: torch.Tensor) -> torch.Tensor:
    """Tokens per full turn of each pair: ``2 pi / theta_i``."""
    _check_inv_freq(inv_freq)
    return 2 * math.pi / inv_freq


class AngleRange(NamedTuple):
    """Per pair: the largest angle seen in training, the largest at the target length, and ``unseen``, True
    where the target length produces angles (mod 2 pi) that never occurred in training."""

    trained: torch.Tensor
    target: torch.Tensor
    unseen: torch.Tensor


def max_angles(inv_freq: torch.Tensor, train_length: int, target_length: int) -> AngleRange:
    """Compare, per pair, the rotation angles of positions ``< train_length`` with those ``< target_length``.

    The largest angle of pair ``i`` is ``(length - 1) theta_i``. A pair whose trained angle reached ``2 pi``
    has already seen every angle on the circle, so longer contexts show it nothing new: these are the fast,
    *high-frequency* pairs. The pairs that run out of range are the slow, *low-frequency* ones, whose angle
    in training stayed below one turn: ``unseen = trained < 2 pi and target > trained``.
    """
    _check_inv_freq(inv_freq)
    _check_positive_int("train_length", train_length)
    _check_positive_int("target_length", target_length)
    inv_freq = inv_freq.double()
    trained = (train_length - 1) * inv_freq
    target = (target_length - 1) * inv_freq
    unseen = (trained < 2 * math.pi) & (target > trained)
    return AngleRange(trained, target, unseen)
