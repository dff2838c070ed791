"""The first GPU hour as one command: ``python -m labsrc.gpucheck --all`` (``make gpu-check``).

On a CUDA machine the plan, in one process and in this order:

1. **fails fast**: it stops at once, before any long step, when there is no CUDA device, when Triton is
   interpreting, or when the smallest kernel (the KV-store copy) does not run and match its reference;
2. **measures the peak bandwidth** the device reaches: a 1 GiB device-to-device copy (``Tensor.copy_``)
   timed by the bench's own timer, so "fraction of peak" can be read against what this machine does, not
   only against the published figure;
3. **checks and times every kernel** (:mod:`labsrc.bench` at ``--size gpu``): each case runs its correctness
   check against the PyTorch reference before it is timed against its baseline (SDPA, torch, transformers),
   in TFLOP/s or GB/s and as a fraction of the published peak and of the measured bandwidth. A failing entry
   is recorded with its error and the plan goes on to the next;
4. **executes the GPU profile of chapters 3 and 5** (``LAB_PROFILE=gpu``), which writes their ledger rows;
5. writes ``kernels/results/<device>-gpu.json`` (read by the book's "Kernel bench" page) and a one-page summary
   ``kernels/results/<device>-gpu.md``.

Each step records its wall time; the whole plan is meant to take at most 8 minutes on one H100/H200.

``--dry-run`` runs the same plan without a GPU: the kernels under the interpreter at the bench's ``tiny``
sizes, the copy at a few MiB, and the chapters step listed but not executed (CI already executes every
chapter at the CPU profile; re-executing two of them here would double that cost). Its files are named
``<device>-dry-run.*`` and go to a temporary folder unless ``--out`` says otherwise: interpreter timings
measure NumPy, so they are never committed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from labsrc import bench, runtime

CHAPTERS = ("chapters/03_flash_attention.ipynb", "chapters/05_kv_quant.ipynb")
_ROOT = Path(__file__).resolve().parents[2]


def preflight(dry_run: bool) -> None:
    """Raise at once when the plan cannot give GPU figures (or, in a dry run, when it cannot run at all)."""
    if not dry_run:
        if not runtime.HAS_CUDA:
            raise SystemExit("--all needs a CUDA device (torch.cuda.is_available() is False); use --dry-run")
        if runtime.INTERPRETED:
            raise SystemExit("TRITON_INTERPRET is set: unset it to time compiled kernels")
    for case in bench.entries()["kv_store"]("tiny"):
        case.check()   # compiles (or interprets) one kernel and compares it with its reference


def copy_bandwidth(dry_run: bool) -> float:
    """GB/s of a device-to-device copy (read + write counted), timed like every bench case."""
    n = (4 if dry_run else 1024) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=runtime.DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = bench.time_call(lambda: dst.copy_(src), reps=3)
    return 2 * n / seconds / 1e9


def run_bench(size: str, measured_gbps: float, only: str | None, log=print) -> tuple[list, list]:
    """Every bench entry at ``size``: its rows and, for entries that raised, ``{entry, error}``."""
    rows, errors = [], []
    names = [n for n in bench.entries() if not only or any(part in n for part in only.split(","))]
    for i, name in enumerate(names, 1):
        start = time.perf_counter()
        try:
            entry_rows = bench.run_entry(name, size)
        except Exception as exc:   # keep going: the next kernel's figures are worth having
            errors.append(dict(entry=name, error=f"{type(exc).__name__}: {exc}"[:2000],
                               traceback=traceback.format_exc()[-4000:]))
            log(f"[{i}/{len(names)}] {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            continue
        for row in entry_rows:
            if "GB/s" in row and measured_gbps:
                row["frac_measured_bw"] = row["GB/s"] / measured_gbps
        rows += entry_rows
        log(f"[{i}/{len(names)}] {name}: {len(entry_rows)} cases in {time.perf_counter() - start:.1f} s")
    return rows, errors


def run_chapters(dry_run: bool, log=print) -> list[dict]:
    """Execute chapters 3 and 5 at the GPU profile (ledger rows written by the notebooks themselves)."""
    done = []
    for nb in CHAPTERS:
        if dry_run:
            exists = (_ROOT / nb).is_file()
            done.append(dict(chapter=nb, executed=False, error=None if exists else "notebook not found",
                             note="listed only in a dry run"))
            continue
        start = time.perf_counter()
        out = Path(tempfile.mkdtemp()) / Path(nb).name
        env = dict(os.environ, LAB_PROFILE="gpu")
        result = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                                 "--ExecutePreprocessor.timeout=600", "--output", str(out), str(_ROOT / nb)],
                                env=env, cwd=_ROOT, capture_output=True, text=True)
        done.append(dict(chapter=nb, executed=result.returncode == 0, seconds=time.perf_counter() - start,
                         error=None if result.returncode == 0 else result.stderr[-2000:]))
        log(f"{nb}: {'executed' if result.returncode == 0 else 'FAILED'} in {done[-1]['seconds']:.0f} s")
    return done


def summary(result: dict) -> str:
    """The one-page Markdown summary of a plan's result."""
    s = result["stamp"]
    lines = [f"# GPU check: {s['device']} ({s['date']})", "",
             f"{'Dry run under the interpreter (timings measure NumPy, not a GPU). ' if result['dry_run'] else ''}"
             f"torch {s['torch']}, triton {s['triton']}, labsrc {s['labsrc']}; "
             f"{result['seconds']:.0f} s in all.", "",
             f"Measured copy bandwidth: {result['copy_gbps']:.1f} GB/s.", "",
             f"## Kernels: {len(result['rows'])} cases checked and timed, {len(result['errors'])} entries failed", ""]
    lines += ["```text", bench.format_table(result["rows"]), "```", ""]
    for err in result["errors"]:
        lines.append(f"- **{err['entry']}** failed: `{err['error'][:300]}`")
    lines += ["", "## Chapters at the GPU profile", ""]
    for ch in result["chapters"]:
        state = "executed" if ch["executed"] else (ch.get("note") or "FAILED")
        lines.append(f"- `{ch['chapter']}`: {state}" + (f" ({ch['error'][:200]})" if ch["error"] else ""))
    return "\n".join(lines) + "\n"


def run(dry_run: bool, out: Path | None, only: str | None = None, log=print) -> dict:
    """Run the plan; write ``<device>-gpu.json`` (``-dry-run`` in a dry run) and its summary; the result."""
    start = time.perf_counter()
    preflight(dry_run)
    gbps = copy_bandwidth(dry_run)
    log(f"copy bandwidth: {gbps:.1f} GB/s")
    rows, errors = run_bench("tiny" if dry_run else "gpu", gbps, only, log)
    chapters = run_chapters(dry_run, log) if not only else []
    folder = out or (Path(tempfile.mkdtemp(prefix="gpucheck-")) if dry_run else bench.RESULTS_DIR)
    extra = dict(dry_run=dry_run, copy_gbps=gbps, errors=errors, chapters=chapters,
                 seconds=time.perf_counter() - start)
    path = bench.save(rows, "dry-run" if dry_run else "gpu", folder, **extra)
    result = json.loads(path.read_text())
    path.with_suffix(".md").write_text(summary(result))
    result["path"] = str(path)
    log(f"written to {path} and {path.with_suffix('.md')}")
    return result


def main(args) -> int:
    result = run(args.dry_run, args.out, args.only)
    failed = result["errors"] or [c for c in result["chapters"] if c["error"]]
    return 1 if failed else 0
