"""The eviction policies (FIFO, LRU, H2O, StreamingLLM, Scissorhands, value-aware) over per-token statistics,
and the registry ``POLICIES`` that names them.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch

from labsrc.kv_eviction.scores import (_check_budget, _check_real, _nonneg_int, stochastic_keep, topk_keep,
                                       value_aware_scores)


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
