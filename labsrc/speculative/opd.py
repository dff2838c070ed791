"""Draft-OPD: the draft's own decoding used to build its training data (on-policy distillation).
"""
from __future__ import annotations

import time

import torch

from labsrc.speculative.common import _eos_ids, _forward, _new_cache, _rollback
from labsrc.speculative.generate import SpecStats, StepStats
from labsrc.speculative.theory import _check_k


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
