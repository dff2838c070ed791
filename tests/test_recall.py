"""labsrc.recall, the MQAR harness that compares sequence mixers: every registered mixer is causal and keeps the
bytes it says, the model trains (the loss falls on a fixed batch), the answer positions and the span scoring
are right, and the stored results the chapter plots are well formed."""
import json
import random

import pytest
import torch

import labsrc  # noqa: F401
from labsrc import recall
from labsrc.claims import wilson
from labsrc.tasks import Sample


@pytest.mark.parametrize("mixer", sorted(recall.MIXERS))
def test_mixers_are_causal(mixer):
    torch.manual_seed(0)
    model = recall.RecallModel(50, 32, (mixer, mixer)).eval()
    ids = torch.randint(0, 50, (2, 70))
    changed = ids.clone()
    changed[:, 40:] = torch.randint(0, 50, (2, 30))
    with torch.no_grad():
        a, b = model.hidden(ids), model.hidden(changed)
    torch.testing.assert_close(a[:, :40], b[:, :40], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_memory_bytes():
    soft = recall.RecallModel(10, 64, ("softmax", "softmax"))
    assert soft.memory_bytes(100) == 2 * (2 * 64 * 100 * 4)           # K and V, 2 layers, fp32
    assert soft.memory_bytes(200) == 2 * soft.memory_bytes(100)
    for mixer, per_layer in (("linear", 4 * (16 * 16 + 16)), ("delta", 4 * 16 * 16),
                             ("mamba2", 4 * 16 * 16)):
        m = recall.RecallModel(10, 64, (mixer,))
        assert m.memory_bytes(100) == m.memory_bytes(10 ** 6) == per_layer * 4     # 4 heads
    hybrid = recall.RecallModel(10, 64, recall.GRID["hybrid"])
    assert hybrid.memory_bytes(100) == 4 * 4 * (16 * 16 + 16) + 2 * 64 * 100 * 4


def test_unknown_mixer_and_duplicate_registration():
    with pytest.raises(ValueError, match="unknown mixer 'no-such-mixer'"):
        recall.RecallModel(10, 32, ("no-such-mixer",))
    with pytest.raises(ValueError, match="registered twice"):
        recall.register_mixer("softmax")(recall.SoftmaxMixer)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        recall.RecallModel(10, 40, ("linear",), head_dim=16)


def _toy_data(n_train=16, n_eval=4, seed=0):
    """A stand-in for MQARData with hand-made samples (no tokenizer): key k -> value k + 10, asked at the end."""
    rng = random.Random(seed)

    def sample():
        keys = rng.sample(range(1, 9), 3)
        ids = [0]
        for k in keys:
            ids += [k, k + 10]
        spans = []
        for k in keys:
            ids.append(k)
            spans.append((len(ids), len(ids) + 1))
            ids.append(k + 10)
        return Sample("mqar", ids, spans)

    data = recall.MQARData.__new__(recall.MQARData)
    data.train_samples = [sample() for _ in range(n_train)]
    data.eval_samples = [sample() for _ in range(n_eval)]
    data.to_compact = {t: t for t in range(20)}
    data.vocab, data.context_len, data.n_pairs = 20, len(data.train_samples[0].ids), 3
    return data


def test_tensors_point_at_the_answers():
    data = _toy_data()
    ids, pos, tgt = data.tensors(data.eval_samples[:2])
    assert pos.shape == (6, 2) and tgt.shape == (6,)
    for (row, t), target in zip(pos.tolist(), tgt.tolist()):
        assert ids[row, t + 1] == target and 11 <= target <= 18


def test_training_lowers_the_loss_and_evaluate_counts_spans():
    data = _toy_data(n_train=32, n_eval=6)
    log = []
    cfg = recall.RecallConfig(("softmax", "softmax"), 32, steps=30, batch=8)
    model = recall.train(cfg, data, log)
    assert log[-1]["loss"] < log[0]["loss"]
    right, total = recall.evaluate(model, data)
    assert total == 18 and 0 <= right <= total
    row = recall.run(recall.RecallConfig(("delta",), 16, steps=2, batch=4), data)
    assert row["total"] == 18 and row["wilson95"] == list(wilson(row["right"], 18))


def _stored():
    """The three stored files this harness writes, with the module whose command wrote each and its task."""
    from labsrc import frontier

    return [(recall.DEFAULT_OUT, recall.GRID, "mqar"), (frontier.DEFAULT_OUT, frontier.GRID, "mqar"),
            (frontier.PASSKEY_OUT, frontier.GRID, "passkey")]


@pytest.mark.parametrize("index", range(3), ids=["recall_mqar", "frontier_mqar", "frontier_passkey"])
def test_stored_runs_were_made_by_the_current_code(index):
    path, grid, task = _stored()[index]
    stored = json.loads(path.read_text())
    mixers = [m for r in stored["runs"] for m in r["mixers"]]
    now = recall.code_version(mixers, task)
    assert stored["code_version"] == now, (
        f"{path.name} was made by code version {stored['code_version']}, but the code that decides its runs is "
        f"now {now}: rerun `{stored['command']}` (labsrc/data/README.md) and commit the new file")


@pytest.mark.parametrize("index", range(3), ids=["recall_mqar", "frontier_mqar", "frontier_passkey"])
def test_stored_results_are_well_formed(index):
    path, grid, task = _stored()[index]
    stored = json.loads(path.read_text())
    module = "labsrc.recall" if grid is recall.GRID else "labsrc.frontier"
    assert stored["command"].startswith(f"python -m {module} ") and f"--steps {stored['train']['steps']}" in \
        stored["command"]
    assert stored["runs"] and stored["task"]["n_eval"] >= 100
    for row in stored["runs"]:
        assert row["model"] in grid and tuple(row["mixers"]) == grid[row["model"]]
        assert row["steps"] == stored["train"]["steps"]
        assert 0 <= row["right"] <= row["total"] and row["accuracy"] == row["right"] / row["total"]
        assert row["wilson95"] == pytest.approx(list(wilson(row["right"], row["total"])))
    seeds, widths = stored["train"]["seeds"], stored["train"]["widths"]
    assert len(set(seeds)) >= 3 and len(set(widths)) >= 2, "at least three seeds and two widths per variant"
    runs = sorted((r["model"], r["d_model"], r["seed"]) for r in stored["runs"])
    assert runs == sorted((m, w, s) for m in grid for w in widths for s in seeds), "one row per variant, width, seed"
    summary = recall.across_seeds(stored["runs"])
    assert all(e.n == len(seeds) and e.lo <= e.value <= e.hi for e in summary.values())


def test_both_chapters_train_the_same_model_the_same_way():
    """The disagreement this harness once had (0.51 against 0.86 for one configuration): where chapter 8's grid
    and chapter 15's comparison hold the same model (two softmax layers) at the same width, seed and task, the
    stored results are the same, run for run."""
    from labsrc import frontier

    a, b = (json.loads(p.read_text()) for p in (recall.DEFAULT_OUT, frontier.DEFAULT_OUT))
    same_task = {k: v for k, v in a["task"].items()} == {k: v for k, v in b["task"].items()}
    assert same_task and a["train"]["steps"] == b["train"]["steps"] and a["train"]["batch"] == b["train"]["batch"]
    ours = {(r["d_model"], r["seed"]): r for r in a["runs"] if r["model"] == "softmax"}
    theirs = {(r["d_model"], r["seed"]): r for r in b["runs"] if r["model"] == "standard"}
    common = set(ours) & set(theirs)
    assert len(common) >= 3
    for key in common:
        assert (ours[key]["right"], ours[key]["params"]) == (theirs[key]["right"], theirs[key]["params"]), key


def test_code_version_follows_the_code_not_the_comments_around_it(monkeypatch):
    base = recall.code_version(["softmax"], "mqar")
    assert base == recall.code_version(["softmax", "softmax"], "mqar") and len(base) == 16
    assert base != recall.code_version(["softmax"], "passkey") != recall.code_version(["linear"], "passkey")

    class Probe(recall.SoftmaxMixer):
        pass

    class ProbeChanged(recall.SoftmaxMixer):
        scale = 2.0

    monkeypatch.setitem(recall.MIXERS, "probe", Probe)
    first = recall.code_version(["probe"], "mqar")
    assert first == recall.code_version(["probe"], "mqar")
    monkeypatch.setitem(recall.MIXERS, "probe", ProbeChanged)
    assert recall.code_version(["probe"], "mqar") != first                   # an edit inside the mixer counts
    with pytest.raises(ValueError, match="unknown mixer 'nope'"):
        recall.code_version(["nope"], "mqar")


def test_across_seeds_is_a_t_interval_over_seeds():
    runs = [{"model": "m", "d_model": 8, "accuracy": a} for a in (0.2, 0.4, 0.6)]
    e = recall.across_seeds(runs)[("m", 8)]
    assert e.n == 3 and e.value == pytest.approx(0.4)
    assert e.hi - e.value == pytest.approx(4.303 * 0.2 / 3 ** 0.5, rel=1e-3)   # t(0.975, 2 df) sd / sqrt(n)


def test_main_writes_command_version_and_one_row_per_seed(tmp_path):
    out = tmp_path / "r.json"
    assert recall.main(["--out", str(out), "--models", "softmax", "--widths", "16", "--seeds", "0", "1",
                        "--steps", "2", "--batch", "4", "--n-train", "20", "--n-eval", "4"]) == 0
    stored = json.loads(out.read_text())
    assert stored["code_version"] == recall.code_version(["softmax"], "mqar")
    assert "--seeds 0 1" in stored["command"] and "--n-eval 4" in stored["command"]
    assert [r["seed"] for r in stored["runs"]] == [0, 1]


# ------------------------------------------------------------------------------------------- the pass key
def test_passkey_shapes_and_answer_positions():
    d = recall.PassKeyData(key_len=3, context_len=20, n_train=30, n_eval=10, seed=1, n_symbols=5, n_filler=7)
    assert d.vocab == 3 + 5 + 7 and d.chance == 5 ** -3
    assert len(d.train_samples) == 30 and len(d.eval_samples) == 10
    for s in d.train_samples + d.eval_samples:
        assert len(s.ids) == 20 and s.spans == ((17, 20),)
        key = s.ids[s.depth + 1:s.depth + 4]
        assert s.ids[s.depth] == d.KEY and s.ids[16] == d.QUERY and s.ids[17:] == key
        assert all(3 <= t < 8 for t in key)                       # key symbols
        assert s.ids.count(d.KEY) == 1 and s.ids.count(d.QUERY) == 1
        others = [t for i, t in enumerate(s.ids) if not s.depth <= i < s.depth + 4 and i < 16]
        assert all(8 <= t < d.vocab for t in others)              # everything else is filler
    assert len({s.depth for s in d.train_samples}) > 1             # the depth varies
    ids, pos, tgt = d.tensors(d.eval_samples[:4])
    assert ids.shape == (4, 20) and pos.shape == (12, 2) and tgt.shape == (12,)
    assert pos[:3].tolist() == [[0, 16], [0, 17], [0, 18]]         # predicted from the token before
    assert torch.equal(tgt, ids[pos[:, 0], pos[:, 1] + 1])


def test_passkey_is_deterministic_in_its_seed():
    a, b = recall.PassKeyData(n_train=20, n_eval=5), recall.PassKeyData(n_train=20, n_eval=5)
    c = recall.PassKeyData(n_train=20, n_eval=5, seed=1)
    assert a.train_samples == b.train_samples and a.eval_samples == b.eval_samples
    assert a.train_samples != c.train_samples
    assert a.train_samples[:5] != a.eval_samples                   # separate streams
    with pytest.raises(ValueError, match="context_len"):
        recall.PassKeyData(key_len=4, context_len=9)


def test_a_trained_softmax_model_finds_the_pass_key_above_chance():
    torch.set_num_threads(1)
    d = recall.PassKeyData(key_len=2, context_len=24, n_train=400, n_eval=60, n_symbols=8, n_filler=16)
    model = recall.train(recall.RecallConfig(("softmax", "softmax"), 32, steps=150, batch=32), d)
    right, total = recall.evaluate(model, d)
    assert total == 60
    assert wilson(right, total)[0] > 10 * d.chance                 # the interval's lower end, not the point


def test_code_version_is_the_stored_curves_digest_over_the_same_objects():
    """One digest for every stored result (issue 42): recall's is labsrc.curves.source_version over the core,
    the data class and the mixers, each with the functions its code_deps name."""
    from labsrc import curves

    objects = [getattr(recall, name) for name in recall._CORE]
    objects += recall._with_deps(recall.DATA["mqar"]) + recall._with_deps(recall.MIXERS["linear"])
    assert recall.code_version(["linear"], "mqar") == curves.source_version(*objects)
