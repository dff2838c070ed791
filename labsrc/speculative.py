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
* :func:`tree_attention_mask`, :func:`tree_verify_logits`, :func:`tree_speculative_generate`: greedy tree
  speculation verified in one target forward with the Triton tree-attention kernel.
* :func:`prompt_lookup_generate`: the draft copied from the context (:func:`lookup_draft`), no draft model.
* :func:`early_exit_draft`, :func:`train_early_exit_head` (``python -m labsrc.speculative train-early-exit``):
  the target's first half as a draft; :func:`self_speculative_generate`: self-speculation with one shared KV
  cache (the draft's keys, values and hidden states are reused by verification; :func:`run_layers`,
  :func:`count_layer_tokens` measure it); :func:`draft_opd_generate`: online draft updates (Draft-OPD).
* ``speculative_generate(..., draft_cache=...)``: a quantized draft KV cache (10.4.5); :func:`fit_kv_projection`,
  :class:`KVProjection`, :func:`cache_features`: the draft's prompt cache projected from the target's
  (``speculative_generate(..., kv_projection=...)``), skipping the draft's prefill (10.4.5).
* :func:`alpha_along`, :func:`alpha_with_draft_cache`, :func:`acceptance_by_position`, :func:`plain_decode`,
  :func:`task_prompts`: measurement.

Chapter 10 teaches this module; chapters 11 and 13 import it (keep the signatures stable).
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from labsrc.sampling import check_sampling, sampling_probs

__all__ = [
    "acceptance_rate", "total_variation", "kl_divergence", "pinsker_lower_bound", "residual_distribution",
    "verify", "verify_batch", "expected_tokens_per_step", "speedup", "optimal_k", "adaptive_window",
    "warp_logits", "speculative_generate", "SpecStats", "StepStats", "chi_square_test",
    "tree_attention_mask", "tree_depths", "tree_verify_logits", "tree_speculative_generate",
    "early_exit_draft", "train_early_exit_head", "alpha_along", "alpha_along_drafts", "acceptance_by_position",
    "plain_decode", "task_prompts", "draft_opd_generate", "self_speculative_generate", "run_layers",
    "count_layer_tokens",
    "cache_nbytes", "alpha_with_draft_cache", "KVProjection", "fit_kv_projection", "cache_features",
    "lookup_draft", "prompt_lookup_generate",
]

_PROB_TOL = 1e-3


class _AssistedGenerationNote(logging.Filter):
    """Drop one deprecation note that transformers' *own* assisted generation triggers.

    ``target.generate(..., assistant_model=draft)`` makes its candidate generator call the draft's ``generate``
    with a ``generation_config`` and generation arguments together, and transformers then logs that doing so
    "is deprecated". The caller did nothing wrong and cannot avoid it; the chapter compares against assisted
    generation, so the note would print on its page. Only this message is dropped.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing `generation_config` together with generation-related" not in record.getMessage()


logging.getLogger("transformers.generation.utils").addFilter(_AssistedGenerationNote())


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
# The sampling distribution (temperature and top-p) is labsrc.sampling's, the rule the serving engine and the
# server use too; warp_logits is its name in this module and in chapter 10.
warp_logits = sampling_probs


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
    cut: bool = False              # the window was shortened by the token budget, not chosen by the rule


@dataclass
class SpecStats:
    """Per-step statistics of :func:`speculative_generate` and their totals."""
    steps: list[StepStats] = field(default_factory=list)
    target_calls: int = 0          # target forward passes after the prefill
    draft_calls: int = 0           # draft forward passes after the prefill
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    new_tokens: int = 0
    target_cache_bytes: int = 0    # peak stored bytes of the target's KV cache (after each verification)
    draft_cache_bytes: int = 0     # peak stored bytes of the draft's own KV cache; 0 when it shares the target's

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
    """Cut a transformers cache back to its first ``length`` positions (``crop(-n)`` drops the newest ``n``)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def cache_nbytes(cache) -> int:
    """Stored bytes of a transformers KV cache: a quantized cache's own count (``nbytes``), else the keys and
    values of every layer."""
    if cache is None:
        return 0
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


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


class _TwoModels:
    """A separate draft model: each model keeps its own KV cache (``draft_cache(draft)`` builds the draft's)."""

    def __init__(self, target, draft, draft_cache=None, kv_projection=None):
        self.target, self.draft, self.kv_projection = target, draft, kv_projection
        self.tcache = _new_cache(target)
        self.dcache = _new_cache(draft) if draft_cache is None else draft_cache(draft)
        if not (hasattr(self.dcache, "get_seq_length") and hasattr(self.dcache, "crop")):
            raise TypeError(f"draft_cache(draft) must return a transformers Cache, got {type(self.dcache).__name__}")

    def prefill(self, ids):
        _forward(self.target, ids, self.tcache)
        if self.kv_projection is not None:    # the draft's prompt cache from the target's, without a draft run
            self.dcache = self.kv_projection.draft_cache(self.target, self.draft, self.tcache)
        else:
            _forward(self.draft, ids, self.dcache)

    def draft_length(self) -> int:
        return self.dcache.get_seq_length()

    def target_length(self) -> int:
        return self.tcache.get_seq_length()

    def draft_next(self, ids) -> torch.Tensor:
        return _forward(self.draft, ids, self.dcache)[-1]

    def score(self, feed) -> torch.Tensor:
        return _forward(self.target, feed, self.tcache)

    def rollback(self, length: int) -> None:
        _rollback(self.tcache, length)
        _rollback(self.dcache, min(self.dcache.get_seq_length(), length))

    def cache_bytes(self) -> tuple[int, int]:
        return cache_nbytes(self.tcache), cache_nbytes(self.dcache)


@torch.no_grad()
def run_layers(model, hidden: torch.Tensor, cache, start: int, stop: int) -> torch.Tensor:
    """Run decoder layers ``start..stop-1`` of a Llama-style ``model`` on ``hidden (1, n, d)``, the positions
    right after what layer ``start`` has cached; each layer appends its keys and values to ``cache``.

    The causal mask and the rotary positions are sized against layer ``start``'s cache length, so the layers
    of one cache may hold different lengths (self-speculation's lower layers run ahead of the upper ones)."""
    from transformers.masking_utils import create_causal_mask

    body = model.model
    past = cache.get_seq_length(start)
    positions = torch.arange(past, past + hidden.shape[1], device=hidden.device)[None]
    mask = create_causal_mask(config=body.config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                              position_ids=positions, layer_idx=start)
    rotary = body.rotary_emb(hidden, position_ids=positions)
    for layer in body.layers[start:stop]:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                       cache=cache, use_cache=True)
    return hidden


class _SharedBody:
    """Self-speculation with one KV cache: the draft is the target's first ``layer`` layers plus an exit head.

    Drafting runs only the lower layers; they append to the target's own cache, so the lower layers run ahead
    of the upper ones by the drafted positions, and their outputs (the hidden states at layer ``layer``) are
    kept. Verification runs the lower layers only on the last drafted token (the one the draft sampled but did
    not feed) and the upper layers on every pending position, starting from the kept hidden states: the lower
    half's keys, values and activations are computed once per position, never twice.
    """

    def __init__(self, target, layer, head):
        exit_model = early_exit_draft(target, layer, head)
        self.target, self.layer = target, exit_model.config.num_hidden_layers
        self.n_layers = target.config.num_hidden_layers
        self.exit_norm, self.exit_head = exit_model.model.norm, exit_model.lm_head
        self.cache = _new_cache(target)
        # layer-``layer`` outputs of the positions the lower half ran ahead on (target_length..draft_length-1)
        self.hidden: torch.Tensor | None = None

    def prefill(self, ids):
        _forward(self.target, ids, self.cache)

    def draft_length(self) -> int:
        return self.cache.get_seq_length(0)

    def target_length(self) -> int:
        return self.cache.get_seq_length(self.n_layers - 1)

    @torch.no_grad()
    def _lower(self, ids) -> torch.Tensor:
        return run_layers(self.target, self.target.model.embed_tokens(ids), self.cache, 0, self.layer)

    @torch.no_grad()
    def draft_next(self, ids) -> torch.Tensor:
        h = self._lower(ids)
        self.hidden = h if self.hidden is None else torch.cat([self.hidden, h], dim=1)
        return self.exit_head(self.exit_norm(h[:, -1])).float()[0]

    @torch.no_grad()
    def score(self, feed) -> torch.Tensor:
        # feed = the positions the upper layers have not seen: the newest token and the
        # drafts
        # of those, the lower half ran
        done = 0 if self.hidden is None else self.hidden.shape[1]
        assert (
            self.target_length() + done == self.draft_length()
        ), "lower layers out of step"
        parts = [] if self.hidden is None else [self.hidden]
        if feed.shape[1] > done:
            # the last drafted token was sampled, never fed: run it
            parts.append(self._lower(feed[:, done:]))
        self.hidden = None
        h = torch.cat(parts, dim=1)   # layer-`layer` states of every pending position
        h = run_layers(self.target, h, self.cache, self.layer, self.n_layers)
        return self.target.lm_head(self.target.model.norm(h))[0].float()

    def rollback(self, length: int) -> None:
        self.hidden = None            # every layer has scored the same positions again: nothing is ahead
        _rollback(self.cache, length)

    def cache_bytes(self) -> tuple[int, int]:
        return cache_nbytes(self.cache), 0   # the draft has no cache of its own


def _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p) -> torch.Tensor:
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
    if do_sample:
        check_sampling(temperature, top_p)
    return input_ids


def speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                         do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None, window: str = "fixed",
                         stats: SpecStats | None = None, stop_at_eos: bool = True, draft_cache=None,
                         kv_projection: KVProjection | None = None) -> tuple[torch.Tensor, SpecStats]:
    """Generate with ``draft`` proposing and ``target`` verifying; returns ``(ids (1, T + n), stats)``.

    Both models keep a transformers KV cache; after each verification both are cut back to the accepted
    prefix (the rejected drafts' keys and values must not stay in the cache). ``do_sample=False`` gives the
    target's greedy output token for token (the same as ``target.generate(do_sample=False)``);
    ``do_sample=True`` samples from the target's distribution after ``temperature`` and ``top_p``
    (:func:`labsrc.sampling.sampling_probs`, the rule the serving engine uses: ``temperature=0`` is greedy, and
    a tiny temperature is its exact limit, never NaN).
    ``window="adaptive"`` re-chooses ``k`` each cycle from an EMA (rho = 0.9) of the acceptance,
    ``k = max(2, min(8, floor(alpha_hat * 10)))``, starting from ``alpha_hat = k / 10``. Generation stops at
    ``max_new_tokens`` or after the target's end-of-sequence token (``stop_at_eos``). Pass ``stats`` to
    collect into an existing :class:`SpecStats`. Batch size 1: ``input_ids`` is ``(T,)`` or ``(1, T)``.
    ``draft_cache``: a function ``draft -> Cache`` for the draft's KV cache, e.g. a quantized
    :class:`labsrc.kv_quant.KVarNCache` (10.4.5); it must be able to drop the newest ``k - 1`` tokens.
    ``kv_projection``: build the draft's cache of the prompt from the target's with a :class:`KVProjection`
    instead of running the draft over the prompt (10.4.5's draft KV sharing).
    """
    input_ids = _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p)
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft must share a vocabulary: {target.config.vocab_size} != "
                         f"{draft.config.vocab_size}")
    if draft_cache is not None and not callable(draft_cache):
        raise TypeError(f"draft_cache must be a function draft -> Cache, got {type(draft_cache).__name__}")
    if kv_projection is not None and not isinstance(kv_projection, KVProjection):
        raise TypeError(f"kv_projection must be a KVProjection, got {type(kv_projection).__name__}")
    if kv_projection is not None and draft_cache is not None:
        raise ValueError("give draft_cache or kv_projection, not both (a projected cache is a DynamicCache)")
    engine = _TwoModels(target, draft, draft_cache, kv_projection)
    _check_rollback_window(engine.dcache, (8 if window == "adaptive" else k) - 1)
    return _speculate(engine, target, input_ids, max_new_tokens, k, do_sample, temperature, top_p, generator,
                      window, stats, stop_at_eos)


def _check_rollback_window(cache, need: int) -> None:
    """A quantized draft cache must hold the newest ``need`` tokens in full precision: a rejection drops up to
    ``k - 1`` drafted tokens, and quantized groups cannot be split (:meth:`labsrc.kv_quant.KVarNLayer.crop`)."""
    from labsrc.kv_quant import KVarNLayer

    for layer in getattr(cache, "layers", []):
        if isinstance(layer, KVarNLayer) and layer.enabled and layer.window < need:
            raise ValueError(f"draft_cache keeps the newest {layer.window} tokens in full precision, but a "
                             f"rejection can roll back {need} drafted tokens; build it with window >= {need}")


def self_speculative_generate(target, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                              layer: int | None = None, head: dict | str | None = "shipped",
                              do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                              generator: torch.Generator | None = None, window: str = "fixed",
                              stats: SpecStats | None = None, stop_at_eos: bool = True
                              ) -> tuple[torch.Tensor, SpecStats]:
    """Self-speculation with one shared KV cache (CLaSp / LayerSkip): ``target``'s first ``layer`` layers and
    an early-exit head (:func:`early_exit_draft`'s ``layer`` and ``head``) draft, the full ``target`` verifies.

    Unlike ``speculative_generate(target, early_exit_draft(target), ...)``, which keeps a second cache for the
    draft and recomputes the lower layers in every verification, the draft writes its keys and values into
    the target's cache and verification starts at layer ``layer`` from the hidden states the draft already
    computed. Same arguments, output and statistics as :func:`speculative_generate`.
    """
    input_ids = _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p)
    return _speculate(_SharedBody(target, layer, head), target, input_ids, max_new_tokens, k, do_sample,
                      temperature, top_p, generator, window, stats, stop_at_eos)


def lookup_draft(context, k: int, ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Prompt lookup's draft: up to ``k`` tokens that followed the most recent earlier
    occurrence of the context's last n-gram.

    ``context`` is a 1-D sequence of token ids (the prompt and the output so far). The
    last ``ngram`` tokens are searched for earlier in ``context``; at the most recent
    occurrence that has at least one token after it, the (up to ``k``) tokens that
    followed are the draft. Without a match the n-gram is shortened, down to
    ``min_ngram`` tokens; with no match that long the draft is empty (the caller then
    takes a plain target step). ``min_ngram=1`` falls back to a single token, as
    transformers' ``prompt_lookup_num_tokens`` does. The default, 2, never drafts from a
    one-token match: in prose such a match is mostly a chance repeat of a common token,
    and the draft it buys is almost always rejected (:func:`prompt_lookup_generate`
    gives the measurement).
    The most recent occurrence, not the first: text being quoted or edited is usually
    near the end, and a loop in the output repeats its latest turn. (transformers takes
    the first.)
    """
    _check_k(k)
    _check_k(ngram, "ngram")
    _check_k(min_ngram, "min_ngram")
    if min_ngram > ngram:
        raise ValueError(f"min_ngram must be <= ngram ({ngram}), got {min_ngram}")
    ctx = torch.as_tensor(context)
    if ctx.dtype.is_floating_point or ctx.dtype == torch.bool or ctx.dim() != 1:
        raise ValueError("context must be a 1-D sequence of integer token ids, got "
                         f"{ctx.dtype} of shape {tuple(ctx.shape)}")
    T = ctx.numel()
    for n in range(min(ngram, T - 1), min_ngram - 1, -1):
        # every window of n tokens that ends before the last token, so at least one
        # token follows it
        windows = ctx[: T - 1].unfold(0, n, 1)
        hits = (windows == ctx[T - n:]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return ctx[start: start + k].tolist()
    return []


class _PromptLookup:
    """Prompt lookup (Saxena 2023): no draft model; the draft is copied from the context by
    :func:`lookup_draft`. Only the target keeps a cache."""

    def __init__(self, target, ngram: int, min_ngram: int = 1):
        self.target, self.ngram, self.min_ngram = target, ngram, min_ngram
        self.tcache = _new_cache(target)

    def prefill(self, ids):
        _forward(self.target, ids, self.tcache)

    def propose(self, seq, kk: int) -> list[int]:
        return lookup_draft(seq[0], kk, self.ngram, self.min_ngram) if kk else []

    def target_length(self) -> int:
        return self.tcache.get_seq_length()

    def score(self, feed) -> torch.Tensor:
        return _forward(self.target, feed, self.tcache)

    def rollback(self, length: int) -> None:
        _rollback(self.tcache, length)

    def cache_bytes(self) -> tuple[int, int]:
        return cache_nbytes(self.tcache), 0


def prompt_lookup_generate(target, input_ids: torch.Tensor, max_new_tokens: int, k: int = 8, ngram: int = 3,
                           do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                           generator: torch.Generator | None = None, stop_at_eos: bool = True,
                           stats: SpecStats | None = None, min_ngram: int = 2,
                           window: str = "fixed") -> tuple[torch.Tensor, SpecStats]:
    """Speculative decoding whose draft costs (almost) nothing: prompt lookup.

    Each cycle drafts up to ``k`` tokens by :func:`lookup_draft`: the context's last ``ngram`` tokens (then
    fewer, down to ``min_ngram``) are found at their most recent earlier occurrence in the prompt or the
    output so far, and what followed is proposed. The target verifies them in one call, with the same loop,
    verification and cache rollback as :func:`speculative_generate`; when nothing matches, the cycle is a
    plain target step (no draft, one token). A deterministic draft is a one-hot ``q``, so with
    ``do_sample=True`` a drafted token ``x`` is accepted with probability ``p(x)`` and a rejection samples
    from ``p`` with ``x`` removed: the output has the target's distribution exactly. ``do_sample=False``
    gives the target's greedy output token for token. Returns ``(ids (1, T + n), stats)``;
    ``stats.draft_calls`` stays 0 (no model drafts) and ``stats.steps[i].draft_seconds`` is the lookup's
    time. ``window="adaptive"`` caps the draft by the acceptance EMA of :func:`speculative_generate`.

    Why ``min_ngram=2`` by default: drafting costs nothing, but verifying drafts does not. On a CPU a call
    that checks 8 drafted tokens costs about 1.4-2.4 decode steps, so a rejected draft loses most of a step.
    On lab-target (10 prompts of 128 tokens per kind, 20 new tokens, interleaved repetitions, one thread),
    falling back to one-token matches drafted in half of the calls on plain prose, and the first looked-up
    token was right in 14% of them: 0.78x plain decoding, 95% interval [0.73, 0.83]. With ``min_ngram=2``
    89% of prose calls are plain steps: 0.90x [0.86, 0.94] (0.86-0.98x over six runs of the comparison on a
    shared CPU; 0.75-0.81x with the fallback). Passages being repeated lose the one-token resynchronisation
    (the first token of the quotation, the token after a mismatch) and keep most of their gain: 2.74 tokens
    per target call and 1.68x [1.34, 2.03] with the fallback, 2.35 and 1.57x [1.27, 1.87] without.
    ``min_ngram=3`` was not measurably faster on prose (paired against 2: 0.96x [0.89, 1.03]) and cut the
    passages' tokens per call to 1.94; capping the draft of a short match, or the adaptive window (its EMA
    starts high and moves 10% per call, too slowly for 20 tokens), changed nothing measurable, so the
    default window stays fixed.
    Pass ``min_ngram=1`` for transformers' behaviour.
    """
    input_ids = _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p)
    _check_k(ngram, "ngram")
    _check_k(min_ngram, "min_ngram")
    if min_ngram > ngram:
        raise ValueError(f"min_ngram must be <= ngram ({ngram}), got {min_ngram}")
    return _speculate(_PromptLookup(target, ngram, min_ngram), target, input_ids, max_new_tokens, k,
                      do_sample, temperature, top_p, generator, window, stats, stop_at_eos)


def _speculate(
    engine, target, input_ids, max_new_tokens, k, do_sample, temperature, top_p,
    generator, window, stats, stop_at_eos,
) -> tuple[torch.Tensor, SpecStats]:
    """The draft-verify loop shared by :func:`speculative_generate`,
    :func:`self_speculative_generate` and :func:`prompt_lookup_generate`; ``engine`` owns
    the caches (``prefill``, ``draft_next``, ``score``, ``rollback``, ``cache_bytes``).
    An engine with a ``propose(seq, kk)`` method drafts deterministically instead of
    calling ``draft_next``: it returns up to ``kk`` tokens (possibly none), each verified
    as a draft with a one-hot ``q``."""
    stats = SpecStats() if stats is None else stats
    device = next(target.parameters()).device
    seq = input_ids.to(device)
    eos = _eos_ids(target) if stop_at_eos else set()
    alpha_hat = min(1.0, k / 10)
    t_start = time.perf_counter()

    def dist(logits):  # greedy is temperature 0 of the one sampling rule
        return sampling_probs(logits, temperature if do_sample else 0.0, top_p)

    t0 = time.perf_counter()
    if seq.shape[1] > 1:
        # prefill everything but the last token; the last is fed with the first window
        engine.prefill(seq[:, :-1])
    stats.prefill_seconds += time.perf_counter() - t0
    produced = 0
    while produced < max_new_tokens:
        rule_k = adaptive_window(alpha_hat) if window == "adaptive" else k
        # never draft past the budget: the target adds one
        kk = min(rule_k, max_new_tokens - produced - 1)
        # ---- draft up to kk tokens: one draft call each, or a deterministic proposal
        # (no model call)
        t0 = time.perf_counter()
        drafted, qs = [], []
        if hasattr(engine, "propose"):
            # a deterministic draft is a one-hot q: min(1, p/q) accepts x with
            # probability p(x), and the residual max(p - q, 0) is p with x removed,
            # renormalised; the verification below is unchanged
            drafted = engine.propose(seq, kk)
            one_hot = torch.nn.functional.one_hot
            vocab = target.config.vocab_size
            qs = [one_hot(torch.tensor(t, device=device), vocab).float()
                  for t in drafted]
        else:
            pending = seq[:, engine.draft_length():]
            for _ in range(kk):
                q = dist(engine.draft_next(pending))
                tok = (
                    torch.multinomial(q, 1, generator=generator)
                    if do_sample
                    else q.argmax(-1, keepdim=True)
                )
                drafted.append(int(tok))
                qs.append(q)
                pending = tok.view(1, 1).to(device)
            stats.draft_calls += kk
        t_draft = time.perf_counter() - t0
        # ---- one target call scores the last token and all drafts
        t0 = time.perf_counter()
        x = torch.tensor(drafted, dtype=torch.long, device=device)
        feed = torch.cat([seq[:, engine.target_length():], x[None]], dim=1)
        logits = engine.score(feed)[-(len(drafted) + 1):]
        stats.target_calls += 1
        p = dist(logits)
        q_all = torch.stack(qs) if qs else p.new_zeros((0, p.shape[-1]))
        out, n_acc = verify(x, q_all, p, generator=generator, greedy=not do_sample)
        t_target = time.perf_counter() - t0
        # the peak: the drafts are still cached
        t_bytes, d_bytes = engine.cache_bytes()
        stats.target_cache_bytes = max(stats.target_cache_bytes, t_bytes)
        stats.draft_cache_bytes = max(stats.draft_cache_bytes, d_bytes)
        emitted = out.tolist()
        # stop after an end-of-sequence token, as generate() does
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        seq = torch.cat(
            [seq, torch.tensor([emitted], dtype=torch.long, device=device)], dim=1
        )
        produced += len(emitted)
        # ---- roll the caches back to the accepted prefix: everything but the newest
        # token is cached
        engine.rollback(seq.shape[1] - 1)
        acc_mask = tuple(j < n_acc for j in range(len(drafted)))
        if drafted:
            alpha_hat = 0.9 * alpha_hat + 0.1 * (n_acc / len(drafted))
        stats.steps.append(
            StepStats(
                k=kk,
                drafted=len(drafted),
                accepted=n_acc,
                emitted=len(emitted),
                draft_seconds=t_draft,
                target_seconds=t_target,
                accepted_mask=acc_mask,
                cut=kk < rule_k,
            )
        )
        if emitted and emitted[-1] in eos:
            break
    stats.new_tokens += min(produced, max_new_tokens)
    stats.wall_seconds += time.perf_counter() - t_start
    return seq[:, : input_ids.shape[1] + max_new_tokens], stats


@contextmanager
def count_layer_tokens(model):
    """Count the token positions each decoder layer of ``model`` processes inside the ``with`` block.

    Yields a list, one count per layer, filled in as the layers run (forward pre-hooks, removed on exit).
    A draft that shares the target's layers (:func:`early_exit_draft`) is counted too: this is how the
    chapter measures the lower-layer work that self-speculation with a shared cache saves.
    """
    counts = [0] * len(model.model.layers)
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            counts[i] += hidden.shape[0] * hidden.shape[1]
        hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


# ------------------------------------------------------------------------------------------- draft KV from the target
def _rope_tables(model, n: int):
    from labsrc.rope import rope_cos_sin
    rotary = model.model.rotary_emb
    return rope_cos_sin(rotary.inv_freq, n, getattr(rotary, "attention_scaling", 1.0))


def _kv_layout(config) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)``: the shape of one position's keys (and values) in a model's cache."""
    from labsrc.models import config_head_dim
    return config.num_hidden_layers, config.num_key_value_heads, config_head_dim(config)


def cache_features(model, cache) -> torch.Tensor:
    """Every layer's cached keys (rotation by position undone) and values, one row per position: ``(T, F)``
    with ``F = layers x 2 x kv_heads x head_dim`` (the first sequence of the batch). Keys are stored rotated
    by their position (RoPE); undoing the rotation leaves what a position-independent linear map can relate
    across models."""
    from labsrc.rope import apply_rope_ref

    n = cache.get_seq_length()
    if n == 0:
        layers, heads, dim = _kv_layout(model.config)
        return torch.zeros(0, layers * 2 * heads * dim)
    cos, sin = _rope_tables(model, n)
    cols = []
    for layer in cache.layers[: model.config.num_hidden_layers]:
        k = layer.keys[:1, :, :n].float()
        _, k = apply_rope_ref(k, k, cos, -sin)                      # rotate back by -position
        for x in (k, layer.values[:1, :, :n].float()):             # (1, H, T, D) -> (T, H * D)
            cols.append(x[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(cols, dim=1)


@dataclass
class KVProjection:
    """A linear map from the target's KV cache to the draft's (10.4.5): ``draft features = [target features,
    1] @ weight``, fitted by :func:`fit_kv_projection`. :meth:`draft_cache` turns a target cache into a
    draft cache for the same positions without running the draft."""
    weight: torch.Tensor           # (F_target + 1, F_draft)
    r2: float                      # fraction of the draft features' variance explained on the fitting data
    n_positions: int               # positions fitted on

    @torch.no_grad()
    def draft_cache(self, target, draft, target_cache):
        """A ``DynamicCache`` for ``draft`` holding every position of ``target_cache``, projected."""
        from labsrc.rope import apply_rope_ref

        x = cache_features(target, target_cache)
        if x.shape[1] + 1 != self.weight.shape[0]:
            raise ValueError(f"target_cache has {x.shape[1]} features per position but the projection was "
                             f"fitted on {self.weight.shape[0] - 1}: another target?")
        y = torch.cat([x, x.new_ones(len(x), 1)], 1).double() @ self.weight.double()
        layers, heads, dim = _kv_layout(draft.config)
        if y.shape[1] != layers * 2 * heads * dim:
            raise ValueError("the projection was fitted for a draft of another shape")
        n = len(y)
        cos, sin = _rope_tables(draft, n)
        dtype = next(draft.parameters()).dtype
        cache = _new_cache(draft)
        for i, block in enumerate(y.float().split(2 * heads * dim, dim=1)):      # one block per layer
            k, v = (t.reshape(n, heads, dim).transpose(0, 1)[None]                # (1, H, T, D)
                    for t in block.split(heads * dim, dim=1))
            _, k = apply_rope_ref(k, k, cos, sin)                     # rotate to each position again
            cache.update(k.to(dtype), v.to(dtype), i)
        return cache


@torch.no_grad()
def fit_kv_projection(target, draft, sequences, ridge: float = 1e-3) -> KVProjection:
    """Fit :class:`KVProjection` by ridge regression on ``sequences`` (token id tensors): run both models over
    each, then solve ``min ||[X, 1] W - Y||^2 + ridge * trace(X^T X) / F * ||W||^2`` in float64, ``X`` the
    target's :func:`cache_features`, ``Y`` the draft's, one row per position."""
    if not sequences:
        raise ValueError("sequences must hold at least one token sequence")
    if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not ridge >= 0:
        raise ValueError(f"ridge must be a number >= 0, got {ridge!r}")
    xs, ys = [], []
    for ids in sequences:
        ids = ids.reshape(1, -1).to(next(target.parameters()).device)
        tc, dc = _new_cache(target), _new_cache(draft)
        _forward(target, ids, tc)
        _forward(draft, ids, dc)
        xs.append(cache_features(target, tc))
        ys.append(cache_features(draft, dc))
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    x1 = torch.cat([x, x.new_ones(len(x), 1)], 1)
    gram = x1.T @ x1                                                   # its top-left block is X^T X
    reg = ridge * torch.trace(gram[:-1, :-1]) / x.shape[1]
    gram[:-1, :-1] += reg * torch.eye(x.shape[1], dtype=x.dtype)     # the bias is not shrunk
    w = torch.linalg.solve(gram, x1.T @ y)
    resid = y - x1 @ w
    r2 = 1 - float(resid.pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    return KVProjection(weight=w.float(), r2=r2, n_positions=len(x))


# ----------------------------------------------------------------------------------------------- tree generation
_TREE_MASK: list = []      # (ancestor mask, use_kernel) of the tree being verified, set around the target call
_TREE_ATTN = "lab_tree"


def _tree_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: the tree's queries against prefix + tree under the ancestor mask."""
    from labsrc.kernels.speculative import tree_attention, tree_attention_ref
    mask, use_kernel = _TREE_MASK[-1]
    n = query.shape[2]
    if key.shape[2] < n or mask.shape[-1] != n:
        raise ValueError(f"tree attention: {n} queries but a tree mask for {mask.shape[-1]} nodes")
    fn = tree_attention if use_kernel else tree_attention_ref
    out = fn(query.contiguous(), key, value, mask.to(query.device), sm_scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_tree_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(_TREE_ATTN, _tree_attention_forward)
    AttentionMaskInterface.register(_TREE_ATTN, sdpa_mask)


@torch.no_grad()
def tree_verify_logits(target, cache, tokens: torch.Tensor, parents, position0: int,
                       use_kernel: bool = True) -> torch.Tensor:
    """One target forward over a token tree after ``cache``: node ``i`` (token ``tokens[i]``, parent
    ``parents[i]``, ``-1`` for the root's level) sits at position ``position0 + depth(i) - 1`` and attends to the
    cache and its ancestors (the Triton tree-attention kernel). Returns the logits ``(N, V)``; the cache then
    holds all ``N`` nodes (cut it back with :func:`_keep_cache_positions`). ``use_kernel=False`` runs the
    PyTorch reference of the same attention instead (same numbers; faster under the Triton interpreter)."""
    _register_tree_attention()
    depth = torch.tensor(tree_depths(parents))
    pos = (position0 + depth - 1)[None].to(tokens.device)
    previous = target.config._attn_implementation
    _TREE_MASK.append((tree_attention_mask(parents), use_kernel))
    try:
        target.set_attn_implementation(_TREE_ATTN)
        out = target(input_ids=tokens[None], cache=cache, position_ids=pos, use_cache=True)
    finally:
        target.set_attn_implementation(previous)
        _TREE_MASK.pop()
    return out.logits[0].float()


def _keep_cache_positions(cache, keep: torch.Tensor) -> None:
    """Keep only cache positions ``keep`` (a 1-D index tensor) in every layer of a transformers cache."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


@torch.no_grad()
def tree_speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                              branches: int = 2, stats: SpecStats | None = None, stop_at_eos: bool = True,
                              use_kernel: bool = True) -> tuple[torch.Tensor, SpecStats]:
    """Greedy tree speculation: per cycle the draft walks its greedy path for ``k`` steps and at every depth
    also offers its next ``branches - 1`` most likely tokens as siblings (a tree of ``1 + k * branches``
    nodes, the verified last token as root); the target verifies the whole tree in one forward with the
    tree-attention kernel and accepts the longest root path whose every token is its own argmax. Output is
    token-identical to the target's greedy decoding. ``branches=1`` is the chain. Returns ``(ids, stats)``."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    _check_k(k)
    _check_k(branches, "branches")
    stats = SpecStats() if stats is None else stats
    device = next(target.parameters()).device
    seq = input_ids.to(device)
    eos = _eos_ids(target) if stop_at_eos else set()
    t_start = time.perf_counter()
    tcache, dcache = _new_cache(target), _new_cache(draft)
    if seq.shape[1] > 1:
        _forward(target, seq[:, :-1], tcache)
        _forward(draft, seq[:, :-1], dcache)
    produced = 0
    while produced < max_new_tokens:
        kk = min(k, max_new_tokens - produced - 1)
        t0 = time.perf_counter()
        # ---- draft: greedy path of kk tokens; siblings = the next-best tokens at each depth
        tokens, parents = [int(seq[0, -1])], [-1]
        path_node = 0
        pending = seq[:, dcache.get_seq_length():]
        path = []
        for _ in range(kk):
            logits = _forward(draft, pending, dcache)[-1]
            top = logits.topk(branches).indices.tolist()
            first = len(tokens)
            for tok in top:
                tokens.append(tok)
                parents.append(path_node)
            path_node = first
            path.append(top[0])
            pending = torch.tensor([[top[0]]], device=device)
        stats.draft_calls += kk
        t_draft = time.perf_counter() - t0
        # ---- target: the whole tree in one forward
        t0 = time.perf_counter()
        L = tcache.get_seq_length()
        logits = tree_verify_logits(target, tcache, torch.tensor(tokens, device=device), parents, L,
                                    use_kernel)
        stats.target_calls += 1
        best = logits.argmax(-1).tolist()
        children = {}
        for i, par in enumerate(parents):
            if par >= 0:
                children.setdefault(par, []).append(i)
        node, accepted_nodes = 0, []
        while True:
            nxt = [c for c in children.get(node, []) if tokens[c] == best[node]]
            if not nxt:
                break
            node = nxt[0]
            accepted_nodes.append(node)
        emitted = [tokens[i] for i in accepted_nodes] + [best[node]]
        t_target = time.perf_counter() - t0
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        n_acc = len(accepted_nodes)
        keep = torch.cat([torch.arange(L + 1), L + torch.tensor(accepted_nodes, dtype=torch.long)]).to(device)
        _keep_cache_positions(tcache, keep[: L + 1 + max(0, len(emitted) - 1)])
        seq = torch.cat([seq, torch.tensor([emitted], device=device)], dim=1)
        produced += len(emitted)
        # the draft cached its own greedy path: keep the part that agrees with what was emitted
        agree = 0
        while agree < min(len(path) - 1, len(emitted)) and path[agree] == emitted[agree]:
            agree += 1
        _rollback(dcache, min(dcache.get_seq_length(), L + 1 + agree, seq.shape[1] - 1))
        stats.steps.append(StepStats(k=kk, drafted=len(tokens) - 1, accepted=n_acc, emitted=len(emitted),
                                     draft_seconds=t_draft, target_seconds=t_target,
                                     accepted_mask=tuple(j < n_acc for j in range(kk))))
        if emitted and emitted[-1] in eos:
            break
    stats.new_tokens += min(produced, max_new_tokens)
    stats.wall_seconds += time.perf_counter() - t_start
    return seq[:, : input_ids.shape[1] + max_new_tokens], stats


# ----------------------------------------------------------------------------------------------- measurement
@torch.no_grad()
def alpha_along(target, draft, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced acceptance along a sequence: ``1 - TV(p_t, q_t)`` at every position ``t`` of ``ids``
    ``(T,)`` (the acceptance probability a drafted token would have there), one forward per model."""
    return alpha_along_drafts(target, {"draft": draft}, ids, temperature)[0]["draft"]


@torch.no_grad()
def alpha_along_drafts(target, drafts: dict, ids: torch.Tensor, temperature: float = 1.0
                       ) -> tuple[dict, torch.Tensor]:
    """:func:`alpha_along` for several drafts on one sequence, with the target run once.

    Returns ``({name: (T,) acceptance 1 - TV(p_t, q_t)}, (T,) entropy of p_t in nats)``. The entropy says how
    determined the target's next token is at each position: the source explains its per-task acceptance
    (Table 10-9) by how determined the text is, and this is that quantity, measured on the target itself.
    """
    ids = ids.reshape(1, -1).to(next(target.parameters()).device)
    p = warp_logits(target(input_ids=ids).logits[0].float(), temperature)
    alphas = {name: torch.minimum(p, warp_logits(d(input_ids=ids).logits[0].float(), temperature)).sum(-1)
              for name, d in drafts.items()}
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)   # 0 * log 0 = 0: clamp only inside the log
    return alphas, entropy


@torch.no_grad()
def alpha_with_draft_cache(target, draft, ids: torch.Tensor, draft_cache=None, n_decode: int = 32,
                           temperature: float = 1.0, kv_projection: KVProjection | None = None,
                           draft_prefix: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a draft cache (a quantized one, or one projected from the target's) does to the acceptance,
    position by position.

    ``ids (T,)`` is fed to the draft as decoding would: ``ids[:T - n_decode]`` in one prefill into
    ``draft_cache(draft)`` (or, with ``kv_projection``, projected from the target's cache of that prefix),
    then the last ``n_decode`` tokens one at a time, each reading the cache. ``draft_prefix`` (a control)
    fills the draft's cache from other tokens instead of ``ids[:T - n_decode]``: another text's prefix, or
    none (an empty tensor). Returns
    ``(alpha_cache, alpha_full, tv)``, each ``(n_decode,)``: ``sum_x min(p, q')`` with the draft's
    distribution ``q'`` through that cache, ``sum_x min(p, q)`` with its exact distribution ``q`` (one forward
    without a cache), and ``TV(q, q')``. Since ``min(p, q') >= min(p, q) - (q - q')_+`` term by term,
    ``|alpha_cache - alpha_full| <= tv`` at every position.
    """
    ids = ids.reshape(1, -1).to(next(target.parameters()).device)
    T = ids.shape[1]
    if isinstance(n_decode, bool) or not isinstance(n_decode, int) or not 1 <= n_decode < T:
        raise ValueError(f"n_decode must be an int in [1, {T - 1}] (ids has {T} tokens), got {n_decode!r}")
    if draft_prefix is not None:
        if kv_projection is not None:
            raise ValueError("give kv_projection or draft_prefix, not both")
        if not isinstance(draft_prefix, torch.Tensor) or draft_prefix.dtype != torch.long:
            raise TypeError("draft_prefix must be a torch.long tensor of token ids")
        prefix = draft_prefix.reshape(1, -1).to(ids.device)
    else:
        prefix = ids[:, : T - n_decode]
    tcache = _new_cache(target)          # one target forward: its logits give p, its cache the projection
    p = warp_logits(_forward(target, ids, tcache)[T - n_decode:], temperature)
    if kv_projection is not None:
        if draft_cache is not None:
            raise ValueError("give draft_cache or kv_projection, not both")
        if not isinstance(kv_projection, KVProjection):
            raise TypeError(f"kv_projection must be a KVProjection, got {type(kv_projection).__name__}")
        _rollback(tcache, T - n_decode)  # the prefix only: the draft decodes the rest itself
        cache = kv_projection.draft_cache(target, draft, tcache)
    else:
        if draft_cache is not None and not callable(draft_cache):
            raise TypeError(f"draft_cache must be a function draft -> Cache, got {type(draft_cache).__name__}")
        cache = (draft_cache or _new_cache)(draft)
        if prefix.shape[1]:
            _forward(draft, prefix, cache)
    q_cache = torch.cat([_forward(draft, ids[:, t: t + 1], cache) for t in range(T - n_decode, T)])
    q_cache = warp_logits(q_cache, temperature)
    q = warp_logits(draft(input_ids=ids).logits[0, T - n_decode:].float(), temperature)
    return (torch.minimum(p, q_cache).sum(-1), torch.minimum(p, q).sum(-1),
            0.5 * (q - q_cache).abs().sum(-1))


def acceptance_by_position(stats: SpecStats | list[SpecStats], k: int) -> tuple[list[int], list[int]]:
    """``(accepted, reached)`` per window position ``1..k``: how often draft ``i`` was reached (every earlier
    draft accepted) and then accepted. ``accepted[i] / reached[i]`` is the conditional acceptance at ``i``."""
    runs = stats if isinstance(stats, list) else [stats]
    accepted, reached = [0] * k, [0] * k
    for run in runs:
        for step in run.steps:
            for i, ok in enumerate(step.accepted_mask[:k]):
                reached[i] += 1
                accepted[i] += int(ok)
                if not ok:
                    break
    return accepted, reached


@torch.no_grad()
def plain_decode(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy decoding one token per forward with a KV cache (the baseline speculative decoding is timed
    against, the same code path). Returns ``(ids, seconds of each decode forward)``."""
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    cache = _new_cache(model)
    if ids.shape[1] > 1:
        _forward(model, ids[:, :-1], cache)
    times = []
    for _ in range(max_new_tokens):
        t0 = time.perf_counter()
        nxt = _forward(model, ids[:, cache.get_seq_length():], cache)[-1].argmax()
        times.append(time.perf_counter() - t0)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids, times


def task_prompts(tokenizer, task: str, n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` prompts of about ``length`` tokens for ``task``: ``"prose"`` (validation text), ``"passkey"`` (the
    text up to the pass key's answer), ``"copy"`` (a word list, prose, then the request to copy it) or
    ``"passage"`` (a quoted prose passage, more prose, then the request to repeat the passage: the answer
    quotes the context, prompt lookup's best case)."""
    import random

    from labsrc import tasks

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if task == "prose":
            ids = tasks.corpus_ids(tokenizer, "validation")
            start = rng.randrange(0, len(ids) - length)
            out.append(torch.cat([torch.tensor([tokenizer.bos_token_id]), ids[start:start + length - 1]]))
        elif task == "passkey":
            sample = tasks.passkey_sample(tokenizer, length, rng.random(), rng)
            out.append(torch.tensor(sample.prompt_ids))
        elif task == "copy":
            sample = tasks.copy_sample(tokenizer, length, rng)
            out.append(torch.tensor(sample.prompt_ids))
        elif task == "passage":
            sample = tasks.passage_sample(tokenizer, length, rng.random(), rng)
            out.append(torch.tensor(sample.prompt_ids))
        else:
            raise ValueError(f"task must be 'prose', 'passkey', 'copy' or 'passage', got {task!r}")
    return out


# ----------------------------------------------------------------------------------------------- Draft-OPD
def draft_opd_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                       update: bool = True, lr: float = 3e-4, buffer_size: int = 16, seed: int = 0,
                       stop_at_eos: bool = False) -> tuple[torch.Tensor, SpecStats]:
    """Greedy speculative decoding whose draft learns online from the target (Draft-OPD, 10.4.2).

    After every verification the target's distributions at the ``k + 1`` verified positions (softmax of its
    logits, on the sequence the draft actually proposed) go into a replay buffer of the last ``buffer_size``
    cycles; then one AdamW step on ``KL(p_target || q_draft)`` over the newest entry and one drawn from the
    buffer updates a *copy* of ``draft`` (the argument is not modified). The draft's KV cache was built with
    the old weights, so it is rebuilt after each step (one prefill). Output equals the target's greedy output
    whatever the draft learns. ``update=False`` runs the same loop with the draft frozen, for comparison.
    Returns ``(ids, stats)``; ``stats.steps[i].accepted`` traces acceptance over the generation.
    """
    import copy
    import random

    _check_k(k)
    device = next(target.parameters()).device
    ids = input_ids.reshape(1, -1).to(device)
    student = copy.deepcopy(draft)
    student.eval()
    opt = torch.optim.AdamW([q for q in student.parameters() if q.is_floating_point()], lr=lr,
                            weight_decay=0.0) if update else None
    rng = random.Random(seed)
    stats = SpecStats()
    eos = _eos_ids(target) if stop_at_eos else set()
    t_start = time.perf_counter()
    tcache = _new_cache(target)
    if ids.shape[1] > 1:
        _forward(target, ids[:, :-1], tcache)
    buffer: list[tuple[torch.Tensor, int, torch.Tensor]] = []
    produced = 0
    while produced < max_new_tokens:
        kk = min(k, max_new_tokens - produced - 1)
        t0 = time.perf_counter()
        dcache = _new_cache(student)          # rebuilt: the weights changed since the last cycle
        pending, drafted = ids, []
        for _ in range(kk):
            tok = _forward(student, pending, dcache)[-1].argmax()
            drafted.append(int(tok))
            pending = tok.view(1, 1)
        t_draft = time.perf_counter() - t0
        t0 = time.perf_counter()
        x = torch.tensor([drafted], dtype=torch.long, device=device)
        feed = torch.cat([ids[:, tcache.get_seq_length():], x], dim=1)
        logits = _forward(target, feed, tcache)[-(kk + 1):]
        stats.target_calls += 1
        best = logits.argmax(-1).tolist()
        n_acc = 0
        while n_acc < kk and drafted[n_acc] == best[n_acc]:
            n_acc += 1
        emitted = drafted[:n_acc] + [best[n_acc]]
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        t_target = time.perf_counter() - t0
        context = torch.cat([ids, x], dim=1)[0]           # what the target scored
        ids = torch.cat([ids, torch.tensor([emitted], device=device)], dim=1)
        produced += len(emitted)
        _rollback(tcache, ids.shape[1] - 1)
        stats.steps.append(StepStats(k=kk, drafted=kk, accepted=n_acc, emitted=len(emitted),
                                     draft_seconds=t_draft, target_seconds=t_target,
                                     accepted_mask=tuple(j < n_acc for j in range(kk))))
        if update and kk:
            buffer.append((context, kk + 1, torch.softmax(logits.float(), -1)))
            del buffer[:-buffer_size]
            batch = [buffer[-1]] + ([rng.choice(buffer[:-1])] if len(buffer) > 1 else [])
            student.train()
            loss = 0.0
            for ctx, n, p in batch:
                # the last n positions of the context are the ones the target scored
                lq = torch.log_softmax(student(input_ids=ctx[None]).logits[0, -n:].float(), -1)
                loss = loss + (p * (p.clamp_min(1e-30).log() - lq)).sum(-1).mean() / len(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            student.eval()
        if emitted and emitted[-1] in eos:
            break
    stats.new_tokens += min(produced, max_new_tokens)
    stats.wall_seconds += time.perf_counter() - t_start
    return ids[:, : input_ids.reshape(1, -1).shape[1] + max_new_tokens], stats


# ----------------------------------------------------------------------------------------------- self-speculation
EARLY_EXIT_DIR = __import__("pathlib").Path(__file__).resolve().parent / "models" / "early_exit"


def early_exit_draft(target, layer: int | None = None, head: dict | str | None = "shipped"):
    """A draft made of ``target``'s own first ``layer`` layers plus an early-exit head (CLaSp / LayerSkip style).

    Returns a ``LlamaForCausalLM`` whose embedding and decoder layers *are* the target's modules (shared, not
    copied: no extra weights, and its keys and values at those layers equal the target's), followed by its
    own final norm and ``lm_head``. ``head``: ``"shipped"`` loads the head trained by
    :func:`train_early_exit_head` (``labsrc/models/early_exit/<name>-L<layer>.safetensors``), a path loads that
    file, a dict is a state dict, ``None`` keeps the target's final norm and ``lm_head`` (untrained exit).
    ``layer`` defaults to half the target's layers.
    """
    import copy

    from transformers import LlamaForCausalLM

    n_layers = target.config.num_hidden_layers
    layer = n_layers // 2 if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer < n_layers:
        raise ValueError(f"layer must be an int in [1, {n_layers - 1}], got {layer!r}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layer
    cfg.tie_word_embeddings = False
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layer]
    with torch.device("meta"):
        draft = LlamaForCausalLM(cfg)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:layer])
    draft.model.rotary_emb = target.model.rotary_emb
    draft.model.norm = copy.deepcopy(target.model.norm)
    draft.lm_head = copy.deepcopy(target.lm_head)
    draft.generation_config = copy.deepcopy(target.generation_config)
    if head is not None:
        if isinstance(head, str):
            from safetensors.torch import load_file
            path = (EARLY_EXIT_DIR / f"{_model_name(target)}-L{layer}.safetensors") if head == "shipped" else head
            head = load_file(str(path))
        draft.model.norm.weight.data.copy_(head["norm.weight"].float())
        draft.lm_head.weight.data.copy_(head["lm_head.weight"].float())
    return draft.eval()


def _model_name(model) -> str:
    from pathlib import Path
    return Path(str(getattr(model.config, "_name_or_path", "model"))).name or "model"


def train_early_exit_head(target, tokenizer, layer: int | None = None, steps: int = 300, seq_len: int = 256,
                          batch_size: int = 4, lr: float = 2e-3, seed: int = 0, out: str | None = None,
                          log=None) -> dict:
    """Train the early-exit head (final norm + ``lm_head`` on layer ``layer``'s hidden state) by
    ``KL(p_target || p_exit)`` with the whole body frozen, on the lab's training mixture (prose and the
    retrieval tasks, :func:`labsrc.models.train.make_batch`). Writes the head as fp16 safetensors to ``out``
    and returns ``{"losses": [...], "seconds": s, "path": out}``."""
    import random

    from safetensors.torch import save_file

    from labsrc.models.train import TrainConfig, make_batch

    torch.manual_seed(seed)
    draft = early_exit_draft(target, layer, head=None)
    for prm in target.parameters():
        prm.requires_grad_(False)
    params = [draft.model.norm.weight, draft.lm_head.weight]
    for prm in params:
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch_size, short_steps=0, grow_steps=0)
    rng = random.Random(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        ids, _ = make_batch(cfg, tokenizer, rng)
        with torch.no_grad():   # one frozen forward gives both the teacher and the exit layer's hidden state
            res = target(input_ids=ids, output_hidden_states=True)
            logp_t = torch.log_softmax(res.logits.float(), -1)
            hidden = res.hidden_states[draft.config.num_hidden_layers]
        logq = torch.log_softmax(draft.lm_head(draft.model.norm(hidden)).float(), -1)
        loss = (logp_t.exp() * (logp_t - logq)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log is not None and (step % 25 == 0 or step == steps - 1):
            print(f"step {step:4d} KL {loss.item():.4f} {time.perf_counter() - t0:.0f}s", file=log, flush=True)
    for prm in params:
        prm.requires_grad_(False)
    head = {"norm.weight": draft.model.norm.weight.detach().half().contiguous(),
            "lm_head.weight": draft.lm_head.weight.detach().half().contiguous()}
    if out is not None:
        save_file(head, str(out))
    return {"losses": losses, "seconds": time.perf_counter() - t0, "path": out}


def main(argv=None):
    """``python -m labsrc.speculative train-early-exit [--steps N]``: train and ship lab-target's exit head."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m labsrc.speculative")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train-early-exit", help="train lab-target's early-exit head (body frozen)")
    tr.add_argument("--layer", type=int, default=None)
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--seq-len", type=int, default=256)
    tr.add_argument("--batch-size", type=int, default=4)
    tr.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)
    from labsrc.models import load
    target, tok = load("lab-target")
    layer = target.config.num_hidden_layers // 2 if args.layer is None else args.layer
    EARLY_EXIT_DIR.mkdir(parents=True, exist_ok=True)
    out = EARLY_EXIT_DIR / f"lab-target-L{layer}.safetensors"
    res = train_early_exit_head(target, tok, layer, steps=args.steps, seq_len=args.seq_len,
                                batch_size=args.batch_size, lr=args.lr, out=str(out), log=sys.stdout)
    from labsrc.models.stored_runs import models_stamp
    card = {"target": "lab-target", "models": models_stamp("lab-target"), "layer": layer, "steps": args.steps, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "lr": args.lr, "seconds": round(res["seconds"], 1),
            "torch_threads": torch.get_num_threads(), "kl_first": res["losses"][0],
            "kl_last_25_mean": sum(res["losses"][-25:]) / len(res["losses"][-25:]),
            "losses": [round(x, 5) for x in res["losses"]]}
    (EARLY_EXIT_DIR / f"lab-target-L{layer}.json").write_text(json.dumps(card, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
