"""Chapter 4's stored curve: every RoPE extension method against the context length, past the trained one.

    python -m labsrc.sweeps.rope                   # the stored run: labsrc/data/results/rope_curve.json
    python -m labsrc.sweeps.rope --n 4 --multiples 1 2 --out /tmp/rope.json   # a small one

``lab-target`` was trained on windows of ``L = model.config.lab_trained_context`` tokens. Each method of
:data:`METHODS` is configured *once*, for the longest length of the sweep (``s = longest / L``, the way a
deployment sets one config; dynamic NTK with factor 1, so its ratio is the input's length over ``L``), through
:func:`labsrc.rope_finetune.set_rope`, and then reads the same ``n`` pass keys (:func:`labsrc.tasks.probe_samples`,
seed 0, keys at depths spread over the whole context) at every length ``x = m L`` for the ``--multiples`` ``m``
(1 to 4 by default). A point is right when greedy decoding gives the whole key (one forward pass,
:func:`labsrc.tasks.score`). Inside ``L`` the model finds nearly every key, so the pass key is the probe that
separates the methods by how far they carry it beyond ``L``.

Beside the curve, the run stores the validation prose's loss per window (``--windows`` non-overlapping windows of
``x`` tokens, the same windows for every method): the mean negative log-likelihood of the whole window and of
its tokens past position ``L``, one number per window, so the chapter can put a Student-t interval on the
perplexity beyond ``L`` (:func:`perplexity_estimate`).
"""
from __future__ import annotations

import functools
import math
import time

import torch
from transformers import modeling_rope_utils as hf_rope
from transformers.models.llama import modeling_llama

from labsrc import claims, curves, rope, tasks
from labsrc import rope_finetune as finetune  # the name the stored curve's fingerprinted Scorer uses
from labsrc.models.stored_runs import models_stamp
from labsrc.sweeps import cli

METHODS = ("default", "linear", "ntk", "dynamic", "yarn")
MULTIPLES = (1.0, 1.5, 2.0, 4.0)
PROBES = ("passkey",)
N = 100
WINDOWS = 8
PATH = curves.RESULTS / "rope_curve.json"


def lengths_for(model, multiples) -> list[int]:
    """The context lengths (tokens) of the multiples ``m`` of the model's trained context ``L``."""
    trained = int(model.config.lab_trained_context)
    return [int(round(m * trained)) for m in multiples]


def method_kwargs(method: str, factor: float) -> dict:
    """:func:`labsrc.finetune.set_rope` arguments for ``method`` configured for the extension ratio ``factor``
    (dynamic NTK gets factor 1: it stretches by the input's own length over ``L``, nothing more)."""
    return {"default": {}, "dynamic": {"factor": 1.0}}.get(method, {"factor": float(factor)})


class Scorer:
    """Scores one point of the curve: a method at a context length on the first ``m`` samples of a probe."""

    def __init__(self, model, tokenizer, longest: int, n: int = N, seed: int = 0):
        self.model, self.tokenizer, self.n, self.seed = model, tokenizer, n, seed
        self.trained = int(model.config.lab_trained_context)
        self.factor = longest / self.trained     # every method configured once, for the longest length

    @functools.cache
    def samples(self, probe: str, length: int) -> list:
        return tasks.probe_samples(probe, self.tokenizer, int(length), self.n, self.seed)

    def use(self, method: str) -> None:
        """Give the model ``method``'s RoPE, configured for the longest length."""
        finetune.set_rope(self.model, method, **method_kwargs(method, self.factor))

    def __call__(self, method: str, length: int, probe: str, m: int | None = None) -> list[bool]:
        samples = self.samples(probe, length)[:m]
        self.use(method)
        try:
            return [all(spans) for spans in tasks.score(self.model, samples)]
        finally:
            finetune.set_rope(self.model, "default")

    @torch.no_grad()
    def window_losses(self, method: str, length: int, windows: int) -> dict:
        """Mean loss (nats per token) of each of ``windows`` validation windows of ``length`` tokens: over the
        whole window (``nll``) and over the tokens predicted at positions ``>= L`` (``nll_beyond``; None when
        the window is no longer than ``L``)."""
        ids = tasks.corpus_ids(self.tokenizer, "validation")
        span = length - 1
        if windows * span > len(ids):
            raise ValueError(f"{windows} windows of {length} tokens do not fit the validation split")
        self.use(method)
        nll, beyond = [], []
        try:
            for w in range(windows):
                x = torch.cat([torch.tensor([self.tokenizer.bos_token_id]), ids[w * span:(w + 1) * span]])[None]
                logits = self.model(input_ids=x).logits.float()
                # loss of the token at position t + 1 predicted from 0..t
                per_tok = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none").double()
                nll.append(float(per_tok.mean()))
                # predicted positions 1..length-1; those >= L are past the trained context
                past = per_tok[self.trained - 1:]
                beyond.append(float(past.mean()) if length > self.trained else None)
        finally:
            finetune.set_rope(self.model, "default")
        return {"nll": nll, "nll_beyond": beyond if length > self.trained else None}


def perplexity_estimate(nlls) -> claims.Estimate:
    """Perplexity from per-window mean losses: ``exp`` of their mean, with the Student-t 95% interval of the
    mean mapped through ``exp`` (the windows, not the tokens, are the independent draws)."""
    e = claims.Estimate.mean(nlls)
    return claims.Estimate(math.exp(e.value), math.exp(e.lo), math.exp(e.hi), e.n, "Student t, exp")


def scoring_code() -> list:
    """Everything whose source decides a point's result (the samples are pinned by their own digest):
    ``transformers``' frequency functions included, since ``set_rope`` lets them compute the tables."""
    return [tasks.score, finetune.set_rope, rope.ntk_base, method_kwargs, Scorer,
            modeling_llama.LlamaRotaryEmbedding, hf_rope.dynamic_rope_update,
            hf_rope._compute_linear_scaling_rope_parameters, hf_rope._compute_dynamic_ntk_parameters,
            hf_rope._compute_yarn_parameters]


def header(scorer: Scorer, model_name: str, probes, lengths, windows: int, command: str) -> dict:
    """What the stored curve depends on; a test recomputes it to tell a stale file."""
    return {"command": command, "model": model_name, "models": models_stamp(model_name),
            "code_version": curves.source_version(*scoring_code()), "trained_context": scorer.trained,
            "factor": scorer.factor, "n": scorer.n, "windows": windows,
            "samples_digest": {p: {str(x): curves.samples_digest(scorer.samples(p, x)) for x in lengths}
                               for p in probes}}


def main(argv=None) -> dict:
    parser = cli.parser("Chapter 4's stored curve: RoPE methods against context length.", n=N, probes=PROBES,
                        out=PATH)
    parser.add_argument("--multiples", nargs="+", type=float, default=list(MULTIPLES),
                        help="context lengths as multiples of the trained context (the largest sets s)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--windows", type=int, default=WINDOWS, help="validation windows per point (0: none)")
    args = parser.parse_args(argv)
    model, tok = cli.load_model(args.model, args.threads)
    lengths = lengths_for(model, args.multiples)
    scorer = Scorer(model, tok, max(lengths), args.n)
    command = (f"python -m labsrc.sweeps.rope --n {args.n} --probes {' '.join(args.probes)} --multiples "
               f"{' '.join(f'{m:g}' for m in args.multiples)} --methods {' '.join(args.methods)} "
               f"--windows {args.windows} {cli.tail(args, PATH)}")
    head = header(scorer, args.model, args.probes, lengths, args.windows, command)
    # The perplexity beside the curve is resumed like the points (same header, same keys); read it before the
    # sweep rewrites the file.
    old = curves.load(args.out, partial=True) if args.out.exists() and not args.overwrite else {}
    key = curves.run_key(head, args.methods, lengths, args.probes)
    ppl = old.get("perplexity", {}) if all(old.get(k) == v for k, v in key.items()) else {}
    t0 = time.perf_counter()
    result = curves.sweep(scorer, args.methods, lengths, args.probes, head, out=args.out,
                          overwrite=args.overwrite)
    result["complete"] = False      # not until the perplexity is in too
    for x in lengths if args.windows else []:
        for method in args.methods:
            key = f"{method}@{x}"
            if key not in ppl:
                t1 = time.perf_counter()
                ppl[key] = {"method": method, "x": x, **scorer.window_losses(method, x, args.windows),
                            "seconds": round(time.perf_counter() - t1, 2)}
                print(f"perplexity x={x} {method}: {perplexity_estimate(ppl[key]['nll'])}")
                result["perplexity"] = ppl
                curves.write(args.out, result)
    result["perplexity"] = ppl
    result["complete"] = True
    return cli.finish(result, args.out, args.threads, t0)


if __name__ == "__main__":
    main()
