"""labsrc.gpucheck: kernel discovery, the compile check for sm_80/sm_90, and the GPU plan's dry run."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from labsrc import bench, runtime
from labsrc.gpucheck import compile as gc
from labsrc.gpucheck import plan
from labsrc.gpucheck.discover import launchable_kernels
from labsrc.gpucheck.specs import SPECS


def test_discovery_finds_the_launched_kernels_and_not_the_helpers():
    found = {k.qualname for k in launchable_kernels()}
    # a kernel launched through a variable (weight_quant's _launch) and ones launched by name
    assert "labsrc.kernels.weight_quant._mxfp4_matmul_kernel" in found
    assert "labsrc.kernels.flash_attention._decode_merge_kernel" in found
    # helpers inlined into kernels are not launchable
    assert "labsrc.kernels.flash_attention._online_softmax_step" not in found
    assert "labsrc.kernels._decay.chunk_segsum" not in found
    dots = {k.name for k in launchable_kernels() if k.uses_dot}
    assert "_flash_attention_kernel" in dots and "_ssd_kernel" in dots   # tl.dot in a helper counts (SSD's)
    assert "_kv_store_kernel" not in dots


def test_every_launchable_kernel_has_a_compile_spec_and_no_spec_is_stale():
    found = {f"{k.module}.{k.name}" for k in launchable_kernels()}
    assert found == set(SPECS), f"missing specs: {found - set(SPECS)}; stale specs: {set(SPECS) - found}"


def test_a_new_kernel_is_found_without_being_listed(tmp_path):
    (tmp_path / "new_family.py").write_text(textwrap.dedent('''
        from labsrc.kernels._triton import tl, triton

        @triton.jit
        def _helper(x):
            return x * 2

        @triton.jit
        def _new_kernel(x_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, _helper(tl.load(x_ptr + offs)))
    '''))
    assert [k.qualname for k in launchable_kernels(tmp_path)] == ["labsrc.kernels.new_family._new_kernel"]


def test_ptxas_log_parsing_and_row_problems():
    log = ("ptxas info    : Function properties for k\n    8 bytes stack frame, 12 bytes spill stores, "
           "16 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers\n")
    assert gc.parse_ptxas_log(log) == (255, 28)
    assert gc.parse_ptxas_log("no ptxas output") is None
    row = dict(compiled=True, spills=28, shared_bytes=200 * 1024, arch=80, mma=False, error=None)
    found = gc.problems(row, uses_dot=True)
    assert len(found) == 3 and "spills" in found[0] and "shared memory" in found[1] and "tensor-core" in found[2]
    assert gc.problems(dict(row, spills=0, shared_bytes=100 * 1024, mma=True), uses_dot=True) == []
    assert gc.problems(dict(compiled=False, error="boom"), uses_dot=False) == ["did not compile: boom"]


def test_launch_hints_are_those_of_a_launch_at_the_gpu_profile_sizes():
    # Triton specialises each launch: 16-byte-aligned pointers and multiples of 16 get a divisibility hint,
    # 1 becomes a constant. The compile check passes the same hints, except for the integers a spec names.
    names = ["x_ptr", "n", "stride", "group", "splits", "scale"]
    signature = dict(x_ptr="*bf16", n="i32", stride="i64", group="i32", splits="i32", scale="fp32")
    hinted = gc.launch_attrs(names, signature, dict(group=4, splits=None))
    assert hinted == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]],
                      (2,): [["tt.divisibility", 16]]}
    assert gc.launch_attrs(names, signature, dict(n=32))[(1,)] == [["tt.divisibility", 16]]
    # an integer the spec gives as 1 is compiled as the constant a launch would make it
    kernel = next(k for k in launchable_kernels() if k.name == "_int4_matmul_kernel")
    configs = gc.configurations(kernel, 90)
    assert any(c.get("M") == 1 and c.get("M_BUCKET") == 1 for c in configs)
    assert all(c.get("GROUP", 16) % 16 == 0 for c in configs)


def test_compile_table_renders_a_table_per_arch_and_a_line_per_kernel():
    rows = [dict(kernel="labsrc.kernels.m.k", arch=a, compiled=True, registers=r, spills=0, shared_bytes=s,
                 mma=True, problems=[]) for a, r, s in ((80, 96, 1024), (80, 128, 2048), (90, 168, 4096))]
    table = gc.markdown_table(rows)
    sm80, sm90 = table.split("**sm_90**")
    assert sm80.startswith("**sm_80**") and "| `m.k` | 2 | 96-128 | 0 | 1.0-2.0 | yes |" in sm80
    assert "| `m.k` | 1 | 168 | 0 | 4.0 | yes |" in sm90 and sm90.rstrip().endswith("problem (spills, shared "
                                                                               "memory over the limit, `tl.dot` "
                                                                               "without tensor cores): none.")
    rows[0]["problems"] = ["spills 8 bytes"]
    assert "problem (spills, shared memory over the limit, `tl.dot` without tensor cores): `m.k` (1 of 2)." \
        in gc.markdown_table(rows).split("**sm_90**")[0]


@pytest.mark.slow
@pytest.mark.skipif(not runtime.INTERPRETED, reason="on a GPU box the kernel tests run the compiled kernels")
def test_every_kernel_compiles_for_ampere_and_hopper(tmp_path):
    # The interpreter never compiles anything: a kernel that only fails at compile time (types, layouts,
    # shared memory, registers) passes every other test. `--compile-only` starts its own process with the
    # interpreter off and compiles with the ptxas Triton ships.
    out = tmp_path / "compile.json"
    result = subprocess.run([sys.executable, "-m", "labsrc.gpucheck", "--compile-only", "--jobs", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=1800)
    rows = json.loads(out.read_text())["kernels"]
    kernels = {k.qualname for k in launchable_kernels()}
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, a) for k in kernels for a in gc.ARCHS}
    assert {r["dtype"] for r in rows if r["compiled"]} == {"bf16", "fp16"}
    # Every row compiles, spills nothing, fits the architecture's shared memory and, where the kernel calls
    # tl.dot, holds tensor-core instructions. A configuration that fails is fixed or dropped from its list,
    # with the reason beside the list (issue 32).
    assert [gc.describe(r) for r in rows if not r["compiled"]] == []
    dots = {k.qualname for k in launchable_kernels() if k.uses_dot}
    assert [gc.describe(r) for r in rows if r["kernel"] in dots and not r["mma"]] == [], "tl.dot without mma"
    assert [gc.describe(r) for r in rows if r["shared_bytes"] > gc.SHARED_LIMIT[r["arch"]]] == []
    assert [gc.describe(r) for r in rows if r["spills"]] == []
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_committed_compile_results_cover_both_tritons_and_pass():
    """kernels/results/ holds the compile check of the newest Triton (compile.json, what CI installs) and of the
    Triton a CUDA torch pins (compile-triton-<version>.json, `make compile-check TRITON=<version>`): each names
    its version, covers every launchable kernel on both architectures, and has no row with a problem."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "kernels" / "results"
    files = [results / "compile.json", *sorted(results.glob("compile-triton-*.json"))]
    assert len(files) >= 2, "the compile check of the Triton a CUDA torch pins is not committed"
    kernels = {k.qualname for k in launchable_kernels()}
    versions = []
    for path in files:
        data = json.loads(path.read_text())
        versions.append(data["triton"])
        if path.name != "compile.json":
            assert path.name == f"compile-triton-{data['triton']}.json"
        assert {(r["kernel"], r["arch"]) for r in data["kernels"]} == {(k, a) for k in kernels for a in gc.ARCHS}
        assert [gc.describe(r) for r in data["kernels"] if r["problems"]] == [], path.name
    assert len(set(versions)) == len(versions)


def test_the_kernel_bench_page_lists_every_triton_checked(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tools"))
    import stage_book

    row = dict(kernel="labsrc.kernels.m.k", arch=80, compiled=True, registers=40, spills=0, shared_bytes=1024,
               mma=False, problems=[], config={}, dtype="bf16", error=None)
    (tmp_path / "compile.json").write_text(json.dumps(dict(triton="3.9.0", kernels=[row])))
    (tmp_path / "compile-triton-3.8.0.json").write_text(json.dumps(dict(triton="3.8.0", kernels=[
        row, dict(row, spills=12, problems=["12 bytes of register spills"])])))
    text = stage_book.compile_markdown(tmp_path / "compile.json")
    assert "The tables are Triton 3.9.0's" in text
    assert "Triton 3.9.0: 1 configurations, none with a problem" in text
    assert "Triton 3.8.0: 2 configurations, 1 with a problem (k)" in text


def test_all_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(runtime, "HAS_CUDA", False)
    with pytest.raises(SystemExit, match="--all needs a CUDA device"):
        plan.preflight(dry_run=False)


def test_dry_run_checks_times_and_writes_results_and_keeps_going_past_a_failing_entry(tmp_path, monkeypatch):
    registry = bench.entries()

    def broken(size):
        raise RuntimeError("this entry is broken on purpose")

    # Two real entries and a broken one between them: the plan records the error and runs the next entry.
    monkeypatch.setattr(bench, "entries", lambda: {"kv_store": registry["kv_store"], "broken": broken,
                                                   "greedy_verify": registry["greedy_verify"]})
    lines = []
    result = plan.run(dry_run=True, out=tmp_path, log=lines.append)
    assert [e["entry"] for e in result["errors"]] == ["broken"]
    assert "broken on purpose" in result["errors"][0]["error"]
    assert {r["entry"] for r in result["rows"]} == {"kv_store", "greedy_verify"}
    assert all(r["kernel_ms"] > 0 and r["baseline_ms"] > 0 for r in result["rows"])
    assert result["copy_gbps"] > 0
    assert [c["chapter"] for c in result["chapters"]] == list(plan.CHAPTERS)
    assert all(c["error"] is None and not c["executed"] for c in result["chapters"])
    written = json.loads((tmp_path / next(p.name for p in tmp_path.glob("*-dry-run.json"))).read_text())
    assert written["rows"] == result["rows"] and written["dry_run"] is True
    summary = next(tmp_path.glob("*-dry-run.md")).read_text()
    assert "Dry run" in summary and "**broken** failed" in summary and "greedy_verify" in summary
    assert any("broken: FAILED" in line for line in lines)
