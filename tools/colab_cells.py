"""Give every chapter a first cell that installs the lab when the notebook runs on Google Colab.

    python tools/colab_cells.py [--check]

A chapter opened from the book's Colab launch button runs on a fresh Colab machine where ``labsrc`` is not
installed, so its set-up cell would fail at ``import labsrc``. The first code cell of each chapter therefore
installs this repository with pip, with the ``chapters`` extra (the libraries the chapters check against), when
(and only when) it runs on Colab; anywhere else it does nothing. The repository URL and branch are read from
``_config.yml`` (``repository.url``/``branch``), the one place they live: after changing them, run this script
again. The cell is tagged ``remove-cell``, so the book does not show it. The script is idempotent (``--check``
exits 1 naming the notebooks that would change) and keeps each notebook's JSON format.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# On Google Colab, install the lab first"
# The optional dependencies the chapters import (pyproject.toml): fla-core (chapter 8), torchao (chapter 12),
# trl (chapter 13), openai (chapter 9); a fresh Colab runtime is not guaranteed to have them.
EXTRAS = "chapters"


def cell_source(url: str, branch: str) -> str:
    """The Colab cell's code for the repository at ``url`` (branch ``branch``)."""
    return f'''{MARKER} (it is not preinstalled there); anywhere else this cell does nothing.
import os
import subprocess
import sys

if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ:
    spec = "labsrc[{EXTRAS}] @ git+{url}@{branch}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec], check=True)
'''


def repository() -> tuple[str, str]:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    return config["url"].rstrip("/"), config.get("branch", "main")


def apply(path: Path, source: str) -> bool:
    """Put the Colab cell first in ``path`` (replacing an older one); True if the file changed."""
    raw = path.read_text()
    nb = json.loads(raw)
    cells = nb["cells"]
    existing = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and MARKER in "".join(c["source"])]
    like = next((c["source"] for c in cells if c["cell_type"] == "code"), [])
    text = source if isinstance(like, str) else source.splitlines(keepends=True)
    cell = {"cell_type": "code", "execution_count": None, "id": "colab-install",
            "metadata": {"tags": ["remove-cell"]}, "outputs": [], "source": text}
    first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    if existing == [first_code] and cells[first_code] == cell:
        return False
    for i in reversed(existing):
        del cells[i]
    first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    cells.insert(first_code, cell)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + ("\n" if raw.endswith("\n") else ""))
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    source = cell_source(*repository())
    stale = []
    for path in args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb")):
        if args.check:
            before = path.read_text()
            if apply(path, source):
                stale.append(path.name)
                path.write_text(before)
        elif apply(path, source):
            print(f"{path.name}: Colab install cell written")
    if stale:
        print(f"without the current Colab install cell: {', '.join(stale)}; run python tools/colab_cells.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
