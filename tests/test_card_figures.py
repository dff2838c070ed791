"""labsrc.models.card_figures: every figure a comparison quotes is read from the eval card it names, at the lengths
it names (chapter 7 once labelled lab-target's 1,536-2,048-token pass keys with lab-mamba's 768-1,024)."""
import ast
import json
import re
from pathlib import Path

import pytest

from labsrc.models import SHIPPED, eval_card
from labsrc.models import card_figures as cards

ROOT = Path(__file__).resolve().parents[1]


def recount(card, lengths):
    """Right answers and keys at exactly ``lengths``, counted straight from the card's JSON grids."""
    k = n = 0
    for grid in ("passkey", "passkey_beyond_trained_context"):
        g = card[grid]
        per_cell = g.get("n", max(4, card["passkey"]["n"] // 2))
        for j, length in enumerate(g["context_lens"]):
            if length in lengths:
                k += sum(round(row[j] * per_cell) for row in g["accuracy"])
                n += per_cell * len(g["accuracy"])
    return k, n


@pytest.mark.parametrize("name", SHIPPED)
def test_a_pass_key_figure_is_the_grid_at_the_lengths_it_names(name):
    card = eval_card(name)
    lengths = cards.passkey_lengths(card)
    assert lengths == sorted(set(card["passkey"]["context_lens"])
                             | set(card["passkey_beyond_trained_context"]["context_lens"]))
    for length in lengths:
        fig = cards.passkey(card, [length])
        k, n = recount(card, {length})
        assert (round(fig.estimate.value * fig.estimate.n), fig.estimate.n) == (k, n)
        assert fig.lengths == (length,) and f"{length:,} tokens" in fig.label


@pytest.mark.parametrize("name", SHIPPED)
def test_a_length_the_card_did_not_measure_is_refused(name):
    card = eval_card(name)
    absent = max(cards.passkey_lengths(card)) + 1
    with pytest.raises(ValueError, match="not on .* eval card"):
        cards.passkey(card, [absent])
    with pytest.raises(ValueError, match="at least one"):
        cards.passkey(card, [])
    with pytest.raises(ValueError, match="no perplexity"):
        cards.perplexity(card, 333)
    with pytest.raises(ValueError, match="task must be"):
        cards.probe(card, "passage_of_time")


@pytest.mark.parametrize("name", SHIPPED)
def test_a_headline_probe_carries_the_length_and_n_it_was_measured_at(name):
    card = eval_card(name)
    for task in cards.PROBES:
        fig = cards.probe(card, task)
        if "probes" in card:
            stored = card["probes"][task]
            assert fig.lengths == (stored["context_len"],) and fig.estimate.n == stored["n"]
            assert fig.estimate.value == stored["accuracy"]
        else:   # an older card: measured at its trained context, 2n needles and n of the others
            assert fig.lengths == (card["trained_context"],)
            assert fig.estimate.n == (2 if task == "needle" else 1) * card["passkey"]["n"]


def test_the_chapter_7_comparison_reads_each_figure_at_its_own_lengths():
    mamba, target = eval_card("lab-mamba"), eval_card("lab-target")
    pairs = cards.comparison(mamba, target)
    for pair in pairs:
        for fig, card in ((pair.a, mamba), (pair.b, target)):
            assert fig.model == card["name"]
            if fig.probe == "pass key":
                k, n = recount(card, set(fig.lengths))
                assert (round(fig.estimate.value * fig.estimate.n), fig.estimate.n) == (k, n)
            else:
                assert fig == cards.probe(card, next(t for t, lb in cards.PROBE_LABELS.items()
                                                     if lb == fig.probe))
        assert pair.equal_lengths == (pair.a.lengths == pair.b.lengths)
        if not pair.equal_lengths:   # the label names both models' lengths
            assert pair.a.span in pair.label and pair.b.span in pair.label
    # Pass keys are compared only at lengths both cards measured.
    keys = [p for p in pairs if p.a.probe == "pass key"]
    common = set(cards.passkey_lengths(mamba)) & set(cards.passkey_lengths(target))
    assert keys and all(p.equal_lengths and set(p.a.lengths) <= common for p in keys)


def test_perplexity_is_quoted_with_its_length_split_and_windows():
    card = eval_card("lab-target")
    ppl = cards.perplexity(card)
    assert ppl.tokens == card["trained_context"] and ppl.windows == card["validation_windows"]
    assert ppl.text == (f"{card['validation_perplexity']:.2f} (validation split, "
                        f"{card['validation_windows']} windows of {card['trained_context']:,} tokens)")
    assert cards.perplexity_text(3.14159, 512, 1, scored="the second half") == \
        "3.14 (validation split, 1 window of 512 tokens, the second half)"
    with pytest.raises(ValueError, match="windows"):
        cards.perplexity_text(3.0, 512, 0)


def code_strings(path):
    """Every string constant in the chapter's code cells (f-string pieces included)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        out += [node.value for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "chapters").glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_chapter_types_the_lengths_of_an_eval_card_figure(path):
    # A label such as "pass key <= 512" or "pass key 768-1024" typed in a cell names lengths nobody checked
    # against the card it is read from; cards.passkey and cards.probe label each figure with its own.
    typed = re.compile(r"pass[- ]key\b[^|\n]{0,12}?(?:(?:<=|≤)\s*\d{3,5}\b|\d{3,5}\s*[-–]\s*\d{3,5}\b"
                       r"|\d[\d,]{2,5}\s*tokens)")
    found = [s for s in code_strings(path) if typed.search(s) and "{" not in s]
    assert not found, f"{path.name} types a card figure's lengths: {found}"
