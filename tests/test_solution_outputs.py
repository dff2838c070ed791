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


def test_taint_travels_through_mutation_and_a_solution_that_mutates():
    # results.append(solve(x)) binds nothing, yet results now holds the solution's value
    cells = [("import numpy as np\nresults, table = [], {}", False), (SOLUTION, True),
             ("results.append(answer(2))", False), ("print(results)", False),
             ("fill = lambda t, v: t.append(v)\nbox = []\nfill(box, answer(3))", False), ("print(box)", False),
             ("np.append([1], answer(1))\nprint(np.pi)", False)]   # a module is not changed by its functions
    deps = so.dependent_cells(cells)
    assert deps[3] == {"results"} and deps[5] == {"box"} and deps[6] == {"answer"}
    assert 7 not in so.dependent_cells(cells + [("print(np.pi)", False)])
    # a solution cell that works by filling a table taints the table
    mutating = "### BEGIN SOLUTION\ntable['k'] = 42\n### END SOLUTION"
    assert so.dependent_cells([("table = {}", False), (mutating, True), ("print(table)", False)]) == \
        {2: {"table"}}


def test_taint_is_sound_against_running_the_cells():
    """Property: run random cells that pass values around by binding and by mutation (append, item and slice
    assignment, +=, a helper that fills its argument, a solution cell that fills a list); wherever the
    solution's object is reachable from what a cell prints, the static rule calls that cell dependent."""
    from hypothesis import given, settings, strategies as st

    setup = ("class Marker(list):\n    pass\n"
             "def fill(t, v):\n    t.append(v)\n"
             "def reach(o, seen):\n"
             "    if id(o) in seen:\n        return False\n    seen.add(id(o))\n"
             "    return isinstance(o, Marker) or (isinstance(o, list) and any(reach(x, seen) for x in o))\n"
             "a, b, c = [], [], []\nshown = {}")
    solution = "def answer(x):\n    ### BEGIN SOLUTION\n    return Marker()\n    ### END SOLUTION\n"
    names = st.sampled_from("abc")
    statement = st.one_of(
        st.builds("{} = answer(1)".format, names),
        st.builds("{} = []".format, names),
        st.builds("{}.append({})".format, names, names),
        st.builds("{}[:0] = [{}]".format, names, names),
        st.builds("{} += [{}]".format, names, names),
        st.builds("{} = [{}]".format, names, names),
        st.builds("fill({}, {})".format, names, names),
        st.builds(lambda x: (f"### BEGIN SOLUTION\n{x}.append(Marker())\n### END SOLUTION", True), names),
        st.builds(lambda x: f"shown[len(shown)] = reach({x}, set())\nprint({x})", names))

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(st.lists(statement, min_size=1, max_size=8))
    def check(body):
        cells = [(setup, False), (solution, True)] + [c if isinstance(c, tuple) else (c, False) for c in body]
        namespace: dict = {}
        printed_at = {}
        for i, (src, _) in enumerate(cells):
            before = len(namespace.get("shown", {}))
            exec(src, namespace)  # noqa: S102 - the cells above, built from a fixed grammar
            if len(namespace["shown"]) > before:
                printed_at[i] = namespace["shown"][before]
        deps = so.dependent_cells(cells)
        for i, reached in printed_at.items():
            if reached:
                assert i in deps, (cells, i)

    check()
