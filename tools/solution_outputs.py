"""Tag every chapter cell whose output depends on an exercise's solution ``remove-output``.

    python tools/solution_outputs.py [--check] [NOTEBOOK ...]

The book renders each chapter as executed with the instructor's solutions, with the solution regions replaced by
the students' stubs (``tools/stage_book.py``). A cell below an exercise that calls the student's function (or
reads a name the solution cell defines, or a name computed from one) printed, in that run, what the *solution*
computes: left on the page, it hands the answer to every reader of the stub above it. Such cells keep their
code but lose their output in the book: they carry Jupyter Book's ``remove-output`` tag, and the book's
release view clears their outputs from the notebook a reader downloads as well.

Which cells depend on a solution is decided from the code alone (:func:`dependent_cells`): a solution cell's
top-level names are tainted; a cell that reads a tainted name is dependent, and the names bound by the
statement that read it become tainted; a statement that binds a name without reading a tainted one clears it.
A value also travels by mutation: ``results.append(solve(x))`` binds nothing but puts the solution's value in
``results``, and a solution cell may work by filling a table (``table[k] = ...``, ``cache.update(...)``). So the
objects such a statement may change are tainted as well (:func:`mutated_names`: the names at the root of an
attribute or item it assigns or deletes, of a method it calls, and the names it passes to a call), and a
mutation never clears a taint.
Test cells (nbgrader ``grade``) are dependent by construction and lose their outputs anyway, so they need no
tag. ``--check`` changes nothing and exits 1 naming each cell that lacks its tag; the same rule is a test
(``tests/test_chapters.py``) and, on the rendered page, a browser check (``tools/browser_check.py``).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "remove-output"
BEGIN = "### BEGIN SOLUTION"
# What nbgrader leaves of a solution region in the release version (labsrc.exercises.student.STUB).
STUB_MARK = "# YOUR CODE HERE"


def _code(source: str) -> ast.Module:
    """Parse a cell's code; IPython magics and shell lines are blanked (they bind no Python name)."""
    lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.split("\n")]
    return ast.parse("\n".join(lines))


def bound_names(tree: ast.Module) -> set[str]:
    """Names a cell binds at top level: assignments, loop and ``with`` targets, definitions and imports (a
    function's local variables are not the notebook's)."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            return  # its body binds locals
        if isinstance(node, ast.Lambda):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _root(node) -> str | None:
    """The name at the root of ``a.b[c].d``, if the expression starts with one."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def mutated_names(tree: ast.Module, modules: set[str] = frozenset()) -> set[str]:
    """Names whose objects a cell may change in place at top level: the root of every attribute or item it
    assigns, augments or deletes (``a[k] = v``, ``a.x += v``, ``del a[k]``), of every method it calls
    (``a.append(v)``, ``a.b.update(v)``), and every name it passes to a call (``fill(a, v)`` may fill ``a``).
    ``modules`` (names bound by imports) are left out: ``np.append(a, v)`` changes neither ``np`` nor ``a``'s
    module."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return  # a definition changes nothing until it is called
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets = [node.optional_vars]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    names.add(_root(sub))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                names.add(_root(node.func.value))
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                names.add(_root(arg))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {n for n in names if n is not None} - set(modules) - set(dir(builtins))


def _imported(tree: ast.Module) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}


def read_names(tree: ast.Module) -> set[str]:
    """Every name a cell reads, function bodies included (they run when the cell calls them); ``a += b`` reads
    ``a`` too (its target is a store in the syntax tree)."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return names | {_root(n.target) for n in ast.walk(tree) if isinstance(n, ast.AugAssign)} - {None}


def dependent_cells(cells: list[tuple[str, bool]]) -> dict[int, set[str]]:
    """For code cells given in notebook order as ``(source, is_solution_cell)``: the index of every cell that
    reads a name whose value comes from a solution, with the names it reads. A solution cell is not itself
    listed (its region is stubbed in the release version); the names it binds are where the taint starts."""
    tainted: set[str] = set()
    modules: set[str] = set()
    found: dict[int, set[str]] = {}
    for i, (source, is_solution) in enumerate(cells):
        tree = _code(source)
        modules |= _imported(tree)
        if is_solution:
            tainted |= bound_names(tree) | mutated_names(tree, modules)
            continue
        # Statement by statement, so that `x = fresh(); print(x)` after a tainted x reads the fresh value.
        for statement in tree.body:
            part = ast.Module(body=[statement], type_ignores=[])
            bound = bound_names(part)
            uses = (read_names(part) & tainted) - set(dir(builtins))
            if uses:
                found.setdefault(i, set()).update(uses)
                tainted |= bound | mutated_names(part, modules)
            else:
                tainted -= bound - mutated_names(part, modules)
    return found


def notebook_dependents(nb: dict) -> list[tuple[int, set[str], bool]]:
    """``(cell index, names read, is a test cell)`` for each cell of an instructor notebook whose output
    depends on a solution."""
    code = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for _, c in code]
    deps = dependent_cells([(src, BEGIN in src) for src in sources])
    return [(code[k][0], names, bool(code[k][1].get("metadata", {}).get("nbgrader", {}).get("grade")))
            for k, names in sorted(deps.items())]


def untagged(nb: dict) -> list[tuple[int, set[str]]]:
    """Cells whose output depends on a solution and that lack the ``remove-output`` tag (test cells exempt)."""
    return [(i, names) for i, names, graded in notebook_dependents(nb)
            if not graded and TAG not in nb["cells"][i].get("metadata", {}).get("tags", [])]


def page_problems(cells: list[tuple[str, bool]]) -> list[str]:
    """What a rendered chapter must not show, from its code cells in page order as ``(code shown, has an
    output)``: an output under a cell that reads a name a stubbed solution cell defines (directly or through a
    name computed from one). Solution cells are recognised by nbgrader's stub; a cell whose shown code does not
    parse (a fragment) counts as binding and reading nothing."""
    parsed = []
    for source, has_output in cells:
        try:
            _code(source)
        except SyntaxError:
            source = ""
        parsed.append((source, has_output))
    deps = dependent_cells([(src, STUB_MARK in src and "NotImplementedError" in src) for src, _ in parsed])
    return [f"an output under a cell that reads {', '.join(sorted(names))}, which a solution defines (it shows "
            f"the instructor's result under the student's stub; tag the cell remove-output): cell starting "
            f"{parsed[i][0].strip().splitlines()[0][:80]!r}"
            for i, names in sorted(deps.items()) if parsed[i][1]]


def apply(path: Path) -> list[int]:
    """Tag the cells of ``path`` that need it; returns their indices. Keeps the file's JSON format."""
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    missing = [i for i, _ in untagged(nb)]
    for i in missing:
        nb["cells"][i].setdefault("metadata", {}).setdefault("tags", []).append(TAG)
    if missing:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + ("\n" if raw.endswith("\n") else ""),
                        encoding="utf-8")
    return missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a cell lacks its tag")
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    bad = 0
    for path in args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb")):
        if args.check:
            for i, names in untagged(json.loads(path.read_text(encoding="utf-8"))):
                print(f"{path.name} cell {i}: its output depends on a solution ({', '.join(sorted(names))}) "
                      f"but it lacks the {TAG!r} tag; run python tools/solution_outputs.py")
                bad += 1
        else:
            for i in apply(path):
                print(f"{path.name} cell {i}: tagged {TAG!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
