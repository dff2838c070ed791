"""Lay out the book's sources in one folder, with executed notebooks and generated pages.

``make book`` never executes a notebook itself: ``make execute`` ran each chapter once (through nbmake, which is
also the notebook test) and left executed copies in ``_executed/chapters/``. This script copies the book pages and
those executed copies into ``_build/src/`` and writes the fragments that two pages include:

* ``book/_generated/claims_table.md``: the claims ledger, from the records the notebooks wrote;
* ``book/_generated/bench_tables.md``: the latest GPU results under ``kernels/results/``, or a sentence saying
  that none were recorded;
* ``book/_generated/compile_table.md``: every kernel's registers, spills and shared memory on sm_80 and sm_90,
  from ``kernels/results/compile.json`` (``python -m labsrc.gpucheck --compile-only``), and which Triton
  versions were checked (``compile-triton-<version>.json`` beside it, ``make compile-check TRITON=<version>``);

and copies a local MathJax next to the pages, so the book needs no network to show its math.

The chapters are rendered as their release version (:func:`release_view`): the executed instructor copy with
nbgrader's ``ClearSolutions`` and ``ClearHiddenTests`` applied to its sources, so the page and its download
button show the stubs students get, never a worked solution, while every other output stays as executed (each
chapter still runs once). The worked solutions live in the instructor notebooks in ``chapters/``.

Usage: ``python tools/stage_book.py`` (from the repository root).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labsrc.bench import format_table  # noqa: E402
from labsrc.gpucheck.compile import markdown_table  # noqa: E402
from labsrc import claims  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import solution_outputs  # noqa: E402


def bench_markdown(results_dir: Path) -> str:
    """Markdown for every GPU result file (newest first); a plain statement when there is none."""
    files = sorted(results_dir.glob("*-gpu.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not files:
        return ("**No GPU results have been recorded yet.** Every kernel is checked and smoke-timed under Triton's "
                "interpreter in CI, but interpreter timings say nothing about GPU speed, so none are shown here. "
                "On a GPU box, `make gpu-check` (`python -m labsrc.gpucheck --all`, about 8 minutes on one "
                "H100/H200) checks every kernel against its reference, times it against its PyTorch baseline and "
                "writes the file this page shows.\n")
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        s = data["stamp"]
        parts.append(f"### {s['device']} ({s['date']})\n\ntorch {s['torch']}, triton {s['triton']}, "
                     f"labsrc {s['labsrc']}\n\n```text\n{format_table(data['rows'])}\n```\n")
    return "\n".join(parts)


def compile_markdown(path: Path) -> str:
    """The compile table (kernels x architectures) from ``kernels/results/compile.json``, then one line per
    Triton version checked (that file and each ``compile-triton-<version>.json`` beside it, written by
    ``make compile-check TRITON=<version>``): how many configurations compiled clean, and which did not."""
    if not path.is_file():
        return "**No compile table has been recorded yet.** Run `python -m labsrc.gpucheck --compile-only --out " \
               "kernels/results/compile.json`.\n"
    data = json.loads(path.read_text())
    table = markdown_table(data["kernels"])
    checked = []
    for other in [path, *sorted(path.parent.glob("compile-triton-*.json"))]:
        rows = json.loads(other.read_text())
        bad = [r for r in rows["kernels"] if r.get("problems")]
        version = rows.get("triton", "of unrecorded version")
        what = (f"Triton {version}: {len(rows['kernels'])} configurations, "
                + (f"{len(bad)} with a problem ({', '.join(sorted({r['kernel'].split('.')[-1] for r in bad}))})"
                   if bad else "none with a problem") + f" (`kernels/results/{other.name}`)")
        checked.append(what)
    return (table + "\nThe tables are Triton " + str(data.get("triton", "?")) + "'s. Checked with "
            + "; ".join(checked) + ".\n")


def release_view(notebook: dict) -> dict:
    """An executed instructor notebook as students get it: each solution region replaced by the release stub and
    each test cell's hidden section removed, by nbgrader's own preprocessors. Every output computed from a
    solution goes: those of test cells (they reported on the instructor's solution and hidden cases), of
    solution cells, and of every cell that reads a name a solution defined (``solution_outputs``: such cells
    carry the ``remove-output`` tag, which a test enforces; they are found here from the code as well, so an
    untagged one cannot leak); so do the outputs of any other ``remove-output`` cell, which the page hides and the
    downloaded notebook should not carry either. Every other output is kept."""
    import nbformat
    from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions

    from labsrc.exercises.student import STUB

    dependent = {i for i, _, _ in solution_outputs.notebook_dependents(notebook)}
    nb = nbformat.reads(json.dumps(notebook), as_version=4)   # joins sources stored as lists of lines
    solutions = {i for i, cell in enumerate(nb.cells) if solution_outputs.BEGIN in cell.source}
    nb, _ = ClearSolutions(code_stub={"python": STUB}).preprocess(nb, {})
    nb, _ = ClearHiddenTests().preprocess(nb, {})
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = cell.get("metadata", {})
        if (i in dependent or i in solutions or meta.get("nbgrader", {}).get("grade")
                or solution_outputs.TAG in meta.get("tags", [])):
            cell.outputs, cell.execution_count = [], None
    return json.loads(json.dumps(nb))


def stage(out: Path = ROOT / "_build" / "src", executed: Path = ROOT / "_executed" / "chapters") -> Path:
    chapters = sorted((ROOT / "chapters").glob("*.ipynb"))
    missing = [p.name for p in chapters if not (executed / p.name).exists()]
    if missing:
        raise SystemExit(f"not executed yet: {missing}; run `make execute` first")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in ("_config.yml", "_toc.yml"):
        shutil.copy2(ROOT / name, out / name)
    shutil.copytree(ROOT / "book", out / "book")
    # MathJax is served from the book itself so pages typeset offline. It must not sit under _static/, where
    # jupyter-book would add every .js file as a script tag on every page.
    spec = importlib.util.find_spec("mathjax")  # django-static-mathjax ships MathJax 3's es5 build (Apache-2.0)
    if spec is None:
        raise SystemExit("MathJax missing: pip install django-static-mathjax (part of the 'book' extra)")
    shutil.copytree(Path(spec.origin).parent / "static" / "mathjax" / "es5", out / "_mathjax_static" / "mathjax")
    (out / "chapters").mkdir()
    for path in chapters:
        executed_nb = json.loads((executed / path.name).read_text(encoding="utf-8"))
        (out / "chapters" / path.name).write_text(json.dumps(release_view(executed_nb), indent=1, ensure_ascii=False)
                                                  + "\n", encoding="utf-8")
    generated = out / "book" / "_generated"
    generated.mkdir()
    (generated / "claims_table.md").write_text(claims.render_markdown(claims.load()))
    (generated / "bench_tables.md").write_text(bench_markdown(ROOT / "kernels" / "results"))
    (generated / "compile_table.md").write_text(compile_markdown(ROOT / "kernels" / "results" / "compile.json"))
    return out


if __name__ == "__main__":
    print(f"staged the book in {stage()}")
