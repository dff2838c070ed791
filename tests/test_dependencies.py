"""pyproject.toml declares what the lab imports, and imports what it declares."""
from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Declared for what they do, not for an import: a pytest plugin, Jupyter's kernel and UI, the book builder,
# MathJax for the offline book, the notebook runner.
NOT_IMPORTED = {"ipykernel", "jupyterlab", "jupyter-book", "django-static-mathjax", "nbmake", "pytest-xdist",
                "pytest-playwright"}
# The package and the repository's own scripts and test helpers, which import each other by file name.
LOCAL = {"labsrc", "tests"} | {p.stem for folder in ("tools", "tests") for p in (ROOT / folder).rglob("*.py")}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def declared() -> set[str]:
    reqs = PROJECT["dependencies"] + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]
    return {_name(r) for r in reqs}


def imported() -> dict[str, set[str]]:
    """Top-level modules imported by the package, tests, tools and chapters, with where."""
    found: dict[str, set[str]] = {}

    def scan(source: str, where: str):
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(where)

    for folder in ("labsrc", "tests", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            scan(path.read_text(), folder)
    for path in (ROOT / "chapters").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                src = "".join(cell["source"])
                scan("\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))), "chapters")
    return {m: w for m, w in found.items() if m not in sys.stdlib_module_names and m not in LOCAL}


def test_every_third_party_import_is_declared():
    dists = md.packages_distributions()
    have = declared()
    missing = {m: sorted(w) for m, w in imported().items()
               if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & have}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declared_package_is_used():
    dists = md.packages_distributions()
    used = {d.lower().replace("_", "-") for m in imported() for d in dists.get(m, [m])}
    unused = declared() - used - NOT_IMPORTED
    assert not unused, f"declared in pyproject.toml but never imported: {sorted(unused)}"
