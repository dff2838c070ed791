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

The package holds one concept per file (every name above is importable from here):

* :mod:`labsrc.speculative.common`: What every drafter shares: a model's forward on a cache, a fresh cache,
  rolling a cache back to a length, its size in bytes, the end-of-sequence ids and the logit warping of
  sampling.
* :mod:`labsrc.speculative.theory`: Speculative decoding's theory: the acceptance rate and its bounds, the
  expected tokens per step and the speedup, the best window, and a chi-square test that the output keeps the
  target's distribution.
* :mod:`labsrc.speculative.verify`: Exact verification: accept a drafted token with probability min(1, p/q),
  else sample the residual max(0, p - q); one window, or a batch of windows.
* :mod:`labsrc.speculative.draft_cache`: The draft's KV cache from the target's: the draft reads a projection of
  the target's (quantized) cache instead of computing its own.
* :mod:`labsrc.speculative.generate`: The speculative decoding loop shared by every drafter: draft a window,
  verify it with the target in one forward, keep the accepted tokens and roll the caches back; the draft model
  drafter and the statistics.
* :mod:`labsrc.speculative.self_spec`: Self-speculation: the target's own first layers (with an early-exit head)
  draft for the whole model.
* :mod:`labsrc.speculative.lookup`: Prompt lookup decoding: the draft is the continuation of the last n-gram's
  earlier occurrence in the context, no draft model at all.
* :mod:`labsrc.speculative.tree`: Tree speculation: several drafts verified at once as a tree, with the tree
  attention mask and the cache rows of the accepted branch kept.
* :mod:`labsrc.speculative.measure`: Measurements: the acceptance rate along greedy drafts and with the draft
  cache projected from the target's, the acceptance by position, plain decoding for the baseline and the task
  prompts the chapter measures on.
* :mod:`labsrc.speculative.opd`: Draft-OPD: the draft's own decoding used to build its training data (on-policy
  distillation).
* :mod:`labsrc.speculative.cli`: ``python -m labsrc.speculative train-early-exit``: the command line.
"""
from __future__ import annotations

from labsrc.speculative.common import (_eos_ids, _forward, _new_cache, _rollback, cache_nbytes, warp_logits)
from labsrc.speculative.theory import (_PROB_TOL, _check_alpha, _check_k, _check_pair, _check_probs,
                                       acceptance_rate, adaptive_window, chi_square_test,
                                       expected_tokens_per_step, kl_divergence, optimal_k, pinsker_lower_bound,
                                       speedup, total_variation)
from labsrc.speculative.verify import (_check_verify_args, _residual, _verify_core, residual_distribution, verify,
                                       verify_batch)
from labsrc.speculative.draft_cache import (KVProjection, _kv_layout, _rope_tables, cache_features,
                                            fit_kv_projection)
from labsrc.speculative.generate import (SpecStats, StepStats, _AssistedGenerationNote, _TwoModels,
                                         _check_generate_args, _check_rollback_window, _speculate,
                                         speculative_generate)
from labsrc.speculative.self_spec import (EARLY_EXIT_DIR, _SharedBody, _model_name, count_layer_tokens,
                                          early_exit_draft, run_layers, self_speculative_generate,
                                          train_early_exit_head)
from labsrc.speculative.lookup import _PromptLookup, lookup_draft, prompt_lookup_generate
from labsrc.speculative.tree import (_TREE_ATTN, _TREE_MASK, _keep_cache_positions, _register_tree_attention,
                                     _tree_attention_forward, tree_attention_mask, tree_depths,
                                     tree_speculative_generate, tree_verify_logits)
from labsrc.speculative.measure import (acceptance_by_position, alpha_along, alpha_along_drafts,
                                        alpha_with_draft_cache, plain_decode, task_prompts)
from labsrc.speculative.opd import draft_opd_generate
from labsrc.speculative.cli import main

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

