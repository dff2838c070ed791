"""The claims ledger: figures the source text states, set beside what the lab measures.

A notebook calls :func:`record` when it has checked something the source claims; the book's "Claims ledger"
page is rendered from these records when the book is built, so no row is ever typed by hand. Records are JSON
files in :func:`claims_dir` (``_build/claims`` in the repository, or ``$LAB_CLAIMS_DIR``).

Every row says how it knows what it says (its *basis*) and by which rule its verdict was decided:

* ``"measured"``: a sampled measurement on the lab's models. The row carries the runtime profile, the sample
  size ``n`` and a 95% interval (Wilson's for an accuracy, :func:`wilson`), and its verdict treats a
  difference whose intervals overlap as *inconclusive* (:func:`compare`, :func:`judge`). A row decided by a
  hypothesis test (a chi-square goodness of fit) carries the test as a :class:`HypothesisTest` instead: a
  p-value is not an interval and is never stored as one.
* ``"simulated"``: the output of a simulator (a seeded model of a pipeline's timing, an EMA iterated on
  expected values). A simulation shows what follows from its premises; it measures nothing, and the spread of
  its output over simulator seeds is the simulator's own randomness, not the uncertainty of a measurement. So
  a simulated row gives its spread as the *range over seeds* (:meth:`Estimate.spread`: the mean, the smallest
  and the largest seed's value, ``n`` = the number of seeds), the page prints it as that range, never as a
  95% interval, and two simulated figures are told apart only where their ranges do not overlap (every seed
  agrees). A deterministic simulation gives no ``n`` and no range.
* ``"arithmetic"``: arithmetic or a closed form computed from the text's own figures (bytes of a cache, a
  formula's sign, an identity checked on random matrices to rounding error). There is no sampling error, so
  no sample size or interval.
* ``"reading"``: the text read against itself or against the paper it cites (``cite`` names the paper's key
  in ``book/references.bib``); this is how a row reaches *misattributed*.

Only a measured effect is *reproduced*. A measurement can fail, so its success is evidence; arithmetic on the
text's own numbers, a simulation of the text's own premises, or a reading of the cited paper can only show
that the text's figure follows from (or agrees with) what it rests on. Those rows say *consistent* when it
does, and *wrong in the text* (arithmetic, reading) or *misattributed* (reading) when it does not; a simulation
that misses the text's figure is *inconclusive*, because a model of the system cannot refute a figure stated
for hardware. :func:`check` gives the verdict of an arithmetic or simulated row, and :func:`record` refuses
"reproduced", "reproduced in trend only" and "not reproduced" on any row that is not measured
(:data:`VERDICTS_BY_BASIS`).

The verdict rule (``rule``) is stated in words with the row, and it is the rule the notebook's code applied:
a verdict is computed by the notebook's code, never typed (only a reading row's verdict is a judgement, typed
with its citation). When a row's rule changes between runs (a new metric, a new threshold), the row keeps the
old rule and the reason in ``rule_changes`` (:class:`RuleChange`), and the page shows them: a verdict whose
rule moved without a word would look decided in advance.

A rule that no data could contradict decides nothing. So a measured or arithmetic row states its rule as a
:class:`Rule`: the words, a function from the row's data to its verdict (through :func:`judge` or :func:`check`),
and a synthetic counter-example, data on which the same function reaches another verdict. :func:`record`
evaluates the rule on the counter-example and refuses the row when it gives the row's own verdict, and the page
shows what the counter-example would have given: the row could have come out otherwise.

A row is never deleted without a word: an id that leaves the ledger (merged into another row, or retired)
is listed in :mod:`labsrc.claims_retired` with its reason, and a row that absorbed another names it in
``merged``.

A measured row also declares its :class:`Scope`: the scale and metric the text's figure is about (a 70B model
on A100s, end-to-end throughput) and, where the lab measured something else, the lab's scale and metric (the
9M-parameter lab model on a CPU, perplexity for a benchmark score). :func:`judge` reads the verdict symmetrically
from it: at another scale or metric a success is only *reproduced in trend only* and a failure is only
*inconclusive*, with the difference stated as the row's ``reason``. Only a measurement at the text's own scale
and metric can give a plain *reproduced* or *not reproduced*; :func:`record` refuses a row that breaks this.
"""
from __future__ import annotations

import datetime
import json
import math
import numbers
import operator
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from statistics import NormalDist

from labsrc.atomic import file_lock, write_atomic

VERDICTS = ("reproduced", "reproduced in trend only", "not reproduced", "consistent", "inconclusive",
            "wrong in the text", "misattributed")
"""Every verdict a row may carry (their meanings are on the book's claims page)."""

BASES = ("measured", "simulated", "arithmetic", "reading")
"""How a row knows what it says: a sampled measurement, a simulator's output, arithmetic on the text's own
figures, or a reading of the text/paper."""

VERDICTS_BY_BASIS = {
    "measured": ("reproduced", "reproduced in trend only", "not reproduced", "inconclusive"),
    "simulated": ("consistent", "inconclusive"),
    "arithmetic": ("consistent", "wrong in the text", "inconclusive"),
    "reading": ("consistent", "wrong in the text", "misattributed", "inconclusive"),
}
"""The verdicts each basis may reach: "reproduced" (and its scoped and failed forms) only for a measured effect."""

READING_NOTE = "a judgement, not a computation (the verdict is a reader's, typed with its citation): reading of"
"""How the page introduces a reading row's evidence: its verdict is a judgement that its citation supports."""

OFF_SCALE_RULE = ("Measured off the text's scale or metric: a success is reproduced in trend only, a failure "
                  "inconclusive.")
"""The symmetric rule, added to the stated rule of every row measured off the text's scale or metric."""

SEED_RANGE = "range over seeds"
"""The ``method`` of an :class:`Estimate` built by :meth:`Estimate.spread`: a simulator's range, not a CI."""

Z95 = NormalDist().inv_cdf(0.975)  # 1.95996...: the two-sided 95% normal quantile
REPO_ROOT = Path(__file__).resolve().parents[2]  # labsrc/claims/__init__.py
_REQUIRED = ("id", "claim", "section", "measured", "verdict", "notebook", "rule", "basis", "profile")
_SCOPE_FIELDS = ("text_scale", "text_metric", "lab_scale", "lab_metric")


def claims_dir() -> Path:
    """Where claim records are written: ``$LAB_CLAIMS_DIR`` or ``<repo>/_build/claims``."""
    return Path(os.environ.get("LAB_CLAIMS_DIR", REPO_ROOT / "_build" / "claims"))


# ------------------------------------------------------------------------------------------------------------
# Sampling error: intervals and the comparison rule every measured verdict uses.
# ------------------------------------------------------------------------------------------------------------
def _count(name: str, value) -> int:
    """An integer count (numpy integers too, not bools or floats)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _number(name: str, value) -> float:
    """A real number as a Python float (numpy scalars too, not bools): what the ledger stores."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for ``k`` successes in ``n`` trials (95% by default).

    Unlike the textbook ``p +- z sqrt(p(1-p)/n)`` it never leaves [0, 1] and does not collapse to a point at
    ``k = 0`` or ``k = n``: 20 right answers out of 20 give [0.84, 1.00], not "exactly 1".
    """
    k, n = _count("k", k), _count("n", n)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"k must lie in [0, n={n}], got {k}")
    if not (isinstance(z, (int, float)) and math.isfinite(z) and z > 0):
        raise ValueError(f"z must be a finite positive number, got {z!r}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At k = 0 (or n) the exact bound is 0 (or 1); rounding can leave 1e-17 instead.
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond 30 the normal quantile is used.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


@dataclass(frozen=True)
class Estimate:
    """A number with its 95% interval and the sample size behind it.

    Build one with :meth:`accuracy` (k of n right: Wilson interval), :meth:`mean` (a sample of numbers:
    Student-t interval), :meth:`spread` (a simulator's output over its seeds: the range, not an interval) or
    :meth:`exact` (no sampling error: the interval is the point and ``n`` is None).
    """

    value: float
    lo: float
    hi: float
    n: int | None
    method: str

    def __post_init__(self):
        # numpy scalars are numbers too (a count from .sum() is a numpy integer): stored as Python's own
        for name in ("value", "lo", "hi"):
            v = _number(f"Estimate.{name}", getattr(self, name))
            if math.isnan(v):
                raise ValueError(f"Estimate.{name} must be a number (not NaN), got {v!r}")
            object.__setattr__(self, name, v)
        if not self.lo <= self.value <= self.hi:
            raise ValueError(f"Estimate needs lo <= value <= hi, got {self.lo} <= {self.value} <= {self.hi}")
        if self.n is not None:
            try:
                object.__setattr__(self, "n", _count("Estimate.n", self.n))
            except TypeError:
                raise ValueError(f"Estimate.n must be a positive int or None, got {self.n!r}") from None
            if self.n < 1:
                raise ValueError(f"Estimate.n must be a positive int or None, got {self.n!r}")

    @classmethod
    def accuracy(cls, k: int, n: int) -> "Estimate":
        """``k`` right out of ``n``: the fraction with its Wilson interval."""
        lo, hi = wilson(k, n)
        k, n = _count("k", k), _count("n", n)
        return cls(k / n, lo, hi, n, "Wilson")

    @classmethod
    def mean(cls, samples) -> "Estimate":
        """The mean of ``samples`` (at least two finite numbers) with a Student-t 95% interval."""
        xs = [float(x) for x in samples]
        if len(xs) < 2:
            raise ValueError(f"samples must hold at least two numbers for an interval, got {len(xs)}")
        if not all(math.isfinite(x) for x in xs):
            raise ValueError("samples must be finite numbers")
        n = len(xs)
        m = sum(xs) / n
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
        t = _T95[n - 2] if n - 1 <= len(_T95) else Z95
        half = t * sd / math.sqrt(n)
        return cls(m, m - half, m + half, n, "Student t")

    @classmethod
    def spread(cls, samples) -> "Estimate":
        """A simulator's output over its seeds: the mean, with the smallest and largest seed's value as ``lo``
        and ``hi`` (``n`` = the number of seeds, ``method`` = :data:`SEED_RANGE`).

        The seeds of a simulation are not samples of the world: their spread is the simulator's own randomness,
        and a Student-t interval over them would read as the uncertainty of a measurement. The range says what
        the seeds did, and two simulated figures whose ranges do not overlap differ on every seed.
        """
        xs = [float(x) for x in samples]
        if len(xs) < 2:
            raise ValueError(f"samples must hold at least two seeds' values for a range, got {len(xs)}")
        if not all(math.isfinite(x) for x in xs):
            raise ValueError("samples must be finite numbers")
        return cls(sum(xs) / len(xs), min(xs), max(xs), len(xs), SEED_RANGE)

    @classmethod
    def exact(cls, value: float) -> "Estimate":
        """A computed number with no sampling error."""
        return cls(float(value), float(value), float(value), None, "exact")

    def __str__(self) -> str:
        if self.n is None:
            return f"{self.value:.4g} (exact)"
        if self.method == SEED_RANGE:
            return f"{self.value:.3g} (range over {self.n} seeds {self.lo:.3g} to {self.hi:.3g})"
        return f"{self.value:.3g} (95% CI {self.lo:.3g} to {self.hi:.3g}, n = {self.n})"


def compare(a: Estimate, b: Estimate) -> int:
    """+1 if ``a`` is above ``b``, -1 if below, 0 if their 95% intervals overlap (the data cannot tell).

    Non-overlapping 95% intervals is a conservative rule (a difference it calls real is real at well below
    the 5% level); that is the side to err on when a verdict rests on it.
    """
    if not isinstance(a, Estimate) or not isinstance(b, Estimate):
        raise TypeError(f"compare takes two Estimates, got {type(a).__name__} and {type(b).__name__}")
    if a.lo > b.hi:
        return 1
    if a.hi < b.lo:
        return -1
    return 0


@dataclass(frozen=True)
class Scope:
    """The scale and metric a claim's figure is about, and those the lab measured it at.

    ``text_scale`` and ``text_metric`` say what the source's figure is about ("Llama-2 13B and 70B on A100
    GPUs", "end-to-end throughput"). ``lab_scale`` and ``lab_metric`` say what this run measured instead, and
    stay ``None`` where the lab measured at the text's own scale or with its own metric (a property of a
    formula holds at any size; a random-matrix check of an identity is the identity).

    A measurement off the text's scale or metric can show a direction, never the text's number: its success
    is "reproduced in trend only" and its failure "inconclusive" (:func:`judge`).
    """

    text_scale: str
    text_metric: str
    lab_scale: str | None = None
    lab_metric: str | None = None

    def __post_init__(self):
        for name in ("text_scale", "text_metric"):
            _text(f"Scope.{name}", getattr(self, name))
        for name in ("lab_scale", "lab_metric"):
            value = getattr(self, name)
            if value is not None:
                _text(f"Scope.{name} (None when the lab measured the text's own)", value)

    @property
    def at_text_scale(self) -> bool:
        """True when the lab measured at the text's scale and with the text's metric."""
        return self.lab_scale is None and self.lab_metric is None

    def difference(self) -> str:
        """What separates the lab's measurement from the text's figure, in words ("" when nothing does)."""
        parts = []
        if self.lab_scale is not None:
            parts.append(f"measured on {self.lab_scale}, while the text's figure is about {self.text_scale}")
        if self.lab_metric is not None:
            parts.append(f"measured as {self.lab_metric}, while the text's figure is {self.text_metric}")
        return "; ".join(parts)

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in _SCOPE_FIELDS}


@dataclass(frozen=True)
class HypothesisTest:
    """The outcome of a hypothesis test that decides a measured row: its name, statistic and p-value.

    A p-value is the probability, under the test's null hypothesis, of a statistic at least as extreme as the
    one observed; it is not an estimate of anything and has no interval. A row decided by a test (a
    chi-square goodness of fit) records it here, so the page prints "chi-square = 9.3, dof = 15, p = 0.86"
    instead of a zero-width "interval" [0.86, 0.86].
    """

    name: str
    statistic: float
    p_value: float
    dof: int | None = None

    def __post_init__(self):
        _text("HypothesisTest.name", self.name)
        for field in ("statistic", "p_value"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"HypothesisTest.{field} must be a finite number, got {v!r}")
            object.__setattr__(self, field, float(v))
        if isinstance(self.dof, numbers.Integral) and not isinstance(self.dof, bool):
            object.__setattr__(self, "dof", int(self.dof))
        if not 0.0 <= self.p_value <= 1.0:
            raise ValueError(f"HypothesisTest.p_value must lie in [0, 1], got {self.p_value!r}")
        if self.dof is not None and (isinstance(self.dof, bool) or not isinstance(self.dof, int)
                                     or self.dof < 1):
            raise ValueError(f"HypothesisTest.dof must be a positive int or None, got {self.dof!r}")

    def fields(self) -> dict:
        return {"name": self.name, "statistic": float(self.statistic), "p_value": float(self.p_value),
                "dof": self.dof}


def _test_text(test: dict) -> str:
    """A stored test as the page prints it: ``chi-square = 9.3, dof = 15, p = 0.86``."""
    dof = f", dof = {test['dof']}" if test.get("dof") is not None else ""
    return f"{test['name']} = {test['statistic']:.4g}{dof}, p = {test['p_value']:.3g}"


@dataclass(frozen=True)
class RuleChange:
    """One change of a row's verdict rule between runs: when, what the rule was before, and why it changed.

    ``date`` is an ISO date (``"2026-12-01"``); ``old_rule`` is the rule as the row stated it before the
    change; ``why`` says what was wrong with it. A row lists its changes oldest first in ``rule_changes``.
    """

    date: str
    old_rule: str
    why: str

    def __post_init__(self):
        if not isinstance(self.date, str) or not re.fullmatch(r"\d{4}-\d\d-\d\d", self.date):
            raise ValueError(f"RuleChange.date must be an ISO date like '2026-12-01', got {self.date!r}")
        try:  # the pattern alone took 2026-02-30 and 2026-13-01
            datetime.date.fromisoformat(self.date)
        except ValueError:
            raise ValueError(f"RuleChange.date must be a date that exists, got {self.date!r}") from None
        _text("RuleChange.old_rule", self.old_rule)
        _text("RuleChange.why", self.why)

    def fields(self) -> dict:
        return {"date": self.date, "old_rule": self.old_rule, "why": self.why}


class Verdict(str):
    """A verdict (one of :data:`VERDICTS`, usable as a plain string) with the reason :func:`judge` gave it.

    :func:`record` stores the reason with the row, so an "inconclusive" or "trend only" row says why.
    """

    reason: str | None

    def __new__(cls, verdict: str, reason: str | None = None):
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
        self = super().__new__(cls, verdict)
        self.reason = reason
        return self


def judge(holds: bool, *, scope: Scope, separable: bool = True) -> Verdict:
    """The verdict of a measured claim from what the measurement found, read symmetrically against its scope.

    Args:
        holds: the claim held in this measurement (by the rule stated before it ran).
        scope: the :class:`Scope` of the claim: the text's scale and metric and, where they differ, the lab's.
        separable: False when the data cannot tell the cases apart (overlapping intervals, a probe every
            method fails); the verdict is then "inconclusive" whatever ``holds`` says.

    At the text's own scale and metric a claim that holds is "reproduced" and one that fails is "not
    reproduced". Off them the rule is symmetric: a success is "reproduced in trend only" (the direction holds;
    the text's number is untested) and a failure is "inconclusive", because a 9M-parameter model on a CPU
    failing to show an effect says nothing about the 70B model on GPUs that the text's figure is about. The
    returned :class:`Verdict` carries the reason, which :func:`record` stores with the row.
    """
    if not isinstance(scope, Scope):
        raise TypeError(f"scope must be a labsrc.claims.Scope, got {type(scope).__name__}")
    if not separable:
        return Verdict("inconclusive", "the measurement cannot separate the cases the claim compares "
                                       "(see the rule)")
    if scope.at_text_scale:
        return Verdict("reproduced" if holds else "not reproduced")
    if holds:
        return Verdict("reproduced in trend only", "the direction holds; " + scope.difference())
    return Verdict("inconclusive", "the claim failed off the text's scale or metric, which cannot refute it: "
                                   + scope.difference())


SIMULATION_MISS = ("the simulation does not show the text's figure; a model of the system cannot refute a "
                   "figure stated for hardware, only say which premises would give it")
"""The reason :func:`check` gives a simulated row whose simulation misses the text's figure."""


def check(holds: bool, *, basis: str, separable: bool = True) -> Verdict:
    """The verdict of an arithmetic or simulated row: "consistent" when the text's figure follows.

    Args:
        holds: the text's figure follows from its own numbers (``basis="arithmetic"``) or from the simulation
            of the premises the row names (``basis="simulated"``), by the rule stated with the row.
        basis: ``"arithmetic"`` or ``"simulated"``.
        separable: False when the computation cannot decide (the text leaves out a number the figure needs;
            the simulated cases' ranges over seeds overlap); the verdict is then "inconclusive".

    Arithmetic cannot be reproduced or fail to be: the figure follows from the text's numbers ("consistent")
    or contradicts them ("wrong in the text"). A simulation shows what its premises imply: a figure it gives
    is "consistent" with them, and one it misses is "inconclusive", never a refutation (a simulator is not the
    hardware the text's figure was measured on). Only :func:`judge`, for a measured row, says "reproduced".
    """
    if basis not in ("arithmetic", "simulated"):
        raise ValueError(f"check decides arithmetic and simulated rows (a measured row goes through judge), got "
                         f"basis {basis!r}")
    if not separable:
        return Verdict("inconclusive", "the arithmetic cannot decide the claim (see the rule)"
                       if basis == "arithmetic" else
                       "the simulated cases' ranges over seeds overlap: the simulation cannot separate them")
    if holds:
        return Verdict("consistent")
    if basis == "arithmetic":
        return Verdict("wrong in the text")
    return Verdict("inconclusive", SIMULATION_MISS)


# Rules that could fail (Rule and its two common shapes) live in labsrc/claims/rules.py; imported here,
# after judge and check, which they decide through.
from labsrc.claims.rules import Rule, _describe, above_rule, within_rule  # noqa: E402


# ------------------------------------------------------------------------------------------------------------
# Rows: write, read back, render.
# ------------------------------------------------------------------------------------------------------------
class Row(dict):
    """A recorded claim row: a plain ``dict`` of its fields that a notebook displays as one sentence.

    A cell that ends with ``claims.record(...)`` would otherwise echo the whole dict onto the page.
    """

    def _repr_markdown_(self) -> str:
        return sentence(self)


_SENTENCES = {
    "reproduced": "the lab's measurement reproduces the text's figure",
    "reproduced in trend only": ("the lab's measurement shows the direction the text states, at another scale or "
                                 "with another metric, so the size of the text's figure is not checked"),
    "not reproduced": "the lab's measurement, at the text's own scale and metric, does not show the text's figure",
    "inconclusive": "the lab's evidence cannot decide the text's claim",
    "misattributed": "the text's account does not match the paper it cites",
}
_BY_BASIS = {
    ("consistent", "arithmetic"): "the text's figure follows from its own numbers",
    ("consistent", "simulated"): "a simulation of the text's premises gives its figure",
    ("consistent", "reading"): "the text agrees with what it cites",
    ("wrong in the text", "arithmetic"): "the text's figure contradicts its own numbers",
    ("wrong in the text", "reading"): "the text contradicts itself or what it cites",
}


def sentence(row: dict) -> str:
    """A row's verdict as a sentence for the chapter page: the section and what the verdict means, with no row id
    (ids, rules and evidence stay on the claims page)."""
    said = _BY_BASIS.get((row["verdict"], row["basis"])) or _SENTENCES.get(row["verdict"], row["verdict"])
    return f"Claims ledger, section {row['section']}: {said} (**{row['verdict']}**; see the claims ledger page)."


def _text(name: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _validate(row: dict, where: str) -> dict:
    """Check one row's fields; ``where`` names the file (and line) in the message."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a claim row must be a JSON object, got {type(row).__name__}")
    missing = [f for f in _REQUIRED if f not in row]
    if missing:
        raise ValueError(f"{where}: claim row is missing fields {missing}")
    if not isinstance(row["id"], str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", row["id"]):
        raise ValueError(f"{where}: id must be a lowercase slug like 'kv-70b-320gib', got {row['id']!r}")
    if row["verdict"] not in VERDICTS:
        raise ValueError(f"{where}: verdict must be one of {VERDICTS}, got {row['verdict']!r}")
    if row["basis"] not in BASES:
        raise ValueError(f"{where}: basis must be one of {BASES}, got {row['basis']!r}")
    for name in ("claim", "section", "measured", "notebook", "rule", "profile"):
        try:
            _text(name, row[name])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not re.fullmatch(r"\d\d_[a-z0-9_]+", row["notebook"]):
        raise ValueError(f"{where}: notebook must be the chapter's stem like '01_kv_cache' (the page links "
                         f"/chapters/<stem>), got {row['notebook']!r}")
    if row.get("test") is not None:
        test = row["test"]
        try:
            if not isinstance(test, dict):
                raise TypeError(f"not an object: {test!r}")
            HypothesisTest(**test)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: test must be a HypothesisTest's fields (name, statistic, p_value, "
                             f"dof): {e}") from None
        if row["basis"] != "measured":
            raise ValueError(f"{where}: a hypothesis test decides a measured row only; an {row['basis']} row "
                             "has no sampling error to test")
    if row["basis"] == "measured":
        n, interval = row.get("n"), row.get("interval")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}: a measured row needs n, a positive int sample size, got {n!r}")
        if interval is None and row.get("test") is not None:
            pass  # decided by a hypothesis test: its p-value is the evidence, not an interval
        elif (not isinstance(interval, (list, tuple)) or len(interval) != 2
                or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in interval)
                or interval[0] > interval[1]):
            raise ValueError(f"{where}: a measured row needs interval, a finite [lo, hi] 95% interval (or, "
                             f"for a hypothesis test, test=HypothesisTest(...)), got {interval!r}")
    changes = row.get("rule_changes")
    if changes is not None:
        if not isinstance(changes, list) or not changes:
            raise ValueError(f"{where}: rule_changes must be a non-empty list of RuleChange fields or None, "
                             f"got {changes!r}")
        for change in changes:
            try:
                if not isinstance(change, dict):
                    raise TypeError(f"not an object: {change!r}")
                RuleChange(**change)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: rule_changes holds a bad entry ({e})") from None
        dates = [c["date"] for c in changes]
        if dates != sorted(dates):
            raise ValueError(f"{where}: rule_changes must be listed oldest first, got dates {dates}")
    for name in _SCOPE_FIELDS + ("reason",):
        value = row.get(name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{where}: {name} must be a non-empty string or None, got {value!r}")
    if row["basis"] == "measured" and not (row.get("text_scale") and row.get("text_metric")):
        raise ValueError(f"{where}: a measured row needs its scope: the scale and metric the text's figure is "
                         "about (scope=claims.Scope(text_scale=..., text_metric=...))")
    off_scale = bool(row.get("lab_scale") or row.get("lab_metric"))
    if off_scale and row["verdict"] == "not reproduced":
        raise ValueError(f"{where}: a failure measured at another scale or metric than the text's cannot refute "
                         "it: the verdict is 'inconclusive' (claims.judge gives it)")
    if off_scale and row["verdict"] == "reproduced" and row["basis"] == "measured":
        raise ValueError(f"{where}: a success measured at another scale or metric than the text's is "
                         "'reproduced in trend only' (claims.judge gives it)")
    if row["basis"] == "measured" and row["verdict"] == "reproduced in trend only" and not off_scale:
        raise ValueError(f"{where}: 'reproduced in trend only' says the lab measured at another scale or "
                         "metric: give it as lab_scale or lab_metric in the row's Scope")
    if row["basis"] == "simulated":
        n, interval = row.get("n"), row.get("interval")
        if (n is None) != (interval is None):
            raise ValueError(f"{where}: a simulated row gives both n (the number of seeds) and interval (the "
                             f"range over seeds, claims.Estimate.spread) or neither (a deterministic "
                             f"simulation), got n={n!r}, interval={interval!r}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise ValueError(f"{where}: a simulated row's n is its number of seeds, at least 2, got {n!r}")
    if row["basis"] in ("arithmetic", "reading") and (row.get("n") is not None or row.get("interval")
                                                        is not None):
        raise ValueError(f"{where}: an {row['basis']} row has no sampling error: no n and no interval")
    if row["verdict"] == "inconclusive" and off_scale and not row.get("reason"):
        raise ValueError(f"{where}: an inconclusive row measured off the text's scale or metric must say so in "
                         "its reason (claims.judge gives it)")
    counter = row.get("counter")
    if counter is not None:
        if (not isinstance(counter, dict) or set(counter) != {"data", "verdict"}
                or not isinstance(counter["data"], str) or counter["verdict"] not in VERDICTS):
            raise ValueError(f"{where}: counter must hold the counter-example's data (in words) and its verdict, "
                             f"got {counter!r}")
        if counter["verdict"] == row["verdict"]:
            raise ValueError(f"{where}: the rule reaches {row['verdict']!r} on its counter-example too: a rule "
                             "that no data could move decides nothing (give a counter-example on which it says "
                             "something else, or make the rule able to fail)")
    merged = row.get("merged")
    if merged is not None and (not isinstance(merged, list) or not merged or not all(
            isinstance(m, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]*", m) and m != row["id"] for m in merged)):
        raise ValueError(f"{where}: merged must be a non-empty list of other rows' ids, got {merged!r}")
    if row["basis"] == "reading" and not row.get("cite"):
        raise ValueError(f"{where}: a reading row must cite the paper it reads (cite=<bibtex key>)")
    if row["verdict"] == "misattributed" and row["basis"] != "reading":
        raise ValueError(f"{where}: 'misattributed' is a reading of the cited paper: basis must be 'reading'")
    if row["verdict"] not in VERDICTS_BY_BASIS[row["basis"]]:
        raise ValueError(f"{where}: a {row['basis']} row's verdict is one of {VERDICTS_BY_BASIS[row['basis']]}, "
                         f"got {row['verdict']!r}: only a measured effect is 'reproduced' (or not); arithmetic, "
                         "a simulation or a reading is 'consistent' with the text's figure or shows it wrong "
                         "(claims.check gives an arithmetic or simulated verdict)")
    return row


def record(claim_id: str, *, claim: str, section: str, measured: str, verdict: str, notebook: str,
           rule: str | Rule, basis: str, estimate: Estimate | None = None, n: int | None = None,
           interval: tuple[float, float] | None = None, cite: str | list[str] | None = None,
           anchor: str | None = None, scope: Scope | None = None, reason: str | None = None,
           test: HypothesisTest | None = None, rule_changes: list[RuleChange] | None = None,
           merged: list[str] | None = None) -> dict:
    """Record one row of the claims ledger and return it.

    Args:
        claim_id: a short stable slug (``"kv-70b-128k-320gib"``).
        claim: what the source states (paraphrased in English; quote the Chinese where wording matters).
        section: the source's section number (``"10.1.1"``).
        measured: what this run found, in a sentence the numbers make true.
        verdict: one of :data:`VERDICTS`, computed by the notebook (:func:`judge` for a measured row,
            :func:`check` for an arithmetic or simulated one); typed only on a reading row.
        notebook: the notebook's stem (``"01_kv_cache"``).
        rule: the verdict rule, as stated before the measurement: a :class:`Rule` (its words, the function
            that gave ``verdict`` and a counter-example on which that function says something else; required
            of measured and arithmetic rows) or, for a reading row, the words alone.
        basis: one of :data:`BASES`; it limits the verdicts the row may reach (:data:`VERDICTS_BY_BASIS`).
        estimate: for ``basis="measured"``: the decisive :class:`Estimate`, which fills ``n`` and ``interval``;
            for ``basis="simulated"``: the range over seeds (:meth:`Estimate.spread`).
        n, interval: the sample size and 95% interval, when no single :class:`Estimate` says them.
        cite: bibtex key(s) of the paper(s) a ``"reading"`` row checks the text against.
        anchor: a MyST label in the chapter (``(kv-quant-table-10-5)=``) that the claims page links to.
        scope: the :class:`Scope` the verdict was judged against; required for ``basis="measured"`` (the
            same one given to :func:`judge`).
        reason: why the verdict is what it is, in a sentence; taken from ``verdict`` when it is a
            :class:`Verdict` from :func:`judge` (give one or the other).
        test: the :class:`HypothesisTest` that decided a measured row (a chi-square fit): its p-value is
            stored as a p-value, never as an interval.
        rule_changes: each change of ``rule`` since the row was first recorded, oldest first, as
            :class:`RuleChange` (date, the old rule, why it changed); the page shows them with the rule.
        merged: ids of rows this row absorbed (each is listed in :mod:`labsrc.claims_retired` with the reason).

    The runtime profile (``cpu`` or ``gpu``) is recorded with every row.
    """
    from labsrc import runtime

    if n is not None and isinstance(n, numbers.Integral) and not isinstance(n, bool):
        n = int(n)  # a numpy count is a count
    if estimate is not None:
        if not isinstance(estimate, Estimate):
            raise TypeError(f"estimate must be a labsrc.claims.Estimate, got {type(estimate).__name__}")
        if basis == "simulated" and estimate.method != SEED_RANGE:
            raise ValueError(f"a simulated row gives its spread as the range over seeds (claims.Estimate.spread), "
                             f"not a {estimate.method} interval: seeds of a simulator are not a measurement's "
                             "sample")
        if basis != "simulated" and estimate.method == SEED_RANGE:
            raise ValueError("a range over simulator seeds (Estimate.spread) belongs to a simulated row")
        if n is not None or interval is not None:
            raise ValueError("give either estimate or n/interval, not both")
        n, interval = estimate.n, (estimate.lo, estimate.hi)
    if scope is not None and not isinstance(scope, Scope):
        raise TypeError(f"scope must be a labsrc.claims.Scope, got {type(scope).__name__}")
    judged = getattr(verdict, "reason", None)
    if judged is not None and reason is not None:
        raise ValueError("give the reason through judge's Verdict or as reason=, not both")
    reason = judged if judged is not None else reason
    if isinstance(cite, str):
        cite = [cite]
    if test is not None and not isinstance(test, HypothesisTest):
        raise TypeError(f"test must be a labsrc.claims.HypothesisTest, got {type(test).__name__}")
    if rule_changes is not None:
        if isinstance(rule_changes, RuleChange) or not all(isinstance(c, RuleChange) for c in rule_changes):
            raise TypeError("rule_changes must be a list of labsrc.claims.RuleChange")
        rule_changes = [c.fields() for c in rule_changes]
    counter = None
    if isinstance(rule, Rule):
        counter = rule.counter_fields(str(verdict))
        rule = rule.text
    elif not isinstance(rule, str):
        raise TypeError(f"rule must be a labsrc.claims.Rule (or, for a reading row, its words), got "
                        f"{type(rule).__name__}")
    if merged is not None:
        if isinstance(merged, str) or not all(isinstance(m, str) for m in merged):
            raise TypeError("merged must be a list of the absorbed rows' ids")
        merged = list(merged)
    if anchor is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", str(anchor)):
        raise ValueError(f"anchor must be a lowercase MyST label like 'kv-quant-table', got {anchor!r}")
    row = Row(id=claim_id, claim=claim, section=section, measured=measured,
              verdict=str(verdict) if isinstance(verdict, str) else verdict, notebook=notebook,
              rule=rule, basis=basis, profile=runtime.PROFILE, n=n,
              interval=[_number("interval[0]", interval[0]), _number("interval[1]", interval[1])]
              if interval is not None else None,
              cite=list(cite) if cite else None, anchor=anchor,
              **(scope.fields() if scope is not None else dict.fromkeys(_SCOPE_FIELDS)), reason=reason,
              test=test.fields() if test is not None else None, rule_changes=rule_changes or None,
              counter=counter, merged=merged or None)
    _validate(row, f"claim {claim_id!r}")
    folder = claims_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{claim_id}.json"
    # Two notebooks may record the same id at once: each write has its own temporary file (a shared one
    # interleaved their bytes, and the second os.replace found it gone), under the row's lock.
    with file_lock(path):
        write_atomic(path, json.dumps(row, indent=1, ensure_ascii=False))
    return row


# The page: loading the rows and rendering book/claims.md (labsrc/claims/page.py).
from labsrc.claims.page import _cell, _evidence, _section_key, _verdict_cell, load, render_markdown  # noqa: E402,F401
