"""The shape every chapter promises (conventions.md), checked without executing anything.

Executing the chapters is `make execute` (nbmake over the instructor notebooks, each followed by its exercises in
the release version: tools/student_suffix.py).
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


# Code the page shows must fit the text column (about 88 characters). Lines that cannot be wrapped without
# changing what the code does, as (notebook stem, a substring of the line):
LONG_LINE_LIMIT = 88
LONG_LINES_ALLOWED: list[tuple[str, str]] = []


def shown_code_lines(path):
    """(line) of every code cell the page shows, outside hidden tests and solutions; cells with magics skipped."""
    for kind, src, cell in cells(path):
        tags = cell.get("metadata", {}).get("tags", [])
        if kind != "code" or "remove-input" in tags or "remove-cell" in tags:
            continue
        lines = src.split("\n")
        if any(line.lstrip().startswith(("%", "!")) for line in lines):
            continue
        # Hidden tests and solutions never reach the page: the book renders the release version, where
        # nbgrader has removed the one and replaced the other by a stub.
        hidden = False
        for line in lines:
            if line.strip().startswith(("### BEGIN HIDDEN TESTS", "### BEGIN SOLUTION")):
                hidden = True
            if not hidden:
                yield line
            if line.strip().startswith(("### END HIDDEN TESTS", "### END SOLUTION")):
                hidden = False


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_shown_code_fits_the_text_column(path):
    allowed = [sub for stem, sub in LONG_LINES_ALLOWED if stem == path.stem]
    too_long = [line for line in shown_code_lines(path)
                if len(line) > LONG_LINE_LIMIT and not any(sub in line for sub in allowed)]
    assert not too_long, (f"{path.name}: {len(too_long)} shown code lines over {LONG_LINE_LIMIT} characters, "
                          f"e.g. {too_long[0]!r}")
    # An allow-list entry that matches nothing is stale: drop it.
    long_lines = [line for line in shown_code_lines(path) if len(line) > LONG_LINE_LIMIT]
    stale = [sub for sub in allowed if not any(sub in line for line in long_lines)]
    assert not stale, f"{path.name}: allow-listed long lines no longer present: {stale}"


# No output computed from a solution reaches the book: the book renders the executed instructor notebook with
# the solutions stubbed, so a cell that reads a name a solution defined shows the solution's result under the
# student's stub. Such cells carry `remove-output` (tools/solution_outputs.py writes the tag).
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_cells_computed_from_a_solution_hide_their_output(path):
    import sys
    sys.path.insert(0, str(path.parents[1] / "tools"))
    import solution_outputs

    missing = solution_outputs.untagged(json.loads(path.read_text()))
    assert not missing, (f"{path.name}: cells {[i for i, _ in missing]} read names a solution defined "
                         f"({sorted(set().union(*(n for _, n in missing)))}) and would show the solution's "
                         "result in the book: run python tools/solution_outputs.py")


# Bookkeeping stays off the page (conventions.md, "On the rendered page"): a cell that records a claims-ledger row,
# or decides a verdict (claims.judge, claims.check, claims.Rule), is tagged remove-input (its one-sentence verdict
# output stays), or hide-input where it also draws a figure. The verdict reaches the reader as a sentence with no
# row id (labsrc.claims.Row); tools/browser_check.py checks the rendered pages for ids.
VERDICT_CALLS = ("claims.record(", "claims.judge(", "claims.check(", "claims.Rule(")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_claims_bookkeeping_is_hidden(path):
    shown = [i for i, (kind, src, cell) in enumerate(cells(path))
             if kind == "code" and any(c in src for c in VERDICT_CALLS)
             and not {"remove-input", "remove-cell", "hide-input"} & set(cell["metadata"].get("tags", []))]
    assert not shown, (f"{path.name}: cells {shown} show claims bookkeeping (a verdict decided or recorded); "
                       "move it into a cell tagged remove-input")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_prints_a_claim_id(path):
    """A chapter's code never prints a ledger row id: a string holding a recorded or retired id appears only
    inside a claims.record call (its id, its anchor, text the claims page shows)."""
    import ast
    import re

    from labsrc.claims_retired import RETIRED

    src_all = [src for kind, src, _ in cells(path) if kind == "code"]
    ids = set(RETIRED) | {m for src in src_all for m in re.findall(
        r'claims\.record\(\s*["\']([a-z0-9][a-z0-9-]*)["\']', src)}
    used = []
    for src in src_all:
        tree = ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.split("\n")))
        allowed = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "record":
                allowed |= {id(n) for n in ast.walk(node)}
        used += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in allowed and any(i in n.value for i in ids)]
    assert not used, f"{path.name}: code that could print a claims-ledger row id: {used}"


def shown_package_sources(path):
    """(where, source) of every ``show_source(...)`` call of a chapter: the chapter's imports are run to resolve
    the shown object, and the call's ``start``/``end`` markers (literals) are applied as the page applies them."""
    import ast

    from labsrc.show import source_of

    namespace: dict = {}
    for kind, src, _ in cells(path):
        if kind != "code":
            continue
        tree = ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.split("\n")))
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module(body=[node], type_ignores=[]), path.name, "exec"), namespace)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "show_source":
                obj = eval(compile(ast.Expression(node.args[0]), path.name, "eval"), namespace)
                markers = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                source, where = source_of(obj, **markers)
                yield where, source


# The package source a chapter renders (labsrc.show.show_source) must fit the same column as its own code: a
# longer line is clipped on the page (a trailing comment lost, most often). The fix is in labsrc: comments
# above the line, wrapped statements.
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_shown_package_source_fits_the_text_column(path):
    too_long = [(where, line) for where, source in shown_package_sources(path) for line in source.splitlines()
                if len(line) > LONG_LINE_LIMIT]
    assert not too_long, (f"{path.name} shows {len(too_long)} package source lines over {LONG_LINE_LIMIT} "
                          f"characters, e.g. {too_long[0][0]}: {too_long[0][1].strip()!r}")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_code_in_the_prose_fits_the_text_column(path):
    """Code fenced in a markdown cell (an exercise's launch line, a buggy function to debug) is shown in the
    same column."""
    too_long = []
    for kind, src, _ in cells(path):
        if kind != "markdown":
            continue
        fence = None
        for line in src.split("\n"):
            marker = re.match(r"\s*(```+|~~~+)", line)
            if marker and (fence is None or marker.group(1).startswith(fence)):
                fence = None if fence else marker.group(1)
            elif fence and len(line) > LONG_LINE_LIMIT:
                too_long.append(line)
    assert not too_long, f"{path.name}: fenced code lines over {LONG_LINE_LIMIT} characters: {too_long}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_cell_has_a_stable_id(path):
    """A cell without an id gets a random one from every tool that writes the notebook (the release build
    among them), so the release notebooks could never be reproduced byte for byte."""
    cells = json.loads(path.read_text())["cells"]
    missing = [i for i, c in enumerate(cells) if not c.get("id")]
    assert not missing, f"{path.name}: cells {missing} have no id"
    ids = [c["id"] for c in cells]
    assert len(ids) == len(set(ids)), f"{path.name}: repeated cell ids"
