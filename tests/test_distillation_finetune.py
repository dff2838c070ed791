"""Fine-tuning distillation from the trained lab-draft (labsrc.distillation, issue #33 section 2): each loss on
hand-checked cases with its gradient, the TV loss as one minus the acceptance, the run's start, determinism and
shared data order, the experiment file's resumption, and ship-finetuned's refusals. Tiny sizes throughout:
a few steps of rows of 48 tokens; the slow tests measure a few-step draft and the shipped one on held-out text.
"""
import labsrc  # noqa: F401

import json
import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from labsrc import distillation

TINY = distillation.FinetuneConfig(steps=2, seq_len=48, batch_size=2, warmup_steps=1)


@pytest.fixture(scope="module")
def models():
    from labsrc.models import load

    target, tok = load("lab-target")
    draft, _ = load("lab-draft")
    return target, draft, tok


def logits_of(*probs):
    """Logits whose softmax is each given distribution (log-probabilities)."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


# --------------------------------------------------------------------------------------------------- losses
def test_tv_loss_on_a_hand_checked_case_and_one_minus_the_acceptance():
    s = logits_of([0.5, 0.3, 0.2], [0.25, 0.25, 0.5])
    t = logits_of([0.2, 0.3, 0.5], [0.25, 0.25, 0.5])
    # row 0: 1/2 (0.3 + 0 + 0.3) = 0.3; row 1: identical, 0
    assert float(distillation.tv_loss(s, t)) == pytest.approx(0.15, abs=1e-6)
    labels = torch.tensor([1, -100])
    assert float(distillation.tv_loss(s, t, labels)) == pytest.approx(0.3, abs=1e-6)
    assert float(distillation.expected_acceptance(s, t, labels)) == pytest.approx(0.7, abs=1e-6)

    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 41, generator=gen) * 2, torch.randn(3, 5, 41, generator=gen) * 2
    labels = torch.randint(0, 41, (3, 5), generator=gen)
    labels[0, 3:] = -100
    for lab in (None, labels):
        assert float(distillation.tv_loss(s, t, lab)) == pytest.approx(1 - float(distillation.expected_acceptance(s, t, lab)),
                                                                  abs=1e-6)


def test_tv_loss_gradient_is_the_hand_derived_one():
    """d TV / d z_j = p_j (sign_j - sum_v p_v sign_v) / 2, sign_v = sign(p_v - t_v), divided by the tokens."""
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    z = s.clone().requires_grad_(True)
    distillation.tv_loss(z, t).backward()
    p, q = F.softmax(s.double(), -1), F.softmax(t.double(), -1)
    sign = torch.sign(p - q)
    want = p * (sign - (p * sign).sum(-1, keepdim=True)) / 2 / 4
    torch.testing.assert_close(z.grad.double(), want, rtol=1e-5, atol=1e-7)


def test_forward_kl_and_the_symmetric_jsd_on_a_hand_checked_case_with_gradients():
    s = logits_of([0.9, 0.1])
    t = logits_of([0.5, 0.5])
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)      # KL(t || s)
    m = [0.7, 0.3]                                                   # (s + t) / 2
    jsd = 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)) \
        + 0.5 * (0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3))
    for fn, want in ((lambda a, b: distillation.kd_loss(a, b, T=1.0), kl),
                     (lambda a, b: distillation.generalized_jsd(a, b, beta=distillation.GKD_BETA), jsd)):
        z = s.clone().requires_grad_(True)
        loss = fn(z, t)
        assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
        loss.backward()
        assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0
        # descending the gradient lowers the loss: the student moves towards the teacher
        assert float(fn((z - 0.1 * z.grad).detach(), t)) < float(loss.detach())


def test_the_control_is_lab_drafts_own_objective_on_a_hand_checked_case():
    """ce: the mean NLL over prose tokens plus answer_weight x the mean over answer tokens."""
    from labsrc.models import train as tr

    logits = logits_of([0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6])[None].requires_grad_(True)
    ids = torch.tensor([[0, 1, 2]])
    answers = torch.tensor([[False, False, True]])
    loss, _, _ = tr.training_loss(logits, ids, answers, 1.0)
    assert float(loss.detach()) == pytest.approx(-math.log(0.25) - math.log(0.1), rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, :2].abs().sum() > 0


def test_the_symmetric_jsd_is_sandwiched_by_total_variation():
    """GKD_BETA's justification: TV²/2 <= JSD_0.5 <= TV ln 2, where either KL can be huge at a small TV."""
    gen = torch.Generator().manual_seed(2)
    for scale in (0.3, 2.0, 8.0):
        s, t = torch.randn(64, 23, generator=gen) * scale, torch.randn(64, 23, generator=gen) * scale
        p, q = F.softmax(s.double(), -1), F.softmax(t.double(), -1)
        tv = 0.5 * (p - q).abs().sum(-1)
        jsd = distillation.losses._gjsd_per_token(p.log(), q.log(), 0.5)
        assert (tv ** 2 / 2 <= jsd + 1e-12).all() and (jsd <= tv * math.log(2) + 1e-12).all()
    # a small TV with a huge KL: a token the draft all but never proposes
    s, t = logits_of([0.999999, 1e-6]), logits_of([0.99, 0.01])
    assert float(distillation.kd_loss(s, t, T=1.0)) > 0.05 > float(distillation.tv_loss(s, t)) == pytest.approx(0.01, abs=1e-5)


# ------------------------------------------------------------------------------------------------ the run
def test_a_run_starts_from_the_shipped_lab_draft_and_leaves_it_unchanged(models):
    from labsrc.models import load

    target, draft, tok = models
    shipped, _ = load("lab-draft")
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    zero, log, info = distillation.finetune_run("kd", distillation.FinetuneConfig(steps=0), 0, teacher=target, draft=draft,
                                                tokenizer=tok)
    assert log == [] and info["steps"] == 0 and info["start"] == "lab-draft"
    for k, v in shipped.state_dict().items():
        assert torch.equal(zero.state_dict()[k], v), k
    one, _, _ = distillation.finetune_run("kd", TINY, 0, teacher=target, draft=draft, tokenizer=tok)
    assert any(not torch.equal(one.state_dict()[k], v) for k, v in before.items())
    for k, v in draft.state_dict().items():  # the argument is copied, never trained
        assert torch.equal(v, before[k]), k


def test_runs_are_deterministic_per_seed_and_every_method_sees_the_same_data(models):
    from labsrc.models import train as tr

    target, draft, tok = models
    runs = {m: distillation.finetune_run(m, TINY, 3, teacher=target, draft=draft, tokenizer=tok)
            for m in distillation.FINETUNE_DEFAULT}
    batches = {m: [r["batch"] for r in log] for m, (_, log, _) in runs.items()}
    assert len({tuple(b) for b in batches.values()}) == 1, batches
    # and those are the batches of lab-draft's data stream from random.Random(seed)
    import random

    rng = random.Random(3)
    want = [distillation.batch_digest(tr.make_batch(TINY.data_config(3), tok, rng, None)[0]) for _ in range(2)]
    assert batches["ce"] == want
    for m, (student, log, info) in runs.items():
        assert all(math.isfinite(r["loss"]) for r in log) and info["method"] == m and info["seed"] == 3
        assert info["tokens"] == 2 * TINY.batch_size * (TINY.seq_len - 1)   # the same budget for each
    again, log2, _ = distillation.finetune_run("gkd", TINY, 3, teacher=target, draft=draft, tokenizer=tok)
    assert [r["loss"] for r in log2] == [r["loss"] for r in runs["gkd"][1]]
    for k, v in runs["gkd"][0].state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    _, other, _ = distillation.finetune_run("ce", TINY, 4, teacher=target, draft=draft, tokenizer=tok)
    assert [r["batch"] for r in other] != batches["ce"]


def test_on_policy_rows_keep_the_data_prefix_and_sample_the_rest():
    gen = torch.Generator().manual_seed(0)
    vocab = 11

    class Uniformish(torch.nn.Module):   # a model whose next-token distribution depends on nothing
        config = None

        def forward(self, input_ids, cache=None, use_cache=False):
            out = torch.zeros(*input_ids.shape, vocab)
            out[..., 3] = 5.0
            return type("Out", (), {"logits": out})()

    class Cache:
        pass

    import labsrc.speculative as spec

    orig = spec._new_cache
    spec._new_cache = lambda model: Cache()
    try:
        prefix = torch.tensor([[1, 2, 3], [4, 5, 6]])
        rows = distillation.sample_continuations(Uniformish(), prefix, 40, gen)
    finally:
        spec._new_cache = orig
    assert rows.shape == (2, 43) and torch.equal(rows[:, :3], prefix)
    share = float((rows[:, 3:] == 3).float().mean())
    p3 = math.exp(5) / (math.exp(5) + vocab - 1)
    assert abs(share - p3) < 0.1      # sampled at temperature 1, not greedy (p3 = 0.94)


@pytest.mark.parametrize("bad, match", [
    (dict(steps=-1), "steps"), (dict(seq_len=4), "seq_len"), (dict(lr=0.0), "lr"), (dict(beta=1.5), "beta"),
    (dict(policy_frac=1.0), "policy_frac"), (dict(p_corpus=2.0), "p_corpus"), (dict(batch_size=0), "batch_size"),
])
def test_finetune_config_refuses_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        distillation.FinetuneConfig(**bad)


def test_finetune_run_refuses_an_unknown_method_or_seed():
    with pytest.raises(ValueError, match="method"):
        distillation.finetune_run("nope", TINY)
    with pytest.raises(ValueError, match="seed"):
        distillation.finetune_run("ce", TINY, seed=-1)


# ---------------------------------------------------------------------------------------- the experiment
def fake_figures(alpha, per_window=None):
    keys = {k: alpha for k in distillation.SUMMARY_KEYS}
    per_window = per_window or [alpha] * 4
    return {**keys, "per_window": {"alpha": per_window, "kl": per_window, "tv": [1 - a for a in per_window]},
            "probes": {"passkey": {"all": per_window, "answer": per_window}}, "eval_seconds": 0.0}


@pytest.fixture
def fake_lab(monkeypatch):
    """The experiment without models: load, the tokenizer, the stamp, the run and the figures are stand-ins;
    ``calls`` lists the (method, seed) runs made, ``fail`` the ones that raise (an interruption)."""
    import labsrc.data
    import labsrc.models

    class Model(str):   # a stand-in model: its name, and the config field ship-finetuned reads
        config = SimpleNamespace(lab_trained_context=512)

    state = {"calls": [], "fail": set(), "stamp": {"lab-target": "t0", "lab-draft": "d0"}}
    monkeypatch.setattr(labsrc.models, "load", lambda name, **kw: (Model(f"model {name}"), "tok"))
    monkeypatch.setattr(labsrc.data, "load_tokenizer", lambda: "tok")
    monkeypatch.setattr(distillation.finetune, "models_stamp", lambda *names: {n: state["stamp"][n] for n in names})

    def run(method, cfg, seed, **kw):
        if (method, seed) in state["fail"]:
            raise KeyboardInterrupt
        state["calls"].append((method, seed))
        return f"{method}-{seed}", [{"loss": 1.0 + seed, "batch": f"b{seed}"}], {
            "method": method, "seed": seed, "train_seconds": 1.0, "threads": 1, "train_config": {}}

    monkeypatch.setattr(distillation.finetune, "finetune_run", run)
    def figures(model, *args):   # lab-draft 0.5; a run of seed s 0.6 + 0.01 s; a saved folder 0.61
        tail = model.rsplit("-", 1)[-1]
        return fake_figures(0.5 if model == "model lab-draft" else 0.6 + 0.01 * int(tail) if tail.isdigit()
                            else 0.61)

    monkeypatch.setattr(distillation.finetune, "finetune_figures", figures)
    return state


def test_the_experiment_file_resumes_per_method_and_seed(tmp_path, fake_lab):
    out = tmp_path / "ft.json"
    fake_lab["fail"] = {("kd", 1)}
    with pytest.raises(KeyboardInterrupt):
        distillation.main(["finetune-experiment", "--steps", "5", "--seeds", "0", "1", "2", "--methods", "ce", "kd",
                      "--out", str(out)])
    first = json.loads(out.read_text())
    assert {(r["method"], r["seed"]) for r in first["rows"]} == {("ce", 0), ("kd", 0), ("ce", 1)}
    assert first["complete"] is False and first["models"] == {"lab-target": "t0", "lab-draft": "d0"}
    assert first["command"].startswith("python -m labsrc.distillation finetune-experiment --steps 5 --seeds 0 1 2 ")
    assert "--methods ce kd" in first["command"] and first["command"].endswith(f"--out {out}")
    fake_lab["fail"] = set()
    fake_lab["calls"].clear()
    assert distillation.main(["finetune-experiment", "--steps", "5", "--seeds", "0", "1", "2", "--methods", "ce",
                         "kd", "--out", str(out)]) == 0
    assert fake_lab["calls"] == [("kd", 1), ("ce", 2), ("kd", 2)]        # only the missing runs
    done = json.loads(out.read_text())
    assert done["complete"] is True and len(done["rows"]) == 6 and len(done["sessions"]) == 2
    assert done["rows"][:3] == first["rows"]
    s = done["summary"]
    assert s["ce"]["alpha_prose"]["n"] == 3 and s["ce"]["alpha_prose"]["value"] == pytest.approx(0.61)
    assert s["ce"]["alpha_prose"]["method"] == "Student t" and s["lab-draft"]["alpha_prose"]["n"] == 4
    table = distillation.finetune_table(done).splitlines()
    assert table[2].startswith("| lab-draft | - | 0.500 [0.500, 0.500] |")   # four equal windows
    # 0.60, 0.61, 0.62: mean 0.61, sd 0.01, Student t (2 df) 4.303 -> half-width 0.0248
    assert table[3].startswith("| ce | 3 | 0.610 [0.585, 0.635] |") and table[4].startswith("| kd | 3 |")
    # a file made with other checkpoints or settings is refused, not written over
    fake_lab["stamp"]["lab-target"] = "t1"
    with pytest.raises(ValueError, match="models"):
        distillation.main(["finetune-experiment", "--steps", "5", "--out", str(out)])
    fake_lab["stamp"]["lab-target"] = "t0"
    with pytest.raises(ValueError, match="config"):
        distillation.main(["finetune-experiment", "--steps", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == done


def results_with(method_alphas, draft_windows, method="tv", stamp=None):
    rows = [{"method": method, "seed": i, "train": {"train_seconds": 1.0, "threads": 1},
             "eval": fake_figures(a), "losses": [1.0]} for i, a in enumerate(method_alphas)]
    return {"models": stamp or {"lab-target": "t0", "lab-draft": "d0"}, "rows": rows,
            "config": {**asdict(TINY)}, "eval": {**asdict(distillation.FinetuneEval()),
                                                        "probe_tasks": ["passkey"]},
            "lab_draft": fake_figures(sum(draft_windows) / len(draft_windows), draft_windows)}


def test_ship_decision_needs_separated_intervals_and_three_seeds():
    # 0.60, 0.61, 0.62: mean 0.61, sd 0.01, Student t (2 df) 4.303 -> [0.585, 0.635]
    above = results_with([0.60, 0.61, 0.62], [0.50, 0.52, 0.54, 0.52])
    ok, why = distillation.ship_decision(above, "tv")
    assert ok and "separate" in why
    overlapping = results_with([0.50, 0.56, 0.62], [0.50, 0.52, 0.54, 0.52])
    ok, why = distillation.ship_decision(overlapping, "tv")
    assert not ok and "overlapping" in why and "shipping nothing" in why
    ok, why = distillation.ship_decision(results_with([0.70, 0.71], [0.5, 0.5, 0.5]), "tv")
    assert not ok and "2 seed(s)" in why
    with pytest.raises(ValueError, match="no run of method"):
        distillation.ship_decision(above, "kd")
    with pytest.raises(ValueError, match="metric"):
        distillation.ship_decision(above, "tv", metric="kl")


@pytest.fixture
def fake_ship(tmp_path, monkeypatch, fake_lab):
    import labsrc.models

    written = []
    monkeypatch.setattr(labsrc.models, "CHECKPOINTS", tmp_path)

    def save_student(student, log, info, out, teacher, tokenizer, **kw):
        written.append((Path(out), info, kw))
        Path(out).mkdir(parents=True, exist_ok=True)
        return {}

    monkeypatch.setattr(distillation.finetune, "save_student", save_student)
    shipped = tmp_path / "lab-draft-distilled"
    shipped.mkdir()
    (shipped / "model.safetensors").write_text("the shipped weights")
    return written, shipped


def test_ship_finetuned_ships_nothing_without_separation(tmp_path, fake_ship, fake_lab, capsys):
    written, shipped = fake_ship
    res = tmp_path / "ft.json"
    res.write_text(json.dumps(results_with([0.50, 0.56, 0.62], [0.50, 0.52, 0.54, 0.52])))
    assert distillation.main(["ship-finetuned", "--method", "tv", "--results", str(res)]) == 1
    assert "shipping nothing" in capsys.readouterr().out
    assert written == [] and fake_lab["calls"] == []         # not even trained
    # results computed with other checkpoints are refused too
    res.write_text(json.dumps(results_with([0.60, 0.61, 0.62], [0.5] * 4, stamp={"lab-target": "old",
                                                                                 "lab-draft": "d0"})))
    assert distillation.main(["ship-finetuned", "--method", "tv", "--results", str(res)]) == 1
    assert "other checkpoints" in capsys.readouterr().out and written == []
    assert (shipped / "model.safetensors").read_text() == "the shipped weights"


def test_ship_finetuned_never_overwrites_a_shipped_checkpoint_without_overwrite(tmp_path, fake_ship, fake_lab,
                                                                               monkeypatch):
    import labsrc.models

    written, shipped = fake_ship
    res = tmp_path / "ft.json"
    res.write_text(json.dumps(results_with([0.60, 0.61, 0.62], [0.50, 0.52, 0.54, 0.52])))
    assert distillation.main(["ship-finetuned", "--method", "tv", "--results", str(res), "--seed", "1"]) == 0
    folder, info, kw = written[-1]
    assert folder == tmp_path / "lab-draft-distilled-retrained-1"
    assert fake_lab["calls"] == [("tv", 1)]
    assert info["shipped_at"].endswith("Z") and info["train_seconds"] == 1.0 and "separate" in info["decision"]
    assert kw["command"] == "python -m labsrc.distillation ship-finetuned --method tv --seed 1 --metric alpha_prose"
    assert kw["models"] == ("lab-target", "lab-draft")
    card = json.loads((folder / "eval_card.json").read_text())
    assert card["finetune"]["alpha_prose"] == pytest.approx(0.61)        # measured on the saved weights
    assert card["finetune_lab_draft"]["alpha_prose"] == pytest.approx(0.52)
    assert distillation.main(["ship-finetuned", "--method", "tv", "--results", str(res), "--overwrite"]) == 0
    assert written[-1][0] == shipped
    assert (shipped / "model.safetensors").read_text() == "the shipped weights", "only save_student writes"
    with pytest.raises(ValueError, match="seed"):
        distillation.main(["ship-finetuned", "--method", "tv", "--results", str(res), "--seed", "7"])


# ------------------------------------------------------------------------------------ measured (slow)
@pytest.mark.slow
def test_a_few_step_fine_tuned_draft_beside_lab_draft_on_held_out_prose(models):
    """Three steps of the TV loss from lab-draft, measured with lab-draft on held-out validation windows: both
    obey Pinsker (mean KL >= 2 (mean TV)²), and a few small steps continue lab-draft instead of wrecking it."""
    target, draft, tok = models
    tuned, log, _ = distillation.finetune_run("tv", distillation.FinetuneConfig(steps=3, seq_len=64, batch_size=2,
                                                                      warmup_steps=1), 0,
                                         teacher=target, draft=draft, tokenizer=tok)
    windows = distillation.prose_windows(tok, 3, 96)
    fig = {name: [distillation.window_figures(m, target, x) for x in windows] for name, m in
           (("lab-draft", draft), ("tuned", tuned))}
    mean = {name: {k: sum(w[k] for w in ws) / len(ws) for k in ("kl", "tv", "alpha")} for name, ws in fig.items()}
    print(mean)
    for m in mean.values():
        assert 0 < m["alpha"] < 1 and m["kl"] >= 2 * m["tv"] ** 2 and m["tv"] == pytest.approx(1 - m["alpha"])
    assert mean["tuned"] != mean["lab-draft"]
    assert abs(mean["tuned"]["alpha"] - mean["lab-draft"]["alpha"]) < 0.05
    assert abs(mean["tuned"]["kl"] - mean["lab-draft"]["kl"]) < 0.2


@pytest.mark.slow
def test_the_shipped_distilled_draft_beside_lab_draft_reproduces_its_card(models):
    """The shipped lab-draft-distilled, measured again on its card's held-out windows with lab-draft beside it:
    its KL and acceptance are the card's (it is the checkpoint the card describes, with today's lab-target);
    a draft shipped by ship-finetuned must also beat lab-draft there, which is what shipping it claimed."""
    from labsrc.models import eval_card, load

    target, draft, tok = models
    card = eval_card("lab-draft-distilled")
    shipped, _ = load("lab-draft-distilled")
    d = card["distillation"]
    got = distillation.evaluate_student(shipped, target, tok, passkey_n=0)
    ref = distillation.evaluate_student(draft, target, tok, passkey_n=0)
    print({"lab-draft-distilled": got, "lab-draft": ref})
    assert got["tokens"] == d["tokens"]
    assert got["expected_acceptance"] == pytest.approx(d["expected_acceptance"], rel=1e-4)
    assert got["kl_teacher_student"] == pytest.approx(d["kl_teacher_student"], rel=1e-4)
    if card.get("start") == "lab-draft":
        assert got["expected_acceptance"] > ref["expected_acceptance"]
