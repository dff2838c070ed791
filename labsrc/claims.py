"""The claims ledger: figures the source text states, set beside what the lab measures.

A notebook calls :func:`record` when it has measured something the source claims; the book's "Claims
ledger" page is rendered from these records when the book is built, so no row is ever typed by hand.
Records are JSON files in :func:`claims_dir` (``_build/claims`` in the repository, or ``$LAB_CLAIMS_DIR``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

VERDICTS = ("reproduced", "reproduced in trend only", "not reproduced", "wrong in the text")
REPO_ROOT = Path(__file__).resolve().parents[1]


def claims_dir() -> Path:
    """Where claim records are written: ``$LAB_CLAIMS_DIR`` or ``<repo>/_build/claims``."""
    return Path(os.environ.get("LAB_CLAIMS_DIR", REPO_ROOT / "_build" / "claims"))


def record(claim_id: str, *, claim: str, section: str, measured: str, verdict: str, notebook: str) -> dict:
    """Record one row of the claims ledger and return it.

    ``claim_id`` is a short stable slug (``"kv-70b-128k-320gib"``); ``claim`` quotes what the source states,
    ``section`` its section number (``"10.1.1"``), ``measured`` what this run of ``notebook`` found, and
    ``verdict`` one of :data:`VERDICTS`.
    """
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", claim_id or ""):
        raise ValueError(f"claim_id must be a lowercase slug like 'kv-70b-320gib', got {claim_id!r}")
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    for name, value in (("claim", claim), ("section", section), ("measured", measured), ("notebook", notebook)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string")
    row = dict(id=claim_id, claim=claim, section=section, measured=measured, verdict=verdict, notebook=notebook)
    folder = claims_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{claim_id}.json").write_text(json.dumps(row, indent=1, ensure_ascii=False))
    print(f"claims ledger: [{verdict}] {claim_id}")
    return row


def load(folder: Path | None = None) -> list[dict]:
    """Every recorded claim, sorted by section then id."""
    folder = claims_dir() if folder is None else Path(folder)
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return sorted(rows, key=lambda r: ([int(x) if x.isdigit() else x for x in re.split(r"[.\s]", r["section"])], r["id"]))


def render_markdown(rows: list[dict]) -> str:
    """The ledger as a Markdown table (used by the book build)."""
    if not rows:
        return "*No claims have been recorded yet: execute the chapters (`make book`) to fill this table.*\n"
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")
    lines = ["| Claim in the source | Section | What the lab measured | Verdict | Measured in |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {cell(r['claim'])} | {cell(r['section'])} | {cell(r['measured'])} | **{cell(r['verdict'])}** "
                     f"| {cell(r['notebook'])} |")
    return "\n".join(lines) + "\n"
