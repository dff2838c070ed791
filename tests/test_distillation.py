"""The distillation losses of labsrc.distillation against direct formulas and TRL's GKD loss, the T² gradient-scale
argument, mode covering vs seeking, TinyBERT's layer map, a short distillation that lowers the KL to a teacher,
and the shipped student's eval card."""
import labsrc  # noqa: F401

import math

import pytest
import torch
import torch.nn.functional as F

from labsrc import distillation

V = 37


def logits(gen, *shape, scale=2.0):
    return torch.randn(*shape, generator=gen) * scale


def direct_kl(p, q):
    """KL(p || q) per row from probabilities, in float64, the textbook sum."""
    p, q = p.double(), q.double()
    return (p * (p.log() - q.log())).sum(-1)


def padded_labels(gen, B, T):
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, -3:] = -100      # right padding
    labels[-1, :2] = -100      # a masked prompt
    return labels


@pytest.mark.parametrize("T", [1.0, 2.0, 4.5])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_kd_loss_matches_the_direct_formula_with_padding(T, alpha):
    gen = torch.Generator().manual_seed(int(T * 10) + int(alpha * 100))
    s, t = logits(gen, 3, 5, V), logits(gen, 3, 5, V)
    labels = padded_labels(gen, 3, 5)
    keep = labels != -100
    p_t, q_s = F.softmax(t.double() / T, -1), F.softmax(s.double() / T, -1)
    soft = (T * T * direct_kl(p_t, q_s))[keep].mean()
    ce = -F.log_softmax(s.double(), -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0][keep].mean()
    want = alpha * ce + (1 - alpha) * soft
    got = distillation.kd_loss(s, t, labels, T=T, alpha=alpha)
    assert got.dtype == torch.float32
    assert math.isclose(float(got), float(want), rel_tol=1e-5)
    # padding is ignored: changing a padded position's logits or label changes nothing
    s2 = s.clone()
    s2[0, -1] += 10
    labels2 = torch.where(labels == -100, -7, labels)
    assert math.isclose(float(distillation.kd_loss(s2, t, labels2, T=T, alpha=alpha, ignore_index=-7)),
                        float(distillation.kd_loss(s, t, labels, T=T, alpha=alpha)), rel_tol=1e-6)


def test_kd_loss_averages_over_tokens_not_the_vocabulary_and_without_labels_is_the_soft_term():
    gen = torch.Generator().manual_seed(1)
    s, t = logits(gen, 2, 4, V), logits(gen, 2, 4, V)
    soft = distillation.kd_loss(s, t, T=3.0)
    want = 9.0 * direct_kl(F.softmax(t.double() / 3, -1), F.softmax(s.double() / 3, -1)).mean()
    assert math.isclose(float(soft), float(want), rel_tol=1e-5)
    # the same tokens as one flat (8, V) batch give the same value: a per-token mean
    assert math.isclose(float(distillation.kd_loss(s.reshape(8, V), t.reshape(8, V), T=3.0)), float(soft), rel_tol=1e-6)
    # identical distributions: zero soft loss, and with labels it is alpha * CE
    labels = torch.randint(0, V, (2, 4), generator=gen)
    ce = F.cross_entropy(s.reshape(-1, V), labels.reshape(-1))
    assert float(distillation.kd_loss(s, s, T=2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation.kd_loss(s, s, labels, T=2.0, alpha=0.25)) == pytest.approx(0.25 * float(ce), rel=1e-5)


def test_kd_loss_fused_equals_unfused_in_value_and_gradient():
    gen = torch.Generator().manual_seed(2)
    s, t = logits(gen, 2, 3, 300), logits(gen, 2, 3, 300)
    labels = torch.randint(0, 300, (2, 3), generator=gen)
    labels[1, 2] = -100
    a = s.clone().requires_grad_(True)
    b = s.clone().requires_grad_(True)
    la = distillation.kd_loss(a, t, labels, T=2.0, alpha=0.4)
    lb = distillation.kd_loss(b, t, labels, T=2.0, alpha=0.4, fused=True)
    la.backward()
    lb.backward()
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7)


def test_the_kernel_modules_reference_is_soft_kl():
    """labsrc.kernels.distillation writes its reference out (it must not import this module, which imports it):
    the same numbers as soft_kl, bit for bit in float32, and float64 in float64 out."""
    from labsrc.kernels.distillation import kd_kl_ref

    gen = torch.Generator().manual_seed(21)
    s, t = logits(gen, 3, 4, V), logits(gen, 3, 4, V)
    t[0, 0, :3] = float("-inf")  # a padded vocabulary: no teacher mass there
    for T in (1.0, 2.5):
        assert torch.equal(kd_kl_ref(s, t, T), distillation.soft_kl(s, t, T))
        got = kd_kl_ref(s.double(), t.double(), T)
        assert got.dtype == torch.float64
        pt, qs = F.softmax(t.double() / T, -1), F.softmax(s.double() / T, -1)
        want = torch.where(pt > 0, pt * (pt.log() - qs.log()), torch.zeros_like(pt)).sum(-1)  # 0 log 0 = 0
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_t_squared_keeps_the_soft_gradient_scale_at_large_t():
    """d(T² KL_T)/ds = T (q_T - p_T) -> (centred(s) - centred(t)) / V as T grows: a limit independent of T.
    Without the T², the gradient shrinks as 1/T²."""
    gen = torch.Generator().manual_seed(3)
    s0, t = logits(gen, 4, V), logits(gen, 4, V)

    def grad_norm(T, squared):
        s = s0.clone().requires_grad_(True)
        loss = distillation.kd_loss(s, t, T=T)
        (loss if squared else loss / T ** 2).backward()
        return float(s.grad.norm())

    with_f = [grad_norm(T, True) for T in (20.0, 40.0, 80.0)]
    without = [grad_norm(T, False) for T in (20.0, 40.0, 80.0)]
    assert max(with_f) / min(with_f) < 1.01
    assert without[0] / without[1] == pytest.approx(4.0, rel=0.02)
    assert without[1] / without[2] == pytest.approx(4.0, rel=0.02)
    limit = ((s0 - s0.mean(-1, keepdim=True)) - (t - t.mean(-1, keepdim=True))) / V / 4  # /4: mean over 4 rows
    assert with_f[-1] == pytest.approx(float(limit.norm()), rel=0.01)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_matches_the_definition(beta):
    gen = torch.Generator().manual_seed(int(beta * 10))
    s, t = logits(gen, 2, 6, V), logits(gen, 2, 6, V)
    labels = padded_labels(gen, 2, 6)
    keep = labels != -100
    T = 1.5
    ps, pt = F.softmax(s.double() / T, -1), F.softmax(t.double() / T, -1)
    m = (1 - beta) * ps + beta * pt
    if beta == 0:
        per = direct_kl(pt, ps)
    elif beta == 1:
        per = direct_kl(ps, pt)
    else:
        per = beta * direct_kl(pt, m) + (1 - beta) * direct_kl(ps, m)
    got = distillation.generalized_jsd(s, t, beta=beta, T=T, labels=labels)
    assert math.isclose(float(got), float(per[keep].mean()), rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8, 1.0])
def test_generalized_jsd_agrees_with_trl(beta):
    """TRL's GKDTrainer.generalized_jsd_loss: with labels its "batchmean" is the per-token mean, as ours;
    without labels it divides the sum by the batch size (sequences), ours by the number of tokens."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer  # trl is in the dev extra

    gen = torch.Generator().manual_seed(7 + int(beta * 10))
    B, T_len = 3, 5
    s, t = logits(gen, B, T_len, V), logits(gen, B, T_len, V)
    labels = padded_labels(gen, B, T_len)
    trl_loss = GKDTrainer.generalized_jsd_loss
    ours = distillation.generalized_jsd(s, t, beta=beta, T=2.0, labels=labels)
    theirs = trl_loss(s, t, labels=labels, beta=beta, temperature=2.0)
    assert math.isclose(float(ours), float(theirs), rel_tol=1e-5, abs_tol=1e-7)
    ours_all = distillation.generalized_jsd(s, t, beta=beta, T=2.0)
    theirs_all = trl_loss(s, t, beta=beta, temperature=2.0)
    assert math.isclose(float(ours_all) * T_len, float(theirs_all), rel_tol=1e-5, abs_tol=1e-7)


def test_generalized_jsd_endpoints_are_forward_and_reverse_kl_of_kd():
    gen = torch.Generator().manual_seed(11)
    s, t = logits(gen, 4, V), logits(gen, 4, V)
    assert math.isclose(float(distillation.generalized_jsd(s, t, beta=0.0)), float(distillation.kd_loss(s, t, T=1.0)),
                        rel_tol=1e-6)
    assert math.isclose(float(distillation.generalized_jsd(s, t, beta=1.0)), float(distillation.kd_loss(t, s, T=1.0)),
                        rel_tol=1e-6)
    # the symmetric JSD is bounded by log 2
    assert 0 < float(distillation.generalized_jsd(s * 10, t * 10, beta=0.5)) <= math.log(2) + 1e-6


def test_expected_acceptance_is_one_minus_total_variation():
    gen = torch.Generator().manual_seed(12)
    s, t = logits(gen, 3, 4, V), logits(gen, 3, 4, V)
    tv = 0.5 * (F.softmax(s.double(), -1) - F.softmax(t.double(), -1)).abs().sum(-1)
    assert math.isclose(float(distillation.expected_acceptance(s, t)), float((1 - tv).mean()), rel_tol=1e-5)
    assert float(distillation.expected_acceptance(t, t)) == pytest.approx(1.0, abs=1e-6)


def test_soft_kl_ignores_vocabulary_entries_the_teacher_gives_no_mass_and_has_finite_gradients():
    gen = torch.Generator().manual_seed(13)
    s, t = logits(gen, 2, V), logits(gen, 2, V)
    t[:, :5] = float("-inf")
    s[:, :5] = float("-inf")
    s.requires_grad_(True)
    kl = distillation.soft_kl(s, t, 2.0)
    want = direct_kl(F.softmax(t[:, 5:].double() / 2, -1), F.softmax(s[:, 5:].detach().double() / 2, -1))
    torch.testing.assert_close(kl.double(), want, rtol=1e-5, atol=1e-7)
    kl.sum().backward()
    assert torch.isfinite(s.grad).all()


def test_mode_covering_and_mode_seeking_on_a_bimodal_target():
    grid = torch.linspace(-6, 6, 121)
    target = torch.exp(-0.5 * ((grid + 3) / 0.6) ** 2) + torch.exp(-0.5 * ((grid - 3) / 0.6) ** 2)
    target = target / target.sum()
    mu_f, sd_f = distillation.fit_unimodal(target, grid, beta=0.0)
    mu_r, sd_r = distillation.fit_unimodal(target, grid, beta=1.0)
    assert abs(mu_f) < 0.2 and sd_f > 2.5                 # forward KL: one wide bump between the modes
    assert abs(abs(mu_r) - 3) < 0.2 and sd_r < 0.8        # reverse KL: on one mode, narrow


def test_tinybert_layer_map():
    assert distillation.tinybert_layer_map(12, 4) == [0, 3, 6, 9, 12]
    assert distillation.tinybert_layer_map(6, 2) == [0, 3, 6]
    assert distillation.tinybert_layer_map(6, 6) == list(range(7))
    with pytest.raises(ValueError, match="n_student"):
        distillation.tinybert_layer_map(6, 4)
    with pytest.raises(ValueError, match="n_teacher"):
        distillation.tinybert_layer_map(0, 2)


@torch.no_grad()
def test_tinybert_and_distilbert_losses():
    gen = torch.Generator().manual_seed(14)
    hs = [torch.randn(2, 5, 8, generator=gen) for _ in range(3)]       # student: 2 layers, width 8
    ht = [torch.randn(2, 5, 12, generator=gen) for _ in range(7)]      # teacher: 6 layers, width 12
    at = [torch.softmax(torch.randn(2, 4, 5, 5, generator=gen), -1) for _ in range(6)]
    as_ = [torch.softmax(torch.randn(2, 4, 5, 5, generator=gen), -1) for _ in range(2)]
    proj = torch.nn.Linear(8, 12, bias=False)
    want = sum(F.mse_loss(proj(hs[m]), ht[g]) for m, g in enumerate([0, 3, 6]))
    want = want + F.mse_loss(as_[0], at[2]) + F.mse_loss(as_[1], at[5])
    got = distillation.tinybert_loss(hs, ht, as_, at, proj)
    assert math.isclose(float(got), float(want), rel_tol=1e-6)
    # a perfect student (projection = identity, same maps) has zero loss
    eye = torch.nn.Linear(12, 12, bias=False)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(12))
    assert float(distillation.tinybert_loss([ht[0], ht[3], ht[6]], ht, [at[2], at[5]], at, eye)) == 0.0

    s, t = logits(gen, 2, 5, V), logits(gen, 2, 5, V)
    labels = padded_labels(gen, 2, 5)
    cos = distillation.cosine_hidden_loss(hs[-1], ht[-1], proj, labels != -100)
    keep = labels != -100
    want_cos = (1 - F.cosine_similarity(proj(hs[-1]), ht[-1], dim=-1))[keep].mean()
    assert math.isclose(float(cos), float(want_cos), rel_tol=1e-6)
    got = distillation.distilbert_loss(s, t, labels, hs[-1], ht[-1], proj, T=2.0, weights=(5.0, 2.0, 1.0))
    want = (5 * distillation.kd_loss(s, t, labels, T=2.0, alpha=0.0) + 2 * distillation.kd_loss(s, t, labels, alpha=1.0)
            + want_cos)
    assert math.isclose(float(got), float(want), rel_tol=1e-6)
    with pytest.raises(ValueError, match="proj"):
        distillation.cosine_hidden_loss(hs[-1], ht[-1])


def test_a_short_distillation_lowers_the_kl_to_the_teacher():
    """A small student (a different architecture) trained on kd_loss alone for 60 steps moves towards a
    fixed teacher: its KL on held-out inputs falls to under half of where it started."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, V))
    student = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, V))
    gen = torch.Generator().manual_seed(5)
    held = torch.randn(256, 16, generator=gen)
    with torch.no_grad():
        held_t = teacher(held) * 3

    def held_kl():
        with torch.no_grad():
            return float(distillation.soft_kl(student(held), held_t).mean())

    before = held_kl()
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    for _ in range(60):
        x = torch.randn(64, 16, generator=gen)
        with torch.no_grad():
            t = teacher(x) * 3
        loss = distillation.kd_loss(student(x), t, T=2.0)  # the fused kernel: tests/kernels/test_distillation_kernel.py
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert held_kl() < 0.5 * before


@pytest.mark.parametrize("bad, match", [
    (dict(T=0.0), "T must"), (dict(T=float("inf")), "T must"), (dict(alpha=1.5), "alpha"),
    (dict(teacher_logits=torch.zeros(2, 4, 5)), "same shape"),
    (dict(labels=torch.zeros(2, 3, dtype=torch.int64)), "labels must have"),
    (dict(labels=torch.zeros(2, 4)), "labels must be int64"),
    (dict(student_logits=torch.zeros(2, 4, V, dtype=torch.int64)), "floating point"),
])
def test_kd_loss_refuses_bad_arguments(bad, match):
    args = dict(student_logits=torch.zeros(2, 4, V), teacher_logits=torch.zeros(2, 4, V), labels=None, T=2.0,
                alpha=0.5)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        distillation.kd_loss(**args)


def test_generalized_jsd_refuses_a_beta_outside_unit_interval():
    with pytest.raises(ValueError, match="beta"):
        distillation.generalized_jsd(torch.zeros(2, V), torch.zeros(2, V), beta=1.2)


@pytest.mark.parametrize("method", ["gkd", "distilbert"])
def test_distill_run_trains_every_recipe_for_a_few_steps(method):
    """The experiment's training loop on the lab's models: two steps (GKD's on-policy branch forced), finite
    losses, the log and the info the eval card records, a student of lab-draft's shape."""
    from labsrc.models import load

    teacher, tok = load("lab-target")
    student, log, info = distillation.distill_run(method, 2, teacher=teacher, tokenizer=tok, on_policy_frac=1.0,
                                                  gen_prompt=16, gen_new=8)
    assert len(log) == 2 and all(math.isfinite(r["loss"]) for r in log)
    assert info["method"] == method and info["steps"] == 2 and info["tokens"] == log[-1]["tokens"]
    assert student.config.hidden_size == 128 and student.config.num_hidden_layers == 4
    if method == "gkd":
        assert all(r["on_policy"] == 1 for r in log)
    with pytest.raises(ValueError, match="method"):
        distillation.distill_run("nope", 1, teacher=teacher, tokenizer=tok)


def test_shipped_distilled_draft_and_its_eval_card():
    from labsrc import models

    card = models.eval_card("lab-draft-distilled")
    assert card["teacher"] == "lab-target"
    # the card records the command that shipped it; one shipped before issue 42's rename names the old package,
    # whose command still runs (labsrc._moved)
    command = card["command"].replace("python -m labsrc.distill ", "python -m labsrc.distillation ", 1)
    if card.get("start") == "lab-draft":  # shipped by ship-finetuned: lab-draft fine-tuned (issue #33)
        assert card["method"] in distillation.FINETUNE_METHODS and card["shipped_at"] and "separate" in card["decision"]
        assert command == (f"python -m labsrc.distillation ship-finetuned --method {card['method']} "
                                   f"--seed {card['seed']} --metric {card['metric']}")
        assert set(card["models"]) == {"lab-target", "lab-draft"}
    else:                                 # shipped by ship: a student trained from scratch
        assert card["method"] in distillation.METHODS[1:]
        assert command == (f"python -m labsrc.distillation ship --method {card['method']} "
                                   f"--steps {card['steps']} --T {card['T']}")
    assert card["parameters"] == models.eval_card("lab-draft")["parameters"]
    d = card["distillation"]
    assert 0 < d["expected_acceptance"] < 1 and d["kl_teacher_student"] > 0 and d["tokens"] > 1000
    log = models.train_log("lab-draft-distilled")
    assert len(log) == card["steps"] and log[-1]["tokens"] == card["tokens"]
    assert card["train_minutes"] > 0


def test_draft_figures_measures_a_student_as_chapter_10s_draft():
    from labsrc.data import load_tokenizer
    from labsrc.models import load

    tok = load_tokenizer()
    target, _ = load("lab-target")
    draft, _ = load("lab-draft")
    d = distillation.draft_figures(draft, target, tok, n_prompts=1, prompt_len=32, new_tokens=8, k=3)
    assert 0 <= d["accepted"] <= d["drafted"] and d["alpha"] == d["accepted"] / d["drafted"]
    assert d["new_tokens"] == 8 and 1 <= d["tokens_per_call"] <= 4 and d["c"] > 0
    assert d["predicted_speedup"] == pytest.approx(d["tokens_per_call"] / (3 * d["c"] + 1))


def test_ship_does_not_overwrite_a_shipped_student_without_overwrite(tmp_path, monkeypatch):
    """`python -m labsrc.distillation ship` writes beside an existing checkpoint (``<out>-retrained-<n>``), as
    training does, and into it only with --overwrite; the folder is chosen before any training."""
    from pathlib import Path

    import labsrc.data
    import labsrc.models

    written = []
    monkeypatch.setattr(labsrc.models, "CHECKPOINTS", tmp_path)
    monkeypatch.setattr(labsrc.models, "load", lambda name, **kw: (f"model {name}", None))
    monkeypatch.setattr(labsrc.data, "load_tokenizer", lambda: "tokenizer")
    monkeypatch.setattr(distillation.scratch, "distill_run", lambda method, steps, **kw: (
        "student", [{"loss": 1.0}], {"method": method, "steps": steps, "T": kw["T"]}))

    def save_student(student, log, info, out, teacher, tokenizer):
        written.append(Path(out))
        return {"validation_perplexity": 1.0, "train_minutes": 0.0, "distillation": {}}

    monkeypatch.setattr(distillation.scratch, "save_student", save_student)
    shipped = tmp_path / "lab-draft-distilled"
    shipped.mkdir()
    (shipped / "model.safetensors").write_text("the shipped weights")
    distillation.main(["ship", "--steps", "3"])
    assert written[-1] == tmp_path / "lab-draft-distilled-retrained-1"
    (written[-1]).mkdir()
    (written[-1] / "model.safetensors").write_text("a first retrain")
    distillation.main(["ship", "--steps", "3"])
    assert written[-1] == tmp_path / "lab-draft-distilled-retrained-2"
    own = tmp_path / "mine"
    own.mkdir()
    (own / "x").write_text("x")
    distillation.main(["ship", "--steps", "3", "--out", str(own)])
    assert written[-1] == tmp_path / "mine-retrained-1"
    distillation.main(["ship", "--steps", "3", "--overwrite"])
    assert written[-1] == shipped
    assert (shipped / "model.safetensors").read_text() == "the shipped weights", "only save_student writes"
