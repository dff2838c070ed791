"""Chapter 1's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, scaled, visible_only


def _kvmath_gqa(right):
    from labsrc import kvmath
    return lambda *a: kvmath.gqa_cache_bytes(*a)


def _checker_reference(right):
    from labsrc.exercises import kv_cache
    return lambda *a: kv_cache._gqa_reference(*a)


EXERCISES = [
    Exercise("01_kv_cache", "check_gqa_bytes",
             [*constants(), *scaled(), visible_only(), bypass("labsrc.kvmath.gqa_cache_bytes", _kvmath_gqa),
              bypass("the checker's own reference", _checker_reference)]),
]
