"""The lab's tokenizer and shipped models: round trip, load(), eval cards reproduced, training smoke run."""
from __future__ import annotations

import math
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labsrc import models, tasks
from labsrc.data import TOKENIZER_PATH, load_text, load_tokenizer
from labsrc.models import train as training

TEXTS = ["It is a truth universally acknowledged, that a single man...", "The pass key is 40917. Remember it.",
         "\"Oh!\" cried Marianne,\n\n--“quotes” café naïve 123 4567890", "  two  spaces\tand a tab  "]


def test_tokenizer_round_trip_and_digits():
    tok = load_tokenizer()
    assert 4096 <= len(tok) <= 8192
    for text in TEXTS + [load_text("validation")[:3000]]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    digits = tok.convert_ids_to_tokens(tok(" 40917", add_special_tokens=False)["input_ids"])
    assert digits[-5:] == list("40917")  # one token per digit


@pytest.mark.parametrize("name", models.SHIPPED)
def test_shipped_checkpoint_shape_and_config(name):
    model, tok = models.load(name)
    cfg = model.config
    card = models.eval_card(name)
    assert cfg.lab_trained_context == card["trained_context"]
    if name in ("lab-target", "lab-draft"):  # the bench v2 pair: a trained context of at least 1,024 tokens
        assert cfg.lab_trained_context >= 1024
    if name == "lab-mamba":  # chapter 7's state-space model: a Mamba-2, no attention
        assert type(model).__name__ == "Mamba2ForCausalLM"
        assert cfg.num_heads * cfg.head_dim == cfg.expand * cfg.hidden_size and cfg.n_groups >= 1
    else:
        assert type(model).__name__ == "LlamaForCausalLM"
        assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    enc = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert enc == load_tokenizer()(TEXTS[0], add_special_tokens=False)["input_ids"]
    n = sum(p.numel() for p in model.parameters())
    assert n == models.eval_card(name)["parameters"]
    if name == "lab-target":
        assert 8e6 <= n <= 15e6 and cfg.num_hidden_layers >= 6 and cfg.num_attention_heads == 8
    elif name == "lab-mamba":  # sized for chapter 7's CPU budget: smaller than lab-target (its eval card says)
        target = sum(p.numel() for p in models.load("lab-target")[0].parameters())
        assert 2e6 <= n < target
    else:
        target = sum(p.numel() for p in models.load("lab-target")[0].parameters())
        assert n <= target / 5


def test_tiny_mamba_config_trains_a_mamba2():
    """The arch switch used by lab-mamba: a few steps of the tiny Mamba-2 run and lower the loss."""
    cfg = replace(training.CONFIGS["tiny-mamba"], max_steps=6, time_budget_s=1e9)
    model, log, info = training.train(cfg, verbose=False)
    assert type(model).__name__ == "Mamba2ForCausalLM" and info["steps"] == 6
    assert all(math.isfinite(r["loss"]) for r in log) and log[-1]["loss"] < log[0]["loss"]


def test_checkpoints_fit_the_size_budget():
    # Four shipped models (lab-target 19 MB, lab-mamba 7 MB, two 3 MB drafts) in fp16 with their logs and
    # cards: a clone stays small, and a fifth model has to argue for its bytes.
    total = sum(f.stat().st_size for f in models.CHECKPOINTS.rglob("*") if f.is_file())
    assert total <= 36 * 2**20, f"checkpoints take {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", models.SHIPPED)
def test_load_reproduces_the_eval_card_perplexity(name):
    model, tok = models.load(name)
    card = models.eval_card(name)
    got = tasks.perplexity_by_position(model, tok, card["trained_context"], bucket=64)["overall"]
    assert math.isclose(got, card["validation_perplexity"], rel_tol=0.01), (got, card["validation_perplexity"])


def test_eval_card_and_log_are_complete():
    for name in models.SHIPPED:
        card = models.eval_card(name)
        for key in ("parameters", "train_minutes", "validation_perplexity", "passkey", "needle_accuracy",
                    "mqar_accuracy", "variable_tracking_accuracy", "passkey_beyond_trained_context",
                    "passkey_with_decoys"):
            assert key in card
        # lab-target's budget is two working sessions (it resumes from a checkpoint): 267 wall-minutes across
        # three sessions on shared cores, about 130 on quiet ones (1.3 s a step); the others fit one hour
        assert card["train_minutes"] <= (300 if name == "lab-target" else 60), (name, card["train_minutes"])
        log = models.train_log(name)
        assert len(log) == card["steps"] and log[-1]["tokens"] == card["tokens"]


def test_target_retrieves_pass_keys_inside_its_trained_context():
    # issue 3: at least 95% at every depth and length inside the trained context, 20 keys per cell
    card = models.eval_card("lab-target")
    grid = torch.tensor(card["passkey"]["accuracy"], dtype=torch.float64)
    assert card["passkey"]["n"] >= 20 and max(card["passkey"]["context_lens"]) == card["trained_context"]
    assert grid.shape == (len(card["passkey"]["depths"]), len(card["passkey"]["context_lens"]))
    assert float(grid.min()) == card["passkey"]["min_inside_trained_context"] >= 0.95, grid


def test_tiny_training_run_lowers_the_loss_within_20_steps():
    cfg = replace(training.CONFIGS["tiny"], max_steps=20, time_budget_s=1e9)  # steps, not seconds, on a busy CPU
    _, log, info = training.train(cfg, verbose=False)
    first = sum(r["loss"] for r in log[:3]) / 3
    last = sum(r["loss"] for r in log[-3:]) / 3
    assert info["steps"] == 20 and last < first - 0.3, (first, last)


def test_batches_are_deterministic_from_the_seed():
    tok = load_tokenizer()
    cfg = training.CONFIGS["tiny"]
    a = training.make_batch(cfg, tok, random.Random(0), 5)
    b = training.make_batch(cfg, tok, random.Random(0), 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == a[1].shape and a[0].numel() == cfg.batch_size * cfg.seq_len and a[1].any()


def test_eval_only_remeasures_the_card_and_keeps_the_training_record(tmp_path, monkeypatch):
    import shutil

    src = Path(models.resolve("lab-draft"))
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    before = models.eval_card(str(tmp_path))
    seen = []

    def fake_evaluate(model, tokenizer):  # the real one takes a minute; this checks what --eval-only does with it
        seen.append(type(model).__name__)
        return {"validation_perplexity": 123.0, "new_probe": [1.0]}

    monkeypatch.setattr(training, "evaluate", fake_evaluate)
    training.main(["lab-draft", "--out", str(tmp_path), "--eval-only"])
    after = models.eval_card(str(tmp_path))
    assert seen == ["LlamaForCausalLM"]  # measured on the saved weights, loaded back
    for key in ("steps", "tokens", "train_minutes", "train_config", "final_train_loss", "parameters"):
        assert after[key] == before[key]
    assert after["validation_perplexity"] == 123.0 and after["new_probe"] == [1.0]
    assert "passkey" not in after  # figures the probes no longer produce do not linger
    with pytest.raises(FileNotFoundError, match="needs a trained checkpoint"):
        training.main(["lab-draft", "--out", str(tmp_path / "empty"), "--eval-only"])


def test_bad_names_paths_and_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="lab-target, lab-draft"):
        models.load("lab-huge")
    with pytest.raises(FileNotFoundError, match="without a config.json"):
        models.load(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model"):
        models.load(str(tmp_path / "nowhere" / "deeper" / "x"))
    with pytest.raises(TypeError, match="name_or_path must be"):
        models.load(3)
    with pytest.raises(TypeError, match="dtype must be"):
        models.load("lab-draft", dtype=torch.int8)
    with pytest.raises(TypeError, match="cfg must be a TrainConfig"):
        training.train({"hidden_size": 8})
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="split must be"):
        load_text("test")
    with pytest.raises(SystemExit):
        training.main(["lab-gigantic"])
    assert Path(TOKENIZER_PATH).is_file()


def test_load_reproduces_the_eval_card_pass_keys_at_the_trained_length():
    # the card's weakest column, measured again on the model as loaded: the figure is not just a number in a file
    card = models.eval_card("lab-target")["passkey"]
    model, tok = models.load("lab-target")
    length = max(card["context_lens"])  # the trained length
    j = card["context_lens"].index(length)
    grid = tasks.passkey_grid(model, tok, [length], card["depths"], n=card["n"], seed=0)
    assert grid[:, 0].tolist() == pytest.approx([row[j] for row in card["accuracy"]], abs=1e-6)


def test_training_shows_a_progress_bar_with_the_time_left(capsys):
    from dataclasses import replace

    cfg = replace(training.CONFIGS["tiny"], max_steps=3)
    training.train(cfg, verbose=True)
    err = capsys.readouterr().err
    assert "training" in err and "3/3" in err and "step" in err, err[-500:]
    assert re.search(r"<\d\d:\d\d", err), "the bar shows the time left"
    training.train(cfg, verbose=False)
    assert capsys.readouterr().err == "", "verbose=False is silent"


def test_a_retrain_never_overwrites_a_checkpoint_without_overwrite(tmp_path):
    out = tmp_path / "lab-target"
    assert training.fresh_folder(out) == out, "a new folder is used as it is"
    out.mkdir()
    assert training.fresh_folder(out) == out, "so is an empty one"
    (out / "config.json").write_text("{}")
    assert training.fresh_folder(out) == tmp_path / "lab-target-retrained-1"
    (tmp_path / "lab-target-retrained-1").mkdir()
    (tmp_path / "lab-target-retrained-1" / "config.json").write_text("{}")
    assert training.fresh_folder(out) == tmp_path / "lab-target-retrained-2"


def test_main_trains_into_a_new_folder_unless_told_to_overwrite(tmp_path, monkeypatch):
    calls = []

    def fake_train(cfg, tokenizer, log_path, resume=None):
        calls.append(Path(log_path).parent)
        raise RuntimeError("stop here: only the folder is under test")

    monkeypatch.setattr(training, "train", fake_train)
    out = tmp_path / "lab-draft"
    out.mkdir()
    (out / "config.json").write_text("{}")
    for argv in (["lab-draft", "--out", str(out)], ["lab-draft", "--out", str(out), "--overwrite"]):
        with pytest.raises(RuntimeError, match="stop here"):
            training.main(argv)
    assert calls == [tmp_path / "lab-draft-retrained-1", out]
    assert (out / "config.json").read_text() == "{}"


def test_load_draws_no_progress_bar_and_leaves_the_setting_alone(capfd):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    models.load("lab-draft")
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err, "no progress widget in the book's outputs"
    assert hf_logging.is_progress_bar_enabled(), "the user's transformers setting is restored"


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """A run killed after its last saved state and resumed ends where the uninterrupted run ends: same weights,
    same log (the resumed steps draw the same batches, the optimiser has its moments back)."""
    cfg = replace(training.CONFIGS["tiny"], max_steps=8, checkpoint_every=3, time_budget_s=1e9)
    whole, log_whole, _ = training.train(cfg, verbose=False)
    state = tmp_path / training.RESUME_FILE
    real_batch = training.make_batch

    def dies_at_step_7(cfg, tokenizer, rng, step=None):
        if step == 7:
            raise KeyboardInterrupt("killed")
        return real_batch(cfg, tokenizer, rng, step)

    monkeypatch.setattr(training, "make_batch", dies_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        training.train(cfg, verbose=False, resume=state, log_path=tmp_path / "log.csv")
    monkeypatch.setattr(training, "make_batch", real_batch)
    assert torch.load(state, weights_only=False)["step"] == 6
    resumed, log_resumed, info = training.train(cfg, verbose=False, resume=state, log_path=tmp_path / "log.csv")
    assert info["steps"] == 8 and [r["loss"] for r in log_resumed] == [r["loss"] for r in log_whole]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert len(rows) == 1 + 8, "the log holds each step once, the re-done step 7 included"
    with pytest.raises(ValueError, match="another config.*lr"):
        training.train(replace(cfg, lr=1e-2), verbose=False, resume=state)
    training.train(replace(cfg, time_budget_s=5.0, threads=1), verbose=False, resume=state)  # run-only fields


def test_resume_flag_needs_an_interrupted_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no resume.pt in .*tiny or its -retrained"):
        training.main(["tiny", "--resume"])  # looks for checkpoints/tiny*, and there are none
    with pytest.raises(FileNotFoundError, match="run/resume.pt does not exist"):
        training.main(["tiny", "--out", str(tmp_path / "run"), "--resume"])


def _values(sample) -> list[str]:
    """The values a sample asks for or states: a pass key, a magic number, MQAR's values, a variable's name."""
    m = sample.meta
    key = [m["key"]] if sample.task == "passkey" else []
    return [v for v in (*key, m.get("value"), *m.get("pairs", {}).values(), m.get("variable")) if v is not None]


def test_training_samples_use_training_keys_values_and_prose_only():
    """No probe key, value or passage reaches the training mix: every synthetic training sample draws the
    training keys, the training class of values and the training prose (the probes draw the others)."""
    tok = load_tokenizer()
    cfg = training.CONFIGS["lab-target"]
    names, probs = zip(*{**cfg.task_mix, **cfg.short_task_mix, "copy": 0.1, "passage": 0.1}.items())
    rng = random.Random(cfg.seed)
    seen = set()
    train_text = tasks.corpus_ids(tok, "train")
    for _ in range(400):
        s = training._synthetic(replace(cfg, max_passage=100), tok, rng, names, probs, 600)
        seen.add(s.task)
        m = s.meta
        assert all(tasks.value_split(v) == "train" for v in _values(s)), (s.task, m)
        assert set(m.get("pairs", {})) <= set(tasks.TRAIN_KEYS)
        assert s.task != "needle" or m["key"] in tasks.TRAIN_KEYS
        if s.task == "needle":
            text = tok.decode(s.ids)
            assert not any(f"number for {k} is" in text for k in tasks.KEYS), text
        if s.task == "copy":
            assert set(m["words"].split()) <= set(tasks.TRAIN_KEYS)
        for d in m.get("decoys", []):
            assert all(tasks.value_split(x) == "train" for x in re.findall(r"\d+", d)), d
    assert {"passkey", "needle", "mqar", "variable_tracking", "passage"} <= seen, seen
    ctx = training.CONFIGS["lab-target"].seq_len
    at = int(training.PROBE_FRACTION * ctx)
    for task in ("passkey", *training.PROBE_SETTINGS):
        for s in training.probe_set(tok, task, at, n=20):
            m = s.meta
            assert all(tasks.value_split(v) == "validation" for v in _values(s)), (task, m)
            assert set(m.get("pairs", {})) <= set(tasks.KEYS)
            assert task != "needle" or m["key"] in tasks.KEYS
            if task == "passage":  # validation prose, which training never reads
                p = torch.tensor(s.ids[s.spans[0][0]:s.spans[-1][1]])
                windows = train_text.unfold(0, 16, 1)
                assert not (windows == p[:16]).all(1).any(), "a probe passage's opening is in the training prose"


def test_copy_alignments_point_each_copied_token_at_its_source():
    ids = torch.tensor([[1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18, 4]])
    answers = torch.zeros_like(ids, dtype=torch.bool)
    answers[0, 12:21] = True  # the repeat of 10..18
    pairs = training.copy_alignments(ids, answers)
    assert pairs == [(0, 11 + i, 1 + i) for i in range(9)]
    for b, q, src in pairs:
        assert ids[b, q + 1] == ids[b, src], "the query predicts the token at its source"
    short = torch.zeros_like(answers)
    short[0, 12:16] = True  # four answer tokens: a pass key or an MQAR value, not a copy
    assert training.copy_alignments(ids, short) == []


def test_attention_guide_scores_are_the_models_own_attention():
    """The guide recomputes the guided heads' attention from the layers' inputs: it must be exactly the
    attention the model computes (checked against transformers' eager attention weights)."""
    from transformers import LlamaForCausalLM

    tok = load_tokenizer()
    cfg = replace(training.CONFIGS["tiny"], num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(training.model_config(cfg, tok)).eval()
    model.config._attn_implementation = "eager"
    guide = training.AttentionGuide(model, heads=3)
    ids = torch.randint(5, len(tok), (2, 37))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
        for layer in (0, 1):
            got = guide._log_attention(layer).exp()
            assert torch.allclose(got, out.attentions[layer][:, :3].float(), atol=1e-5), layer
        answers = torch.zeros_like(ids, dtype=torch.bool)
        ids[:, 20:30] = ids[:, 3:13]
        answers[:, 20:30] = True
        loss = guide.loss(ids, answers)
    prev = -torch.log(torch.diagonal(out.attentions[0][:, :3], offset=-1, dim1=-2, dim2=-1)).mean()
    assert loss > prev > 0, "the previous-token term, plus the copy term"
    guide.remove()
    assert not model.model.layers[0].self_attn._forward_pre_hooks


def test_guidance_fades_out_and_pulls_the_heads_where_it_says():
    cfg = replace(training.CONFIGS["tiny"], guide_steps=40, max_steps=40, lr=1e-2, time_budget_s=1e9,
                  task_mix={"copy": 1.0}, p_corpus=0.0)
    assert [training._guide_weight(cfg, s) for s in (0, 19, 20, 30, 39, 40)] == [1.0, 1.0, 1.0, 0.5, 0.05, 0.0]
    model, log, _ = training.train(cfg, verbose=False)
    guided = [r["guide_loss"] for r in log if r["guide_loss"] is not None]
    assert len(guided) == 40 and guided[-1] < guided[0] / 2, (guided[0], guided[-1])
    with pytest.raises(ValueError, match="guidance.*needs attention"):
        training.train(replace(training.CONFIGS["tiny-mamba"], guide_steps=2), verbose=False)


def test_lab_target_curriculum_stages():
    cfg = training.CONFIGS["lab-target"]
    tok = load_tokenizer()
    starts, step = [], 0
    for steps, length, p_corpus, mix in cfg.curriculum:
        assert training.row_length(cfg, step) == training.row_length(cfg, step + steps - 1) == length
        starts.append(step)
        step += steps
    assert training.row_length(cfg, step) == cfg.short_len  # then growing
    assert training.row_length(cfg, step + cfg.grow_steps) == cfg.seq_len == 1024
    assert training.row_length(cfg, None) == cfg.seq_len
    rng = random.Random(0)
    for s in starts + [cfg.max_steps - 1]:
        ids, answers = training.make_batch(cfg, tok, rng, s)
        assert ids.numel() == cfg.batch_size * cfg.seq_len and answers.any()
    first = training.make_batch(cfg, tok, rng, 0)
    assert training.copy_alignments(*first), "the first stage is copying"


@pytest.mark.slow
@pytest.mark.parametrize("task", ["passkey", *training.PROBE_SETTINGS])
def test_eval_card_probes_are_recomputed_on_a_prefix(task):
    """The eval card's headline probes, recomputed on the first 20 of their samples (a probe of 20 is a prefix
    of the probe of 100): each sample's result is the card's, so the card's accuracy and interval are the
    model's, not numbers in a file."""
    card = models.eval_card("lab-target")["probes"][task]
    assert card["n"] >= 100 and len(card["per_sample"]) == card["n"]
    per = card["per_sample"]
    assert card["accuracy"] == pytest.approx(sum(per) / len(per))
    assert card["ci95"] == pytest.approx(training._interval(per)["ci95"])
    model, tok = models.load("lab-target")
    samples = training.probe_set(tok, task, card["context_len"], n=20)
    got = [sum(r) / len(r) for r in tasks.score(model, samples)]
    assert got == pytest.approx(per[:20], abs=1e-4)
    lo, hi = card["ci95"]
    assert lo <= card["accuracy"] <= hi


def test_eval_card_progress_bar_counts_every_stage(monkeypatch):
    """The eval card's progress bar (train.evaluate) advances once per measured stage and ends full, at both
    trained contexts (512, and another, which adds the perplexity at 512); the measurements are faked here."""
    bars = []

    class Bar:
        def __init__(self, total, disable=False, **kw):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def set_postfix_str(self, text):
            pass

        def update(self, k=1):
            self.n += k

        def close(self):
            self.closed = True

    from labsrc.models import card as eval_card  # the eval card's module: train re-exports evaluate from it

    grid = torch.ones(len(training.PASSKEY_FRACTIONS), len(training.PASSKEY_DEPTHS))
    monkeypatch.setattr(eval_card, "tqdm", Bar)
    monkeypatch.setattr(training.tasks, "perplexity_by_position", lambda *a, **k: {
        "overall": 1.0, "n_windows": 1, "positions": [], "perplexity": []})
    monkeypatch.setattr(training.tasks, "passkey_grid", lambda *a, **k: grid)
    monkeypatch.setattr(training.tasks, "variable_tracking_accuracy", lambda *a, **k: 1.0)
    monkeypatch.setattr(eval_card, "probe", lambda *a, **k: {"accuracy": 1.0})
    for ctx in (512, 768):
        card = training.evaluate(None, None, context_len=ctx)
        assert bars[-1].closed and bars[-1].n == bars[-1].total, (ctx, bars[-1].n, bars[-1].total)
        assert ("validation_perplexity_512" in card) == (ctx != 512)


def test_the_probes_length_is_one_function_that_every_stored_run_uses():
    """90% of the trained context, defined once (issue 42): the three sweeps and chapter 12's stored run use
    labsrc.models.context_len itself, not a copy of it."""
    from types import SimpleNamespace

    from labsrc import weight_quant
    from labsrc.sweeps import kv_eviction, kv_quant, serving

    for user in (kv_eviction, kv_quant, serving):
        assert user.context_len is models.context_len, user.__name__
    assert weight_quant.probe_context is models.context_len
    fake = SimpleNamespace(config=SimpleNamespace(lab_trained_context=512))
    assert models.context_len(fake) == int(training.PROBE_FRACTION * 512) == 460
