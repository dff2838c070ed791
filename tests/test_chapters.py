"""The shape every chapter promises (conventions.md), checked without executing anything.

Executing the chapters is `make execute` (nbmake over the instructor notebooks) and `make test-student`.
"""
import json
import re
from pathlib import Path

import pytest

from labsrc.exercises import student

CHAPTERS = sorted((Path(__file__).resolve().parents[1] / "chapters").glob("*.ipynb"))


def cells(path):
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"], c)
            for c in nb["cells"]]


def test_there_are_chapters():
    assert CHAPTERS, "no chapter notebooks found"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_is_stored_without_outputs(path):
    for kind, _, cell in cells(path):
        if kind == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{path.name} has outputs"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_the_conventional_shape(path):
    assert re.fullmatch(r"\d\d_[a-z0-9_]+", path.stem), "chapters are named NN_topic.ipynb"
    all_cells = cells(path)
    markdown = "\n".join(src for kind, src, _ in all_cells if kind == "markdown").lower()
    code = "\n".join(src for kind, src, _ in all_cells if kind == "code")
    assert all_cells[0][0] == "markdown" and all_cells[0][1].lstrip().startswith("# "), "starts with a title"
    for heading in ("you will learn", "runs on", "exercise", "summary", "references"):
        assert heading in markdown, f"{path.name} lacks a '{heading}' section"
    assert "labsrc.stamp()" in code or "stamp()" in code, "the setup cell prints the runtime stamp"
    assert "seed_everything" in code, "the chapter seeds everything"
    assert "sizes(" in code, "sizes come from the runtime profile"
    assert "{cite}" in markdown, "the chapter cites its references"
    assert not re.search(r"^\s*except\s*(Exception)?\s*:", code, re.M), "notebooks never hide errors"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_three_checked_exercises(path):
    nb = json.loads(path.read_text())
    solved = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            solved += student.strip_solutions("".join(cell["source"]))[1]
    assert solved >= 3, f"{path.name} has {solved} solution blocks; a chapter needs at least three exercises"
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert code.count("labsrc.exercises") + code.count("from labsrc.exercises") >= 1
    assert len(re.findall(r"\bex\.check\w*\(|\bcheck_\w+\(", code)) >= 3, "each exercise needs a check call"
