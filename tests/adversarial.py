"""A small framework for grading exercises adversarially: wrong answers that must fail, and messages that must
not leak the answer.

Each chapter registers its exercises in ``tests/adversaries/chNN.py`` (one file per chapter, so chapters are
added without touching each other's files), as a module-level list::

    from tests.adversarial import Exercise, constants, scaled, visible_only, handout, bypass

    EXERCISES = [
        Exercise("01_kv_cache", "check_gqa_bytes", kind_adversaries=[*constants(), *scaled(), visible_only()]),
        ...
    ]

``tests/test_exercise_adversarial.py`` collects every ``EXERCISES`` list and, for each adversary, submits its
answer to the visible check (``LAB_EXERCISES`` unset, as a student runs it) and to the hidden check with the
``hidden=`` value written in the instructor notebook's hidden section (as nbgrader autogrades it). The adversary
must fail one of them (a *visible-only* adversary must fail the hidden one), and no message either check prints
may hold

* a number that equals an expected value or a simple transform of it (x2, /2, +1, -1, the sign flipped: so the
  scaled adversaries' own answers, echoed, are caught too), expected values being what the instructor's
  solution returns on the cases the check ran (plus any an exercise adds through ``expected=``); the part of a
  message that names the case (``Result.case``: inputs, shapes, the element) and the numbers written in the
  checker module's own source (fixed text such as "half a percentage point") are left out;
* a direction word ("too large", "below", "underestimates" ...).

The instructor's solution is the code of the notebook's solution cell, executed in a namespace with the usual
imports (``torch``, ``math``, ``np``, ``F``, ``triton``, ``tl``) plus the exercise's ``setup`` names.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]

DIRECTION = re.compile(
    r"\b(too (high|low|large|small|big|many|few|much|little|long|short|wide|narrow)|larger|smaller|higher|lower|"
    r"greater|fewer|bigger|above|below|over-?estimat\w*|under-?estimat\w*|exceed\w*|undershoot\w*|overshoot\w*|"
    r"more than|less than|short of|off by|times (the )?(right|expected|measured|correct) (value|one|answer))\b",
    re.I)
"""Words that tell a student which way the right answer lies."""

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.]*[A-Za-z_])")


# ------------------------------------------------------------------------------------------------ notebooks
def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def notebook(chapter: str) -> list[dict]:
    return json.loads((ROOT / "chapters" / f"{chapter}.ipynb").read_text())["cells"]


def cells_of(chapter: str, check: str) -> tuple[str, str]:
    """``(solution cell, test cell)`` sources of the exercise graded by ``check`` (the test cell's grade id, or
    another check that test cell calls)."""
    cells = notebook(chapter)
    for i, cell in enumerate(cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade") and (meta.get("grade_id") == check or f"ex.{check}(" in _source(cell)):
            sol = next(c for c in reversed(cells[:i]) if c.get("metadata", {}).get("nbgrader", {}).get("solution"))
            return _source(sol), _source(cell)
    raise LookupError(f"{chapter} has no graded cell {check}")


def hidden_values(chapter: str, check: str) -> list[Any]:
    """The ``hidden=`` values of the hidden calls of ``check`` in the instructor notebook's test cell."""
    _, test = cells_of(chapter, check)
    section = test.split("### BEGIN HIDDEN TESTS", 1)[1]
    values = []
    for call in re.findall(rf"ex\.{check}\((.*)\)\s*$", section, re.M):
        tree = ast.parse(f"f({call})", mode="eval").body
        kw = {k.arg: k.value for k in tree.keywords}
        values.append(ast.literal_eval(kw["hidden"]))
    return values


def base_namespace() -> dict:
    import numpy as np
    import torch.nn.functional as F

    from labsrc import runtime
    from labsrc.kernels._triton import tl, triton
    return {"torch": torch, "math": math, "np": np, "F": F, "triton": triton, "tl": tl, "runtime": runtime,
            "HAS_TRITON": runtime.HAS_TRITON}


def solution(chapter: str, check: str, setup: dict | None = None, name: str | None = None) -> Callable:
    """The instructor's answer: the solution cell executed, and the function (or kernel) it defines (the last
    one, or ``name``)."""
    sol, _ = cells_of(chapter, check)
    ns = {**base_namespace(), **(setup or {})}
    before = set(ns)
    exec(compile(sol, f"<{chapter} solution of {check}>", "exec"), ns)
    if name is not None:
        return ns[name]
    defined = [v for k, v in ns.items() if k not in before and (callable(v) or hasattr(v, "fn"))
               and not isinstance(v, type) and not k.startswith("_") and getattr(v, "__module__", None) != "labsrc"]
    return defined[-1]


def handout(chapter: str, name: str, setup: dict | None = None) -> Callable:
    """The buggy code a debugging exercise hands out: the fenced ```python block of a markdown cell (or the code
    cell) of ``chapter`` that defines ``name``, executed."""
    for cell in notebook(chapter):
        text = _source(cell)
        blocks = re.findall(r"```python\n(.*?)```", text, re.S) if cell["cell_type"] == "markdown" else [text]
        for block in blocks:
            if re.search(rf"^def {re.escape(name)}\(", block, re.M) and "### BEGIN SOLUTION" not in block:
                ns = {**base_namespace(), **(setup or {})}
                exec(compile(block, f"<{chapter} handout {name}>", "exec"), ns)
                return ns[name]
    raise LookupError(f"{chapter} hands out no function {name}")


# ------------------------------------------------------------------------------------------------ adversaries
@dataclass
class Adversary:
    """A wrong answer. ``make(right)`` builds it from the instructor's answer ``right``. ``hidden_only``: it is
    right on the visible cases by construction, so only the hidden check must catch it."""

    name: str
    make: Callable[[Callable], Any]
    hidden_only: bool = False


def _map(out: Any, f: Callable[[Any], Any]) -> Any:
    """``f`` applied to every number or floating tensor of an answer's output (tuples and lists kept)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_map(o, f) for o in out)
    if isinstance(out, torch.Tensor):
        return f(out) if out.is_floating_point() else (f(out.double()).round().to(out.dtype))
    if isinstance(out, bool) or out is None:
        return out
    if isinstance(out, (int, float)):
        return f(out)
    return out


def constants(values=(0, 1, -1, 0.5, 1e6)) -> list[Adversary]:
    """Answers that return one constant whatever they are given (for an answer with tensor outputs: the right
    answer's shape filled with the constant)."""
    def make(c):
        def build(right):
            def answer(*args, **kwargs):
                out = right(*args, **kwargs)
                return _map(out, lambda x: torch.full_like(x, c) if isinstance(x, torch.Tensor) else c)
            return answer
        return build
    return [Adversary(f"constant {c:g}", make(c)) for c in values]


def scaled(factors=(("x2", lambda x: x * 2), ("x0.5", lambda x: x * 0.5), ("+1", lambda x: x + 1))
           ) -> list[Adversary]:
    """The right answer scaled by 2, by 1/2, and shifted by 1."""
    def make(f):
        def build(right):
            return lambda *args, **kwargs: _map(right(*args, **kwargs), f)
        return build
    return [Adversary(f"right {name}", make(f)) for name, f in factors]


def visible_only(wrong: Callable[[Any], Any] = lambda x: x * 2 + 1) -> Adversary:
    """Right on the visible cases (it learns them from a run of the visible check), ``wrong`` elsewhere."""
    def build(right):
        seen: dict[str, Any] = {}

        def key(args, kwargs):
            return repr([(tuple(a.shape), a.sum().item()) if isinstance(a, torch.Tensor) else a for a in args]) + \
                repr(sorted(kwargs.items()))

        def answer(*args, **kwargs):
            k = key(args, kwargs)
            if answer.learning:
                seen[k] = True
                return right(*args, **kwargs)
            out = right(*args, **kwargs)
            return out if k in seen else _map(out, wrong)
        answer.learning = True
        return answer
    return Adversary("right on the visible cases only", build, hidden_only=True)


def handed_out(chapter: str, name: str, setup: dict | None = None) -> Adversary:
    """The buggy code a debugging exercise hands out, submitted as it is."""
    return Adversary(f"the handed-out {name}", lambda right: handout(chapter, name, setup))


def bypass(name: str, make: Callable[[Callable], Any]) -> Adversary:
    """A known way around the exercise (a library call, a later cell's measurement ...): ``make(right)``."""
    return Adversary(f"bypass: {name}", make)


@dataclass
class Exercise:
    """One graded exercise and the adversaries it must reject.

    ``chapter`` and ``check`` name the notebook and its grade id; ``adversaries`` the wrong answers; ``setup``
    names the solution cell needs beyond the usual imports; ``name`` the function the solution cell defines (when
    it defines several); ``expected`` extra expected values to look for in messages (a measured quantity the
    solution only approximates); ``check_kwargs`` keyword arguments the test cell passes to the check."""

    chapter: str
    check: str
    adversaries: list[Adversary]
    setup: dict = field(default_factory=dict)
    name: str | None = None
    expected: Callable[[], list[float]] | None = None
    check_kwargs: dict = field(default_factory=dict)
    module: str | None = None

    @property
    def id(self) -> str:
        return f"{self.chapter[:2]}-{self.check.removeprefix('check_')}"

    def checker(self) -> Callable:
        if self.module is None:
            _, test = cells_of(self.chapter, self.check)
            for cell in notebook(self.chapter):
                m = re.search(r"from labsrc\.exercises import (\w+) as ex\b", _source(cell))
                if m:
                    self.module = m.group(1)
                    break
        return getattr(importlib.import_module(f"labsrc.exercises.{self.module}"), self.check)

    def right(self) -> Callable:
        return solution(self.chapter, self.check, self.setup, self.name)


# ------------------------------------------------------------------------------------------------ running
@dataclass
class Outcome:
    visible_passed: bool
    hidden_passed: bool
    results: list                      # every Result printed, visible and hidden
    errors: list[str]                  # exceptions other than the check's own verdict

    def messages(self) -> list[str]:
        """What each result said, without the part that names the case."""
        out = []
        for r in self.results:
            text = r.message
            if r.case:
                text = text.replace(r.case, "")
            out.append(text)
        for err in self.errors:                 # a raised failure repeats a printed result, case included
            for r in self.results:
                if r.case:
                    err = err.replace(r.case, "")
            out.append(err)
        return out


@contextlib.contextmanager
def recording():
    """Every :class:`labsrc.exercises.core.Result` printed while inside (the checks print each one)."""
    from labsrc.exercises import core

    seen: list = []
    original = core.Result.__str__

    def spy(self):
        if not seen or seen[-1] is not self:
            seen.append(self)
        return original(self)

    core.Result.__str__ = spy
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield seen
    finally:
        core.Result.__str__ = original


def run(exercise: Exercise, answer: Any) -> Outcome:
    """Submit ``answer`` to the visible check and to each hidden check of the notebook."""
    from labsrc.exercises import ExerciseFailed

    check = exercise.checker()
    errors: list[str] = []
    with recording() as results:
        try:
            visible = check(answer, **exercise.check_kwargs).passed
        except ExerciseFailed as err:
            visible = False
            errors.append(str(err))
        if hasattr(answer, "learning"):
            answer.learning = False
        hidden = True
        for value in hidden_values(exercise.chapter, exercise.check):
            try:
                hidden = check(answer, hidden=value, **exercise.check_kwargs).passed and hidden
            except ExerciseFailed as err:
                hidden = False
                errors.append(str(err))
    return Outcome(visible, hidden, list(results), errors)


def expected_values(exercise: Exercise, right: Callable) -> list[float]:
    """The numbers the instructor's answer returns on the cases the checks run (visible and hidden), plus the
    exercise's own ``expected``."""
    found: list[float] = []

    def collect(out):
        if isinstance(out, (tuple, list)):
            for o in out:
                collect(o)
        elif isinstance(out, torch.Tensor):
            if out.numel() <= 64:
                found.extend(float(x) for x in out.detach().double().flatten().tolist())
        elif isinstance(out, (int, float)) and not isinstance(out, bool):
            found.append(float(out))

    if callable(right) and not hasattr(right, "fn"):
        def spy(*args, **kwargs):
            out = right(*args, **kwargs)
            collect(out)
            return out
        run(exercise, spy)
    if exercise.expected is not None:
        found.extend(exercise.expected())
    return [x for x in found if math.isfinite(x)]


def source_numbers(exercise: Exercise) -> set[float]:
    """The numbers written in the checker module's and core's source: fixed text, not information about a case."""
    import inspect

    from labsrc.exercises import core
    exercise.checker()
    mod = importlib.import_module(f"labsrc.exercises.{exercise.module}")
    text = inspect.getsource(mod) + inspect.getsource(core)
    return {float(m) for m in _NUMBER.findall(text)}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-12)


def leaks(message: str, expected: list[float], fixed: set[float]) -> list[str]:
    """The numbers of ``message`` that equal an expected value or a simple transform of it, and its direction
    words."""
    found = [m.group(0) for m in DIRECTION.finditer(message)]
    for token in _NUMBER.findall(message):
        x = float(token)
        if x in fixed or any(_close(x, f) for f in fixed):
            continue
        for e in expected:
            transforms = [e, 2 * e, e / 2, e + 1, e - 1, -e]
            if any(_close(x, t) for t in transforms):
                found.append(f"{token} (from expected {e:g})")
                break
    return found


def silent_kernel() -> Adversary:
    """A ``@triton.jit`` kernel with the solution's signature that writes nothing (Triton reads a kernel's source
    from its file, so it is written to one and imported)."""
    def build(right):
        import importlib.util
        import inspect
        import tempfile

        fn = getattr(right, "fn", right)
        params = inspect.signature(fn).parameters
        args = ", ".join(f"{p}: tl.constexpr" if "constexpr" in str(v.annotation) else p for p, v in params.items())
        text = ("from labsrc.kernels._triton import tl, triton\n\n\n@triton.jit\n"
                f"def silent({args}):\n    pass\n")
        path = Path(tempfile.mkdtemp(prefix="lab-adversary-")) / "silent_kernel.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("silent_kernel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.silent
    return Adversary("a kernel that writes nothing", build)
