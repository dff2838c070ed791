"""Check cells for exercises: compare a student's answer with the truth and say which case fails.

Every exercise in the lab is a function the student fills in. A check calls it:

* if it raises ``NotImplementedError`` (the stub in the student build), the check prints
  ``not solved yet`` and the notebook carries on;
* if its answer is right, the check prints ``passed``;
* otherwise it prints **which case fails** and the invariant the answer breaks there, and a hint.

What a failure may say (conventions, section 8; ``tests/test_exercise_adversarial.py`` holds every check to it):
the case (its number, its inputs' shapes and arguments, the element where a tensor first goes wrong) and the
invariant the answer breaks (a shape, a dtype, NaN where the truth is finite, "differs from the reference on this
case", a property a right answer has on every input). Never the expected value or the measured one, never the
answer's own number echoed next to it, never a ratio, a difference, a direction ("too large", "below") or how
the right answer scales with an argument, never the name of the bug in code the prompt handed out, never a
pointer to a paragraph that states the fix. A :class:`Result` keeps the case description apart
(``Result.case``) so a test can tell the inputs a message names from information about the answer.

With ``LAB_EXERCISES=strict`` in the environment (set when the instructor notebooks are executed by the
tests and the book build, and by the grading command) anything but ``passed`` raises :class:`ExerciseFailed`,
so a broken solution cannot slip into the book and a wrong answer loses the test cell's points.

**Hidden cases.** Every chapter check is wrapped by :func:`exercise`, which adds ``hidden=``. The test cell's
hidden section (``### BEGIN HIDDEN TESTS``, which nbgrader strips from the release notebooks and puts back when it
autogrades) calls the check again with a seed written *literally in the instructor notebook*,
``ex.check_x(answer, hidden=52817)``, or with cases written there (a list or dict, :func:`hidden_cases`), so no
``labsrc`` function a student can import holds the hidden cases: :func:`seed_for` and :func:`trials_for` turn
the seed into the hidden case set (twice the trials). ``hidden=True`` (no seed) is kept for older cells and
tests. A failure in the hidden cases *always* raises, whatever the environment, so even a plain
``nbgrader autograde`` gives an unsolved or wrong exercise no points.

**No bypass.** An answer may not call the library function it is asked to write, the checker's own code, or (for
a prediction or an experiment) the measurement the check makes. :func:`library_use` reads the answer's code
*and* watches it run (a profile hook sees every Python call, every C function, and any code of a forbidden
module or package, ``transformers`` included), so a call made through an alias, a closure, an import inside the
function, a helper, or a context manager's ``__enter__`` is caught. :data:`AUTOGRAD` lists what computes a
gradient for the student (``torch.enable_grad()`` and ``set_grad_enabled`` included); :func:`guarded` wraps an
answer so that each call the check makes runs under the guard.

A kernel exercise cannot run where Triton is not installed (macOS, Windows). Its check then prints that it was
skipped; a student carries on. But a skipped check has judged nothing, so it must not earn points: with
``LAB_EXERCISES=strict`` and in the hidden cases it raises, with a message saying to grade on Linux, and
``python -m labsrc.exercises.grade`` lists those exercises as not graded on that machine. Executing the
instructor notebooks to build the book sets ``LAB_EXERCISES=build`` instead: strict in every other way (a failed
or unsolved check raises, hidden cases included), but a kernel that cannot run here is reported as skipped, so
the book builds on a Mac too.

The kinds of exercise (prediction, derivation, debugging, experiment, kernel, transcription) and which of them
count as thinking tasks are defined once, in :mod:`labsrc.exercises.kinds`.
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
    case: str = ""
    """The part of ``message`` that names the failing case (its inputs, shapes, where a tensor first goes wrong):
    a test that looks for information about the expected answer in a message leaves it out."""

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


# The ``hidden=`` value of the check running now (see :func:`exercise`): False, True, a seed or cases.
_HIDDEN = contextvars.ContextVar("lab_hidden_cases", default=False)
# ``hidden=True`` (no seed from the notebook) draws from a generator seeded this far from the visible one.
# Every trial count is HIDDEN_TRIALS times the visible one in the hidden cases.
HIDDEN_SEED_OFFSET, HIDDEN_TRIALS = 1000, 2


def hidden() -> bool:
    """True inside a check called with ``hidden=...`` (anything but False): a chapter check may add cases then."""
    value = _HIDDEN.get()
    return value is not False and value is not None


def seed_for(visible: int) -> int:
    """The seed a check draws its cases from: ``visible`` for the visible cases; in the hidden cases the seed the
    notebook's hidden section passed (``hidden=52817``), mixed with ``visible`` so that two case sets of one
    check differ; ``visible + HIDDEN_SEED_OFFSET`` for a plain ``hidden=True``."""
    value = _HIDDEN.get()
    if value is False or value is None:
        return visible
    if value is True or not isinstance(value, int):
        return visible + HIDDEN_SEED_OFFSET
    return (int(value) * 7919 + visible) % (2 ** 31 - 1)


def trials_for(visible: int) -> int:
    """How many trials a check runs: ``visible``, or ``HIDDEN_TRIALS`` times as many in the hidden cases."""
    return visible * HIDDEN_TRIALS if hidden() else visible


def hidden_cases() -> Any:
    """The cases the notebook's hidden section wrote out for this check (``hidden=[...]`` or ``hidden={...}``),
    or None: a prediction's hidden settings live there, not in the package."""
    value = _HIDDEN.get()
    return value if isinstance(value, (list, tuple, dict)) else None


def exercise(check: Callable[..., Result]) -> Callable[..., Result]:
    """Give a chapter check a ``hidden`` keyword (default False).

    ``check(answer, hidden=<seed or cases>)`` runs the hidden case set (:func:`seed_for`, :func:`trials_for`,
    :func:`hidden_cases`) and raises :class:`ExerciseFailed` on anything but *passed*, in any environment:
    hidden calls only exist in the instructor's notebooks and in the copies nbgrader autogrades.
    """
    @functools.wraps(check)
    def wrapped(answer: Any, *args: Any, hidden: Any = False, **kwargs: Any) -> Result:
        if hidden is False or hidden is None:
            return check(answer, *args, **kwargs)
        token = _HIDDEN.set(hidden)
        try:
            return check(answer, *args, **kwargs)
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


def fail(name: str, case: str, invariant: str, hint: str = "") -> Result:
    """Report a failure: ``case`` names the input on which the answer fails (trial number, shapes, arguments,
    the element), ``invariant`` what a right answer has there and this one has not, in words that carry nothing
    about the expected value (no number computed from it, no direction, no ratio)."""
    message = f"{case}: {invariant}" if case else invariant
    return _report(Result(name, FAILED, _with_hint(message, hint), case=case))


def _number(got: Any) -> Any:
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        return got.item()
    if isinstance(got, (np.ndarray, np.generic)) and np.size(got) == 1:
        return got.item()
    return got


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


WRONG_VALUE = "the answer is not the right value for these inputs"
"""What a check says of a wrong number: that it is wrong on the case named, nothing about where the right one is."""


def check_value(name: str, answer: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 0.0,
                hint: str = "", case: str = "") -> Result:
    """Check a number (or any value compared with ``==``).

    ``answer`` is the student's function (called with no arguments) or the value itself. Numbers are
    compared with ``rtol``/``atol``; a wrong one is reported as wrong on ``case``, with no direction, ratio or
    value.
    """
    got, unsolved = _call(answer)
    if unsolved is not None:
        unsolved.name = name
        return _report(unsolved)
    if _is_number(expected):
        got = _number(got)
        if not _is_number(got):
            return fail(name, case, f"expected a number, got {type(got).__name__}.", hint)
        if not (math.isfinite(got) and math.isclose(got, expected, rel_tol=rtol, abs_tol=atol)):
            return fail(name, case, f"{WRONG_VALUE}.", hint)
        return _report(Result(name, PASSED))
    if got != expected:
        return fail(name, case, "the answer is not the expected one.", hint)
    return _report(Result(name, PASSED))


def diagnose_number(got: float, expected: float) -> str:
    """Deprecated: says nothing. It used to name the exact factor between a wrong number and the right one, which
    let a few constant answers rebuild the formula; a check now names the failing case instead. Kept (returning
    '') only so that a module not yet rewritten still imports."""
    return ""


def _compare_tensors(got: Any, expected: torch.Tensor, rtol: float | None, atol: float | None
                     ) -> tuple[str, str] | None:
    """``(where, what)`` is wrong with ``got`` against ``expected`` (``where``: the first element that differs,
    or ''), or None when they agree. It names the broken invariant (shape, dtype, NaN, differs from the
    reference) and the first element where it breaks, never by how much or in which direction."""
    if not isinstance(got, torch.Tensor):
        return "", f"expected a tensor, got {type(got).__name__}."
    if got.shape != expected.shape:
        return "", f"the answer has shape {tuple(got.shape)}; this case needs {tuple(expected.shape)}."
    if got.dtype != expected.dtype:
        return "", f"the answer has dtype {got.dtype}; this case needs {expected.dtype}."
    default_rtol, default_atol = tolerance(expected.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    got_c, exp_c = got.detach().cpu().double(), expected.detach().cpu().double()
    bad = ~torch.isclose(got_c, exp_c, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    first = tuple(int(i) for i in bad.nonzero()[0])
    where = f"first at element {first}" if first else "the one element"
    if torch.isnan(got_c[first]) and not torch.isnan(exp_c[first]):
        return where, "the answer is NaN there, the reference is finite."
    if not torch.isfinite(got_c[first]) and torch.isfinite(exp_c[first]):
        return where, "the answer is infinite there, the reference is finite."
    return where, "the answer differs from the reference there."


def check_tensor(name: str, answer: Any, expected: torch.Tensor, *, rtol: float | None = None,
                 atol: float | None = None, hint: str = "", case: str = "") -> Result:
    """Check a tensor: same shape, same dtype and values within the dtype's tolerance (or the one given)."""
    got, unsolved = _call(answer)
    if unsolved is not None:
        unsolved.name = name
        return _report(unsolved)
    problem = _compare_tensors(got, expected, rtol, atol)
    if problem:
        where, what = problem
        return fail(name, ", ".join(p for p in (case, where) if p), what, hint)
    return _report(Result(name, PASSED))


def describe_args(args: tuple) -> str:
    """The arguments of a case as a student can rebuild it: a tensor by its shape and dtype, a number or a short
    value as itself."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"tensor{tuple(a.shape)}" + ("" if a.dtype == torch.float32 else f" {a.dtype}".replace("torch.", ""))
        if isinstance(a, (list, tuple)) and len(a) > 8:
            return f"{type(a).__name__} of {len(a)}"
        if isinstance(a, float):
            return f"{a:.6g}"
        return repr(a) if len(repr(a)) <= 60 else type(a).__name__
    return "(" + ", ".join(one(a) for a in args) + ")"


def check_function(name: str, fn: Callable, reference: Callable, make_inputs: Callable[[torch.Generator], tuple],
                   *, trials: int = 5, seed: int = 0, rtol: float | None = None, atol: float | None = None,
                   hint: str = "", arg_names: Iterable[str] | None = None,
                   explain: Callable[..., str] | None = None, forbidden: Iterable[Any] = (),
                   allowed: Iterable[Any] = (), owner: str = "labsrc") -> Result:
    """Check ``fn`` against ``reference`` on ``trials`` fresh random inputs.

    ``make_inputs(generator)`` returns the argument tuple for one trial. Outputs may be tensors or numbers. A
    failure names the trial and its inputs (shapes and arguments, so the student can rebuild the case) and the
    invariant broken there, nothing more. ``explain`` and ``arg_names`` are accepted for older callers and unused:
    a chapter's diagnosis of the slip (an exact factor, the doubled argument, the wrong one of two terms) named
    the bug or said where the answer lies. In the hidden cases (:func:`exercise`) the trials come from the notebook's seed and there
    are twice as many. With ``forbidden``, every call of ``fn`` runs under :func:`guarded` (``allowed``: helpers
    the exercise hands out).
    """
    seed, trials = seed_for(seed), trials_for(trials)
    forbidden = tuple(forbidden)
    if forbidden:
        fn = guarded(fn, forbidden, allowed=allowed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        args = make_inputs(gen)
        try:
            got, unsolved = _call(fn, *args)
        except Refused as refused:
            return refusal(name, refused.names, hint, owner=owner)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        expected = reference(*args)
        case = f"trial {trial + 1} of {trials}, inputs {describe_args(args)}"
        if isinstance(expected, torch.Tensor):
            problem = _compare_tensors(got, expected, rtol, atol)
        else:
            got = _number(got)
            if _is_number(got) and math.isfinite(got) and math.isclose(
                    got, expected, rel_tol=rtol or 1e-6, abs_tol=atol or 0.0):
                problem = None
            elif _is_number(got):
                problem = "", f"{WRONG_VALUE}."
            else:
                problem = "", f"expected a number, got {type(got).__name__}."
        if problem:
            where, what = problem
            return fail(name, ", ".join(p for p in (case, where) if p), what, hint)
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


_SELF_DEFEATING = (sys.setprofile, sys.settrace)
"""C functions that would switch the guard's profile hook off: calling one inside an answer counts as a refused
call (the hook sees the call before it takes effect)."""


_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_EXERCISES = __name__.rpartition(".")[0]
"""The checkers' package (its folder and name): the guard refuses an answer that calls into it, but not the
checkers' own wrappers around the answer (:func:`as_number`, a chapter's conversions), which the guard sees
too."""


class _Watch:
    """What the runtime guard looks for while an answer runs: the code objects of forbidden Python functions and
    of the methods of forbidden classes (``__enter__`` of a context manager), forbidden C functions and methods,
    and the source files of forbidden modules and packages. ``allowed``: helpers the exercise hands out, whose
    own calls into a forbidden module do not count."""

    _METHODS = ("__init__", "__new__", "__enter__", "__exit__", "__call__")

    def __init__(self, forbidden: Iterable[Any], allowed: Iterable[Any] = ()):
        self.codes: dict[types.CodeType, str] = {}
        self.builtins: dict[int, str] = {id(f): f"sys.{f.__name__}" for f in _SELF_DEFEATING}
        self.methods: list[tuple[type, str, str]] = []     # (class, method name, reported name)
        prefixes: list[str] = []
        self.prefix_names: dict[str, str] = {}
        for f in forbidden:
            if f is None:
                continue
            name = _short_name(f) or repr(f)
            if isinstance(f, types.ModuleType):
                path = getattr(f, "__file__", None)
                if path:
                    prefix = (os.path.dirname(os.path.abspath(path)) + os.sep
                              if hasattr(f, "__path__") else os.path.abspath(path))
                    prefixes.append(prefix)
                    self.prefix_names[prefix] = f.__name__
                continue
            if isinstance(f, type):
                for attr in self._METHODS:
                    code = getattr(_plain(f.__dict__.get(attr)), "__code__", None)
                    if code is not None:
                        self.codes[code] = name
                continue
            code = getattr(_plain(f), "__code__", None)
            if code is not None:
                self.codes[code] = name
            elif isinstance(f, (types.BuiltinFunctionType, types.BuiltinMethodType)):
                self.builtins[id(f)] = name
            elif hasattr(f, "__objclass__"):                  # a C method: torch.Tensor.softmax
                self.methods.append((f.__objclass__, f.__name__, f"{f.__objclass__.__name__}.{f.__name__}"))
        self.prefixes = tuple(prefixes)
        self.allowed = {getattr(_plain(a), "__code__", None) for a in allowed} - {None}

    def _allowed_above(self, frame) -> bool:
        for _ in range(64):
            frame = frame.f_back
            if frame is None:
                return False
            if frame.f_code in self.allowed:
                return True
        return False

    def run(self, fn: Callable, args: tuple, kwargs: dict | None = None, seen: set[str] | None = None
            ) -> tuple[Any, set[str]]:
        """``(fn(*args), names of the forbidden things it called)``, the names also added to ``seen``; an
        exception of ``fn`` propagates, after the hook is off (``seen`` then holds what it called before)."""
        seen = set() if seen is None else seen
        codes, builtins, methods, prefixes = self.codes, self.builtins, self.methods, self.prefixes
        own = _Watch.run.__code__

        def hook(frame, event, arg):
            if event == "call":
                code = frame.f_code
                if code in codes:
                    seen.add(codes[code])
                elif (prefixes and code.co_filename.startswith(prefixes) and code not in self.allowed
                      and not self._allowed_above(frame)):
                    name = next(n for p, n in self.prefix_names.items() if code.co_filename.startswith(p))
                    caller = frame.f_back
                    # the checkers' own wrappers (core's, a chapter's) run inside the guard around the answer:
                    # checker code counts only when code outside the checkers (the answer) calls it
                    if name != _EXERCISES or not (caller is None or caller.f_code.co_filename.startswith(_HERE)):
                        seen.add(name)
            elif event == "c_call":
                if frame.f_code is own:                     # the guard switching its own hook off
                    return
                if id(arg) in builtins:
                    seen.add(builtins[id(arg)])
                elif methods:
                    owner = getattr(arg, "__self__", None)
                    for cls, method, name in methods:
                        if getattr(arg, "__name__", None) == method and isinstance(owner, cls):
                            seen.add(name)

        previous = sys.getprofile()
        sys.setprofile(hook)
        try:
            out = fn(*args, **(kwargs or {}))
        finally:
            sys.setprofile(previous)
        return out, seen


def _runtime_calls(fn: Callable, args: tuple, forbidden: Iterable[Any], allowed: Iterable[Any] = ()) -> set[str]:
    """Names of the ``forbidden`` things that ``fn(*args)`` calls, directly or not (see :class:`_Watch`). Any
    exception of ``fn`` is left to the check proper."""
    seen: set[str] = set()
    try:
        _Watch(forbidden, allowed).run(fn, args, seen=seen)
    except Exception:  # noqa: BLE001 - a stub or a wrong answer is reported by the check itself
        pass
    return seen


class Refused(Exception):
    """Raised by a :func:`guarded` answer that called something the exercise forbids; ``names`` says what."""

    def __init__(self, names: Iterable[str]):
        self.names = sorted(set(names))
        super().__init__(", ".join(self.names))


def _exercise_package() -> types.ModuleType:
    return sys.modules[__name__.rpartition(".")[0]]


def guarded(fn: Callable, forbidden: Iterable[Any], *, allowed: Iterable[Any] = ()) -> Callable:
    """``fn`` wrapped so that each call runs under the runtime guard: when the call used one of ``forbidden``
    (or any code of ``labsrc.exercises``, the checkers themselves, or switched the guard off) it raises
    :class:`Refused` after the call returns, so no answer it computed reaches the comparison. A
    ``NotImplementedError`` (the stub) passes through as it is. ``allowed`` names helpers the exercise hands
    out (their own calls do not count)."""
    watch = _Watch((*forbidden, _exercise_package()), allowed)
    static = [f for f in forbidden if f is not None]

    @functools.wraps(fn)
    def run(*args, **kwargs):
        used = library_use(fn, static)
        seen: set[str] = set()
        try:
            out, _ = watch.run(fn, args, kwargs, seen=seen)
        except NotImplementedError:
            raise
        except Exception:
            if used or seen:
                raise Refused([*used, *seen]) from None
            raise
        if used or seen:
            raise Refused([*used, *seen])
        return out
    return run


def refusal(name: str, used: Iterable[str], hint: str = "", *, owner: str = "labsrc") -> Result:
    """The reported failure of an answer that used ``used`` (from :class:`Refused` or :func:`library_use`)."""
    return _report(Result(name, FAILED, _with_hint(
        f"the answer calls {owner}'s own {', '.join(sorted(used))}, which this exercise does not allow (it asks "
        f"you to work it out yourself).", hint)))


def _autograd() -> tuple:
    import torch.autograd.functional as functional
    found = [torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward, torch.enable_grad,
             torch.set_grad_enabled, torch.inference_mode, torch._C._set_grad_enabled, functional,
             torch.Tensor.requires_grad_]
    try:
        import torch._functorch as functorch       # torch.func.grad, vjp, jacrev ...
        found.append(functorch)
    except ImportError:  # pragma: no cover - an older torch
        pass
    return tuple(found)


AUTOGRAD = _autograd()
"""What computes a gradient for an answer, or turns on the recording that would: ``torch.autograd.grad`` and
``backward``, ``torch.func``/functorch, ``torch.autograd.functional``, and the context managers and switches
that re-enable gradients inside a ``no_grad`` check (``enable_grad``, ``set_grad_enabled``, ``inference_mode``,
``torch._C._set_grad_enabled``, ``requires_grad_``). Pass it (with the rest) as ``forbidden`` where an exercise
asks for a gradient by hand."""


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

    With ``args``, ``fn(*args)`` is also run under a profile hook (:class:`_Watch`), which adds the forbidden
    things it calls indirectly (``rope.rope_frequencies(..., "linear")`` calls ``linear_frequencies``), inside a
    context manager, through a C function, or anywhere in a forbidden module or package (``transformers``),
    which no reading of the answer's own code can see."""
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
        for name in _runtime_calls(fn, args, forbidden):
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
