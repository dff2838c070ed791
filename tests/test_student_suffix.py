"""tools/student_suffix.py: the student version runs in the instructor's kernel from the first cell that differs,
and nothing the instructor cells alone bind can hide a student's NameError."""
import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("student_suffix", ROOT / "tools" / "student_suffix.py")
ss = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ss)


def notebook(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s[3:]) if s.startswith("md:") else nbformat.v4.new_code_cell(s)
                for s in sources]
    return nb


SOLVED = "def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"
STUB = "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError('not solved yet')"
CHECK = "ex.check(f)\n### BEGIN HIDDEN TESTS\nex.check(f, hidden=True)\n### END HIDDEN TESTS"
CHECK_STUDENT = "ex.check(f)"


def test_combine_then_split_round_trip():
    ours = notebook("import x", "md:## Exercises", SOLVED, CHECK, "md:## Summary")
    theirs = notebook("import x", "md:## Exercises", STUB, CHECK_STUDENT, "md:## Summary")
    assert ss.first_difference(ours, theirs) == 2
    combined = ss.combine(nbformat.from_dict(ours), theirs, claims="/c", ledger="/l")
    sources = [c.source for c in combined.cells]
    assert sources[:5] == [c.source for c in ours.cells]
    assert "LAB_EXERCISES" in sources[5] and "'/c'" in sources[5] and "'/l'" in sources[5]
    assert sources[6:] == [STUB, CHECK_STUDENT, "## Summary"]
    assert len({c.id for c in combined.cells}) == len(combined.cells)
    nbformat.validate(combined)
    instructor, student = ss.split(combined)
    assert [c.source for c in instructor.cells] == [c.source for c in ours.cells]
    assert [c.source for c in student.cells][1:] == [STUB, CHECK_STUDENT, "## Summary"]
    assert ss.split(instructor)[1] is None


def test_cells_must_line_up():
    with pytest.raises(ValueError, match="make release"):
        ss.first_difference(notebook("a = 1", "b = 2"), notebook("a = 1"))
    with pytest.raises(ValueError, match="make release"):
        ss.first_difference(notebook("a = 1", "b = 2"), notebook("a = 1", "md:b"))


def test_a_name_only_hidden_tests_bind_is_caught():
    leaky = "ex.check(f)\n### BEGIN HIDDEN TESTS\nscore = ex.check(f, hidden=True)\n### END HIDDEN TESTS"
    ours = notebook(SOLVED, leaky, "print(score)")
    theirs = notebook(STUB, CHECK_STUDENT, "print(score)")
    assert ss.leaked_names(ours, theirs) == [(1, "score", 2)]
    with pytest.raises(ValueError, match="NameError"):
        ss.combine(ours, theirs, claims="/c", ledger="/l")
    # A name the stub binds too, or one bound only inside a function body, is no leak.
    assert ss.leaked_names(notebook(SOLVED, "y = f(1)"), notebook(STUB, "y = f(1)")) == []
    inner = "def g():\n    ### BEGIN SOLUTION\n    t = 1\n    return t\n    ### END SOLUTION"
    assert ss.leaked_names(notebook(inner, "print(t)"),
                           notebook("def g():\n    raise NotImplementedError", "print(t)")) == []


@pytest.mark.parametrize("path", sorted((ROOT / "chapters").glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_chapter_combines_from_its_exercises(path):
    # The suffix must start inside the exercises at the end (so the combined run re-executes no experiment),
    # and the chapter must leak no name (combine raises on one).
    ours, theirs = nbformat.read(path, 4), nbformat.read(ROOT / "release" / "chapters" / path.name, 4)
    k = ss.first_difference(ours, theirs)
    headings = [i for i, c in enumerate(ours.cells) if c.cell_type == "markdown"
                and any(line.startswith("## Exercises") for line in c.source.splitlines())]
    assert headings and headings[-1] < k < len(ours.cells), (k, headings)
    ss.combine(ours, theirs, claims="/c", ledger="/l")
