"""Claim ids that left the ledger, and why: no finding disappears without a word.

A row of the claims ledger may change its evidence, rule or verdict (with a :class:`labsrc.claims.RuleChange`),
or be merged into another row, but it never vanishes silently. Every id a chapter once recorded and records no
longer is listed here, with the date, the reason and, for a merge, the id of the row that now carries the
finding (that row names the absorbed id in its ``merged`` field, and the claims page shows it).
``tests/test_claims.py`` compares the ids recorded in the repository's history with the chapters' ids and this
list: an id recorded once, recorded no longer and not listed here fails the test.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retired:
    """One id that left the ledger: when, why, and (for a merge) the row that carries its finding now."""

    date: str
    why: str
    merged_into: str | None = None


RETIRED: dict[str, Retired] = {
    "memory-gemini-sparse-attention": Retired(
        "2026-12-02", "the same reading of Gemini 1.5's report was recorded in chapters 2 and 14",
        merged_into="gemini-15-sparse-attention-moe"),
    "spec-draft-opd-acceptance": Retired(
        "2026-12-02", "Draft-OPD's 0.71-to-0.87 acceptance claim was judged twice: chapter 10 on one prompt, "
                      "chapter 13 across seeds with on-policy against off-policy distillation; chapter 13's stays",
        merged_into="distill-draft-opd-on-policy-alpha"),
    "memory-source-formula-joint-softmax": Retired(
        "2026-12-07", "the Memorizing Transformer's joint softmax was a row in chapters 3 and 14; chapter 3's "
                      "measures the weight it gives the memory on lab-target's queries",
        merged_into="memorizing-transformer-joint-softmax"),
    "frontier-mlkv-halves-cache": Retired(
        "2026-12-08", "MLKV's halving (10.7.4) is the arithmetic of 10.3.14 stated again: one figure, counted "
                      "twice; chapter 1's row judges both sentences",
        merged_into="mlkv-two-layers-halve-cache"),
}
"""Every id that left the ledger, by id."""
