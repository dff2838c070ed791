"""Measuring a quantized cache on the lab's model: the next-token loss, the hidden states' error and the probes'
accuracy.
"""
from __future__ import annotations

import torch

from labsrc.kv_quant.cache import CacheFactory


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
