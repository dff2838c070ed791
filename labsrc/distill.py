"""Knowledge distillation from scratch: the KD loss and its T² factor, forward/reverse KL and GKD's generalized
JSD, DistilBERT's and TinyBERT's losses, and the experiment that distils ``lab-target`` into drafts.

Losses (all averaged over *tokens*, never over the vocabulary; positions whose label is ``ignore_index`` are
left out; logits are ``(..., V)`` and labels are aligned with them: no shift inside):

* :func:`soft_kl` -- per-token ``KL(softmax(teacher/T) || softmax(student/T))``;
* :func:`kd_loss` -- Hinton et al.'s ``alpha * CE(labels, student) + (1 - alpha) * T² * KL``;
* :func:`generalized_jsd` -- GKD's divergence (Agarwal et al.): the mixture ``m = (1-beta) s + beta t`` and
  ``beta * KL(t || m) + (1 - beta) * KL(s || m)``; ``beta = 0`` is ``KL(t || s)`` (forward, mode covering),
  ``beta = 1`` is ``KL(s || t)`` (reverse, mode seeking), as in TRL's ``generalized_jsd_loss``;
* :func:`expected_acceptance` -- ``sum_v min(p_t, p_s)``, speculative sampling's per-token acceptance rate
  when the student drafts for the teacher (Leviathan et al.), i.e. ``1 - TV(p_t, p_s)``;
* :func:`distilbert_loss` -- DistilBERT's objective for a causal LM: KD + LM + a cosine loss between last
  hidden states (through a projection when the widths differ);
* :func:`tinybert_layer_map`, :func:`tinybert_loss` -- TinyBERT's uniform layer mapping ``g(m) = m * N / M``,
  hidden-state MSE through a learned projection and attention-map MSE.

The experiment (:func:`distill_run`) trains students of ``lab-draft``'s shape for the same steps on the same
batches as a from-scratch baseline, scores them (perplexity, entropy, pass keys, expected acceptance against the
teacher) and writes ``labsrc/data/distill_results.json``::

    python -m labsrc.distill experiment --steps 120 --sweep-steps 60 --save-dir /tmp/students
    python -m labsrc.distill drafts --students /tmp/students --prompts 8   # each as chapter 10's draft
    python -m labsrc.distill ship --method kd --steps 120 --T 2.0   # checkpoints/lab-draft-distilled

``ship`` writes over the shipped student only with ``--overwrite``; without it, beside it, in
``lab-draft-distilled-retrained-<n>``, as retraining a model does.

Those students start from nothing, the chapter's second experiment. Drafts are distilled in practice the way
DistillSpec does it: start from the trained draft and continue its training against the target. Here
(:func:`finetune_run`) lab-draft continues for the same steps, on the same batches, from the same seeds,
under each of :data:`FINETUNE_METHODS`: more of its own cross-entropy (the control), KD to lab-target, on-policy
GKD and the total variation that acceptance is one minus (:func:`tv_loss`). Each is measured against the
target (:func:`finetune_figures`: KL, TV and acceptance on held-out prose and on the probe tasks, tokens per
target call and wall clock as chapter 10's draft) and summarised across seeds with Student-t intervals::

    python -m labsrc.distill finetune-experiment --steps 300 --seeds 0 1 2     # resumable per (method, seed)
    python -m labsrc.distill ship-finetuned --method tv   # only if it beats lab-draft with separated intervals

Every run is deterministic from its seed, so the methods and the sweep may also run as separate processes
(``experiment(..., methods=...)``) and give the same figures.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from labsrc.models.stored_runs import models_stamp

__all__ = ["soft_kl", "kd_loss", "generalized_jsd", "expected_acceptance", "tv_loss", "token_mask",
           "cosine_hidden_loss", "distilbert_loss", "tinybert_layer_map", "tinybert_loss", "fit_unimodal",
           "STUDENT_CONFIG", "distill_run", "evaluate_student", "prose_windows", "window_figures",
           "FINETUNE_METHODS", "FinetuneConfig", "FinetuneEval", "finetune_run", "finetune_figures",
           "summarize_finetune", "finetune_table", "ship_decision", "finetune_experiment", "ship_finetuned"]

RESULTS = Path(__file__).resolve().parent / "data" / "distill_results.json"


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
    :func:`labsrc.kernels.distill.kd_kl` (same value, no probabilities materialised).
    """
    _check_logits(student_logits, teacher_logits, labels, ignore_index)
    _check_temperature(T)
    _check_unit("alpha", alpha)
    mask = token_mask(labels, student_logits.shape[:-1], ignore_index, student_logits.device)
    if fused:
        from labsrc.kernels.distill import kd_kl
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


# ------------------------------------------------------------------------------------------- experiment
def _train_module():
    from labsrc.models import train as tr
    return tr


def student_config(steps: int = 400):
    """``lab-draft``'s architecture and data recipe with ``steps`` steps (the curriculum scaled to them)."""
    tr = _train_module()
    base = tr.CONFIGS["lab-draft"]
    short = max(1, steps // 4)
    return replace(base, max_steps=steps, short_steps=short, grow_steps=short, warmup_steps=min(100, steps // 10),
                   eval_every=0, threads=1, time_budget_s=20 * 60)


STUDENT_CONFIG = "lab-draft"  # students have lab-draft's shape: 4 layers, width 128, tied embeddings

METHODS = ("scratch", "kd", "gkd", "distilbert")


def _hidden_dims(model):
    return model.config.hidden_size


def distill_run(method: str, steps: int = 400, T: float = 2.0, alpha: float = 0.5, teacher=None, tokenizer=None,
                seed: int = 0, log_path: Path | None = None, on_policy_frac: float = 0.5, beta: float = 0.5,
                gen_prompt: int = 64, gen_new: int = 64, verbose: bool = False, steps_cap_s: float | None = None,
                progress: bool = False):
    """Train a student of ``lab-draft``'s shape for ``steps`` steps; return ``(student, log, info)``.

    ``method``: ``"scratch"`` (the training objective of :mod:`labsrc.models.train`, no teacher), ``"kd"``
    (:func:`kd_loss` on the same batches, labels = next tokens, weight ``alpha`` on them), ``"gkd"``
    (on-policy: with probability ``on_policy_frac`` the batch is the student's own continuations of
    ``gen_prompt``-token prefixes, sampled at temperature 1 and scored by the teacher with
    :func:`generalized_jsd` on the generated tokens; otherwise the data batch with the same divergence) and
    ``"distilbert"`` (:func:`distilbert_loss` with a learned projection 128 -> 320). Every method sees the
    same data batches (one seeded stream) and the answer-token weighting of the lab's training objective
    is kept for the hard term. Deterministic from ``seed``. ``progress`` shows a bar over the steps (the
    command line's runs; the chapter's short live run stays quiet).
    """
    from tqdm.auto import tqdm

    from transformers import LlamaForCausalLM

    from labsrc.data import load_tokenizer
    from labsrc.models import load

    tr = _train_module()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cfg = replace(student_config(steps), seed=seed)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = tokenizer or load_tokenizer()
    if teacher is None and method != "scratch":
        teacher, _ = load("lab-target")
    rng = random.Random(seed)
    student = LlamaForCausalLM(tr.model_config(cfg, tokenizer))
    student.train()
    proj = torch.nn.Linear(student.config.hidden_size, teacher.config.hidden_size, bias=False) \
        if method == "distilbert" else None
    params = list(student.parameters()) + (list(proj.parameters()) if proj is not None else [])
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen_rng = torch.Generator().manual_seed(seed + 1)
    log, t0, tokens = [], time.time(), 0
    fh = open(log_path, "w", newline="") if log_path else None
    writer = None
    bar = tqdm(total=cfg.max_steps, desc=f"distilling ({method}, T={T})", unit="step", disable=not progress)
    for step in range(cfg.max_steps):
        if steps_cap_s is not None and time.time() - t0 > steps_cap_s:
            break
        for g in opt.param_groups:
            g["lr"] = tr._lr(cfg, step)
        ids, answers = tr.make_batch(cfg, tokenizer, rng, step)
        on_policy = method == "gkd" and torch.rand((), generator=gen_rng).item() < on_policy_frac
        if on_policy:
            ids, answers = _on_policy_batch(student, ids, gen_prompt, gen_new, gen_rng)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            out = student(input_ids=ids, output_hidden_states=method == "distilbert")
            t_out = None
            if method != "scratch":
                with torch.no_grad():
                    t_out = teacher(input_ids=ids, output_hidden_states=method == "distilbert")
        logits = out.logits[:, :-1].float()
        hard, nll, answer = tr.training_loss(out.logits, ids, answers, cfg.answer_weight)
        labels = ids[:, 1:]
        if method == "scratch":
            loss = hard
        elif method == "kd":
            soft = kd_loss(logits, t_out.logits[:, :-1].float(), T=T)
            loss = alpha * hard + (1 - alpha) * soft
        elif method == "gkd":
            lab = labels.clone()
            if on_policy:
                lab[:, :gen_prompt - 1] = -100  # score the student's own tokens only
            loss = generalized_jsd(logits, t_out.logits[:, :-1].float(), beta=beta, T=1.0, labels=lab)
        else:
            w_kd, w_lm, w_cos = DISTILBERT_WEIGHTS
            soft = kd_loss(logits, t_out.logits[:, :-1].float(), T=T)
            cos = cosine_hidden_loss(out.hidden_states[-1], t_out.hidden_states[-1], proj)
            loss = (w_kd * soft + w_lm * hard + w_cos * cos) / (w_kd + w_lm)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        tokens += ids.numel()
        row = {"step": step + 1, "loss": float(loss.detach()), "text_loss": float(nll[~answer].mean().detach()),
               "on_policy": int(on_policy), "lr": tr._lr(cfg, step), "tokens": tokens,
               "elapsed_s": round(time.time() - t0, 2)}
        log.append(row)
        if fh:
            if writer is None:
                writer = csv.DictWriter(fh, fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)
            fh.flush()
        bar.set_postfix(loss=f"{row['loss']:.3f}")
        bar.update()
        if verbose and (step + 1) % 50 == 0:
            bar.write(f"{method} T={T} step {step + 1}: loss {row['loss']:.3f} ({row['elapsed_s']:.0f} s)")
    bar.close()
    if fh:
        fh.close()
    student.eval()
    info = {"method": method, "steps": len(log), "tokens": tokens, "T": T, "alpha": alpha, "seed": seed,
            "train_minutes": round((time.time() - t0) / 60, 2), "train_config": asdict(cfg)}
    if method == "gkd":
        info.update(beta=beta, on_policy_frac=on_policy_frac, gen_prompt=gen_prompt, gen_new=gen_new)
    return student, log, info


@torch.no_grad()
def _on_policy_batch(student, ids, gen_prompt, gen_new, gen):
    """The student's own continuations: ``gen_new`` tokens sampled (temperature 1) after the first
    ``gen_prompt`` tokens of each row (a quarter of the rows at most, so the step costs about as much)."""
    was_training = student.training
    student.eval()
    rows = ids[: max(1, ids.shape[0] // 4), :gen_prompt]
    seq = rows
    for _ in range(gen_new):  # no KV cache: a 1.3M-parameter model on 128 tokens, cheap enough
        probs = F.softmax(student(input_ids=seq, use_cache=False).logits[:, -1].float(), dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
    student.train(was_training)
    return seq, torch.zeros_like(seq, dtype=torch.bool)


def prose_windows(tokenizer, n_windows: int, window_len: int, offset: int = 0) -> list[torch.Tensor]:
    """``n_windows`` consecutive held-out windows of the validation prose, each the BOS token then
    ``window_len - 1`` tokens, from token ``offset`` on: the text every draft here is scored on (no model of the
    lab trains on the validation split)."""
    from labsrc import tasks

    for name, v in (("n_windows", n_windows), ("window_len", window_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "n_windows" else 2):
            raise ValueError(f"{name} must be an int >= {1 if name == 'n_windows' else 2}, got {v!r}")
    ids = tasks.corpus_ids(tokenizer, "validation")
    span = window_len - 1
    if offset + n_windows * span > len(ids):
        raise ValueError(f"{n_windows} windows of {window_len} tokens from offset {offset} need "
                         f"{offset + n_windows * span} validation tokens; the split holds {len(ids)}")
    bos = torch.tensor([tokenizer.bos_token_id])
    return [torch.cat([bos, ids[offset + w * span:offset + (w + 1) * span]]) for w in range(n_windows)]


@torch.no_grad()
def window_figures(student, teacher, x: torch.Tensor) -> dict:
    """The student against the teacher on one window ``x`` ``(T,)``, per token predicted (``T - 1`` of them,
    at temperature 1): mean NLL of the text, mean predictive entropy (nats), mean ``KL(teacher || student)``,
    mean ``TV`` and mean expected acceptance ``alpha = 1 - TV`` (speculative sampling's acceptance rate of a
    drafted token at that position, :func:`expected_acceptance`)."""
    x = x.reshape(1, -1)
    s = student(input_ids=x).logits[0, :-1].float()
    t = teacher(input_ids=x).logits[0, :-1].float()
    y = x[0, 1:]
    logp = F.log_softmax(s, -1)
    alpha = float(expected_acceptance(s, t))
    return {"tokens": len(y), "nll": float(F.cross_entropy(s, y)),
            "entropy": float(-(logp.exp() * logp).sum(-1).mean()), "kl": float(soft_kl(s, t, 1.0).mean()),
            "tv": 1.0 - alpha, "alpha": alpha}


@torch.no_grad()
def evaluate_student(student, teacher, tokenizer, n_windows: int = 16, context_len: int = 256,
                     passkey_n: int = 10, seed: int = 0) -> dict:
    """Validation perplexity, mean predictive entropy (nats), expected acceptance against the teacher and
    KL(teacher || student) on ``n_windows`` validation windows, plus the pass-key accuracy at
    ``context_len`` tokens (depths 0.25/0.5/0.75, ``passkey_n`` each)."""
    from labsrc import tasks

    torch.set_num_threads(1)
    nll = ent = acc = kl = 0.0
    count = 0
    for x in prose_windows(tokenizer, n_windows, context_len):
        w = window_figures(student, teacher, x)
        nll += w["nll"] * w["tokens"]
        ent += w["entropy"] * w["tokens"]
        acc += w["alpha"] * w["tokens"]
        kl += w["kl"] * w["tokens"]
        count += w["tokens"]
    depths = [0.25, 0.5, 0.75]
    pk = tasks.passkey_accuracy(student, tokenizer, context_len, depths, n=passkey_n, seed=seed) \
        if passkey_n else None  # passkey_n=0: no probe (a quick look at the distributions only)
    return {"perplexity": math.exp(nll / count), "entropy": ent / count, "expected_acceptance": acc / count,
            "kl_teacher_student": kl / count, "tokens": count, "passkey": pk,
            "passkey_n": passkey_n * len(depths), "context_len": context_len}


@torch.no_grad()
def draft_figures(draft, target, tokenizer, n_prompts: int = 4, prompt_len: int = 64, new_tokens: int = 32,
                  k: int = 4, seed: int = 0, plain: bool = False) -> dict:
    """``draft`` as chapter 10's draft for ``target``: :func:`labsrc.speculative.speculative_generate`
    (sampling at temperature 1, window ``k``) on ``n_prompts`` validation prefixes of ``prompt_len`` tokens.

    Returns the measured acceptance (accepted / drafted, with its count: drafts after a rejection count as
    not accepted), new tokens per target call, the draft-to-target cost ratio ``c`` per call measured in the
    run, and the speedup these predict, Leviathan et al.'s ``E[tokens per call] / (k c + 1)`` with the
    measured tokens per call (:func:`labsrc.speculative.speedup` with the per-token acceptance those tokens
    imply). Wall-clock speedups on a shared CPU are noise; the tokens per target call are not.

    ``plain=True`` also times the target decoding alone (:func:`labsrc.speculative.plain_decode`, one token
    per forward) on each prompt right after its speculative run, so that both see the same machine load, and
    adds the wall clock of both (decoding only, the prompt's prefill left out of each) and their ratio,
    ``wall_speedup`` (above 1: the draft made decoding faster).
    """
    from labsrc import speculative, tasks

    torch.set_num_threads(1)
    ids = tasks.corpus_ids(tokenizer, "validation")
    gen = torch.Generator().manual_seed(seed)
    stats = speculative.SpecStats()
    start = len(ids) // 2  # past the windows evaluate_student scores
    plain_s = 0.0
    for i in range(n_prompts):
        prompt = torch.cat([torch.tensor([tokenizer.bos_token_id]),
                            ids[start + i * prompt_len:start + (i + 1) * prompt_len - 1]])
        speculative.speculative_generate(target, draft, prompt, new_tokens, k=k, do_sample=True, generator=gen,
                                         stats=stats, stop_at_eos=False)
        if plain:
            plain_s += sum(speculative.plain_decode(target, prompt, new_tokens)[1])
    alpha = stats.acceptance
    draft_s = sum(st.draft_seconds for st in stats.steps) / max(1, stats.draft_calls)
    target_s = sum(st.target_seconds for st in stats.steps) / max(1, stats.target_calls)
    c = draft_s / target_s if target_s else float("nan")
    out = {"alpha": alpha, "accepted": stats.accepted, "drafted": stats.drafted,
           "tokens_per_call": stats.tokens_per_call, "c": c, "k": k,
           "predicted_speedup": stats.tokens_per_call / (k * c + 1),
           "new_tokens": stats.new_tokens}
    if plain:
        spec_s = stats.wall_seconds - stats.prefill_seconds
        out.update(spec_seconds=spec_s, plain_seconds=plain_s, wall_speedup=plain_s / spec_s)
    return out


def add_draft_figures(students: Path, out: Path = RESULTS, **kw) -> dict:
    """Load each method's saved student from ``students/<method>`` and add its :func:`draft_figures` to the
    results in ``out`` (and lab-draft's, the reference draft trained for 1,500 steps)."""
    from labsrc.data import load_tokenizer
    from labsrc.models import load

    results = json.loads(Path(out).read_text())
    tokenizer = load_tokenizer()
    target, _ = load("lab-target")
    from transformers import AutoModelForCausalLM

    for m in results["methods"]:  # weights only (experiment's save_dir): no tokenizer beside them
        draft = AutoModelForCausalLM.from_pretrained(Path(students) / m, dtype=torch.float32).eval()
        results["methods"][m]["draft"] = draft_figures(draft, target, tokenizer, **kw)
        Path(out).write_text(json.dumps(results, indent=1))
    draft, _ = load("lab-draft")
    results["lab_draft"] = {**evaluate_student(draft, target, tokenizer),
                            "draft": draft_figures(draft, target, tokenizer, **kw)}
    Path(out).write_text(json.dumps(results, indent=1))
    return results


def experiment(steps: int, sweep_steps: int, temps=(1.0, 2.0, 4.0, 8.0), out: Path = RESULTS,
               methods=METHODS, verbose: bool = True, save_dir: Path | None = None) -> dict:
    """Train every method for ``steps`` steps and the KD temperature sweep for ``sweep_steps``, score each
    student, write ``out`` (JSON) and return it; with ``save_dir``, save each method's student there
    (``save_dir/<method>``, as :func:`ship` would) so the best one can be shipped without retraining."""
    from labsrc.data import load_tokenizer
    from labsrc.models import load

    tokenizer = load_tokenizer()
    teacher, _ = load("lab-target")
    results = {"steps": steps, "sweep_steps": sweep_steps, "models": models_stamp("lab-target", "lab-draft"),
               "methods": {}, "sweep": {},
               "teacher": evaluate_student(teacher, teacher, tokenizer)}
    t_all = time.time()
    for m in methods:
        student, log, info = distill_run(m, steps, teacher=teacher, tokenizer=tokenizer, verbose=verbose,
                                         progress=verbose)
        info["final_loss"] = log[-1]["loss"]
        results["methods"][m] = {**info, **evaluate_student(student, teacher, tokenizer)}
        results["methods"][m].pop("train_config")
        if save_dir is not None:  # weights only: the eval card is measured for the shipped student
            student.save_pretrained(Path(save_dir) / m)
        out.write_text(json.dumps(results, indent=1))
    for T in temps:
        student, log, info = distill_run("kd", sweep_steps, T=T, teacher=teacher, tokenizer=tokenizer,
                                         verbose=verbose, progress=verbose)
        res = {**info, **evaluate_student(student, teacher, tokenizer)}
        res.pop("train_config")
        results["sweep"][str(T)] = res
        out.write_text(json.dumps(results, indent=1))
    results["total_minutes"] = round((time.time() - t_all) / 60, 2)
    out.write_text(json.dumps(results, indent=1))
    return results


def ship(method: str, steps: int, T: float = 2.0, out: Path | None = None, overwrite: bool = False) -> dict:
    """Train ``method`` for ``steps`` steps and write the checkpoint (fp16), tokenizer, ``train_log.csv`` and
    ``eval_card.json`` (the lab's eval card plus the distillation figures) to ``out`` (by default
    ``checkpoints/lab-draft-distilled``).

    As in training (:func:`labsrc.models.train.fresh_folder`), a folder that already holds a checkpoint is not
    written over unless ``overwrite``: the run goes to the first free ``<out>-retrained-<n>`` beside it, since
    chapters 10 and 13 read their numbers from the shipped student. The folder is chosen before training."""
    from labsrc.data import load_tokenizer
    from labsrc.models import CHECKPOINTS, load

    out = Path(out or CHECKPOINTS / "lab-draft-distilled")
    if not overwrite:
        out = _train_module().fresh_folder(out)
    print(f"writing the distilled student to {out}", flush=True)
    tokenizer = load_tokenizer()
    teacher, _ = load("lab-target")
    student, log, info = distill_run(method, steps, T=T, teacher=teacher, tokenizer=tokenizer, verbose=True,
                                     progress=True)
    return save_student(student, log, info, out, teacher, tokenizer)


def save_student(student, log, info, out: Path, teacher, tokenizer, command: str | None = None,
                 models=("lab-target",), trained_context: int | None = None) -> dict:
    """Write a trained student as a lab checkpoint: fp16 weights, tokenizer, ``train_log.csv`` and
    ``eval_card.json`` (the lab's eval card, measured on the saved weights, plus the distillation figures).

    ``command`` is the one that made it (by default :func:`ship`'s), ``models`` the shipped checkpoints it was
    made from (their digests go on the card) and ``trained_context`` the longest rows it has trained on (by
    default its run's ``seq_len``; a fine-tuned lab-draft keeps lab-draft's)."""
    from labsrc.data import TOKENIZER_PATH
    from labsrc.models import load

    tr = _train_module()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(log[0]))
        writer.writeheader()
        writer.writerows(log)
    method, steps, T = info["method"], info["steps"], info.get("T")
    student.to(torch.float16).save_pretrained(out)
    shutil.copy(TOKENIZER_PATH, out / "tokenizer.json")
    tokenizer.save_pretrained(out)
    t0 = time.time()
    model, _ = load(str(out))
    if command is None:
        command = f"python -m labsrc.distill ship --method {method} --steps {steps} --T {T}"
    card = {"name": "lab-draft-distilled", "teacher": "lab-target", "models": models_stamp(*models),
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained_context": trained_context or info["train_config"]["seq_len"],
            **info, "final_train_loss": log[-1]["loss"], "command": command}
    card.update(tr.evaluate(model, tokenizer, n=10))
    card["distillation"] = evaluate_student(model, teacher, tokenizer)
    card["eval_minutes"] = round((time.time() - t0) / 60, 2)
    (out / "eval_card.json").write_text(json.dumps(card, indent=1))
    return card


# ------------------------------------------------------------------------------ fine-tuning lab-draft
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


# GKD's beta for the on-policy method: the symmetric generalized JSD. Acceptance depends on TV, which counts the
# draft's excess mass (it proposes what the target rejects) and its missing mass (it rarely proposes what the
# target would accept) alike. Forward KL (beta = 0) barely charges the first, reverse KL (beta = 1) the second;
# beta = 0.5 charges both, like TV, and is sandwiched by it: TV²/2 <= JSD_0.5 <= TV ln 2 (Pinsker on each half,
# and Lin 1991), where either KL can be unbounded while TV is small. tests/test_distill.py checks the sandwich.
GKD_BETA = 0.5


@dataclass(frozen=True)
class FinetuneMethod:
    """One way of continuing lab-draft's training: a loss and the rows it is computed on (``"corpus"``: the
    data batches; ``"policy"``: the same rows with their last ``policy_frac`` sampled by the draft itself)."""

    loss: str
    data: str
    about: str


FINETUNE_METHODS = {
    "ce": FinetuneMethod("ce", "corpus", "more of lab-draft's own training: next-token cross-entropy on the "
                                        "data (answer tokens weighted as in labsrc.models.train), the control"),
    "kd": FinetuneMethod("fkl", "corpus", "KD to lab-target: KL(target || draft) at T = 1 on the data"),
    "gkd": FinetuneMethod("jsd", "policy", "on-policy GKD: generalized JSD (beta = GKD_BETA) on rows whose "
                                           "second half the draft sampled itself, scored by lab-target"),
    "tv": FinetuneMethod("tv", "corpus", "TV to lab-target on the data: 1 - expected acceptance (tv_loss)"),
    "tv-policy": FinetuneMethod("tv", "policy", "the TV loss on the on-policy rows of gkd"),
}
FINETUNE_DEFAULT = ("ce", "kd", "gkd", "tv")   # the four; tv-policy separates loss from data if wanted
FINETUNE_RESULTS = Path(__file__).resolve().parent / "data" / "results" / "distill_finetune.json"


@dataclass(frozen=True)
class FinetuneConfig:
    """What every fine-tuning run shares (the method and the seed aside).

    The data are lab-draft's own mixture (:func:`labsrc.models.train.make_batch` with lab-draft's config at
    its steady state: prose rows and the synthetic retrieval samples) in rows of ``seq_len`` tokens,
    ``batch_size`` rows a step; ``p_corpus`` overrides the share of prose rows. The learning rate warms up over
    ``warmup_steps`` to ``lr``, lab-draft's final learning rate (its schedule ends at 0.1 x 3e-3): the run
    continues where lab-draft's stopped instead of shaking it with a fresh peak; then a cosine to
    ``min_lr_ratio * lr``. AdamW, weight decay and clipping as lab-draft's. ``policy_frac`` of each on-policy
    row is sampled by the draft (temperature 1) after the data prefix; every position of the row is scored, so
    the on-policy methods score as many tokens a step as the others.
    """

    steps: int = 300
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    p_corpus: float | None = None
    policy_frac: float = 0.5
    beta: float = GKD_BETA
    bf16_autocast: bool = True

    def __post_init__(self):
        for name in ("steps", "warmup_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        for name in ("seq_len", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (8 if name == "seq_len" else 1):
                raise ValueError(f"{name} must be an int >= {8 if name == 'seq_len' else 1}, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        _check_unit("min_lr_ratio", self.min_lr_ratio)
        _check_unit("beta", self.beta)
        if self.p_corpus is not None:
            _check_unit("p_corpus", self.p_corpus)
        if isinstance(self.policy_frac, bool) or not isinstance(self.policy_frac, (int, float)) \
                or not 0 < self.policy_frac < 1:
            raise ValueError(f"policy_frac must lie strictly between 0 and 1, got {self.policy_frac!r}")

    def data_config(self, seed: int):
        """lab-draft's training config with these rows: what :func:`labsrc.models.train.make_batch` draws."""
        tr = _train_module()
        extra = {} if self.p_corpus is None else {"p_corpus": self.p_corpus}
        return replace(tr.CONFIGS["lab-draft"], seq_len=self.seq_len, batch_size=self.batch_size, seed=seed,
                       **extra)

    def lr_at(self, step: int) -> float:
        return _train_module().warmup_cosine(step, self.lr, self.warmup_steps, self.steps, self.min_lr_ratio)


def batch_digest(ids: torch.Tensor) -> str:
    """First 12 hex digits of a SHA-256 over a batch's token ids: the log's record of which data a step saw."""
    import hashlib

    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


@torch.no_grad()
def sample_continuations(model, prefix: torch.Tensor, n_new: int, generator: torch.Generator) -> torch.Tensor:
    """``prefix`` ``(B, P)`` followed by ``n_new`` tokens the model samples (temperature 1, a KV cache, the
    random draws from ``generator`` only): ``(B, P + n_new)``. The model's train/eval mode is restored."""
    from labsrc.speculative import _new_cache

    was_training = model.training
    model.eval()
    cache = _new_cache(model)
    logits = model(input_ids=prefix, cache=cache, use_cache=True).logits[:, -1]
    out = [prefix]
    for i in range(n_new):
        nxt = torch.multinomial(F.softmax(logits.float(), dim=-1), 1, generator=generator)
        out.append(nxt)
        if i + 1 < n_new:
            logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    model.train(was_training)
    return torch.cat(out, dim=1)


def finetune_run(method: str, cfg: FinetuneConfig = FinetuneConfig(), seed: int = 0, teacher=None, draft=None,
                 tokenizer=None, threads: int = 1, progress: bool = False):
    """Continue lab-draft's training for ``cfg.steps`` steps under ``method`` (a key of
    :data:`FINETUNE_METHODS`); return ``(draft, log, info)``.

    The run starts from the shipped lab-draft's weights (``draft``, if given, is copied, never changed) and is
    deterministic from ``seed``: the data batches come from ``random.Random(seed)`` alone, so every method sees
    the same rows in the same order (the log's ``batch`` digests show it), and the on-policy samples from a
    ``torch.Generator`` seeded with ``seed + 1`` that the data never touch. The teacher (lab-target, loaded
    if not given) scores every token of the row at temperature 1 for the distillation methods:

    * ``ce``: lab-draft's own objective (:func:`labsrc.models.train.training_loss`) on the data: the control,
      what the same steps of ordinary training give;
    * ``kd``: ``KL(target || draft)`` (:func:`kd_loss` without labels at ``T = 1``) on the data;
    * ``gkd``: :func:`generalized_jsd` with ``cfg.beta`` on on-policy rows: the first ``1 - policy_frac`` of
      each data row, then the draft's own sample (GKD's student-generated data, which DistillSpec found to
      align a draft best: it is trained where it drafts);
    * ``tv`` (and ``tv-policy``): :func:`tv_loss`, one minus the expected acceptance, on the data (on the
      on-policy rows).
    """
    import copy

    from tqdm.auto import tqdm

    from labsrc.data import load_tokenizer
    from labsrc.models import load

    if method not in FINETUNE_METHODS:
        raise ValueError(f"method must be one of {sorted(FINETUNE_METHODS)}, got {method!r}")
    if not isinstance(cfg, FinetuneConfig):
        raise TypeError(f"cfg must be a FinetuneConfig, got {type(cfg).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    recipe = FINETUNE_METHODS[method]
    tr = _train_module()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = tokenizer or load_tokenizer()
    if draft is None:
        draft, _ = load("lab-draft")
    student = copy.deepcopy(draft).float()
    if teacher is None and recipe.loss != "ce":
        teacher, _ = load("lab-target")
    data_cfg = cfg.data_config(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    params = list(student.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    keep = cfg.seq_len - round(cfg.policy_frac * cfg.seq_len)  # data tokens before the draft's own sample
    student.train()
    log, tokens, t0 = [], 0, time.time()
    bar = tqdm(total=cfg.steps, desc=f"fine-tuning lab-draft ({method}, seed {seed})", unit="step",
               disable=not progress)
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        ids, answers = tr.make_batch(data_cfg, tokenizer, rng, None)
        digest = batch_digest(ids)
        rows = ids
        if recipe.data == "policy":
            rows = sample_continuations(student, ids[:, :keep], cfg.seq_len - keep, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = student(input_ids=rows).logits
            if recipe.loss != "ce":
                with torch.no_grad():
                    t_logits = teacher(input_ids=rows).logits[:, :-1].float()
        s_logits = logits[:, :-1].float()
        if recipe.loss == "ce":
            loss = tr.training_loss(logits, ids, answers, data_cfg.answer_weight)[0]
        elif recipe.loss == "fkl":
            loss = kd_loss(s_logits, t_logits, T=1.0)
        elif recipe.loss == "jsd":
            loss = generalized_jsd(s_logits, t_logits, beta=cfg.beta)
        else:
            loss = tv_loss(s_logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        tokens += rows[:, 1:].numel()
        log.append({"step": step + 1, "loss": float(loss.detach()), "lr": cfg.lr_at(step), "tokens": tokens,
                    "batch": digest, "elapsed_s": round(time.time() - t0, 2)})
        bar.set_postfix(loss=f"{log[-1]['loss']:.4f}")
        bar.update()
    bar.close()
    student.eval()
    info = {"method": method, "loss": recipe.loss, "data": recipe.data, "seed": seed, "steps": len(log),
            "tokens": tokens, "train_seconds": round(time.time() - t0, 2),
            "train_minutes": round((time.time() - t0) / 60, 2), "threads": threads, "start": "lab-draft",
            "train_config": asdict(cfg)}
    return student, log, info


@dataclass(frozen=True)
class FinetuneEval:
    """What each fine-tuned draft (and lab-draft) is measured on; the same for every method and seed.

    ``windows`` held-out prose windows of ``window_len`` tokens (:func:`prose_windows`): KL, TV and the
    expected acceptance ``alpha`` per token against lab-target. ``probe_n`` samples of each probe task in
    ``probe_tasks`` at ``probe_len`` tokens (the eval card's settings, :func:`labsrc.models.train.probe_set`;
    the probes seed their own generators, so they are the same samples every time): ``alpha`` teacher-forced
    along the sample (:func:`labsrc.speculative.alpha_along`) over all its tokens and over the answer tokens.
    ``prompts`` prose prompts of ``prompt_len`` tokens run as chapter 10's draft (:func:`draft_figures`, window
    ``k``, ``new_tokens`` each, sampling seed ``sample_seed``, the target alone timed beside it): measured
    acceptance, tokens per target call and the wall clock.
    """

    windows: int = 32
    window_len: int = 256
    probe_tasks: tuple = ("passkey", "needle", "mqar", "variable_tracking")
    probe_n: int = 8
    probe_len: int = 256
    prompts: int = 4
    prompt_len: int = 64
    new_tokens: int = 32
    k: int = 4
    sample_seed: int = 0


@torch.no_grad()
def probe_alpha(draft, target, tokenizer, tasks_=("passkey", "needle", "mqar", "variable_tracking"),
                context_len: int = 256, n: int = 8) -> dict:
    """Teacher-forced acceptance on the probe tasks: for each task, per sample, the mean of ``1 - TV`` over
    the tokens the sample predicts (``all``) and over its answer tokens (``answer``), where the draft must
    read its context to agree with the target."""
    from labsrc import speculative

    tr = _train_module()
    out = {}
    for task in tasks_:
        per_all, per_answer = [], []
        for s in tr.probe_set(tokenizer, task, context_len, n):
            a = speculative.alpha_along(target, draft, torch.tensor(s.ids))
            per_all.append(float(a[:-1].mean()))  # position t scores the token t + 1; the last predicts none
            at = [t - 1 for lo, hi in s.spans for t in range(lo, hi)]
            per_answer.append(float(a[at].mean()))
        out[task] = {"all": per_all, "answer": per_answer}
    return out


def finetune_figures(draft, target, tokenizer, ev: FinetuneEval = FinetuneEval()) -> dict:
    """Every figure of :class:`FinetuneEval` for one draft: per-window and per-sample lists (the intervals
    are drawn from them) and their means."""
    t0 = time.time()
    win = [window_figures(draft, target, x) for x in prose_windows(tokenizer, ev.windows, ev.window_len)]
    probes = probe_alpha(draft, target, tokenizer, ev.probe_tasks, ev.probe_len, ev.probe_n)
    spec = draft_figures(draft, target, tokenizer, n_prompts=ev.prompts, prompt_len=ev.prompt_len,
                         new_tokens=ev.new_tokens, k=ev.k, seed=ev.sample_seed, plain=True)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {"kl": mean([w["kl"] for w in win]), "tv": mean([w["tv"] for w in win]),
           "alpha_prose": mean([w["alpha"] for w in win]), "nll": mean([w["nll"] for w in win]),
           "alpha_probe": mean([mean(p["all"]) for p in probes.values()]),
           "alpha_probe_answer": mean([mean(p["answer"]) for p in probes.values()]),
           **{f"alpha_{task}": mean(p["all"]) for task, p in probes.items()},
           "alpha_sampled": spec["alpha"], "tokens_per_call": spec["tokens_per_call"], "c": spec["c"],
           "wall_speedup": spec["wall_speedup"],
           "per_window": {key: [w[key] for w in win] for key in ("kl", "tv", "alpha")},
           "probes": probes, "draft": spec}
    out["eval_seconds"] = round(time.time() - t0, 2)
    return out


# The figures summarised across seeds, in the order of the table; the first is the one a ship decision reads.
SUMMARY_KEYS = ("alpha_prose", "kl", "tv", "alpha_probe", "alpha_probe_answer", "alpha_sampled",
                "tokens_per_call", "wall_speedup", "nll")


_ESTIMATE_FIELDS = ("value", "lo", "hi", "n", "method")


def _estimate_dict(est) -> dict:
    return {name: getattr(est, name) for name in _ESTIMATE_FIELDS}


def summary_estimate(summary: dict, draft: str, key: str):
    """One figure of :func:`summarize_finetune`'s table as a :class:`labsrc.claims.Estimate` (it needs an
    interval: a figure of one seed, or one measured once, has none and is refused by ``Estimate``)."""
    from labsrc.claims import Estimate

    return Estimate(**{name: summary[draft][key][name] for name in _ESTIMATE_FIELDS})


def summarize_finetune(results: dict) -> dict:
    """Each method's mean over its seeds of every figure in :data:`SUMMARY_KEYS` and of the training seconds,
    with a Student-t 95% interval (:meth:`labsrc.claims.Estimate.mean`, ``n`` = seeds; a figure of one seed
    has no interval: ``lo`` and ``hi`` are None); and lab-draft's, whose only sampling error is the held-out
    sample: its per-window figures (prose) and per-sample figures (probes) with a Student-t interval over
    them, its other figures as measured once."""
    from labsrc.claims import Estimate

    by_method: dict = {}
    for row in results["rows"]:
        by_method.setdefault(row["method"], []).append(row)
    summary = {}
    for method, rows in by_method.items():
        s = {}
        for key in (*SUMMARY_KEYS, "train_seconds"):
            xs = [r["train"]["train_seconds"] if key == "train_seconds" else r["eval"][key] for r in rows]
            s[key] = (_estimate_dict(Estimate.mean(xs)) if len(xs) >= 2 else
                      {"value": xs[0], "lo": None, "hi": None, "n": 1, "method": "one seed"})
        summary[method] = s
    ref = results.get("lab_draft")
    if ref:
        s = {}
        for key in SUMMARY_KEYS:
            if key in ("alpha_prose", "kl", "tv"):
                per = ref["per_window"]["alpha" if key == "alpha_prose" else key]
                s[key] = _estimate_dict(Estimate.mean(per))
            elif key in ("alpha_probe", "alpha_probe_answer"):
                part = "all" if key == "alpha_probe" else "answer"
                # one value per probe sample (the tasks' samples pooled): the spread the held-out draw gives
                per = [x for p in ref["probes"].values() for x in p[part]]
                s[key] = _estimate_dict(Estimate.mean(per))
            else:
                s[key] = {"value": ref[key], "lo": None, "hi": None, "n": 1, "method": "measured once"}
        summary["lab-draft"] = s
    return summary


_TABLE = (("alpha_prose", "α prose", 3), ("kl", "KL(t‖d)", 3), ("alpha_probe", "α probes", 3),
          ("alpha_probe_answer", "α answers", 3), ("tokens_per_call", "tokens / call", 2),
          ("wall_speedup", "wall speedup", 2))


def finetune_table(results: dict) -> str:
    """The experiment's table in Markdown: each method's mean over seeds with its 95% interval (lab-draft's
    over the held-out windows and probe samples), first row lab-draft; from the stored numbers, never typed."""
    summ = summarize_finetune(results)

    def cell(e, digits):
        if e["lo"] is None:
            return f"{e['value']:.{digits}f}"
        return f"{e['value']:.{digits}f} [{e['lo']:.{digits}f}, {e['hi']:.{digits}f}]"

    order = ["lab-draft"] + [m for m in summ if m != "lab-draft"]
    head = "| draft | seeds | " + " | ".join(label for _, label, _ in _TABLE) + " | training (min) |"
    lines = [head, "|" + "---|" * (len(_TABLE) + 3)]
    for m in order:
        if m not in summ:
            continue
        s = summ[m]
        seeds = "-" if m == "lab-draft" else str(s["alpha_prose"]["n"])
        train = "-" if m == "lab-draft" else f"{s['train_seconds']['value'] / 60:.1f}"
        lines.append(f"| {m} | {seeds} | " + " | ".join(cell(s[k], d) for k, _, d in _TABLE) + f" | {train} |")
    return "\n".join(lines)


def ship_decision(results: dict, method: str, metric: str = "alpha_prose", min_seeds: int = 3) -> tuple[bool, str]:
    """Whether ``method``'s fine-tuned drafts beat lab-draft on ``metric`` (higher is better) with intervals
    that separate: the Student-t 95% interval of its mean over at least ``min_seeds`` seeds lies wholly above
    lab-draft's 95% interval over the held-out windows (:func:`labsrc.claims.compare`). Returns ``(ship?,
    a sentence saying why)``."""
    from labsrc.claims import compare

    if metric not in ("alpha_prose", "alpha_probe", "alpha_probe_answer"):
        raise ValueError(f"metric must be an acceptance with an interval for lab-draft (alpha_prose, "
                         f"alpha_probe, alpha_probe_answer), got {metric!r}")
    rows = [r for r in results.get("rows", []) if r["method"] == method]
    if not rows:
        raise ValueError(f"the results hold no run of method {method!r}; they hold "
                         f"{sorted({r['method'] for r in results.get('rows', [])})}")
    if isinstance(min_seeds, bool) or not isinstance(min_seeds, int) or min_seeds < 2:
        raise ValueError(f"min_seeds must be an int >= 2 (an interval needs two seeds), got {min_seeds!r}")
    if len(rows) < min_seeds:
        return False, (f"{method} has {len(rows)} seed(s) in the results; an interval across seeds needs at "
                       f"least {min_seeds}: shipping nothing")
    if "lab_draft" not in results:
        raise ValueError("the results hold no measurement of lab-draft to compare with")
    summ = summarize_finetune(results)
    est = {m: summary_estimate(summ, m, metric) for m in (method, "lab-draft")}
    verdict = compare(est[method], est["lab-draft"])
    said = f"{metric}: {method} {est[method]} against lab-draft {est['lab-draft']}"
    if verdict > 0:
        return True, f"{said}: the intervals separate, {method} above"
    how = "below" if verdict < 0 else "overlapping"
    return False, f"{said}: {how}, so {method} does not beat lab-draft: shipping nothing"


def _finetune_header(cfg: FinetuneConfig, ev: FinetuneEval) -> dict:
    """What a resumed run must share with the file it resumes: the checkpoints, the training config and the
    evaluation (not the threads, a property of the session each row records)."""
    return {"kind": "lab-draft fine-tuned under each loss", "models": models_stamp("lab-target", "lab-draft"),
            "config": asdict(cfg), "eval": {**asdict(ev), "probe_tasks": list(ev.probe_tasks)}}


def finetune_experiment(methods=FINETUNE_DEFAULT, seeds=(0, 1, 2), cfg: FinetuneConfig = FinetuneConfig(),
                        ev: FinetuneEval = FinetuneEval(), out: Path = FINETUNE_RESULTS, command: str = "",
                        threads: int = 1, save_dir: Path | None = None, progress: bool = True,
                        echo=print) -> dict:
    """Fine-tune lab-draft under every method for every seed (:func:`finetune_run`), measure each
    (:func:`finetune_figures`) and lab-draft once, and write ``out`` (JSON) after each run, with the
    checkpoints' digests, the command, the per-(method, seed) rows with their training and evaluation
    seconds, and the summary across seeds (:func:`summarize_finetune`).

    Resumable: a file ``out`` from an interrupted run with the same checkpoints, config and evaluation keeps
    its rows, and only the missing ``(method, seed)`` pairs are run (each run is deterministic
    from its seed, so the rows are the ones an uninterrupted run would have written; only their timings
    differ). A file with other settings is refused, naming the settings that differ, rather than written over.
    """
    from labsrc import curves
    from labsrc.data import load_tokenizer
    from labsrc.models import load

    methods, seeds = list(methods), list(seeds)
    for m in methods:
        if m not in FINETUNE_METHODS:
            raise ValueError(f"methods must be among {sorted(FINETUNE_METHODS)}, got {m!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and not empty, got {seeds}")
    out = Path(out)
    header = _finetune_header(cfg, ev)
    results = {**header, "methods": methods, "seeds": seeds, "rows": [], "sessions": []}
    if out.exists():
        old = json.loads(out.read_text())
        differ = [k for k in header if old.get(k) != header[k]]
        if differ:
            raise ValueError(f"{out} holds a run with other {', '.join(differ)}: give another --out, or move it "
                             f"away to start again")
        results.update(rows=old.get("rows", []), sessions=old.get("sessions", []),
                       methods=list(dict.fromkeys([*old.get("methods", []), *methods])),
                       seeds=list(dict.fromkeys([*old.get("seeds", []), *seeds])))
        if "lab_draft" in old:
            results["lab_draft"] = old["lab_draft"]
        echo(f"resuming {out}: {len(results['rows'])} run(s) already done")
    session = {"command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": 0.0}
    results["sessions"].append(session)
    results["command"] = command
    t_session = time.time()

    def save():
        session["seconds"] = round(time.time() - t_session, 1)
        results["summary"] = summarize_finetune(results)
        results["complete"] = all((m, s) in done() for m in results["methods"] for s in results["seeds"]) \
            and "lab_draft" in results
        curves.write(out, results)

    def done():
        return {(r["method"], r["seed"]) for r in results["rows"]}

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer()
    target, _ = load("lab-target")
    draft, _ = load("lab-draft")
    if "lab_draft" not in results:
        results["lab_draft"] = finetune_figures(draft, target, tokenizer, ev)
        echo(f"lab-draft: alpha {results['lab_draft']['alpha_prose']:.4f}, KL {results['lab_draft']['kl']:.4f}")
        save()
    for seed in seeds:
        for method in methods:
            if (method, seed) in done():
                continue
            student, log, info = finetune_run(method, cfg, seed, teacher=target, draft=draft,
                                              tokenizer=tokenizer, threads=threads, progress=progress)
            if save_dir is not None:
                student.save_pretrained(Path(save_dir) / f"{method}-seed{seed}")
            info.pop("train_config")
            figures = finetune_figures(student, target, tokenizer, ev)
            results["rows"].append({"method": method, "seed": seed, "train": info, "eval": figures,
                                    "losses": [round(r["loss"], 5) for r in log],
                                    "batches": [r["batch"] for r in log]})
            echo(f"{method} seed {seed}: alpha {figures['alpha_prose']:.4f}, KL {figures['kl']:.4f} "
                 f"({info['train_seconds']:.0f} s training, {figures['eval_seconds']:.0f} s measuring)")
            save()
    save()
    return results


def ship_finetuned(method: str, results_path: Path = FINETUNE_RESULTS, seed: int | None = None,
                   metric: str = "alpha_prose", out: Path | None = None, overwrite: bool = False,
                   echo=print) -> dict | None:
    """Ship ``method``'s fine-tuned lab-draft as ``lab-draft-distilled`` if, in the stored experiment
    ``results_path``, it beats lab-draft's acceptance with separated intervals (:func:`ship_decision`);
    otherwise say why and ship nothing (return None).

    The results must have been computed with the checkpoints that ship now. The draft is retrained (the
    experiment's config, ``seed``: by default its first seed; deterministic, so it is the draft the results
    measured) and written by :func:`save_student` with the training time, the time it was shipped and the
    command. As :func:`ship`, a folder that holds a checkpoint is not written over without ``overwrite``: the
    run goes to ``<out>-retrained-<n>`` beside it."""
    from labsrc.data import load_tokenizer
    from labsrc.models import CHECKPOINTS, load

    results_path = Path(results_path)
    if not results_path.is_file():
        raise FileNotFoundError(f"no results at {results_path}: run `python -m labsrc.distill "
                                f"finetune-experiment` first")
    results = json.loads(results_path.read_text())
    now = models_stamp("lab-target", "lab-draft")
    if results.get("models") != now:
        echo(f"{results_path} was computed with other checkpoints ({results.get('models')}; shipped now: {now}): "
             f"rerun the experiment; shipping nothing")
        return None
    ok, why = ship_decision(results, method, metric)
    echo(why)
    if not ok:
        return None
    seeds = sorted({r["seed"] for r in results["rows"] if r["method"] == method})
    seed = seeds[0] if seed is None else seed
    row = next((r for r in results["rows"] if r["method"] == method and r["seed"] == seed), None)
    if row is None:
        raise ValueError(f"seed must be one of the seeds the results ran for {method}, {seeds}; got {seed!r}")
    cfg = FinetuneConfig(**results["config"])
    folder = Path(out or CHECKPOINTS / "lab-draft-distilled")
    if not overwrite:
        folder = _train_module().fresh_folder(folder)
    echo(f"writing the fine-tuned draft ({method}, seed {seed}) to {folder}")
    tokenizer = load_tokenizer()
    teacher, _ = load("lab-target")
    draft, _ = load("lab-draft")
    student, log, info = finetune_run(method, cfg, seed, teacher=teacher, draft=draft, tokenizer=tokenizer,
                                      threads=row["train"].get("threads", 1), progress=True)
    # deterministic from the seed: the retrained draft's losses are the measured run's (threads alike)
    info.update(shipped_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), decision=why, metric=metric,
                results=str(results_path), same_losses_as_measured=row["losses"] == [round(r["loss"], 5)
                                                                                     for r in log])
    command = f"python -m labsrc.distill ship-finetuned --method {method} --seed {seed} --metric {metric}"
    card = save_student(student, log, info, folder, teacher, tokenizer, command=command,
                        models=("lab-target", "lab-draft"),
                        trained_context=int(getattr(draft.config, "lab_trained_context", cfg.seq_len)))
    # the experiment's figures, measured again on the saved (fp16) weights, beside lab-draft's stored ones
    ev = FinetuneEval(**{**results["eval"], "probe_tasks": tuple(results["eval"]["probe_tasks"])})
    shipped, _ = load(str(folder))
    card["finetune"] = {k: v for k, v in finetune_figures(shipped, teacher, tokenizer, ev).items()
                        if k in SUMMARY_KEYS}
    card["finetune_lab_draft"] = {k: results["lab_draft"][k] for k in SUMMARY_KEYS}
    (folder / "eval_card.json").write_text(json.dumps(card, indent=1))
    return card


def main(argv=None):
    parser = argparse.ArgumentParser(description="Distil lab-target into drafts of lab-draft's shape.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("experiment", help="train and score every method and the temperature sweep")
    e.add_argument("--steps", type=int, default=120)
    e.add_argument("--sweep-steps", type=int, default=60)
    e.add_argument("--methods", default=",".join(METHODS))
    e.add_argument("--out", type=Path, default=RESULTS)
    e.add_argument("--save-dir", type=Path, default=None, help="save each method's student here")
    d = sub.add_parser("drafts", help="add each saved student's acceptance and speedup as chapter 10's draft")
    d.add_argument("--students", type=Path, required=True)
    d.add_argument("--out", type=Path, default=RESULTS)
    d.add_argument("--prompts", type=int, default=8)
    s = sub.add_parser("ship", help="train one recipe into checkpoints/lab-draft-distilled")
    s.add_argument("--method", choices=METHODS[1:], default="kd")
    s.add_argument("--steps", type=int, default=120)
    s.add_argument("--T", type=float, default=2.0)
    s.add_argument("--out", type=Path, default=None,
                   help="default: checkpoints/lab-draft-distilled; if it already holds a checkpoint, the run writes "
                        "to <out>-retrained-<n> unless --overwrite is given")
    s.add_argument("--overwrite", action="store_true",
                   help="write into --out (or checkpoints/lab-draft-distilled) even if it holds a checkpoint")
    f = sub.add_parser("finetune-experiment",
                       help="continue lab-draft's training under each loss, for each seed, and measure each")
    f.add_argument("--steps", type=int, default=FinetuneConfig.steps)
    f.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (at least three)")
    f.add_argument("--methods", nargs="+", default=list(FINETUNE_DEFAULT), choices=sorted(FINETUNE_METHODS))
    f.add_argument("--seq-len", type=int, default=FinetuneConfig.seq_len)
    f.add_argument("--batch-size", type=int, default=FinetuneConfig.batch_size)
    f.add_argument("--lr", type=float, default=FinetuneConfig.lr)
    f.add_argument("--warmup-steps", type=int, default=FinetuneConfig.warmup_steps)
    f.add_argument("--beta", type=float, default=FinetuneConfig.beta, help="GKD's beta (default: GKD_BETA)")
    f.add_argument("--policy-frac", type=float, default=FinetuneConfig.policy_frac)
    f.add_argument("--p-corpus", type=float, default=None, help="share of prose rows (default: lab-draft's)")
    f.add_argument("--windows", type=int, default=FinetuneEval.windows)
    f.add_argument("--window-len", type=int, default=FinetuneEval.window_len)
    f.add_argument("--probe-n", type=int, default=FinetuneEval.probe_n)
    f.add_argument("--probe-len", type=int, default=FinetuneEval.probe_len)
    f.add_argument("--prompts", type=int, default=FinetuneEval.prompts)
    f.add_argument("--threads", type=int, default=1)
    f.add_argument("--out", type=Path, default=FINETUNE_RESULTS)
    f.add_argument("--save-dir", type=Path, default=None, help="save each fine-tuned draft here")
    g = sub.add_parser("ship-finetuned", help="ship a fine-tuned lab-draft as lab-draft-distilled if its "
                                              "acceptance beats lab-draft's with separated intervals")
    g.add_argument("--method", required=True, choices=sorted(FINETUNE_METHODS))
    g.add_argument("--results", type=Path, default=FINETUNE_RESULTS)
    g.add_argument("--seed", type=int, default=None, help="which seed's run to ship (default: the first)")
    g.add_argument("--metric", default="alpha_prose", choices=["alpha_prose", "alpha_probe", "alpha_probe_answer"])
    g.add_argument("--out", type=Path, default=None,
                   help="default: checkpoints/lab-draft-distilled; if it already holds a checkpoint, the draft "
                        "goes to <out>-retrained-<n> unless --overwrite is given")
    g.add_argument("--overwrite", action="store_true",
                   help="write into --out (or checkpoints/lab-draft-distilled) even if it holds a checkpoint")
    args = parser.parse_args(argv)
    if args.cmd == "finetune-experiment":
        from labsrc.recall import command_line

        if len(args.seeds) < 3:
            print(f"note: {len(args.seeds)} seed(s); the intervals across seeds (and ship-finetuned) need three")
        cfg = FinetuneConfig(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                             warmup_steps=args.warmup_steps, beta=args.beta, policy_frac=args.policy_frac,
                             p_corpus=args.p_corpus)
        ev = FinetuneEval(windows=args.windows, window_len=args.window_len, probe_n=args.probe_n,
                          probe_len=args.probe_len, prompts=args.prompts)
        command = command_line("labsrc.distill", f, args).replace(
            "python -m labsrc.distill", "python -m labsrc.distill finetune-experiment", 1)
        results = finetune_experiment(args.methods, args.seeds, cfg, ev, out=args.out, command=command,
                                      threads=args.threads, save_dir=args.save_dir)
        print(finetune_table(results))
        return 0
    if args.cmd == "ship-finetuned":
        card = ship_finetuned(args.method, args.results, seed=args.seed, metric=args.metric, out=args.out,
                              overwrite=args.overwrite)
        return 0 if card is not None else 1
    if args.cmd == "experiment":
        experiment(args.steps, args.sweep_steps, methods=tuple(args.methods.split(",")), out=args.out,
                   save_dir=args.save_dir)
    elif args.cmd == "drafts":
        add_draft_figures(args.students, args.out, n_prompts=args.prompts)
    else:
        card = ship(args.method, args.steps, args.T, args.out, overwrite=args.overwrite)
        print(json.dumps({k: card[k] for k in ("validation_perplexity", "train_minutes", "distillation")},
                         indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
