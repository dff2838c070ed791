"""Write the student version of the chapter notebooks.

Solutions sit between nbgrader's markers inside an exercise function::

    def bytes_per_token(...):
        ### BEGIN SOLUTION
        return 2 * n_layers * ...
        ### END SOLUTION

The student build replaces each such block with a stub at the same indentation::

        # YOUR CODE HERE
        raise NotImplementedError("not solved yet")

so the check cell that follows prints "not solved yet" and the notebook still runs to the end. nbgrader itself
can read the same markers (``nbgrader generate_assignment``); this small script exists so that ``make student``
needs no nbgrader course directory. Usage::

    python -m labsrc.exercises.student chapters _build/student
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", 'raise NotImplementedError("not solved yet")')


def strip_solutions(source: str) -> tuple[str, int]:
    """Replace every solution block in one cell's source; return the new source and how many blocks there were.

    Raises ValueError on a marker without its partner, or nested markers, naming the line.
    """
    out, inside, indent, count = [], False, "", 0
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"line {number}: {BEGIN!r} inside another solution block")
            inside, indent, count = True, re.match(r"\s*", line).group(0), count + 1
            out.extend(f"{indent}{s}\n" for s in STUB)
        elif marker == END:
            if not inside:
                raise ValueError(f"line {number}: {END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "".join(out), count


def student_notebook(notebook: dict) -> tuple[dict, int]:
    """A copy of ``notebook`` (nbformat JSON) with solutions stubbed and outputs cleared, and the block count."""
    nb = json.loads(json.dumps(notebook))
    total = 0
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        try:
            new_source, count = strip_solutions(source)
        except ValueError as err:
            raise ValueError(f"cell {index}: {err}") from None
        cell["source"] = new_source
        cell["outputs"], cell["execution_count"] = [], None
        total += count
    return nb, total


def build(src: Path, out: Path) -> dict[str, int]:
    """Write the student version of every ``src/*.ipynb`` into ``out``; return solution blocks per notebook."""
    src, out = Path(src), Path(out)
    notebooks = sorted(src.glob("*.ipynb"))
    if not notebooks:
        raise ValueError(f"no notebooks in {src}")
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for path in notebooks:
        nb, counts[path.name] = student_notebook(json.loads(path.read_text()))
        (out / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write student notebooks with the solutions stubbed out.")
    parser.add_argument("src", type=Path, help="folder of instructor notebooks (chapters/)")
    parser.add_argument("out", type=Path, help="folder to write the student notebooks to")
    args = parser.parse_args(argv)
    for name, count in build(args.src, args.out).items():
        print(f"{name}: {count} solution block(s) stubbed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
