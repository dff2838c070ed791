"""Rules that could fail: a verdict rule as its words, the function that decides it and a synthetic
counter-example on which that function says something else (:class:`Rule`), and the two common shapes
(:func:`above_rule`, :func:`within_rule`). Re-exported by :mod:`labsrc.claims`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from labsrc.claims import VERDICTS, Estimate, Scope, Verdict, check, compare, judge



def _describe(value) -> str:
    """A counter-example's value as the page prints it: an Estimate as itself, a float to 4 digits."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [_describe(v) for v in value[:6]]
        return "[" + ", ".join(items) + (", ..." if len(value) > 6 else "") + "]"
    if isinstance(value, dict):
        items = [f"{k}: {_describe(v)}" for k, v in list(value.items())[:6]]
        return "{" + ", ".join(items) + (", ..." if len(value) > 6 else "") + "}"
    return str(value)


@dataclass(frozen=True)
class Rule:
    """A verdict rule: its words, the function that applies it to data, and data on which it would fail.

    Args:
        text: the rule in words, as the page prints it ("reproduced if the 95% interval lies above 0.9").
        decide: a function of the row's data, given by keyword, returning the :class:`Verdict` from
            :func:`judge` (a measured row) or :func:`check` (an arithmetic or simulated row). It applies the
            rule and nothing else: everything it reads comes in as an argument, so it can be called on other
            data.
        counter: synthetic data (keyword arguments of ``decide``) on which the rule reaches another verdict
            than on the row's data: what the lab would have had to find for the row to say something else. A
            list of such dicts gives one counter-example per other branch, for a row whose outcome is not known
            before it runs (one on which the claim holds, one on which it fails).

    ``rule(**data)`` is the verdict on the row's data. :func:`record` takes the rule with the verdict, calls
    ``decide`` on each counter-example and refuses a row when none reaches another verdict than the row's
    own: a rule that no data could move is not a test of the claim.
    """

    text: str
    decide: Callable[..., "Verdict"]
    counter: dict | list = field(default_factory=dict)

    def __post_init__(self):
        from labsrc.claims import _text  # defined after this module is imported

        _text("Rule.text", self.text)
        if not callable(self.decide):
            raise TypeError(f"Rule.decide must be a function of the row's data, got {type(self.decide).__name__}")
        examples = self.counter if isinstance(self.counter, list) else [self.counter]
        if not examples or not all(isinstance(c, dict) and c for c in examples):
            raise ValueError("Rule.counter must be a non-empty dict of the data (decide's keyword arguments) on "
                             "which the rule reaches another verdict, or a list of such dicts, got "
                             f"{self.counter!r}")

    def __call__(self, **data) -> "Verdict":
        verdict = self.decide(**data)
        if not isinstance(verdict, str) or verdict not in VERDICTS:
            raise ValueError(f"Rule.decide must return a verdict (claims.judge or claims.check), got {verdict!r}")
        return verdict if isinstance(verdict, Verdict) else Verdict(verdict)

    def counter_verdicts(self) -> list["Verdict"]:
        """The verdict the rule reaches on each synthetic counter-example."""
        return [self(**c) for c in (self.counter if isinstance(self.counter, list) else [self.counter])]

    def counter_verdict(self) -> "Verdict":
        """The verdict the rule reaches on its (first) synthetic counter-example."""
        return self.counter_verdicts()[0]

    def counter_fields(self, verdict: str) -> dict:
        """What the row stores of the counter-example that reaches another verdict than ``verdict`` (the
        first, if none does; :func:`record` then refuses the row): the data in words and its verdict."""
        examples = self.counter if isinstance(self.counter, list) else [self.counter]
        pairs = list(zip(examples, self.counter_verdicts()))
        data, said = next(((c, v) for c, v in pairs if v != verdict), pairs[0])
        return {"data": "; ".join(f"{k} = {_describe(v)}" for k, v in data.items()), "verdict": str(said)}


_HIGH = Estimate(0.8, 0.75, 0.85, 100, "synthetic")
_LOW = Estimate(0.2, 0.15, 0.25, 100, "synthetic")


def above_rule(text: str, *, scope: Scope) -> Rule:
    """The commonest measured rule, as a :class:`Rule` of ``(a, b)``: the claim holds if ``a``'s 95% interval
    lies above ``b``'s, fails if below, and the data cannot tell if they overlap (:func:`compare`). Its
    counter-examples are two synthetic estimates apart in each direction. Swap the arguments for "below"."""
    def decide(a: Estimate, b: Estimate) -> Verdict:
        side = compare(a, b)
        return judge(side > 0, separable=side != 0, scope=scope)

    return Rule(text, decide, counter=[dict(a=_HIGH, b=_LOW), dict(a=_LOW, b=_HIGH)])


def within_rule(text: str, *, target: float, tol: float, relative: bool = True, basis: str = "arithmetic") -> Rule:
    """An arithmetic (or simulated) rule of one computed ``value``: consistent if it lies within ``tol`` of the
    text's ``target`` (relative to it unless ``relative=False``); wrong in the text otherwise (inconclusive
    for a simulation, :func:`check`). Its counter-examples are the target itself and a value ``3 tol`` away."""
    if not (isinstance(target, (int, float)) and math.isfinite(target)):
        raise ValueError(f"target must be a finite number, got {target!r}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    if relative and target == 0:
        raise ValueError("a relative tolerance needs a non-zero target (give relative=False)")
    width = tol * abs(target) if relative else tol

    def decide(value: float) -> Verdict:
        return check(abs(value - target) <= width, basis=basis)

    return Rule(text, decide, counter=[dict(value=float(target)), dict(value=float(target + 3 * width))])

