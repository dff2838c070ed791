import pytest

from labsrc import claims


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CLAIMS_DIR", str(tmp_path))
    return tmp_path


def test_record_load_and_render(ledger):
    row = claims.record("kv-a", claim="320 GiB at 128K", section="10.1.1", measured="320.0 GiB",
                        verdict="reproduced", notebook="01_kv_cache")
    claims.record("kv-b", claim="x | y", section="10.3.14", measured="z", verdict="wrong in the text", notebook="01")
    claims.record("kv-c", claim="c", section="10.1.2", measured="z", verdict="not reproduced", notebook="01")
    rows = claims.load()
    assert [r["id"] for r in rows] == ["kv-a", "kv-c", "kv-b"], "sorted by section number, not as text"
    assert rows[0] == row
    table = claims.render_markdown(rows)
    assert table.count("\n") == 5 and "x \\| y" in table and "**wrong in the text**" in table


def test_empty_ledger_says_so(ledger):
    assert "No claims have been recorded" in claims.render_markdown(claims.load())


@pytest.mark.parametrize("kwargs, message", [
    (dict(claim_id="Bad Id"), "claim_id"),
    (dict(verdict="sort of"), "verdict"),
    (dict(measured=" "), "measured"),
])
def test_record_rejects_bad_rows(ledger, kwargs, message):
    good = dict(claim_id="ok", claim="c", section="10.1", measured="m", verdict="reproduced", notebook="n")
    good.update(kwargs)
    claim_id = good.pop("claim_id")
    with pytest.raises(ValueError, match=message):
        claims.record(claim_id, **good)
