"""What a chapter's prose may say about its numbers (issue 45): a ranking is computed from the intervals, never
typed; a summary states who won instead of pointing at the prose above; a small live run beside a stored curve
says it is a demonstration; a legend does not sit on the points it explains."""
import ast
import math
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def cells(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def chapter(stem):
    return next(p for p in CHAPTERS if p.stem.startswith(stem))


# "beats plain RoPE by 0.3", "2.5x faster", "40% slower": a ranking with its size, typed into Markdown, is true
# of one run at most; the computed cells say it from the intervals (claims.compare, curves.separations).
TYPED_RANKING = re.compile(
    r"\b(?:faster|slower|above|below|better|worse|beats?|outperforms?|ahead|wins?|higher|lower)\b[^.\n]{0,20}"
    r"\bby\s+(?:about\s+)?\d|\d+(?:\.\d+)?\s*(?:x|×|%)\s+(?:faster|slower)\b", re.I)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_ranking_is_typed_into_the_prose(path):
    found = [(i, m.group(0)) for i, (kind, src) in enumerate(cells(path)) if kind == "markdown"
             for m in TYPED_RANKING.finditer(src)]
    assert not found, f"{path.name}: a typed ranking (compute it from the intervals): {found}"


DEFERRING = re.compile(r"the prose (?:under|above|below) it|names the winner|says which wins|"
                       r"the section's text, computed from it|each section prints its verdict", re.I)


def summary_section(path):
    """The cells from '## Summary' to the next level-2 heading."""
    cs = cells(path)
    start = next(i for i, (kind, src) in enumerate(cs) if kind == "markdown" and src.startswith("## Summary"))
    out = [cs[start]]
    for kind, src in cs[start + 1:]:
        if kind == "markdown" and re.match(r"## (?!#)", src):
            break
        out.append((kind, src))
    # the summary markdown may itself run on into '## Try it': keep only its part before that heading
    out[0] = ("markdown", out[0][1].split("\n## ", 1)[0])
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_summary_does_not_defer_to_the_prose_above(path):
    found = [m.group(0) for _, src in summary_section(path) for m in DEFERRING.finditer(src)]
    assert not found, f"{path.name}: the summary defers instead of saying who won: {found}"


@pytest.mark.parametrize("stem", ["04", "05", "06", "09", "14"])
def test_a_comparison_chapters_summary_computes_who_won(stem):
    # These chapters compare methods on stored or measured intervals; their summaries say the result from
    # the numbers, in a computed cell of the Summary section.
    code = [src for kind, src in summary_section(chapter(stem)) if kind == "code"]
    assert code and any("display(" in src for src in code), \
        f"chapter {stem}'s summary has no computed statement of who won"


@pytest.mark.parametrize("stem, marker", [
    ("04", "finetune(model"),          # the fine-tune of a handful of steps
    ("06", "def run_rate"),            # the live table beside the stored curve
    ("06", "ledger.measure("),         # ledger rows with one pass key each
    ("12", "ledger.measure("),         # the same
])
def test_a_small_live_run_beside_a_stored_result_says_it_is_a_demonstration(stem, marker):
    # A number the page interprets comes from a run large enough to say it, or the page labels the run a
    # demonstration from which nothing is concluded: in the cell that runs it or in the prose around it.
    cs = cells(chapter(stem))
    i = next(i for i, (_, src) in enumerate(cs) if marker in src)
    near = " ".join(src for _, src in cs[max(0, i - 2):i + 4])
    assert "demonstration" in near, f"chapter {stem}: the run at {marker!r} is not labelled a demonstration"


def test_the_distance_plot_legend_sits_outside_the_axes():
    # Chapter 2's accuracy-against-distance plot: inside the axes the legend covered the points beyond the
    # trained context, which lie along the bottom.
    src = next(src for kind, src in cells(chapter("02")) if kind == "code" and "against distance" in src)
    legends = [node for node in ast.walk(ast.parse(src))
               if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "legend"]
    assert legends, "no legend call in the distance plot's cell"
    for call in legends:
        anchor = next((kw.value for kw in call.keywords if kw.arg == "bbox_to_anchor"), None)
        assert anchor is not None, "the legend is placed inside the axes"
        x, y = (ast.literal_eval(e) for e in anchor.elts[:2])
        assert not (0 <= x <= 1 and 0 <= y <= 1), f"bbox_to_anchor {(x, y)} lies inside the axes"


def pairs_computed(keep: float, length: int, block: int) -> float:
    """The share of causal (query, key) pairs chapter 3's block-sparse attention computes: per query its own
    block up to itself, plus the best ceil(keep x visible blocks) - 1 earlier blocks (all whole)."""
    kept = 0
    for t in range(length):
        own = t // block
        budget = max(1, math.ceil(keep * (own + 1)))
        kept += t % block + 1 + (budget - 1) * block
    return kept / (length * (length + 1) / 2)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_sparse_attention_bar_is_not_decided_by_a_hair(profile):
    # Chapter 3's rule counts settings that compute at most half of the causal pairs. Keeping half of the blocks
    # computes a hair more (the diagonal block is always kept), so a setting must lie clearly inside the bar.
    from labsrc.runtime import SIZES
    s = SIZES["flash_attention"][profile]
    shares = [pairs_computed(k, s["sparse_len"], s["sparse_block"]) for k in s["sparse_keep"]]
    assert any(0.30 <= x <= 0.48 for x in shares), f"no setting clearly inside the bar: {shares}"
