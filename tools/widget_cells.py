"""Give the chapters' interactive widgets a static fallback that the book shows (re-runnable, idempotent).

    python tools/widget_cells.py [--check]

A widget needs a kernel: in the static book, the widget JavaScript could at best draw sliders that move
nothing, and it would have to come from a CDN (blank offline). So the book loads no widget JavaScript
(``nb_ipywidgets_js: {}`` in _config.yml), and each widget cell displays ONE output carrying two views:

* the widget view (``application/vnd.jupyter.widget-view+json``), which JupyterLab, Colab and Binder render
  as the live widget;
* the widget function's output for the starting values, captured with ``capture_output`` (a figure's
  ``image/png``, or printed text as ``text/html``), which pages without a kernel show instead: the book
  (``nb_mime_priority_overrides`` ranks the widget view below every rich type), GitHub, nbviewer.

A widget output with no such fallback renders as an empty widget box in the book, and ``make test-browser``
fails on it. This script edits only the cells that build a ``widgets.interactive``, by replacing exact
snippets (below); a cell already edited is left as it is, and a cell whose snippet changed in the meantime is
reported (exit 1) rather than guessed at. Run it after merging changes to the chapters: other cells are not
touched, and the notebooks keep their JSON format (indent 1, UTF-8 as is, trailing newline).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# notebook -> list of (old snippet, new snippet) applied to the one code cell that contains `marker`.
CAPTURE_IMPORT = "from IPython.utils.capture import capture_output\n"

KV_OLD_IMPORTS = "import ipywidgets as widgets\nfrom IPython.display import display\n"
KV_NEW_IMPORTS = ("import html\n\nimport ipywidgets as widgets\nfrom IPython.display import display\n"
                  + CAPTURE_IMPORT)
KV_OLD_DISPLAY = "display(calculator)\n"
KV_NEW_DISPLAY = '''\
# One output, two views: a notebook shows the live widget; a page without a kernel (the
# book, GitHub) shows the report for the starting settings, captured here, instead of an
# inert widget.
with capture_output() as starting_view:
    describe(**calculator.kwargs)
display(
    {
        **calculator._repr_mimebundle_(),
        "text/html": f"<pre>{html.escape(starting_view.stdout)}</pre>",
        "text/plain": starting_view.stdout,
    },
    raw=True,
)
'''

ROPE_OLD_DISPLAY = '''\
display(widgets.interactive(draw_angles, factor=widgets.FloatSlider(value=2.0, min=1.0, max=16.0, step=0.5,
                                                                    description="factor s"), ax=widgets.fixed(None)))
draw_angles(4.0)  # the static snapshot
'''
ROPE_NEW_DISPLAY = '''\
angle_widget = widgets.interactive(
    draw_angles,
    ax=widgets.fixed(None),
    factor=widgets.FloatSlider(
        value=4.0, min=1.0, max=16.0, step=0.5, description="factor s"
    ),
)
# One output, two views: a notebook shows the live widget; a page without a kernel (the
# book, GitHub) shows the figure for the starting factor (the static snapshot at s = 4),
# captured here, instead of an inert widget.
with capture_output() as starting_view:
    draw_angles(**angle_widget.kwargs)
display({**angle_widget._repr_mimebundle_(), **starting_view.outputs[-1].data},
        metadata=starting_view.outputs[-1].metadata, raw=True)
'''
ROPE_IMPORT_ANCHOR = "from IPython.display import display\n"

EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "chapters/01_kv_cache.ipynb": [
        ("calculator = widgets.interactive(", [(KV_OLD_IMPORTS, KV_NEW_IMPORTS), (KV_OLD_DISPLAY, KV_NEW_DISPLAY)]),
    ],
    "chapters/04_rope.ipynb": [
        # the chapter imports everything in its first code cell
        ("import ipywidgets as widgets\n", [(ROPE_IMPORT_ANCHOR, ROPE_IMPORT_ANCHOR + CAPTURE_IMPORT)]),
        ('description="factor s"', [(ROPE_OLD_DISPLAY, ROPE_NEW_DISPLAY)]),
    ],
}


class CellChanged(RuntimeError):
    """A widget cell no longer holds the snippet this script replaces (nor its replacement)."""


def edit_source(source: str, edits: list[tuple[str, str]], where: str) -> str:
    """Apply each (old, new) replacement once; skip those already applied (``new`` present)."""
    for old, new in edits:
        if new in source:
            continue
        if source.count(old) != 1:
            raise CellChanged(f"{where}: expected exactly one {old.splitlines()[0]!r}... to replace, found "
                              f"{source.count(old)}; the cell changed, update tools/widget_cells.py")
        source = source.replace(old, new)
    return source


def edit_notebook(nb: dict, plan: list[tuple[str, list[tuple[str, str]]]], name: str) -> int:
    """Edit the cells of ``nb`` (a notebook's JSON) in place; return how many cells changed."""
    changed = 0
    for marker, edits in plan:
        cells = [c for c in nb["cells"] if c["cell_type"] == "code" and marker in "".join(c["source"])]
        if len(cells) != 1:
            raise CellChanged(f"{name}: expected one code cell containing {marker!r}, found {len(cells)}")
        cell = cells[0]
        before = "".join(cell["source"])
        # Snippets end with a newline; a cell's last line has none in the stored notebook.
        after = edit_source(before + "\n", edits, f"{name} cell {cell.get('id')}")[:-1]
        if after != before:
            # keep the cell's storage form: one string, or a list of lines
            cell["source"] = after if isinstance(cell["source"], str) else after.splitlines(keepends=True)
            changed += 1
    return changed


def dump(nb: dict) -> str:
    """The repository's notebook format."""
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs the edit")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    args = parser.parse_args(argv)
    pending = []
    for rel, plan in EDITS.items():
        path = args.root / rel
        nb = json.loads(path.read_text(encoding="utf-8"))
        try:
            changed = edit_notebook(nb, plan, rel)
        except CellChanged as exc:
            print(f"widget cells: {exc}", file=sys.stderr)
            return 1
        if changed:
            pending.append(rel)
            if not args.check:
                path.write_text(dump(nb), encoding="utf-8")
        print(f"{rel}: {'needs' if args.check and changed else 'edited' if changed else 'already has'} "
              f"the widget fallback{f' ({changed} cell(s))' if changed else ''}")
    return 1 if args.check and pending else 0


if __name__ == "__main__":
    sys.exit(main())
