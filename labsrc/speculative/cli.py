"""``python -m labsrc.speculative train-early-exit``: the command line.
"""
from __future__ import annotations

import torch

from labsrc.speculative.self_spec import EARLY_EXIT_DIR, train_early_exit_head


def main(argv=None):
    """``python -m labsrc.speculative train-early-exit [--steps N]``: train and ship lab-target's exit head."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m labsrc.speculative")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train-early-exit", help="train lab-target's early-exit head (body frozen)")
    tr.add_argument("--layer", type=int, default=None)
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--seq-len", type=int, default=256)
    tr.add_argument("--batch-size", type=int, default=4)
    tr.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)
    from labsrc.models import load
    target, tok = load("lab-target")
    layer = target.config.num_hidden_layers // 2 if args.layer is None else args.layer
    EARLY_EXIT_DIR.mkdir(parents=True, exist_ok=True)
    out = EARLY_EXIT_DIR / f"lab-target-L{layer}.safetensors"
    res = train_early_exit_head(target, tok, layer, steps=args.steps, seq_len=args.seq_len,
                                batch_size=args.batch_size, lr=args.lr, out=str(out), log=sys.stdout)
    from labsrc.models.stored_runs import models_stamp
    card = {"target": "lab-target", "models": models_stamp("lab-target"), "layer": layer, "steps": args.steps, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "lr": args.lr, "seconds": round(res["seconds"], 1),
            "torch_threads": torch.get_num_threads(), "kl_first": res["losses"][0],
            "kl_last_25_mean": sum(res["losses"][-25:]) / len(res["losses"][-25:]),
            "losses": [round(x, 5) for x in res["losses"]]}
    (EARLY_EXIT_DIR / f"lab-target-L{layer}.json").write_text(json.dumps(card, indent=1) + "\n")
    print(f"wrote {out}")
