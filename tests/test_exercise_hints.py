"""No exercise check's message gives the answer away.

A check prints a hint on every failed attempt, so a student who submits a few wrong answers reads every hint. The
conventions ask that a hint name what is wrong in the answer (the failing case, the shape, the invariant, the
section to re-read), never the expected code or formula. This test makes that mechanical: for every graded
exercise of the 15 chapters it gathers

* the messages its checker module can print: every string literal of the module and of
  :mod:`labsrc.exercises.core` (f-strings by their fixed parts; docstrings, which state the task, left out),
  plus what the check actually prints when it is handed each of a few wrong answers (``WRONG_ANSWERS``: zero,
  one, a negative number, a huge one, None, the first argument handed back, zeros shaped like it);
* the solution: the code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in the chapter's instructor
  notebook, the checker module's own reference functions (named ``*_ref*``), and the source of the ``labsrc``
  functions the check refuses to let the answer call (the library code the student is asked to write),

tokenizes both into identifiers, numbers and operators, and fails when a message shares with the solution a run
of more than ``MAX_RUN`` tokens, or of ``MAX_RUN_WITH_OPERATOR`` or more tokens one of which is an arithmetic
operator or ``=`` (``2 ** bits -`` is a piece of a formula; ``(T, d, dv)`` is the names of the arguments). A
second test fails on any message that writes a formula of its own: a few tokens holding several arithmetic
operators. Both also count the exercises they found against the notebooks' graded cells, so a new exercise
cannot slip past them.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import json
import re
import tokenize
import types
from pathlib import Path

import pytest

import labsrc  # noqa: F401  (sets the Triton interpreter up before any kernel module is imported)
from labsrc.exercises import core

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))

MAX_RUN = 5
"""The longest run of consecutive solution tokens a message may share with the solution. Six tokens are about
one clause of code (``exp(m_old - m_new)`` is seven); shorter shared runs are the names of the exercise's own
arguments and shapes, ``(B, N, V)``, which a hint has to use to say what is wrong."""

MAX_RUN_WITH_OPERATOR = 4
"""A shared run this long that holds an arithmetic operator or an assignment is a piece of the formula
(``S = exp(g)``, ``ceil(num_tokens / block_size)``, ``2 ** bits - 1``) and fails too."""

_ARITHMETIC = {"+", "-", "*", "/", "**", "//", "%", "@", "="}

FORMULA_WINDOW, FORMULA_OPERATORS = 7, 3
"""A message writes a formula when some ``FORMULA_WINDOW`` consecutive tokens of it hold ``FORMULA_OPERATORS``
or more arithmetic operators (``x1*cos - x2*sin``, ``g * memory + (1 - g) * local``). Prose has none; a
diagnosis such as "1/25 times the right value" has one."""

# Module prefixes are dropped before comparing, so a hint that writes ``exp(x)`` for the solution's
# ``torch.exp(x)`` or ``tl.exp(x)`` still matches it.
_PREFIXES = {"torch", "tl", "math", "np", "numpy", "triton", "F", "self"}
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\*\*|//|<=|>=|==|!=|->|<<|>>|"
                    r"[-+*/%<>=()\[\]{},.:@^~&|]")


def tokens(text: str) -> list[str]:
    """Identifiers, numbers and operators of ``text``, with module prefixes such as ``torch.`` dropped."""
    raw = _TOKEN.findall(text)
    out: list[str] = []
    i = 0
    while i < len(raw):
        if raw[i] in _PREFIXES and i + 1 < len(raw) and raw[i + 1] == ".":
            i += 2
            continue
        out.append(raw[i])
        i += 1
    return out


def code_tokens(source: str) -> list[str]:
    """The tokens of Python ``source`` without its comments and string literals (prose, not code)."""
    kept = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type >= tokenize.N_TOKENS:
                continue
            kept.append(tok.string)
    except (tokenize.TokenError, IndentationError):
        kept = [source]
    return tokens(" ".join(kept))


def ngrams(seq: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}


# ------------------------------------------------------------------------------------ the exercises and solutions
def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _solution_code(cell_source: str) -> str:
    return "\n".join(re.findall(r"### BEGIN SOLUTION\n(.*?)\n\s*### END SOLUTION", cell_source, re.S))


def exercises() -> list[dict]:
    """One entry per graded cell of every chapter: the chapter, the grade id, the checker module, the checks the
    cell calls and the solution code of the solution cell(s) above it (since the previous graded cell)."""
    found = []
    for path in CHAPTERS:
        nb = json.loads(path.read_text())
        module = None
        solution = []
        for cell in nb["cells"]:
            src = _source(cell)
            m = re.search(r"(?:from labsrc\.exercises import |import labsrc\.exercises\.)(\w+) as ex\b", src)
            if m:
                module = m.group(1)
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if meta.get("solution"):
                solution.append(_solution_code(src))
            if meta.get("grade"):
                checks = sorted(set(re.findall(r"\bex\.(check_\w+)\(", src)))
                found.append(dict(chapter=path.stem, grade_id=meta["grade_id"], module=module, checks=checks,
                                  solution="\n".join(solution)))
                solution = []
    return found


EXERCISES = exercises()


def test_every_graded_cell_is_an_exercise_found_here():
    graded = 0
    for path in CHAPTERS:
        nb = json.loads(path.read_text())
        graded += sum(bool(c.get("metadata", {}).get("nbgrader", {}).get("grade")) for c in nb["cells"])
    assert len(CHAPTERS) == 15
    assert len(EXERCISES) == graded
    for ex in EXERCISES:
        assert ex["module"], f"{ex['chapter']} {ex['grade_id']}: no `from labsrc.exercises import ... as ex` above"
        assert ex["checks"], f"{ex['chapter']} {ex['grade_id']}: the graded cell calls no ex.check_*"
        assert ex["solution"].strip(), f"{ex['chapter']} {ex['grade_id']}: no solution code above the check"
        mod = importlib.import_module(f"labsrc.exercises.{ex['module']}")
        for name in ex["checks"]:
            assert callable(getattr(mod, name, None)), f"{ex['module']}.{name} is not a check"


# ------------------------------------------------------------------------------------------- the messages
def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                ids.add(id(first.value))
        # An attribute docstring: a bare string right after an assignment documents it, and is no message.
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for before, after in zip(body, body[1:]):
                if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr) and \
                        isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    ids.add(id(after.value))
    return ids


def static_messages(module: types.ModuleType) -> list[str]:
    """Every string literal of ``module``'s source but its docstrings: f-strings by their fixed text, and the
    adjacent literals of one expression joined (a hint is often split over lines)."""
    tree = ast.parse(inspect.getsource(module))
    docs = _docstring_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append(" ".join(v.value for v in node.values if isinstance(v, ast.Constant)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.append(node.value)
    return [s for s in out if len(tokens(s)) > MAX_RUN]


def _returns_zero(*args, **kwargs):
    return 0


def _first_tensor(args):
    import torch
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _zeros_like_first(*args, **kwargs):
    import torch
    first = _first_tensor(args)
    return 0 if first is None else torch.zeros_like(first)


WRONG_ANSWERS = (_returns_zero, lambda *a, **k: 1, lambda *a, **k: -1.5, lambda *a, **k: 1e6,
                 lambda *a, **k: None, lambda *a, **k: a[0] if a else 0, _zeros_like_first)
"""The wrong answers whose printed messages are read: a student trying constants and shapes sees all of these."""


def printed_messages(check, answers=WRONG_ANSWERS) -> tuple[str, list]:
    """What ``check`` prints for each of ``answers``, and the library objects it refuses the answer."""
    refused: list = []
    original = core.library_use

    def spy(fn, forbidden, **kw):
        forbidden = list(forbidden)
        refused.extend(forbidden)
        return original(fn, forbidden, **kw)

    out = io.StringIO()
    core.library_use = spy
    try:
        with contextlib.redirect_stdout(out):
            for answer in answers:
                try:
                    check(answer)
                except Exception as err:  # noqa: BLE001 - strict mode, or a check that raises: its text counts
                    print(err)
    finally:
        core.library_use = original
    return out.getvalue(), refused


# ------------------------------------------------------------------------------------- the reference code
def _own_source(obj) -> str:
    """The source of a ``labsrc`` function (a Triton kernel's Python function included), or ''."""
    from labsrc.show import _unwrap

    try:
        obj = _unwrap(obj)
    except Exception:  # noqa: BLE001
        pass
    obj = getattr(obj, "__func__", obj)
    if not (inspect.isfunction(obj) and (getattr(obj, "__module__", "") or "").startswith("labsrc")):
        return ""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def reference_code(module: types.ModuleType, refused: list) -> str:
    """The checker module's reference functions (``*_ref*``) and the labsrc functions its checks refuse."""
    parts = [inspect.getsource(obj) for name, obj in vars(module).items()
             if inspect.isfunction(obj) and obj.__module__ == module.__name__ and "_ref" in name]
    parts += [_own_source(obj) for obj in refused]
    return "\n".join(p for p in parts if p)


def _shared_run(message: list[str], solution: set[tuple[str, ...]], short: set[tuple[str, ...]] = frozenset()
                ) -> str | None:
    """The first run of ``message`` that is in ``solution`` (runs of ``MAX_RUN + 1`` tokens) or, holding an
    arithmetic operator, in ``short`` (runs of ``MAX_RUN_WITH_OPERATOR`` tokens); None when there is none."""
    for i in range(len(message)):
        run = tuple(message[i:i + MAX_RUN + 1])
        if len(run) == MAX_RUN + 1 and run in solution:
            return " ".join(run)
        run = tuple(message[i:i + MAX_RUN_WITH_OPERATOR])
        if len(run) == MAX_RUN_WITH_OPERATOR and run in short and _ARITHMETIC & set(run):
            return " ".join(run)
    return None


def _prose(text: str) -> str:
    """``text`` with the hyphens of compound words (re-read, top-k, Mixture-of-Depths) dropped: not minus signs."""
    return re.sub(r"(?<=[A-Za-z])-(?=[A-Za-z])", "_", text)


def formula_in(message: str) -> str | None:
    """The first ``FORMULA_WINDOW`` tokens of ``message`` that hold ``FORMULA_OPERATORS`` arithmetic operators."""
    toks = tokens(_prose(message))
    for i in range(max(0, len(toks) - FORMULA_WINDOW + 1)):
        window = toks[i:i + FORMULA_WINDOW]
        if sum(t in _ARITHMETIC - {"="} for t in window) >= FORMULA_OPERATORS:
            return " ".join(window)
    return None


@pytest.fixture(scope="module")
def lenient_env():
    mp = pytest.MonkeyPatch()
    mp.delenv("LAB_EXERCISES", raising=False)
    yield
    mp.undo()


def messages_and_refused(ex: dict) -> tuple[list[str], list]:
    """Every message the exercise's checks can print (static, and printed for ``WRONG_ANSWERS``; a chapter not yet
    reworked to the third round's rules, without a file in tests/adversaries/, for ``return 0`` only), and the
    library objects they refuse."""
    module = importlib.import_module(f"labsrc.exercises.{ex['module']}")
    messages = static_messages(module) + static_messages(core)
    refused: list = []
    answers = WRONG_ANSWERS if ex["chapter"][:2] in _adversarial_chapters() else (_returns_zero,)
    for name in ex["checks"]:
        printed, used = printed_messages(getattr(module, name), answers)
        messages.append(printed)
        refused += used
    return messages, refused


_IDS = [f"{e['chapter'][:2]}-{e['grade_id']}" for e in EXERCISES]


@pytest.mark.parametrize("ex", EXERCISES, ids=_IDS)
def test_no_message_repeats_the_solution(ex, lenient_env):
    module = importlib.import_module(f"labsrc.exercises.{ex['module']}")
    messages, refused = messages_and_refused(ex)
    solutions = {"the solution cell": code_tokens(ex["solution"]),
                 "the reference code": code_tokens(reference_code(module, refused))}
    for where, toks in solutions.items():
        grams, short = ngrams(toks, MAX_RUN + 1), ngrams(toks, MAX_RUN_WITH_OPERATOR)
        for message in messages:
            run = _shared_run(tokens(message), grams, short)
            assert run is None, (f"{ex['module']} ({', '.join(ex['checks'])}): a message repeats {where}'s "
                                 f"tokens `{run}`:\n  {message[:300]}")


@pytest.mark.parametrize("ex", EXERCISES, ids=_IDS)
def test_no_message_writes_a_formula(ex, lenient_env):
    messages, _ = messages_and_refused(ex)
    for message in messages:
        found = formula_in(message)
        assert found is None, (f"{ex['module']} ({', '.join(ex['checks'])}): a message writes a formula "
                               f"`{found}`:\n  {message[:300]}")


def _headings(path: Path) -> set[str]:
    nb = json.loads(path.read_text())
    found = set()
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            found.update(_rendered(m) for m in re.findall(r"^#+ (.*)$", _source(cell), re.M))
    return found


def _rendered(heading: str) -> str:
    """A heading as the reader sees it: no math dollars, a squared exponent as the ² a hint can print."""
    return heading.replace("^2", "²").replace("$", "").strip()


@pytest.mark.parametrize("module", sorted({e["module"] for e in EXERCISES}))
def test_every_section_a_hint_sends_the_student_to_is_in_the_chapter(module):
    """A hint that says "re-read 'X'" names a heading of the chapter whose exercises the module checks, so a
    renamed section cannot leave the student looking for a page that is not there."""
    chapters = {e["chapter"] for e in EXERCISES if e["module"] == module}
    headings = set().union(*(_headings(ROOT / "chapters" / f"{c}.ipynb") for c in chapters))
    mod = importlib.import_module(f"labsrc.exercises.{module}")
    named = set()
    for message in static_messages(mod):
        quoted = r"'((?:[^']|'s\b)+)'"      # a quoted heading, whose own apostrophes are possessives
        named.update(re.findall(r"re-read [^'\n]*?" + quoted, message))
        named.update(re.findall(r" and " + quoted, message))
    assert named, f"{module}: no hint sends the student to a section"
    missing = sorted(n for n in named if n not in headings)
    assert not missing, f"{module}: hints name sections that {sorted(chapters)} lacks: {missing}"


def test_the_guard_catches_a_hint_that_is_the_solution():
    """The comparison itself: a hint that writes out the solution's update, even with other module prefixes and
    spacing, is caught; one that names the failing case is not."""
    solution = code_tokens("m_new = torch.maximum(m_old, s.max(-1).values)\n"
                           "acc = acc * torch.exp(m_old - m_new)[:, None] + p @ v\n")
    grams = ngrams(solution, MAX_RUN + 1)
    assert _shared_run(tokens("Hint: rescale by tl.exp(m_old - m_new)[:, None] first."), grams)
    assert _shared_run(tokens("Hint: acc = acc*exp(m_old-m_new)[:,None] + p@v"), grams)
    assert _shared_run(tokens("Hint: row 3 of the block differs from the running max (m_old, m_new); re-read "
                              "'The online softmax'."), grams) is None
    # a short piece of the formula is caught when it holds an operator; the argument names alone are not
    short = ngrams(solution, MAX_RUN_WITH_OPERATOR)
    assert _shared_run(tokens("Hint: acc * exp(m_old ..."), grams, short)
    assert _shared_run(tokens("Hint: look at (m_old, s) ..."), grams, short) is None


def test_the_formula_guard_catches_pseudo_code_and_spares_prose():
    assert formula_in("Hint: the first half gets x1*cos - x2*sin and the second x2*cos + x1*sin.")
    assert formula_in("then g * memory + (1 - g) * local with g = sigmoid(gate[h]).")
    assert formula_in("Hint: re-read 'Mixture-of-Depths: only some tokens' and the top-k rule; it is exactly "
                      "1/25 times the right value, off by -1.") is None


# ------------------------------------------------------------------------------ no message points the way
_DIRECTION = re.compile(r"\b(too (high|low|large|small|big|many|few|much|little)|larger|smaller|higher|lower|greater|"
                        r"fewer|above|below|overestimat\w*|underestimat\w*|exceed\w*|more than|less than|off by|"
                        r"times the right|doubling)\b", re.I)


def _adversarial_chapters() -> set[str]:
    """Chapters whose exercises have been reworked to the third round's rules (a file in tests/adversaries/)."""
    return {p.stem[2:] for p in (ROOT / "tests" / "adversaries").glob("ch[0-9][0-9].py")}


@pytest.mark.parametrize("ex", EXERCISES, ids=_IDS)
def test_no_message_points_the_way(ex, lenient_env):
    """No string a check can print, and nothing it prints for the wrong answers above, says which way the right
    answer lies ("too large", "below") or how it scales ("doubling ..."), for the chapters reworked so far."""
    if ex["chapter"][:2] not in _adversarial_chapters():
        pytest.skip(f"{ex['chapter']} has no tests/adversaries file yet")
    module = importlib.import_module(f"labsrc.exercises.{ex['module']}")
    messages = static_messages(module) + static_messages(core)
    for name in ex["checks"]:
        messages.append(printed_messages(getattr(module, name))[0])
    for message in messages:
        found = _DIRECTION.search(message.replace("Fill in the function above", "").replace(
            "Fill in the kernel above", ""))
        assert found is None, f"{ex['module']}: a message says {found.group(0)!r}:\n  {message[:300]}"
