"""What every drafter shares: a model's forward on a cache, a fresh cache, rolling a cache back to a length, its
size in bytes, the end-of-sequence ids and the logit warping of sampling.
"""
from __future__ import annotations

import torch

from labsrc.sampling import sampling_probs


# ----------------------------------------------------------------------------------------------- generation
# The sampling distribution (temperature and top-p) is labsrc.sampling's, the rule the serving engine and the
# server use too; warp_logits is its name in this module and in chapter 10.
warp_logits = sampling_probs


def _rollback(cache, length: int) -> None:
    """Cut a transformers cache back to its first ``length`` positions (``crop(-n)`` drops the newest ``n``)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def cache_nbytes(cache) -> int:
    """Stored bytes of a transformers KV cache: a quantized cache's own count (``nbytes``), else the keys and
    values of every layer."""
    if cache is None:
        return 0
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


@torch.no_grad()
def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Feed ``ids (1, n)`` after ``cache``; return the float logits ``(n, V)``."""
    out = model(input_ids=ids, cache=cache, use_cache=True)
    return out.logits[0].float()


def _eos_ids(model) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
