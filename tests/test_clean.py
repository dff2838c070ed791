"""`make clean` (tools/clean.py) removes build outputs and keeps what people made: the students' notebooks in
_build/lab/ and the grades of the last `make grade`."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_clean_keeps_students_notebooks_and_grades(tmp_path):
    for path in ("_build/lab/01_kv_cache.ipynb", "_build/grades.csv", "_build/html/index.html",
                 "_build/student/01_kv_cache.ipynb", "_build/ledger.jsonl", "_executed/chapters/.stamp"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("work")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "clean.py"), str(tmp_path)], capture_output=True,
                          text=True, check=True)
    assert (tmp_path / "_build/lab/01_kv_cache.ipynb").read_text() == "work"
    assert (tmp_path / "_build/grades.csv").read_text() == "work"
    assert sorted(p.name for p in (tmp_path / "_build").iterdir()) == ["grades.csv", "lab"]
    assert not (tmp_path / "_executed").exists()
    assert "kept _build/lab" in done.stdout
    subprocess.run([sys.executable, str(ROOT / "tools" / "clean.py"), str(tmp_path)], check=True,
                   capture_output=True)   # again, on a clean tree: nothing to do, no error


def test_make_clean_runs_the_script():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "-f", "Makefile", "-n", "clean"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python3 tools/clean.py"
