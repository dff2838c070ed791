"""The reference every policy is measured against: the attention-output loss of keeping a subset, and the best
subset by brute force (small sizes only).
"""
from __future__ import annotations

import itertools
import math

import torch

from labsrc.kv_eviction.scores import _check_budget


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
