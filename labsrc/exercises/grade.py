"""Autograde a folder of submissions with nbgrader and print a per-exercise score table.

``submissions/`` holds one folder per student, each with the chapter notebooks that student hands in::

    submissions/ada/01_kv_cache.ipynb
    submissions/ada/03_flash_attention.ipynb
    submissions/grace/01_kv_cache.ipynb

The command lays out an nbgrader course (:func:`labsrc.exercises.student.course`) with the instructor notebooks
of the chapters handed in as the source, runs ``nbgrader generate_assignment`` (which records every test cell,
hidden tests included, in the gradebook), copies each submission to ``submitted/<student>/lab/`` and runs
``nbgrader autograde lab``. Autograde replaces every test cell's source with the instructor's (hidden tests
included), puts back test cells a student deleted, executes each notebook to the end whatever fails, and gives a
test cell its points only if it raised nothing. The kernels run with ``LAB_EXERCISES=strict`` (a failed visible
check raises too) and import the ``labsrc`` this module belongs to. Usage::

    python -m labsrc.exercises.grade submissions/ --csv grades.csv [--course course/] [--source chapters/]

``--course`` keeps the course directory (gradebook, autograded notebooks) for ``nbgrader generate_feedback``;
without it a temporary one is used and removed. A chapter a student did not hand in scores 0.

On a machine without Triton (macOS, Windows) the kernel exercises cannot run: their checks raise, so they score
0, and the command lists them after the table as not graded on this machine. Grade on Linux for those points.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from labsrc.exercises.core import NOT_GRADED
from labsrc.exercises.student import ASSIGNMENT, course, nbgrader, release

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ScoreTable:
    """Points per student and exercise. ``exercises`` lists ``(notebook, grade_id, max_points)`` in the order
    of the notebooks and of their cells; ``scores[student][(notebook, grade_id)]`` is the points earned."""

    exercises: list[tuple[str, str, float]]
    scores: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    # (notebook, grade_id) of the exercises whose checks could not run on the grading machine (a kernel exercise
    # without Triton): they scored 0 for every student, whatever the answer.
    ungraded: set[tuple[str, str]] = field(default_factory=set)

    def ungraded_note(self) -> str:
        """A line naming the exercises that could not be graded here, or "" when every one was."""
        if not self.ungraded:
            return ""
        names = [column for column, (notebook, grade_id, _) in zip(self.columns(), self.exercises)
                 if (notebook, grade_id) in self.ungraded]
        return (f"{NOT_GRADED} (Triton is missing, so these kernel exercises scored 0; grade on Linux): "
                + ", ".join(names))

    def total(self, student: str) -> float:
        return sum(self.scores[student].values())

    @property
    def max_total(self) -> float:
        return sum(points for _, _, points in self.exercises)

    def columns(self) -> list[str]:
        return [f"{notebook.split('_')[0]}:{grade_id.removeprefix('check_')}" for notebook, grade_id, _ in
                self.exercises]

    def rows(self) -> list[list]:
        """Header, one row per student, and the row of maximum points."""
        keys = [(notebook, grade_id) for notebook, grade_id, _ in self.exercises]
        rows = [["student", *self.columns(), "total"]]
        for student in sorted(self.scores):
            rows.append([student, *(_number(self.scores[student][k]) for k in keys), _number(self.total(student))])
        rows.append(["(max)", *(_number(points) for _, _, points in self.exercises), _number(self.max_total)])
        return rows

    def to_csv(self) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(self.rows())
        return out.getvalue()

    def to_markdown(self) -> str:
        rows = [[str(x) for x in row] for row in self.rows()]
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        if self.ungraded:
            lines += ["", self.ungraded_note()]
        return "\n".join(lines) + "\n"


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(float(x), 2)


def exercises_of(notebook: Path) -> list[tuple[str, float]]:
    """``(grade_id, points)`` of each autograded test cell of a source notebook, in cell order."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    meta = [c.get("metadata", {}).get("nbgrader", {}) for c in cells]
    return [(m["grade_id"], float(m["points"])) for m in meta if m.get("grade")]


def grade(submissions: Path, source: Path = ROOT / "chapters", course_dir: Path | None = None) -> ScoreTable:
    """Autograde every ``submissions/<student>/*.ipynb`` against the instructor notebooks in ``source``."""
    submissions, source = Path(submissions), Path(source)
    if not submissions.is_dir():
        raise ValueError(f"submissions: {submissions} is not a folder (one subfolder of notebooks per student)")
    students = sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not students:
        raise ValueError(f"no student folders in {submissions}")
    handed_in = sorted({nb.name for s in students for nb in s.glob("*.ipynb")})
    unknown = [name for name in handed_in if not (source / name).exists()]
    if unknown:
        raise ValueError(f"{unknown} are not notebooks of {source}; name submissions as the chapters are named")
    if not handed_in:
        raise ValueError(f"no notebooks in the student folders of {submissions}")
    with tempfile.TemporaryDirectory(prefix="lclab-grade-") as tmp:
        root = Path(course_dir) if course_dir else Path(tmp)
        course(root, [source / name for name in handed_in])
        release(root)
        for student in students:
            target = root / "submitted" / student.name / ASSIGNMENT
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            for nb in student.glob("*.ipynb"):
                shutil.copy2(nb, target / nb.name)
        env = {"LAB_EXERCISES": "strict",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               # the chapters record claims and ledger rows: keep a student's numbers out of the lab's own
               "LAB_CLAIMS_DIR": str(root / "claims"), "LAB_LEDGER": str(root / "ledger.jsonl")}
        nbgrader(root, "autograde", ASSIGNMENT, "--force", env=env)
        table = _read_gradebook(root, source, handed_in, [s.name for s in students])
        table.ungraded = not_graded_here(root, handed_in, [s.name for s in students])
        return table


def not_graded_here(root: Path, notebooks: list[str], students: list[str]) -> set[tuple[str, str]]:
    """``(notebook, grade_id)`` of every test cell whose output, in any student's autograded notebook, says its
    check could not run on this machine (:data:`labsrc.exercises.core.NOT_GRADED`: a kernel without Triton)."""
    found = set()
    for student in students:
        for name in notebooks:
            path = Path(root) / "autograded" / student / ASSIGNMENT / name
            if not path.exists():
                continue
            for cell in json.loads(path.read_text())["cells"]:
                meta = cell.get("metadata", {}).get("nbgrader", {})
                if meta.get("grade") and NOT_GRADED in json.dumps(cell.get("outputs", [])):
                    found.add((name, meta["grade_id"]))
    return found


def _read_gradebook(root: Path, source: Path, notebooks: list[str], students: list[str]) -> ScoreTable:
    from nbgrader.api import Gradebook, MissingEntry

    table = ScoreTable([(name, grade_id, points) for name in notebooks
                        for grade_id, points in exercises_of(source / name)])
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student in students:
            scores = table.scores[student] = {}
            for name in notebooks:
                try:
                    graded = {g.name: g.score for g in
                              gb.find_submission_notebook(Path(name).stem, ASSIGNMENT, student).grades}
                except MissingEntry:   # this student did not hand this chapter in
                    graded = {}
                for grade_id, _ in exercises_of(source / name):
                    scores[(name, grade_id)] = float(graded.get(grade_id) or 0.0)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Autograde submissions/<student>/*.ipynb with nbgrader.")
    parser.add_argument("submissions", type=Path, help="folder with one subfolder of notebooks per student")
    parser.add_argument("--csv", type=Path, help="write the score table here as CSV")
    parser.add_argument("--course", type=Path, help="keep the nbgrader course here (for generate_feedback)")
    parser.add_argument("--source", type=Path, default=ROOT / "chapters", help="the instructor notebooks")
    args = parser.parse_args(argv)
    from labsrc import runtime

    if not runtime.HAS_TRITON:
        print("warning: Triton is not installed here, so the kernel exercises cannot run and will score 0; "
              "grade on Linux to award them. The table will name them.", file=sys.stderr)
    table = grade(args.submissions, args.source, args.course)
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        args.csv.write_text(table.to_csv())
    print(table.to_markdown(), end="")
    if table.ungraded:
        print(f"warning: {table.ungraded_note()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
