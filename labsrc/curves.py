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
stopped. It never discards a stored curve silently: a file that holds another run (a header field, the methods,
the axis or the probes differ) is refused with the fields named, unless the caller says ``overwrite``; the
``command`` alone does not decide, since options that cannot change a result (``--threads``, ``--out``) are in
it. A file that is not a curve at all gets an error naming it.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from labsrc import claims
from labsrc.atomic import write_atomic

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


def _read(path: Path) -> dict:
    """A curve file's JSON, or a ``ValueError`` naming the file when it is not one (truncated, not JSON, not an
    object with a list of rows)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a stored curve ({type(err).__name__}: {err}); remove it, or rerun "
                         "with overwrite (--overwrite)") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows", []), list) \
            or not all(isinstance(r, dict) and {"method", "x", "probe"} <= r.keys() for r in data.get("rows", [])):
        raise ValueError(f"{path} is not a stored curve (no list of rows with method, x and probe); remove it, "
                         "or rerun with overwrite (--overwrite)")
    return data


def run_key(header: dict, methods, xs, probes) -> dict:
    """What decides a sweep's results, to compare with a stored file's: the header without ``command`` (it also
    holds options that change nothing, such as ``--threads``), the methods, the axis and the probes; in JSON's
    form, as the file stores them."""
    key = {k: v for k, v in header.items() if k != "command"}
    return json.loads(json.dumps({**key, "methods": list(methods), "xs": list(xs), "probes": list(probes)}))


def sweep(score: Callable[[str, object, str], Sequence[bool]], methods: Sequence[str], xs: Sequence,
          probes: Sequence[str], header: dict, out: Path | None = None, baseline=None, echo=print,
          overwrite: bool = False) -> dict:
    """Score every ``(method, x, probe)``: ``score(method, x, probe)`` returns one bool per probe sample (right
    or wrong), the same samples for every method and ``x``. One row per point, with its per-sample results and
    seconds; ``baseline(probe)``, if given, scores the reference once per probe (a row with method
    :data:`BASELINE` and ``x`` None). The file ``out`` (if given) is rewritten after each point; if it already
    holds a run with the same :func:`run_key`, its points are kept and only the missing ones are scored; if it
    holds another run, ``FileExistsError`` names what differs before anything is scored, unless ``overwrite``."""
    for name, seq in (("methods", methods), ("xs", xs), ("probes", probes)):
        if not seq:
            raise ValueError(f"{name} must not be empty")
    if BASELINE in methods:
        raise ValueError(f"{BASELINE!r} is the baseline's name; give the baseline as baseline=")
    result = {**header, "methods": list(methods), "xs": list(xs), "probes": list(probes), "rows": [],
              "complete": False}
    done = {}
    if out is not None and Path(out).exists() and not overwrite:
        old = _read(out)
        key = run_key(header, methods, xs, probes)
        differ = [k for k in key if old.get(k) != key[k]]
        if differ:
            raise FileExistsError(
                f"{out} holds a curve from another run ({', '.join(differ)} differ): it would be lost. Write this "
                "run beside it (--out another file), or replace it (overwrite, --overwrite)")
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
    """Write a curve's JSON atomically (:func:`labsrc.atomic.write_atomic`: a temporary file of its own, then a
    rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(result, indent=1) + "\n")


def load(path, partial: bool = False) -> dict:
    """A stored curve; raises if the run did not finish, unless ``partial`` (then the points scored so far,
    with :func:`missing` naming the rest: a chapter drawn from a run still under way says so)."""
    result = _read(path)
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


ALPHA = 0.05  # a pair separates when the exact McNemar test's two-sided p is below this


def mcnemar(a: Sequence[int], b: Sequence[int]) -> dict:
    """The exact McNemar test of two methods scored right (1) or wrong (0) on the same samples, in order.

    Only the samples they disagree on carry information: ``a_only`` (right under ``a`` alone) and ``b_only``.
    Under "no difference" each disagreement goes either way with probability 1/2, so ``p`` is the two-sided
    binomial tail of the smaller count (exact: no large-sample approximation, which fails on the few
    disagreements a 100-sample probe has). ``difference`` is accuracy(a) - accuracy(b) with the Agresti-Min
    95% interval for paired proportions (half a sample added to each disagreement cell)."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"a and b must score the same samples: got {len(a)} and {len(b)} results")
    n = len(a)
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    m, k = a_only + b_only, min(a_only, b_only)
    p = 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m)
    n2, ba, bb = n + 2, a_only + 0.5, b_only + 0.5
    d = (ba - bb) / n2
    se = math.sqrt(max(0.0, (ba + bb) - (ba - bb) ** 2 / n2)) / n2
    return {"n": n, "a_only": a_only, "b_only": b_only, "p": p, "difference": (a_only - b_only) / n,
            "ci95": (max(-1.0, d - claims.Z95 * se), min(1.0, d + claims.Z95 * se))}


def _row(curve: dict, method: str, x, probe: str) -> dict:
    for row in curve["rows"]:
        if _key(row) == (method, x, probe):
            return row
    raise KeyError(f"no point ({method!r}, {x!r}, {probe!r}) in this curve")


def separations(curve: dict, probe: str, methods: Iterable[str] | None = None) -> dict:
    """For each ``x``: the pairs ``(a, b)`` where ``a`` scores above ``b``, and the pairs that do not separate.

    The methods of a curve are scored on the same samples, so each pair is judged by the exact McNemar test on
    their per-sample results (:func:`mcnemar`, ``p < ALPHA``), which sees what two overlapping intervals hide:
    a method right on every sample the other gets right, and on a few more. ``tests[(a, b)]`` keeps each
    test, with the difference and its interval. Rows without per-sample results (or of different samples)
    fall back to the interval rule (:func:`labsrc.claims.compare`). An ``x`` where some method has no point
    yet (a partial curve, :func:`missing`) is left out: comparing a subset would mislead."""
    methods = list(methods or curve["methods"])
    have = {_key(r) for r in curve["rows"]}
    out = {}
    for x in curve["xs"]:
        if any((m, x, probe) not in have for m in methods):
            continue
        rows = {m: _row(curve, m, x, probe) for m in methods}
        est = {m: estimate(rows[m]) for m in methods}
        above, tied, tests = [], [], {}
        for i, a in enumerate(methods):
            for b in methods[i + 1:]:
                pa, pb = rows[a].get("per_sample"), rows[b].get("per_sample")
                if pa is not None and pb is not None and len(pa) == len(pb):
                    t = tests[(a, b)] = mcnemar(pa, pb)
                    c = 0 if t["p"] >= ALPHA else (1 if t["difference"] > 0 else -1)
                else:
                    c = claims.compare(est[a], est[b])
                if c > 0:
                    above.append((a, b))
                elif c < 0:
                    above.append((b, a))
                else:
                    tied.append((a, b))
        out[x] = {"above": above, "tied": tied, "estimates": est, "tests": tests}
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
                verdict += f" (the other {len(s['tied'])} pair(s) do not separate)"
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
