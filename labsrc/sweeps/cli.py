"""What every sweep's command shares: its common options, loading the model, and stamping the machine on the
stored result. Each sweep module adds the options of its own axis and methods and builds its scorer."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from labsrc import curves, tasks


def parser(description: str, *, n: int, probes, out: Path) -> argparse.ArgumentParser:
    """An argument parser with ``--n``, ``--probes``, ``--model``, ``--threads``, ``--out`` and ``--overwrite``;
    the sweep adds the options of its axis and its methods."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--n", type=int, default=n, help="probe samples per point")
    p.add_argument("--probes", nargs="+", default=list(probes), choices=tasks.TASKS)
    p.add_argument("--model", default="lab-target")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even when it holds a curve from another run (without it such a run is "
                        "refused: write it elsewhere with --out)")
    return p


def load_model(name: str, threads: int):
    """``(model, tokenizer)`` in eval mode, with torch limited to ``threads`` threads (a stored run records
    them: on a shared machine one thread per run keeps its time honest)."""
    from labsrc import models

    torch.set_num_threads(threads)
    model, tok = models.load(name)
    return model.eval(), tok


def tail(args, default_out: Path) -> str:
    """The options every command line ends with (``--out`` only when it is not the stored file)."""
    return (f"--model {args.model} --threads {args.threads}"
            + ("" if args.out == default_out else f" --out {args.out}"))


def finish(result: dict, out: Path, threads: int, started: float) -> dict:
    """Stamp the machine and the wall time since ``started`` (``time.perf_counter()``) on ``result`` and write
    it to ``out``."""
    from labsrc import runtime

    result["machine"] = {"device": runtime.device_name(), "torch": torch.__version__,
                         "transformers": __import__("transformers").__version__, "threads": threads,
                         "seconds_this_session": round(time.perf_counter() - started)}
    curves.write(out, result)
    return result
