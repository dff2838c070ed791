"""Which tokens to keep: the recency and value-aware scores, and the ways of turning scores into a keep set
of ``budget`` tokens (top-k, systematic and Bernoulli sampling with the inclusion probabilities that keep the
expected budget).
"""
from __future__ import annotations

import math
from numbers import Real

import torch


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


def _nonneg_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value
