"""The eval card: the headline probes on the first probes' formats (:func:`evaluate`), and the v3 card's
general skills (:mod:`labsrc.tasks.skills`) measured on held-out phrasing
families, pools and prose, beside the trained format.

Every probe draws its samples from a generator seeded by the probe's own name, so two runs score the same
samples (and methods compared on them can be paired); training draws from one ``random.Random(cfg.seed)``
stream of the training split, so no probe sample is ever a training row.
"""
from __future__ import annotations

import math
import random

import torch
from tqdm.auto import tqdm

from labsrc import tasks
from labsrc.tasks import accuracy, probe_depths
from labsrc.tasks import skills
from labsrc.tasks.pools import HELDOUT

TRAINED_CONTEXT = 512  # a model's trained context when its config does not say (lab-target's says 1,024)


# ----------------------------------------------------------------------------------------------- headline
# The eval card. Its headline probes run at PROBE_FRACTION of the trained context (room for the question at
# the end of a context the model was trained at), PROBE_N samples each, with 95% intervals. The grids below
# are fractions of the trained context, so a 512-token model (lab-mamba) and a 1,024-token one are measured
# alike.
PROBE_FRACTION = 0.9
PROBE_N = 100
PROBE_SETTINGS = {"needle": {"n_distractors": 3}, "mqar": {"n_pairs": 8}, "variable_tracking": {"n_hops": 2},
                  "passage": {"n_tokens": 100}}
PASSKEY_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
PASSKEY_BEYOND = (1.5, 2.0)
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PASSKEY_DECOYS = 3  # the eval card's second grid: the same pass keys with three other numbers in the prose


def trained_context(model) -> int:
    """The context a lab model was trained at (``config.lab_trained_context``; 512 for a config without it)."""
    return int(getattr(model.config, "lab_trained_context", None) or TRAINED_CONTEXT)


def _interval(per_sample: list[float]) -> dict:
    """Accuracy over samples with its 95% interval: Wilson's when each sample is one right-or-wrong answer;
    for fractions (MQAR's queries, a passage's tokens, which are not independent within a sample) the normal
    interval of the mean over samples, clipped to [0, 1]."""
    from labsrc.claims import Z95, wilson

    n = len(per_sample)
    mean = sum(per_sample) / n
    if all(x in (0.0, 1.0) for x in per_sample):
        lo, hi = wilson(round(sum(per_sample)), n)
        how = "wilson"
    else:
        sd = math.sqrt(sum((x - mean) ** 2 for x in per_sample) / max(n - 1, 1))
        lo, hi = max(0.0, mean - Z95 * sd / math.sqrt(n)), min(1.0, mean + Z95 * sd / math.sqrt(n))
        how = "normal over samples"
    return {"n": n, "accuracy": mean, "ci95": [lo, hi], "interval": how}


def probe_set(tokenizer, task: str, context_len: int, n: int = PROBE_N, seed: int = 0) -> list:
    """The samples of one headline probe, with the eval card's settings (a prefix of the ``n`` is the probe of
    fewer samples)."""
    return tasks.probe_samples(task, tokenizer, context_len, n, seed, **PROBE_SETTINGS.get(task, {}))


def probe(model, tokenizer, task: str, context_len: int, n: int = PROBE_N, seed: int = 0) -> dict:
    """One headline probe of the eval card: accuracy with its 95% interval over ``n`` samples, and by depth
    (five bins) for the probes whose answer sits at a depth. ``task`` is ``"passkey"`` or a
    :func:`labsrc.tasks.probe_samples` task, with the eval card's settings (:data:`PROBE_SETTINGS`)."""
    samples = probe_set(tokenizer, task, context_len, n, seed)
    per = [sum(r) / len(r) for r in tasks.score(model, samples)]
    out = {"context_len": context_len, **PROBE_SETTINGS.get(task, {}), **_interval(per),
           "per_sample": [round(x, 4) for x in per]}  # the slow test recomputes a prefix of these exactly
    if "depth" in samples[0].meta:
        bins = {}
        for s, x in zip(samples, per):
            bins.setdefault(min(int(s.meta["depth"] * 5), 4), []).append(x)
        out["by_depth"] = {f"{b / 5:.1f}-{(b + 1) / 5:.1f}": sum(v) / len(v) for b, v in sorted(bins.items())}
    return out


def evaluate(model, tokenizer, context_len: int | None = None, n: int = PROBE_N, grid_n: int = 20,
             seed: int = 0, progress: bool = True) -> dict:
    """The eval card's figures for ``model``: validation perplexity, the headline probes at
    :data:`PROBE_FRACTION` of the trained context (``context_len``, by default the model's own) with ``n``
    samples each, and pass-key grids over length and depth (``grid_n`` a cell). ``progress`` shows a bar over
    the card's stages (it takes minutes on a CPU)."""
    torch.set_num_threads(1)
    ctx = context_len or trained_context(model)
    at = int(PROBE_FRACTION * ctx)
    bar = tqdm(total=7 + len(PROBE_SETTINGS) + (ctx != 512), desc="eval card", unit="stage", disable=not progress)

    def done(stage, value):
        bar.set_postfix_str(stage)
        bar.update()
        return value

    ppl = done("perplexity", tasks.perplexity_by_position(model, tokenizer, ctx, bucket=64))
    lengths = [int(f * ctx) for f in PASSKEY_FRACTIONS]
    beyond_lengths = [int(f * ctx) for f in PASSKEY_BEYOND]
    grid = done("pass-key grid", tasks.passkey_grid(model, tokenizer, lengths, PASSKEY_DEPTHS, n=grid_n, seed=seed))
    beyond = done("beyond the context", tasks.passkey_grid(model, tokenizer, beyond_lengths, PASSKEY_DEPTHS,
                                                            n=max(4, grid_n // 2), seed=seed, batch_size=4))
    decoys = done("decoys", tasks.passkey_grid(model, tokenizer, lengths, PASSKEY_DEPTHS, n=grid_n, seed=seed,
                                               n_decoys=PASSKEY_DECOYS))
    probes = {t: done(t, probe(model, tokenizer, t, at, n, seed)) for t in ("passkey", *PROBE_SETTINGS)}
    card = {
        "validation_perplexity": ppl["overall"],
        "validation_windows": ppl["n_windows"],
        "perplexity_by_position": {"positions": ppl["positions"], "perplexity": ppl["perplexity"]},
        "probes": probes,
        "passkey": {"context_lens": lengths, "depths": list(PASSKEY_DEPTHS), "n": grid_n,
                    "accuracy": grid.tolist(),
                    "accuracy_by_depth": dict(zip(map(str, PASSKEY_DEPTHS), grid.min(1).values.tolist())),
                    "min_inside_trained_context": float(grid.min())},
        "passkey_beyond_trained_context": {"context_lens": beyond_lengths, "depths": list(PASSKEY_DEPTHS),
                                           "n": max(4, grid_n // 2), "accuracy": beyond.tolist()},
        "passkey_with_decoys": {"context_lens": lengths, "depths": list(PASSKEY_DEPTHS), "n": grid_n,
                                "n_decoys": PASSKEY_DECOYS, "accuracy": decoys.tolist(),
                                "min_inside_trained_context": float(decoys.min())},
        # The headline figures under the names the chapters read.
        "needle_accuracy": probes["needle"]["accuracy"],
        "mqar_accuracy": probes["mqar"]["accuracy"],
        "passage_copy_accuracy": probes["passage"]["accuracy"],
        "variable_tracking_accuracy": {
            str(h): (probes["variable_tracking"]["accuracy"] if h == 2 else
                     done(f"{h}-hop tracking",
                          tasks.variable_tracking_accuracy(model, tokenizer, at, n=n, n_hops=h, seed=seed)))
            for h in (0, 1, 2)},
    }
    if ctx != 512:  # the first lab-target's context: prose perplexity compared at equal length
        card["validation_perplexity_512"] = done("perplexity at 512", tasks.perplexity_by_position(
            model, tokenizer, 512, bucket=64))["overall"]
    bar.close()
    return card


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


# ----------------------------------------------------------------------------------------------- the card
CARD_N = 100
INDUCTION_GAPS = (0, 200, 600)
CONTINUATION_CUE = 12     # tokens of a passage's start given again; the model should go on with the rest
CONTINUATION_TOKENS = 64  # greedy tokens scored (the length of the matching prefix)
CONTEXT_SHORT = 128       # tokens of context before the scored tail in the long-context benefit
TAIL = 64                 # the scored tail of each window
# The goals (issue 41), printed beside the card: (probe, comparison, goal).
GOALS = {"induction_frequent": (">=", 0.9), "induction_uniform": (">=", 0.8), "repeat": (">=", 0.8),
         "continuation": (">=", 0.7), "passkey": (">=", 0.95), "needle": (">=", 0.85), "absent": (">=", 0.8),
         "mqar_8": (">=", 0.8), "vt_2hop_asked_earlier": (">=", 0.8), "vt_2hop_asked_later": (">=", 0.8),
         "vt_0hop": (">=", 0.95), "passage": (">=", 0.9), "perplexity_512": ("<=", 60.0),
         "context_benefit_nats": (">=", 0.05)}


def _summary(per_sample: list[float]) -> dict:
    """Accuracy with its 95% interval (Wilson for right/wrong samples, normal over samples for fractions), the
    sample size and the per-sample results (so methods scored on the same samples can be paired)."""
    return {**_interval(per_sample), "per_sample": [round(x, 4) for x in per_sample]}


def _scored(model, samples) -> dict:
    from labsrc.tasks import score

    return _summary([sum(r) / len(r) for r in score(model, samples)])


def continuation(model, tokenizer, context_len: int, n: int = CARD_N, seed: int = 0) -> dict:
    """Greedy continuation of text that quotes itself: a validation passage, prose, then the passage's first
    :data:`CONTINUATION_CUE` tokens again at the end of ``context_len`` tokens; the score of a sample is the
    share of :data:`CONTINUATION_TOKENS` greedy tokens that go on with the passage before the first slip
    (what prompt lookup needs: a run of tokens to propose)."""
    import torch

    k, m = CONTINUATION_CUE, CONTINUATION_TOKENS
    rng = random.Random(f"v3-continuation-{seed}-{context_len}")
    device = next(model.parameters()).device
    per = []
    for _ in range(n):
        # BOS, prose, the passage (k + m tokens), prose (the gap), the passage's first k tokens: context_len
        gap = rng.randint(0, context_len - 1 - 2 * k - m)
        passage = skills.filler(tokenizer, HELDOUT, k + m, rng, "prose")
        before = skills.filler(tokenizer, HELDOUT, context_len - 1 - 2 * k - m - gap, rng, "prose")
        prompt = ([tokenizer.bos_token_id] + before + passage + skills.filler(tokenizer, HELDOUT, gap, rng, "prose")
                  + passage[:k])
        want = passage[k:]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=m, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        run = next((i for i, (x, y) in enumerate(zip(out, want)) if x != y), min(len(out), m))
        per.append(run / m)
    return _summary(per)


def context_benefit(model, tokenizer, context_len: int = 1024, short: int = CONTEXT_SHORT, tail: int = TAIL) -> dict:
    """Does context far back help predict prose? Over every ``context_len``-token validation window, the mean
    loss of its last ``tail`` tokens with only the ``short`` tokens before them, minus with the whole window:
    positive when the far context helps. The interval is the normal one over windows."""
    import math
    import torch

    from labsrc.claims import Z95
    from labsrc.tasks import corpus_ids

    ids = corpus_ids(tokenizer, "validation")
    span = context_len - 1
    device = next(model.parameters()).device
    diffs = []
    for w in range(len(ids) // span):
        window = [tokenizer.bos_token_id] + ids[w * span:(w + 1) * span].tolist()
        losses = []
        for row in (window, [tokenizer.bos_token_id] + window[-(short + tail):]):
            x = torch.tensor([row], device=device)
            with torch.no_grad():
                logits = model(input_ids=x).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none")
            losses.append(float(nll[-tail:].mean()))
        diffs.append(losses[1] - losses[0])
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1))
    return {"n": n, "nats": mean, "ci95": [mean - Z95 * sd / math.sqrt(n), mean + Z95 * sd / math.sqrt(n)],
            "context_len": context_len, "short": short, "tail": tail}


def general_card(model, tokenizer, context_len: int | None = None, n: int = CARD_N, seed: int = 0,
                 progress: bool = True) -> dict:
    """The v3 card: every skill on held-out phrasings, pools and prose at 0.9 of the trained context, ``n``
    samples each with 95% intervals, and beside each retrieval probe the trained format (the first probes'
    own wording, :func:`labsrc.tasks.probe_samples`): the robustness table chapter 2 prints."""
    from labsrc.tasks import perplexity_by_position, probe_samples

    ctx = context_len or trained_context(model)
    at = int(PROBE_FRACTION * ctx)
    ho = {}
    jobs = [(f"induction_{v}_gap{g}", lambda v=v, g=g: heldout_samples(
                "induction", tokenizer, at, n, seed, n_tokens=50, gap=g, vocab=v))
            for v in ("frequent", "uniform") for g in INDUCTION_GAPS]
    jobs += [("repeat", lambda: heldout_samples("recurrence", tokenizer, at, n, seed, n_tokens=100, gap=0)),
             ("passkey", lambda: heldout_samples("passkey", tokenizer, at, n, seed)),
             ("needle", lambda: heldout_samples("needle", tokenizer, at, n, seed, n_distractors=3)),
             ("absent", lambda: heldout_samples("needle", tokenizer, at, n, seed, n_distractors=3, absent=True)),
             ("mqar_8", lambda: heldout_samples("mqar", tokenizer, at, n, seed, n_pairs=8)),
             ("mqar_16", lambda: heldout_samples("mqar", tokenizer, at, n, seed, n_pairs=16)),
             ("vt_2hop_asked_earlier", lambda: heldout_samples("variable_tracking", tokenizer, at, n, seed,
                                                               n_hops=2, asked_last=False)),
             ("vt_2hop_asked_later", lambda: heldout_samples("variable_tracking", tokenizer, at, n, seed,
                                                             n_hops=2, asked_last=True)),
             ("vt_0hop", lambda: heldout_samples("variable_tracking", tokenizer, at, n, seed, n_hops=0)),
             ("passage", lambda: heldout_samples("passage", tokenizer, at, n, seed, n_tokens=100))]
    trained = {"passkey": {}, "needle": {"n_distractors": 3}, "mqar_8": {"n_pairs": 8},
               "vt_2hop": {"n_hops": 2}, "passage": {"n_tokens": 100}}
    bar = tqdm(total=len(jobs) + len(trained) + 3, desc="v3 card", unit="probe", disable=not progress)
    for name, make in jobs:
        ho[name] = _scored(model, make())
        bar.update()
    for v in ("frequent", "uniform"):  # the headline induction figures pool the three gaps
        per = [x for g in INDUCTION_GAPS for x in ho[f"induction_{v}_gap{g}"]["per_sample"]]
        ho[f"induction_{v}"] = _summary(per)
    ho["continuation"] = continuation(model, tokenizer, at, n, seed)
    bar.update()
    tf = {}
    for name, kw in trained.items():
        task = {"mqar_8": "mqar", "vt_2hop": "variable_tracking"}.get(name, name)
        tf[name] = _scored(model, probe_samples(task, tokenizer, at, n, seed, **kw))
        bar.update()
    ppl = perplexity_by_position(model, tokenizer, 512, bucket=64)
    bar.update()
    benefit = context_benefit(model, tokenizer, min(1024, ctx)) if ctx >= 2 * (CONTEXT_SHORT + TAIL) else None
    bar.update()
    bar.close()
    return {"context_len": at, "n": n, "seed": seed, "heldout": ho, "trained_format": tf,
            "perplexity_512": ppl["overall"], "perplexity_512_windows": ppl["n_windows"],
            "context_benefit": benefit}


def goals_table(general: dict) -> list[dict]:
    """The card's headline figures beside the issue's goals: ``{"probe", "value", "ci95", "goal", "met"}`` rows
    (``met`` None where the interval straddles the goal: neither shown met nor shown missed)."""
    rows = []
    for probe, (op, goal) in GOALS.items():
        if probe == "perplexity_512":
            value, ci = general["perplexity_512"], None
        elif probe == "context_benefit_nats":
            b = general.get("context_benefit")
            if b is None:
                continue
            value, ci = b["nats"], b["ci95"]
        else:
            value, ci = general["heldout"][probe]["accuracy"], general["heldout"][probe]["ci95"]
        lo, hi = ci if ci else (value, value)
        met = (lo >= goal if op == ">=" else hi <= goal) or None
        missed = hi < goal if op == ">=" else lo > goal
        rows.append({"probe": probe, "value": value, "ci95": ci, "goal": f"{op} {goal}",
                     "met": True if met else (False if missed else None)})
    return rows


def robustness_table(general: dict) -> list[dict]:
    """Each retrieval skill in its trained format beside the held-out one: ``{"skill", "trained", "heldout"}``
    rows of accuracies with intervals (chapter 2 prints it)."""
    pairs = (("pass key", "passkey", "passkey"), ("needle, 3 distractors", "needle", "needle"),
             ("MQAR, 8 pairs", "mqar_8", "mqar_8"), ("variable tracking, 2 hops", "vt_2hop", None),
             ("passage copy, 100 tokens", "passage", "passage"))
    rows = []
    for skill, t, h in pairs:
        held = general["heldout"][h] if h else _summary(
            general["heldout"]["vt_2hop_asked_earlier"]["per_sample"]
            + general["heldout"]["vt_2hop_asked_later"]["per_sample"])
        rows.append({"skill": skill, "trained": general["trained_format"][t], "heldout": held})
    return rows
