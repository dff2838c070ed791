"""The stored comparison (``python -m labsrc.memory``: too slow for the chapter's CPU profile), its file and
its summary.
"""
from __future__ import annotations

import time
from numbers import Integral

from labsrc.memory.compare import CHEAP, compare_methods, comparison_plan


# ----------------------------------------------------------------------------------------------------------
# The stored comparison (too slow for the CPU profile of the chapter: this script writes it)
# ----------------------------------------------------------------------------------------------------------
RESULTS = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "results"


def results_path(profile: str) -> "__import__('pathlib').Path":
    """Where :func:`main` stores the comparison of ``profile`` (``cpu`` or ``gpu``)."""
    return RESULTS / f"memory_comparison_{profile}.json"


def load_results(profile: str = "cpu") -> dict:
    """The stored comparison written by :func:`main` for ``profile``."""
    import json

    path = results_path(profile)
    if not path.is_file():
        raise FileNotFoundError(f"no stored comparison at {path}; run `python -m labsrc.memory --profile {profile}`")
    return json.loads(path.read_text())


def summarize(rows: list[dict]) -> dict:
    """Per ``(length, label)``: ``k`` right of ``n``, mean seconds per token, KV tokens held and read (means)
    and, for RAG, how often the fact was in the retrieved chunks (``fact_k``)."""
    out: dict = {}
    for r in rows:
        cell = out.setdefault((r["length"], r["label"]), dict(k=0, n=0, sec=0.0, held=0.0, read=0.0, fact_k=0))
        cell["k"] += int(r["right"])
        cell["n"] += 1
        cell["sec"] += r["seconds"] / r["tokens"]
        cell["held"] += r["kv_tokens_held"]
        cell["read"] += r["kv_tokens_read"]
        cell["fact_k"] += int(r.get("fact_retrieved", False))
    for cell in out.values():
        for key in ("sec", "held", "read"):
            cell[key] /= cell["n"]
    return out


def main(argv=None) -> None:
    """``python -m labsrc.memory [--profile cpu|gpu] [--fresh]``: run :func:`compare_methods` at the profile's
    sizes (``labsrc.sizes("memory")``: ``compare_lengths``, ``compare_n`` (one per length),
    ``compare_n_cheap``, ``top_ks``, ``window``, ``chunk``) and write every row, with the run's stamp and the
    digest of the lab-target it used, to ``labsrc/data/results/memory_comparison_<profile>.json``.

    The file is rewritten after every (length, method) cell, so an interrupted run loses one cell at most:
    run the command again and it resumes, keeping the cells already stored when the file's settings and
    model digest are the ones it would use (``--fresh`` starts over).

    Why these sizes on the CPU (1,024-8,192 tokens; 20, 20, 10 and 10 documents per method, 100 for
    truncation and BM25 RAG): the run has to fit well under an hour on two cores shared with other jobs (the
    stored run took the time its ``seconds`` field records). Truncation and BM25 RAG read one trained window
    whatever the length (about half a second a document), so they get n = 100 everywhere. Every other method
    reads the whole document, and at 8,192 tokens one document costs seconds to a minute on a busy machine
    (retrieval searches every past key for every query, in every layer; eviction scores its cache at every
    chunk; full attention and YaRN are one long forward pass), so n falls with length there; the chapter's
    intervals show what that costs. One ``k`` (32) stands for retrieval; the GPU profile compares several."""
    import argparse
    import json
    import sys

    import labsrc
    from labsrc.models import load
    from labsrc.models.stored_runs import models_stamp

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--profile", default=labsrc.PROFILE, choices=("cpu", "gpu"))
    parser.add_argument("--fresh", action="store_true", help="ignore a stored partial run and start over")
    args = parser.parse_args(argv)
    S = labsrc.sizes("memory", args.profile)
    labsrc.seed_everything(0)
    model, tok = load("lab-target", device=labsrc.DEVICE)
    lengths = list(S.compare_lengths)
    ns = list(S.compare_n) if not isinstance(S.compare_n, Integral) else [S.compare_n] * len(lengths)
    settings = dict(profile=args.profile, lengths=lengths, n=ns, n_cheap=S.compare_n_cheap, cheap=list(CHEAP),
                    window=S.window, chunk=S.chunk, top_ks=list(S.top_ks), probe="passkey",
                    models=models_stamp("lab-target"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = labsrc.stamp(file=sys.stderr)
    path = results_path(args.profile)
    rows: list[dict] = []
    before = 0.0
    if path.is_file() and not args.fresh:
        old = json.loads(path.read_text())
        if {k: old.get(k) for k in settings} == settings and not old.get("complete"):
            rows, before = old["rows"], float(old["seconds"])
            print(f"resuming: {len(rows)} rows stored ({before:.0f} s)", file=sys.stderr)
    done = {(r["length"], r["label"]) for r in rows}
    t0 = time.perf_counter()
    cells = len(lengths) * len(comparison_plan(S.top_ks))

    def save(length, label, cell):
        rows.extend(cell)
        finished = len({(r["length"], r["label"]) for r in rows}) == cells
        out = dict(stamp=info, **settings, seconds=before + time.perf_counter() - t0, complete=finished,
                   command=f"python -m labsrc.memory --profile {args.profile}", rows=rows)
        path.write_text(json.dumps(out, indent=1))
        print(f"{before + time.perf_counter() - t0:7.1f}s  L={length} {label}: "
              f"{sum(r['right'] for r in cell)}/{len(cell)}", file=sys.stderr, flush=True)

    compare_methods(model, tok, lengths, ns, n_cheap=S.compare_n_cheap, top_ks=S.top_ks, window=S.window,
                    chunk=S.chunk, skip=done, progress=save)
