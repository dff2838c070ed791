"""Figures read from a model's eval card, each with the length, split and sample size it was measured at.

A comparison between two models quotes their eval cards (:func:`labsrc.models.eval_card`). Two cards need not
measure at the same lengths: each card's pass-key grid sits at fractions of *its own* trained context
(``labsrc.models.train.PASSKEY_FRACTIONS`` and ``PASSKEY_BEYOND``), and its headline probes at 90% of it. So a
figure is asked for at the lengths the comparison names, and one a card did not measure there is refused
rather than read from another length::

    from labsrc.models import card_figures as cards, eval_card
    card = eval_card("lab-target")
    key = cards.passkey(card, (768, 1024))     # pools the grid cells at those lengths, every depth
    key.label                                  # 'pass key at 768-1,024 tokens'
    key.estimate                               # k of n right, with its Wilson interval
    cards.perplexity(card).text                # '57.95 (validation split, 59 windows of 1,024 tokens)'

Cards written before the headline probes existed (``lab-mamba``'s) hold the needle, MQAR and variable-tracking
figures without their length or sample size; :func:`labsrc.models.train.evaluate` measured them then at the
trained context with ``2n`` needles and ``n`` samples of the others (``n`` = the pass-key grid's per-cell count),
and :func:`probe` reads them so.
"""
from __future__ import annotations

from dataclasses import dataclass

from labsrc import claims

PROBES = ("needle", "mqar", "variable_tracking")
_GRIDS = ("passkey", "passkey_beyond_trained_context")


@dataclass(frozen=True)
class CardFigure:
    """One accuracy from an eval card: the estimate, the lengths (tokens) it was measured at, and its name."""

    model: str
    probe: str
    estimate: claims.Estimate
    lengths: tuple[int, ...]

    @property
    def span(self) -> str:
        """'768-1,024' (or '921' for one length)."""
        lo, hi = min(self.lengths), max(self.lengths)
        return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"

    @property
    def label(self) -> str:
        """'pass key at 768-1,024 tokens': what was measured and where."""
        return f"{self.probe} at {self.span} tokens"


@dataclass(frozen=True)
class Perplexity:
    """A perplexity with what it was measured on: ``value`` over ``windows`` windows of ``tokens`` tokens of
    the ``split`` split (every position of every window scored)."""

    value: float
    tokens: int
    windows: int
    split: str = "validation"

    @property
    def text(self) -> str:
        return perplexity_text(self.value, self.tokens, self.windows, self.split)


def perplexity_text(value: float, tokens: int, windows: int, split: str = "validation",
                    scored: str | None = None) -> str:
    """The one way the book quotes a perplexity: '57.95 (validation split, 59 windows of 1,024 tokens)'.

    A perplexity depends on the window length (a longer window gives later tokens more context), the text (the
    split) and how many windows were averaged, so a figure is never quoted without them. ``scored`` says which
    tokens were scored when not every position was (e.g. 'the second half of each, through the cache')."""
    for name, v in (("tokens", tokens), ("windows", windows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    where = f"{split} split, {windows} window{'s' * (windows != 1)} of {tokens:,} tokens"
    return f"{value:.2f} ({where}{', ' + scored if scored else ''})"


def _name(card: dict) -> str:
    return card.get("name", "model")


def passkey_lengths(card: dict) -> list[int]:
    """Every context length at which the card's pass-key grids (inside and beyond the trained context) were
    measured, sorted."""
    return sorted({L for g in _GRIDS if g in card for L in card[g]["context_lens"]})


def _cell_n(card: dict, grid: str) -> int:
    g = card[grid]
    if "n" in g:
        return int(g["n"])
    # Older cards do not store the beyond-context grid's per-cell count: train.evaluate drew
    # max(4, n // 2) keys per cell there, n being the inside grid's.
    return max(4, int(card["passkey"]["n"]) // 2)


def passkey(card: dict, lengths) -> CardFigure:
    """The pass-key accuracy pooled over every depth of the card's grid cells at exactly ``lengths`` (tokens).

    Cells come from the grid inside the trained context or the one beyond it, whichever holds the length, and
    are pooled as right answers over keys (k of n, Wilson interval). A length the card did not measure raises
    ValueError naming the lengths it did.
    """
    lengths = tuple(sorted({int(L) for L in lengths}))
    if not lengths:
        raise ValueError("lengths must name at least one context length")
    have = passkey_lengths(card)
    missing = [L for L in lengths if L not in have]
    if missing:
        raise ValueError(f"lengths {missing} are not on {_name(card)}'s eval card; its pass-key grids were "
                         f"measured at {have}")
    k = n = 0
    for grid in _GRIDS:
        if grid not in card:
            continue
        g, per_cell = card[grid], _cell_n(card, grid)
        for j, L in enumerate(g["context_lens"]):
            if L in lengths:
                for row in g["accuracy"]:
                    k += round(row[j] * per_cell)
                    n += per_cell
    return CardFigure(_name(card), "pass key", claims.Estimate.accuracy(k, n), lengths)


PROBE_LABELS = {"needle": "needle (3 distractors)", "mqar": "MQAR (8 pairs)",
                "variable_tracking": "variable tracking (2 hops)"}


def probe(card: dict, task: str) -> CardFigure:
    """A headline probe of the card (``needle``, ``mqar``, ``variable_tracking``) with its length and n.

    A card with ``probes`` stores each one's length, sample size and interval (MQAR's and the passage's are
    intervals of the mean over samples, whose queries are not independent). An older card stores only the
    accuracy: it was measured at the trained context with ``2n`` needles and ``n`` samples of the others, and
    the interval is Wilson's over samples (for MQAR, the fraction of queries answered rounded to samples).
    """
    if task not in PROBES:
        raise ValueError(f"task must be one of {PROBES}, got {task!r}")
    if "probes" in card:
        r = card["probes"][task]
        est = claims.Estimate(float(r["accuracy"]), float(r["ci95"][0]), float(r["ci95"][1]), int(r["n"]),
                              r.get("interval", "wilson"))
        return CardFigure(_name(card), PROBE_LABELS[task], est, (int(r["context_len"]),))
    n = int(card["passkey"]["n"])
    acc = {"needle": card["needle_accuracy"], "mqar": card["mqar_accuracy"],
           "variable_tracking": card["variable_tracking_accuracy"]["2"]}[task]
    count = 2 * n if task == "needle" else n
    est = claims.Estimate.accuracy(round(float(acc) * count), count)
    return CardFigure(_name(card), PROBE_LABELS[task], est, (int(card["trained_context"]),))


def validation_windows(tokens: int) -> int:
    """How many non-overlapping ``tokens``-token windows the validation split holds (what an eval card's
    perplexity averages over: :func:`labsrc.tasks.perplexity_by_position` with ``n_windows=None``)."""
    from labsrc import tasks
    from labsrc.data import load_tokenizer
    return len(tasks.corpus_ids(load_tokenizer(), "validation")) // (tokens - 1)


def perplexity(card: dict, tokens: int | None = None) -> Perplexity:
    """The card's validation perplexity at ``tokens`` (default: the trained context), with its windows.

    A card measures it at its trained context and, when that is not 512, once more at 512 tokens (the length
    every shipped model can be compared at). Another length raises ValueError."""
    trained = int(card["trained_context"])
    tokens = trained if tokens is None else int(tokens)
    if tokens == trained:
        return Perplexity(float(card["validation_perplexity"]), tokens, int(card["validation_windows"]))
    if tokens == 512 and "validation_perplexity_512" in card:
        return Perplexity(float(card["validation_perplexity_512"]), 512, validation_windows(512))
    have = [trained] + ([512] if "validation_perplexity_512" in card else [])
    raise ValueError(f"{_name(card)}'s eval card has no perplexity at {tokens} tokens; it has {have}")


@dataclass(frozen=True)
class Pair:
    """One row of a two-model comparison: the same probe read from both cards. ``equal_lengths`` says whether
    both were measured at the same lengths; a row where they were not may be shown, never scored."""

    a: CardFigure
    b: CardFigure

    @property
    def equal_lengths(self) -> bool:
        return self.a.lengths == self.b.lengths

    @property
    def label(self) -> str:
        if self.equal_lengths:
            return self.a.label
        return f"{self.a.probe} ({self.a.model} at {self.a.span}, {self.b.model} at {self.b.span} tokens)"


def comparison(card_a: dict, card_b: dict) -> list[Pair]:
    """The probes two eval cards can be compared on, each read at the lengths it names.

    Pass keys: the context lengths both cards' grids hold, grouped by whether each lies inside each model's
    trained context (so a length one model was trained at and the other was not forms its own row). Then the
    headline probes (:data:`PROBES`), each at the length its card measured it; where the two lengths differ
    the pair says so (:attr:`Pair.equal_lengths`)."""
    common = sorted(set(passkey_lengths(card_a)) & set(passkey_lengths(card_b)))
    groups: dict[tuple[bool, bool], list[int]] = {}
    for L in common:
        key = (L <= card_a["trained_context"], L <= card_b["trained_context"])
        groups.setdefault(key, []).append(L)
    rows = [Pair(passkey(card_a, ls), passkey(card_b, ls)) for ls in groups.values()]
    return rows + [Pair(probe(card_a, t), probe(card_b, t)) for t in PROBES]
