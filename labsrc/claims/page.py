"""The claims page: the rows loaded from :func:`labsrc.claims.claims_dir` and rendered as Markdown
(``book/claims.md``). Re-exported by :mod:`labsrc.claims`."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from labsrc.claims import (BASES, OFF_SCALE_RULE, READING_NOTE, VERDICTS, VERDICTS_BY_BASIS, _test_text, _validate,
                           claims_dir)



def _section_key(section: str):
    """Sort key of a section: numbers in numeric order (``10.2`` before ``10.10``), then any other text.

    Each part is a triple ``(0, digits, number)`` or ``(1, 0, text)``, so a section that is not purely numeric
    (``"10.1.3a"``, ``"Table 10.5"``) sorts after the numbers at its place instead of comparing an int with a
    str (which raised ``TypeError`` in :func:`load`). A number is compared by its ASCII digits, never
    through ``int()``: ``str.isdigit`` is true of "²" and "١", which ``int()`` refuses or reads differently,
    and ``int()`` refuses more than 4300 digits; those too made :func:`load` raise.
    """
    key = []
    for part in re.split(r"[.\s]+", section.strip()):
        if part.isascii() and part.isdigit():
            digits = part.lstrip("0") or "0"
            key.append((0, len(digits), digits))  # a longer number is larger; equal lengths compare as text
        else:
            key.append((1, 0, part))
    return key


def load(folder: Path | None = None) -> list[dict]:
    """Every recorded claim, validated, sorted by section then id (a bad file raises naming it)."""
    folder = claims_dir() if folder is None else Path(folder)
    rows = []
    for path in sorted(folder.glob("[!.]*.json")) if folder.is_dir() else []:
        try:
            row = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON claim row ({e})") from None
        rows.append(_validate(row, str(path)))
    return sorted(rows, key=lambda r: (_section_key(r["section"]), r["id"]))


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _evidence(r: dict) -> str:
    """What stands behind a row, in a few words: basis, profile, n and interval, cited paper."""
    if r["basis"] == "arithmetic":
        return "arithmetic on the text's own figures or a closed form (no sampling error)"
    if r["basis"] == "simulated":
        out = "simulated (a model of the system, not a measurement)"
        if r.get("n") is not None:
            lo, hi = r["interval"]
            out += (f", {r['n']} seeds, range over seeds {lo:.3g} to {hi:.3g} (the simulator's randomness, not "
                    "a 95% interval)")
        else:
            out += ", deterministic"
        if r.get("text_scale"):
            out += (f". *Text's figure:* {r['text_scale']}, {r['text_metric']}. *Simulated:* "
                    f"{r.get('lab_scale') or 'the same scale'}, {r.get('lab_metric') or 'the same metric'}")
        return out
    if r["basis"] == "reading":
        return (READING_NOTE + " " + ", ".join(f"{{cite:p}}`{k}`" for k in r["cite"]))
    out = f"measured, {r['profile']} profile, n = {r['n']}"
    if r.get("interval") is not None:
        lo, hi = r["interval"]
        out += f", 95% CI {lo:.3g} to {hi:.3g}"
    if r.get("test") is not None:
        out += f", {_test_text(r['test'])}"
    if r.get("text_scale"):
        out += (f". *Text's figure:* {r['text_scale']}, {r['text_metric']}. *Lab:* "
                f"{r.get('lab_scale') or 'the same scale'}, {r.get('lab_metric') or 'the same metric'}")
    return out


def _verdict_cell(r: dict) -> str:
    """The verdict in bold, then its reason where it has one (why inconclusive, why only a trend)."""
    if r.get("reason"):
        return f"**{r['verdict']}**: {_cell(r['reason'])}"
    if r["basis"] == "reading":
        return f"**{r['verdict']}** (judged, not computed)"
    return f"**{r['verdict']}**"


def render_markdown(rows: list[dict]) -> str:
    """The ledger as Markdown: the counts by verdict, by basis and by both, then one table per chapter (used by
    the book build)."""
    if not rows:
        return "*No claims have been recorded yet: execute the chapters (`make book`) to fill this table.*\n"
    counts = Counter(r["verdict"] for r in rows)
    bases = Counter(r["basis"] for r in rows)
    out = [f"{len(rows)} claims checked.", "", "| Verdict | Claims |", "|---|---|"]
    out += [f"| {v} | {counts[v]} |" for v in VERDICTS]
    out += ["", "| Basis | Claims |", "|---|---|"]
    out += [f"| {b} | {bases[b]} |" for b in BASES]
    # The two counts crossed: which verdicts each basis reached (a basis can reach only some, VERDICTS_BY_BASIS).
    both = Counter((r["verdict"], r["basis"]) for r in rows)
    out += ["", "| Verdict by basis | " + " | ".join(BASES) + " |", "|---" * (len(BASES) + 1) + "|"]
    out += [f"| {v} | " + " | ".join(str(both[v, b]) if v in VERDICTS_BY_BASIS[b] else "" for b in BASES) + " |"
            for v in VERDICTS]
    out.append("")
    by_chapter: dict[str, list[dict]] = {}
    for r in rows:
        by_chapter.setdefault(r["notebook"], []).append(r)
    for notebook in sorted(by_chapter):
        out += [f"### {{doc}}`/chapters/{notebook}`", "",
                "| Claim in the source | § | What the lab found | Evidence and rule | Verdict |",
                "|---|---|---|---|---|"]
        for r in by_chapter[notebook]:
            where = f"{{ref}}`{_cell(r['section'])} <{r['anchor']}>`" if r.get("anchor") else _cell(r["section"])
            off_scale = r["basis"] == "measured" and (r.get("lab_scale") or r.get("lab_metric"))
            rule = r["rule"] + (" " + OFF_SCALE_RULE if off_scale else "")
            rule += "".join(f" *Rule changed {c['date']}:* it was \"{c['old_rule']}\"; {c['why']}"
                            for c in r.get("rule_changes") or ())
            if r.get("counter"):
                rule += (f" *Could have gone otherwise:* on {r['counter']['data']} the same rule gives "
                         f"{r['counter']['verdict']}.")
            if r.get("merged"):
                rule += " *Merged here:* " + ", ".join(f"`{m}`" for m in r["merged"]) + "."
            rule += f" *Row:* `{r['id']}`."
            out.append(f"| {_cell(r['claim'])} | {where} | {_cell(r['measured'])} | {_evidence(r)}. "
                       f"*Rule:* {_cell(rule)} | {_verdict_cell(r)} |")
        out.append("")
    return "\n".join(out)
