"""Measuring eviction on the lab's model: which tokens survive, the loss of the next token, the budget for a
share kept, greedy generation with an evicting cache and whether its answer is right.
"""
from __future__ import annotations

from numbers import Real

from transformers.cache_utils import Cache
import torch

from labsrc.kv_eviction.cache import EvictingCache
from labsrc.kv_eviction.policies import EvictionPolicy, FIFO
from labsrc.kv_eviction.scores import _nonneg_int


def survival_matrix(cache: EvictingCache, layer_idx: int = 0, head: int = 0) -> torch.Tensor:
    """Boolean ``(evictions, seen)``: row r marks the positions still cached after the r-th eviction of
    layer ``layer_idx`` (KV head ``head``; use 0 when the cache is shared). Needs ``record=True``."""
    if not cache.record:
        raise ValueError("build the cache with record=True to log survival")
    log = cache.layers[layer_idx].log
    if not log:
        raise ValueError(f"layer {layer_idx} has not evicted anything yet")
    seen = cache.layers[layer_idx].seen
    out = torch.zeros((len(log), seen), dtype=torch.bool)
    for r, (_, pos) in enumerate(log):
        out[r, pos[head].cpu()] = True
    return out


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor, cache: Cache | None, prefill: int) -> torch.Tensor:
    """Teacher-forced negative log-likelihood of ``input_ids[0, prefill:]`` with the prompt
    ``input_ids[:, :prefill]`` fed at once and every later token one at a time through ``cache``
    (so the cache evicts between tokens). Returns float32 ``(L - prefill,)``; mean it and exp for perplexity.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, L), got {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 1 <= prefill < length:
        raise ValueError(f"prefill must be an int in [1, {length - 1}], got {prefill!r}")
    out = model(input_ids[:, :prefill], cache=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    cache = out.cache
    for t in range(prefill, length - 1):
        out = model(input_ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0, -1])
    logp = torch.log_softmax(torch.stack(logits).float(), -1)
    return -logp.gather(1, input_ids[0, prefill:, None]).squeeze(1)


def budget_for(n_tokens: int, evict_rate: float, protect: int = 0) -> int:
    """The budget that evicts a fraction ``evict_rate`` of ``n_tokens`` (0.5 keeps half), never below
    ``protect + 1``: ``max(protect + 1, round((1 - evict_rate) * n_tokens))``."""
    if isinstance(evict_rate, bool) or not isinstance(evict_rate, Real) or not 0.0 <= evict_rate < 1.0:
        raise ValueError(f"evict_rate must lie in [0, 1), got {evict_rate!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    return max(_nonneg_int("protect", protect) + 1, round((1.0 - evict_rate) * n_tokens))


@torch.no_grad()
def generate_evicting(model, input_ids: torch.Tensor, policy: EvictionPolicy, budget: int, protect: int = 0,
                      max_new_tokens: int = 16, seed: int = 0, **cache_kwargs) -> tuple[torch.Tensor, EvictingCache]:
    """Greedy ``model.generate`` through an :class:`EvictingCache` (hooks attached and removed here).

    Returns ``(new token ids (1, max_new_tokens), cache)``; the cache keeps its timings, log and kept
    positions for inspection. ``seed`` seeds the policy's generator; ``cache_kwargs`` go to the cache
    (``shared``, ``slack``, ``record``).
    """
    with EvictingCache(policy, budget, protect=protect, model=model, generator=torch.Generator().manual_seed(seed),
                       **cache_kwargs) as cache:
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, cache=cache)
    return out[:, input_ids.shape[1]:], cache


@torch.no_grad()
def answer_matches(model, samples, policy: EvictionPolicy | None, evict_rate: float | None, seed: int = 0,
                   **cache_kwargs) -> list[bool]:
    """For each probe sample (:class:`labsrc.tasks.Sample`): does greedy generation through an evicting cache
    reproduce its answer exactly?

    The budget is ``budget_for(prompt length, evict_rate)`` for each sample; ``policy=None`` with
    ``evict_rate=None`` is the full cache (nothing is ever evicted). Sample j uses seed ``seed + j``.
    """
    if (policy is None) != (evict_rate is None):
        raise ValueError("give both policy and evict_rate, or neither (the full cache)")
    right = []
    for j, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids])
        if policy is None:
            pol, budget = FIFO(), ids.shape[1] + len(s.answer_ids)
        else:
            pol, budget = policy, budget_for(ids.shape[1], evict_rate)
        new, _ = generate_evicting(model, ids, pol, budget, max_new_tokens=len(s.answer_ids), seed=seed + j,
                                   **cache_kwargs)
        right.append(new[0].tolist() == list(s.answer_ids))
    return right


def answer_accuracy(model, samples, policy: EvictionPolicy | None, evict_rate: float | None, seed: int = 0,
                    **cache_kwargs) -> float:
    """The fraction of :func:`answer_matches` that hold."""
    right = answer_matches(model, samples, policy, evict_rate, seed, **cache_kwargs)
    return sum(right) / len(right)


@torch.no_grad()
def record_qkv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The post-RoPE queries, keys and values of every layer for one forward over ``input_ids`` (1, L):
    a list over layers of ``(q (H_q, L, d), k (H_kv, L, d), v (H_kv, L, d_v))``, captured by the same hooks
    :class:`EvictingCache` uses. Query head h reads KV head ``h // (H_q // H_kv)``. Feed slices of these to
    :func:`subset_loss` / :func:`optimal_subset`, or their softmax to :meth:`TokenStats.from_attention`."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, L), got {tuple(input_ids.shape)}")
    with EvictingCache(FIFO(), budget=input_ids.shape[1], model=model) as cache:
        model(input_ids, cache=cache, use_cache=True)
    return [(layer.pending_query[0], layer.keys[0], layer.values[0]) for layer in cache.layers]
