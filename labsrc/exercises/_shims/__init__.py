"""What chapters 8-15's checks need from :mod:`labsrc.exercises.core` as issue 44 rewrites it (branch exA), with
the older core's behaviour where the new functions are not there yet. Once both are merged this module reduces
to re-exports of ``core.seed_for``, ``core.trials_for`` and ``core.fail`` and can be dropped. (A package, not a
module, so that the tests that find every chapter's module of checks by globbing ``labsrc/exercises/*.py`` pass it
by.)

* :func:`seed_for` and :func:`trials_for`: the seed and the number of trials of a case set; in the hidden cases
  the seed comes from the instructor notebook's hidden section (``hidden=<seed>``), not from this package.
* :func:`failed`: report a failure whose message starts with the case (``"trial 3 (T=7, ...): the invariant
  broken"``), keeping the case apart in ``Result.case`` so a test can tell the inputs a message names from
  information about the answer.
"""
from __future__ import annotations

from labsrc.exercises import core
from labsrc.exercises.core import FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, Result, _report, hidden

__all__ = ["seed_for", "trials_for", "failed"]


def seed_for(visible: int) -> int:
    """The seed a check draws its cases from: ``visible``, or in the hidden cases the notebook's seed (older
    core: a fixed offset from ``visible``)."""
    if hasattr(core, "seed_for"):
        return core.seed_for(visible)
    return visible + HIDDEN_SEED_OFFSET if hidden() else visible


def trials_for(visible: int) -> int:
    """How many trials a check runs: ``visible``, or more in the hidden cases."""
    if hasattr(core, "trials_for"):
        return core.trials_for(visible)
    return visible * HIDDEN_TRIALS if hidden() else visible


def _case_of(message: str) -> str:
    """The part of ``message`` before its first ``": "`` outside brackets: the case it names (or '')."""
    depth = 0
    for i, ch in enumerate(message):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ":" and depth == 0 and message[i + 1:i + 2] == " ":
            return message[:i]
    return ""


def failed(name: str, message: str) -> Result:
    """Report ``message`` as a failure of the check ``name`` (printed, and raised where the check must raise),
    with the case it opens with kept in ``Result.case`` where the core's Result has that field."""
    case = _case_of(message)
    try:
        result = Result(name, FAILED, message, case=case)
    except TypeError:            # the older core's Result has no case
        result = Result(name, FAILED, message)
    return _report(result)
