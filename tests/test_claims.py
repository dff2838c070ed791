import json
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from labsrc import claims
from labsrc.claims import Estimate


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CLAIMS_DIR", str(tmp_path))
    return tmp_path


EXACT = dict(basis="exact", rule="reproduced if the arithmetic gives the text's figure")


def test_record_load_and_render(ledger):
    row = claims.record("kv-a", claim="320 GiB at 128K", section="10.1.1", measured="320.0 GiB",
                        verdict="reproduced", notebook="01_kv_cache", **EXACT)
    claims.record("kv-b", claim="x | y", section="10.3.14", measured="z", verdict="wrong in the text",
                  notebook="01_kv_cache", **EXACT)
    claims.record("kv-c", claim="c", section="10.1.2", measured="z", verdict="not reproduced", notebook="04_rope",
                  basis="measured", rule="r", estimate=Estimate.accuracy(3, 20), anchor="rope-probe")
    claims.record("kv-d", claim="d", section="10.3.1", measured="the paper quantizes keys per channel",
                  verdict="misattributed", notebook="05_kv_quant", basis="reading", rule="r", cite="liu2024kivi")
    rows = claims.load()
    assert [r["id"] for r in rows] == ["kv-a", "kv-c", "kv-d", "kv-b"], "sorted by section number, not as text"
    assert rows[0] == row and row["profile"] in ("cpu", "gpu")
    assert row._repr_markdown_() == "Claims ledger, 10.1.1: **reproduced** (exact; `kv-a`).", \
        "a cell ending in record() shows one sentence, not the dict"
    assert rows[1]["n"] == 20 and rows[1]["interval"] == pytest.approx(list(claims.wilson(3, 20)))
    table = claims.render_markdown(rows)
    assert "4 claims checked" in table
    assert "| misattributed | 1 |" in table and "| inconclusive | 0 |" in table, "counts cover every verdict"
    for chapter in ("01_kv_cache", "04_rope", "05_kv_quant"):
        assert f"### {{doc}}`/chapters/{chapter}`" in table, "rows are grouped under their chapter"
    assert "x \\| y" in table and "**wrong in the text**" in table
    assert "{ref}`10.1.2 <rope-probe>`" in table, "a row with an anchor links to the chapter's section"
    assert "n = 20, 95% CI 0.0524 to 0.36" in table and "{cite:p}`liu2024kivi`" in table


def test_empty_ledger_says_so(ledger):
    assert "No claims have been recorded" in claims.render_markdown(claims.load())


@pytest.mark.parametrize("kwargs, message", [
    (dict(claim_id="Bad Id"), "id"),
    (dict(verdict="sort of"), "verdict"),
    (dict(measured=" "), "measured"),
    (dict(rule=""), "rule"),
    (dict(basis="vibes"), "basis"),
    (dict(basis="measured"), "n, a positive int"),
    (dict(basis="measured", n=10), "interval"),
    (dict(basis="measured", n=10, interval=(0.5, float("nan"))), "interval"),
    (dict(basis="measured", n=10, interval=(0.9, 0.1)), "interval"),
    (dict(basis="reading"), "cite"),
    (dict(verdict="misattributed"), "basis must be 'reading'"),
    (dict(anchor="Not A Label"), "anchor"),
    (dict(notebook="chapters/01_kv_cache.ipynb"), "notebook must be the chapter's stem"),
    (dict(estimate=Estimate.exact(1.0), n=3), "either estimate"),
])
def test_record_rejects_bad_rows(ledger, kwargs, message):
    good = dict(claim_id="ok", claim="c", section="10.1", measured="m", verdict="reproduced", notebook="01_kv",
                **EXACT)
    good.update(kwargs)
    claim_id = good.pop("claim_id")
    with pytest.raises(ValueError, match=message):
        claims.record(claim_id, **good)
    assert not list(ledger.glob("*.json")), "a rejected row is not written"


def test_record_rejects_a_non_estimate(ledger):
    with pytest.raises(TypeError, match="estimate"):
        claims.record("ok", claim="c", section="1", measured="m", verdict="reproduced", notebook="01_kv",
                      basis="measured", rule="r", estimate=(0.5, 0.1, 0.9))


def test_load_names_the_file_of_a_bad_row(ledger):
    claims.record("ok", claim="c", section="10.1", measured="m", verdict="reproduced", notebook="01_kv", **EXACT)
    (ledger / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not a JSON claim row"):
        claims.load()
    (ledger / "broken.json").write_text(json.dumps({"id": "x", "claim": "c"}))
    with pytest.raises(ValueError, match=r"broken\.json: claim row is missing fields"):
        claims.load()


def test_concurrent_records_of_one_id_leave_one_whole_row(ledger):
    """Writers racing on one id (two notebooks executed side by side) used to share one temporary file: their
    bytes interleaved and the slower os.replace found the file gone. Every write must succeed and leave one
    whole, valid row, with no temporary file behind."""
    import threading

    errors, barrier = [], threading.Barrier(8)

    def writer(i):
        try:
            barrier.wait()
            for j in range(25):
                claims.record("race", claim="c" * (1 + (i * 25 + j) % 300), section="10.1", measured=f"w{i}-{j}",
                              verdict="reproduced", notebook="01_kv", **EXACT)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    rows = claims.load()
    assert len(rows) == 1 and rows[0]["id"] == "race" and rows[0]["measured"].startswith("w")
    assert [p.name for p in ledger.iterdir() if p.suffix == ".tmp"] == []


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(st.lists(st.one_of(st.integers(0, 120).map(str),
                                         st.text("abcxyzABC-()", min_size=1, max_size=4)),
                               min_size=1, max_size=4), min_size=1, max_size=6))
def test_load_sorts_sections_that_are_not_purely_numeric(tmp_path_factory, parts):
    """Sections like "10.1.3a" or "Table 10.5" next to "10.1.3" used to make load() compare an int with a str.
    Any mix sorts: numbers in numeric order, text after the numbers at the same place."""
    import os

    folder = tmp_path_factory.mktemp("claims")
    os.environ["LAB_CLAIMS_DIR"] = str(folder)
    try:
        sections = [".".join(p) for p in parts]
        for i, sec in enumerate(sections):
            claims.record(f"s{i}", claim="c", section=sec, measured="m", verdict="reproduced", notebook="01_kv",
                          **EXACT)
        got = [r["section"] for r in claims.load()]
    finally:
        del os.environ["LAB_CLAIMS_DIR"]
    assert sorted(got) == sorted(sections)
    nums = [s for s in got if all(x.isdigit() for x in s.split("."))]
    assert nums == sorted(nums, key=lambda s: [int(x) for x in s.split(".")]), "numeric sections in number order"


# --- intervals ----------------------------------------------------------------------------------------------
def test_wilson_matches_known_values():
    # Values from the closed form, checked against Newcombe (1998), Table I: 0/10 -> [0, 0.2775], 1/10 ->
    # [0.0179, 0.4042], 81/263 -> [0.2553, 0.3662].
    assert claims.wilson(0, 10) == (0.0, pytest.approx(0.2775, abs=1e-4))
    assert claims.wilson(1, 10) == (pytest.approx(0.0179, abs=1e-4), pytest.approx(0.4042, abs=1e-4))
    assert claims.wilson(81, 263) == (pytest.approx(0.2553, abs=1e-4), pytest.approx(0.3662, abs=1e-4))
    assert claims.wilson(20, 20)[1] == 1.0 and claims.wilson(20, 20)[0] == pytest.approx(0.8389, abs=1e-4)
    assert claims.wilson(np.int64(3), np.int64(7)) == claims.wilson(3, 7), "numpy counts are counts"


@pytest.mark.parametrize("args, error, message", [
    ((3, 0), ValueError, "n must be at least 1"),
    ((4, 3), ValueError, r"k must lie in \[0, n=3\]"),
    ((-1, 3), ValueError, "k must lie"),
    ((1.5, 3), TypeError, "k must be an int"),
    ((True, 3), TypeError, "k must be an int"),
    ((1, 3, float("nan")), ValueError, "z must be"),
])
def test_wilson_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=message):
        claims.wilson(*args)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_wilson_contains_the_estimate_and_shrinks_with_n(n, data):
    k = data.draw(st.integers(0, n))
    lo, hi = claims.wilson(k, n)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    lo4, hi4 = claims.wilson(4 * k, 4 * n)
    assert hi4 - lo4 < hi - lo, "four times the sample narrows the interval"


def test_wilson_covers_about_95_percent():
    # The interval's point: over many fresh samples it contains the true rate about 95% of the time.
    rng = random.Random(0)
    for p, n in ((0.5, 20), (0.9, 40), (0.05, 100)):
        hits = 0
        for _ in range(2000):
            k = sum(rng.random() < p for _ in range(n))
            lo, hi = claims.wilson(k, n)
            hits += lo <= p <= hi
        assert 0.92 <= hits / 2000 <= 0.99, (p, n, hits / 2000)


def test_estimate_mean_uses_student_t():
    e = Estimate.mean([1.0, 2.0, 3.0])
    assert e.value == 2.0 and e.n == 3
    assert e.hi - e.value == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-3)
    big = Estimate.mean([float(i % 2) for i in range(100)])
    assert big.hi - big.value == pytest.approx(claims.Z95 * np.std([i % 2 for i in range(100)], ddof=1) / 10)
    with pytest.raises(ValueError, match="at least two"):
        Estimate.mean([1.0])
    with pytest.raises(ValueError, match="finite"):
        Estimate.mean([1.0, float("inf")])


def test_estimate_checks_itself_and_prints_its_evidence():
    assert str(Estimate.accuracy(19, 20)) == "0.95 (95% CI 0.764 to 0.991, n = 20)"
    assert str(Estimate.exact(320)) == "320 (exact)"
    with pytest.raises(ValueError, match="lo <= value <= hi"):
        Estimate(0.5, 0.6, 0.9, 10, "x")
    with pytest.raises(ValueError, match="value"):
        Estimate(float("nan"), 0.0, 1.0, 10, "x")
    with pytest.raises(ValueError, match="n must be"):
        Estimate(0.5, 0.1, 0.9, 0, "x")


# --- the verdict rule ---------------------------------------------------------------------------------------
def test_overlapping_intervals_cannot_separate():
    full, policy = Estimate.accuracy(20, 20), Estimate.accuracy(19, 20)
    assert claims.compare(full, policy) == 0 and claims.compare(policy, full) == 0
    assert claims.compare(Estimate.accuracy(20, 20), Estimate.accuracy(2, 20)) == 1
    assert claims.compare(Estimate.accuracy(2, 20), Estimate.accuracy(20, 20)) == -1
    with pytest.raises(TypeError, match="two Estimates"):
        claims.compare(0.9, full)


@pytest.mark.parametrize("holds, separable, trend_only, verdict", [
    (True, True, False, "reproduced"),
    (True, True, True, "reproduced in trend only"),
    (False, True, False, "not reproduced"),
    (False, True, True, "not reproduced"),
    (True, False, False, "inconclusive"),
    (False, False, True, "inconclusive"),
])
def test_judge(holds, separable, trend_only, verdict):
    assert claims.judge(holds, separable=separable, trend_only=trend_only) == verdict
