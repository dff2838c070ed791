"""Paired comparisons of stored curves: methods scored on the same samples are judged by the exact McNemar
test on their per-sample results (issue 41), not by whether two intervals overlap."""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsrc import curves


def _flip_test(a, b):
    """An independent exact p: enumerate every way of flipping which method each disagreement favours (the
    permutation distribution under no difference) and count outcomes as extreme as the observed one."""
    d = [x - y for x, y in zip(a, b) if x != y]
    if not d:
        return 1.0
    obs = abs(sum(d))
    extreme = sum(1 for signs in itertools.product((1, -1), repeat=len(d)) if abs(sum(signs)) >= obs)
    return extreme / 2 ** len(d)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=60)
       .filter(lambda pairs: sum(x != y for x, y in pairs) <= 14))
def test_mcnemar_p_equals_the_exact_permutation_distribution(pairs):
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    t = curves.mcnemar(a, b)
    assert t["p"] == pytest.approx(_flip_test(a, b))
    assert t["a_only"] - t["b_only"] == sum(a) - sum(b)
    assert t["difference"] == pytest.approx((sum(a) - sum(b)) / len(a))
    lo, hi = t["ci95"]
    assert -1 <= lo <= hi <= 1
    back = curves.mcnemar(b, a)  # symmetric: the same p, the difference and interval mirrored
    assert back["p"] == pytest.approx(t["p"]) and back["ci95"] == pytest.approx((-hi, -lo))


def test_known_values():
    # 10 disagreements all one way: p = 2 / 2**10; 5 each way: p = 1
    assert curves.mcnemar([1] * 10 + [0] * 5, [0] * 10 + [0] * 5)["p"] == pytest.approx(2 / 1024)
    assert curves.mcnemar([1] * 5 + [0] * 5, [0] * 5 + [1] * 5)["p"] == 1.0
    assert curves.mcnemar([1, 1, 0], [1, 1, 0])["p"] == 1.0
    with pytest.raises(ValueError, match="same samples"):
        curves.mcnemar([1, 0], [1])


def _curve(rows):
    return {"methods": ["a", "b"], "xs": [1], "probes": ["p"], "rows": rows, "complete": True}


def test_the_paired_test_separates_what_overlapping_intervals_cannot():
    """b is right on 50 of 100 samples; a on the same 50 and 8 more. The Wilson intervals (0.48-0.67 and
    0.40-0.60) overlap, yet every disagreement favours a: p = 2/256."""
    b = [1] * 50 + [0] * 50
    a = [1] * 58 + [0] * 42
    rows = [{"method": m, "x": 1, "probe": "p", "k": sum(v), "n": 100, "per_sample": v} for m, v in
            (("a", a), ("b", b))]
    sep = curves.separations(_curve(rows), "p")[1]
    assert sep["above"] == [("a", "b")]
    assert sep["tests"][("a", "b")]["p"] == pytest.approx(2 / 256)
    assert "a above b" in curves.describe(_curve(rows), "p")
    # the same accuracies on samples drawn independently: disagreements both ways, no separation
    rng = random.Random(0)
    a2 = a[:]
    rng.shuffle(a2)
    rows[0]["per_sample"] = a2
    sep = curves.separations(_curve(rows), "p")[1]
    assert sep["tied"] == [("a", "b")] and sep["tests"][("a", "b")]["p"] > 0.05


def test_rows_without_per_sample_results_fall_back_to_the_intervals():
    rows = [{"method": "a", "x": 1, "probe": "p", "k": 58, "n": 100},
            {"method": "b", "x": 1, "probe": "p", "k": 50, "n": 100}]
    sep = curves.separations(_curve(rows), "p")[1]
    assert sep["tied"] == [("a", "b")] and sep["tests"] == {}
