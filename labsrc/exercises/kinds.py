"""The kinds of exercise, defined once (conventions, section 8).

Every exercise declares one kind in ``tools/nbgrader_cells.py``'s ``EXERCISES`` table; the heading line students
see, the instructors page's table and the test that at least half of each chapter's points go to thinking tasks
all read the kinds from here. A kind is judged by what the student must do, not by the word in the title:

* **prediction**: forecast a measured quantity the student cannot get from a cheap measurement in the notebook;
  graded against a value that only the hidden test computes (on settings written in the hidden section).
* **derivation**: a relation that is not printed on the page, worked out and written as code.
* **debugging**: fix a bug in code the prompt hands out, whose fix is not on the page.
* **experiment**: the student chooses what to measure (a setting, a budget, a parameter); graded by re-running
  the measurement on the student's choice in the hidden test.
* **kernel**: write a Triton kernel that runs under the interpreter (a kernel that does more than copy the
  chapter's; it is not counted as a thinking task).
* **transcription**: anything else, such as coding a formula or an algorithm the chapter states.

This module imports nothing, so ``tools/`` scripts load it by path without importing torch.
"""
from __future__ import annotations

KINDS = ("prediction", "derivation", "debugging", "experiment", "kernel", "transcription")

THINKING = ("prediction", "derivation", "debugging", "experiment")
"""The kinds that make a student think rather than type what the chapter printed: at least half of a chapter's
points go to them."""

DEFINITIONS = {
    "prediction": "forecasts a measured quantity the student cannot get from a cheap measurement in the notebook, "
                  "graded against a value only the hidden test computes",
    "derivation": "a relation not printed on the page",
    "debugging": "fixes a bug whose fix is not on the page",
    "experiment": "the student chooses what to measure and is graded by re-running the measurement on that choice",
    "kernel": "writes a Triton kernel that runs under the interpreter",
    "transcription": "anything else: a formula or an algorithm the chapter states, coded",
}

LABELS = {"prediction": "Prediction", "derivation": "Derivation", "debugging": "Debugging",
          "experiment": "Experiment", "kernel": "Triton kernel", "transcription": "Implementation"}
"""How the heading line under an exercise names its kind to students."""

assert set(DEFINITIONS) == set(KINDS) == set(LABELS) and set(THINKING) < set(KINDS)


def thinking_share(rows) -> tuple[int, int]:
    """``(points on thinking kinds, all points)`` of ``rows``, pairs ``(kind, points)``."""
    rows = list(rows)
    return sum(p for k, p in rows if k in THINKING), sum(p for _, p in rows)
