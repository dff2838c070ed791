"""Speculative decoding from scratch: exact rejection sampling, acceptance theory, generation.

A small *draft* model proposes ``k`` tokens; the large *target* model scores all of them in one forward pass;
each drafted token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))`` (``p`` the target's
distribution, ``q`` the draft's). At the first rejection the emitted token is drawn from the normalised
residual ``max(p_i - q_i, 0)``; when all ``k`` are accepted a bonus token is drawn from ``p_k``. Every emitted
token then has exactly the target's distribution (Leviathan et al. 2023, Chen et al. 2023).

* :func:`acceptance_rate`, :func:`total_variation`, :func:`kl_divergence`, :func:`pinsker_lower_bound`:
  ``alpha = sum_x min(p, q) = 1 - TV(p, q) >= 1 - sqrt(KL / 2)``.
* :func:`residual_distribution`, :func:`verify` (one sequence), :func:`verify_batch` (``B`` sequences with
  different acceptance lengths), greedy mode (argmax match, the temperature -> 0 limit).
* :func:`expected_tokens_per_step`, :func:`speedup`, :func:`optimal_k`: the i.i.d. acceptance model.
* :func:`speculative_generate`: both models' KV caches, rolled back on rejection; fixed or adaptive window.

Chapter 10 teaches this module; chapters 11 and 13 import it (keep the signatures stable).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

__all__ = [
    "acceptance_rate", "total_variation", "kl_divergence", "pinsker_lower_bound", "residual_distribution",
    "verify", "verify_batch", "expected_tokens_per_step", "speedup", "optimal_k", "adaptive_window",
    "warp_logits", "speculative_generate", "SpecStats", "StepStats", "chi_square_test",
    "tree_attention_mask", "tree_depths",
]

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


# ----------------------------------------------------------------------------------------------- trees
def tree_attention_mask(parents) -> torch.Tensor:
    """The ancestor-or-self mask of a draft tree: ``mask[i, j]`` true when node ``j`` is node ``i`` or an
    ancestor of it. ``parents[i]`` is the index of node ``i``'s parent (``< i``: parents come first), or ``-1``
    for a node that hangs directly off the verified prefix. Returns ``(N, N)`` bool."""
    if isinstance(parents, torch.Tensor):
        if parents.dtype.is_floating_point or parents.dim() != 1:
            raise ValueError(f"parents must be a 1-D integer sequence, got {parents.dtype} {tuple(parents.shape)}")
        parents = parents.tolist()
    parents = list(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if isinstance(par, bool) or not isinstance(par, int):
            raise ValueError(f"parents[{i}] must be an int, got {par!r}")
        if not -1 <= par < i:
            raise ValueError(f"parents[{i}] = {par}: a parent must come before its child (-1 <= parent < {i})")
        mask[i, i] = True
        if par >= 0:
            mask[i] |= mask[par]
    return mask


def tree_depths(parents) -> list[int]:
    """Depth of each node (1 for a child of the prefix): its position offset after the prefix."""
    depth = []
    for par in list(parents):
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


# ----------------------------------------------------------------------------------------------- generation
def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Logits -> the sampling distribution: ``softmax(logits / temperature)`` restricted to the top-p nucleus
    (the smallest set of most likely tokens whose mass reaches ``top_p``, as transformers' ``TopPLogitsWarper``
    keeps it), renormalised. Computed in float64 on the last axis."""
    if temperature <= 0 or math.isnan(temperature):
        raise ValueError(f"temperature must be > 0 (use do_sample=False for greedy), got {temperature}")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, idx = probs.sort(-1, descending=False)
        cum = sorted_p.cumsum(-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class StepStats:
    """One draft-verify cycle: window, drafted and accepted tokens, tokens emitted, seconds spent."""
    k: int
    drafted: int
    accepted: int
    emitted: int
    draft_seconds: float
    target_seconds: float
    accepted_mask: tuple[bool, ...] = ()


@dataclass
class SpecStats:
    """Per-step statistics of :func:`speculative_generate` and their totals."""
    steps: list[StepStats] = field(default_factory=list)
    target_calls: int = 0          # target forward passes after the prefill
    draft_calls: int = 0           # draft forward passes after the prefill
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    new_tokens: int = 0

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance(self) -> float:
        """Accepted / drafted (the per-token acceptance rate the windows saw)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_call(self) -> float:
        """New tokens per target call (1.0 for ordinary decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else float("nan")


def _rollback(cache, length: int) -> None:
    """Cut a transformers cache back to its first ``length`` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        try:
            cache.crop(-extra)
        except ValueError:            # older transformers: crop(max_length)
            cache.crop(length)


def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


@torch.no_grad()
def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Feed ``ids (1, n)`` after ``cache``; return the float logits ``(n, V)``."""
    out = model(input_ids=ids, cache=cache, use_cache=True)
    return out.logits[0].float()


def _eos_ids(model) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                         do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None, window: str = "fixed",
                         stats: SpecStats | None = None, stop_at_eos: bool = True
                         ) -> tuple[torch.Tensor, SpecStats]:
    """Generate with ``draft`` proposing and ``target`` verifying; returns ``(ids (1, T + n), stats)``.

    Both models keep a transformers KV cache; after each verification both are cut back to the accepted
    prefix (the rejected drafts' keys and values must not stay in the cache). ``do_sample=False`` gives the
    target's greedy output token for token (the same as ``target.generate(do_sample=False)``);
    ``do_sample=True`` samples from the target's distribution after ``temperature`` and ``top_p``.
    ``window="adaptive"`` re-chooses ``k`` each cycle from an EMA (rho = 0.9) of the acceptance,
    ``k = max(2, min(8, floor(alpha_hat * 10)))``, starting from ``alpha_hat = k / 10``. Generation stops at
    ``max_new_tokens`` or after the target's end-of-sequence token (``stop_at_eos``). Pass ``stats`` to
    collect into an existing :class:`SpecStats`. Batch size 1: ``input_ids`` is ``(T,)`` or ``(1, T)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a torch.long tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (T,) or (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _check_k(k)
    if window not in ("fixed", "adaptive"):
        raise ValueError(f"window must be 'fixed' or 'adaptive', got {window!r}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft must share a vocabulary: {target.config.vocab_size} != "
                         f"{draft.config.vocab_size}")
    if do_sample:
        warp_logits(torch.zeros(2), temperature, top_p)  # validates temperature and top_p
    stats = SpecStats() if stats is None else stats
    device = next(target.parameters()).device
    seq = input_ids.to(device)
    eos = _eos_ids(target) if stop_at_eos else set()
    alpha_hat = min(1.0, k / 10)
    t_start = time.perf_counter()

    def dist(logits):
        if do_sample:
            return warp_logits(logits, temperature, top_p)
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()

    tcache, dcache = _new_cache(target), _new_cache(draft)
    t0 = time.perf_counter()
    if seq.shape[1] > 1:   # prefill everything but the last token; the last is fed with the first window
        _forward(target, seq[:, :-1], tcache)
        _forward(draft, seq[:, :-1], dcache)
    stats.prefill_seconds += time.perf_counter() - t0
    produced = 0
    while produced < max_new_tokens:
        kk = adaptive_window(alpha_hat) if window == "adaptive" else k
        kk = min(kk, max_new_tokens - produced - 1)   # never draft past the budget: the target adds one
        # ---- draft kk tokens, one draft call each
        t0 = time.perf_counter()
        drafted, qs = [], []
        pending = seq[:, dcache.get_seq_length():]
        for _ in range(kk):
            q = dist(_forward(draft, pending, dcache)[-1])
            tok = (torch.multinomial(q, 1, generator=generator) if do_sample else q.argmax(-1, keepdim=True))
            drafted.append(int(tok))
            qs.append(q)
            pending = tok.view(1, 1).to(device)
        stats.draft_calls += kk
        t_draft = time.perf_counter() - t0
        # ---- one target call scores the last token and all drafts
        t0 = time.perf_counter()
        x = torch.tensor(drafted, dtype=torch.long, device=device)
        feed = torch.cat([seq[:, tcache.get_seq_length():], x[None]], dim=1)
        logits = _forward(target, feed, tcache)[-(kk + 1):]
        stats.target_calls += 1
        p = dist(logits)
        q_all = torch.stack(qs) if qs else p.new_zeros((0, p.shape[-1]))
        out, n_acc = verify(x, q_all, p, generator=generator, greedy=not do_sample)
        t_target = time.perf_counter() - t0
        emitted = out.tolist()
        # stop after an end-of-sequence token, as generate() does
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        seq = torch.cat([seq, torch.tensor([emitted], dtype=torch.long, device=device)], dim=1)
        produced += len(emitted)
        # ---- roll both caches back to the accepted prefix: everything but the newest token is cached
        _rollback(tcache, seq.shape[1] - 1)
        _rollback(dcache, min(dcache.get_seq_length(), seq.shape[1] - 1))
        acc_mask = tuple(j < n_acc for j in range(kk))
        if kk:
            alpha_hat = 0.9 * alpha_hat + 0.1 * (n_acc / kk)
        stats.steps.append(StepStats(k=kk, drafted=kk, accepted=n_acc, emitted=len(emitted),
                                     draft_seconds=t_draft, target_seconds=t_target, accepted_mask=acc_mask))
        if emitted and emitted[-1] in eos:
            break
    stats.new_tokens += min(produced, max_new_tokens)
    stats.wall_seconds += time.perf_counter() - t_start
    return seq[:, : input_ids.shape[1] + max_new_tokens], stats
