"""Chapter 12's stored run (``python -m labsrc.weight_quant``): every configuration on the lab's model, its
loss, bytes and probe accuracy.
"""
from __future__ import annotations

import copy
import math

import torch

from labsrc.models import context_len as probe_context  # the probes' length, one rule for the lab
from labsrc.weight_quant.awq import apply_awq, awq_search_scales
from labsrc.weight_quant.gptq import gptq_quantize, hessian
from labsrc.weight_quant.model import (activation_outliers, calibration_ids, collect_linear_inputs, int8_model,
                                       linear_layers, model_weight_bytes, qat_mxfp4, quantize_model, window_nll)
from labsrc.kernels.weight_quant.rtn import dequantize, layer_output_error, quantize_rtn


PROBES = ("needle", "variable_tracking")
"""The in-context probes every configuration of :func:`run_experiment` is scored on (eval-card settings:
the needle with 3 distractors, variable tracking over 2 hops; :data:`labsrc.models.train.PROBE_SETTINGS`).

Why these two: they are the eval card's probes that lab-target answers about half the time in full
precision (see its eval card), so a configuration can move them either way, and each sample is one
right-or-wrong answer, so every point has a Wilson interval. The pass key is saturated, and MQAR and passage
copying score fractions of a sample (no Wilson interval); and the budget allows two probes: at n = 100 one
probe costs 40-70 s per configuration (one thread of a busy 2-core CPU, 921-token samples; LLM.int8()'s
split product is several times slower), and the run scores 16 configurations: the stored run took 42
minutes, nice'd on a 2-core machine shared with a training run."""


ONE_ANSWER_PROBES = ("passkey", "needle", "variable_tracking")
"""The eval-card probes whose samples are each one right-or-wrong answer (what :func:`score_probes` counts)."""


def probe_sets(tokenizer, probes, context_len: int, n: int = 100, seed: int = 0) -> dict:
    """``{probe: samples}``: the eval card's ``n`` samples at ``context_len`` tokens of each probe of
    ``probes`` (names from :data:`ONE_ANSWER_PROBES`; :func:`labsrc.models.train.probe_set`), drawn by the
    probes' own seeded generators (validation split, seeded by the probe's name and ``seed``, never by
    training's seed), so the full-precision model's answers are its eval card's, sample for sample."""
    from labsrc.models import train

    if not probes or any(p not in ONE_ANSWER_PROBES for p in probes):
        raise ValueError(f"probes must name eval-card probes with one right-or-wrong answer per sample "
                         f"({', '.join(ONE_ANSWER_PROBES)}; MQAR and passage copying score fractions of a "
                         f"sample), got {probes!r}")
    return {p: train.probe_set(tokenizer, p, context_len, n, seed) for p in probes}


def score_probes(model, sets: dict) -> dict[str, list[int]]:
    """``{probe: per-sample 1/0}``: whether greedy decoding answers each sample right (every answer span of
    it; these probes have one)."""
    from labsrc import tasks

    return {p: [int(all(r)) for r in tasks.score(model, samples)] for p, samples in sets.items()}


def run_experiment(model_name: str = "lab-target", calib_windows: int = 4, calib_len: int = 512,
                   eval_windows: int = 8, eval_len: int = 512, probe_n: int = 100, probes=PROBES,
                   probe_seed: int = 0, qat_steps: int = 60, qat_lr: float = 1e-4, seed: int = 0, log=print,
                   reuse: dict | None = None) -> dict:
    """The chapter's experiment: lab-target under every method; per-window losses and per-sample probe answers.

    Returns a JSON-ready dict: ``configs`` (name -> ``bytes`` of the decoder linears as stored, ``nll`` per
    evaluation window, ``probes``: for each probe of ``probes`` the 1/0 answer of each of its ``probe_n``
    samples at ``probe_ctx`` tokens, 0.9 of the trained context; ``seconds`` it took), ``weights`` (the
    number of decoder linear weights, so bits per weight is ``8 * bytes / weights``), the QAT loss curves,
    the layer-wise output errors of RTN, GPTQ and AWQ (4 bits, g128) on held-out activations, and the
    activation outlier ratios. ``seed`` draws the calibration and evaluation windows and the fine-tuning;
    ``probe_seed`` is the probes' own (the eval card's is 0), so the fp32 answers are the eval card's.

    The configurations run from 32 bits down to 2 (RTN and GPTQ at 4, 3 and 2 bits with groups of 128),
    so the probes trace a curve across bits instead of one saturated point.

    ``reuse``: an earlier result with the same settings; configurations (and the layer errors) it already
    holds are taken from it instead of being recomputed. Every step is deterministic (seeded windows,
    calibration and fine-tuning; one thread), so this gives the numbers a full run gives.
    """
    import time

    from labsrc import models
    from labsrc.curves import samples_digest

    model, tok = models.load(model_name)
    calib = calibration_ids(tok, calib_windows, calib_len, "train", seed)
    evals = calibration_ids(tok, eval_windows, eval_len, "validation", seed + 1)
    probe_ctx = probe_context(model)
    sets = probe_sets(tok, tuple(probes), probe_ctx, probe_n, probe_seed)
    result = {"model": model_name, "calib_windows": calib_windows, "calib_len": calib_len,
              "eval_windows": eval_windows, "eval_len": eval_len, "probe_ctx": probe_ctx,
              "probe_n": probe_n, "probe_seed": probe_seed, "probes": list(probes),
              "probe_samples_digest": {p: samples_digest(s) for p, s in sets.items()}, "configs": {}}
    old = {}
    if reuse is not None:
        same = all(reuse.get(k) == v for k, v in result.items() if k != "configs") \
            and reuse.get("qat_steps", qat_steps) == qat_steps
        if not same:
            raise ValueError("reuse holds a result with other settings; run without it")
        old = reuse.get("configs", {})
    result["qat_steps"] = qat_steps
    result["weights"] = sum(m.weight.numel() for _, m in linear_layers(model))

    def add(name, make):
        if name in old:
            result["configs"][name] = old[name]
            log(f"{name}: reused")
            return
        t = time.time()
        m, nbytes = make()
        nll = window_nll(m, evals)
        answers = score_probes(m, sets)
        result["configs"][name] = {"bytes": int(nbytes), "nll": nll.tolist(), "probes": answers,
                                   "seconds": round(time.time() - t, 1)}
        right = ", ".join(f"{p} {sum(a)}/{len(a)}" for p, a in answers.items())
        log(f"{name}: {nbytes} bytes, ppl {math.exp(float(nll.mean())):.3f}, {right} "
            f"({time.time() - t:.0f}s)")

    add("fp32", lambda: (model, model_weight_bytes(model, 4)))
    add("fp16", lambda: (copy.deepcopy(model).half().float(), model_weight_bytes(model, 2)))
    add("LLM.int8", lambda: int8_model(model))
    add("RTN INT8", lambda: quantize_model(model, "rtn", bits=8, group_size=None))
    add("RTN INT4 per-channel", lambda: quantize_model(model, "rtn", bits=4, group_size=None))
    add("RTN INT4 g128", lambda: quantize_model(model, "rtn", bits=4, group_size=128))
    add("GPTQ INT4 g128", lambda: quantize_model(model, "gptq", calib, bits=4, group_size=128))
    add("AWQ INT4 g128", lambda: quantize_model(model, "awq", calib, bits=4, group_size=128))
    add("RTN INT3 g128", lambda: quantize_model(model, "rtn", bits=3, group_size=128))
    add("GPTQ INT3 g128", lambda: quantize_model(model, "gptq", calib, bits=3, group_size=128))
    add("RTN INT2 g128", lambda: quantize_model(model, "rtn", bits=2, group_size=128))
    add("GPTQ INT2 g128", lambda: quantize_model(model, "gptq", calib, bits=2, group_size=128))
    add("MXFP4 PTQ", lambda: quantize_model(model, "mxfp4"))
    mx_bytes = quantize_model(model, "mxfp4")[1]
    if qat_steps:
        for name, fq in (("MXFP4 QAT", True), ("MXFP4 PTQ after FP fine-tune", False)):
            needed = [name] + ([] if fq else ["FP fine-tune"])
            if all(n in old for n in needed) and name in (reuse or {}).get("qat_losses", {}):
                result.setdefault("qat_losses", {})[name] = reuse["qat_losses"][name]
                for n in needed:
                    add(n, None)
                continue
            t = time.time()
            m, losses, fp_tuned = qat_mxfp4(model, tok, qat_steps, qat_lr, fake_quant=fq, seed=seed)
            result.setdefault("qat_losses", {})[name] = losses
            log(f"{name}: {qat_steps} steps in {time.time() - t:.0f}s")
            old.pop(name, None)
            add(name, lambda: (m, mx_bytes))
            if not fq:  # the fine-tuned model itself, unquantized: QAT's full-precision reference
                old.pop("FP fine-tune", None)
                add("FP fine-tune", lambda: (fp_tuned, model_weight_bytes(model, 4)))
    if reuse is not None and "layer_errors" in reuse and "outlier_ratio" in reuse:
        result["layer_errors"], result["outlier_ratio"] = reuse["layer_errors"], reuse["outlier_ratio"]
        return result
    # layer-wise output error on held-out activations (the evaluation windows) of the fp model
    held = collect_linear_inputs(model, evals[:2])
    calib_acts = collect_linear_inputs(model, calib)
    errs = {"RTN": [], "GPTQ": [], "AWQ": []}
    names = []
    for name, mod in linear_layers(model):
        w, xc, xh = mod.weight.detach().float(), calib_acts[name], held[name]
        names.append(name)
        errs["RTN"].append(layer_output_error(w, dequantize(quantize_rtn(w, 4, 128)), xh))
        errs["GPTQ"].append(layer_output_error(w, dequantize(gptq_quantize(w, hessian(xc), 4, 128)), xh))
        s = awq_search_scales(w, xc, 4, 128)
        errs["AWQ"].append(layer_output_error(w, dequantize(apply_awq(w, s, 4, 128)) / s, xh))
    result["layer_errors"] = {"layers": names, **errs}
    result["outlier_ratio"] = activation_outliers(model, evals[:2])
    return result


def main(argv=None) -> None:
    """``python -m labsrc.weight_quant [--out PATH] [--qat-steps N] ...``: run :func:`run_experiment` and
    write its JSON (the chapter's stored results, ``labsrc/data/results/weight_quant.json`` by default)."""
    import argparse
    import json
    from pathlib import Path

    from labsrc.models.stored_runs import models_stamp

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default=str(RESULTS_PATH))
    parser.add_argument("--eval-windows", type=int, default=24)
    parser.add_argument("--probe-n", type=int, default=100, help="samples per probe and configuration")
    parser.add_argument("--probes", nargs="+", default=list(PROBES),
                        help=f"eval-card probes to score every configuration on (default: {' '.join(PROBES)})")
    parser.add_argument("--calib-windows", type=int, default=8)
    parser.add_argument("--qat-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse", action="store_true",
                        help="keep the configurations already in --out (same settings) and compute the rest")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reuse = json.loads(Path(args.out).read_text()) if args.reuse and Path(args.out).is_file() else None
    result = run_experiment(calib_windows=args.calib_windows, eval_windows=args.eval_windows,
                            probe_n=args.probe_n, probes=tuple(args.probes), qat_steps=args.qat_steps,
                            log=lambda m: print(m, flush=True), reuse=reuse)
    result["command"] = (f"python -m labsrc.weight_quant --eval-windows {args.eval_windows} --probe-n "
                         f"{args.probe_n} --probes {' '.join(args.probes)} --calib-windows "
                         f"{args.calib_windows} --qat-steps {args.qat_steps}")
    result["models"] = models_stamp("lab-target")  # labsrc.models.stored_runs: tells a stale file
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


RESULTS_PATH = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "results" / "weight_quant.json"
