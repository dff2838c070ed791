"""Check cells for exercises: compare a student's answer with the truth and say what is right or wrong.

Every exercise in the lab is a function the student fills in. A check calls it:

* if it raises ``NotImplementedError`` (the stub in the student build), the check prints
  ``not solved yet`` and the notebook carries on;
* if its answer is right, the check prints ``passed``;
* otherwise it prints what is wrong and a hint, never the solution.

"What is wrong" is as specific as the check can make it: the failing case, a wrong shape, and where it can
tell, the kind of slip (a number off by an exact factor or by one, a tensor transposed, scaled or shifted, the
argument whose doubling moves the answer unlike the truth: :func:`diagnose_number`, :func:`scaling_diagnosis`,
and a chapter's own ``explain`` callback to :func:`check_function`). The hint sends the student to the section
of the chapter to re-read; it never writes out the expected code or formula (``tests/test_exercise_hints.py``).

With ``LAB_EXERCISES=strict`` in the environment (set when the instructor notebooks are executed by the
tests and the book build, and by the grading command) anything but ``passed`` raises :class:`ExerciseFailed`,
so a broken solution cannot slip into the book and a wrong answer loses the test cell's points.

Every chapter check is wrapped by :func:`exercise`, which adds ``hidden=True``: the same check on a further
case set (another seed, twice the trials, plus any extra cases the chapter module adds through
:func:`hidden`), and a failure then *always* raises, whatever the environment. Those calls sit between
``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` in each test cell: nbgrader removes them from the
release notebooks and puts them back when it autogrades, so even a plain ``nbgrader autograde`` (without
``LAB_EXERCISES=strict``) gives an unsolved or wrong exercise no points, while a student running the release
notebook sees the friendly message and the notebook runs on.

A kernel exercise cannot run where Triton is not installed (macOS, Windows). Its check then prints that it was
skipped; a student carries on. But a skipped check has judged nothing, so it must not earn points: with
``LAB_EXERCISES=strict`` and in the hidden cases it raises, with a message saying to grade on Linux, and
``python -m labsrc.exercises.grade`` lists those exercises as not graded on that machine. Executing the
instructor notebooks to build the book sets ``LAB_EXERCISES=build`` instead: strict in every other way (a failed
or unsolved check raises, hidden cases included), but a kernel that cannot run here is reported as skipped, so
the book builds on a Mac too.
"""
from __future__ import annotations

import contextvars
import functools
import math
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch

PASSED, FAILED, NOT_SOLVED, SKIPPED = "passed", "failed", "not solved yet", "skipped"

# Tolerances follow the dtype: about 1e-5 relative for fp32, 1e-3 for fp16, 1e-2 for bf16.
_TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The ``(rtol, atol)`` the lab uses when comparing tensors of ``dtype``; exact (0, 0) for integers."""
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def randint(gen: torch.Generator, lo: int, hi: int) -> int:
    """A random integer in ``[lo, hi]`` (both ends included) from ``gen``: for building random check inputs."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def as_number(fn: Callable) -> Callable:
    """Wrap a student's function so that a one-element tensor or NumPy value counts as the number it holds:
    the check should judge the value, not the type."""
    def wrapped(*args):
        got = fn(*args)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            return got.item()
        if isinstance(got, (np.ndarray, np.generic)) and np.size(got) == 1:
            return got.item()
        return got
    return wrapped


class ExerciseFailed(AssertionError):
    """Raised in strict mode when an exercise is not passed."""


@dataclass
class Result:
    """The outcome of one check: ``status`` is ``"passed"``, ``"failed"`` or ``"not solved yet"``."""

    name: str
    status: str
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def _ipython_display_(self) -> None:
        """Show nothing when a check is a cell's last expression: it has printed its one-line message already (a
        repr would repeat it), and nbgrader would read a test cell's displayed value as a partial-credit score."""

    def __str__(self) -> str:
        mark = {PASSED: "✅", FAILED: "❌", NOT_SOLVED: "⏳", SKIPPED: "⏭"}[self.status]
        text = f"{mark} {self.name}: {self.status}"
        return f"{text}. {self.message}" if self.message else text


def _mode() -> str:
    return os.environ.get("LAB_EXERCISES", "").strip().lower()


def strict() -> bool:
    """True when ``LAB_EXERCISES`` is ``strict`` (grading) or ``build`` (the book build executing the instructor
    notebooks): checks raise instead of printing a failure."""
    return _mode() in ("strict", "build")


def building() -> bool:
    """True when ``LAB_EXERCISES=build``: the instructor notebooks are executed for the book, so a kernel check
    that cannot run on this machine reports "skipped" instead of raising (nothing is graded)."""
    return _mode() == "build"


# Set while a check runs with ``hidden=True`` (see :func:`exercise`).
_HIDDEN = contextvars.ContextVar("lab_hidden_cases", default=False)
# Hidden cases draw from a generator seeded this far from the visible one, with HIDDEN_TRIALS times the trials.
HIDDEN_SEED_OFFSET, HIDDEN_TRIALS = 1000, 2


def hidden() -> bool:
    """True inside a check called with ``hidden=True``: a chapter check may add cases of its own then."""
    return _HIDDEN.get()


def exercise(check: Callable[..., Result]) -> Callable[..., Result]:
    """Give a chapter check a ``hidden`` keyword (default False).

    ``check(answer, hidden=True)`` runs the hidden case set (:func:`check_function` changes its seed and
    doubles its trials; a check may add cases when :func:`hidden` is true) and raises
    :class:`ExerciseFailed` on anything but *passed*, in any environment: hidden calls only exist in the
    instructor's notebooks and in the copies nbgrader autogrades.
    """
    @functools.wraps(check)
    def wrapped(answer: Any, *, hidden: bool = False) -> Result:
        if not hidden:
            return check(answer)
        token = _HIDDEN.set(True)
        try:
            return check(answer)
        finally:
            _HIDDEN.reset(token)
    return wrapped


def _report(result: Result) -> Result:
    if hidden():
        result.name = f"{result.name} (hidden cases)"
    print(result)
    if (strict() or hidden()) and not result.passed:
        raise ExerciseFailed(str(result))
    return result


TRITON_MISSING = ("Triton is not installed on this machine (it has Linux wheels only), so the kernel cannot run; "
                  "the other exercises do not need it.")
NOT_GRADED = "not graded on this machine"
"""The words every skipped kernel check raises with when grading: :mod:`labsrc.exercises.grade` looks for them."""
GRADE_ON_LINUX = (f"{NOT_GRADED}: a skipped kernel check earns no points. Grade this notebook on Linux, where "
                  "Triton installs and its interpreter runs the kernel on a CPU.")


def triton_missing(name: str) -> Result:
    """Report the kernel exercise ``name`` as skipped, Triton being missing here: printed and returned while a
    student works, but raised as :class:`ExerciseFailed` (saying to grade on Linux) with ``LAB_EXERCISES=strict``
    and in the hidden cases, since a check that ran nothing must not award the exercise's points. Only the book
    build (``LAB_EXERCISES=build``) lets it pass through there."""
    result = Result(f"{name} (hidden cases)" if hidden() else name, SKIPPED, TRITON_MISSING)
    print(result)
    if (strict() or hidden()) and not building():
        raise ExerciseFailed(f"{result.name}: {GRADE_ON_LINUX}")
    return result


def skipped_without_triton(name: str) -> Result | None:
    """``None`` where Triton can launch kernels; elsewhere the result of :func:`triton_missing` (which raises when
    grading)."""
    from labsrc import runtime

    if runtime.HAS_TRITON:
        return None
    return triton_missing(name)


def not_a_kernel(name: str, kernel: Any, launch: str) -> Result | None:
    """``None`` when ``kernel`` launches as ``kernel[grid](...)`` (a ``@triton.jit`` function); else the result to
    report: "not solved yet" for the untouched stub (it raises ``NotImplementedError``), failed for anything
    else, with a hint naming the launch in words (``launch``, e.g. ``"a grid of R programs"``)."""
    if hasattr(kernel, "__getitem__"):
        return None
    try:
        kernel()
    except NotImplementedError:
        return Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again.")
    except Exception:  # noqa: BLE001 - any other failure: it is not a launchable kernel
        pass
    return Result(name, FAILED, f"{kernel!r} is not a Triton kernel, so the check cannot launch it on "
                                f"{launch}. Hint: re-read how the chapter's kernel is declared and launched.")


def stub_raised(err: BaseException) -> bool:
    """Whether ``err`` is the student build's stub saying it is not filled in: a ``NotImplementedError``
    anywhere in the chain of wrappers (Triton's interpreter re-raises a kernel's exception wrapped), or an
    error whose text names it (a compiled kernel's stub fails to compile with the ``raise`` in its message).
    Every check asks this one question before it calls a failure a failure."""
    link: BaseException | None = err
    while link is not None:
        if isinstance(link, NotImplementedError) or "NotImplementedError" in repr(link):
            return True
        link = link.__cause__ or link.__context__
    return False


def launch_failed(name: str, err: BaseException, where: str, hint: str) -> Result:
    """What to report when launching a student's kernel raised ``err``: "not solved yet" when it is the stub's
    ``NotImplementedError`` (the interpreter wraps a kernel's exception, so its cause is looked at too), else
    a failure naming the exception's type and first line, ``where`` (the trial and sizes) and the ``hint``."""
    if stub_raised(err):
        return Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again.")
    shown = err.__cause__ or err.__context__ or err
    first = str(shown).splitlines()[0][:160] if str(shown) else ""
    return Result(name, FAILED, _with_hint(f"{where}: the launch raised {type(shown).__name__}: {first}", hint))


def _call(answer: Any, *args: Any) -> tuple[Any, Result | None]:
    """Call ``answer`` (when callable) and turn the student-build stub into a 'not solved' result."""
    if not callable(answer):
        return answer, None
    try:
        return answer(*args), None
    except NotImplementedError:
        return None, Result("", NOT_SOLVED, "Fill in the function above, then run this cell again.")


def _with_hint(message: str, hint: str) -> str:
    return f"{message} Hint: {hint}" if hint else message


def check_value(name: str, answer: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 0.0,
                hint: str = "") -> Result:
    """Check a number (or any value compared with ``==``).

    ``answer`` is the student's function (called with no arguments) or the value itself. Numbers are
    compared with ``rtol``/``atol``; the expected value is never printed.
    """
    got, unsolved = _call(answer)
    if unsolved is not None:
        unsolved.name = name
        return _report(unsolved)
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return _report(Result(name, FAILED, _with_hint(f"expected a number, got {type(got).__name__}.", hint)))
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            direction = "too large" if got > expected else "too small"
            return _report(Result(name, FAILED, _with_hint(
                f"{got!r} is {direction}.{diagnose_number(got, expected)}", hint)))
        return _report(Result(name, PASSED))
    if got != expected:
        return _report(Result(name, FAILED, _with_hint(f"{got!r} is not the expected answer.", hint)))
    return _report(Result(name, PASSED))


def _simple_ratio(r: float) -> str | None:
    """``r`` written as a small fraction ``p/q`` (p, q <= 8), a whole number up to 100 or one over such a number,
    when it is one; else None."""
    for q in range(1, 9):
        p = round(r * q)
        if 1 <= abs(p) <= 8 and math.isclose(r, p / q, rel_tol=1e-6):
            return f"{p}" if q == 1 else f"{p}/{q}"
    if r and 1 < abs(round(r)) <= 100 and math.isclose(r, round(r), rel_tol=1e-6):
        return f"{round(r)}"
    if r and 1 < abs(round(1 / r)) <= 100 and math.isclose(1 / r, round(1 / r), rel_tol=1e-6):
        return f"1/{round(1 / r)}"
    return None


def diagnose_number(got: float, expected: float) -> str:
    """What kind of slip a wrong number looks like, as a sentence (or ''): an exact factor (a term counted twice
    or left out, a missing scale), an off-by-one, the wrong sign. It names the slip, not the expected value."""
    if not (math.isfinite(got) and math.isfinite(expected)) or expected == 0:
        return ""
    if got == 0:
        return " It is zero: is every term counted?"
    ratio = got / expected
    if math.isclose(ratio, -1.0, rel_tol=1e-9):
        return " It has the wrong sign."
    whole = float(got).is_integer() and float(expected).is_integer()
    if whole and 1 <= abs(got - expected) <= 2 and abs(expected) >= 3:
        return (f" It is off by {int(got - expected):+d}: check where a count starts and whether its last item "
                f"is included.")
    simple = _simple_ratio(ratio)
    if simple is not None and simple != "1":
        return f" It is exactly {simple} times the right value: a factor is counted too often or left out."
    return ""


def scaling_diagnosis(fn: Callable, reference: Callable, args: tuple, names: Iterable[str]) -> str:
    """Which argument the answer ``fn`` depends on wrongly, as a sentence (or ''): each numeric argument in turn
    is doubled, and the first one that changes ``fn``'s result by another factor than the reference's is named
    (an argument left out, counted twice, or used where another belongs). It says how the answer should react,
    not what to write."""
    def value(f, a):
        try:
            out = f(*a)
            out = out.item() if isinstance(out, torch.Tensor) and out.numel() == 1 else out
            return float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None
        except Exception:  # noqa: BLE001 - an answer that fails on the doubled case says nothing here
            return None

    got0, exp0 = value(fn, args), value(reference, args)
    if not got0 or not exp0:
        return ""
    for i, name in enumerate(names):
        if i >= len(args) or isinstance(args[i], bool) or not isinstance(args[i], (int, float)):
            continue
        doubled = args[:i] + (args[i] * 2,) + args[i + 1:]
        got1, exp1 = value(fn, doubled), value(reference, doubled)
        if got1 is None or exp1 is None:
            continue
        want, have = exp1 / exp0, got1 / got0
        if not math.isclose(want, have, rel_tol=1e-2):   # a clear difference, not a lower-order term
            def said(r):
                return "leaves it unchanged" if math.isclose(r, 1.0, rel_tol=1e-9) else f"multiplies it by {r:.4g}"
            return (f" Doubling {name} {said(want)} in the right answer but {said(have)} in yours: look at how "
                    f"{name} enters your count.")
    return ""


def _diagnose_tensor(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> str:
    """What kind of slip a wrong tensor of the right shape looks like (or ''): transposed, scaled by one constant,
    the wrong sign, all zeros, shifted by one position along a dimension."""
    def close(a, b):
        return a.shape == b.shape and bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))

    g, e = got.double(), expected.double()
    if not torch.isfinite(e).all() or e.numel() < 2:
        return ""
    if got.dim() >= 2 and got.shape[-1] == got.shape[-2] and close(g.transpose(-1, -2), e):
        return " It equals the right result transposed (its last two dimensions swapped)."
    if not g.any() and e.any():
        return " It is all zeros."
    if close(-g, e):
        return " It has the wrong sign everywhere."
    nonzero = e.abs() > max(atol, 1e-12)
    if nonzero.any() and torch.isfinite(g).all():
        ratio = g[nonzero] / e[nonzero]
        c = ratio.median().item()
        if c != 0 and not math.isclose(c, 1.0, rel_tol=1e-9) and close(g, c * e):
            return (f" Every element is {c:.4g} times the right one: a scale factor is missing, extra or "
                    f"applied twice.")
    for d in range(g.dim()):
        n = g.shape[d]
        if n < 3:
            continue
        if close(g.narrow(d, 1, n - 1), e.narrow(d, 0, n - 1)) or close(g.narrow(d, 0, n - 1),
                                                                          e.narrow(d, 1, n - 1)):
            return (f" It is the right result shifted by one position along dimension {d}: an index is off by "
                    f"one.")
    return ""


def _compare_tensors(got: Any, expected: torch.Tensor, rtol: float | None, atol: float | None) -> str | None:
    """Return what is wrong with ``got`` compared to ``expected``, or None when they agree. A wrong tensor of the
    right shape is diagnosed where it can be (:func:`_diagnose_tensor`)."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}."
    if got.shape != expected.shape:
        swapped = got.dim() >= 2 and got.shape[:-2] + got.shape[-2:][::-1] == expected.shape
        return (f"shape {tuple(got.shape)} should be {tuple(expected.shape)}"
                + (" (the last two dimensions are swapped)." if swapped else "."))
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype} should be {expected.dtype}."
    default_rtol, default_atol = tolerance(expected.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    got_c, exp_c = got.detach().cpu(), expected.detach().cpu()
    if torch.isnan(got_c).any() and not torch.isnan(exp_c).any():
        return f"{int(torch.isnan(got_c).sum())} element(s) are NaN."
    if not torch.allclose(got_c.double(), exp_c.double(), rtol=rtol, atol=atol, equal_nan=True):
        diff = (got_c.double() - exp_c.double()).abs()
        bad = ~torch.isclose(got_c.double(), exp_c.double(), rtol=rtol, atol=atol, equal_nan=True)
        first = tuple(int(i) for i in bad.nonzero()[0])
        return (f"{int(bad.sum())} of {bad.numel()} elements differ (largest difference {diff.max().item():.3g}; "
                f"first at index {first}).{_diagnose_tensor(got_c, exp_c, rtol, atol)}")
    return None


def check_tensor(name: str, answer: Any, expected: torch.Tensor, *, rtol: float | None = None,
                 atol: float | None = None, hint: str = "") -> Result:
    """Check a tensor: same shape, same dtype and values within the dtype's tolerance (or the one given)."""
    got, unsolved = _call(answer)
    if unsolved is not None:
        unsolved.name = name
        return _report(unsolved)
    problem = _compare_tensors(got, expected, rtol, atol)
    if problem:
        return _report(Result(name, FAILED, _with_hint(problem, hint)))
    return _report(Result(name, PASSED))


def check_function(name: str, fn: Callable, reference: Callable, make_inputs: Callable[[torch.Generator], tuple],
                   *, trials: int = 5, seed: int = 0, rtol: float | None = None, atol: float | None = None,
                   hint: str = "", arg_names: Iterable[str] | None = None,
                   explain: Callable[..., str] | None = None) -> Result:
    """Check ``fn`` against ``reference`` on ``trials`` fresh random inputs.

    ``make_inputs(generator)`` returns the argument tuple for one trial. Outputs may be tensors or numbers.
    The failing inputs' shapes are shown so the student can reproduce the case; a wrong number is diagnosed
    (an exact factor, an off-by-one) and, with ``arg_names`` (the names of the numeric arguments, in order), so
    is the argument whose doubling moves the answer differently (:func:`scaling_diagnosis`). ``explain(got,
    expected, *args)``, when given, adds a chapter's own diagnosis of a failed trial (a sentence, or ''). Inside
    a check called with ``hidden=True`` (see :func:`exercise`) the trials come from another seed and there are
    twice as many.
    """
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, trials * HIDDEN_TRIALS
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        args = make_inputs(gen)
        got, unsolved = _call(fn, *args)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        expected = reference(*args)
        if isinstance(expected, torch.Tensor):
            problem = _compare_tensors(got, expected, rtol, atol)
        else:
            ok = isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=rtol or 1e-6, abs_tol=atol or 0.0)
            if ok:
                problem = None
            elif isinstance(got, (int, float)) and not isinstance(got, bool):
                direction = "too large" if got > expected else "too small"
                problem = (f"returned {got!r}, which is {direction}.{diagnose_number(got, expected)}"
                           + (scaling_diagnosis(fn, reference, args, arg_names) if arg_names else ""))
            else:
                problem = f"returned {got!r}, which is wrong."
        if problem:
            if explain is not None:
                try:
                    extra = explain(got, expected, *args)
                except Exception:  # noqa: BLE001 - an answer too malformed to diagnose keeps the plain message
                    extra = ""
                problem = f"{problem} {extra}".strip() if extra else problem
            shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
            return _report(Result(name, FAILED, _with_hint(f"trial {trial + 1} with inputs {shapes}: {problem}", hint)))
    return _report(Result(name, PASSED, f"agrees with the reference on {trials} random inputs."))


def check_raises(name: str, fn: Callable, exception: type[BaseException], *args: Any, hint: str = "") -> Result:
    """Check that calling ``fn(*args)`` raises ``exception`` (a student's input validation)."""
    try:
        fn(*args)
    except NotImplementedError:
        return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
    except exception:
        return _report(Result(name, PASSED))
    except Exception as err:  # noqa: BLE001 - we report which exception it was
        return _report(Result(name, FAILED, _with_hint(f"raised {type(err).__name__}, expected {exception.__name__}.", hint)))
    return _report(Result(name, FAILED, _with_hint(f"raised nothing, expected {exception.__name__}.", hint)))


# ------------------------------------------------------------------------------------ the library-call guard
def _plain(obj: Any) -> Any:
    """The Python object behind ``obj``: a Triton kernel's function (``labsrc.show._unwrap``), then what a
    ``functools.wraps`` decorator wrapped."""
    from labsrc.show import _unwrap

    try:
        for _ in range(4):
            obj = _unwrap(obj)
            inner = getattr(obj, "__wrapped__", None)
            if inner is None or inner is obj:
                break
            obj = inner
    except Exception:  # noqa: BLE001 - a notebook object whose attribute lookup fails is just not a wrapper
        pass
    return obj


def _short_name(obj: Any) -> str:
    """The name code uses for ``obj``: a function's or class's ``__name__``, a module's last dotted part."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__.rpartition(".")[2]
    return getattr(_plain(obj), "__name__", "") or ""


def _code_names(code: types.CodeType) -> set[str]:
    """Every global, attribute, imported and closure name ``code`` and the code nested in it (inner functions,
    lambdas, comprehensions) refers to."""
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names + c.co_freevars)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _runtime_calls(fn: Callable, args: tuple, codes: dict) -> set[str]:
    """Names of the functions whose code is in ``codes`` that ``fn(*args)`` calls, directly or not (a profile
    hook watches every call). Any exception of ``fn`` is left to the check proper."""
    seen: set[str] = set()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            seen.add(codes[frame.f_code])

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a stub or a wrong answer is reported by the check itself
        pass
    finally:
        sys.setprofile(previous)
    return seen


def library_use(fn: Any, forbidden: Iterable[Any], *, args: tuple | None = None) -> list[str]:
    """The sorted names of the ``forbidden`` objects (functions, Triton kernels, classes, modules) that the
    answer ``fn`` is or refers to; an empty list when the answer is the student's own work.

    The code of ``fn`` (a Triton kernel's function, what ``__wrapped__`` wraps) and of every function nested in
    it is read, not run: each global, attribute or imported name is looked up in ``fn``'s globals and closure.

    * A name bound to a forbidden object counts under the name the answer uses: an alias in the notebook
      (``f = kq.kv_bytes``) or in an enclosing function is caught.
    * A name equal to a forbidden object's own name that the globals and closure do not bind to something
      else counts too: ``kq.kv_bytes(...)``, or ``from labsrc.rope import max_angles`` inside the function.
      A student's own function that happens to share the library's name is bound to it, so it does not.
    * A forbidden object reached through a forbidden module the answer names (``kvmath.gqa_cache_bytes``)
      is reported once, by the module's name.
    * ``fn`` itself being forbidden counts.

    With ``args``, ``fn(*args)`` is also run under a profile hook, which adds the forbidden Python functions
    it calls indirectly (``rope.rope_frequencies(..., "linear")`` calls ``linear_frequencies``), which no
    reading of the answer's own code can see."""
    forbidden = [f for f in forbidden if f is not None]
    plain = {id(_plain(f)): f for f in forbidden}
    by_name = {_short_name(f): f for f in forbidden if _short_name(f)}
    for f in forbidden:                  # a module is also named by its full dotted name in an import
        if isinstance(f, types.ModuleType):
            by_name[f.__name__] = f
    target = _plain(fn)
    found: dict[str, Any] = {}           # reported name -> forbidden object
    if id(target) in plain:
        found[_short_name(plain[id(target)]) or "the answer itself"] = plain[id(target)]
    code = getattr(target, "__code__", None)
    if code is not None:
        glb = getattr(target, "__globals__", {}) or {}
        bound: dict[str, Any] = dict(glb)
        for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
            try:
                bound[name] = cell.cell_contents
            except ValueError:           # an empty cell: a closure variable not assigned yet
                pass
        for name in _code_names(code):
            if name in bound:
                obj = plain.get(id(_plain(bound[name])))
                if obj is not None:
                    found[name] = obj
            elif name in by_name:
                found[name] = by_name[name]
        modules = {id(obj) for obj in found.values() if isinstance(obj, types.ModuleType)}
        found = {name: obj for name, obj in found.items()
                 if isinstance(obj, types.ModuleType) or name in bound
                 or id(sys.modules.get(getattr(_plain(obj), "__module__", None) or "")) not in modules}
    if args is not None and callable(fn):
        codes = {getattr(_plain(f), "__code__", None): _short_name(f) for f in forbidden}
        codes.pop(None, None)
        for name in _runtime_calls(fn, args, codes):
            found.setdefault(name, None)
    return sorted(found)


def refuse_library(title: str, fn: Any, forbidden: Iterable[Any], hint: str = "", *, owner: str = "labsrc",
                   args: tuple | None = None) -> Result | None:
    """A failed, reported Result when the answer ``fn`` is or calls one of the ``forbidden`` library objects
    (see :func:`library_use`), naming what it used; None when the answer is the student's own.

    The message reads "the answer calls <owner>'s own <names>, which this exercise asks you to write", then
    the ``hint``: the point of the exercise is to write it."""
    used = library_use(fn, forbidden, args=args)
    if not used:
        return None
    return _report(Result(title, FAILED, _with_hint(
        f"the answer calls {owner}'s own {', '.join(used)}, which this exercise asks you to write.", hint)))
