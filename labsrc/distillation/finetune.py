"""Distillation the way drafts are distilled in practice (DistillSpec): ``lab-draft`` continues its training
against ``lab-target`` under each of :data:`FINETUNE_METHODS`, for the same steps on the same batches from the same
seeds, is measured against the target (:func:`finetune_figures`) and summarised across seeds
(:func:`summarize_finetune`); :func:`ship_finetuned` ships one only when its intervals beat lab-draft's.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from labsrc.distillation.losses import _check_unit, generalized_jsd, kd_loss, tv_loss
from labsrc.distillation.measure import draft_figures, prose_windows, window_figures
from labsrc.distillation.scratch import _train_module, save_student
from labsrc.models.stored_runs import models_stamp



# GKD's beta for the on-policy method: the symmetric generalized JSD. Acceptance depends on TV, which counts the
# draft's excess mass (it proposes what the target rejects) and its missing mass (it rarely proposes what the
# target would accept) alike. Forward KL (beta = 0) barely charges the first, reverse KL (beta = 1) the second;
# beta = 0.5 charges both, like TV, and is sandwiched by it: TV²/2 <= JSD_0.5 <= TV ln 2 (Pinsker on each half,
# and Lin 1991), where either KL can be unbounded while TV is small. tests/test_distillation.py checks the sandwich.
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
FINETUNE_RESULTS = Path(__file__).resolve().parents[1] / "data" / "results" / "distill_finetune.json"


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
        raise FileNotFoundError(f"no results at {results_path}: run `python -m labsrc.distillation "
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
    command = f"python -m labsrc.distillation ship-finetuned --method {method} --seed {seed} --metric {metric}"
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
