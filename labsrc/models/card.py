"""The v3 eval card's probes: the general skills (:mod:`labsrc.tasks.skills`) measured on held-out phrasing
families, pools and prose, beside the trained format.

Every probe draws its samples from a generator seeded by the probe's own name, so two runs score the same
samples (and methods compared on them can be paired); training draws from one ``random.Random(cfg.seed)``
stream of the training split, so no probe sample is ever a training row.
"""
from __future__ import annotations

import random

from labsrc.tasks import accuracy, probe_depths
from labsrc.tasks import skills
from labsrc.tasks.pools import HELDOUT


def heldout_samples(task: str, tokenizer, context_len: int, n: int, seed: int = 0, **kw) -> list:
    """``n`` held-out samples of a general ``task`` at ``context_len`` tokens, seeded by name; the ones with a
    depth sit at :func:`labsrc.tasks.probe_depths` (a smaller probe is a prefix of a larger one)."""
    tag = "-".join(f"{k}={v}" for k, v in sorted(kw.items()))
    rng = random.Random(f"v3-{task}-{seed}-{context_len}-{tag}")
    depths = probe_depths(n)
    gen = {"passkey": skills.passkey, "needle": skills.needle, "passage": skills.passage}
    if task in gen:
        return [gen[task](tokenizer, context_len, d, rng, HELDOUT, **kw) for d in depths]
    gen = {"mqar": skills.mqar, "variable_tracking": skills.variable_tracking, "induction": skills.induction,
           "recurrence": skills.recurrence}
    if task in gen:
        return [gen[task](tokenizer, context_len, rng, split=HELDOUT, **kw) for _ in range(n)]
    raise ValueError(f"task must be one of {skills.TASKS[:-1]}, got {task!r}")


def progress_probes(model, tokenizer, length: int, n: int = 8) -> dict:
    """A quick look during v3 training, every ``eval_every`` steps: ``n`` held-out samples of each skill at
    ``length`` tokens (seed 1234, not the eval card's samples)."""
    gap = max(0, min(200, length - 110))
    kw = dict(n=n, seed=1234)
    hops = 2 if length >= 256 else 0
    return {
        "induction_512": accuracy(model, heldout_samples("induction", tokenizer, length, n_tokens=50, gap=gap,
                                                         **kw)),
        "recurrence_512": accuracy(model, heldout_samples("recurrence", tokenizer, length, n_tokens=50, gap=gap,
                                                          **kw)),
        "passkey_ho_512": accuracy(model, heldout_samples("passkey", tokenizer, length, **kw)),
        "needle_ho_512": accuracy(model, heldout_samples("needle", tokenizer, length, n_distractors=3, **kw)),
        "absent_ho_512": accuracy(model, heldout_samples("needle", tokenizer, length, n_distractors=3, absent=True,
                                                         **kw)),
        "mqar_ho_512": accuracy(model, heldout_samples("mqar", tokenizer, length, n_pairs=min(8, length // 64),
                                                       **kw)),
        "vt_ho_512": accuracy(model, heldout_samples("variable_tracking", tokenizer, length, n_hops=hops, **kw)),
    }
