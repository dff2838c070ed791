"""Measurements: the acceptance rate along greedy drafts and with the draft cache projected from the
target's, the acceptance by position, plain decoding for the baseline and the task prompts the chapter measures on.
"""
from __future__ import annotations

import time

import torch

from labsrc.speculative.common import _forward, _new_cache, _rollback, warp_logits
from labsrc.speculative.draft_cache import KVProjection
from labsrc.speculative.generate import SpecStats


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
