"""Train one of the lab's models on this machine's CPU: ``python -m labsrc.models.train <name>``.

Names: ``lab-target`` (about 9M parameters, 6 layers, grouped-query attention with 8 query heads and 2 KV
heads, trained at a context of 512 tokens), ``lab-draft`` (a fifth of that, for speculative decoding) and
``tiny`` (a smoke-test configuration). A run is deterministic from its seed, stops after ``max_steps`` (or,
as a safety net, at a wall-clock budget, which the eval card then reports), and writes into
``labsrc/models/checkpoints/<name>/`` (or ``--out``): the weights (safetensors, fp16), the config, the
tokenizer, ``train_log.csv`` (the loss curve) and ``eval_card.json`` (validation perplexity and probe
accuracies, measured on the *saved* weights loaded back through :func:`labsrc.models.load`).

Each training row starts with the BOS token. With probability ``p_corpus`` it is a window of the training
split; otherwise it packs synthetic retrieval samples from :mod:`labsrc.tasks` (pass key, needle with
distractors, MQAR, variable tracking, and a word-copy task; the same generators the probes use, on the
*training* split's prose) of random length and depth, separated by end-of-text tokens, then more prose; a pass
key's prose carries up to ``max_decoys`` other numbers, so that the model learns which number to copy. The
run starts with 128-token rows (more of them per step) that are mostly pass keys: that is where the model
learns to look things up in its context. Then the rows grow to 512 tokens and the mixture turns to its
steady share of prose. The loss is the mean over prose tokens plus ``answer_weight`` times the mean over
answer tokens: the answers are a handful of tokens among hundreds, and they are what teaches the model to
read its context.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labsrc import tasks
from labsrc.data import TOKENIZER_PATH, load_tokenizer, train_tokenizer

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
TRAINED_CONTEXT = 512


@dataclass
class TrainConfig:
    """Everything that defines a run: the architecture, the data mixture and the optimiser."""

    hidden_size: int = 320
    intermediate_size: int = 864
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = False
    seq_len: int = TRAINED_CONTEXT
    batch_size: int = 4  # rows of seq_len per step; shorter rows come proportionally more numerous
    max_steps: int = 5600
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    answer_weight: float = 1.0
    p_corpus: float = 0.3
    task_mix: dict = field(default_factory=lambda: {"passkey": 0.45, "needle": 0.15, "mqar": 0.15,
                                                    "variable_tracking": 0.15, "copy": 0.1})
    # Retrieval first: for short_steps the rows are short_len tokens of pass keys only, where the look-up
    # circuit forms (in the committed lab-target run the answer loss fell below 0.05 by step 300). Diluted, it
    # formed far more slowly: with a tenth of the rows prose and 40% other tasks the answer loss was still at
    # 0.8-1.0 at step 1,100, and a random-token copy warm-up (4,000 possible tokens) left copy accuracy at zero
    # for 640 steps. Then the rows grow to seq_len over grow_steps, and the mixture turns to task_mix/p_corpus.
    short_len: int = 128
    short_steps: int = 1200
    short_p_corpus: float = 0.0
    short_task_mix: dict = field(default_factory=lambda: {"passkey": 1.0})
    grow_steps: int = 1500
    min_task_len: int = 80
    # Pass keys in training carry up to this many decoy numbers in their prose (tasks.DECOYS): the keys the
    # model got wrong without them were the ones whose haystack held numbers ("CHAPTER 30", "1797-98").
    max_decoys: int = 3
    seed: int = 0
    time_budget_s: float = 58 * 60
    eval_every: int = 500
    # Two threads on a quiet machine: 4,360 tokens/s against 2,490 on one (lab-target, 512-token rows, bf16).
    # On two cores shared with other jobs, two OpenMP threads wait on each other; pass --threads 1 there.
    threads: int = 2
    bf16_autocast: bool = True
    # The architecture: "llama" (attention) or "mamba2" (transformers' Mamba2ForCausalLM, chapter 7's lab-mamba;
    # the fields below are Mamba-2's and unused by "llama", whose num_attention_heads/... are unused by it).
    arch: str = "llama"
    state_size: int = 64
    head_dim: int = 64
    expand: int = 2
    n_groups: int = 1
    chunk_size: int = 64


CONFIGS = {
    "lab-target": TrainConfig(),
    "lab-draft": TrainConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=True, max_steps=1500, lr=3e-3,
                             short_steps=300, grow_steps=400, time_budget_s=30 * 60,
                             # With decoys the draft's look-up circuit did not form in its 300 short steps (pass
                             # key 0.00 in every cell, validation perplexity 80.0); without, it scores 0.75-1.00.
                             max_decoys=0),
    # lab-mamba: a Mamba-2 on the same corpus and mixture, sized to train in the ~25 CPU-minutes chapter 7 had
    # (one thread, niced, shared cores): 3.5M parameters against lab-target's 9.1M, about 1/9 of its tokens
    # (the committed run stopped at its 25-minute budget after 591 of 600 steps, 1.2M tokens).
    # The schedule is lab-target's compressed (pass keys first in short rows, then growing to 512 tokens).
    "lab-mamba": TrainConfig(arch="mamba2", hidden_size=256, num_hidden_layers=6, state_size=32, head_dim=64,
                             expand=2, n_groups=1, chunk_size=64, tie_word_embeddings=True, max_steps=600,
                             lr=2e-3, warmup_steps=40, short_steps=250, grow_steps=200, eval_every=200,
                             time_budget_s=25 * 60, threads=1),
    "tiny-mamba": TrainConfig(arch="mamba2", hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16,
                              expand=2, n_groups=1, chunk_size=32, tie_word_embeddings=True, seq_len=128,
                              batch_size=4, max_steps=20, lr=3e-3, warmup_steps=2, short_steps=0, grow_steps=0,
                              eval_every=0, time_budget_s=120, threads=1),
    "tiny": TrainConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, tie_word_embeddings=True, seq_len=128, batch_size=4, max_steps=20,
                        lr=3e-3, warmup_steps=2, short_steps=0, grow_steps=0, eval_every=0, time_budget_s=120,
                        threads=1),
}


def model_config(cfg: TrainConfig, tokenizer):
    """The ``transformers`` config for ``cfg``: a ``LlamaConfig`` (RoPE, RMSNorm, SwiGLU, grouped-query
    attention) or, for ``arch="mamba2"``, a ``Mamba2Config`` (``expand * hidden_size / head_dim`` heads)."""
    from transformers import LlamaConfig, Mamba2Config

    if cfg.arch == "mamba2":
        inner = cfg.expand * cfg.hidden_size
        if inner % cfg.head_dim:
            raise ValueError(f"expand * hidden_size = {inner} must be a multiple of head_dim = {cfg.head_dim}")
        c = Mamba2Config(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            state_size=cfg.state_size, head_dim=cfg.head_dim, expand=cfg.expand, num_heads=inner // cfg.head_dim,
            n_groups=cfg.n_groups, chunk_size=cfg.chunk_size, tie_word_embeddings=cfg.tie_word_embeddings,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        c.lab_trained_context = cfg.seq_len
        return c
    if cfg.arch != "llama":
        raise ValueError(f"arch must be 'llama' or 'mamba2', got {cfg.arch!r}")

    c = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0,
    )
    c.lab_trained_context = cfg.seq_len  # the RoPE chapter reads this: positions beyond it were never trained
    return c


def row_length(cfg: TrainConfig, step: int | None) -> int:
    """Length of the training rows at ``step``: ``short_len`` for the first ``short_steps``, then growing (in
    multiples of 32) to ``seq_len`` over ``grow_steps``; ``seq_len`` when ``step`` is None."""
    short = min(cfg.short_len, cfg.seq_len)
    if step is None or step >= cfg.short_steps + cfg.grow_steps:
        return cfg.seq_len
    if step < cfg.short_steps:
        return short
    grow = (step - cfg.short_steps) / max(1, cfg.grow_steps)
    return min(cfg.seq_len, int(short + grow * (cfg.seq_len - short)) // 32 * 32)


def make_batch(cfg: TrainConfig, tokenizer, rng: random.Random, step: int | None = None):
    """One batch: ``(ids, answers)``, both ``(rows, length)``; ``answers[b, t]`` is True where token ``t`` is an
    answer of a synthetic sample (its loss is averaged separately, see :func:`training_loss`).

    Every step has ``batch_size * seq_len`` tokens; rows are :func:`row_length` long, so short rows come more
    numerous. A row is, with probability ``p_corpus``, a window of the training prose; otherwise it packs
    synthetic retrieval samples (the first of random length up to the whole row, so retrieval is trained at
    every distance), separated by end-of-text, then prose. During the first ``short_steps`` the rows use
    ``short_p_corpus`` and ``short_task_mix`` instead: mostly pass keys, which is where retrieval is learnt.
    """
    train_ids = tasks.corpus_ids(tokenizer, "train")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    length = row_length(cfg, step)
    short = step is not None and step < cfg.short_steps
    p_corpus = cfg.short_p_corpus if short else cfg.p_corpus
    names, probs = zip(*(cfg.short_task_mix if short else cfg.task_mix).items())
    rows, weights = [], []
    for _ in range(cfg.batch_size * cfg.seq_len // length):
        w = [False] * length
        if rng.random() < p_corpus:
            start = rng.randrange(0, len(train_ids) - length)
            ids = [bos] + train_ids[start:start + length - 1].tolist()
        else:
            ids, room = [], length
            while room >= cfg.min_task_len:
                sample = _synthetic(cfg, tokenizer, rng, names, probs, room)
                if ids:
                    sample.ids = [eos] + sample.ids[1:]  # end-of-text separates packed samples
                for a, e in sample.spans:
                    for t in range(a, e):
                        w[len(ids) + t] = True
                ids += sample.ids
                room = length - len(ids)
                if rng.random() < 0.3:
                    break
            if len(ids) < length:
                n = length - len(ids) - 1
                start = rng.randrange(0, len(train_ids) - n)
                ids = ids + [eos] + train_ids[start:start + n].tolist()
        rows.append(ids[:length])
        weights.append(w[:length])
    return torch.tensor(rows), torch.tensor(weights)


def _synthetic(cfg: TrainConfig, tokenizer, rng: random.Random, names, probs, room: int):
    """One synthetic retrieval sample of at most ``room`` tokens, task and shape drawn from the mixture."""
    task = rng.choices(names, probs)[0]
    length = rng.randint(cfg.min_task_len, room)
    kw, need = {}, 80  # need: a little more than the sample's fixed (non-filler) tokens
    if task == "passkey":
        if cfg.max_decoys:  # no draw without decoys: the rng stream, and so the run, stays as it was
            kw["n_decoys"] = rng.randint(0, cfg.max_decoys)
            need = 80 + 14 * kw["n_decoys"]
    elif task == "needle":
        kw["n_distractors"] = rng.randint(0, 4)
        need = 100 + 26 * kw["n_distractors"]
    elif task == "mqar":
        kw["n_pairs"] = rng.randint(2, 12)
        need = 30 + 22 * kw["n_pairs"]
    elif task == "variable_tracking":
        kw["n_hops"] = rng.randint(0, 2)
        need = 100 + 40 * kw["n_hops"]
    elif task == "copy":
        kw["n_words"] = rng.randint(4, 12)
        need = 20 + 3 * kw["n_words"]
    if need > room:
        task, kw = "passkey", {}
    length = max(length, min(need, room))
    try:
        return tasks.make_sample(task, tokenizer, length, rng, split="train", **kw)
    except ValueError:  # a rare draw of long key words overran the estimate: a pass key always fits
        return tasks.make_sample("passkey", tokenizer, room, rng, split="train")


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_loss(logits: torch.Tensor, ids: torch.Tensor, answers: torch.Tensor, answer_weight: float):
    """The training objective: mean next-token loss over prose plus ``answer_weight`` x mean loss over answer
    tokens. Returns ``(loss, per-token nll, answer mask)``, the last two aligned with ``ids[:, 1:]``.

    The answers are a handful of tokens among hundreds; weighting them per token (not per group) left their
    gradient too weak for the retrieval circuit to form in the steps a CPU affords.
    """
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    answer = answers[:, 1:]
    loss = nll[~answer].mean()
    if answer.any():
        loss = loss + answer_weight * nll[answer].mean()
    return loss, nll, answer


def train(cfg: TrainConfig, tokenizer=None, log_path: Path | None = None, verbose: bool = True):
    """Train a fresh model under ``cfg``; return ``(model, log rows, info)``. Deterministic from ``cfg.seed``."""
    from transformers import LlamaForCausalLM, Mamba2ForCausalLM

    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = tokenizer or load_tokenizer()
    rng = random.Random(cfg.seed)
    model = (Mamba2ForCausalLM if cfg.arch == "mamba2" else LlamaForCausalLM)(model_config(cfg, tokenizer))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    log, t0, tokens, stopped_early = [], time.time(), 0, False
    fh = open(log_path, "w", newline="") if log_path else None
    writer = None
    # A bar with the step, the rate and the time left (an hour-long run must say how long it has to go);
    # `verbose=False` (the tests) shows nothing.
    bar = tqdm(total=cfg.max_steps, desc="training", unit="step", disable=not verbose,
               dynamic_ncols=True, mininterval=1.0)
    for step in range(cfg.max_steps):
        if time.time() - t0 > cfg.time_budget_s:
            stopped_early = True
            bar.write(f"stopped at the time budget ({cfg.time_budget_s / 60:.0f} min) after {step} steps")
            break
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        ids, w = make_batch(cfg, tokenizer, rng, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=ids).logits
        loss, nll, answer = training_loss(logits, ids, w, cfg.answer_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tokens += ids.numel()
        row = {"step": step + 1, "loss": float(loss.detach()), "text_loss": float(nll[~answer].mean().detach()),
               "answer_loss": float(nll[answer].mean().detach()) if answer.any() else float("nan"),
               "lr": _lr(cfg, step), "tokens": tokens, "elapsed_s": round(time.time() - t0, 2)}
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            model.eval()
            row["passkey_512"] = tasks.passkey_accuracy(model, tokenizer, cfg.seq_len, [0.0, 0.5, 1.0], n=4,
                                                        seed=1234)
            model.train()
        log.append(row)
        if fh:
            if writer is None:
                writer = csv.DictWriter(fh, fieldnames=list(log[0]) + ["passkey_512"], extrasaction="ignore")
                writer.writeheader()
            writer.writerow(row)
            fh.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", seq=ids.shape[1], refresh=False)
        if "passkey_512" in row:
            bar.write(f"step {step + 1}: pass key at {cfg.seq_len} tokens {row['passkey_512']:.2f}, "
                      f"loss {row['loss']:.3f}")
    bar.close()
    if fh:
        fh.close()
    model.eval()
    info = {"steps": len(log), "tokens": tokens, "train_minutes": round((time.time() - t0) / 60, 2),
            "stopped_at_time_budget": stopped_early}
    return model, log, info


PASSKEY_LENGTHS = (128, 256, 384, 512)
PASSKEY_BEYOND = (768, 1024)
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PASSKEY_DECOYS = 3  # the eval card's second grid: the same pass keys with three other numbers in the prose


def evaluate(model, tokenizer, context_len: int = TRAINED_CONTEXT, n: int = 20, seed: int = 0) -> dict:
    """The eval card's figures for ``model``: validation perplexity and the probe accuracies."""
    torch.set_num_threads(1)
    ppl = tasks.perplexity_by_position(model, tokenizer, context_len, bucket=64)
    grid = tasks.passkey_grid(model, tokenizer, PASSKEY_LENGTHS, PASSKEY_DEPTHS, n=n, seed=seed)
    beyond = tasks.passkey_grid(model, tokenizer, PASSKEY_BEYOND, PASSKEY_DEPTHS, n=max(4, n // 2), seed=seed,
                                batch_size=4)
    decoys = tasks.passkey_grid(model, tokenizer, PASSKEY_LENGTHS, PASSKEY_DEPTHS, n=n, seed=seed,
                                n_decoys=PASSKEY_DECOYS)
    return {
        "validation_perplexity": ppl["overall"],
        "validation_windows": ppl["n_windows"],
        "perplexity_by_position": {"positions": ppl["positions"], "perplexity": ppl["perplexity"]},
        "passkey": {"context_lens": list(PASSKEY_LENGTHS), "depths": list(PASSKEY_DEPTHS), "n": n,
                    "accuracy": grid.tolist(),
                    "accuracy_by_depth": dict(zip(map(str, PASSKEY_DEPTHS), grid.min(1).values.tolist())),
                    "min_inside_trained_context": float(grid.min())},
        "passkey_beyond_trained_context": {"context_lens": list(PASSKEY_BEYOND), "depths": list(PASSKEY_DEPTHS),
                                           "accuracy": beyond.tolist()},
        "passkey_with_decoys": {"context_lens": list(PASSKEY_LENGTHS), "depths": list(PASSKEY_DEPTHS), "n": n,
                                "n_decoys": PASSKEY_DECOYS, "accuracy": decoys.tolist(),
                                "min_inside_trained_context": float(decoys.min())},
        "needle_accuracy": tasks.needle_accuracy(model, tokenizer, context_len, n=2 * n, seed=seed),
        "mqar_accuracy": tasks.mqar_accuracy(model, tokenizer, context_len, n=n, seed=seed),
        "variable_tracking_accuracy": {
            str(h): tasks.variable_tracking_accuracy(model, tokenizer, context_len, n=n, n_hops=h, seed=seed)
            for h in (0, 1, 2)},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: checkpoints/<name>); if it already holds a checkpoint, "
                             "the run writes to <out>-retrained-<n> unless --overwrite is given")
    parser.add_argument("--overwrite", action="store_true",
                        help="train into --out (or checkpoints/<name>) even if it holds a checkpoint")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--time-budget-min", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's, 2)")
    parser.add_argument("--eval-only", action="store_true",
                        help="do not train: re-measure the eval card of the checkpoint in --out (or checkpoints/"
                             "<name>) with the current probes, keeping its training record")
    args = parser.parse_args(argv)
    if args.eval_only:
        return _reevaluate(args.out or CHECKPOINTS / args.name)
    cfg = CONFIGS[args.name]
    if args.max_steps is not None:
        cfg = replace(cfg, max_steps=args.max_steps)
    if args.threads is not None:
        cfg = replace(cfg, threads=args.threads)
    if args.time_budget_min is not None:
        cfg = replace(cfg, time_budget_s=args.time_budget_min * 60)
    out = args.out or CHECKPOINTS / args.name
    if not args.overwrite:
        out = fresh_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"writing the checkpoint to {out}", flush=True)
    if not TOKENIZER_PATH.is_file():
        train_tokenizer()
    tokenizer = load_tokenizer()
    model, log, info = train(cfg, tokenizer, log_path=out / "train_log.csv")
    model.to(torch.float16).save_pretrained(out)
    shutil.copy(TOKENIZER_PATH, out / "tokenizer.json")
    tokenizer.save_pretrained(out)
    card = {"name": args.name, "parameters": sum(p.numel() for p in model.parameters()),
            "trained_context": cfg.seq_len, **info, "train_config": asdict(cfg),
            "final_train_loss": log[-1]["loss"] if log else None}
    _write_card(out, card)


def fresh_folder(out: Path) -> Path:
    """``out`` if it holds no checkpoint yet, else the first free ``<out>-retrained-<n>`` beside it.

    A retrain must not silently replace the shipped models (the chapters' numbers come from them): writing
    over them takes ``--overwrite``.
    """
    out = Path(out)
    if not out.exists() or not any(out.iterdir()):
        return out
    n = 1
    while (candidate := out.with_name(f"{out.name}-retrained-{n}")).exists() and any(candidate.iterdir()):
        n += 1
    return candidate


def _write_card(out: Path, card: dict):
    """Measure the checkpoint in ``out`` as saved (loaded back through :func:`labsrc.models.load`) and write
    ``card`` plus those figures to ``out/eval_card.json``."""
    from labsrc.models import load

    t0 = time.time()
    model, tokenizer = load(str(out))
    card = {**card, **evaluate(model, tokenizer)}
    card["eval_minutes"] = round((time.time() - t0) / 60, 2)
    (out / "eval_card.json").write_text(json.dumps(card, indent=1))
    print(json.dumps({k: v for k, v in card.items() if k not in ("train_config", "perplexity_by_position")},
                     indent=1))


_TRAINING_RECORD = ("name", "parameters", "trained_context", "steps", "tokens", "train_minutes",
                    "stopped_at_time_budget", "train_config", "final_train_loss")


def _reevaluate(out: Path):
    """``--eval-only``: rewrite the eval card of an already trained checkpoint, keeping its training record."""
    path = Path(out) / "eval_card.json"
    if not path.is_file():
        raise FileNotFoundError(f"--eval-only needs a trained checkpoint with an eval card; {path} does not exist")
    old = json.loads(path.read_text())
    _write_card(Path(out), {k: old[k] for k in _TRAINING_RECORD if k in old})


if __name__ == "__main__":
    main()
