"""Stretch a loaded model's RoPE to a longer context, and fine-tune it briefly at that length.

Used by the position-encoding chapter:

* :func:`set_rope` swaps the position encoding of a loaded Llama-style model for one of the methods of
  :mod:`labsrc.rope` by writing ``model.config.rope_parameters`` and re-creating ``model.model.rotary_emb``
  from it, so ``transformers`` computes the frequencies itself (the chapter checks them against
  :func:`labsrc.rope.rope_frequencies`). Static NTK-aware scaling has no ``rope_type`` of its own in
  ``transformers``; it *is* default RoPE with a larger base, so it is written as ``default`` with
  ``rope_theta = ntk_base(...)``.
* :func:`finetune` runs a few optimiser steps at a new length on the same data the model was trained on
  (:func:`labsrc.models.train.make_batch`: corpus windows plus the synthetic retrieval tasks, answers weighted
  as in training) and returns the loss of every step.
"""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from labsrc import rope
from labsrc.models import config_head_dim

__all__ = ["set_rope", "finetune"]

_HF_TYPES = {"default": "default", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}


def set_rope(model, method: str, factor: float | None = None, **params) -> dict:
    """Give ``model`` the RoPE of ``method`` (one of :data:`labsrc.rope.METHODS`) at extension ratio ``factor``.

    The trained length ``L`` is ``model.config.lab_trained_context`` (or ``max_position_embeddings``) and is
    passed as ``original_max_position_embeddings``. ``params`` go into ``rope_parameters`` (e.g. ``beta_fast``
    for yarn, ``low_freq_factor``/``high_freq_factor`` for llama3). The base ``rope_theta`` of the trained
    model is kept from the first call, so calling this repeatedly never compounds a change. Returns the new
    ``rope_parameters``. ``dynamic`` follows ``transformers``: its ratio is ``factor * T / L - (factor - 1)``
    for an input of ``T > L`` tokens, recomputed in the forward pass.
    """
    if method not in rope.METHODS:
        raise ValueError(f"method must be one of {rope.METHODS}, got {method!r}")
    config = model.config
    if not hasattr(config, "lab_rope_theta"):
        config.lab_rope_theta = float(config.rope_parameters["rope_theta"])
    base = config.lab_rope_theta
    trained = int(getattr(config, "lab_trained_context", config.max_position_embeddings))
    dim = config_head_dim(config)
    if method == "default":
        new = {"rope_type": "default", "rope_theta": base}
    else:
        if factor is None or float(factor) < 1:
            raise ValueError(f"method {method!r} needs factor >= 1 (new length / trained length), got {factor!r}")
        if method == "ntk":
            new = {"rope_type": "default", "rope_theta": rope.ntk_base(base, float(factor), dim)}
        else:
            new = {"rope_type": _HF_TYPES[method], "rope_theta": base, "factor": float(factor),
                   "original_max_position_embeddings": trained, **params}
    config.rope_parameters = new
    old = model.model.rotary_emb
    device = old.inv_freq.device
    model.model.rotary_emb = type(old)(config=config).to(device)
    return new


def finetune(model, tokenizer, seq_len: int, steps: int, lr: float = 3e-4, batch_size: int = 1, seed: int = 0,
             p_corpus: float | None = None) -> list[float]:
    """Fine-tune ``model`` in place for ``steps`` AdamW steps on rows of ``seq_len`` tokens; return the losses.

    Rows come from :func:`labsrc.models.train.make_batch` (the training mixture: prose, plus pass-key, needle,
    MQAR and variable-tracking samples, now up to ``seq_len`` long), and the loss is the training loss: mean
    prose loss plus ``answer_weight`` times the mean loss on answer tokens. The learning rate warms up over the
    first quarter of the steps (Adam's first steps are otherwise large on a converged model) and then stays
    constant. The model is left in eval mode. Deterministic from ``seed``.
    """
    from labsrc.models.train import CONFIGS, make_batch, training_loss

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(seq_len, int) or seq_len < 128:
        raise ValueError(f"seq_len must be an int >= 128, got {seq_len!r}")
    cfg = replace(CONFIGS["lab-target"], seq_len=seq_len, batch_size=batch_size,
                  seed=seed, **({} if p_corpus is None else {"p_corpus": p_corpus}))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 4)
    losses = []
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup)
        ids, w = make_batch(cfg, tokenizer, rng)
        ids, w = ids.to(device), w.to(device)
        loss, _, _ = training_loss(model(input_ids=ids).logits, ids, w, cfg.answer_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
