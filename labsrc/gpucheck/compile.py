"""Compile every launchable kernel for sm_80 and sm_90 without a GPU, and read its resource use.

Triton ships its own ``ptxas``, so a kernel compiles to PTX and a cubin for any architecture on a machine
with no GPU. Each compile carries the specialisation a launch at the GPU profile's sizes would give it
(:func:`launch_attrs`: aligned pointers, integers that are multiples of 16, ones as constants), so that the
code is the code a GPU would run. For each kernel (:mod:`labsrc.gpucheck.discover`), architecture,
configuration (its :mod:`~labsrc.gpucheck.specs` constexprs times its autotune list) and dtype, one row
records whether it compiled, its registers per thread and spill bytes (``ptxas -v`` on the PTX Triton
wrote), its shared memory (Triton's launch metadata) and whether the PTX holds tensor-core instructions
(``mma.sync`` on Ampere, ``wgmma`` on Hopper). Every configuration compiles in bf16; fp16 differs only in the tensor-core variant, so
it compiles for each kernel's first configuration (that keeps the CI run to a few minutes).

The interpreter switch (``TRITON_INTERPRET``) is read once, when ``triton`` is imported, and ``import labsrc``
turns it on where no GPU is visible; :func:`compile_all` therefore runs in a process started with
``TRITON_INTERPRET=0`` (:func:`labsrc.gpucheck.main` starts one).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import inspect
import io
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

from labsrc.gpucheck.discover import Kernel, launchable_kernels
from labsrc.gpucheck.specs import SPECS

ARCHS = (80, 90)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
"""Most shared memory one block may use: A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB."""


def _ptxas(arch: int) -> str:
    # the ptxas Triton itself uses for this architecture (it ships two, for different PTX versions)
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(arch).path


def parse_ptxas_log(log: str) -> tuple[int, int] | None:
    """``(registers per thread, spill bytes stored + loaded)`` from a ``ptxas -v`` log; ``None`` if absent."""
    registers = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    if not registers:
        return None
    return max(registers), sum(int(m) for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """Run ``ptxas -v`` on ``ptx`` (when Triton's cache answered and no ptxas log was captured), with the
    options Triton's own ptxas call passes."""
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)   # sm_80, or sm_90a for Hopper's wgmma
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        command = [_ptxas(arch), "-v", "-lineinfo", "--regAllocOptLevel=2", f"--gpu-name={target}", str(src),
                   "-o", str(Path(tmp) / "k.cubin")]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return parse_ptxas_log(out)


def launch_attrs(arg_names: list, signature: dict, ints: dict) -> dict:
    """The divisibility hints that a launch at the GPU profile's sizes gives Triton.

    Triton specialises every launch on its arguments: a pointer that is 16-byte aligned (every tensor the
    wrappers pass is) and an integer that is a multiple of 16 are marked so, and an integer equal to 1 becomes
    a constant. Compiling ahead of time, they must be given: without them Triton has to assume a misaligned
    base and a stride of 3, cannot vectorise a load or copy it asynchronously into shared memory, and emits
    code that no GPU launch runs (flash attention's K and V tiles then load one element at a time, and every
    configuration spilled). ``ints`` holds the integer arguments that are not multiples of 16 at the GPU
    profile's sizes (``None``: it varies with the shape); every other integer argument is taken to be one.
    """
    hinted = {}
    for i, name in enumerate(arg_names):
        kind = signature[name]
        if kind.startswith("*") or (kind in ("i32", "i64") and (ints.get(name, 16) or 1) % 16 == 0):
            hinted[(i,)] = [["tt.divisibility", 16]]
    return hinted


def configurations(kernel: Kernel, arch: int) -> list[dict]:
    """Every configuration to compile: the spec's constexprs times the kernel's autotune list for ``arch``,
    each with the spec's integer arguments that are not multiples of 16 (``Spec.ints``)."""
    import triton
    spec = SPECS[f"{kernel.module}.{kernel.name}"]
    module = importlib.import_module(f"labsrc.kernels.{kernel.module}")
    obj = getattr(module, kernel.name)
    if spec.arch_configs:
        from labsrc.kernels import flash_attention
        # the package and each of its files that looks the function up (the config functions are spread
        # over forward, backward and decode, and other families call flash_attention._capability)
        holders = [flash_attention] + [m for m in vars(flash_attention).values()
                                       if inspect.ismodule(m) and hasattr(m, "_capability")]
        saved = flash_attention._capability
        for holder in holders:
            holder._capability = lambda: divmod(arch, 10)   # the list this architecture's GPU would get
        try:
            tuned = getattr(module, spec.arch_configs)()
        finally:
            for holder in holders:
                holder._capability = saved
    elif isinstance(obj, triton.runtime.Autotuner):
        tuned = obj.configs
    else:
        tuned = None
    if tuned is None:
        return [{"num_warps": spec.num_warps, "num_stages": 3, **spec.ints, **consts} for consts in spec.constexprs]
    return [{**spec.ints, **consts, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            for consts, c in itertools.product(spec.constexprs, tuned)]


def compile_one(kernel: Kernel, arch: int, config: dict, dtype: str) -> dict:
    """Compile one configuration and return its row (``compiled`` is ``False`` and ``error`` says why)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = dict(kernel=kernel.qualname, arch=arch, config=config, dtype=dtype, compiled=False, registers=None,
               spills=None, shared_bytes=None, mma=False, error=None)
    try:
        spec = SPECS[f"{kernel.module}.{kernel.name}"]
        obj = getattr(importlib.import_module(f"labsrc.kernels.{kernel.module}"), kernel.name)
        fn = obj.fn if isinstance(obj, triton.runtime.Autotuner) else obj
        params = dict(zip(fn.arg_names, fn.params))
        unknown = [k for k in config if k not in params and k not in ("num_warps", "num_stages")]
        if unknown:
            raise ValueError(f"the configuration names {unknown}, which are not arguments of the kernel")
        consts = {k: v for k, v in config.items() if k in params and params[k].is_constexpr}
        missing = [n for n, p in params.items() if p.is_constexpr and n not in consts]
        if missing:
            raise ValueError(f"no value for constexpr {missing} in the spec or the autotune list")
        # integer arguments at their GPU-profile values: 1 is a constant in a real launch, the rest are hints
        ints = {k: v for k, v in config.items() if k in params and not params[k].is_constexpr}
        consts.update({k: 1 for k, v in ints.items() if v == 1})
        signature = {n: "constexpr" if n in consts else spec.types.get(n, "i32").replace("T", dtype)
                     if spec.types.get(n, "i32").startswith("*T") else spec.types.get(n, "i32")
                     for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                        attrs=launch_attrs(fn.arg_names, signature, ints))
        # Triton runs ptxas -v itself and prints its log when asked: capture it rather than run ptxas twice.
        log = io.StringIO()
        triton.knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))
        ptx = compiled.asm["ptx"]
        row["registers"], row["spills"] = parse_ptxas_log(log.getvalue()) or ptxas_usage(ptx, arch)
        row["shared_bytes"] = int(compiled.metadata.shared)
        row["mma"] = bool(re.search(r"\b(w?gmma|mma\.sync)", ptx))
        row["compiled"] = True
    except Exception as exc:  # a failing configuration is a row to report, not the end of the run
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:500]
    return row


def problems(row: dict, uses_dot: bool) -> list[str]:
    """What is wrong with a row: not compiled, spills, shared memory over the limit, ``tl.dot`` without mma."""
    if not row["compiled"]:
        return [f"did not compile: {row['error']}"]
    found = []
    if row["spills"]:
        found.append(f"{row['spills']} bytes of register spills")
    if row["shared_bytes"] > SHARED_LIMIT[row["arch"]]:
        found.append(f"{row['shared_bytes']} bytes of shared memory > {SHARED_LIMIT[row['arch']]}")
    if uses_dot and not row["mma"]:
        found.append("tl.dot kernel without tensor-core instructions in its PTX")
    return found


def _compile_task(task: tuple) -> dict:
    kernel, arch, config, dtype = task
    row = compile_one(kernel, arch, config, dtype)
    row["problems"] = problems(row, kernel.uses_dot)
    return row


def compile_all(archs=ARCHS, only: str | None = None, jobs: int = 1, progress=print) -> list[dict]:
    """Rows for every launchable kernel (with ``only``, those whose qualified name contains one of its
    comma-separated parts), compiled in ``jobs`` worker processes (each compile is one CPU core's work)."""
    rows, tasks = [], []
    for kernel in launchable_kernels():
        if only and not any(part in kernel.qualname for part in only.split(",")):
            continue
        key = f"{kernel.module}.{kernel.name}"
        # A new kernel (found by discovery, so it cannot be skipped silently) or one known not to compile yet:
        # a failed row per architecture that says why.
        why = (f"no compile spec: add {key!r} to labsrc/gpucheck/specs.py" if key not in SPECS
               else SPECS[key].not_compiled)
        if why:
            for arch in archs:
                row = dict(kernel=kernel.qualname, arch=arch, config={}, dtype=None, compiled=False,
                           registers=None, spills=None, shared_bytes=None, mma=False, error=why)
                row["problems"] = problems(row, kernel.uses_dot)
                rows.append(row)
            continue
        for arch in archs:
            for i, config in enumerate(configurations(kernel, arch)):
                for dtype in SPECS[key].dtypes if i == 0 else SPECS[key].dtypes[:1]:
                    tasks.append((kernel, arch, config, dtype))
    if jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            results = pool.map(_compile_task, tasks)
            for row in results:
                rows.append(row)
                if progress:
                    progress(describe(row))
    else:
        for task in tasks:
            rows.append(_compile_task(task))
            if progress:
                progress(describe(rows[-1]))
    return sorted(rows, key=lambda r: (r["kernel"], r["arch"]))


def describe(row: dict) -> str:
    """One row as one line of text: architecture, kernel, dtype, blocks and warps, resources, verdict."""
    cfg = " ".join(f"{k}={v}" for k, v in row["config"].items() if k.startswith(("BLOCK", "num_")))
    status = "ok" if not row["problems"] else "FAIL " + "; ".join(row["problems"])
    return (f"sm_{row['arch']} {row['kernel'].removeprefix('labsrc.kernels.')} {row['dtype']} [{cfg}] "
            f"regs={row['registers']} spills={row['spills']} smem={row['shared_bytes']} mma={row['mma']}: {status}")


def markdown_table(rows: list[dict]) -> str:
    """One table per architecture, one line per kernel: configurations compiled, registers, spills, shared
    memory, tensor cores (``mma``); under it, the kernels with configurations that have problems. One table
    per architecture, and the problems outside it, keep the columns few enough for the book's text column.

    Registers and shared memory are given as the range over the kernel's configurations (the autotune list
    picks one per shape at run time); spills and problems count over all of them.
    """
    groups: dict[tuple, list] = {}
    for row in rows:
        # "flash_attention._flash_attention" for labsrc.kernels.flash_attention._flash_attention_kernel: the longest names
        # set the table's width.
        name = row["kernel"].removeprefix("labsrc.kernels.").removesuffix("_kernel")
        groups.setdefault((row["arch"], name), []).append(row)

    def span(values, scale=1):
        values = [v / scale for v in values if v is not None]
        if not values:
            return "-"
        lo, hi = min(values), max(values)
        fmt = (lambda v: f"{v:.0f}") if scale == 1 else (lambda v: f"{v:.1f}")
        return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"

    lines = []
    for arch in sorted({arch for arch, _ in groups}):
        lines += ["" if not lines else "\n", f"**sm_{arch}**\n",
                  "| kernel | configs | registers | spills | shared KiB | mma |",
                  "|---|---|---|---|---|---|"]
        flagged = []
        for (a, kernel), group in sorted(groups.items()):
            if a != arch:
                continue
            ok = [r for r in group if r["compiled"]]
            bad = sum(1 for r in group if r.get("problems"))
            mma = "yes" if ok and all(r["mma"] for r in ok) else ("some" if any(r["mma"] for r in ok) else "no")
            lines.append(f"| `{kernel}` | {len(group)} | {span([r['registers'] for r in ok])} | "
                         f"{max((r['spills'] for r in ok), default=0)} | "
                         f"{span([r['shared_bytes'] for r in ok], 1024)} | {mma} |")
            if bad:
                flagged.append(f"`{kernel}` ({bad} of {len(group)})")
        # Problems under the table, not in a column of their own: the table stays within the text column.
        lines.append("\nConfigurations with a problem (spills, shared memory over the limit, `tl.dot` without "
                     "tensor cores): " + (", ".join(flagged) if flagged else "none") + ".")
    return "\n".join(line for line in lines if line) + "\n"
