"""What quantization costs, computed: the channel variances and their spread, the error of a grouping and the
error the variance ratio predicts, and the bytes of a quantized cache.
"""
from __future__ import annotations

import torch

from labsrc.kernels.kv_quant.codes import (STORE_BYTES, _check_bits, _check_granularity, _check_group_size, _check_int,
                                   _check_x)
from labsrc.kernels.kv_quant.tensor import ChannelStats, fake_quantize


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
