"""Stored accuracy curves: methods compared across a difficulty axis, with an interval on every point.

A chapter that compares methods (eviction policies, cache bit widths, RoPE scalings, weight formats) must be able
to tell them apart, and one point at a setting where every method scores 1.0 (or 0.0) cannot. So the comparison
is a *curve*: each method scored at every value ``x`` of the axis where they differ (a KV budget from 10% to 90%,
2 to 8 bits, a context length past the trained one), ``n`` probe samples a point (``n >= 100`` where the probe is
cheap), each point an :class:`~labsrc.claims.Estimate` with its 95% Wilson interval.

Such a sweep costs CPU-hours, so it runs once, by its command, and is stored (``labsrc/data/results/``); the
chapter plots the stored curve, writes its prose from it (:func:`separations`, :func:`describe`: never typed
by hand) and re-scores a small slice live (:func:`rescore`) to show that the stored run reproduces. Every row
keeps its per-sample results, so the slice must match sample for sample.

A stored curve records what made it: ``command`` (every option spelled out), ``code_version`` (a digest of the
source of the functions that score it, :func:`source_version`), ``samples_digest`` (of the probe samples it
scored, :func:`samples_digest`), ``models`` (digests of the checkpoints' weights,
:func:`labsrc.models.stored_runs.models_stamp`) and the machine. A test recomputes the digests from the code,
the probes and the shipped checkpoint, so a stored curve cannot outlive what made it unnoticed.

:func:`sweep` writes the file after every point and, given the same header, resumes where an interrupted run
stopped.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from labsrc import claims

RESULTS = Path(__file__).resolve().parent / "data" / "results"


def source_version(*objects) -> str:
    """First 16 hex digits of a SHA-256 over the source of ``objects`` (functions, classes, modules), in order.

    An edit inside any of them changes it; an edit elsewhere in their files does not."""
    if not objects:
        raise ValueError("give at least one function, class or module")
    parts = [inspect.getsource(o) for o in objects]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def samples_digest(samples) -> str:
    """First 16 hex digits of a SHA-256 over probe samples' token ids and answer spans: what a curve was
    scored on, whatever code drew it (a refactor of the generators that draws the same samples keeps it)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([list(s.ids), [list(span) for span in s.spans]]).encode())
    return h.hexdigest()[:16]


def _key(row: dict) -> tuple:
    return (row["method"], row["x"], row["probe"])


BASELINE = "baseline"   # the method name of the reference every curve is read against (the full cache, ...)


def _score_row(score, method, x, probe, echo) -> dict:
    t0 = time.perf_counter()
    right = [bool(r) for r in score()]
    if not right:
        raise ValueError(f"scoring ({method!r}, {x!r}, {probe!r}) returned no samples")
    row = {"method": method, "x": x, "probe": probe, "k": sum(right), "n": len(right),
           "per_sample": [int(r) for r in right], "seconds": round(time.perf_counter() - t0, 2)}
    echo(f"{probe} x={x} {method}: {estimate(row)}  ({row['seconds']:.0f} s)")
    return row


def sweep(score: Callable[[str, object, str], Sequence[bool]], methods: Sequence[str], xs: Sequence,
          probes: Sequence[str], header: dict, out: Path | None = None, baseline=None, echo=print) -> dict:
    """Score every ``(method, x, probe)``: ``score(method, x, probe)`` returns one bool per probe sample (right
    or wrong), the same samples for every method and ``x``. One row per point, with its per-sample results and
    seconds; ``baseline(probe)``, if given, scores the reference once per probe (a row with method
    :data:`BASELINE` and ``x`` None). The file ``out`` (if given) is rewritten after each point; if it already
    holds a run with the same ``header``, its points are kept and only the missing ones are scored."""
    for name, seq in (("methods", methods), ("xs", xs), ("probes", probes)):
        if not seq:
            raise ValueError(f"{name} must not be empty")
    if BASELINE in methods:
        raise ValueError(f"{BASELINE!r} is the baseline's name; give the baseline as baseline=")
    result = {**header, "methods": list(methods), "xs": list(xs), "probes": list(probes), "rows": [],
              "complete": False}
    done = {}
    if out is not None and Path(out).exists():
        old = json.loads(Path(out).read_text())
        if {k: old.get(k) for k in header} == header:
            done = {_key(r): r for r in old.get("rows", [])}
            if done:
                echo(f"resuming {out}: {len(done)} points already scored")
    for probe in probes:
        todo = [(BASELINE, None)] if baseline is not None else []
        todo += [(method, x) for x in xs for method in methods]
        for method, x in todo:
            row = done.get((method, x, probe))
            if row is None:
                fn = ((lambda: baseline(probe)) if method == BASELINE
                      else (lambda: score(method, x, probe)))
                row = _score_row(fn, method, x, probe, echo)
            result["rows"].append(row)
            if out is not None:
                write(out, result)
    result["complete"] = True
    if out is not None:
        write(out, result)
    return result


def write(path: Path, result: dict) -> None:
    """Write a curve's JSON atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def load(path, partial: bool = False) -> dict:
    """A stored curve; raises if the run did not finish, unless ``partial`` (then the points scored so far,
    with :func:`missing` naming the rest: a chapter drawn from a run still under way says so)."""
    result = json.loads(Path(path).read_text())
    if not result.get("complete") and not partial:
        raise ValueError(f"{path} holds an unfinished sweep: rerun its command ({result.get('command')})")
    return result


def missing(curve: dict) -> list[tuple]:
    """The ``(method, x, probe)`` points a curve's header asks for that it does not hold (empty when complete)."""
    have = {_key(r) for r in curve["rows"]}
    return [(m, x, p) for p in curve["probes"] for x in curve["xs"] for m in curve["methods"]
            if (m, x, p) not in have]


def estimate(row: dict) -> claims.Estimate:
    """A row's accuracy with its 95% Wilson interval."""
    return claims.Estimate.accuracy(row["k"], row["n"])


def point(curve: dict, method: str, x, probe: str) -> claims.Estimate:
    """The estimate of one point of a stored curve."""
    for row in curve["rows"]:
        if _key(row) == (method, x, probe):
            return estimate(row)
    raise KeyError(f"no point ({method!r}, {x!r}, {probe!r}) in this curve")


def separations(curve: dict, probe: str, methods: Iterable[str] | None = None) -> dict:
    """For each ``x``: the pairs ``(a, b)`` where ``a``'s whole 95% interval lies above ``b``'s
    (:func:`labsrc.claims.compare`), and the pairs the intervals cannot order. An ``x`` where some method has
    no point yet (a partial curve, :func:`missing`) is left out: comparing a subset would mislead."""
    methods = list(methods or curve["methods"])
    have = {_key(r) for r in curve["rows"]}
    out = {}
    for x in curve["xs"]:
        if any((m, x, probe) not in have for m in methods):
            continue
        est = {m: point(curve, m, x, probe) for m in methods}
        above, tied = [], []
        for i, a in enumerate(methods):
            for b in methods[i + 1:]:
                c = claims.compare(est[a], est[b])
                if c > 0:
                    above.append((a, b))
                elif c < 0:
                    above.append((b, a))
                else:
                    tied.append((a, b))
        out[x] = {"above": above, "tied": tied, "estimates": est}
    return out


def describe(curve: dict, probe: str, x_label: Callable[[object], str] = str,
             methods: Iterable[str] | None = None) -> str:
    """One sentence per ``x`` saying which methods the intervals separate (best first) and which they do not,
    from the stored numbers: the chapter's prose about a curve comes from here, never typed."""
    sep = separations(curve, probe, methods)
    lines = []
    for x, s in sep.items():
        est = s["estimates"]
        order = sorted(est, key=lambda m: -est[m].value)
        scores = ", ".join(f"{m} {est[m].value:.2f} [{est[m].lo:.2f}, {est[m].hi:.2f}]" for m in order)
        if not s["above"]:
            verdict = "no two of them separate"
        else:
            wins = {}
            for a, b in s["above"]:
                wins.setdefault(a, []).append(b)
            verdict = "; ".join(f"{a} above {', '.join(bs)}" for a, bs in
                                sorted(wins.items(), key=lambda kv: -est[kv[0]].value))
            if s["tied"]:
                verdict += f" (the other {len(s['tied'])} pair(s) overlap)"
        n = {e.n for e in est.values()}
        lines.append(f"At {x_label(x)} (n = {'/'.join(map(str, sorted(n)))} each): {scores}. {verdict}.")
    return "\n".join(lines)


def leaders(curve: dict, probe: str, methods: Iterable[str] | None = None) -> dict:
    """For each ``x`` (as :func:`separations`): ``{"leaders": [...], "beaten": [...], "margin": (lo, hi)}``.

    The leaders are the methods no other method's interval lies above; ``beaten`` the methods at least one
    leader's interval lies above, and ``margin`` the smallest and largest gap in value between a leader and a
    method it lies above (None when nothing separates: then every method is a leader and ``beaten`` is empty).
    """
    out = {}
    for x, s in separations(curve, probe, methods).items():
        est = s["estimates"]
        below = {b for _, b in s["above"]}
        lead = sorted((m for m in est if m not in below), key=lambda m: -est[m].value)
        pairs = [(a, b) for a, b in s["above"] if a in lead]
        gaps = [est[a].value - est[b].value for a, b in pairs]
        out[x] = {"leaders": lead, "beaten": sorted({b for _, b in pairs}, key=lambda m: -est[m].value),
                  "margin": (min(gaps), max(gaps)) if gaps else None, "estimates": est}
    return out


def summarize(curve: dict, probe: str, x_label: Callable[[object], str] = str,
              methods: Iterable[str] | None = None, name: Callable[[str], str] = str) -> str:
    """One sentence for a chapter's summary: at each ``x``, who leads (no interval above theirs), whom they lie
    above and by how much, and where nothing separates; from the stored numbers, never typed. ``name`` turns a
    method's key into the word the chapter uses for it."""
    parts, ties = [], []
    for x, r in leaders(curve, probe, methods).items():
        est = r["estimates"]
        if r["margin"] is None:
            ties.append(x_label(x))
            continue
        lo, hi = r["margin"]
        lead = ", ".join(f"{name(m)} {est[m].value:.2f}" for m in r["leaders"])
        by = f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f} to {hi:.2f}"
        beaten = ", ".join(name(m) for m in r["beaten"])
        parts.append(f"at {x_label(x)} the top group ({lead}) lies above {beaten} by {by}")
    n = {e.n for r in leaders(curve, probe, methods).values() for e in r["estimates"].values()}
    text = "; ".join(parts)
    if ties:
        text += ("; " if text else "") + f"at {', '.join(ties)} no two intervals separate"
    return (text[:1].upper() + text[1:] + f" (n = {'/'.join(map(str, sorted(n)))} per point, 95% intervals)."
            if text else "")


def rescore(curve: dict, score_slice: Callable[[str, object, str, int], Sequence[bool]], method: str, x,
            probe: str, m: int) -> tuple[list[int], list[int]]:
    """Score the first ``m`` samples of one stored point again (``score_slice(method, x, probe, m)``) and return
    ``(stored, fresh)`` per-sample results, for the chapter's live check that the stored run reproduces."""
    for row in curve["rows"]:
        if _key(row) == (method, x, probe):
            if m > row["n"]:
                raise ValueError(f"m must be at most the point's n ({row['n']}), got {m}")
            fresh = [int(bool(r)) for r in score_slice(method, x, probe, m)]
            return row["per_sample"][:m], fresh
    raise KeyError(f"no point ({method!r}, {x!r}, {probe!r}) in this curve")
