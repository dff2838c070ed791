"""The contract every chapter's exercise checks keep, written once.

A right answer passes, a wrong one fails with a hint (and raises in strict mode), and the student build's stub
is "not solved yet"; with ``hidden=True`` (a test cell's hidden section) the check raises on anything but a pass
in any environment. A test module defines ``CASES``, a list of ``(check, right, wrong)`` triples, and imports
the tests below; ``tests/conftest.py`` parametrizes them with that module's ``CASES``.
"""
import pytest

from labsrc.exercises import ExerciseFailed


def stub(*args):
    raise NotImplementedError


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


def test_right_answer_passes(exercise_case, lenient, capsys):
    check, right, _ = exercise_case
    assert check(right).status == "passed"
    assert "passed" in capsys.readouterr().out


def test_wrong_answer_fails_with_hint(exercise_case, lenient, capsys):
    check, _, wrong = exercise_case
    result = check(wrong)
    assert result.status == "failed" and "Hint:" in result.message
    assert "failed" in capsys.readouterr().out


def test_stub_is_not_solved_yet(exercise_case, lenient, capsys):
    check, _, _ = exercise_case
    assert check(stub).status == "not solved yet"
    assert "not solved yet" in capsys.readouterr().out


def test_strict_mode_passes_right_and_raises_on_wrong_and_stub(exercise_case, monkeypatch):
    check, right, wrong = exercise_case
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    assert check(right).passed
    with pytest.raises(ExerciseFailed):
        check(wrong)
    with pytest.raises(ExerciseFailed):
        check(stub)


def test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode(exercise_case, lenient, capsys):
    """The call in a test cell's hidden section: nbgrader autogrades with it whatever LAB_EXERCISES says."""
    check, right, wrong = exercise_case
    result = check(right, hidden=True)
    assert result.passed and "(hidden cases)" in result.name
    with pytest.raises(ExerciseFailed, match="Hint:"):
        check(wrong, hidden=True)
    with pytest.raises(ExerciseFailed, match="not solved yet"):
        check(stub, hidden=True)
    assert "hidden cases" in capsys.readouterr().out, "the hidden check still prints its message"


def assert_kernel_check_skips_without_triton(check, answer, monkeypatch, capsys):
    """Without Triton a kernel check tells a student it was skipped, and awards nothing when grading: it raises,
    saying to grade on Linux, in strict mode and in the hidden cases (a plain ``nbgrader autograde``). Only the
    book build (``LAB_EXERCISES=build``, executing the instructor notebooks) lets the skip pass through.

    Not a test itself (no ``test_`` prefix): each kernel chapter's test module calls it with its kernel check."""
    from labsrc import runtime
    from labsrc.exercises import core

    monkeypatch.setattr(runtime, "HAS_TRITON", False)
    monkeypatch.delenv("LAB_EXERCISES", raising=False)
    result = check(answer)
    assert result.status == core.SKIPPED and not result.passed and "Triton" in result.message
    assert "skipped" in capsys.readouterr().out, "the student sees that the kernel was skipped"
    for mode, hidden in (("", True), ("strict", False), ("strict", True)):
        monkeypatch.setenv("LAB_EXERCISES", mode)
        with pytest.raises(ExerciseFailed, match=f"{core.NOT_GRADED}.*on Linux"):
            check(answer, hidden=hidden)
        assert "skipped" in capsys.readouterr().out, "the skip is printed before it raises"
    monkeypatch.setenv("LAB_EXERCISES", "build")
    for hidden in (False, True):
        assert check(answer, hidden=hidden).status == core.SKIPPED
