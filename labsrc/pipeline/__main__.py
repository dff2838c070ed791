"""``python -m labsrc.pipeline --model lab-target --draft lab-draft --stages 2 --k 4 --schedule overlapped``

Runs pipeline speculative decoding on ``--stages`` processes for a few prompts from the lab's corpus and
prints, per prompt, whether the output equals the target's own greedy decoding, then the time per token and
the bubble fraction of each rank. ``--json PATH`` writes the whole result (timelines included).
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lab-target", help="the target (a shipped name or a folder)")
    parser.add_argument("--draft", default="lab-draft", help="the draft model")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (P)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per window")
    parser.add_argument("--schedule", choices=("plain", "overlapped"), default="overlapped")
    parser.add_argument("--depth", type=int, default=2, help="windows in flight per sequence (overlapped)")
    parser.add_argument("--prompts", type=int, default=3, help="how many prompts (micro-batches)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--verify", choices=("kernel", "reference"), default="kernel",
                        help="the last stage's greedy verification: the Triton kernel or its reference")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a silent rank fails the run")
    parser.add_argument("--json", default=None, help="write the full result here")
    args = parser.parse_args(argv)

    import torch

    from labsrc import pipeline
    from labsrc.models import load
    from labsrc.pipeline import simulate

    model, tok = load(args.model)
    prompts = pipeline.corpus_prompts(tok, args.prompts)
    res = pipeline.sweep(prompts, [dict(k=args.k, schedule=args.schedule, depth=args.depth,
                                        max_new_tokens=args.max_new_tokens)],
                         target=args.model, draft=args.draft, stages=args.stages, verify=args.verify,
                         timeout=args.timeout)[0]
    same = 0
    for i, (p, out) in enumerate(zip(prompts, res["outputs"])):
        ref = model.generate(torch.tensor([p]), max_new_tokens=args.max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        same += out == ref
        print(f"prompt {i}: {len(out)} tokens, {'equal to' if out == ref else 'DIFFERENT from'} "
              f"target.generate")
    n_tok = sum(len(o) for o in res["outputs"])
    print(f"P={args.stages} k={args.k} {args.schedule}: {1e3 * res['wall'] / n_tok:.2f} ms per token, "
          f"{n_tok / res['wall']:.1f} tokens/s over {len(prompts)} sequences (CPU timings if no GPU)")
    for r, events in enumerate(res["timelines"]):
        print(f"  rank {r}: layers {res['layers'][r]}, busy {100 * simulate.busy_fraction(events, res['wall']):.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
