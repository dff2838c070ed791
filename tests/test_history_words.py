"""No chapter tells the reader about the book's own history (tools/history_words.py), and no chapter's prose
gives lab-target a trained context its checkpoint does not have; the browser check applies the first rule to
the rendered pages."""
import ast
import io
import json
import re
import sys
import tokenize
from pathlib import Path

import pytest

from labsrc.models import eval_card

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import history_words  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def page_text(cell):
    """What of a cell can reach the page: Markdown, and a code cell's strings and comments, except the
    rule changes a claims row carries (history by design, shown on the claims page)."""
    src = source(cell)
    if cell["cell_type"] == "markdown":
        return [src]
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return [src]
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "RuleChange":
            skip |= {id(n) for n in ast.walk(node)}
    out = [n.value for n in ast.walk(tree)
           if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]
    out += [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT]
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_speaks_of_the_books_history(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    found = [(i, h) for i, cell in enumerate(nb["cells"]) for text in page_text(cell)
             for h in history_words.find(text)]
    assert not found, f"{path.name}: words from the book's history (cell, text): {found}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_prose_gives_lab_target_the_context_it_was_trained_at(path):
    trained = eval_card("lab-target")["trained_context"]
    said = re.compile(r"(?:lab model|lab-target`?)[^.]{0,120}?trained\s+(?:at|on)\s+(?:a\s+)?"
                      r"(\d[\d,]*)(?:-|\s+)tokens?", re.I)
    nb = json.loads(path.read_text(encoding="utf-8"))
    wrong = [(i, m.group(0)) for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "markdown"
             for m in said.finditer(source(cell)) if int(m.group(1).replace(",", "")) != trained]
    assert not wrong, f"{path.name}: lab-target is trained at {trained} tokens, the prose says: {wrong}"


def test_the_history_words_are_found_and_ordinary_words_are_not():
    for text in ("the previous `lab-target` (trained at 512 tokens)", "In an earlier training run without",
                 "git show a2db078:labsrc/models/checkpoints", "That model is no longer shipped",
                 "the stored curve of the retrained model", "a previous model's perplexity",
                 "(Until this run, the same rule was applied"):
        assert history_words.find(text), text
    for text in ("towards the previous token", "the previous step wrote", "earlier tokens in memory",
                 "an earlier occurrence of the context", "the previous chapter", "old premises"):
        assert not history_words.find(text), text
