"""Exercise checks. Generic helpers live in :mod:`labsrc.exercises.core`; each chapter's checks live in a
module named for the chapter (``labsrc.exercises.kv_cache`` ...), which hold the expected answers as code
that computes them, never as printed values. :mod:`labsrc.exercises.student` builds the release notebooks
with nbgrader and :mod:`labsrc.exercises.grade` autogrades submissions."""
from labsrc.exercises.core import (ExerciseFailed, Result, check_function, check_raises, check_tensor,
                                   check_value, exercise, hidden, strict, tolerance)

__all__ = ["ExerciseFailed", "Result", "check_function", "check_raises", "check_tensor", "check_value",
           "exercise", "hidden", "strict", "tolerance"]
