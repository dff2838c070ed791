import json

import pytest

from labsrc import bench
from labsrc import hardware, runtime


def test_every_entry_runs_at_tiny_size_and_checks_itself():
    registry = bench.entries()
    assert registry, "no bench entries registered"
    for name in registry:
        rows = bench.run_entry(name, "tiny", reps=1)
        assert rows, name
        for row in rows:
            assert row["kernel_ms"] > 0 and row["baseline_ms"] > 0
            assert "GB/s" in row or "TFLOP/s" in row, f"{name} reports neither bandwidth nor throughput"


def test_bench_rejects_unknown_entries_and_sizes():
    with pytest.raises(ValueError, match="unknown bench entry"):
        bench.run_entry("no_such_kernel", "tiny")
    with pytest.raises(ValueError, match="size must be one of"):
        bench.run_entry("no_such_kernel", "huge")


@pytest.mark.skipif(not runtime.INTERPRETED, reason="under the interpreter GPU sizes must be refused")
def test_gpu_size_is_refused_under_the_interpreter():
    with pytest.raises(ValueError, match="--size gpu needs compiled kernels"):
        bench.run_entry(next(iter(bench.entries())), "gpu")


def test_save_and_table(tmp_path):
    rows = [dict(entry="e", case="c", kernel_ms=1.0, baseline_ms=2.0, speedup=2.0, **{"GB/s": 3.5})]
    path = bench.save(rows, "tiny", tmp_path)
    data = json.loads(path.read_text())
    assert data["rows"] == rows and data["size"] == "tiny" and data["stamp"]["device"] == runtime.device_name()
    table = bench.format_table(rows)
    assert "GB/s" in table.splitlines()[0] and "3.5" in table


def test_hardware_lookup():
    assert hardware.lookup("NVIDIA H200").name == "H200"
    assert hardware.lookup("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert hardware.lookup("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert hardware.lookup("CPU (x86_64, 2 cores)") is None


def test_the_bench_runs_from_any_directory_and_shows_progress(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "labsrc.bench", "kv_store", "--size", "tiny", "--reps", "1",
                          "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[1/1] kv_store (tiny)" in out.stdout, "each entry says when it starts"
    assert out.stdout.count("kernel ") >= 1 and list(tmp_path.glob("*-tiny.json"))


def test_the_docstring_lists_every_entry():
    for name in bench.entries():
        assert f"``{name}``" in bench.__doc__, f"labsrc.bench's docstring does not list {name}"


def test_results_go_to_the_checkout_folder_the_book_reads():
    from pathlib import Path

    assert bench.RESULTS_DIR == Path(__file__).resolve().parents[1] / "kernels" / "results"
