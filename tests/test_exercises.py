from pathlib import Path

import pytest
import torch

from labsrc import exercises as ex
from labsrc.exercises import student


def unsolved(*args):
    raise NotImplementedError("not solved yet")


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


def test_check_value_passes_fails_and_reports_unsolved(capsys):
    assert ex.check_value("answer", lambda: 42, 42).passed
    wrong = ex.check_value("answer", lambda: 41.0, 42, hint="count both K and V")
    assert wrong.status == "failed" and "count both K and V" in wrong.message
    assert "42" not in wrong.message and "41" not in wrong.message, "no value, expected or given, is printed"
    assert "small" not in wrong.message and "large" not in wrong.message, "nor a direction"
    assert ex.check_value("answer", unsolved, 42).status == "not solved yet"
    assert "not solved yet" in capsys.readouterr().out
    assert ex.check_value("answer", lambda: "x", 42).status == "failed"
    assert ex.check_value("answer", lambda: (1, 2), (1, 2)).passed


def test_check_tensor_uses_dtype_tolerance_and_names_the_problem():
    ref = torch.linspace(0, 1, 10)
    assert ex.check_tensor("t", lambda: ref * (1 + 1e-7), ref).passed
    off = ex.check_tensor("t", lambda: ref + 1e-3, ref)
    assert "differs" in off.message and "(0,)" in off.case, "the first element that differs is named"
    assert "shape" in ex.check_tensor("t", lambda: ref[:5], ref).message
    assert "dtype" in ex.check_tensor("t", lambda: ref.half(), ref).message
    poisoned = ref.clone()
    poisoned[3] = float("nan")
    assert "NaN" in ex.check_tensor("t", lambda: poisoned, ref).message
    half = ref.half()
    assert ex.check_tensor("t", lambda: half * (1 + 5e-4), half).passed


def test_check_function_tries_random_inputs():
    def make(gen):
        return (torch.randn(int(torch.randint(1, 9, (1,), generator=gen)), generator=gen),)
    assert ex.check_function("softmax", lambda x: torch.softmax(x, 0), lambda x: torch.softmax(x, 0), make).passed
    bad = ex.check_function("softmax", lambda x: torch.exp(x) / 2, lambda x: torch.softmax(x, 0), make)
    assert bad.status == "failed" and "trial 1" in bad.message
    assert ex.check_function("softmax", unsolved, lambda x: x, make).status == "not solved yet"


def test_check_raises():
    def validates(n):
        if n <= 0:
            raise ValueError("n must be positive")
    assert ex.check_raises("v", validates, ValueError, 0).passed
    assert ex.check_raises("v", validates, ValueError, 1).status == "failed"
    assert ex.check_raises("v", unsolved, ValueError, 0).status == "not solved yet"


def test_strict_mode_raises_on_anything_but_passed(monkeypatch):
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    assert ex.check_value("a", lambda: 1, 1).passed
    with pytest.raises(ex.ExerciseFailed):
        ex.check_value("a", lambda: 2, 1)
    with pytest.raises(ex.ExerciseFailed):
        ex.check_value("a", unsolved, 1)


def test_build_mode_is_strict_for_every_check(monkeypatch):
    """The book build (LAB_EXERCISES=build) checks the instructor's solutions as strictly as grading does."""
    monkeypatch.setenv("LAB_EXERCISES", "build")
    assert ex.strict() and ex.check_value("a", lambda: 1, 1).passed
    for answer in (lambda: 2, unsolved):
        with pytest.raises(ex.ExerciseFailed):
            ex.check_value("a", answer, 1)


def test_every_kernel_check_reports_a_missing_triton_through_the_shared_rule():
    """A kernel check that tested Triton on its own could let a skip pass when grading: each chapter module that
    mentions Triton reports its absence through core.triton_missing (or skipped_without_triton),
    whose contract tests/exercise_contract.py checks for every kernel exercise."""
    from labsrc.exercises import core

    folder = Path(core.__file__).parent
    kernel_modules = [p for p in sorted(folder.glob("*.py")) if p.name != "core.py" and "triton" in p.read_text()]
    assert len(kernel_modules) >= 13, [p.name for p in kernel_modules]
    for path in kernel_modules:
        text = path.read_text()
        assert "triton_missing(" in text or "skipped_without_triton(" in text, path.name
        assert "NOT_SOLVED, \"skipped" not in text and "Skipped(" not in text, f"{path.name} skips on its own"


SOLVED_CELL = """def kv_bytes(layers, tokens):
    \"\"\"Bytes of K and V.\"\"\"
    ### BEGIN SOLUTION
    per_token = 2 * layers
    return per_token * tokens
    ### END SOLUTION

print("after")
"""


def test_strip_solutions_is_nbgraders_clearing_and_keeps_indentation():
    text, count = student.strip_solutions(SOLVED_CELL)
    assert count == 1
    assert "per_token" not in text and "BEGIN SOLUTION" not in text
    assert '    raise NotImplementedError("not solved yet")\n' in text
    assert text.endswith('print("after")\n')
    namespace = {}
    exec(text, namespace)  # the stubbed cell is valid Python
    with pytest.raises(NotImplementedError):
        namespace["kv_bytes"](1, 2)


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "no end solution"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_strip_solutions_rejects_broken_markers(source, message):
    with pytest.raises(ValueError, match=message):
        student.strip_solutions(source)


def test_hidden_check_uses_other_cases_and_always_raises():
    seen = {}

    def make(gen):
        return (torch.randn(3, generator=gen),)

    def record(x):
        seen.setdefault("calls", []).append(x.clone())
        return x

    visible = ex.exercise(lambda fn: ex.check_function("id", fn, lambda x: x, make, trials=2, seed=5))
    assert visible(record).passed
    shown = seen.pop("calls")
    assert visible(record, hidden=True).passed
    hidden_inputs = seen.pop("calls")
    assert len(hidden_inputs) == 2 * len(shown), "the hidden set runs more trials"
    assert not any(torch.equal(h, s) for h in hidden_inputs for s in shown), "and other inputs"
    with pytest.raises(ex.ExerciseFailed, match="hidden cases"):
        visible(lambda x: x + 1, hidden=True)   # lenient environment (autouse fixture), raises all the same
    assert visible(lambda x: x + 1).status == "failed", "the visible check still only reports"


# Every chapter's module of checks, found rather than listed, so that a new chapter cannot be left out.
CHAPTER_MODULES = sorted(p.stem for p in (Path(ex.__file__).parent).glob("*.py")
                         if p.stem not in {"__init__", "core", "grade", "student", "kinds"})


@pytest.mark.parametrize("module", CHAPTER_MODULES)
def test_every_chapter_check_has_a_hidden_case_set(module):
    import importlib
    import inspect

    mod = importlib.import_module(f"labsrc.exercises.{module}")
    checks = [f for name, f in vars(mod).items()
              if name.startswith("check_") and callable(f) and f.__module__ == mod.__name__]
    assert checks
    for check in checks:
        assert "hidden" in inspect.signature(check, follow_wrapped=False).parameters, f"{module}.{check.__name__} lacks hidden="


# ------------------------------------------------------------------------------ the one library-call guard
from labsrc import kv_cache  # noqa: E402
from labsrc.exercises.core import library_use, refuse_library  # noqa: E402
from labsrc.kernels._triton import HAS_TRITON, tl, triton  # noqa: E402

_LIB = (kv_cache.gqa_cache_bytes, kv_cache.mla_equivalent_kv_heads)
_gqa_alias = kv_cache.gqa_cache_bytes       # an alias bound in the notebook's globals


def test_library_use_by_name_alias_closure_nested_and_import_inside():
    def by_name(*a):
        return kv_cache.gqa_cache_bytes(*a)

    def by_alias(*a):
        return _gqa_alias(*a)

    closed = kv_cache.mla_equivalent_kv_heads

    def by_closure(*a):
        return closed(*a)

    def nested(*a):
        def helper():
            return kv_cache.mla_equivalent_kv_heads(*a)
        return helper()

    def import_inside(*a):
        from labsrc.kv_cache import gqa_cache_bytes as g
        return g(*a)

    assert library_use(by_name, _LIB) == ["gqa_cache_bytes"]
    assert library_use(by_alias, _LIB) == ["_gqa_alias"]           # named as the answer names it
    assert library_use(by_closure, _LIB) == ["closed"]
    assert library_use(nested, _LIB) == ["mla_equivalent_kv_heads"]
    assert library_use(import_inside, _LIB) == ["gqa_cache_bytes"]
    assert library_use(by_name, (kv_cache,)) == ["kv_cache"]            # a forbidden module
    # a function reached through a forbidden module is reported once, by the module's name
    assert library_use(by_name, (kv_cache, *_LIB)) == ["kv_cache"]


def test_library_use_leaves_the_students_own_work_alone():
    namespace = {}
    exec("def gqa_cache_bytes(*a):\n    return 0\n"
         "def answer(*a):\n    return gqa_cache_bytes(*a)\n", namespace)
    assert library_use(namespace["answer"], _LIB) == [], "their own function of the library's name"

    def own(n_layers, head_dim):
        return 2 * n_layers * head_dim

    assert library_use(own, _LIB) == []
    assert library_use(42, _LIB) == [] and library_use(print, _LIB) == []   # no Python code to read


def test_library_use_refuses_the_library_function_itself_and_unwraps_decorators():
    import functools

    assert library_use(kv_cache.gqa_cache_bytes, _LIB) == ["gqa_cache_bytes"]

    @functools.wraps(kv_cache.mla_equivalent_kv_heads)
    def wrapper(*a):
        return 0

    assert library_use(wrapper, _LIB) == ["mla_equivalent_kv_heads"], "what __wrapped__ wraps is read"


def test_library_use_with_args_sees_an_indirect_call():
    def indirect(d, b, s):                  # rope_frequencies(..., "linear") calls linear_frequencies
        from labsrc import rope
        return rope.rope_frequencies(d, b, "linear", factor=s)[0]

    from labsrc import rope
    assert library_use(indirect, (rope.linear_frequencies,)) == []  # not in the answer's own code
    assert library_use(indirect, (rope.linear_frequencies,), args=(64, 10000.0, 4.0)) == ["linear_frequencies"]


@triton.jit
def _kernel_calling_the_lab(X, BLOCK: tl.constexpr):
    from labsrc.kernels import flash_attention as attention_kernels  # noqa: F401 - read, never launched
    m = tl.load(X + tl.arange(0, BLOCK))
    attention_kernels._online_softmax_step(m, m, m[:, None])


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_library_use_unwraps_triton_kernels():
    from labsrc.kernels import flash_attention as attention_kernels
    from labsrc.kernels.kv_cache import _kv_store_kernel

    assert library_use(_kv_store_kernel, (_kv_store_kernel,)) == ["_kv_store_kernel"], "the kernel itself"
    assert library_use(_kernel_calling_the_lab, (attention_kernels._online_softmax_step,)) == ["_online_softmax_step"]
    assert library_use(_kernel_calling_the_lab, (_kv_store_kernel,)) == []


def test_refuse_library_reports_what_was_used(capsys):
    def by_name(*a):
        return kv_cache.gqa_cache_bytes(*a)

    result = refuse_library("bytes", by_name, _LIB, "count the bytes.", owner="labsrc.kv_cache")
    assert result.status == "failed"
    assert result.message == ("the answer calls labsrc.kv_cache's own gqa_cache_bytes, which this exercise asks you "
                              "to write. Hint: count the bytes.")
    assert "gqa_cache_bytes" in capsys.readouterr().out
    assert refuse_library("bytes", lambda n: 2 * n, _LIB, "count the bytes.") is None


# ------------------------------------------------------------------------------------ what a wrong answer looks like
from labsrc.exercises.core import AUTOGRAD, Refused, _compare_tensors, guarded  # noqa: E402


def test_a_wrong_number_or_tensor_is_named_by_its_case_not_by_its_relation_to_the_answer():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(5, 5, generator=gen)
    for wrong in (e.T.contiguous(), 3 * e, -e, torch.zeros_like(e), torch.roll(e, 1, 1)):
        where, what = _compare_tensors(wrong, e, None, None)
        assert where.startswith("first at element") and what == "the answer differs from the reference there."
    assert "NaN" in _compare_tensors(e.masked_fill(e > 0, float("nan")), e, None, None)[1]
    assert "shape" in _compare_tensors(torch.randn(3, 5), torch.randn(5, 3), None, None)[1]
    result = ex.check_function("n", lambda a, b: 2 * (a + b), lambda a, b: a + b, lambda g: (2.0, 3.0))
    assert result.case == "trial 1 of 5, inputs (2, 3)" and result.message.startswith(result.case)
    assert "10" not in result.message and "times" not in result.message


def test_the_hidden_cases_come_from_the_seed_the_notebook_passes():
    seen = {}

    def make(gen):
        return (torch.randn(3, generator=gen),)

    def record(x):
        seen.setdefault("calls", []).append(x.clone())
        return x

    check = ex.exercise(lambda fn: ex.check_function("id", fn, lambda x: x, make, trials=2, seed=5))
    runs = []
    for value in (52817, 52817, 12345):
        check(record, hidden=value)
        runs.append(seen.pop("calls"))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1])), "one seed, one case set"
    assert not any(torch.equal(a, b) for a in runs[0] for b in runs[2]), "another seed, other cases"


def test_one_predicate_tells_the_untouched_stub_from_a_failure():
    """Every check asks labsrc.exercises.core.stub_raised whether an exception is the student build's stub:
    raised directly, wrapped by Triton's interpreter (anywhere in the chain), or named by a compile error."""
    from labsrc.exercises.core import stub_raised

    def wrapped():
        try:
            raise NotImplementedError
        except NotImplementedError as err:
            raise RuntimeError("interpreter failed") from err

    with pytest.raises(RuntimeError) as info:
        wrapped()
    assert stub_raised(NotImplementedError()) and stub_raised(info.value)
    assert stub_raised(RuntimeError("CompilationError: ... raise NotImplementedError ..."))
    assert not stub_raised(ValueError("shapes differ")) and not stub_raised(RuntimeError("boom"))


def test_the_guard_sees_gradients_through_context_managers_and_switches():
    def through_enable_grad(x):
        with torch.enable_grad():
            y = x.detach().requires_grad_()
            (y ** 2).sum().backward()
            return y.grad

    def through_the_switch(x):
        torch._C._set_grad_enabled(True)
        return x

    def turning_the_guard_off(x):
        import sys
        sys.setprofile(None)
        return x

    for cheat in (through_enable_grad, through_the_switch, turning_the_guard_off):
        with pytest.raises(Refused), torch.no_grad():
            guarded(cheat, AUTOGRAD)(torch.ones(3))
    assert torch.equal(guarded(lambda x: 2 * x, AUTOGRAD)(torch.ones(2)), torch.full((2,), 2.0))


def test_the_guard_refuses_a_library_module_the_checker_and_c_functions():
    import transformers

    from labsrc.exercises import kv_cache

    with pytest.raises(Refused, match="transformers"):
        guarded(lambda: transformers.AutoConfig.for_model("llama"), (transformers,))()
    with pytest.raises(Refused, match="labsrc.exercises"):
        guarded(lambda *a: kv_cache._gqa_reference(*a), ())(1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(Refused, match="softmax"):
        guarded(lambda x: x.softmax(0), (torch.Tensor.softmax,))(torch.ones(3))
    result = ex.check_function("n", lambda x: torch.softmax(x, 0), lambda x: x, lambda g: (torch.ones(3),),
                               forbidden=(torch.softmax,))
    assert result.status == "failed" and "softmax" in result.message
