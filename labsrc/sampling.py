"""Logits -> the distribution the next token is drawn from: one rule for temperature and top-p.

Speculative decoding (:mod:`labsrc.speculative`), the serving engine and the OpenAI-compatible server
(:mod:`labsrc.serving`) all sample tokens; they take the distribution from here, so that one request means the
same thing everywhere, and the server refuses at the door (:func:`check_sampling`) exactly what the rule
cannot serve.

**Temperature.** ``temperature == 0`` is greedy: the argmax token (the lowest index among ties) with
probability 1. A positive temperature ``T`` gives ``softmax(logits / T)``, computed as
``softmax((logits - max logits) / T)`` in float64. The two are the same distribution wherever the first is
finite, but the first is not finite for tiny ``T``: ``logits / 1e-310`` overflows to ``+-inf`` and softmax
then computes ``inf - inf = NaN`` (and a sampler raises on it). Subtracting the maximum first makes the
largest logit exactly 0 and every other one ``(l - max) / T <= 0``, so a tiny ``T`` gives its exact limit:
probability 1 on the argmax, shared equally among tokens tied at the maximum, never NaN. There is no
threshold below which a temperature is "treated as 0": the distribution converges to greedy as ``T -> 0``,
and ``T = 0`` differs from a tiny ``T`` only on exact ties (argmax picks the lowest index). A ``+inf`` logit
counts as the maximum (its tokens share the mass); NaN logits, or a row with no logit above ``-inf``, have no
distribution and raise ``ValueError``.

**Top-p.** The nucleus is transformers' ``TopPLogitsWarper``: tokens are dropped from the least likely up while
the mass dropped stays ``<= 1 - top_p`` (the most likely token is always kept), and the rest renormalised.
"""
from __future__ import annotations

import math
from numbers import Real

import torch

__all__ = ["check_sampling", "sampling_probs", "sample_token"]


def check_sampling(temperature, top_p=1.0) -> tuple[float, float]:
    """Validate a temperature and a top-p; return them as floats.

    ``temperature`` must be a finite real ``>= 0`` (0 is greedy), ``top_p`` a real in ``(0, 1]``. Raises
    ``TypeError`` for a value that is not a real number (a bool included) and ``ValueError`` for one out of
    range, each naming the argument: what a server should answer with 400.
    """
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    temperature, top_p = float(temperature), float(top_p)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return temperature, top_p


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution over the last axis of ``logits`` (any leading shape), float64.

    ``temperature == 0``: one-hot on the argmax. ``temperature > 0``: ``softmax((logits - max) / temperature)``,
    exact for every temperature down to the smallest float (see the module docstring), then the top-p nucleus.
    Raises ``ValueError`` for NaN logits, a row with no logit above ``-inf``, or arguments
    :func:`check_sampling` refuses.
    """
    temperature, top_p = check_sampling(temperature, top_p)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("logits must be a floating-point torch.Tensor with a vocabulary axis")
    if logits.shape[-1] < 1:
        raise ValueError("logits must hold at least one token on the last axis")
    x = logits.double()
    if bool(torch.isnan(x).any()):
        raise ValueError("logits hold NaN: there is no distribution to sample from")
    top = x.amax(-1, keepdim=True)
    if bool((top == float("-inf")).any()):
        raise ValueError("a row of logits is -inf everywhere: no token can be sampled")
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).double()
    # the maximum becomes exactly 0 and everything else <= 0: no overflow, no inf - inf, whatever T is
    z = torch.where(x == top, torch.zeros_like(x), (x - top) / temperature)
    probs = torch.softmax(z, dim=-1)
    if top_p < 1:
        sorted_p, idx = probs.sort(-1, descending=False)
        drop_sorted = sorted_p.cumsum(-1) <= (1 - top_p)
        drop_sorted[..., -1] = False                 # the most likely token always stays
        probs = probs.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """One token id from ``logits (V,)`` under :func:`sampling_probs`: the argmax when ``temperature == 0``
    (no random number drawn), else a draw with ``generator`` (a CPU generator: the draw happens on the CPU)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1:
        raise ValueError("logits must be a 1-D tensor (V,) for one token")
    probs = sampling_probs(logits, temperature, top_p)
    if temperature == 0:
        return int(probs.argmax())
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
