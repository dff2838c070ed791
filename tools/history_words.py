"""Words from the book's own history, which a reader of the page has no use for.

A page describes the lab as it is: "the previous lab-target", "an earlier run", "the retrained model" or a
``git show`` of an old commit tell the reader about versions they never met (and invite a comparison with a
figure nobody can check on the page). The browser check (``tools/browser_check.py``) fails a chapter page
whose text holds one, and ``tests/test_history_words.py`` checks the notebooks' Markdown and visible code before
the book is built. What a chapter *measures* about training (a run without decoys, a schedule that starts with
pass keys alone) is an experiment, said as one, not history. The claims page's rule changes are history by
design and are not checked.

Standard library only (the browser check imports it).
"""
from __future__ import annotations

import re

PATTERN = re.compile(r"""\b(?:
    previous\s+(?:`?lab-[\w-]+`?|models?|runs?|versions?|checkpoints?|eval\s+cards?|cards?|curves?|sweeps?|training)
  | earlier\s+(?:training\s+)?(?:runs?|versions?|models?|checkpoints?|cards?|curves?)
  | (?:old|former)\s+(?:models?|checkpoints?|cards?|curves?|runs?|versions?)
  | retrained\s+(?:models?|target|`?lab-[\w-]+`?)
  | no\s+longer\s+(?:shipped|ships|used|trained)
  | git\s+(?:show|log|checkout|diff|blame)\b
  | used\s+to\s+be
  | until\s+this\s+(?:run|version|retrain\w*)
)""", re.I | re.X)


def find(text: str) -> list[str]:
    """Every history phrase in ``text``, with a few words of context."""
    out = []
    for m in PATTERN.finditer(text):
        a, b = max(0, m.start() - 30), min(len(text), m.end() + 30)
        out.append(" ".join(text[a:b].split()))
    return out
