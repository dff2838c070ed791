"""KV-cache eviction: keep ``budget`` of the ``N`` cached tokens and drop the rest.

One interface serves every policy. A policy looks at per-token statistics (:class:`TokenStats`: the
tokens' positions, their value vectors, the attention recent queries paid them, their accumulated
attention and when they were last attended) and returns the sorted indices of the tokens to keep:

* :class:`FIFO` (a sliding window): keep the newest tokens;
* :class:`LRU`: keep the tokens most recently attended above a threshold;
* :class:`H2O`: heavy hitters by accumulated attention, plus a window of recent tokens;
* :class:`StreamingLLM`: the first few tokens (attention sinks) plus a window of recent tokens;
* :class:`Scissorhands`: tokens that were important most often over a history of queries;
* :class:`ValueAware`: Score(i) = A_i^alpha * ||V_i||^beta * R_i^gamma, kept stochastically
  (:func:`stochastic_keep`) or by top-K (:func:`topk_keep`).

Every policy honours a protected prefix (a system prompt: the first ``protect`` positions are never
evicted). :class:`PagedEvictionPool` runs the same choice at page granularity with lazy release, and
:class:`EvictingCache` plugs any policy into ``model.generate()`` of a Hugging Face model.

How the attention statistics are collected inside the cache: a cache's ``update()`` sees keys and values,
never queries. :class:`EvictingCache` therefore registers two hooks on each attention module when given
the model: a pre-hook that records the rotary ``(cos, sin)`` the module receives, and a hook on ``q_proj``
that applies the same rotary embedding to its output. That yields the exact post-RoPE queries the model
uses, and ``update()`` recomputes their softmax over the cached keys (the same keys, the same causal mask),
without touching the model's own attention call. The price is one extra ``Q K^T`` per layer per step,
which the cache times (``cache.timings``) so the overhead can be measured rather than assumed.

Recipes for the chapter's experiments (batch size 1; ``protect`` = length of the system prompt):

* a policy at 50% / 75% eviction on a probe: ``new, cache = generate_evicting(model, ids, H2O(),
  budget_for(ids.shape[1], 0.5, protect), protect)``; perplexity: ``token_nll(model, ids,
  EvictingCache(policy, budget, protect, model=model), prefill).mean().exp()`` (use ``with``, or
  ``cache.detach()`` afterwards, to remove the hooks).
* the A/V/R ablation: ``ValueAware(alpha=1, beta=0, gamma=0)`` (A only), ``(0, 0.5, 0)`` (V only), etc.;
  ``stochastic=False`` for the top-K ablation.
* GQA: per-KV-head choice with the group summed (default), ``ValueAware(head_reduce="max")``, or one
  choice per layer with ``EvictingCache(..., shared=True)``.
* value-norm spread: ``value_norm_cv(DynamicCache_layer.values[0])`` (one number per KV head).
* overhead: ``sum(cache.timings.values()) / cache.steps`` seconds per decode step, against the
  generate time of a plain ``DynamicCache``.
* token survival: ``EvictingCache(..., record=True)`` then ``survival_matrix(cache, layer, head)``.
* distance to the best subset: ``record_qkv(model, ids)`` -> ``optimal_subset(q, k, v, budget)`` versus
  ``subset_loss(q, k, v, policy.select(TokenStats.from_attention(attn, v), budget))`` on a tiny slice.

The package holds one concept per file (every name above is importable from here):

* :mod:`labsrc.kv_eviction.scores`: Which tokens to keep: the recency and value-aware scores, and the ways of
  turning scores into a keep set of ``budget`` tokens (top-k, systematic and Bernoulli sampling with the
  inclusion probabilities that keep the expected budget).
* :mod:`labsrc.kv_eviction.subset`: The reference every policy is measured against: the attention-output loss of
  keeping a subset, and the best subset by brute force (small sizes only).
* :mod:`labsrc.kv_eviction.policies`: The eviction policies (FIFO, LRU, H2O, StreamingLLM, Scissorhands, value-
  aware) over per-token statistics, and the registry ``POLICIES`` that names them.
* :mod:`labsrc.kv_eviction.paged`: Eviction at page granularity with lazy release: tokens are dropped one by
  one, pages go back to the pool when they empty.
* :mod:`labsrc.kv_eviction.cache`: A ``transformers`` cache that evicts: each layer keeps its budget of tokens
  by a policy, as the model decodes.
* :mod:`labsrc.kv_eviction.measure`: Measuring eviction on the lab's model: which tokens survive, the loss of
  the next token, the budget for a share kept, greedy generation with an evicting cache and whether its answer
  is right.
"""
from __future__ import annotations

from labsrc.kv_eviction.scores import (_check_budget, _check_real, _check_scores, _nonneg_int, _uniform,
                                       bernoulli_keep, inclusion_probabilities, recency, retention_frequencies,
                                       stochastic_keep, systematic_indices, topk_keep, value_aware_scores,
                                       value_norm_cv)
from labsrc.kv_eviction.subset import _check_qkv, optimal_subset, subset_loss
from labsrc.kv_eviction.policies import (EvictionPolicy, FIFO, H2O, LRU, POLICIES, Scissorhands, SlidingWindow,
                                         StreamingLLM, TokenStats, ValueAware, _recent_mask, make_policy)
from labsrc.kv_eviction.paged import PagedEvictionPool
from labsrc.kv_eviction.cache import EvictingCache, EvictingLayer
from labsrc.kv_eviction.measure import (answer_accuracy, answer_matches, budget_for, generate_evicting,
                                        record_qkv, survival_matrix, token_nll)

__all__ = [
    "value_aware_scores", "recency", "inclusion_probabilities", "systematic_indices", "stochastic_keep",
    "bernoulli_keep", "topk_keep", "retention_frequencies", "value_norm_cv", "subset_loss", "optimal_subset", "TokenStats",
    "EvictionPolicy", "FIFO", "SlidingWindow", "LRU", "H2O", "StreamingLLM", "Scissorhands", "ValueAware",
    "make_policy", "POLICIES", "PagedEvictionPool", "EvictingLayer", "EvictingCache", "survival_matrix",
    "token_nll", "budget_for", "generate_evicting", "record_qkv",
]

