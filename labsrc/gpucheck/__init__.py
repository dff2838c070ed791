"""GPU readiness without a GPU, and one command for the first GPU hour.

    python -m labsrc.gpucheck --compile-only --out FILE   # no GPU needed: every kernel for sm_80 and sm_90
    python -m labsrc.gpucheck --all                       # on a CUDA machine (also: make gpu-check)
    python -m labsrc.gpucheck --dry-run                   # the same plan at tiny sizes, under the interpreter

``--compile-only`` (:mod:`labsrc.gpucheck.compile`) compiles every launchable ``@triton.jit`` kernel of
:mod:`labsrc.kernels` (found by reading the package, :mod:`labsrc.gpucheck.discover`) for Ampere and Hopper with
the configurations the GPU profile and the autotune lists use, and writes one JSON row per kernel,
architecture, configuration and dtype: registers, spills, shared memory, tensor-core instructions. It exits
with status 1 when a row did not compile, spills, exceeds the architecture's shared memory or lacks the
tensor-core instructions its ``tl.dot`` should give.

``--all`` and ``--dry-run`` (:mod:`labsrc.gpucheck.plan`) run the GPU plan: every kernel against its reference,
every kernel timed against its PyTorch baseline (the kernel bench, :mod:`labsrc.bench`), the GPU profile of
chapters 3 and 5, and the results file with a one-page summary.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from labsrc import runtime


def _compile_only(args) -> int:
    if runtime.INTERPRETED:
        # Triton decided to interpret when it was imported: compile in a fresh process that says otherwise.
        # FP fusion stays on, as Triton 3.9 defaults to (set here, it also silences 3.9's notice that the default
        # will change).
        env = dict(os.environ, TRITON_INTERPRET="0")
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        return subprocess.run([sys.executable, "-m", "labsrc.gpucheck", *sys.argv[1:]], env=env).returncode
    import triton

    from labsrc.gpucheck.compile import compile_all
    rows = compile_all(only=args.only, jobs=args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # the Triton that compiled them: its compiler and ptxas decide registers and spills
    args.out.write_text(json.dumps(dict(triton=triton.__version__, kernels=rows), indent=1) + "\n")
    failed = [r for r in rows if r["problems"]]
    kernels = len({r["kernel"] for r in rows})
    print(f"\n{len(rows)} rows, {kernels} kernels, {len(failed)} with problems (Triton {triton.__version__}); "
          f"written to {args.out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.gpucheck", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_80 and sm_90")
    mode.add_argument("--all", action="store_true", help="the full GPU plan (needs a CUDA device)")
    mode.add_argument("--dry-run", action="store_true", help="the GPU plan at tiny sizes under the interpreter")
    parser.add_argument("--out", type=Path, help="--compile-only: the JSON file; otherwise the results folder")
    parser.add_argument("--only", help="only kernels (or bench entries) whose name contains one of these "
                                       "comma-separated texts")
    parser.add_argument("--jobs", type=int, default=1, help="--compile-only: compile in this many processes")
    args = parser.parse_args(argv)
    if args.compile_only:
        if args.out is None:
            parser.error("--compile-only needs --out FILE")
        return _compile_only(args)
    from labsrc.gpucheck import plan
    return plan.main(args)
