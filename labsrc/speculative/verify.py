"""Exact verification: accept a drafted token with probability min(1, p/q), else sample the residual
max(0, p - q); one window, or a batch of windows.
"""
from __future__ import annotations

import torch

from labsrc.speculative.theory import _check_pair, _check_probs


# ----------------------------------------------------------------------------------------------- verify
def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))``: where to sample after a rejection. Falls back to ``p`` where ``p == q``
    (a rejection is then impossible, the fallback only guards rounding)."""
    _check_pair(p, q)
    return _residual(p, q)


def _residual(p, q):
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=torch.finfo(r.dtype).tiny), p)


def _check_verify_args(draft_tokens, draft_probs, target_probs, batched: bool):
    lead = 1 if batched else 0
    if not isinstance(draft_tokens, torch.Tensor):
        raise TypeError(f"draft_tokens must be a torch.Tensor, got {type(draft_tokens).__name__}")
    if draft_tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    want = "(B, k)" if batched else "(k,)"
    if draft_tokens.dim() != 1 + lead:
        raise ValueError(f"draft_tokens must have shape {want}, got {tuple(draft_tokens.shape)}")
    _check_probs("draft_probs", draft_probs, 2 + lead)
    _check_probs("target_probs", target_probs, 2 + lead)
    k = draft_tokens.shape[-1]
    V = draft_probs.shape[-1]
    if draft_probs.shape[:-1] != draft_tokens.shape:
        raise ValueError(f"draft_probs must have shape {want[:-1]}, V) matching draft_tokens "
                         f"{tuple(draft_tokens.shape)}, got {tuple(draft_probs.shape)}")
    exp_t = (*draft_tokens.shape[:-1], k + 1, V)
    if tuple(target_probs.shape) != exp_t:
        raise ValueError(f"target_probs must have shape {exp_t} (k + 1 rows, same vocabulary as draft_probs), "
                         f"got {tuple(target_probs.shape)}")
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= V):
        raise ValueError(f"draft_tokens must be in [0, {V}), got values in "
                         f"[{int(draft_tokens.min())}, {int(draft_tokens.max())}]")


def _verify_core(x, q, p, generator, greedy):
    """x (B, k) long, q (B, k, V), p (B, k+1, V): emitted (B, k+1) padded with -1, n_accepted (B,)."""
    B, k = x.shape
    if k == 0:
        n_acc = torch.zeros(B, dtype=torch.long)
    elif greedy:
        ok = x == p[:, :k].argmax(-1)
        n_acc = ok.long().cumprod(-1).sum(-1)
    else:
        qx = q.gather(-1, x[..., None])[..., 0]
        if (qx <= 0).any():
            raise ValueError("draft_probs gives probability 0 to a drafted token: the draft could not have "
                             "drawn it (draft_tokens must be sampled from draft_probs)")
        px = p[:, :k].gather(-1, x[..., None])[..., 0]
        u = torch.rand((B, k), generator=generator, dtype=torch.float64, device=x.device)
        ok = u * qx.double() < px.double()          # u < min(1, p/q) without dividing
        n_acc = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=x.device)
    p_stop = p[rows, n_acc]                          # (B, V): target at the first rejected (or bonus) slot
    if greedy:
        last = p_stop.argmax(-1)
    else:
        q_pad = torch.cat([q, q.new_zeros((B, 1, q.shape[-1]))], dim=1)  # bonus slot: residual of p vs 0 is p
        q_stop = q_pad[rows, n_acc]
        dist = _residual(p_stop, q_stop)
        dist = torch.where((n_acc == k)[:, None], p_stop, dist)
        last = torch.multinomial(dist.double(), 1, generator=generator)[:, 0]
    out = torch.full((B, k + 1), -1, dtype=torch.long, device=x.device)
    if k:
        keep = torch.arange(k, device=x.device)[None, :] < n_acc[:, None]
        out[:, :k] = torch.where(keep, x, out[:, :k])
    out[rows, n_acc] = last
    return out, n_acc


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           generator: torch.Generator | None = None, greedy: bool = False) -> tuple[torch.Tensor, int]:
    """Accept or reject ``k`` drafted tokens; returns ``(tokens, n_accepted)``.

    ``draft_tokens (k,)`` were drawn from ``draft_probs (k, V)``; ``target_probs (k + 1, V)`` are the target's
    distributions at the same positions plus one. Token ``i`` is accepted with probability
    ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the last token is drawn from
    ``norm(max(p_i - q_i, 0))``; if all ``k`` are accepted a bonus token is drawn from ``p_k``. ``tokens`` has
    length ``n_accepted + 1`` and is distributed exactly as ``n_accepted + 1`` tokens of the target.
    ``greedy=True`` accepts while the drafted token is the target's argmax and emits the target's argmax
    (the temperature -> 0 limit); it draws no random numbers.
    """
    _check_verify_args(draft_tokens, draft_probs, target_probs, batched=False)
    out, n = _verify_core(draft_tokens.long()[None], draft_probs[None], target_probs[None], generator, greedy)
    n = int(n[0])
    return out[0, : n + 1], n


def verify_batch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 generator: torch.Generator | None = None, greedy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` for ``B`` sequences at once: ``draft_tokens (B, k)``, ``draft_probs (B, k, V)``,
    ``target_probs (B, k + 1, V)``. Returns ``tokens (B, k + 1)`` (row ``b`` holds ``n_accepted[b] + 1`` tokens,
    then ``-1`` padding) and ``n_accepted (B,)``."""
    _check_verify_args(draft_tokens, draft_probs, target_probs, batched=True)
    return _verify_core(draft_tokens.long(), draft_probs, target_probs, generator, greedy)
