"""Speculative decoding's theory: the acceptance rate and its bounds, the expected tokens per step and the
speedup, the best window, and a chi-square test that the output keeps the target's distribution.
"""
from __future__ import annotations

import math

import torch


_PROB_TOL = 1e-3


# ----------------------------------------------------------------------------------------------- checks
def _check_probs(name: str, p, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if not p.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor of probabilities, got {p.dtype}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else ndim
        if p.dim() not in dims:
            raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got shape {tuple(p.shape)}")
    if p.shape[-1] < 1:
        raise ValueError(f"{name} has an empty vocabulary axis, shape {tuple(p.shape)}")
    if not torch.isfinite(p).all():
        raise ValueError(f"{name} holds non-finite values: probabilities must be finite")
    if (p < 0).any():
        raise ValueError(f"{name} holds negative values: probabilities must be >= 0")
    total = p.double().sum(-1)
    if ((total - 1).abs() > _PROB_TOL).any():
        worst = float(total.flatten()[(total - 1).abs().flatten().argmax()])
        raise ValueError(f"{name} is not a distribution: a row sums to {worst:.6g}, expected 1 "
                         f"(within {_PROB_TOL}); apply softmax to logits first")
    return p


def _check_pair(p, q):
    _check_probs("p", p)
    _check_probs("q", q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")


# ----------------------------------------------------------------------------------------------- theory
def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that a token drawn from the draft ``q`` is accepted by the target ``p``: ``sum_x min(p, q)``.

    Equal to ``1 - TV(p, q)``. Works on the last axis (leading axes are batch axes).
    """
    _check_pair(p, q)
    return torch.minimum(p, q).sum(-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``TV(p, q) = 1/2 sum_x |p(x) - q(x)|`` over the last axis."""
    _check_pair(p, q)
    return 0.5 * (p - q).abs().sum(-1)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) = sum_x p log(p / q)`` over the last axis (``inf`` where ``q = 0 < p``)."""
    _check_pair(p, q)
    pd, qd = p.double(), q.double()
    terms = torch.where(pd > 0, pd * (pd.log() - qd.log()), torch.zeros_like(pd))
    return terms.sum(-1).to(p.dtype)


def pinsker_lower_bound(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Pinsker: ``TV <= sqrt(KL(p || q) / 2)``, so ``alpha >= 1 - sqrt(KL(p || q) / 2)`` (clamped at 0)."""
    return (1 - torch.sqrt(kl_divergence(p, q) / 2)).clamp(min=0)


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a number in [0, 1], got {type(alpha).__name__}")
    if not (0 <= alpha <= 1) or math.isnan(alpha):
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(alpha)


def _check_k(k, name="k") -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"{name} must be >= 1, got {k}")
    return k


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens emitted per target call with window ``k`` and i.i.d. acceptance ``alpha``.

    ``(1 - alpha^(k+1)) / (1 - alpha)``: the accepted prefix plus the one token the target always adds
    (the residual sample or the bonus). Tends to ``k + 1`` (not ``k``) as ``alpha -> 1``.
    """
    alpha, k = _check_alpha(alpha), _check_k(k)
    if alpha == 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s walltime improvement: ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))``.

    ``c = T_draft / T_target``, the cost of one draft call relative to one target call (a target call that
    verifies ``k + 1`` tokens is assumed to cost the same as one decode step).
    """
    if isinstance(c, bool) or not isinstance(c, (int, float)) or math.isnan(c) or c < 0:
        raise ValueError(f"c must be a number >= 0 (T_draft / T_target), got {c!r}")
    return expected_tokens_per_step(alpha, k) / (k * c + 1)


def optimal_k(alpha: float, c: float, k_max: int = 32) -> int:
    """The window ``k`` in ``1..k_max`` (inclusive) with the largest :func:`speedup` (the smallest on a tie)."""
    _check_k(k_max, "k_max")
    return max(range(1, k_max + 1), key=lambda k: (speedup(alpha, k, c), -k))


def adaptive_window(alpha_hat: float) -> int:
    """The source's dynamic window (10.4.5): ``k = max(2, min(8, floor(alpha_hat * 10)))``."""
    alpha_hat = _check_alpha(alpha_hat)
    return max(2, min(8, int(math.floor(alpha_hat * 10 + 1e-9))))


def chi_square_test(counts, probs, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-square goodness of fit of observed ``counts`` to ``probs``: ``(statistic, dof, p_value)``.

    Cells whose expected count is below ``min_expected`` are pooled into one cell (the usual rule for the
    chi-square approximation). The p-value is the upper regularised gamma ``Q(dof / 2, stat / 2)``.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    if counts.shape != probs.shape:
        raise ValueError(f"counts and probs must have the same length, got {counts.numel()} and {probs.numel()}")
    if (counts < 0).any() or counts.sum() <= 0:
        raise ValueError("counts must be >= 0 with a positive total")
    _check_probs("probs", probs.float() if probs.dtype != torch.float64 else probs)
    n = counts.sum()
    expected = n * probs
    small = expected < min_expected
    if (counts[probs == 0] > 0).any():
        return float("inf"), int((~small).sum()), 0.0
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = int(obs.numel() - 1)
    if dof < 1:
        return stat, dof, 1.0
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p_value
