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


def test_stored_results_are_well_formed():
    stored = json.loads(recall.DEFAULT_OUT.read_text())
    assert stored["task"]["n_pairs"] >= 1 and stored["runs"]
    for row in stored["runs"]:
        assert row["model"] in recall.GRID and tuple(row["mixers"]) == recall.GRID[row["model"]]
        assert 0 <= row["right"] <= row["total"] and row["accuracy"] == row["right"] / row["total"]
        lo, hi = wilson(row["right"], row["total"])
        assert row["wilson95"] == pytest.approx([lo, hi])
    models = {(r["model"], r["d_model"]) for r in stored["runs"]}
    widths = {w for _, w in models}
    assert models == {(m, w) for m in recall.GRID for w in widths}, "every mixer at every width"


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
