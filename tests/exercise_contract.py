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
