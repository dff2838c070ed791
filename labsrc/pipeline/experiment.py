"""The chapter's timing sweep: ``python -m labsrc.pipeline.experiment [--out PATH]``.

For ``P`` in the profile's ``exp_stages`` (one launch each) it runs every ``k`` in ``exp_ks`` with three
schedules (``plain``; ``overlapped`` with one window in flight per sequence, i.e. micro-batches only;
``overlapped`` with two, i.e. also speculating that a window is fully accepted), ``exp_reps`` times each, on
the profile's prompts, and checks every output against ``target.generate``. It also times plain greedy
decoding of the target (the speed-up's denominator). Results go to ``labsrc/pipeline/results/<profile>.json``
(small: per run the time per token, the bubble fraction, the measured stage, draft and transfer times, the
acceptance counts; the timelines of one run per ``P`` and schedule at ``live_k``), which the chapter plots
when its profile cannot afford the sweep. On a CPU these are CPU timings of processes that share the cores
they run on; the file records the machine's load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from labsrc.models.stored_runs import models_stamp

RESULTS = Path(__file__).resolve().parent / "results"


def acceptance_counts(windows) -> tuple[int, int]:
    """``(accepted drafts, draft trials)`` over verified windows: each window contributes its accepted
    drafts, plus one trial more when it stopped at a rejection (the i.i.d. model's likelihood)."""
    acc = trials = 0
    for w in windows:
        if w["kind"] != "window":
            continue
        acc += w["accepted"]
        trials += w["accepted"] + (0 if w["full"] else 1)
    return acc, trials


def summarise(res: dict) -> dict:
    """The numbers of one run that the chapter uses (no timelines)."""
    from labsrc.pipeline import simulate as sim

    n_tok = sum(len(o) for o in res["outputs"])
    st = sim.stage_times_from(res["timelines"], res["k"])
    acc, trials = acceptance_counts(res["windows"])
    return dict(stages=res["stages"], k=res["k"], schedule=res["schedule"], depth=res["depth"], wall=res["wall"],
                tokens=n_tok, time_per_token=res["wall"] / n_tok,
                bubble=sim.bubble_fraction(res["timelines"], res["wall"]),
                busy=[sim.busy_fraction(ev, res["wall"]) for ev in res["timelines"]],
                stage_times=st["stage_times"], draft_time=st["draft_time"], comm=res["comm"],
                accepted=acc, trials=trials, windows=sum(w["kind"] == "window" for w in res["windows"]),
                discarded=len(res["discarded"]), layers=res["layers"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.pipeline.experiment", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="where to write (default labsrc/pipeline/results/<profile>.json)")
    args = parser.parse_args(argv)

    import torch

    import labsrc
    from labsrc import pipeline, runtime
    from labsrc.models import load

    s = labsrc.sizes("pipeline")
    target, tok = load("lab-target", device=runtime.DEVICE)
    prompts = pipeline.corpus_prompts(tok, s.prompts, length=s.prompt_len)
    refs = [target.generate(torch.tensor([p], device=runtime.DEVICE), max_new_tokens=s.new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
            for p in prompts]
    ar = []
    for _ in range(s.exp_reps):
        t = time.perf_counter()
        for p in prompts:
            target.generate(torch.tensor([p], device=runtime.DEVICE), max_new_tokens=s.new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=tok.pad_token_id)
        ar.append((time.perf_counter() - t) / (len(prompts) * s.new_tokens))
    schedules = [("plain", 1), ("overlapped", 1), ("overlapped", 2)]
    load_before = os.getloadavg()
    runs, timelines = [], []
    for P in s.exp_stages:
        jobs = [dict(k=k, schedule=sch, depth=d, max_new_tokens=s.new_tokens)
                for rep in range(s.exp_reps) for k in s.exp_ks for sch, d in schedules]
        t = time.perf_counter()
        results = pipeline.sweep(prompts, jobs, stages=P, verify="reference", timeout=600)
        print(f"P={P}: {len(jobs)} runs in {time.perf_counter() - t:.0f} s", flush=True)
        for i, res in enumerate(results):
            row = summarise(res)
            row.update(rep=i // (len(s.exp_ks) * len(schedules)), same_as_generate=res["outputs"] == refs)
            runs.append(row)
            if row["rep"] == 0 and res["k"] == s.live_k:
                timelines.append(dict(stages=P, k=res["k"], schedule=res["schedule"], depth=res["depth"],
                                      wall=res["wall"], timelines=res["timelines"], discarded=res["discarded"]))
    out = dict(models=models_stamp("lab-target"), meta=dict(profile=runtime.PROFILE, device=str(runtime.DEVICE), machine=platform.machine(),
                         cores=os.cpu_count(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                         load_before=list(load_before), load_after=list(os.getloadavg()),
                         prompts=len(prompts), new_tokens=s.new_tokens, verify="reference",
                         command="python -m labsrc.pipeline.experiment"),
               ar_time_per_token=ar, runs=runs, timelines=timelines)
    path = Path(args.out) if args.out else RESULTS / f"{runtime.PROFILE}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=0))
    print(f"written to {path}; outputs equal to target.generate in "
          f"{sum(r['same_as_generate'] for r in runs)} of {len(runs)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
