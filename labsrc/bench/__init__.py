"""The kernel bench: every Triton kernel of the lab timed against PyTorch, from any directory.

    python -m labsrc.bench --list                  # the entries below
    python -m labsrc.bench --all --size tiny       # CI smoke run, works under the interpreter
    python -m labsrc.bench --all --size gpu        # on a GPU box: real sizes, results saved for the book
    python -m labsrc.bench flash_attention --size gpu

The entries, one module per kernel family in this package (``labsrc/bench/<family>.py``):

* ``kv_store`` (:mod:`labsrc.bench.kv_cache`): the slot-addressed cache write, in GB/s;
* ``flash_attention``, ``flash_attention_backward``, ``decode_attention`` (:mod:`labsrc.bench.flash_attention`):
  prefill forward and backward in TFLOP/s, flash-decoding in GB/s of K/V read;
* ``rope`` (:mod:`labsrc.bench.rope`): rotating queries and keys, in GB/s;
* ``kvquant_pack``, ``kvquant_decode`` (:mod:`labsrc.bench.kv_quant`): quantize-and-pack and attention straight
  from the packed INT4/INT8 cache;
* ``paged_decode_attention`` (:mod:`labsrc.bench.serving`): decode through block tables against dense
  flash-decoding, in GB/s of K/V read.
* ``knn_memory_attention`` (:mod:`labsrc.bench.memory`): the Memorizing Transformer's gated local + retrieved-row
  attention, in GB/s.
* ``chunk_linear_attention``, ``chunk_gated_delta_rule`` (:mod:`labsrc.bench.linear_attention`): chunked
  linear attention and Gated DeltaNet in TFLOP/s, against FlashAttention at the same length and against
  the token-by-token PyTorch form.
* ``linear_scan``, ``selective_scan``, ``ssd`` (:mod:`labsrc.bench.ssm`): the state-space scans, in GB/s
  (``ssd`` also in TFLOP/s).
* ``int4_matmul``, ``mxfp4_matmul`` (:mod:`labsrc.bench.weight_quant`): W4A16 and MXFP4 GEMMs dequantizing in
  registers, GB/s of weight bytes and TFLOP/s beside ``torch.matmul`` on the dequantized 16-bit weight.
* ``tree_attention`` (:mod:`labsrc.bench.speculative`): verifying a speculative draft tree (its queries
  against the cached prefix and their ancestors) in one launch, in GB/s;
* ``greedy_verify`` (:mod:`labsrc.bench.pipeline`): the last pipeline stage's greedy verification (argmax of
  each window row, compare with the drafts, accepted length), in GB/s of logits read.
* ``diff_attention`` (:mod:`labsrc.bench.frontier`): differential attention's two softmaxes fused in one kernel,
  in TFLOP/s, against two calls of ``flash_attention`` and a subtraction.
* ``kd_kl``, ``kd_kl_backward`` (:mod:`labsrc.bench.distillation`): the fused distillation loss (temperature
  softmaxes and their KL in one pass over the vocabulary) and its backward, in GB/s.

Each module registers its entries with :func:`register`: a function ``entry(size) -> list[Case]`` for
``size`` in ``"tiny"`` (a smoke run that the interpreter can do in CI) or ``"gpu"`` (real sizes). A
:class:`Case` carries the kernel call, the PyTorch baseline, a correctness check and the bytes moved / FLOPs
done, from which the harness reports achieved GB/s or TFLOP/s and the fraction of the device's published
peak (:mod:`labsrc.hardware`). Each case is printed as it finishes.

Results are written as JSON to ``kernels/results/<device>-<size>.json`` in a source checkout (the folder the
book's "Kernel bench" page renders), or to ``./kernel-results/`` when the lab is installed from a wheel.
(The bench lives in ``labsrc`` rather than a top-level ``kernels`` package: installing a package of that
name would shadow Hugging Face's ``kernels``, which ``transformers`` looks for.)
"""
from __future__ import annotations

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

_CHECKOUT = Path(__file__).resolve().parents[2]
RESULTS_DIR = (_CHECKOUT / "kernels" / "results" if (_CHECKOUT / "labsrc").is_dir() and (_CHECKOUT / "kernels").is_dir()
               else Path.cwd() / "kernel-results")
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
    """Import every entry module of this package (``labsrc/bench/<family>.py``); the entries by name."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
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


def save(rows: list[dict], size: str, folder: Path = RESULTS_DIR, **extra) -> Path:
    """Write ``rows`` with the runtime stamp to ``<folder>/<device>-<size>.json`` and return the path.

    ``extra`` adds fields to the file (``labsrc.gpucheck`` adds the measured bandwidth, the failed entries
    and the chapters it executed)."""
    folder.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", runtime.device_name().lower()).strip("-")
    path = folder / f"{slug}-{size}.json"
    stamp = dict(device=runtime.device_name(), interpreted=runtime.INTERPRETED, labsrc=labsrc.__version__,
                 torch=labsrc.runtime.torch.__version__, triton=runtime._version("triton"),
                 date=time.strftime("%Y-%m-%d"))
    path.write_text(json.dumps(dict(stamp=stamp, size=size, rows=rows, **extra), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.bench", description=__doc__.split("\n\n")[0])
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
    rows = []
    for i, name in enumerate(names, 1):
        # Each entry says when it starts and each case when it is done: a GPU run takes minutes.
        print(f"[{i}/{len(names)}] {name} ({args.size})", flush=True)
        for row in run_entry(name, args.size, args.reps):
            print(f"    {row['case']}: kernel {row['kernel_ms']:.3g} ms, {row['baseline']} {row['baseline_ms']:.3g} ms",
                  flush=True)
            rows.append(row)
    print()
    print(format_table(rows))
    print(f"\nwritten to {save(rows, args.size, args.out)}")
    return 0

