"""The metrics ledger: every field, figures that agree with independent computations, clear errors."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st
import torch

from labsrc import ledger, tasks
from labsrc.data import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


SMALL = dict(context_len=160, n=1, ppl_windows=1, chunk=24, decode_prompt_len=16, decode_tokens=8)


def test_measure_returns_every_field_with_the_analytic_kv_bytes(model, tok):
    row = ledger.measure(model, tok, name="random-tiny", **SMALL)
    assert set(row) == set(ledger.FIELDS)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    # fp32 DynamicCache: K and V, every layer, every KV head
    assert row["kv_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    assert row["peak_kv_bytes"] == row["kv_bytes_per_token"] * (SMALL["context_len"] - 1)
    assert row["decode_tokens_per_s"] > 0
    assert 0.0 <= row["passkey_accuracy"] <= 1.0 and 0.0 <= row["needle_accuracy"] <= 1.0
    assert row["acceptance_rate"] is None
    assert row["validation_perplexity"] > 1


def test_perplexity_through_the_cache_equals_one_full_forward(model, tok):
    got = ledger._perplexity_through_cache(model, tok, ledger.default_cache, 96, 1, 10)
    ids = tasks.corpus_ids(tok, "validation")
    x = torch.cat([torch.tensor([tok.bos_token_id]), ids[:95]])[None]
    with torch.no_grad():
        logits = model(input_ids=x).logits
    want = math.exp(float(torch.nn.functional.cross_entropy(logits[0, 47:95], x[0, 48:96])))
    assert math.isclose(got, want, rel_tol=1e-5)


def test_greedy_with_cache_matches_greedy_without(model, tok):
    prompt = torch.tensor([tasks.passkey_sample(tok, 120, 0.5, __import__("random").Random(1)).prompt_ids])
    got = ledger.greedy(model, prompt, 5, ledger.default_cache(model)).tokens
    ids = prompt
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    assert got == ids[0, prompt.shape[1]:].tolist()


def test_a_decoder_that_reports_acceptance_shows_up(model, tok):
    def fake_speculative(model, prompt_ids, max_new_tokens, cache):
        out = ledger.greedy(model, prompt_ids, max_new_tokens, cache)
        return ledger.Decoded(out.tokens, acceptance_rate=0.75)

    row = ledger.measure(model, tok, name="spec", decoder=fake_speculative, **SMALL)
    assert row["acceptance_rate"] == 0.75


def test_ledger_accumulates_persists_and_finds_the_pareto_front(tmp_path):
    base = {f: None for f in ledger.FIELDS}
    rows = [dict(base, name="a", kv_bytes_per_token=100.0, passkey_accuracy=1.0),
            dict(base, name="b", kv_bytes_per_token=50.0, passkey_accuracy=0.9),
            dict(base, name="c", kv_bytes_per_token=60.0, passkey_accuracy=0.5),  # dominated by b
            dict(base, name="d", kv_bytes_per_token=25.0, passkey_accuracy=0.2)]
    book = ledger.Ledger(tmp_path / "l.jsonl")
    for r in rows:
        book.add(r)
    book.add(dict(rows[0], passkey_accuracy=0.95))  # same name replaces
    again = ledger.Ledger(tmp_path / "l.jsonl")
    assert [r["name"] for r in again.rows] == ["a", "b", "c", "d"]
    assert again.rows[0]["passkey_accuracy"] == 0.95
    assert [r["name"] for r in again.pareto("kv_bytes_per_token", "passkey_accuracy")] == ["d", "b", "a"]
    assert "| a |" in again.to_markdown()


def test_bad_arguments_raise_clear_errors(model, tok):
    with pytest.raises(TypeError, match="model must be"):
        ledger.measure("llama", tok, name="x")
    with pytest.raises(TypeError, match="cache_factory must be callable"):
        ledger.measure(model, tok, name="x", cache_factory="quantized")
    with pytest.raises(TypeError, match="decoder must be callable"):
        ledger.measure(model, tok, name="x", decoder=3)
    with pytest.raises(ValueError, match="name must be"):
        ledger.measure(model, tok, name="")
    with pytest.raises(ValueError, match="context_len must be a positive int"):
        ledger.measure(model, tok, name="x", context_len=0)
    with pytest.raises(TypeError, match="cache_factory returned None"):
        ledger.measure(model, tok, name="x", cache_factory=lambda m: None, **SMALL)
    with pytest.raises(TypeError, match="must return a labsrc.ledger.Decoded"):
        ledger.measure(model, tok, name="x", decoder=lambda *a: [1, 2], **SMALL)
    with pytest.raises(ValueError, match="missing fields"):
        ledger.Ledger(None).add({"name": "x"})
    with pytest.raises(ValueError, match="not a numeric ledger field"):
        ledger.Ledger(None).pareto("name", "passkey_accuracy")


def test_cache_bytes_takes_a_cache_that_states_its_storage_at_its_word(model):
    class Stated:
        nbytes = 123
        def __init__(self):
            self.working_copy = torch.zeros(1000)  # a simulation buffer, not storage
    assert ledger.cache_bytes(Stated()) == 123
    cache = ledger.default_cache(model)
    k = torch.zeros(1, 2, 5, 8)
    cache.update(k, k.clone(), 0)
    assert ledger.cache_bytes(cache) == 2 * k.numel() * 4


def test_cache_bytes_counts_state_not_a_librarys_counters():
    """A recurrent layer's cache (transformers 5.25 adds an int64 token count to each) is its states: the
    conv window and the SSM state, nothing more, as chapter 7's exercise and memory table expect."""
    class Layer:
        def __init__(self):
            self.conv_states = {0: torch.zeros(1, 12, 4)}
            self.recurrent_states = {0: torch.zeros(1, 2, 2, 2)}
            self.cumulative_length = torch.tensor(5)           # a counter: not state

    class Cache:
        def __init__(self):
            self.layers = [Layer(), Layer()]

    assert ledger.cache_bytes(Cache()) == 2 * (12 * 4 + 2 * 2 * 2) * 4


def test_two_ledgers_on_one_file_keep_each_others_rows(tmp_path):
    """Two notebooks executed side by side add to the same ledger file: no row may be lost."""
    row = dict({f: 0.0 for f in ledger.FIELDS}, notes="")
    path = tmp_path / "ledger.jsonl"
    a, b = ledger.Ledger(path), ledger.Ledger(path)
    a.add(dict(row, name="from chapter 5"))
    b.add(dict(row, name="from chapter 6"))
    a.add(dict(row, name="chapter 5 again"))
    assert [r["name"] for r in ledger.Ledger(path).rows] == ["from chapter 5", "from chapter 6", "chapter 5 again"]


def _row(name, **values):
    return dict({f: None for f in ledger.FIELDS}, name=name, notes="", **values)


def test_a_stale_copy_never_overwrites_a_newer_row(tmp_path):
    """Lost update: ledger A read row r, notebook B rewrote r, A adds another row; B's r must survive."""
    path = tmp_path / "ledger.jsonl"
    a = ledger.Ledger(path)
    a.add(_row("shared", passkey_accuracy=0.5))
    b = ledger.Ledger(path)
    b.add(_row("shared", passkey_accuracy=0.9))  # the newest write of "shared"
    a.add(_row("a's own", passkey_accuracy=0.1))
    got = {r["name"]: r["passkey_accuracy"] for r in ledger.Ledger(path).rows}
    assert got == {"shared": 0.9, "a's own": 0.1}
    assert {r["name"]: r["passkey_accuracy"] for r in a.rows}["shared"] == 0.9, "rows are read afresh"


def test_numpy_and_torch_scalars_are_stored_as_numbers(tmp_path):
    import numpy as np

    book = ledger.Ledger(tmp_path / "l.jsonl")
    book.add(_row("np", passkey_accuracy=np.float32(0.75), peak_kv_bytes=np.int64(1024),
                  validation_perplexity=torch.tensor(12.5), context_len=torch.tensor(512)))
    book.add(_row("next", passkey_accuracy=0.5))  # every later add still works
    row = ledger.Ledger(tmp_path / "l.jsonl").rows[0]
    assert row["passkey_accuracy"] == 0.75 and type(row["passkey_accuracy"]) is float
    assert row["peak_kv_bytes"] == 1024 and type(row["peak_kv_bytes"]) is int
    assert row["validation_perplexity"] == 12.5 and row["context_len"] == 512


@pytest.mark.parametrize("values, error, message", [
    (dict(passkey_accuracy=float("nan")), ValueError, "'passkey_accuracy' is NaN"),
    (dict(passkey_accuracy="0.5"), TypeError, "'passkey_accuracy' must be a number or None"),
    (dict(passkey_accuracy=True), TypeError, "must be a number"),
    (dict(peak_kv_bytes=torch.ones(2)), TypeError, "'peak_kv_bytes' must be a number"),
    (dict(notes=3), TypeError, "'notes' must be a string or None"),
    (dict(extra=object()), TypeError, "extra field 'extra' is not JSON-safe"),
])
def test_bad_rows_are_refused_before_anything_is_written(tmp_path, values, error, message):
    book = ledger.Ledger(tmp_path / "l.jsonl")
    book.add(_row("good", passkey_accuracy=1.0))
    with pytest.raises(error, match=message):
        book.add(dict(_row("bad"), **values))
    book.add(_row("after", passkey_accuracy=0.5))
    assert [r["name"] for r in book.rows] == ["good", "after"]


def test_a_malformed_file_is_reported_with_its_line(tmp_path):
    path = tmp_path / "l.jsonl"
    ledger.Ledger(path).add(_row("good", passkey_accuracy=1.0))
    with open(path, "a") as f:
        f.write('{"name": "half a row"\n')
    with pytest.raises(ValueError, match=r"l\.jsonl, line 2: not a JSON ledger row"):
        ledger.Ledger(path)
    path.write_text('{"name": "no fields"}\n')
    with pytest.raises(ValueError, match=r"line 1: row is missing fields"):
        ledger.Ledger(path)
    path.write_text('[1, 2]\n')
    with pytest.raises(TypeError, match=r"line 1: a ledger row must be a dict"):
        ledger.Ledger(path)
    path.write_text(__import__("json").dumps(_row("nan", passkey_accuracy=1.0)).replace("1.0", "NaN") + "\n")
    with pytest.raises(ValueError, match=r"line 1: field 'passkey_accuracy' is NaN"):
        ledger.Ledger(path)


def test_pareto_skips_missing_values_and_keeps_infinite_ones_in_order(tmp_path):
    book = ledger.Ledger(None)
    book.add(_row("a", kv_bytes_per_token=10.0, validation_perplexity=float("inf")))
    book.add(_row("b", kv_bytes_per_token=20.0, validation_perplexity=30.0))
    book.add(_row("c", kv_bytes_per_token=5.0, validation_perplexity=None))
    front = book.pareto("kv_bytes_per_token", "validation_perplexity", maximize_y=False)
    assert [r["name"] for r in front] == ["a", "b"]
    with pytest.raises(ValueError, match="not a numeric ledger field"):
        book.pareto("notes", "validation_perplexity")


def test_two_processes_adding_at_once_lose_no_row(tmp_path):
    """The lock is real: two processes each add 15 rows to one file at the same time; all 30 are there."""
    import subprocess
    import sys

    path = tmp_path / "l.jsonl"
    code = ("import sys; from labsrc import ledger\n"
            "book = ledger.Ledger(sys.argv[1])\n"
            "for i in range(15):\n"
            "    book.add(dict({f: None for f in ledger.FIELDS}, name=f'{sys.argv[2]}-{i}', notes=''))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), tag]) for tag in ("x", "y")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(ledger.Ledger(path).rows) == 30


@settings(max_examples=60, deadline=None)
@given(points=st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 1e6)),
                                 st.one_of(st.none(), st.floats(-1e3, 1e3), st.sampled_from([-math.inf, math.inf]))),
                       max_size=12),
       minimize_x=st.booleans(), maximize_y=st.booleans())
def test_pareto_front_is_exactly_the_non_dominated_rows(points, minimize_x, maximize_y):
    book = ledger.Ledger(None)
    for i, (x, y) in enumerate(points):
        book.add(_row(f"r{i}", kv_bytes_per_token=x, passkey_accuracy=y))
    front = book.pareto("kv_bytes_per_token", "passkey_accuracy", minimize_x, maximize_y)
    sx, sy = (1 if minimize_x else -1), (-1 if maximize_y else 1)  # both as "smaller is better"
    full = {(sx * x, sy * y) for x, y in points if x is not None and y is not None}
    # A point is on the front when no other point is at least as good on both axes and better on one.
    expected = {(x, y) for x, y in full if not any(bx <= x and by <= y and (bx, by) != (x, y) for bx, by in full)}
    got = [(sx * r["kv_bytes_per_token"], sy * r["passkey_accuracy"]) for r in front]
    assert set(got) == expected and len(got) == len(expected), "one row per point of the front"
