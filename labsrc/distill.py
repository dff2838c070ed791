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
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from labsrc.models.stored_runs import models_stamp

__all__ = ["soft_kl", "kd_loss", "generalized_jsd", "expected_acceptance", "token_mask", "cosine_hidden_loss",
           "distilbert_loss", "tinybert_layer_map", "tinybert_loss", "fit_unimodal", "STUDENT_CONFIG",
           "distill_run", "evaluate_student"]

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


@torch.no_grad()
def evaluate_student(student, teacher, tokenizer, n_windows: int = 16, context_len: int = 256,
                     passkey_n: int = 10, seed: int = 0) -> dict:
    """Validation perplexity, mean predictive entropy (nats), expected acceptance against the teacher and
    KL(teacher || student) on ``n_windows`` validation windows, plus the pass-key accuracy at
    ``context_len`` tokens (depths 0.25/0.5/0.75, ``passkey_n`` each)."""
    from labsrc import tasks

    torch.set_num_threads(1)
    ids = tasks.corpus_ids(tokenizer, "validation")
    span = context_len - 1
    nll = ent = acc = kl = 0.0
    count = 0
    for w in range(n_windows):
        x = torch.cat([torch.tensor([tokenizer.bos_token_id]), ids[w * span:(w + 1) * span]])[None]
        s = student(input_ids=x).logits[0, :-1].float()
        t = teacher(input_ids=x).logits[0, :-1].float()
        y = x[0, 1:]
        nll += float(F.cross_entropy(s, y, reduction="sum"))
        logp = F.log_softmax(s, -1)
        ent += float(-(logp.exp() * logp).sum())
        acc += float(expected_acceptance(s, t)) * len(y)
        kl += float(soft_kl(s, t, 1.0).sum())
        count += len(y)
    depths = [0.25, 0.5, 0.75]
    pk = tasks.passkey_accuracy(student, tokenizer, context_len, depths, n=passkey_n, seed=seed) \
        if passkey_n else None  # passkey_n=0: no probe (a quick look at the distributions only)
    return {"perplexity": math.exp(nll / count), "entropy": ent / count, "expected_acceptance": acc / count,
            "kl_teacher_student": kl / count, "tokens": count, "passkey": pk,
            "passkey_n": passkey_n * len(depths), "context_len": context_len}


@torch.no_grad()
def draft_figures(draft, target, tokenizer, n_prompts: int = 4, prompt_len: int = 64, new_tokens: int = 32,
                  k: int = 4, seed: int = 0) -> dict:
    """``draft`` as chapter 10's draft for ``target``: :func:`labsrc.speculative.speculative_generate`
    (sampling at temperature 1, window ``k``) on ``n_prompts`` validation prefixes of ``prompt_len`` tokens.

    Returns the measured acceptance (accepted / drafted, with its count: drafts after a rejection count as
    not accepted), new tokens per target call, the draft-to-target cost ratio ``c`` per call measured in the
    run, and the speedup these predict, Leviathan et al.'s ``E[tokens per call] / (k c + 1)`` with the
    measured tokens per call (:func:`labsrc.speculative.speedup` with the per-token acceptance those tokens
    imply). Wall-clock speedups on a shared CPU are noise; the tokens per target call are not.
    """
    from labsrc import speculative, tasks

    torch.set_num_threads(1)
    ids = tasks.corpus_ids(tokenizer, "validation")
    gen = torch.Generator().manual_seed(seed)
    stats = speculative.SpecStats()
    start = len(ids) // 2  # past the windows evaluate_student scores
    for i in range(n_prompts):
        prompt = torch.cat([torch.tensor([tokenizer.bos_token_id]),
                            ids[start + i * prompt_len:start + (i + 1) * prompt_len - 1]])
        speculative.speculative_generate(target, draft, prompt, new_tokens, k=k, do_sample=True, generator=gen,
                                         stats=stats, stop_at_eos=False)
    alpha = stats.acceptance
    draft_s = sum(st.draft_seconds for st in stats.steps) / max(1, stats.draft_calls)
    target_s = sum(st.target_seconds for st in stats.steps) / max(1, stats.target_calls)
    c = draft_s / target_s if target_s else float("nan")
    return {"alpha": alpha, "accepted": stats.accepted, "drafted": stats.drafted,
            "tokens_per_call": stats.tokens_per_call, "c": c, "k": k,
            "predicted_speedup": stats.tokens_per_call / (k * c + 1),
            "new_tokens": stats.new_tokens}


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


def save_student(student, log, info, out: Path, teacher, tokenizer) -> dict:
    """Write a trained student as a lab checkpoint: fp16 weights, tokenizer, ``train_log.csv`` and
    ``eval_card.json`` (the lab's eval card, measured on the saved weights, plus the distillation figures)."""
    from labsrc.data import TOKENIZER_PATH
    from labsrc.models import load

    tr = _train_module()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(log[0]))
        writer.writeheader()
        writer.writerows(log)
    method, steps, T = info["method"], info["steps"], info["T"]
    student.to(torch.float16).save_pretrained(out)
    shutil.copy(TOKENIZER_PATH, out / "tokenizer.json")
    tokenizer.save_pretrained(out)
    t0 = time.time()
    model, _ = load(str(out))
    card = {"name": "lab-draft-distilled", "teacher": "lab-target", "models": models_stamp("lab-target"),
            "parameters": sum(p.numel() for p in model.parameters()), "trained_context": info["train_config"]["seq_len"],
            **info, "final_train_loss": log[-1]["loss"],
            "command": f"python -m labsrc.distill ship --method {method} --steps {steps} --T {T}"}
    card.update(tr.evaluate(model, tokenizer, n=10))
    card["distillation"] = evaluate_student(model, teacher, tokenizer)
    card["eval_minutes"] = round((time.time() - t0) / 60, 2)
    (out / "eval_card.json").write_text(json.dumps(card, indent=1))
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
    args = parser.parse_args(argv)
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
    main()
