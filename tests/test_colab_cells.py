"""Each chapter installs the lab on Colab (and only there), from the repository named once in _config.yml."""
import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import colab_cells  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_first_code_cell_installs_the_lab_on_colab(path):
    cells = json.loads(path.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    url, branch = colab_cells.repository()
    assert "".join(first["source"]) == colab_cells.cell_source(url, branch), \
        "run python tools/colab_cells.py (the repository URL comes from _config.yml)"
    assert first["metadata"].get("tags") == ["remove-cell"], "the book does not show the install cell"


def test_the_cell_does_nothing_outside_colab_and_pip_installs_on_colab(tmp_path):
    source = colab_cells.cell_source("https://example.invalid/lab", "main")
    # Outside Colab: runs, and would fail loudly if it tried to reach the (invalid) URL.
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and not out.stdout and not out.stderr
    # On Colab (COLAB_RELEASE_TAG set): it calls pip with the repository; a stub pip records the call.
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!{sys.executable}\nimport sys; print(' '.join(sys.argv[1:]))\n")
    fake.chmod(0o755)
    code = source.replace("sys.executable", repr(str(fake)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "COLAB_RELEASE_TAG": "test"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "-m pip install -q labsrc[chapters] @ git+https://example.invalid/lab@main"


def test_the_script_is_idempotent(tmp_path):
    nb = tmp_path / "x.ipynb"
    nb.write_text(CHAPTERS[0].read_text())
    source = colab_cells.cell_source(*colab_cells.repository())
    colab_cells.apply(nb, source)
    once = nb.read_text()
    assert not colab_cells.apply(nb, source) and nb.read_text() == once
    assert once.count(colab_cells.MARKER) == 1


# --- what the cell installs covers what the chapters import ------------------------------------------------
def _imports(source: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in ``source``, function-local ones included (labsrc imports
    its optional oracles inside the functions that use them)."""
    out = []
    tree = ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, [a.name for a in node.names]))
    return out


def _labsrc_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def reachable_modules(sources: list[str]) -> set[str]:
    """Top-level third-party modules the code in ``sources`` imports, directly or through any labsrc module
    it imports (and the packages above it), at any depth."""
    third, todo, seen = set(), list(sources), set()
    while todo:
        for module, names in _imports(todo.pop()):
            if module.split(".")[0] != "labsrc":
                third.add(module.split(".")[0])
                continue
            parts = module.split(".")
            candidates = [".".join(parts[:k]) for k in range(1, len(parts) + 1)] + [f"{module}.{n}" for n in names]
            for name in candidates:
                path = _labsrc_file(name)
                if path and name not in seen:
                    seen.add(name)
                    todo.append(path.read_text())
    return {m for m in third if m not in sys.stdlib_module_names}


def _norm(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def installed_by(source: str) -> set[str]:
    """The distributions the Colab cell's ``pip install labsrc[extras] @ ...`` brings: the project's
    dependencies and those of each extra it names (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = re.search(r'"labsrc(?:\[([^\]]*)\])? @ git\+', source)
    assert spec, "the Colab cell does not pip install labsrc from the repository"
    extras = [e.strip() for e in (spec.group(1) or "").split(",") if e.strip()]
    reqs = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {_norm(r) for r in reqs}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_colab_cell_installs_everything_the_chapter_imports(path):
    """Opened on Colab, a chapter only has what its install cell brings (and Python's standard library): every
    third-party module the chapter reaches, through labsrc included, must come with labsrc or the extra."""
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    have = installed_by(code[0])
    dists = md.packages_distributions()
    missing = {m: dists.get(m, [m]) for m in reachable_modules(code[1:])
               if not {_norm(d) for d in dists.get(m, [m])} & have}
    assert not missing, (f"{path.name} imports {sorted(missing)} (from {missing}), which the Colab cell does not "
                         "install: add them to the 'chapters' extra in pyproject.toml")


def test_the_chapters_extra_is_part_of_dev():
    """make setup installs dev, not chapters: dev must bring every package of the chapters extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {_norm(r) for r in extras["chapters"]} <= {_norm(r) for r in extras["dev"]}
