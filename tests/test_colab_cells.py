"""Each chapter installs the lab on Colab (and only there), from the repository named once in _config.yml."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import colab_cells  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_first_code_cell_installs_the_lab_on_colab(path):
    cells = json.loads(path.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    url, branch = colab_cells.repository()
    assert "".join(first["source"]) == colab_cells.cell_source(url, branch), \
        "run python tools/colab_cells.py (the repository URL comes from _config.yml)"
    assert first["metadata"].get("tags") == ["remove-cell"], "the book does not show the install cell"


def test_the_cell_does_nothing_outside_colab_and_pip_installs_on_colab(tmp_path):
    source = colab_cells.cell_source("https://example.invalid/lab", "main")
    # Outside Colab: runs, and would fail loudly if it tried to reach the (invalid) URL.
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and not out.stdout and not out.stderr
    # On Colab (COLAB_RELEASE_TAG set): it calls pip with the repository; a stub pip records the call.
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!{sys.executable}\nimport sys; print(' '.join(sys.argv[1:]))\n")
    fake.chmod(0o755)
    code = source.replace("sys.executable", repr(str(fake)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "COLAB_RELEASE_TAG": "test"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "-m pip install -q labsrc @ git+https://example.invalid/lab@main"


def test_the_script_is_idempotent(tmp_path):
    nb = tmp_path / "x.ipynb"
    nb.write_text(CHAPTERS[0].read_text())
    source = colab_cells.cell_source(*colab_cells.repository())
    colab_cells.apply(nb, source)
    once = nb.read_text()
    assert not colab_cells.apply(nb, source) and nb.read_text() == once
    assert once.count(colab_cells.MARKER) == 1
