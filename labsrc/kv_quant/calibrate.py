"""Calibration: the model's keys and values on calibration text, and KVarN's per-channel statistics from them.
"""
from __future__ import annotations

import torch

from labsrc.kernels.kv_quant.codes import _check_int
from labsrc.kernels.kv_quant.tensor import ChannelStats, KVStats


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
