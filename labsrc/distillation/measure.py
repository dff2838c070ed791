"""What a student or draft is measured on against ``lab-target``: held-out prose windows, the per-token figures
(KL, expected acceptance, entropy) on them, and a draft's acceptance and speed in chapter 10's speculative loop.
Both experiments (:mod:`labsrc.distillation.scratch`, :mod:`labsrc.distillation.finetune`) score with these."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labsrc.distillation.losses import expected_acceptance, soft_kl


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
