"""release/chapters/ holds exactly what nbgrader writes from chapters/: the notebooks the launch buttons open."""
import json
from pathlib import Path

import yaml

from labsrc.exercises import student

ROOT = Path(__file__).resolve().parents[1]


def test_release_notebooks_are_current(tmp_path):
    student.build(ROOT / "chapters", tmp_path)
    fresh = sorted(p.name for p in tmp_path.glob("*.ipynb"))
    assert fresh == sorted(p.name for p in (ROOT / "chapters").glob("*.ipynb"))
    stale = [name for name in fresh if (ROOT / "release" / "chapters" / name).read_bytes() != (tmp_path / name).read_bytes()]
    assert not stale, f"release/chapters/ is out of date for {stale}: run `make release`"
    for name in fresh:
        text = (ROOT / "release" / "chapters" / name).read_text()
        assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
        # No output at all, so none computed from a solution (the book's view of it: tests/test_grading.py).
        cells = json.loads(text)["cells"]
        assert not [c for c in cells if c["cell_type"] == "code" and c.get("outputs")], f"{name} has outputs"


def test_the_launch_buttons_open_the_release_notebooks():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["path_to_book"] == "release"
    assert (ROOT / "release" / "chapters").is_dir()
