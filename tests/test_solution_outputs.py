"""tools/solution_outputs.py: which cells' outputs depend on an exercise's solution, in the notebook and on the
rendered page (the rule the chapter test, the book's release view and the browser check share)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import solution_outputs as so  # noqa: E402

from labsrc.exercises.student import STUB  # noqa: E402

SOLUTION = "def answer(x):\n    ### BEGIN SOLUTION\n    return 42 * x\n    ### END SOLUTION\n"


def test_taint_follows_names_through_cells_and_stops_at_a_fresh_binding():
    cells = [("import math\nbase = 3", False),
             (SOLUTION, True),
             ("got = answer(2)", False),                       # reads the solution
             ("twice = 2 * got\nprint(base)", False),          # reads a name computed from it
             ("def f():\n    return twice\n", False),         # a function body counts: calling it reads twice
             ("got = math.sqrt(base)\nprint(got)", False),     # got rebound from scratch, then read
             ("print(got, base, len([1]))", False)]            # clean names and builtins only
    deps = so.dependent_cells(cells)
    assert deps == {2: {"answer"}, 3: {"got"}, 4: {"twice"}}


def test_a_statement_that_reads_a_tainted_name_taints_what_it_binds_even_if_rebound():
    cells = [(SOLUTION, True), ("x = 1\nx = answer(x)", False), ("print(x)", False)]
    assert so.dependent_cells(cells) == {1: {"answer"}, 2: {"x"}}


def test_untagged_cells_are_reported_and_test_cells_exempt():
    def code(src, **meta):
        return {"cell_type": "code", "metadata": meta, "source": src, "outputs": [], "execution_count": None}

    nb = {"cells": [code(SOLUTION),
                    code("ex.check(answer)", nbgrader={"grade": True, "grade_id": "c"}),
                    code("print(answer(1))"),
                    code("print(answer(2))", tags=["remove-output"])]}
    assert [i for i, _ in so.untagged(nb)] == [2]


def test_the_page_check_fails_an_output_under_a_cell_that_reads_a_stubbed_solution():
    stub = "def answer(x):\n    " + STUB.replace("\n", "\n    ") + "\n"
    page = [("import math", False), (stub, False), ("print(answer(1))", True), ("print(math.pi)", True)]
    problems = so.page_problems(page)
    assert len(problems) == 1 and "answer" in problems[0] and "print(answer(1))" in problems[0]
    # Without its output (remove-output), the same page passes; a cell the page cuts off (not Python) is skipped.
    assert not so.page_problems([page[0], page[1], ("print(answer(1))", False), ("for x in", True)])
