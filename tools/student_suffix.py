"""Run each chapter's student version in the same kernel as its instructor version, from where they differ.

A release notebook (``release/chapters/``, what nbgrader writes from ``chapters/``) is its instructor notebook
with every solution region replaced by a stub and the hidden tests removed; every other cell is the same, and
in every chapter the first cell that differs is in the exercises at the end. Executing the release notebook
from the top would re-run every experiment the instructor execution has just run, to prove nothing new. So
``make execute`` runs one notebook per chapter: the instructor cells, then a cell that switches to the
student's setting (checks print instead of raising, claims and ledger rows go elsewhere), then the release
cells from the first one that differs. The suffix proves what a separate student run proved: with every
exercise unsolved, each check reports it and the chapter runs to its end.

One thing the shared kernel could hide: a name bound only by an instructor cell (a solution or a hidden test)
and read by a later cell would exist in the combined run and be missing in a student's. :func:`leaked_names`
finds such names; ``combine`` refuses to write a notebook that has one (tests/test_student_suffix.py applies it
to every chapter).

Usage (what the Makefile runs)::

    python tools/student_suffix.py combine chapters release/chapters _executed/chapters
    # ... execute _executed/chapters/*.ipynb ...
    python tools/student_suffix.py split _executed/chapters _executed/student
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import nbformat

MARKER = "student-suffix"   # the metadata key of the switching cell
SWITCH = '''\
# Below: the release (student) version of the exercises, run in the kernel of the instructor version above
# (tools/student_suffix.py). Checks now print "not solved yet" instead of raising, as on a student's machine.
import os
os.environ["LAB_EXERCISES"] = ""
os.environ["LAB_CLAIMS_DIR"] = {claims!r}
os.environ["LAB_LEDGER"] = {ledger!r}
'''


def first_difference(instructor, student) -> int:
    """Index of the first cell whose type or source differs. The two must have the same cells otherwise."""
    if len(instructor.cells) != len(student.cells):
        raise ValueError(f"the release notebook has {len(student.cells)} cells and the instructor one "
                         f"{len(instructor.cells)}: run `make release`")
    for i, (a, b) in enumerate(zip(instructor.cells, student.cells)):
        if a.cell_type != b.cell_type:
            raise ValueError(f"cell {i} is {a.cell_type} in the instructor notebook and {b.cell_type} in the "
                             "release one: run `make release`")
        if a.source != b.source:
            return i
    return len(instructor.cells)


def _bound(source: str) -> set[str]:
    """Names a cell binds at top level: assignments, loop and ``with`` targets, imports, defs and classes
    (not the names a function or class binds inside its own body)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:   # an IPython magic: nothing to compare
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return names


def _read(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def leaked_names(instructor, student) -> list[tuple[int, str, int]]:
    """``(cell, name, reader)``: ``name`` is bound by instructor cell ``cell`` but not by its release version,
    and release cell ``reader`` (later) reads it. Each would be a NameError on a student's machine that the
    combined run cannot show."""
    leaks = []
    code = [(i, a.source, b.source) for i, (a, b) in enumerate(zip(instructor.cells, student.cells))
            if a.cell_type == "code"]
    for i, ours, theirs in code:
        if ours == theirs:
            continue
        only_ours = _bound(ours) - _bound(theirs)
        for j, _, later in code:
            if j > i:
                leaks += [(i, name, j) for name in sorted(only_ours & _read(later))]
    return leaks


def combine(instructor, student, *, claims: str, ledger: str):
    """The instructor notebook, the switching cell, then the release cells from the first difference."""
    k = first_difference(instructor, student)
    leaks = leaked_names(instructor, student)
    if leaks:
        raise ValueError("names only the instructor cells bind, read by later cells (a student would get a "
                         f"NameError): {leaks}")
    nb = nbformat.from_dict(instructor)   # a copy: the caller's notebook stays as it was
    switch = nbformat.v4.new_code_cell(SWITCH.format(claims=claims, ledger=ledger))
    switch.metadata[MARKER] = {"instructor_cells": len(instructor.cells), "first_difference": k}
    suffix = [nbformat.from_dict(dict(c)) for c in student.cells[k:]]
    for c in suffix:
        c.metadata[MARKER] = True
        c.id = f"student-{c.id}"[:64]   # cell ids must stay unique in the one notebook
    nb.cells = list(instructor.cells) + [switch] + suffix
    return nb


def split(combined):
    """``(instructor, student_suffix)`` of an executed combined notebook; ``student_suffix`` is ``None`` when
    the notebook was not combined."""
    marks = [i for i, c in enumerate(combined.cells) if isinstance(c.metadata.get(MARKER), dict)]
    if not marks:
        return combined, None
    n = marks[0]
    student = nbformat.from_dict(dict(combined))
    student.cells = combined.cells[n:]
    combined.cells = combined.cells[:n]
    return combined, student


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("combine", help="write instructor + student-suffix notebooks into OUT")
    c.add_argument("chapters", type=Path)
    c.add_argument("release", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--student-dir", type=Path, default=Path("_executed/student"),
                   help="where the suffix's claims and ledger rows go")
    s = sub.add_parser("split", help="cut executed combined notebooks back to the instructor cells")
    s.add_argument("executed", type=Path)
    s.add_argument("student_out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "combine":
        args.out.mkdir(parents=True, exist_ok=True)
        student_dir = args.student_dir.resolve()
        for path in sorted(args.chapters.glob("*.ipynb")):
            nb = combine(nbformat.read(path, 4), nbformat.read(args.release / path.name, 4),
                         claims=str(student_dir / "claims"), ledger=str(student_dir / "ledger.jsonl"))
            nbformat.write(nb, args.out / path.name)
    else:
        args.student_out.mkdir(parents=True, exist_ok=True)
        for path in sorted(args.executed.glob("*.ipynb")):
            instructor, student = split(nbformat.read(path, 4))
            if student is None:
                print(f"{path}: not a combined notebook", file=sys.stderr)
                return 1
            nbformat.write(instructor, path)
            nbformat.write(student, args.student_out / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
