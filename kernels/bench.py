"""The kernel bench harness.

Each kernel family has a module ``kernels/bench_<family>.py`` that registers one entry with
:func:`register`. An entry is a function ``entry(size) -> list[Case]`` for ``size`` in ``"tiny"`` (a smoke run
that the interpreter can do in CI) or ``"gpu"`` (real sizes). A :class:`Case` carries the kernel call, the
PyTorch baseline, a correctness check and the bytes moved / FLOPs done, from which the harness reports
achieved GB/s or TFLOP/s and the fraction of the device's published peak (:mod:`labsrc.hardware`).

    python -m kernels.bench --all --size tiny     # CI smoke, works under the interpreter
    python -m kernels.bench attention --size gpu  # on a GPU box

Results are printed as a table and written as JSON to ``kernels/results/<device>-<size>.json``.
"""
from __future__ import annotations

import sys

if __name__ == "__main__":
    # `python -m kernels.bench` runs this file as __main__; the entry modules import `kernels.bench`, and must
    # register with this same module object, not a second copy.
    sys.modules.setdefault("kernels.bench", sys.modules[__name__])

import argparse
import importlib
import json
import pkgutil
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import labsrc
from labsrc import hardware, runtime

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIZES = ("tiny", "gpu")
_REGISTRY: dict[str, Callable[[str], list["Case"]]] = {}


@dataclass
class Case:
    """One measured configuration of one kernel."""

    label: str                       # e.g. "T=4096 H=8 D=128 fp16"
    kernel: Callable[[], object]     # runs the Triton kernel once
    baseline: Callable[[], object]   # runs the PyTorch baseline once
    check: Callable[[], None]        # raises when the kernel's output is wrong
    bytes_moved: float = 0.0         # minimum bytes the kernel must read + write
    flops: float = 0.0               # floating-point operations of the kernel
    baseline_name: str = "torch"
    extra: dict = field(default_factory=dict)


def register(name: str):
    """Decorator: register ``fn(size) -> list[Case]`` as the bench entry ``name``."""
    def wrap(fn):
        if name in _REGISTRY:
            raise ValueError(f"bench entry {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn
    return wrap


def entries() -> dict[str, Callable[[str], list[Case]]]:
    """Import every ``kernels/bench_*.py`` and return the registered entries by name."""
    package_dir = Path(__file__).resolve().parent
    for info in pkgutil.iter_modules([str(package_dir)]):
        if info.name.startswith("bench_"):
            importlib.import_module(f"kernels.{info.name}")
    return dict(sorted(_REGISTRY.items()))


def time_call(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call: CUDA-event timing via triton.testing.do_bench on a GPU, wall clock on the CPU."""
    if runtime.HAS_CUDA and not runtime.INTERPRETED:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_entry(name: str, size: str, reps: int = 3) -> list[dict]:
    """Run one entry at one size and return a row per case."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if size == "gpu" and runtime.INTERPRETED:
        raise ValueError("--size gpu needs compiled kernels on a GPU; under the interpreter only --size tiny runs")
    registry = entries()
    if name not in registry:
        raise ValueError(f"unknown bench entry {name!r}; known: {sorted(registry)}")
    accel = hardware.lookup(runtime.device_name()) if runtime.HAS_CUDA else None
    rows = []
    for case in registry[name](size):
        case.check()
        t_kernel = time_call(case.kernel, reps)
        t_base = time_call(case.baseline, reps)
        row = dict(entry=name, case=case.label, kernel_ms=t_kernel * 1e3, baseline=case.baseline_name,
                   baseline_ms=t_base * 1e3, speedup=t_base / t_kernel, **case.extra)
        if case.bytes_moved:
            row["GB/s"] = case.bytes_moved / t_kernel / 1e9
            if accel:
                row["frac_peak_bw"] = row["GB/s"] / accel.hbm_gbps
        if case.flops:
            row["TFLOP/s"] = case.flops / t_kernel / 1e12
            if accel:
                row["frac_peak_flops"] = row["TFLOP/s"] / accel.bf16_tflops
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """Rows as an aligned text table."""
    if not rows:
        return "(no results)"
    columns = list(dict.fromkeys(k for r in rows for k in r))
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def save(rows: list[dict], size: str, folder: Path = RESULTS_DIR) -> Path:
    """Write ``rows`` with the runtime stamp to ``<folder>/<device>-<size>.json`` and return the path."""
    folder.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", runtime.device_name().lower()).strip("-")
    path = folder / f"{slug}-{size}.json"
    stamp = dict(device=runtime.device_name(), interpreted=runtime.INTERPRETED, labsrc=labsrc.__version__,
                 torch=labsrc.runtime.torch.__version__, triton=runtime._version("triton"),
                 date=time.strftime("%Y-%m-%d"))
    path.write_text(json.dumps(dict(stamp=stamp, size=size, rows=rows), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help="one bench entry (see --list)")
    parser.add_argument("--all", action="store_true", help="run every entry")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    parser.add_argument("--size", choices=SIZES, default="tiny" if runtime.INTERPRETED else "gpu")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions on the CPU (GPU uses do_bench)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON results")
    args = parser.parse_args(argv)
    registry = entries()
    if args.list:
        print("\n".join(registry))
        return 0
    if args.all == bool(args.name):
        parser.error("give one entry name or --all")
    names = list(registry) if args.all else [args.name]
    rows = [row for name in names for row in run_entry(name, args.size, args.reps)]
    print(format_table(rows))
    print(f"\nwritten to {save(rows, args.size, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
