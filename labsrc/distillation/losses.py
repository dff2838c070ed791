"""The distillation losses, each averaged over tokens (never over the vocabulary), with the checks they share.

Logits are ``(..., V)`` and labels aligned with them (no shift inside); positions whose label is
``ignore_index`` are left out. The package's docstring (:mod:`labsrc.distillation`) lists each loss and its source;
:func:`fit_unimodal` shows forward KL covering and reverse KL seeking modes on a toy target.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------- checks
def _check_logits(student_logits, teacher_logits, labels=None, ignore_index=-100):
    for name, x in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] < 1:
            raise ValueError(f"{name} must have a vocabulary axis last, got shape {tuple(x.shape)}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    if labels is not None:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
        if labels.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")
        if labels.shape != student_logits.shape[:-1]:
            raise ValueError(f"labels must have the logits' shape without the vocabulary axis, "
                             f"{tuple(student_logits.shape[:-1])}, got {tuple(labels.shape)}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_temperature(T):
    if isinstance(T, bool) or not isinstance(T, (int, float)) or not math.isfinite(T) or T <= 0:
        raise ValueError(f"T must be a positive finite number, got {T!r}")


def _check_unit(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")


def token_mask(labels: torch.Tensor | None, shape, ignore_index: int = -100, device=None) -> torch.Tensor:
    """Boolean mask of the tokens that count: ``labels != ignore_index``, or every token without labels."""
    if labels is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return labels != ignore_index


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_token`` over ``mask`` (0 with a zero gradient when no token counts, not NaN)."""
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


# ----------------------------------------------------------------------------------------------- losses
def soft_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """Per-token ``KL(softmax(teacher/T) || softmax(student/T))`` in float32, shape ``logits.shape[:-1]``.

    A vocabulary entry where the teacher's logit is ``-inf`` has ``p = 0`` and contributes nothing (``0 log 0
    = 0``), whatever the student's logit.
    """
    _check_logits(student_logits, teacher_logits)
    _check_temperature(T)
    log_q = F.log_softmax(student_logits.float() / T, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / T, dim=-1)
    return _kl_terms(log_p, log_q)


def _kl_terms(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``sum_v a_v (log a_v - log b_v)`` with ``0 log 0 = 0``, written so that the gradient is finite too
    (a ``-inf`` in ``log_b`` where ``a = 0`` would otherwise make ``0 * inf = NaN`` in the backward)."""
    a = log_a.exp()
    has_mass = a > 0
    diff = torch.where(has_mass, log_a - log_b, torch.zeros_like(a))
    return (torch.where(has_mass, a, torch.zeros_like(a)) * diff).sum(-1)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None = None,
            T: float = 2.0, alpha: float = 0.5, ignore_index: int = -100, fused: bool = False) -> torch.Tensor:
    """Hinton et al.'s distillation loss, averaged over the tokens whose label is not ``ignore_index``::

        alpha * CE(labels, student) + (1 - alpha) * T² * KL(softmax(teacher / T) || softmax(student / T))

    The hard term uses temperature 1. Without ``labels`` there is no hard term and the loss is the soft term
    alone, ``T² * KL`` (``alpha`` is then unused), over every token. The T² keeps the soft term's gradient
    on the scale of the hard term's as T grows (its gradient is ``(q_T - p_T) / T`` per logit and
    ``q_T - p_T = O(1/T)``). ``fused=True`` computes the soft term with the Triton kernel
    :func:`labsrc.kernels.distillation.kd_kl` (same value, no probabilities materialised).
    """
    _check_logits(student_logits, teacher_logits, labels, ignore_index)
    _check_temperature(T)
    _check_unit("alpha", alpha)
    mask = token_mask(labels, student_logits.shape[:-1], ignore_index, student_logits.device)
    if fused:
        from labsrc.kernels.distillation import kd_kl
        V = student_logits.shape[-1]
        kl = kd_kl(student_logits.reshape(-1, V), teacher_logits.reshape(-1, V), T).reshape(mask.shape)
    else:
        kl = soft_kl(student_logits, teacher_logits, T)
    soft = T * T * _masked_mean(kl, mask)
    if labels is None:
        return soft
    safe = torch.where(mask, labels, torch.zeros_like(labels)).long()
    ce = F.cross_entropy(student_logits.float().reshape(-1, student_logits.shape[-1]), safe.reshape(-1),
                         reduction="none").reshape(mask.shape)
    return alpha * _masked_mean(ce, mask) + (1 - alpha) * soft


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    T: float = 1.0, labels: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence, averaged over tokens (like :func:`kd_loss`).

    With ``s = softmax(student/T)``, ``t = softmax(teacher/T)`` and the mixture ``m = (1 - beta) s + beta t``::

        JSD_beta = beta * KL(t || m) + (1 - beta) * KL(s || m)      (0 < beta < 1)
        beta = 0: KL(t || s)   (forward KL, "mode covering")
        beta = 1: KL(s || t)   (reverse KL, "mode seeking")

    the convention of TRL's ``GKDTrainer.generalized_jsd_loss``. TRL's default ``"batchmean"`` reduction
    divides by the number of unmasked tokens when labels are given (as here) but by the batch size when
    they are not; this function always takes the per-token mean.
    """
    _check_logits(student_logits, teacher_logits, labels, ignore_index)
    _check_temperature(T)
    _check_unit("beta", beta)
    log_s = F.log_softmax(student_logits.float() / T, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / T, dim=-1)

    per = _gjsd_per_token(log_s, log_t, beta)
    mask = token_mask(labels, per.shape, ignore_index, per.device)
    return _masked_mean(per, mask)


def _gjsd_per_token(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized JSD per token from the two log-softmaxes (see :func:`generalized_jsd`)."""
    if beta == 0:
        return _kl_terms(log_t, log_s)
    if beta == 1:
        return _kl_terms(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_s + math.log1p(-beta), log_t + math.log(beta)]), dim=0)
    return beta * _kl_terms(log_t, log_m) + (1 - beta) * _kl_terms(log_s, log_m)


def expected_acceptance(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                        labels: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Mean over tokens of ``sum_v min(p_teacher, p_student)`` (temperature 1): the probability that
    speculative sampling accepts the student's draft token at that position, ``1 - TV(p_t, p_s)``."""
    _check_logits(student_logits, teacher_logits, labels, ignore_index)
    p_s = F.softmax(student_logits.float(), dim=-1)
    p_t = F.softmax(teacher_logits.float(), dim=-1)
    per = torch.minimum(p_s, p_t).sum(-1)
    return _masked_mean(per, token_mask(labels, per.shape, ignore_index, per.device))


def cosine_hidden_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                       proj: torch.nn.Module | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """DistilBERT's cosine loss, ``1 - cos(proj(h_student), h_teacher)`` averaged over tokens.

    DistilBERT's student has the teacher's width, so it needs no projection; a student of another width
    (``lab-draft``: 128 against 320) goes through ``proj`` (a learned linear map to the teacher's width).
    """
    if proj is not None:
        student_hidden = proj(student_hidden)
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} (after proj) and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must have the same shape; pass a proj for other widths")
    cos = F.cosine_similarity(student_hidden.float(), teacher_hidden.float(), dim=-1)
    mask = torch.ones_like(cos, dtype=torch.bool) if mask is None else mask
    return _masked_mean(1 - cos, mask)


DISTILBERT_WEIGHTS = (5.0, 2.0, 1.0)  # (kd, lm, cos): alpha_ce, alpha_mlm, alpha_cos of DistilBERT's run


def distilbert_loss(student_logits, teacher_logits, labels, student_hidden, teacher_hidden,
                    proj: torch.nn.Module | None = None, T: float = 2.0, weights=DISTILBERT_WEIGHTS,
                    ignore_index: int = -100) -> torch.Tensor:
    """DistilBERT's triple loss for a causal LM: ``w_kd * T² KL + w_lm * CE + w_cos * (1 - cos)``.

    The LM loss replaces DistilBERT's masked-LM loss; the weights default to its training script's
    ``alpha_ce = 5, alpha_mlm = 2, alpha_cos = 1``. Averages over tokens with ``labels != ignore_index``.
    """
    if len(weights) != 3:
        raise ValueError(f"weights must be (w_kd, w_lm, w_cos), got {weights!r}")
    w_kd, w_lm, w_cos = weights
    mask = token_mask(labels, student_logits.shape[:-1], ignore_index, student_logits.device)
    soft = kd_loss(student_logits, teacher_logits, labels, T=T, alpha=0.0, ignore_index=ignore_index)
    hard = kd_loss(student_logits, teacher_logits, labels, T=T, alpha=1.0, ignore_index=ignore_index)
    cos = cosine_hidden_loss(student_hidden, teacher_hidden, proj, mask)
    return w_kd * soft + w_lm * hard + w_cos * cos


def tinybert_layer_map(n_teacher: int, n_student: int) -> list[int]:
    """TinyBERT's uniform mapping ``g(m) = m * N / M`` for ``m = 0..M``: student layer ``m`` learns from
    teacher layer ``g(m)`` (layer 0 is the embedding output; ``g(M) = N``, the last layer to the last)."""
    for name, n in (("n_teacher", n_teacher), ("n_student", n_student)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if n_teacher % n_student:
        raise ValueError(f"the uniform mapping needs n_student ({n_student}) to divide n_teacher ({n_teacher})")
    return [m * (n_teacher // n_student) for m in range(n_student + 1)]


def tinybert_loss(student_hiddens, teacher_hiddens, student_attns, teacher_attns, proj: torch.nn.Module,
                  mapping: list[int] | None = None) -> torch.Tensor:
    """TinyBERT's intermediate-layer loss: ``sum_m MSE(H_S[m] W_h, H_T[g(m)]) + sum_m MSE(A_S[m], A_T[g(m)])``.

    ``*_hiddens`` are the ``M + 1`` / ``N + 1`` hidden states (embeddings first, as transformers'
    ``output_hidden_states``), ``*_attns`` the ``M`` / ``N`` attention maps ``(B, H, T, T)`` (one per layer,
    so attention loss ``m`` pairs student layer ``m`` with teacher layer ``g(m)``, ``m = 1..M``). ``proj``
    is ``W_h`` (student width to teacher width). When the head counts differ (TinyBERT's have the same)
    the maps are compared averaged over heads. The prediction-layer loss is :func:`kd_loss` with alpha 0.
    """
    M, N = len(student_hiddens) - 1, len(teacher_hiddens) - 1
    mapping = tinybert_layer_map(N, M) if mapping is None else list(mapping)
    if len(mapping) != M + 1:
        raise ValueError(f"mapping must give a teacher layer for each of the {M + 1} student layers, got {mapping}")
    loss = sum(F.mse_loss(proj(student_hiddens[m]).float(), teacher_hiddens[g].float())
               for m, g in enumerate(mapping))
    if student_attns is not None:
        for m in range(1, M + 1):
            a_s, a_t = student_attns[m - 1].float(), teacher_attns[mapping[m] - 1].float()
            if a_s.shape[1] != a_t.shape[1]:
                a_s, a_t = a_s.mean(1), a_t.mean(1)
            loss = loss + F.mse_loss(a_s, a_t)
    return loss


# ------------------------------------------------------------------------------- mode covering vs seeking
def fit_unimodal(target: torch.Tensor, grid: torch.Tensor, beta: float, means=None, stds=None) -> tuple[float, float]:
    """The discretised Gaussian ``q`` (mean, std) on ``grid`` closest to the categorical ``target`` under the
    generalized JSD with ``beta`` (0: forward KL(target || q), 1: reverse KL(q || target)), found by an
    exhaustive search over ``means`` x ``stds`` (a grid search finds the global minimum, where gradient
    descent can stall between the modes). Returns ``(mean, std)``. On a bimodal target forward KL covers both
    modes (a wide q between them); reverse KL seeks one mode (a narrow q on it)."""
    _check_unit("beta", beta)
    means = torch.linspace(float(grid.min()), float(grid.max()), 97) if means is None else means
    stds = torch.linspace(0.2, float(grid.max() - grid.min()) / 2, 60) if stds is None else stds
    mu, sd = torch.meshgrid(means, stds, indexing="ij")
    s_logits = -0.5 * ((grid - mu.reshape(-1, 1)) / sd.reshape(-1, 1)) ** 2
    log_s = F.log_softmax(s_logits.double(), -1)
    log_t = target.double().clamp_min(1e-300).log().expand_as(log_s)
    best = int(_gjsd_per_token(log_s, log_t, beta).argmin())
    return float(mu.reshape(-1)[best]), float(sd.reshape(-1)[best])


# ------------------------------------------------------------------ the draft's own objective
def tv_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None = None,
            ignore_index: int = -100) -> torch.Tensor:
    """Mean over tokens of the total variation ``TV(p_t, p_s) = 1/2 sum_v |p_t,v - p_s,v|`` (temperature 1).

    Speculative sampling accepts a drafted token with probability ``sum_v min(p_t, p_s) = 1 - TV`` (Leviathan
    et al.), so this loss is exactly one minus the expected acceptance (:func:`expected_acceptance`): the
    objective a draft is trained for, with no stand-in. Its gradient with respect to the student's logit
    ``z_j`` is ``p_s,j (sign_j - sum_v p_s,v sign_v) / 2`` with ``sign_v = sign(p_s,v - p_t,v)``: bounded,
    but small where the student gives a token almost no probability, so TV pulls up a missing token slowly
    where a KL would pull hard (DistillSpec trains with it all the same, and measures which works).
    """
    _check_logits(student_logits, teacher_logits, labels, ignore_index)
    p_s = F.softmax(student_logits.float(), dim=-1)
    p_t = F.softmax(teacher_logits.float(), dim=-1)
    per = 0.5 * (p_s - p_t).abs().sum(-1)
    return _masked_mean(per, token_mask(labels, per.shape, ignore_index, per.device))
