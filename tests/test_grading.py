"""Grading with nbgrader, end to end: the release build, the autograde round trip, the book's staged copies and
the instructors page's exercise table.

The round trip runs on a small notebook made of chapter 1's real exercise cells (its solution and test cells
with their nbgrader metadata and the exercise statements before them): the grading machinery is the same for
every chapter, and this notebook executes in seconds, so no chapter is executed a third time in `make test`
(each executes once in `make execute`: as instructor, then its exercises as student, tools/student_suffix.py).
"""
import copy
import functools
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest

from labsrc.exercises import grade, student

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
ROUND_TRIP_CHAPTER = ROOT / "chapters" / "01_kv_cache.ipynb"
SOLUTION_REGION = re.compile(r"### BEGIN SOLUTION(.*?)### END SOLUTION", re.S)


@functools.cache
def _nbgrader_cells():
    """tools/nbgrader_cells.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("nbgrader_cells", ROOT / "tools" / "nbgrader_cells.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def nbgrader(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def exercise_notebook(chapter: Path) -> dict:
    """``chapter`` cut down to its exercise cells, unchanged: each solution cell with the markdown just before
    it (the exercise statement) and its test cell."""
    nb = json.loads(chapter.read_text())
    keep = set()
    for i, cell in enumerate(nb["cells"]):
        if nbgrader(cell).get("solution") or nbgrader(cell).get("grade"):
            keep.add(i)
            if nbgrader(cell).get("solution") and i and nb["cells"][i - 1]["cell_type"] == "markdown":
                keep.add(i - 1)
    small = copy.deepcopy(nb)
    small["cells"] = [c for i, c in enumerate(nb["cells"]) if i in keep]
    return small


def write(nb: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return path


# --------------------------------------------------------------------------------- metadata in the notebooks
def test_nbgrader_cells_script_has_been_run():
    """tools/nbgrader_cells.py is the source of truth for the exercise cells: running it changes nothing."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "tools/nbgrader_cells.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, f"run `python tools/nbgrader_cells.py`: {done.stdout}{done.stderr}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_exercise_cell_carries_nbgrader_metadata(path):
    cells = json.loads(path.read_text())["cells"]
    solutions = [c for c in cells if "### BEGIN SOLUTION" in source(c)]
    tests = [c for c in cells if nbgrader(c).get("grade")]
    assert len(solutions) >= 3 and len(tests) == len(solutions)
    for cell in solutions:
        meta = nbgrader(cell)
        assert meta["solution"] and not meta["grade"] and meta["grade_id"].startswith("solution_")
    for cell in tests:
        meta, text = nbgrader(cell), source(cell)
        assert meta["locked"] and meta["points"] > 0 and not meta["solution"]
        visible, hidden = text.split("### BEGIN HIDDEN TESTS")
        assert re.search(r"\bex\.check_\w+\(", visible), "the students see the check"
        assert re.search(r"hidden=(\d+|True)\)", hidden), "each hidden call carries its seed, written only here"
        assert hidden.rstrip().endswith("### END HIDDEN TESTS")
        assert cell["metadata"]["lab"]["minutes"] > 0


def test_nbgrader_cells_is_idempotent_and_keeps_an_instructors_hidden_lines():
    cells_tool = _nbgrader_cells()
    nb = exercise_notebook(ROUND_TRIP_CHAPTER)
    test = next(c for c in nb["cells"] if nbgrader(c).get("grade"))
    test["source"] = source(test).replace("### END HIDDEN TESTS", "assert gqa_kv_bytes(1, 1, 1, 1, 1, 1, 1) == 2\n"
                                          "### END HIDDEN TESTS")
    for cell in nb["cells"]:                 # as if the metadata had been lost in a merge
        cell["metadata"].pop("nbgrader", None)
    once = copy.deepcopy(nb)
    cells_tool.annotate(once)
    twice = copy.deepcopy(once)
    cells_tool.annotate(twice)
    assert once == twice
    hidden = source(next(c for c in once["cells"] if nbgrader(c).get("grade"))).split("### BEGIN HIDDEN TESTS")[1]
    assert "assert gqa_kv_bytes(1, 1, 1, 1, 1, 1, 1) == 2" in hidden
    assert len(re.findall(r"hidden=(\d+|True)\)", hidden)) == 1


# --------------------------------------------------------------------------------- the release build
@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    counts = student.build(ROOT / "chapters", out)
    return out, counts


def test_release_has_no_solutions_no_hidden_tests_and_locked_checks(released):
    out, counts = released
    assert sorted(counts) == [p.name for p in CHAPTERS] and all(n >= 3 for n in counts.values())
    for path in CHAPTERS:
        instructor = json.loads(path.read_text())["cells"]
        release = json.loads((out / path.name).read_text())["cells"]
        answers = [m.group(1).strip() for c in instructor for m in SOLUTION_REGION.finditer(source(c))]
        text = "\n".join(source(c) for c in release)
        assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text and "hidden=" not in text
        for answer in answers:
            assert answer not in text, f"{path.name}: a solution survived the release build"
        assert text.count('raise NotImplementedError("not solved yet")') == len(answers)
        for cell in release:
            if nbgrader(cell).get("grade"):
                assert cell["metadata"]["editable"] is False and cell["metadata"]["deletable"] is False
            if cell["cell_type"] == "code":
                assert not cell["outputs"]


# --------------------------------------------------------------------------------- the autograde round trip
def solve(release: dict, instructor: dict, grade_ids: set[str]) -> dict:
    """``release`` with the instructor's solution cells put back for the exercises in ``grade_ids``."""
    nb = copy.deepcopy(release)
    answers = {nbgrader(c)["grade_id"]: c for c in instructor["cells"] if nbgrader(c).get("solution")}
    for cell in nb["cells"]:
        gid = nbgrader(cell).get("grade_id", "")
        if nbgrader(cell).get("solution") and "check_" + gid.removeprefix("solution_") in grade_ids:
            cell["source"] = answers[gid]["source"]
    return nb


@pytest.mark.slow
@pytest.mark.notebook
def test_autograde_round_trip(tmp_path, capsys):
    name = ROUND_TRIP_CHAPTER.name
    instructor = exercise_notebook(ROUND_TRIP_CHAPTER)
    source_dir = tmp_path / "source"
    write(instructor, source_dir / name)
    t0 = time.perf_counter()
    student.build(source_dir, tmp_path / "release")
    t_release = time.perf_counter() - t0
    release = json.loads((tmp_path / "release" / name).read_text())
    ids = [nbgrader(c)["grade_id"] for c in release["cells"] if nbgrader(c).get("grade")]
    points = {nbgrader(c)["grade_id"]: nbgrader(c)["points"] for c in release["cells"] if nbgrader(c).get("grade")}

    subs = tmp_path / "submissions"
    write(release, subs / "unsolved" / name)
    write(instructor, subs / "instructor" / name)
    partial = solve(release, instructor, set(ids[:2]))   # two exercises tried, the first one wrong:
    for cell in partial["cells"]:                          # the classic GQA mistake, counting query heads
        if nbgrader(cell).get("grade_id") == "solution_gqa_bytes":
            cell["source"] = source(cell).replace("n_kv_heads * head_dim", "n_heads * head_dim")
            assert "n_heads * head_dim" in source(cell)
    write(partial, subs / "partial" / name)
    passed_over = copy.deepcopy(release)   # check cells replaced by `pass` (metadata kept, as Jupyter keeps it)
    for cell in passed_over["cells"]:
        if nbgrader(cell).get("grade"):
            cell["source"] = "pass"
    write(passed_over, subs / "checks_replaced" / name)
    deleted = copy.deepcopy(release)       # check cells deleted
    deleted["cells"] = [c for c in deleted["cells"] if not nbgrader(c).get("grade")]
    write(deleted, subs / "checks_deleted" / name)

    course = tmp_path / "course"
    t0 = time.perf_counter()
    table = grade.grade(subs, source_dir, course)
    t_grade = time.perf_counter() - t0
    full = sum(points.values())
    with capsys.disabled():
        print(f"\nrelease build {t_release:.1f} s; autograde of {len(table.scores)} submissions {t_grade:.1f} s\n"
              + table.to_markdown())
    totals = {s: table.total(s) for s in table.scores}
    assert totals["instructor"] == full
    assert totals["unsolved"] == totals["checks_replaced"] == totals["checks_deleted"] == 0
    assert ids[0] == "check_gqa_bytes" and table.scores["partial"][(name, ids[0])] == 0
    assert totals["partial"] == table.scores["partial"][(name, ids[1])] == points[ids[1]]
    # autograde executed every submission to the end, the unsolved one included
    for who in table.scores:
        graded = json.loads((course / "autograded" / who / "lab" / name).read_text())
        code = [c for c in graded["cells"] if c["cell_type"] == "code"]
        assert all(c["execution_count"] is not None for c in code), f"{who} did not execute to the end"
        displayed = [o for c in code if nbgrader(c).get("grade") for o in c["outputs"]
                     if o["output_type"] == "execute_result"]
        assert not displayed, "a test cell's displayed value would be read by nbgrader as a partial score"
        if who in ("checks_replaced", "checks_deleted"):
            restored = [source(c) for c in code if nbgrader(c).get("grade")]
            assert len(restored) == len(ids) and all(re.search(r"hidden=(\d+|True)\)", s) for s in restored)
    unsolved = json.loads((course / "autograded" / "unsolved" / "lab" / name).read_text())
    shown = "".join(source({"source": o.get("text", "")}) for c in unsolved["cells"] if c["cell_type"] == "code"
                    for o in c["outputs"])
    assert "not solved yet" in shown and "Fill in the function above" in shown, "the friendly message stays"
    csv_rows = table.to_csv().splitlines()
    assert csv_rows[0].startswith("student,01:gqa_bytes") and csv_rows[-1].startswith("(max),")


@pytest.mark.slow
@pytest.mark.notebook
def test_autograde_without_triton_awards_no_kernel_points_and_says_so(tmp_path, monkeypatch):
    """Graded on a machine without Triton (simulated in nbgrader's kernels by tests/no_triton_site), the kernel
    exercise scores 0 even for the instructor's own solution, an unsolved notebook scores 0 in all, and the table
    names the exercise as not graded on this machine; the other exercises are graded as on Linux."""
    name = ROUND_TRIP_CHAPTER.name
    instructor = exercise_notebook(ROUND_TRIP_CHAPTER)
    source_dir = tmp_path / "source"
    write(instructor, source_dir / name)
    student.build(source_dir, tmp_path / "release")
    release = json.loads((tmp_path / "release" / name).read_text())
    points = {nbgrader(c)["grade_id"]: nbgrader(c)["points"] for c in release["cells"] if nbgrader(c).get("grade")}
    kernel = "check_kv_store_kernel"
    assert kernel in points
    subs = tmp_path / "submissions"
    write(release, subs / "unsolved" / name)
    write(instructor, subs / "instructor" / name)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "no_triton_site"))
    course = tmp_path / "course"
    table = grade.grade(subs, source_dir, course)
    assert table.total("unsolved") == 0
    assert table.scores["instructor"][(name, kernel)] == 0
    assert table.total("instructor") == sum(points.values()) - points[kernel]
    assert table.ungraded == {(name, kernel)}
    assert "not graded on this machine" in table.to_markdown() and "01:kv_store_kernel" in table.ungraded_note()
    graded = json.loads((course / "autograded" / "instructor" / "lab" / name).read_text())
    cell = next(c for c in graded["cells"] if nbgrader(c).get("grade_id") == kernel)
    shown = json.dumps(cell["outputs"])
    assert "skipped" in shown and "on Linux" in shown, "the grader sees why the kernel earned nothing"
    # the feedback nbgrader writes from this course shows results, not the hidden cases
    student.nbgrader(course, "generate_feedback", student.ASSIGNMENT, "--force", env={"PYTHONPATH": str(ROOT)})
    html = (course / "feedback" / "instructor" / "lab" / f"{ROUND_TRIP_CHAPTER.stem}.html").read_text()
    assert "hidden=" not in html and "HIDDEN TESTS" not in html
    assert "check_kv_store_kernel" in html and "on Linux" in html


def test_course_keeps_an_existing_nbgrader_config(tmp_path, capsys):
    """`make grade COURSE=...` on an instructor's own course leaves its nbgrader_config.py as it was, and names
    the lab's settings it lacks; a new course gets the lab's config."""
    fresh = student.course(tmp_path / "new", [ROUND_TRIP_CHAPTER])
    assert (fresh / "nbgrader_config.py").read_text() == student.CONFIG
    own = tmp_path / "own"
    own.mkdir()
    mine = 'c = get_config()\nc.CourseDirectory.course_id = "my-class"\nc.Execute.timeout = 600\n'
    (own / "nbgrader_config.py").write_text(mine)
    student.course(own, [ROUND_TRIP_CHAPTER])
    assert (own / "nbgrader_config.py").read_text() == mine
    warning = capsys.readouterr().err
    assert "kept your" in warning and "c.OverwriteCells.add_missing_cells" in warning
    assert "c.Execute.timeout" not in warning and "course_id" not in warning
    (own / "nbgrader_config.py").write_text(student.CONFIG + "# my own line\n")
    student.course(own, [ROUND_TRIP_CHAPTER])
    assert (own / "nbgrader_config.py").read_text().endswith("# my own line\n") and not capsys.readouterr().err


def test_feedback_hides_the_hidden_tests_but_keeps_the_results():
    """The preprocessor the lab's config gives `nbgrader generate_feedback`: a test cell loses its hidden section,
    and a failed check's traceback (which quotes the hidden call) is cut to its message; printed results stay."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    cell = new_code_cell("ex.check_gqa_bytes(gqa_kv_bytes)\n### BEGIN HIDDEN TESTS\n"
                         "ex.check_gqa_bytes(gqa_kv_bytes, hidden=True)\n### END HIDDEN TESTS")
    cell.metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True, "points": 1,
                                 "grade_id": "check_gqa_bytes", "schema_version": 3}
    cell.outputs = [new_output("stream", name="stdout", text="❌ gqa (hidden cases): failed. 3 is too small.\n"),
                    new_output("error", ename="ExerciseFailed", evalue="gqa (hidden cases): failed",
                               traceback=["----> 3 ex.check_gqa_bytes(gqa_kv_bytes, hidden=True)", "ExerciseFailed"])]
    plain = new_code_cell("x = 1")
    plain.outputs = [new_output("error", ename="NameError", evalue="y", traceback=["----> 1 y"])]
    nb = new_notebook(cells=[cell, plain])
    assert "labsrc.exercises.student.HideHiddenTests" in student.CONFIG
    out, _ = student.HideHiddenTests().preprocess(nbformat.from_dict(nb), {})
    text = json.dumps(out.cells[0])
    assert "hidden=True" not in text and "HIDDEN TESTS" not in text
    assert out.cells[0].source.strip() == "ex.check_gqa_bytes(gqa_kv_bytes)"
    assert out.cells[0].outputs[1].traceback == ["ExerciseFailed: gqa (hidden cases): failed"]
    assert "failed. 3 is too small" in out.cells[0].outputs[0].text, "the result stays"
    assert out.cells[1].outputs[0].traceback == ["----> 1 y"], "a student's own cell keeps its traceback"


def test_score_table_formats():
    table = grade.ScoreTable([("01_a.ipynb", "check_x", 1.0), ("02_b.ipynb", "check_y", 2.5)],
                             {"bo": {("01_a.ipynb", "check_x"): 1.0, ("02_b.ipynb", "check_y"): 0.0},
                              "al": {("01_a.ipynb", "check_x"): 0.0, ("02_b.ipynb", "check_y"): 2.5}})
    assert table.to_csv().splitlines() == ["student,01:x,02:y,total", "al,0,2.5,2.5", "bo,1,0,1", "(max),1,2.5,3.5"]
    md = table.to_markdown().splitlines()
    assert md[0] == "| student | 01:x | 02:y | total |" and md[2] == "| al | 0 | 2.5 | 2.5 |"
    assert "not graded" not in table.to_markdown()
    table.ungraded = {("02_b.ipynb", "check_y")}
    assert table.to_markdown().splitlines()[-1] == table.ungraded_note()
    assert table.ungraded_note().startswith("not graded on this machine") and table.ungraded_note().endswith(": 02:y")


def test_grade_refuses_unknown_notebooks_and_empty_folders(tmp_path):
    with pytest.raises(ValueError, match="no student folders"):
        grade.grade(tmp_path)
    with pytest.raises(ValueError, match="submissions: .* is not a folder"):
        grade.grade(tmp_path / "missing")
    write({"cells": []}, tmp_path / "ada" / "99_nope.ipynb")
    with pytest.raises(ValueError, match="99_nope"):
        grade.grade(tmp_path)


# --------------------------------------------------------------------------------- the book shows the release
def stage_book():
    spec = importlib.util.spec_from_file_location("stage_book", ROOT / "tools" / "stage_book.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_staged_chapter_is_the_release_version_with_outputs(path):
    """What tools/stage_book.py renders: no text between BEGIN/END SOLUTION, no hidden tests, other outputs kept."""
    nb = json.loads(path.read_text())
    answers = [m.group(1).strip() for c in nb["cells"] for m in SOLUTION_REGION.finditer(source(c))]
    marker = {"output_type": "stream", "name": "stdout", "text": "executed\n"}
    for cell in nb["cells"]:            # stand-in for the executed copy's outputs
        if cell["cell_type"] == "code":
            cell["outputs"] = [marker]
    staged = stage_book().release_view(nb)
    text = "\n".join(source(c) for c in staged["cells"])
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text and "hidden=" not in text
    assert answers and not any(answer in text for answer in answers)
    for before, after in zip(nb["cells"], staged["cells"]):
        if after["cell_type"] != "code":
            continue
        if nbgrader(after).get("grade"):
            assert after["outputs"] == [], "a test cell's output reported on the solution"
        elif nbgrader(after).get("solution"):
            assert after["outputs"] == [], "a solution cell's output is the solution's"
        elif "remove-output" in after["metadata"].get("tags", []):
            assert after["outputs"] == [], "a cell computed from a solution kept its output"
        else:
            assert after["outputs"] == [marker]
        if not nbgrader(after):
            assert source(after) == source(before)


def test_staged_chapter_drops_outputs_computed_from_a_solution_even_untagged():
    """A cell that reads a name a solution defined (directly or through a name computed from one) loses its
    output in the book, tag or not; a cell that rebinds the name from scratch keeps its own."""
    def code(src, grade_id=None):
        meta = {"nbgrader": {"solution": True, "grade": False, "grade_id": grade_id, "locked": False,
                             "schema_version": 3}} if grade_id else {}
        return {"cell_type": "code", "execution_count": 1, "metadata": meta, "source": src,
                "outputs": [{"output_type": "stream", "name": "stdout", "text": "executed\n"}]}

    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        code("import math\nbase = 3", None),
        code("def answer(x):\n    ### BEGIN SOLUTION\n    return 42 * x\n    ### END SOLUTION\nprint(answer(1))",
             "solution_answer"),
        code("got = answer(2)\nprint(got)"),          # reads the solution
        code("print(got + base)"),                     # reads a name computed from it
        code("got = math.sqrt(base)\nprint(got)"),    # rebinds got from scratch
        code("print(got)"),
    ]}
    staged = stage_book().release_view(nb)
    kept = [bool(c["outputs"]) for c in staged["cells"]]
    assert kept == [True, False, False, False, True, True]


def test_staged_book_if_built_has_no_solutions():
    """The staged copies of the last `make book` (skipped before the first one)."""
    staged = sorted((ROOT / "_build" / "src" / "chapters").glob("*.ipynb"))
    if not staged:
        pytest.skip("the book has not been staged in this checkout")
    for path in staged:
        text = "\n".join(source(c) for c in json.loads(path.read_text())["cells"])
        assert not SOLUTION_REGION.search(text) and "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text


# --------------------------------------------------------------------------------- the instructors page
def test_instructors_exercise_table_matches_the_notebooks():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "tools/exercise_table.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    page = (ROOT / "book" / "instructors.md").read_text()
    for path in CHAPTERS:
        total = sum(nbgrader(c).get("points", 0) for c in json.loads(path.read_text())["cells"])
        assert f"| `{path.stem}` | **all" in page and f"| **{total}** |" in page


def test_instructors_page_reveals_no_exercise_answer():
    page = (ROOT / "book" / "instructors.md").read_text()
    for path in CHAPTERS:
        for cell in json.loads(path.read_text())["cells"]:
            for answer in SOLUTION_REGION.findall(source(cell)):
                assert answer.strip() not in page, f"the instructors page shows an answer of {path.name}"


def test_make_lab_hides_nbgraders_jupyterlab_extension():
    """`make lab` (students) points JUPYTER_CONFIG_PATH at tools/jupyter/student, which disables nbgrader's
    JupyterLab extension; `make lab-solutions` (instructors) keeps it."""
    import os
    import subprocess
    import sys
    pytest.importorskip("jupyterlab")

    def listing(extra_env):
        done = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True,
                              text=True, env={**os.environ, **extra_env})
        text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
        return [line for line in text.splitlines() if "@jupyter/nbgrader v" in line]

    student_view = listing({"JUPYTER_CONFIG_PATH": str(ROOT / "tools" / "jupyter" / "student")})
    instructor_view = listing({})
    if not instructor_view:
        pytest.skip("nbgrader's JupyterLab extension is not installed here")
    assert all("disabled" in line for line in student_view) and student_view
    assert all("enabled" in line for line in instructor_view)
    assert "JUPYTER_CONFIG_PATH=$(CURDIR)/tools/jupyter/student" in (ROOT / "Makefile").read_text()


# --------------------------------------------------------------------------------- what the exercises ask
from labsrc.exercises.kinds import THINKING  # noqa: E402  (the one definition of the thinking kinds)
# Chapter 2 builds the bench and the model; every other chapter has a Triton kernel of its own.
KERNEL_CHAPTERS = [p for p in CHAPTERS if not p.stem.startswith("02_")]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_gives_at_least_half_its_points_to_thinking_tasks(path):
    """Conventions, exercises: at least three graded exercises, and at least half of the chapter's points go
    to prediction, derivation, debugging and experiment tasks rather than coding a formula printed above."""
    tests = [c for c in json.loads(path.read_text())["cells"] if nbgrader(c).get("grade")]
    kinds = [(c["metadata"]["lab"]["kind"], nbgrader(c)["points"]) for c in tests]
    assert len(kinds) >= 3, f"{path.stem} has {len(kinds)} graded exercises"
    thinking = sum(points for kind, points in kinds if kind in THINKING)
    total = sum(points for _, points in kinds)
    assert 2 * thinking >= total, f"{path.stem}: {thinking} of {total} points go to thinking tasks ({kinds})"


@pytest.mark.parametrize("path", KERNEL_CHAPTERS, ids=lambda p: p.stem)
def test_a_kernel_chapter_keeps_a_kernel_writing_exercise(path):
    kinds = [c["metadata"]["lab"]["kind"] for c in json.loads(path.read_text())["cells"] if nbgrader(c).get("grade")]
    assert "kernel" in kinds, f"{path.stem} has no exercise that writes a Triton kernel"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_an_exercise_heading_states_its_kind_points_and_time(path):
    """tools/nbgrader_cells.py writes the heading and the tag line under it; students see the estimate."""
    cells = json.loads(path.read_text())["cells"]
    for i, cell in enumerate(cells):
        if nbgrader(cell).get("solution"):
            above = next(source(c) for c in reversed(cells[:i]) if c["cell_type"] == "markdown")
            test = next(c for c in cells[i + 1:] if c["cell_type"] == "code")
            lab, points = test["metadata"]["lab"], nbgrader(test)["points"]
            assert f"### Exercise" in above and f"· about {lab['minutes']} minutes*" in above, above[:200]
            assert f"· {points} point" in above, above[:200]
