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
"""
from __future__ import annotations

import itertools
import math
import sys
import time
import weakref
from dataclasses import dataclass
from numbers import Real

import torch

from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = [
    "value_aware_scores", "recency", "inclusion_probabilities", "systematic_indices", "stochastic_keep",
    "bernoulli_keep", "topk_keep", "retention_frequencies", "value_norm_cv", "subset_loss", "optimal_subset", "TokenStats",
    "EvictionPolicy", "FIFO", "SlidingWindow", "LRU", "H2O", "StreamingLLM", "Scissorhands", "ValueAware",
    "make_policy", "POLICIES", "PagedEvictionPool", "EvictingLayer", "EvictingCache", "survival_matrix",
    "token_nll", "budget_for", "generate_evicting", "record_qkv",
]


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------

def _check_budget(budget, n: int, name: str = "budget") -> int:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{name} must be an int, got {type(budget).__name__}")
    if budget <= 0:
        raise ValueError(f"{name} must be positive, got {budget}")
    if budget > n:
        raise ValueError(f"{name}={budget} is larger than the number of tokens N={n}")
    return budget


def _check_real(name: str, value, *, minimum: float | None = None) -> float:
    """A finite real number (not a bool), at least ``minimum`` when given; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {'non-negative' if minimum == 0 else f'>= {minimum:g}'}, got {value!r}")
    return float(value)


def _check_scores(scores) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"scores must be a non-empty 1-D tensor, got shape {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite")
    if (scores < 0).any():
        raise ValueError("scores must be non-negative")
    return scores


# --------------------------------------------------------------------------------------------------
# The value-aware score and the budget correction
# --------------------------------------------------------------------------------------------------

def recency(n: int, lam: float = 0.5, device=None) -> torch.Tensor:
    """The recency factor R_i = exp(-lam * (N - i) / N) for i = 0..N-1 (0 = the oldest token).

    The oldest token gets exp(-lam) (0.61 for lam = 0.5), the newest exp(-lam / N), close to 1.
    ``n`` must be a positive int and ``lam`` a finite number >= 0.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    lam = _check_real("lam", lam, minimum=0)
    i = torch.arange(n, dtype=torch.float32, device=device)
    return torch.exp(-lam * (n - i) / n)


def value_aware_scores(attn: torch.Tensor, values: torch.Tensor, alpha: float = 1.0, beta: float = 0.5,
                       gamma: float = 0.3, lam: float = 0.5, head_reduce: str = "sum") -> torch.Tensor:
    """Score(i) = A_i^alpha * ||V_i||_2^beta * R_i^gamma for each of the N cached tokens.

    Args:
        attn: ``(heads, W, N)`` softmax probabilities of the last W queries over the N keys, for the query
            heads that share one KV head (a GQA group; all query heads for MHA). Rows of queries that could
            not see a key (the key came later) hold 0.
        values: ``(N, d)`` the cached value vectors of that KV head.
        alpha, beta, gamma: exponents of the three signals; 0 switches a signal off (x^0 = 1), which is
            how the A/V/R ablation is run.
        lam: the recency decay rate in R_i = exp(-lam (N - i) / N), i = 0 for the oldest token.
        head_reduce: how the query heads of the group are combined: ``"sum"`` (the source's
            A_i = sum_h sum_t softmax(q_{t,h} k_{i,h}^T / sqrt(d_h))) or ``"max"`` (a token counts as
            much as the one head that needs it most; the per-head alternative of the GQA discussion).

    A_i sums over the W window queries (not the whole history), so a token that was popular long ago but
    is ignored now loses its advantage. Returns a float32 tensor of shape ``(N,)``.
    """
    if not isinstance(attn, torch.Tensor) or attn.dim() != 3:
        raise ValueError(f"attn must be a 3-D tensor (heads, W, N), got "
                         f"{tuple(attn.shape) if isinstance(attn, torch.Tensor) else type(attn).__name__}")
    if not isinstance(values, torch.Tensor) or values.dim() != 2:
        raise ValueError(f"values must be a 2-D tensor (N, d), got "
                         f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}")
    if attn.shape[-1] != values.shape[0]:
        raise ValueError(f"attn has N={attn.shape[-1]} keys but values has {values.shape[0]} rows")
    if values.shape[0] == 0:
        raise ValueError("values must hold at least one token")
    for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        _check_real(name, value)
    _check_real("lam", lam, minimum=0)
    if head_reduce not in ("sum", "max"):
        raise ValueError(f"head_reduce must be 'sum' or 'max', got {head_reduce!r}")
    n = values.shape[0]
    per_head = attn.float().sum(dim=1)                       # (heads, N): summed over the window
    a = per_head.sum(0) if head_reduce == "sum" else per_head.max(0).values
    v = values.float().norm(dim=-1)
    r = recency(n, lam, device=values.device)
    return a.pow(alpha) * v.pow(beta) * r.pow(gamma)


def inclusion_probabilities(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Keep-probabilities p_i proportional to ``scores``, capped at 1, that sum to exactly ``budget``.

    The source's p_i = min(1, K s_i / sum_j s_j) sums to less than K as soon as one cap binds (the
    probability mass above 1 is simply lost), so the expected number kept falls short of K. Here the
    capped mass is redistributed: items whose share reaches 1 are fixed at 1 and the remaining budget is
    shared, proportionally to score, among the others, until no share exceeds 1 (at most N rounds, each
    linear). Every uncapped p_i is then >= the source's value. If fewer than ``budget`` items have a
    positive score, all of them get 1 and the zero-score items share what is left equally.
    Computed in float64; returns float64 of shape ``(N,)``.
    """
    s = _check_scores(scores).double()
    n = s.numel()
    _check_budget(budget, n)
    p = torch.zeros_like(s)
    positive = s > 0
    n_pos = int(positive.sum())
    if n_pos <= budget:
        p[positive] = 1.0
        zero = ~positive
        if budget > n_pos:
            p[zero] = (budget - n_pos) / int(zero.sum())
        return p
    capped = torch.zeros(n, dtype=torch.bool, device=s.device)
    while True:
        free = ~capped
        remaining = budget - int(capped.sum())
        p = torch.where(capped, torch.ones_like(s), remaining * s / s[free].sum())
        over = free & (p >= 1.0)
        if not over.any():
            return p.clamp_(0.0, 1.0)
        capped |= over


def systematic_indices(p: torch.Tensor, u: float) -> torch.Tensor:
    """Systematic sampling: the indices i whose interval (C_{i-1}, C_i] of the cumulative sum of ``p``
    contains one of the points u, u + 1, ..., u + K - 1 (for u = 0, the points 1, ..., K).

    With sum(p) = K (an integer) and u uniform in [0, 1) this selects exactly K distinct items and item i
    with probability exactly p_i (its interval has length p_i <= 1, so it holds at most one point, and a
    uniformly shifted unit grid hits it with probability p_i). Linear time. Returns the sorted indices.

    ``p`` must be a non-empty 1-D tensor of probabilities (each in [0, 1], none NaN) whose sum is an
    integer K; a p_i above 1 would hold several points and the count would fall short of K. ``u`` is a
    number in [0, 1). Raises ValueError naming the argument otherwise.
    """
    if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
        raise ValueError(f"p must be a 1-D tensor with at least one item, got "
                         f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    if p.is_complex() or p.dtype == torch.bool:
        raise ValueError(f"p must hold real probabilities, got dtype {p.dtype}")
    pd = p.double()
    if not bool(torch.isfinite(pd).all()) or bool((pd < 0).any()) or bool((pd > 1).any()):
        raise ValueError(f"p must hold probabilities in [0, 1] (no NaN), got values in "
                         f"[{float(pd.min())}, {float(pd.max())}]")
    if isinstance(u, torch.Tensor) and u.numel() == 1 and u.dtype != torch.bool:
        u = float(u)
    if isinstance(u, bool) or not isinstance(u, Real) or not 0.0 <= float(u) < 1.0:
        raise ValueError(f"u must lie in [0, 1), got {u!r}")
    u = float(u)
    c = torch.cumsum(pd, 0)
    total = float(c[-1])
    k = round(total)
    if abs(total - k) > 1e-6:
        raise ValueError(f"p must sum to an integer, got {total}")
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=p.device)   # nothing to keep (and no drift to remove)
    # Capped probabilities (p_i = 1) put edges on integers, and float sums land them a hair to either side
    # (0.99999999255 for a float32 p; 1.0000000000000002): snap every edge within the sum's own tolerance of
    # an integer onto it, or the interval it closes would gain or lose a point.
    near = c.round()
    c = torch.where((c - near).abs() <= 1e-6, near, c)
    # Item i is kept when its interval (C_{i-1}, C_i] holds one of the points v, v + 1, ..., v + K - 1, with
    # v = u (v = 1 when u = 0, the same grid shifted by a whole step). Writing C_i = m_i + f_i (integer part,
    # fraction), exactly m_i + [v <= f_i] points lie at or below C_i. Comparing v with f_i, rather than
    # rounding C_i - u, keeps the count exact when u is lost in that subtraction (u = 1e-300, or
    # u = 1 - 2e-16 against C_i = 3), where the rounded count kept K + 1 or K - 1 items.
    v = u if u > 0 else 1.0
    whole = torch.floor(c)
    upper = (whole + (c - whole >= v).to(c.dtype)).clamp_(0, k)
    lower = torch.cat([upper.new_zeros(1), upper[:-1]])
    return torch.nonzero(upper > lower).flatten()


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def stochastic_keep(scores: torch.Tensor, budget: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Keep exactly ``budget`` distinct indices, each with probability p_i (:func:`inclusion_probabilities`).

    The guarantee: the result has exactly ``budget`` items and P(i kept) = p_i = min(1, c * s_i) with the
    constant c chosen so that sum_i p_i = budget (the source's min(1, K s_i / sum s) with the capped mass
    redistributed). It is the source's "Bernoulli(p_i), then correct the count" done without the
    correction's bias: the items are shuffled by a random permutation and systematic sampling
    (:func:`systematic_indices`) is applied in that order. The shuffle leaves every p_i exact and spreads
    the joint inclusion probabilities so that no fixed pair of neighbours is always split.
    Linear time apart from drawing the permutation. Same generator state, same choice. Returns sorted
    int64 indices.
    """
    p = inclusion_probabilities(scores, budget)
    perm = torch.randperm(p.numel(), generator=generator, device="cpu").to(p.device)
    picked = systematic_indices(p[perm], _uniform(generator))
    return torch.sort(perm[picked]).values


def bernoulli_keep(scores: torch.Tensor, budget: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The source's literal recipe, for comparison: draw Bernoulli(p_i) with p_i = min(1, K s_i / sum s),
    then fix the count: drop surplus items uniformly at random among those kept with p_i < 1, or top up
    from the dropped ones in proportion to score (weighted sampling without replacement by the keys
    u^(1/s)). The count is exact, but the inclusion probabilities are only approximately p_i (the
    correction moves them); :func:`stochastic_keep` is exact."""
    s = _check_scores(scores).double()
    n = s.numel()
    _check_budget(budget, n)
    total = float(s.sum())
    p = torch.clamp(budget * s / total, max=1.0) if total > 0 else torch.full_like(s, budget / n)
    kept = torch.rand(n, generator=generator, dtype=torch.float64) < p
    count = int(kept.sum())
    if count > budget:
        removable = torch.nonzero(kept & (p < 1)).flatten()
        if removable.numel() < count - budget:
            removable = torch.nonzero(kept).flatten()
        order = torch.randperm(removable.numel(), generator=generator)
        kept[removable[order[: count - budget]]] = False
    elif count < budget:
        cand = torch.nonzero(~kept).flatten()
        u = torch.rand(cand.numel(), generator=generator, dtype=torch.float64).clamp_min(1e-300)
        key = torch.where(s[cand] > 0, torch.log(u) / s[cand].clamp_min(1e-300), torch.full_like(u, -math.inf))
        key = key + torch.rand(cand.numel(), generator=generator, dtype=torch.float64) * 1e-300
        kept[cand[torch.topk(key, budget - count).indices]] = True
    return torch.nonzero(kept).flatten()


def retention_frequencies(keep_fn, scores: torch.Tensor, budget: int, draws: int = 2000,
                          seed: int = 0) -> torch.Tensor:
    """How often each index is kept over ``draws`` calls ``keep_fn(scores, budget, generator)`` with one
    seeded generator (e.g. :func:`stochastic_keep` or :func:`bernoulli_keep`); float64 ``(N,)``. Compare
    with :func:`inclusion_probabilities`: each count is Binomial(draws, P(kept))."""
    if isinstance(draws, bool) or not isinstance(draws, int) or draws <= 0:
        raise ValueError(f"draws must be a positive int, got {draws!r}")
    if not callable(keep_fn):
        raise ValueError(f"keep_fn must be callable (e.g. stochastic_keep), got {type(keep_fn).__name__}")
    _nonneg_int("seed", seed)
    _check_scores(scores)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(scores.numel(), dtype=torch.float64)
    for _ in range(draws):
        counts[keep_fn(scores, budget, g).cpu()] += 1
    return counts / draws


def topk_keep(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The deterministic ablation of :func:`stochastic_keep`: the ``budget`` highest scores (ties go to the
    newer, higher index). Returns sorted int64 indices."""
    s = _check_scores(scores)
    _check_budget(budget, s.numel())
    order = torch.argsort(s.flip(0), descending=True, stable=True)
    return torch.sort(s.numel() - 1 - order[:budget]).values


def value_norm_cv(values: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation std/mean of the value norms ||V_i||_2 over the tokens (dimension -2).

    ``values`` is ``(..., N, d)``; the result has shape ``(...)``. The source contrasts < 0.3 (summaries,
    translation) with > 0.8 (reasoning) to explain when the value factor matters.
    """
    if not isinstance(values, torch.Tensor) or values.dim() < 2 or values.shape[-2] < 2:
        raise ValueError("values must be a tensor (..., N, d) with N >= 2")
    norms = values.float().norm(dim=-1)
    if not bool(torch.isfinite(norms).all()):
        raise ValueError("values must be finite")
    mean = norms.mean(dim=-1)
    if bool((mean == 0).any()):
        raise ValueError("values must not be all zero over the N tokens: the coefficient of variation "
                         "std/mean is undefined when the mean norm is 0")
    return norms.std(dim=-1) / mean


# --------------------------------------------------------------------------------------------------
# The loss of a subset and the best subset by brute force
# --------------------------------------------------------------------------------------------------

def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q has dimension {q.shape[1]} but k has {k.shape[1]}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")


def subset_loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep) -> torch.Tensor:
    """L(S) = || softmax(Q K^T / sqrt d) V - softmax(Q K_S^T / sqrt d) V_S ||_F for the kept set S.

    ``q`` is ``(T, d)`` (the queries the cache must serve, e.g. future ones), ``k`` ``(N, d)``, ``v``
    ``(N, dv)``, ``keep`` a sequence or tensor of indices. Computed in float64.
    """
    _check_qkv(q, k, v)
    try:
        idx = torch.as_tensor(keep)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"keep must be a sequence or tensor of indices, got {type(keep).__name__}") from None
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool or idx.dim() > 1:
        raise ValueError(f"keep must hold integer indices (a 1-D sequence or tensor), got dtype {idx.dtype} "
                         f"and shape {tuple(idx.shape)}")
    idx = idx.long().flatten()
    if idx.numel() == 0 or idx.unique().numel() != idx.numel() or idx.min() < 0 or idx.max() >= k.shape[0]:
        raise ValueError("keep must hold distinct indices within [0, N)")
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[1] ** -0.5
    full = torch.softmax(q @ k.T * scale, -1) @ v
    part = torch.softmax(q @ k[idx].T * scale, -1) @ v[idx]
    return torch.linalg.norm(full - part)


def optimal_subset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budget: int, protect: int = 0,
                   max_subsets: int = 200_000) -> tuple[torch.Tensor, float]:
    """The subset S (|S| = budget, containing the first ``protect`` tokens) with the smallest
    :func:`subset_loss`, by trying them all. Only for tiny N: the number of subsets is
    C(N - protect, budget - protect), refused above ``max_subsets``. Returns (sorted indices, loss)."""
    _check_qkv(q, k, v)
    n = k.shape[0]
    _check_budget(budget, n)
    if isinstance(protect, bool) or not isinstance(protect, int) or not 0 <= protect <= budget:
        raise ValueError(f"protect must lie in [0, budget={budget}], got {protect!r}")
    if isinstance(max_subsets, bool) or not isinstance(max_subsets, int) or max_subsets <= 0:
        raise ValueError(f"max_subsets must be a positive int, got {max_subsets!r}")
    count = math.comb(n - protect, budget - protect)
    if count > max_subsets:
        raise ValueError(f"{count} subsets exceed max_subsets={max_subsets}; use a smaller N")
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[1] ** -0.5
    logits = q @ k.T * scale                                  # (T, N)
    full = torch.softmax(logits, -1) @ v                      # (T, dv)
    subsets = torch.tensor(list(itertools.combinations(range(protect, n), budget - protect)),
                           dtype=torch.long).reshape(count, budget - protect)
    subsets = torch.cat([torch.arange(protect).expand(count, protect), subsets], 1)
    best_loss, best = math.inf, None
    for chunk in subsets.split(4096):
        lg = logits[:, chunk].permute(1, 0, 2)                # (S, T, K)
        part = torch.softmax(lg, -1) @ v[chunk]               # (S, T, dv)
        loss = torch.linalg.norm((part - full).flatten(1), dim=1)
        i = int(torch.argmin(loss))
        if float(loss[i]) < best_loss:
            best_loss, best = float(loss[i]), chunk[i]
    return torch.sort(best).values, best_loss


# --------------------------------------------------------------------------------------------------
# Per-token statistics and the policies
# --------------------------------------------------------------------------------------------------

@dataclass
class TokenStats:
    """What a policy may look at when one KV head (or one layer) must shrink to its budget.

    Attributes (N = tokens currently cached, G = query heads reading this KV head, T <= window):
        positions: ``(N,)`` int64 original positions of the cached tokens, increasing.
        values: ``(N, d)`` their value vectors.
        attn: ``(G, T, N)`` softmax rows of the last T queries over these tokens (oldest row first);
            0 where a query came before the token.
        acc: ``(N,)`` attention accumulated since the token arrived, summed over the G heads and every
            query (H2O's statistic).
        last_used: ``(N,)`` the position of the last query that attended the token above the LRU threshold
            (its own position when none has).
        seen: how many tokens the sequence has had in total.
    """

    positions: torch.Tensor
    values: torch.Tensor
    attn: torch.Tensor
    acc: torch.Tensor
    last_used: torch.Tensor
    seen: int

    @property
    def n(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def from_attention(cls, attn: torch.Tensor, values: torch.Tensor, window: int | None = None,
                       threshold: float | None = None, positions: torch.Tensor | None = None) -> "TokenStats":
        """Build the statistics of a sequence from its full causal attention history.

        ``attn`` is ``(G, T, N)``: the rows of T queries (in order, the last of them at the newest position)
        over N keys; ``values`` ``(N, d)``. Useful to run the policies offline on recorded attention.
        ``threshold`` is LRU's: None means "above uniform" (1 / number of keys the query could see).
        """
        for name, x in (("attn", attn), ("values", values)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if attn.dim() != 3 or values.dim() != 2 or attn.shape[-1] != values.shape[0]:
            raise ValueError(f"attn must be (G, T, N) and values (N, d) with the same N, got "
                             f"{tuple(attn.shape)} and {tuple(values.shape)}")
        g, t, n = attn.shape
        if t == 0 or n == 0:
            raise ValueError(f"attn must hold at least one query and one key, got shape {tuple(attn.shape)}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or a positive int, got {window!r}")
        if threshold is not None:
            threshold = _check_real("threshold", threshold, minimum=0)
        if positions is None:
            positions = torch.arange(n)
        elif not isinstance(positions, torch.Tensor) or positions.shape != (n,) or positions.is_floating_point():
            raise ValueError(f"positions must be an integer tensor of shape ({n},), got "
                             f"{getattr(positions, 'shape', type(positions).__name__)}")
        qpos = positions[-1] - t + 1 + torch.arange(t)
        a = attn.float()
        acc = a.sum((0, 1))
        visible = (positions[None, :] <= qpos[:, None]).sum(1).clamp_min(1).float()       # (T,)
        thr = (1.0 / visible) if threshold is None else torch.full_like(visible, threshold)
        hit = a.mean(0) > thr[:, None]                                                     # (T, N)
        last = torch.where(hit, qpos[:, None].expand(t, n), positions[None, :].expand(t, n)).max(0).values
        last = torch.maximum(last, positions)
        w = t if window is None else min(window, t)
        return cls(positions=positions.clone(), values=values, attn=a[:, t - w:, :], acc=acc,
                   last_used=last, seen=int(positions[-1]) + 1)


class EvictionPolicy:
    """Base class: a policy keeps ``budget`` of the N tokens described by a :class:`TokenStats`.

    Subclasses set ``needs_attention`` (whether they read the attention statistics; the cache then needs
    the model's queries), ``window`` (how many recent query rows they read from ``stats.attn``) and
    implement :meth:`forced` (tokens the policy always keeps, e.g. sinks or a recent window) and
    :meth:`score` (higher = keep). :meth:`select` adds the protected prefix to the forced set and fills
    the rest of the budget with the best-scoring other tokens (or stochastically, for value-aware).
    """

    name = "base"
    needs_attention = False
    window = 0
    threshold: float | None = None
    stochastic = False

    def forced(self, stats: TokenStats, budget: int) -> torch.Tensor:
        """Boolean ``(N,)`` mask of tokens kept regardless of score (none by default)."""
        return torch.zeros(stats.n, dtype=torch.bool, device=stats.positions.device)

    def score(self, stats: TokenStats) -> torch.Tensor:
        raise NotImplementedError

    def select(self, stats: TokenStats, budget: int, protect: int = 0,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Sorted int64 indices (into the N cached tokens) of exactly ``budget`` tokens to keep.

        Tokens at positions < ``protect`` are always kept. Raises ValueError when the budget is not an
        int in [1, N] or is smaller than the tokens that must be kept.
        """
        n = stats.n
        _check_budget(budget, n)
        if isinstance(protect, bool) or not isinstance(protect, int) or protect < 0:
            raise ValueError(f"protect must be a non-negative int, got {protect!r}")
        forced = self.forced(stats, budget) | (stats.positions < protect)
        n_forced = int(forced.sum())
        if n_forced > budget:
            raise ValueError(f"budget={budget} is smaller than the {n_forced} tokens {self.name} must keep "
                             f"(protected prefix, sinks or recent window)")
        keep = forced.clone()
        rest = budget - n_forced
        if rest > 0:
            cand = torch.nonzero(~forced).flatten()
            s = self.score(stats)[cand].float()
            chosen = stochastic_keep(s, rest, generator) if self.stochastic else topk_keep(s, rest)
            keep[cand[chosen]] = True
        return torch.nonzero(keep).flatten()

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _recent_mask(stats: TokenStats, recent: int) -> torch.Tensor:
    mask = torch.zeros(stats.n, dtype=torch.bool, device=stats.positions.device)
    if recent > 0:
        mask[-recent:] = True
    return mask


def _nonneg_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class FIFO(EvictionPolicy):
    """First in, first out: keep the newest tokens (a sliding window over the sequence)."""

    name = "fifo"

    def score(self, stats):
        return stats.positions.float()


SlidingWindow = FIFO


class LRU(EvictionPolicy):
    """Least recently used: keep the tokens whose last use is most recent, where a token is used by a
    query that gives it more than ``threshold`` of its attention (averaged over the group's heads;
    None = more than uniform, 1 / number of visible keys). Arrival counts as a use."""

    name = "lru"
    needs_attention = True

    def __init__(self, threshold: float | None = None):
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, Real)
                                      or not 0.0 <= threshold < 1.0):
            raise ValueError(f"threshold must lie in [0, 1) or be None, got {threshold!r}")
        self.threshold = threshold

    def score(self, stats):
        return stats.last_used.float()


class H2O(EvictionPolicy):
    """Heavy-Hitter Oracle: keep the ``recent`` newest tokens and, for the rest of the budget, the tokens
    with the largest attention accumulated since they arrived. ``recent=None`` gives half the budget."""

    name = "h2o"
    needs_attention = True

    def __init__(self, recent: int | None = None):
        self.recent = None if recent is None else _nonneg_int("recent", recent)

    def forced(self, stats, budget):
        return _recent_mask(stats, budget // 2 if self.recent is None else self.recent)

    def score(self, stats):
        return stats.acc.float()


class StreamingLLM(EvictionPolicy):
    """Attention sinks plus a sliding window: keep the first ``sinks`` tokens and the newest ones."""

    name = "streamingllm"

    def __init__(self, sinks: int = 4):
        self.sinks = _nonneg_int("sinks", sinks)

    def forced(self, stats, budget):
        return stats.positions < self.sinks

    def score(self, stats):
        return stats.positions.float()


class Scissorhands(EvictionPolicy):
    """Persistence of importance: over the last ``history`` queries, count how often each token received
    more than the uniform share of attention (group-averaged); keep the ``recent`` newest tokens and the
    tokens counted most often (ties broken by accumulated attention). ``recent=None`` is a quarter of the
    budget."""

    name = "scissorhands"
    needs_attention = True

    def __init__(self, history: int = 16, recent: int | None = None):
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive int, got {history!r}")
        self.window = history
        self.recent = None if recent is None else _nonneg_int("recent", recent)

    def forced(self, stats, budget):
        return _recent_mask(stats, budget // 4 if self.recent is None else self.recent)

    def score(self, stats):
        a = stats.attn.float().mean(0)                                # (T, N)
        if a.shape[0] == 0:
            return stats.acc.float()
        visible = (a > 0).sum(1, keepdim=True).clamp_min(1).float()
        count = (a > 1.0 / visible).sum(0).float()
        acc = stats.acc.float()
        return count + acc / (acc.max() + 1.0) * 0.5             # the fraction only breaks ties


class ValueAware(EvictionPolicy):
    """Value-aware eviction: Score(i) = A_i^alpha ||V_i||^beta R_i^gamma (:func:`value_aware_scores`),
    A_i from the last ``window`` queries, kept by :func:`stochastic_keep` (``stochastic=True``) or by top-K.

    ``window`` defaults to the source's W = 512. ``recent`` newest tokens are always kept; the default
    (None) is ``min(8, budget // 4)``, and ``recent=0`` is the rule exactly as the source writes it, with
    R_i as the only recency signal. Chapter 6 measures why the lab keeps the newest tokens: A_i sums the
    attention a token received from the window's queries, and a token that just arrived has had at most one
    query, so its A_i is near zero whatever it holds. R_i^gamma lies between 0.86 and 1 with the source's
    gamma = 0.3 and lam = 0.5, far too flat to make up for that, so without them each step evicts, in most
    layers, the token it has just generated and the question at the end of a prompt, and pass-key retrieval
    collapses. A short ``window`` (W = 16) fails too: the question's queries attend only the first token of
    the key, so the rest of the key scores near zero and is gone when the answer needs it.
    """

    name = "value_aware"
    needs_attention = True

    def __init__(self, alpha: float = 1.0, beta: float = 0.5, gamma: float = 0.3, lam: float = 0.5,
                 window: int = 512, stochastic: bool = True, recent: int | None = None, head_reduce: str = "sum"):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if head_reduce not in ("sum", "max"):
            raise ValueError(f"head_reduce must be 'sum' or 'max', got {head_reduce!r}")
        for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
            _check_real(name, value)
        _check_real("lam", lam, minimum=0)
        if not isinstance(stochastic, bool):
            raise ValueError(f"stochastic must be a bool, got {stochastic!r}")
        self.alpha, self.beta, self.gamma, self.lam = alpha, beta, gamma, lam
        self.window, self.stochastic, self.head_reduce = window, stochastic, head_reduce
        self.recent = None if recent is None else _nonneg_int("recent", recent)

    def forced(self, stats, budget):
        return _recent_mask(stats, min(8, budget // 4) if self.recent is None else self.recent)

    def score(self, stats):
        s = value_aware_scores(stats.attn, stats.values, self.alpha, self.beta, self.gamma, self.lam,
                               self.head_reduce)
        # A token nobody in the window attended scores exactly 0 when alpha > 0; a floor keeps it drawable
        # (with a tiny probability) instead of making the draw degenerate.
        return s.clamp_min(1e-12)


POLICIES = {"fifo": FIFO, "sliding_window": FIFO, "lru": LRU, "h2o": H2O, "streamingllm": StreamingLLM,
            "scissorhands": Scissorhands, "value_aware": ValueAware}


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """Build a policy by name: one of ``POLICIES`` (fifo, sliding_window, lru, h2o, streamingllm,
    scissorhands, value_aware), with its keyword arguments."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)


# --------------------------------------------------------------------------------------------------
# Page granularity with lazy release
# --------------------------------------------------------------------------------------------------

class PagedEvictionPool:
    """A pool of ``num_pages`` physical pages of ``page_size`` token slots shared by sequences, with
    eviction at page granularity and lazy release.

    * :meth:`append` gives each new token a slot, taking a new page when the sequence's last page is full.
    * :meth:`evict` scores a sequence's pages (mean of its tokens' scores), keeps pages with probability
      proportional to score (:func:`stochastic_keep`, or top-K) and *marks* the others. Pages holding a
      protected token (the first ``protect`` positions: a system prompt) and the page being written are
      never marked. A marked page leaves the sequence's page table at once (attention stops reading it),
      but its data stays until the page is needed again.
    * When a new page is needed, a free page is used first, then the oldest marked page (only now is it
      released: lazy release). :meth:`restore` puts a marked page back if it has not been reused yet, at
      no recomputation cost.
    """

    def __init__(self, num_pages: int, page_size: int = 16, protect: int = 0):
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages, self.page_size = num_pages, page_size
        self.protect = _nonneg_int("protect", protect)
        self.free: list[int] = list(range(num_pages))
        self.marked: dict[int, tuple] = {}          # page -> (seq_id, logical index, start position), in mark order
        self.tables: dict = {}                      # seq_id -> list of [page, start position, filled]
        self.lengths: dict = {}                     # seq_id -> tokens appended so far
        self.reused = 0

    def pages(self, seq_id) -> list[int]:
        """The physical pages the sequence's attention reads, in position order."""
        return [entry[0] for entry in self.tables.get(seq_id, [])]

    def page_positions(self, seq_id) -> list[range]:
        """The token positions held by each of the sequence's pages."""
        return [range(start, start + filled) for _, start, filled in self.tables.get(seq_id, [])]

    @property
    def n_free(self) -> int:
        """Pages available for a new allocation (free plus marked)."""
        return len(self.free) + len(self.marked)

    def _allocate(self) -> int:
        if self.free:
            return self.free.pop(0)
        if self.marked:
            page = next(iter(self.marked))          # oldest mark first
            del self.marked[page]
            self.reused += 1
            return page
        raise MemoryError("no free or marked page left: evict pages first")

    def append(self, seq_id, n_tokens: int = 1) -> list[tuple[int, int]]:
        """Give ``n_tokens`` new tokens of ``seq_id`` their (page, slot); raises MemoryError (appending
        nothing) when they do not fit."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
        table = self.tables.get(seq_id, [])
        length = self.lengths.get(seq_id, 0)
        room = 0
        if table and table[-1][1] + table[-1][2] == length:
            room = self.page_size - table[-1][2]
        if room + self.page_size * self.n_free < n_tokens:
            raise MemoryError(f"no free or marked page left for {n_tokens} tokens: evict pages first")
        table = self.tables.setdefault(seq_id, table)
        slots = []
        for _ in range(n_tokens):
            if not table or table[-1][2] == self.page_size or table[-1][1] + table[-1][2] != length:
                table.append([self._allocate(), length, 0])
            entry = table[-1]
            slots.append((entry[0], entry[2]))
            entry[2] += 1
            length += 1
            self.lengths[seq_id] = length
        return slots

    def page_scores(self, seq_id, token_scores: torch.Tensor) -> torch.Tensor:
        """Mean token score of each page; ``token_scores`` is indexed by position (length = tokens appended)."""
        if not isinstance(token_scores, torch.Tensor):
            raise ValueError(f"token_scores must be a torch.Tensor, got {type(token_scores).__name__}")
        if token_scores.dim() != 1 or token_scores.numel() != self.lengths.get(seq_id, 0):
            raise ValueError(f"token_scores must be 1-D with one score per appended token "
                             f"({self.lengths.get(seq_id, 0)}), got shape {tuple(token_scores.shape)}")
        return torch.stack([token_scores[start:start + filled].float().mean()
                            for _, start, filled in self.tables[seq_id]])

    def evictable(self, seq_id) -> torch.Tensor:
        """Boolean mask over the sequence's pages: False for protected pages and the page being written."""
        table = self.tables.get(seq_id, [])
        mask = torch.tensor([start >= self.protect for _, start, _ in table], dtype=torch.bool)
        if table:
            mask[-1] = False
        return mask

    def evict(self, seq_id, token_scores: torch.Tensor, n_pages: int, stochastic: bool = True,
              generator: torch.Generator | None = None) -> list[int]:
        """Mark ``n_pages`` of the sequence's evictable pages, chosen by page score; returns them."""
        scores = self.page_scores(seq_id, token_scores)
        cand = torch.nonzero(self.evictable(seq_id)).flatten()
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or not 0 < n_pages <= cand.numel():
            raise ValueError(f"n_pages must be an int in [1, {cand.numel()}] (evictable pages), got {n_pages!r}")
        keep_n = cand.numel() - n_pages
        drop = torch.ones(cand.numel(), dtype=torch.bool)
        if keep_n > 0:
            s = scores[cand].clamp_min(1e-12)
            kept = stochastic_keep(s, keep_n, generator) if stochastic else topk_keep(s, keep_n)
            drop[kept] = False
        victims = sorted(int(i) for i in cand[drop])
        table = self.tables[seq_id]
        pages = []
        for logical in reversed(victims):
            page, start, filled = table.pop(logical)
            self.marked[page] = (seq_id, start, filled)
            pages.append(page)
        return sorted(pages)

    def restore(self, page: int) -> bool:
        """Put a marked page back into its sequence's table if it was not reused; True when restored."""
        if page not in self.marked:
            return False
        seq_id, start, filled = self.marked.pop(page)
        table = self.tables[seq_id]
        at = next((i for i, e in enumerate(table) if e[1] > start), len(table))
        table.insert(at, [page, start, filled])
        return True

    def release(self, seq_id) -> None:
        """The sequence is finished: its pages, and its marked pages, become free."""
        for page, _, _ in self.tables.pop(seq_id, []):
            self.free.append(page)
        for page in [p for p, info in self.marked.items() if info[0] == seq_id]:
            del self.marked[page]
            self.free.append(page)
        self.lengths.pop(seq_id, None)


# --------------------------------------------------------------------------------------------------
# A transformers Cache that evicts
# --------------------------------------------------------------------------------------------------

class EvictingLayer(CacheLayerMixin):
    """One layer of :class:`EvictingCache`: keys/values ``(1, H_kv, kept, d)`` plus the statistics.

    ``update()`` appends the new tokens, folds the attention of the new queries (when the policy needs
    it) into the statistics, returns every key the current queries may attend (kept + new), and then
    shrinks the stored cache to the budget. ``get_seq_length()`` reports the tokens *seen*, so generate()
    keeps assigning the right rotary positions, and ``get_mask_sizes()`` offsets the mask by the evicted
    count so that new tokens stay causal among themselves and every kept token stays visible.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: "EvictingCache", layer_idx: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.seen = 0
        self.positions = None       # (S, kept) where S = H_kv, or 1 when one choice is shared by the layer
        self.acc = None
        self.last_used = None
        self.attn = None            # (S, G, T, kept)
        self.pending_query = None   # (1, H_q, q_len, d) post-RoPE, set by the q_proj hook
        self.scaling = None
        self.log: list[tuple[int, torch.Tensor]] = []

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        b, h, _, d = key_states.shape
        s = 1 if self._cache.shared else h
        self.keys = key_states.new_zeros((b, h, 0, d))
        self.values = value_states.new_zeros((b, h, 0, value_states.shape[-1]))
        self.positions = torch.zeros((s, 0), dtype=torch.long, device=self.device)
        self.acc = torch.zeros((s, 0), device=self.device)
        self.last_used = torch.zeros((s, 0), dtype=torch.long, device=self.device)
        self.attn = None
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = 0 if self.keys is None else self.keys.shape[-2]
        return kept + query_length, self.seen - kept

    def kept_positions(self) -> torch.Tensor:
        """``(S, kept)`` original positions of the cached tokens (S = KV heads, or 1 when shared)."""
        return self.positions

    def _query_probs(self, keys, q_len, new_pos):
        """Softmax of the pending queries over ``keys`` with the causal rule on original positions:
        ``(S, G, q_len, N)``."""
        q = self.pending_query
        if q is None:
            raise ValueError(f"policy {self._cache.policy.name} needs the model's queries: build the cache "
                             f"with EvictingCache(policy, budget, model=model)")
        if q.shape[-2] != q_len:
            raise ValueError(f"layer {self.layer_idx}: the hooked query has {q.shape[-2]} positions but the "
                             f"cache received {q_len} keys")
        self.pending_query = None
        h_kv, d = keys.shape[1], keys.shape[-1]
        h_q = q.shape[1]
        g = h_q // h_kv
        qg = q[0].float().reshape(h_kv, g, q_len, d)
        logits = torch.einsum("hgqd,hnd->hgqn", qg, keys[0].float()) * self.scaling
        kpos = self.full_positions                                  # (S, N)
        if kpos.shape[0] == 1 and h_kv > 1:
            kpos = kpos.expand(h_kv, -1)
        future = kpos[:, None, None, :] > new_pos[None, None, :, None]
        probs = torch.softmax(logits.masked_fill(future, -math.inf), dim=-1)
        if self._cache.shared:
            probs = probs.reshape(1, h_q, q_len, -1)
        return probs

    def update(self, key_states, value_states, *args, **kwargs):
        cache = self._cache
        if key_states.shape[0] != 1:
            raise ValueError(f"EvictingCache holds one sequence (batch size 1), got batch size {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t0 = time.perf_counter()
        q_len = key_states.shape[-2]
        s = self.positions.shape[0]
        new_pos = torch.arange(self.seen, self.seen + q_len, device=self.device)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.full_positions = torch.cat([self.positions, new_pos.expand(s, q_len)], 1)
        self.acc = torch.cat([self.acc, self.acc.new_zeros((s, q_len))], 1)
        self.last_used = torch.cat([self.last_used, new_pos.expand(s, q_len)], 1)
        policy = cache.policy
        if policy.needs_attention:
            probs = self._query_probs(keys, q_len, new_pos)          # (S, G, q, N)
            self.acc += probs.sum((1, 2))
            mean = probs.mean(1)                                       # (S, q, N)
            if policy.threshold is None:
                visible = (self.full_positions[:, None, :] <= new_pos[None, :, None]).sum(-1, keepdim=True)
                hit = mean > 1.0 / visible.float()
            else:
                hit = mean > policy.threshold
            qpos = new_pos[None, :, None].expand_as(hit)
            last = torch.where(hit, qpos, torch.full_like(qpos, -1)).max(1).values
            self.last_used = torch.maximum(self.last_used, last)
            if policy.window > 0:
                if self.attn is None:
                    self.attn = probs.new_zeros(probs.shape[:2] + (0, probs.shape[-1] - q_len))
                old = torch.nn.functional.pad(self.attn, (0, q_len))
                self.attn = torch.cat([old, probs], 2)[:, :, -policy.window:, :]
        self.seen += q_len
        if self.layer_idx == 0:
            cache.steps += 1
        cache.timings["stats"] += time.perf_counter() - t0
        full_keys, full_values = keys, values
        kept = keys.shape[-2]
        if kept > cache.budget + cache.slack:
            t1 = time.perf_counter()
            keys, values = self._evict(keys, values)
            cache.timings["select"] += time.perf_counter() - t1
            cache.evictions += 1
        else:
            self.positions = self.full_positions
        self.keys, self.values = keys, values
        return full_keys, full_values

    def _stats(self, i, values) -> TokenStats:
        if self._cache.shared:
            vals = values[0].permute(1, 0, 2).reshape(values.shape[2], -1)    # all heads' values side by side
        else:
            vals = values[0, i]
        attn = self.attn[i] if self.attn is not None else vals.new_zeros((1, 0, vals.shape[0]))
        return TokenStats(positions=self.full_positions[i], values=vals, attn=attn, acc=self.acc[i],
                          last_used=self.last_used[i], seen=self.seen)

    def _evict(self, keys, values):
        cache = self._cache
        s = self.full_positions.shape[0]
        idx = torch.stack([cache.policy.select(self._stats(i, values), cache.budget, cache.protect,
                                               cache.generator) for i in range(s)])       # (S, budget)
        h = keys.shape[1]
        gather_idx = idx.expand(h, -1) if s == 1 else idx
        gi = gather_idx[None, :, :, None]
        keys = keys.gather(2, gi.expand(-1, -1, -1, keys.shape[-1]))
        values = values.gather(2, gi.expand(-1, -1, -1, values.shape[-1]))
        self.positions = self.full_positions.gather(1, idx)
        self.acc = self.acc.gather(1, idx)
        self.last_used = self.last_used.gather(1, idx)
        if self.attn is not None:
            gidx = idx[:, None, None, :].expand(-1, self.attn.shape[1], self.attn.shape[2], -1)
            self.attn = self.attn.gather(3, gidx)
        if cache.record:
            self.log.append((self.seen, self.positions.clone()))
        return keys, values

    def reset(self):
        self.keys = self.values = None
        self.is_initialized = False
        self.seen = 0
        self.log = []


class EvictingCache(Cache):
    """A ``transformers`` cache that keeps at most ``budget`` tokens per layer, chosen by ``policy``.

    Usage::

        cache = EvictingCache(H2O(), budget=64, protect=8, model=model)
        out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)
        cache.detach()                 # remove the query hooks (or use ``with EvictingCache(...) as cache``)

    Args:
        policy: an :class:`EvictionPolicy`.
        budget: tokens kept per layer (per KV head unless ``shared``).
        protect: the first ``protect`` positions (a system prompt) are never evicted.
        model: the model; required when the policy reads attention (hooks capture its post-RoPE queries).
        shared: one choice per layer for all KV heads (scored with all query heads) instead of one per KV head.
        slack: evict only when the cache exceeds ``budget + slack`` (amortised eviction), down to ``budget``.
        record: keep ``layer.log``: (tokens seen, kept positions) after each eviction, for survival plots.
        generator: the torch generator for stochastic policies (same seed, same choices).

    Batch size 1 only. Each forward attends to the kept tokens plus the new ones; the stored cache is then
    cut back to the budget. ``timings`` holds the seconds spent on statistics and on selection (all
    layers), ``steps`` the forward passes seen and ``evictions`` the layer-evictions performed, so the
    scoring overhead per step is ``sum(timings.values()) / steps``.
    """

    def __init__(self, policy: EvictionPolicy, budget: int, protect: int = 0, model=None, shared: bool = False,
                 slack: int = 0, record: bool = False, generator: torch.Generator | None = None):
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {type(policy).__name__}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive int, got {budget!r}")
        _nonneg_int("protect", protect)
        _nonneg_int("slack", slack)
        if protect > budget:
            raise ValueError(f"protect={protect} exceeds budget={budget}: the protected prefix must fit")
        self.policy, self.budget, self.protect = policy, budget, protect
        self.shared, self.slack, self.record = bool(shared), slack, bool(record)
        self.generator = generator
        self.timings = {"stats": 0.0, "select": 0.0}
        self.evictions = 0
        self.steps = 0
        self._hooks = []
        super().__init__(layers=[])
        if model is not None:
            self.attach(model)
        elif policy.needs_attention:
            raise ValueError(f"policy {policy.name} reads attention, so EvictingCache needs model=")

    def _layer(self, idx: int) -> EvictingLayer:
        while len(self.layers) <= idx:
            self.layers.append(EvictingLayer(self, len(self.layers)))
        return self.layers[idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._layer(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attach(self, model) -> "EvictingCache":
        """Hook every attention module of ``model`` (modules with ``q_proj`` and ``layer_idx``) so the
        cache receives the post-RoPE queries of each forward."""
        ref = weakref.ref(self)
        found = 0
        for module in model.modules():
            if not (hasattr(module, "q_proj") and hasattr(module, "layer_idx") and hasattr(module, "head_dim")):
                continue
            found += 1
            rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
            if rope is None:
                raise ValueError(f"{type(module).__name__}: no apply_rotary_pos_emb in its module")
            state = {}

            def pre_hook(mod, args, kwargs, state=state):
                pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
                state["pe"] = pe

            def q_hook(lin, args, out, mod=module, state=state, rope=rope):
                cache = ref()
                if cache is None or state.get("pe") is None:
                    return
                b, q_len = out.shape[:2]
                q = out.view(b, q_len, -1, mod.head_dim)
                if hasattr(mod, "q_norm"):
                    q = mod.q_norm(q)
                q = q.transpose(1, 2)
                cos, sin = state["pe"]
                q, _ = rope(q, q, cos, sin)
                layer = cache._layer(mod.layer_idx)
                layer.pending_query = q.detach()
                layer.scaling = getattr(mod, "scaling", mod.head_dim ** -0.5)

            self._hooks.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._hooks.append(module.q_proj.register_forward_hook(q_hook))
        if found == 0:
            raise ValueError("model has no attention module with q_proj and layer_idx to hook")
        return self

    def detach(self) -> None:
        """Remove the hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()
        return False

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        """``(S, kept)`` original positions currently cached in layer ``layer_idx``."""
        return self.layers[layer_idx].positions


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
