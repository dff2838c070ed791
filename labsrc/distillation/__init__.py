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

    python -m labsrc.distillation experiment --steps 120 --sweep-steps 60 --save-dir /tmp/students
    python -m labsrc.distillation drafts --students /tmp/students --prompts 8   # each as chapter 10's draft
    python -m labsrc.distillation ship --method kd --steps 120 --T 2.0   # checkpoints/lab-draft-distilled

``ship`` writes over the shipped student only with ``--overwrite``; without it, beside it, in
``lab-draft-distilled-retrained-<n>``, as retraining a model does.

Those students start from nothing, the chapter's second experiment. Drafts are distilled in practice the way
DistillSpec does it: start from the trained draft and continue its training against the target. Here
(:func:`finetune_run`) lab-draft continues for the same steps, on the same batches, from the same seeds,
under each of :data:`FINETUNE_METHODS`: more of its own cross-entropy (the control), KD to lab-target, on-policy
GKD and the total variation that acceptance is one minus (:func:`tv_loss`). Each is measured against the
target (:func:`finetune_figures`: KL, TV and acceptance on held-out prose and on the probe tasks, tokens per
target call and wall clock as chapter 10's draft) and summarised across seeds with Student-t intervals::

    python -m labsrc.distillation finetune-experiment --steps 300 --seeds 0 1 2     # resumable per (method, seed)
    python -m labsrc.distillation ship-finetuned --method tv   # only if it beats lab-draft with separated intervals

Every run is deterministic from its seed, so the methods and the sweep may also run as separate processes
(``experiment(..., methods=...)``) and give the same figures.

The package, one concept per file (imports run down this list, never back up):

* :mod:`~labsrc.distillation.losses` -- the losses above and :func:`tv_loss`, with their argument checks;
* :mod:`~labsrc.distillation.measure` -- prose windows, per-token figures against the target, a draft's acceptance and
  speed in chapter 10's loop (both experiments score with it);
* :mod:`~labsrc.distillation.scratch` -- the from-scratch students, their experiment and ``ship``;
* :mod:`~labsrc.distillation.finetune` -- fine-tuning lab-draft, its experiment, summary and ``ship-finetuned``;
* :mod:`~labsrc.distillation.cli` -- the command line (``python -m labsrc.distillation``).

Everything public is re-exported here, so ``from labsrc import distillation; distillation.kd_loss(...)`` is the way to use
it; a test that replaces a function an experiment calls patches the module that calls it
(``labsrc.distillation.scratch.distill_run``).
"""
from __future__ import annotations

from labsrc.distillation.losses import (DISTILBERT_WEIGHTS, cosine_hidden_loss,
                                   distilbert_loss, expected_acceptance, fit_unimodal, generalized_jsd, kd_loss,
                                   soft_kl, tinybert_layer_map, tinybert_loss, token_mask, tv_loss)
from labsrc.distillation.measure import draft_figures, evaluate_student, prose_windows, window_figures
from labsrc.distillation.scratch import (METHODS, RESULTS, STUDENT_CONFIG, add_draft_figures, distill_run, experiment,
                                    save_student, ship, student_config)
from labsrc.distillation.finetune import (FINETUNE_DEFAULT, FINETUNE_METHODS, FINETUNE_RESULTS, GKD_BETA, SUMMARY_KEYS,
                                     FinetuneConfig, FinetuneEval, FinetuneMethod, batch_digest, finetune_experiment,
                                     finetune_figures, finetune_run, finetune_table, probe_alpha,
                                     sample_continuations, ship_decision, ship_finetuned, summarize_finetune,
                                     summary_estimate)
from labsrc.distillation.cli import main

__all__ = [
    # losses
    "soft_kl", "kd_loss", "generalized_jsd", "expected_acceptance", "tv_loss", "token_mask", "cosine_hidden_loss",
    "DISTILBERT_WEIGHTS", "distilbert_loss", "tinybert_layer_map", "tinybert_loss", "fit_unimodal",
    # measured against the target
    "prose_windows", "window_figures", "evaluate_student", "draft_figures",
    # students from scratch
    "STUDENT_CONFIG", "METHODS", "RESULTS", "student_config", "distill_run", "experiment", "add_draft_figures",
    "ship", "save_student",
    # fine-tuning lab-draft
    "GKD_BETA", "FinetuneMethod", "FINETUNE_METHODS", "FINETUNE_DEFAULT", "FINETUNE_RESULTS", "FinetuneConfig",
    "FinetuneEval", "batch_digest", "sample_continuations", "finetune_run", "probe_alpha", "finetune_figures",
    "SUMMARY_KEYS", "summary_estimate", "summarize_finetune", "finetune_table", "ship_decision",
    "finetune_experiment", "ship_finetuned",
    "main",
]
