"""Write the release (student) version of the chapter notebooks with nbgrader.

The chapter notebooks are nbgrader source notebooks: every exercise is a solution cell (the answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION``) followed by a locked, autograded test cell with points and a
``### BEGIN HIDDEN TESTS`` section (``tools/nbgrader_cells.py`` writes that metadata). This module runs the real
``nbgrader generate_assignment`` on them, in a temporary course directory it creates with the lab's
``nbgrader_config.py``, and copies the release notebooks out. In the release version each solution region is
replaced, at its indentation, by::

    # YOUR CODE HERE
    raise NotImplementedError("not solved yet")

hidden tests and outputs are removed and test cells are locked. The visible check then prints "not solved yet"
and the notebook runs to the end. Usage::

    python -m labsrc.exercises.student chapters _build/student           # what `make student` runs
    python -m labsrc.exercises.student --course course --assignment kv_cache chapters/01_kv_cache.ipynb

:func:`course` and :func:`nbgrader` are shared with :mod:`labsrc.exercises.grade`.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ASSIGNMENT = "lab"
STUB = '# YOUR CODE HERE\nraise NotImplementedError("not solved yet")'

# The course configuration the lab's commands write; an instructor's own course can copy it.
CONFIG = f'''\
# nbgrader configuration of the Long-Context Inference Lab (written by labsrc.exercises.student).
c = get_config()  # noqa: F821 (nbgrader provides it)
c.CourseDirectory.course_id = "lclab"
# The stub the release notebooks get for every solution region: the check cell reports "not solved yet".
c.ClearSolutions.code_stub = {{"python": {STUB!r}}}
# A submission whose test cells were deleted gets them back from the source (and their points stay at stake).
c.OverwriteCells.add_missing_cells = True
# A whole chapter executes in about two minutes on a CPU, so no cell should need five. A cell that stalls (twice,
# on a shared machine, an autograde of chapter 1 sat idle after its cells had run, nbgrader and kernel both
# waiting) is interrupted, recorded as an error, and grading goes on with the next cell.
c.Execute.timeout = 300
# Feedback shows each test cell's result, not the hidden cases: their code is cut from the test cells and a failed
# check's traceback (which quotes that code) is reduced to its message.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "labsrc.exercises.student.HideHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
'''


@functools.lru_cache(maxsize=None)
def _hide_hidden_tests_class():
    """Build :class:`HideHiddenTests` on first use: nbgrader is imported only where feedback is made."""
    from nbgrader.preprocessors import ClearHiddenTests
    from nbgrader.utils import is_grade

    class HideHiddenTests(ClearHiddenTests):
        """nbgrader's ``ClearHiddenTests`` (the code between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN
        TESTS`` goes) for the feedback of autograded notebooks, which also shortens an error in a test cell to
        ``Name: message``: its traceback quotes the hidden lines. The printed results stay."""

        def preprocess_cell(self, cell, resources, index):
            cell, resources = super().preprocess_cell(cell, resources, index)
            if cell.cell_type == "code" and is_grade(cell):
                for output in cell.get("outputs", []):
                    if output.get("output_type") == "error":
                        output["traceback"] = [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
            return cell, resources

    return HideHiddenTests


def __getattr__(name: str):
    # nbgrader loads the preprocessor by its dotted name from the course's nbgrader_config.py
    if name == "HideHiddenTests":
        return _hide_hidden_tests_class()
    raise AttributeError(name)


def course(root: Path, notebooks: list[Path], assignment: str = ASSIGNMENT) -> Path:
    """Lay out an nbgrader course in ``root``: its ``nbgrader_config.py`` and ``source/<assignment>/`` holding
    ``notebooks`` (the instructor versions). Returns ``root``.

    An ``nbgrader_config.py`` already in ``root`` (an instructor's own course) is kept as it is, never
    overwritten; the lab's settings it lacks are named in a warning (copy them from :data:`CONFIG`)."""
    if not notebooks:
        raise ValueError("no notebooks to put in the course")
    root = Path(root)
    source = root / "source" / assignment
    source.mkdir(parents=True, exist_ok=True)
    config = root / "nbgrader_config.py"
    if not config.exists():
        config.write_text(CONFIG)
    else:
        missing = missing_settings(config.read_text())
        if missing:
            print(f"warning: kept your {config}; it lacks the lab's settings {', '.join(missing)} "
                  "(see labsrc/exercises/student.py, CONFIG)", file=sys.stderr)
    for path in notebooks:
        shutil.copy2(path, source / Path(path).name)
    return root


def missing_settings(config: str) -> list[str]:
    """The names of the settings of :data:`CONFIG` (``c.Section.name``) that the config text ``config`` does not
    set."""
    import re

    wanted = re.findall(r"^(c\.\w+\.\w+) =", CONFIG, flags=re.M)
    return [name for name in wanted if not re.search(rf"^\s*{re.escape(name)}\s*=", config, flags=re.M)]


def nbgrader(root: Path, *args: str, env: dict | None = None) -> str:
    """Run ``nbgrader <args>`` in the course directory ``root``; return its log, raise RuntimeError (with the
    log) when it fails. The log goes to ``root/nbgrader-<command>.log``: with its output in a pipe, an autograde
    of a whole chapter stalled, both nbgrader and its kernel idle, while the same command with a file finished."""
    # nbgrader runs `alembic` (its database migrations) from PATH: put this interpreter's scripts first, so a
    # venv that is not activated works too.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    log_path = Path(root) / f"nbgrader-{args[0]}.log"
    with open(log_path, "w") as log_file:
        done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=root, stdin=subprocess.DEVNULL,
                              stdout=log_file, stderr=subprocess.STDOUT,
                              env={**os.environ, "PATH": path, **(env or {})})
    log = log_path.read_text(errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader {' '.join(args)} failed (exit {done.returncode}):\n{log[-4000:]}")
    return log


def solution_cells(notebook: dict) -> int:
    """How many cells of ``notebook`` (nbformat JSON) nbgrader treats as solution cells."""
    return sum(bool(c.get("metadata", {}).get("nbgrader", {}).get("solution")) for c in notebook["cells"])


def release(root: Path, assignment: str = ASSIGNMENT) -> Path:
    """``nbgrader generate_assignment`` in the course ``root``; returns ``release/<assignment>``."""
    nbgrader(root, "generate_assignment", assignment, "--force")
    return Path(root) / "release" / assignment


def build(src: Path, out: Path) -> dict[str, int]:
    """Write the release version of every ``src/*.ipynb`` into ``out``; return the solution cells per notebook."""
    src, out = Path(src), Path(out)
    notebooks = sorted(src.glob("*.ipynb"))
    if not notebooks:
        raise ValueError(f"no notebooks in {src}")
    with tempfile.TemporaryDirectory(prefix="lclab-course-") as tmp:
        released = release(course(Path(tmp), notebooks))
        out.mkdir(parents=True, exist_ok=True)
        for path in notebooks:
            shutil.copy2(released / path.name, out / path.name)
    return {path.name: solution_cells(json.loads(path.read_text())) for path in notebooks}


def strip_solutions(source: str) -> tuple[str, int]:
    """One cell's source with each solution region replaced by the stub, as nbgrader's ``ClearSolutions``
    does it; and how many regions there were. Raises ValueError on a marker without its partner or nested
    markers."""
    from nbformat.v4 import new_code_cell
    from nbgrader.preprocessors import ClearSolutions

    cell = new_code_cell(source)
    clear = ClearSolutions(code_stub={"python": STUB})
    try:
        clear._replace_solution_region(cell, "python")
    except RuntimeError as err:
        raise ValueError(f"solution markers: {err}") from None
    return cell.source, sum(clear.begin_solution_delimeter in line for line in source.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write the release notebooks with nbgrader generate_assignment (SRC OUT), or lay out an nbgrader "
                    "course for your own class (--course DIR NOTEBOOK...).")
    parser.add_argument("paths", type=Path, nargs="+",
                        help="SRC OUT: the instructor notebooks' folder (chapters/) and the folder to write the release "
                             "notebooks to; with --course: the instructor notebooks to put in the course")
    parser.add_argument("--course", type=Path, help="lay out an nbgrader course here (nbgrader_config.py and "
                                                    "source/ASSIGNMENT/) and stop")
    parser.add_argument("--assignment", default=ASSIGNMENT, help=f"the assignment's name (default {ASSIGNMENT})")
    args = parser.parse_args(argv)
    if args.course:
        root = course(args.course, args.paths, args.assignment)
        print(f"nbgrader course in {root}: source/{args.assignment}/ holds {len(args.paths)} notebook(s)")
        return 0
    if len(args.paths) != 2:
        parser.error("give SRC and OUT (or --course DIR and notebooks)")
    for name, count in build(*args.paths).items():
        print(f"{name}: {count} solution cell(s) stubbed by nbgrader generate_assignment")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
