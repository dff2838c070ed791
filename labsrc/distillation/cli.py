"""``python -m labsrc.distillation``: the command line of both experiments and of shipping a draft (see the package
docstring for the commands)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from labsrc.distillation.finetune import (FINETUNE_DEFAULT, FINETUNE_METHODS, FINETUNE_RESULTS, FinetuneConfig,
                                     FinetuneEval, finetune_experiment, finetune_table, ship_finetuned)
from labsrc.distillation.scratch import METHODS, RESULTS, add_draft_figures, experiment, ship


def main(argv=None):
    parser = argparse.ArgumentParser(description="Distil lab-target into drafts of lab-draft's shape.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("experiment", help="train and score every method and the temperature sweep")
    e.add_argument("--steps", type=int, default=120)
    e.add_argument("--sweep-steps", type=int, default=60)
    e.add_argument("--methods", default=",".join(METHODS))
    e.add_argument("--out", type=Path, default=RESULTS)
    e.add_argument("--save-dir", type=Path, default=None, help="save each method's student here")
    d = sub.add_parser("drafts", help="add each saved student's acceptance and speedup as chapter 10's draft")
    d.add_argument("--students", type=Path, required=True)
    d.add_argument("--out", type=Path, default=RESULTS)
    d.add_argument("--prompts", type=int, default=8)
    s = sub.add_parser("ship", help="train one recipe into checkpoints/lab-draft-distilled")
    s.add_argument("--method", choices=METHODS[1:], default="kd")
    s.add_argument("--steps", type=int, default=120)
    s.add_argument("--T", type=float, default=2.0)
    s.add_argument("--out", type=Path, default=None,
                   help="default: checkpoints/lab-draft-distilled; if it already holds a checkpoint, the run writes "
                        "to <out>-retrained-<n> unless --overwrite is given")
    s.add_argument("--overwrite", action="store_true",
                   help="write into --out (or checkpoints/lab-draft-distilled) even if it holds a checkpoint")
    f = sub.add_parser("finetune-experiment",
                       help="continue lab-draft's training under each loss, for each seed, and measure each")
    f.add_argument("--steps", type=int, default=FinetuneConfig.steps)
    f.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (at least three)")
    f.add_argument("--methods", nargs="+", default=list(FINETUNE_DEFAULT), choices=sorted(FINETUNE_METHODS))
    f.add_argument("--seq-len", type=int, default=FinetuneConfig.seq_len)
    f.add_argument("--batch-size", type=int, default=FinetuneConfig.batch_size)
    f.add_argument("--lr", type=float, default=FinetuneConfig.lr)
    f.add_argument("--warmup-steps", type=int, default=FinetuneConfig.warmup_steps)
    f.add_argument("--beta", type=float, default=FinetuneConfig.beta, help="GKD's beta (default: GKD_BETA)")
    f.add_argument("--policy-frac", type=float, default=FinetuneConfig.policy_frac)
    f.add_argument("--p-corpus", type=float, default=None, help="share of prose rows (default: lab-draft's)")
    f.add_argument("--windows", type=int, default=FinetuneEval.windows)
    f.add_argument("--window-len", type=int, default=FinetuneEval.window_len)
    f.add_argument("--probe-n", type=int, default=FinetuneEval.probe_n)
    f.add_argument("--probe-len", type=int, default=FinetuneEval.probe_len)
    f.add_argument("--prompts", type=int, default=FinetuneEval.prompts)
    f.add_argument("--threads", type=int, default=1)
    f.add_argument("--out", type=Path, default=FINETUNE_RESULTS)
    f.add_argument("--save-dir", type=Path, default=None, help="save each fine-tuned draft here")
    g = sub.add_parser("ship-finetuned", help="ship a fine-tuned lab-draft as lab-draft-distilled if its "
                                              "acceptance beats lab-draft's with separated intervals")
    g.add_argument("--method", required=True, choices=sorted(FINETUNE_METHODS))
    g.add_argument("--results", type=Path, default=FINETUNE_RESULTS)
    g.add_argument("--seed", type=int, default=None, help="which seed's run to ship (default: the first)")
    g.add_argument("--metric", default="alpha_prose", choices=["alpha_prose", "alpha_probe", "alpha_probe_answer"])
    g.add_argument("--out", type=Path, default=None,
                   help="default: checkpoints/lab-draft-distilled; if it already holds a checkpoint, the draft "
                        "goes to <out>-retrained-<n> unless --overwrite is given")
    g.add_argument("--overwrite", action="store_true",
                   help="write into --out (or checkpoints/lab-draft-distilled) even if it holds a checkpoint")
    args = parser.parse_args(argv)
    if args.cmd == "finetune-experiment":
        from labsrc.recall import command_line

        if len(args.seeds) < 3:
            print(f"note: {len(args.seeds)} seed(s); the intervals across seeds (and ship-finetuned) need three")
        cfg = FinetuneConfig(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                             warmup_steps=args.warmup_steps, beta=args.beta, policy_frac=args.policy_frac,
                             p_corpus=args.p_corpus)
        ev = FinetuneEval(windows=args.windows, window_len=args.window_len, probe_n=args.probe_n,
                          probe_len=args.probe_len, prompts=args.prompts)
        command = command_line("labsrc.distillation", f, args).replace(
            "python -m labsrc.distillation", "python -m labsrc.distillation finetune-experiment", 1)
        results = finetune_experiment(args.methods, args.seeds, cfg, ev, out=args.out, command=command,
                                      threads=args.threads, save_dir=args.save_dir)
        print(finetune_table(results))
        return 0
    if args.cmd == "ship-finetuned":
        card = ship_finetuned(args.method, args.results, seed=args.seed, metric=args.metric, out=args.out,
                              overwrite=args.overwrite)
        return 0 if card is not None else 1
    if args.cmd == "experiment":
        experiment(args.steps, args.sweep_steps, methods=tuple(args.methods.split(",")), out=args.out,
                   save_dir=args.save_dir)
    elif args.cmd == "drafts":
        add_draft_figures(args.students, args.out, n_prompts=args.prompts)
    else:
        card = ship(args.method, args.steps, args.T, args.out, overwrite=args.overwrite)
        print(json.dumps({k: card[k] for k in ("validation_perplexity", "train_minutes", "distillation")},
                         indent=1))

