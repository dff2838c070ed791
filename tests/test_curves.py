"""labsrc.curves: stored accuracy curves (sweep, resume, separations and prose from the numbers, live rescoring),
and chapter 6's sweep (labsrc.sweeps.kv_eviction) end to end on a few samples."""
import json

import pytest

from labsrc import claims, curves
from labsrc.models.stored_runs import model_digest


def fake_score(table):
    """A scorer reading fixed per-sample results, counting its calls."""
    calls = []

    def score(method, x, probe):
        calls.append((method, x, probe))
        return table[method, x, probe]
    return score, calls


TABLE = {("a", 1, "p"): [True] * 50, ("b", 1, "p"): [False] * 50,
         ("a", 2, "p"): [True] * 25 + [False] * 25, ("b", 2, "p"): [True] * 24 + [False] * 26}


def test_sweep_rows_and_file(tmp_path):
    score, calls = fake_score(TABLE)
    out = tmp_path / "c.json"
    result = curves.sweep(score, ["a", "b"], [1, 2], ["p"], {"command": "x"}, out=out,
                          baseline=lambda probe: [True] * 50, echo=lambda *_: None)
    assert len(calls) == 4 and result["complete"]
    stored = curves.load(out)
    assert stored == json.loads(json.dumps(result))
    base = [r for r in stored["rows"] if r["method"] == curves.BASELINE]
    assert len(base) == 1 and base[0]["k"] == 50 and base[0]["x"] is None
    assert curves.point(stored, "a", 2, "p") == claims.Estimate.accuracy(25, 50)
    with pytest.raises(KeyError):
        curves.point(stored, "c", 2, "p")


def interrupted_sweep(out):
    """A sweep of methods a, b over x = 1, 2 stopped at (b, 2): the file holds three points and says unfinished."""
    score, _ = fake_score(TABLE)

    def dies_on_b2(method, x, probe):
        if (method, x) == ("b", 2):
            raise KeyboardInterrupt
        return score(method, x, probe)
    with pytest.raises(KeyboardInterrupt):
        curves.sweep(dies_on_b2, ["a", "b"], [1, 2], ["p"], {"command": "x"}, out=out, echo=lambda *_: None)
    with pytest.raises(ValueError, match="unfinished"):
        curves.load(out)


def test_an_interrupted_sweep_resumes_and_another_run_never_silently_replaces_it(tmp_path):
    out = tmp_path / "c.json"
    interrupted_sweep(out)
    score2, calls = fake_score(TABLE)
    # the command alone (it holds --threads and --out, which change no result) does not decide resumption
    curves.sweep(score2, ["a", "b"], [1, 2], ["p"], {"command": "x --threads 2"}, out=out, echo=lambda *_: None)
    assert calls == [("b", 2, "p")]
    stored = out.read_bytes()
    score3, calls = fake_score(TABLE)
    for header, methods, xs in (({"command": "x", "n": 5}, ["a", "b"], [1, 2]), ({"command": "x"}, ["a"], [1, 2]),
                                ({"command": "x"}, ["a", "b"], [2])):
        with pytest.raises(FileExistsError, match="holds a curve from another run .* --overwrite"):
            curves.sweep(score3, methods, xs, ["p"], header, out=out, echo=lambda *_: None)
    assert calls == [] and out.read_bytes() == stored  # refused before scoring or writing anything
    curves.sweep(score3, ["a", "b"], [1, 2], ["p"], {"command": "x", "n": 5}, out=out, echo=lambda *_: None,
                 overwrite=True)
    assert len(calls) == 4 and curves.load(out)["n"] == 5


@pytest.mark.parametrize("content", ["", "{", "[1, 2]", '{"rows": [1]}', '{"rows": "x"}', "\udcff"])
def test_a_file_that_is_not_a_curve_is_named(tmp_path, content):
    out = tmp_path / "broken.json"
    out.write_text(content, errors="surrogateescape")
    score, calls = fake_score(TABLE)
    with pytest.raises(ValueError, match="broken.json is not a stored curve"):
        curves.sweep(score, ["a"], [1], ["p"], {"command": "x"}, out=out, echo=lambda *_: None)
    with pytest.raises(ValueError, match="broken.json is not a stored curve"):
        curves.load(out)
    assert calls == []
    curves.sweep(score, ["a"], [1], ["p"], {"command": "x"}, out=out, echo=lambda *_: None, overwrite=True)
    assert curves.load(out)["complete"]


def test_a_stored_curve_is_never_lost_without_overwrite(tmp_path_factory):
    """Property: whatever a second run asks (header, methods, axis, probes, an interruption), the stored file
    afterwards still holds every row it held, unless the run was told to overwrite."""
    from hypothesis import given, settings, strategies as st

    run = st.fixed_dictionaries(dict(
        header=st.fixed_dictionaries({"command": st.sampled_from(["x", "x --threads 2"]),
                                      "n": st.sampled_from([50, 51])}),
        methods=st.sampled_from([["a"], ["b"], ["a", "b"]]), xs=st.sampled_from([[1], [2], [1, 2]]),
        die_after=st.integers(0, 4), overwrite=st.booleans()))

    @settings(max_examples=60, deadline=None)
    @given(run, run)
    def check(first, second):
        out = tmp_path_factory.mktemp("curve") / "c.json"
        for r in (first, second):
            score, calls = fake_score(TABLE)

            def dying(method, x, probe, r=r, calls=calls, score=score):
                if len(calls) >= r["die_after"] + 1:
                    raise KeyboardInterrupt
                return score(method, x, probe)
            before = {json.dumps(row, sort_keys=True) for row in json.loads(out.read_text())["rows"]} \
                if out.exists() else set()
            try:
                curves.sweep(dying, r["methods"], r["xs"], ["p"], r["header"], out=out, echo=lambda *_: None,
                             overwrite=r["overwrite"])
            except (KeyboardInterrupt, FileExistsError):
                pass
            after = {json.dumps(row, sort_keys=True) for row in json.loads(out.read_text())["rows"]} \
                if out.exists() else set()
            if not r["overwrite"]:
                assert before <= after, (first, second)

    check()


def test_bad_sweeps_are_named():
    score, _ = fake_score(TABLE)
    with pytest.raises(ValueError, match="methods"):
        curves.sweep(score, [], [1], ["p"], {})
    with pytest.raises(ValueError, match="baseline"):
        curves.sweep(score, ["baseline"], [1], ["p"], {})
    with pytest.raises(ValueError, match="no samples"):
        curves.sweep(lambda *a: [], ["a"], [1], ["p"], {}, echo=lambda *_: None)


def test_separations_and_prose_come_from_the_intervals():
    score, _ = fake_score(TABLE)
    curve = curves.sweep(score, ["a", "b"], [1, 2], ["p"], {}, echo=lambda *_: None)
    sep = curves.separations(curve, "p")
    assert sep[1]["above"] == [("a", "b")] and sep[1]["tied"] == []
    assert sep[2]["above"] == [] and sep[2]["tied"] == [("a", "b")]   # 25/50 against 24/50 overlap
    text = curves.describe(curve, "p", x_label=lambda x: f"x = {x}").splitlines()
    assert text[0].startswith("At x = 1 (n = 50 each): a 1.00") and "a above b" in text[0]
    assert "no two of them separate" in text[1]


def test_a_summary_says_who_leads_by_how_much_and_where_nothing_separates():
    # A chapter's summary states the winners from the stored intervals, never typed (issue 45, item 5).
    score, _ = fake_score(TABLE)
    curve = curves.sweep(score, ["a", "b"], [1, 2], ["p"], {}, echo=lambda *_: None)
    lead = curves.leaders(curve, "p")
    assert lead[1]["leaders"] == ["a"] and lead[1]["beaten"] == ["b"] and lead[1]["margin"] == (1.0, 1.0)
    assert lead[2]["leaders"] == ["a", "b"] and lead[2]["beaten"] == [] and lead[2]["margin"] is None
    text = curves.summarize(curve, "p", x_label=lambda x: f"x = {x}")
    assert text == ("At x = 1 the top group (a 1.00) lies above b by 1.00; at x = 2 no two intervals "
                    "separate (n = 50 per point, 95% intervals).")


def test_a_partial_curve_loads_only_when_asked_and_names_what_it_lacks(tmp_path):
    # A chapter may be drawn from a sweep still under way: it must say so, and compare only complete x's.
    out = tmp_path / "c.json"
    score, _ = fake_score(TABLE)
    interrupted_sweep(out)
    part = curves.load(out, partial=True)
    assert curves.missing(part) == [("b", 2, "p")]
    assert list(curves.separations(part, "p")) == [1]
    assert curves.describe(part, "p").startswith("At 1 ") and "At 2" not in curves.describe(part, "p")
    full = curves.sweep(score, ["a", "b"], [1, 2], ["p"], {"command": "x"}, out=out, echo=lambda *_: None)
    assert curves.missing(full) == [] and list(curves.separations(full, "p")) == [1, 2]


def test_rescore_returns_stored_and_fresh_slices():
    score, _ = fake_score(TABLE)
    curve = curves.sweep(score, ["a", "b"], [1, 2], ["p"], {}, echo=lambda *_: None)
    stored, fresh = curves.rescore(curve, lambda m, x, p, k: TABLE[m, x, p][:k], "a", 2, "p", 30)
    assert stored == fresh == [1] * 25 + [0] * 5
    with pytest.raises(ValueError, match="at most"):
        curves.rescore(curve, lambda *a: [], "a", 2, "p", 51)


def test_digests_change_with_what_they_cover(tmp_path):
    def f():
        return 1

    def g():
        return 2
    assert curves.source_version(f) != curves.source_version(g)
    assert curves.source_version(f, g) != curves.source_version(g, f)
    with pytest.raises(ValueError):
        curves.source_version()

    class S:
        def __init__(self, ids, spans):
            self.ids, self.spans = ids, spans
    a = curves.samples_digest([S([1, 2, 3], [(1, 2)])])
    assert a == curves.samples_digest([S([1, 2, 3], [(1, 2)])])
    assert a != curves.samples_digest([S([1, 2, 4], [(1, 2)])])
    assert a != curves.samples_digest([S([1, 2, 3], [(1, 3)])])


def stored_curve(module, what):
    """``(stored, model, tokenizer)`` for a sweep module's stored curve, checked for what every chapter that
    plots one needs: its header still describes the shipped scoring code and checkpoint, STORED lists it with
    the command that made it, and it is finished with n >= 100 samples at every point. The caller checks the
    samples (each sweep draws them its own way) and the rest of its header."""
    from labsrc import models
    from labsrc.models.stored_runs import ROOT, STORED
    stored = curves.load(module.PATH, partial=True)
    assert stored["code_version"] == curves.source_version(*module.scoring_code()), \
        f"the {what} code changed since the stored curve: rerun {stored['command']}"
    assert stored["models"] == {stored["model"]: model_digest(stored["model"])}
    path = module.PATH.relative_to(ROOT).as_posix()
    assert [r.command for r in STORED if r.path == path] == [stored["command"]], \
        f"STORED must list {path} with the command that made it"
    assert all(r["n"] == len(r["per_sample"]) == stored["n"] for r in stored["rows"])
    assert stored["n"] >= 100 and not curves.missing(stored), "the stored curve is unfinished or too small"
    model, tok = models.load(stored["model"])
    return stored, model, tok


def small_sweep(module, argv, tmp_path):
    """Run a sweep module's command on a few samples into ``tmp_path`` and check what every sweep's file holds:
    its code version, the checkpoint's digest, and the rows the command returned. Returns ``(stored, model,
    tokenizer)`` for the caller's own checks (its command, its points, re-scoring a slice)."""
    from labsrc import models
    out = tmp_path / "curve.json"
    result = module.main([*argv, "--out", str(out)])
    stored = curves.load(out)
    assert stored["code_version"] == curves.source_version(*module.scoring_code())
    assert stored["models"] == {"lab-target": model_digest("lab-target")}
    assert result["rows"] == stored["rows"]
    model, tok = models.load("lab-target")
    return stored, model, tok


def test_evict_sweep_end_to_end_on_a_few_samples(tmp_path, monkeypatch):
    # Chapter 6's command on 2 pass keys, 2 policies, one budget: the file has its header, the baseline and
    # every point, and re-scoring a slice reproduces the stored per-sample results.
    from labsrc.sweeps import kv_eviction as sweep_evict
    stored, model, tok = small_sweep(sweep_evict, ["--n", "2", "--probes", "passkey", "--kept", "0.3",
                                                   "--policies", "fifo", "h2o"], tmp_path)
    assert stored["command"].startswith("python -m labsrc.sweeps.kv_eviction --n 2 --probes passkey --kept 0.3")
    assert {(r["method"], r["x"]) for r in stored["rows"]} == {("baseline", None), ("fifo", 0.3), ("h2o", 0.3)}
    scorer = sweep_evict.Scorer(model, tok, n=2)
    assert stored["samples_digest"]["passkey"] == curves.samples_digest(scorer.samples("passkey"))
    got, fresh = curves.rescore(stored, scorer, "h2o", 0.3, "passkey", 2)
    assert got == fresh
    with pytest.raises(ValueError, match="kept"):
        scorer("fifo", 1.0, "passkey")
    # The same command with --threads 2 resumes the file (nothing is scored again); another budget is refused
    # before it scores or writes anything, and --overwrite replaces the file.
    out = tmp_path / "curve.json"
    argv = ["--n", "2", "--probes", "passkey", "--kept", "0.3", "--policies", "fifo", "h2o", "--out", str(out)]
    monkeypatch.setattr(sweep_evict.Scorer, "__call__", lambda *a, **k: pytest.fail("a stored point was rescored"))
    monkeypatch.setattr(sweep_evict.Scorer, "baseline", lambda *a, **k: pytest.fail("the baseline was rescored"))
    again = sweep_evict.main([*argv, "--threads", "2"])
    assert again["rows"] == stored["rows"] and again["machine"]["threads"] == 2
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match="curve.json holds a curve from another run .xs differ"):
        sweep_evict.main(["--n", "2", "--probes", "passkey", "--kept", "0.5", "--policies", "fifo", "h2o",
                          "--out", str(out)])
    assert out.read_bytes() == before


def test_the_stored_evict_curve_is_what_the_shipped_code_probes_and_model_make():
    # Chapter 6 plots labsrc/data/results/evict_curve.json: its header must still describe the scoring code,
    # the probe samples and the checkpoint that ship, or the chapter would plot another experiment's numbers.
    from labsrc.sweeps import kv_eviction as sweep_evict
    stored, model, tok = stored_curve(sweep_evict, "eviction")
    scorer = sweep_evict.Scorer(model, tok, n=stored["n"])
    assert stored["context_len"] == scorer.context_len
    for probe in stored["probes"]:
        assert stored["samples_digest"][probe] == curves.samples_digest(scorer.samples(probe)), probe


def test_paged_evict_sweep_end_to_end_on_a_few_samples(tmp_path):
    # Chapter 9's command on 2 pass keys, 2 block policies, one share kept: header, baseline and every point,
    # and re-scoring a slice reproduces the stored per-sample results.
    from labsrc.sweeps import serving as sweep_serving
    stored, model, tok = small_sweep(sweep_serving, ["--n", "2", "--probes", "passkey", "--kept", "0.3",
                                                   "--policies", "value", "recency"], tmp_path)
    assert stored["command"].startswith("python -m labsrc.sweeps.serving --n 2 --probes passkey --kept 0.3")
    assert {(r["method"], r["x"]) for r in stored["rows"]} == {("baseline", None), ("value", 0.3),
                                                               ("recency", 0.3)}
    assert stored["block_size"] == 16
    scorer = sweep_serving.Scorer(model, tok, n=2)
    assert stored["samples_digest"]["passkey"] == curves.samples_digest(scorer.samples("passkey"))
    got, fresh = curves.rescore(stored, scorer, "value", 0.3, "passkey", 2)
    assert got == fresh
    with pytest.raises(ValueError, match="kept"):
        scorer("value", 1.0, "passkey")
    with pytest.raises(ValueError, match="method"):
        scorer("h2o", 0.3, "passkey")


def test_the_stored_paged_evict_curve_is_what_the_shipped_code_probes_and_model_make():
    # Chapter 9 plots labsrc/data/results/paged_evict_curve.json and sets it beside chapter 6's token-level
    # curve on the same samples: its header must describe the shipped scoring code, samples and checkpoint.
    from labsrc.sweeps import kv_eviction as sweep_evict, serving as sweep_serving
    stored, model, tok = stored_curve(sweep_serving, "paged eviction")
    scorer = sweep_serving.Scorer(model, tok, n=stored["n"], block_size=stored["block_size"])
    assert stored["context_len"] == scorer.context_len
    for probe in stored["probes"]:
        assert stored["samples_digest"][probe] == curves.samples_digest(scorer.samples(probe)), probe
    # the chapter compares the two curves sample for sample only where they scored the same samples
    token_level = curves.load(sweep_evict.PATH, partial=True)
    shared = set(stored["probes"]) & set(token_level["probes"])
    assert shared and all(stored["samples_digest"][p] == token_level["samples_digest"][p] for p in shared)


def test_rope_sweep_end_to_end_on_a_few_samples(tmp_path):
    # Chapter 4's command on 2 pass keys, 2 methods, L and 1.5 L, 2 windows: every point and its per-window
    # losses are stored, and re-scoring a slice reproduces the stored per-sample results.
    from labsrc.sweeps import rope as sweep_rope
    stored, model, tok = small_sweep(sweep_rope, ["--n", "2", "--multiples", "1", "1.5", "--methods", "default",
                                                  "yarn", "--windows", "2"], tmp_path)
    assert stored["command"].startswith("python -m labsrc.sweeps.rope --n 2 --probes passkey --multiples 1 1.5")
    L = model.config.lab_trained_context
    assert stored["xs"] == [L, int(1.5 * L)] and stored["factor"] == 1.5
    assert {(r["method"], r["x"]) for r in stored["rows"]} == {(m, x) for m in ("default", "yarn")
                                                             for x in stored["xs"]}
    ppl = stored["perplexity"]
    assert set(ppl) == {f"{m}@{x}" for m in ("default", "yarn") for x in stored["xs"]}
    assert ppl[f"default@{L}"]["nll_beyond"] is None and len(ppl[f"yarn@{int(1.5 * L)}"]["nll_beyond"]) == 2
    assert sweep_rope.perplexity_estimate(ppl[f"default@{L}"]["nll"]).n == 2
    scorer = sweep_rope.Scorer(model, tok, max(stored["xs"]), n=2)
    x = stored["xs"][1]
    assert stored["samples_digest"]["passkey"][str(x)] == curves.samples_digest(scorer.samples("passkey", x))
    got, fresh = curves.rescore(stored, scorer, "yarn", x, "passkey", 2)
    assert got == fresh
    # the scorer leaves the model with its trained RoPE
    assert model.config.rope_parameters["rope_type"] == "default"


def test_the_stored_rope_curve_is_what_the_shipped_code_probes_and_model_make():
    # Chapter 4 plots labsrc/data/results/rope_curve.json: its header must still describe the scoring code, the
    # probe samples at every length and the checkpoint that ship, and every point must hold n >= 100 samples.
    from labsrc.sweeps import rope as sweep_rope
    stored, model, tok = stored_curve(sweep_rope, "RoPE scoring")
    assert stored["trained_context"] == model.config.lab_trained_context
    assert stored["xs"] == sweep_rope.lengths_for(model, sweep_rope.MULTIPLES)
    assert stored["methods"] == list(sweep_rope.METHODS)
    scorer = sweep_rope.Scorer(model, tok, max(stored["xs"]), n=stored["n"])
    assert stored["factor"] == scorer.factor == max(stored["xs"]) / stored["trained_context"]
    for probe in stored["probes"]:
        for x in stored["xs"]:
            assert stored["samples_digest"][probe][str(x)] == curves.samples_digest(scorer.samples(probe, x)), x
    assert stored["complete"], "the stored run's perplexity windows are unfinished"
    ppl = stored["perplexity"]
    assert set(ppl) == {f"{m}@{x}" for m in stored["methods"] for x in stored["xs"]}
    assert all(len(p["nll"]) == stored["windows"] >= 2 for p in ppl.values())


def test_kvquant_sweep_end_to_end_on_a_few_samples(tmp_path):
    # Chapter 5's command on 10 needles (one batch), 2 configurations, INT3: the file has its header, the
    # baseline and every point, and re-scoring the slice reproduces the stored per-sample results.
    from labsrc.sweeps import kv_quant as sweep_kvq
    stored, model, tok = small_sweep(sweep_kvq, ["--n", "10", "--probes", "needle", "--bits", "3", "--configs",
                                                 "per_token", "kvarn128"], tmp_path)
    assert stored["command"].startswith("python -m labsrc.sweeps.kv_quant --n 10 --probes needle --bits 3")
    assert {(r["method"], r["x"]) for r in stored["rows"]} == {("baseline", None), ("per_token", 3),
                                                               ("kvarn128", 3)}
    scorer = sweep_kvq.Scorer(model, tok, n=10)
    assert stored["samples_digest"]["needle"] == curves.samples_digest(scorer.samples("needle"))
    got, fresh = curves.rescore(stored, scorer, "kvarn128", 3, "needle", 10)
    assert got == fresh
    with pytest.raises(ValueError, match="config must be one of"):
        scorer("per_channel", 4, "needle", 1)


def test_the_stored_kvquant_curve_is_what_the_shipped_code_probes_and_model_make():
    # Chapter 5 plots labsrc/data/results/kvquant_curve.json: its header must still describe the scoring code,
    # the calibration text, the probe samples and the checkpoint that ship, and it must be finished with
    # n >= 100 per point, or the chapter would plot another (or a smaller) experiment's numbers.
    from labsrc.sweeps import kv_quant as sweep_kvq
    stored, model, tok = stored_curve(sweep_kvq, "KV-quantization")
    scorer = sweep_kvq.Scorer(model, tok, n=stored["n"])
    assert stored["context_len"] == scorer.context_len == 921
    assert stored["batch"] == sweep_kvq.BATCH
    assert stored["calibration"]["digest"] == sweep_kvq.calibration_digest(tok)
    for probe in stored["probes"]:
        assert stored["samples_digest"][probe] == curves.samples_digest(scorer.samples(probe)), probe
    assert set(stored["methods"]) == set(sweep_kvq.CONFIGS) and stored["xs"] == [2, 3, 4]
    assert set(stored["probes"]) == {"needle", "variable_tracking", "passkey"}
    assert all(any(r["method"] == curves.BASELINE and r["probe"] == p for r in stored["rows"])
               for p in stored["probes"])
