"""The from-scratch experiment: students of ``lab-draft``'s shape trained for the same steps on the same batches
under each method (:data:`METHODS`), scored against ``lab-target`` and written to
``labsrc/data/distill_results.json``; :func:`ship` trains one recipe into ``checkpoints/lab-draft-distilled``.
"""
from __future__ import annotations

import csv
import json
import random
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from labsrc.distillation.losses import DISTILBERT_WEIGHTS, cosine_hidden_loss, generalized_jsd, kd_loss
from labsrc.distillation.measure import draft_figures, evaluate_student
from labsrc.models.stored_runs import models_stamp

RESULTS = Path(__file__).resolve().parents[1] / "data" / "distill_results.json"


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


def save_student(student, log, info, out: Path, teacher, tokenizer, command: str | None = None,
                 models=("lab-target",), trained_context: int | None = None) -> dict:
    """Write a trained student as a lab checkpoint: fp16 weights, tokenizer, ``train_log.csv`` and
    ``eval_card.json`` (the lab's eval card, measured on the saved weights, plus the distillation figures).

    ``command`` is the one that made it (by default :func:`ship`'s), ``models`` the shipped checkpoints it was
    made from (their digests go on the card) and ``trained_context`` the longest rows it has trained on (by
    default its run's ``seq_len``; a fine-tuned lab-draft keeps lab-draft's)."""
    from labsrc.data import TOKENIZER_PATH
    from labsrc.models import load

    tr = _train_module()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(log[0]))
        writer.writeheader()
        writer.writerows(log)
    method, steps, T = info["method"], info["steps"], info.get("T")
    student.to(torch.float16).save_pretrained(out)
    shutil.copy(TOKENIZER_PATH, out / "tokenizer.json")
    tokenizer.save_pretrained(out)
    t0 = time.time()
    model, _ = load(str(out))
    if command is None:
        command = f"python -m labsrc.distillation ship --method {method} --steps {steps} --T {T}"
    card = {"name": "lab-draft-distilled", "teacher": "lab-target", "models": models_stamp(*models),
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained_context": trained_context or info["train_config"]["seq_len"],
            **info, "final_train_loss": log[-1]["loss"], "command": command}
    card.update(tr.evaluate(model, tokenizer, n=10))
    card["distillation"] = evaluate_student(model, teacher, tokenizer)
    card["eval_minutes"] = round((time.time() - t0) / 60, 2)
    (out / "eval_card.json").write_text(json.dumps(card, indent=1))
    return card
