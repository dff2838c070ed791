"""The eviction chapter's exercise checks: a right answer passes, a wrong one fails, a stub is 'not solved'."""
import math

import pytest
import torch

from labsrc import evict as ev
from labsrc.exercises import eviction as ex


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


def stub(*args):
    raise NotImplementedError


def student_scores(attn, values, alpha, beta, gamma, lam):
    n = values.shape[0]
    a = attn.sum(dim=(0, 1))
    v = values.norm(dim=-1)
    r = torch.exp(-lam * (n - torch.arange(n, dtype=torch.float32)) / n)
    return a ** alpha * v ** beta * r ** gamma


def test_check_scores():
    assert ex.check_scores(student_scores).passed
    one_based = lambda a, v, al, be, ga, la: a.sum((0, 1)) ** al * v.norm(dim=-1) ** be * torch.exp(  # noqa: E731
        -la * (v.shape[0] - 1 - torch.arange(v.shape[0])) / v.shape[0]) ** ga
    assert ex.check_scores(one_based).status == "failed"
    wrong_r = lambda a, v, al, be, ga, la: a.sum((0, 1)) ** al * v.norm(dim=-1) ** be  # noqa: E731
    assert ex.check_scores(wrong_r).status == "failed"
    squared = lambda a, v, al, be, ga, la: student_scores(a, v * v.abs(), al, be, ga, la)  # noqa: E731
    assert ex.check_scores(squared).status == "failed"
    assert ex.check_scores(stub).status == "not solved yet"


def student_lru(attn, budget, threshold):
    t, n = attn.shape
    last = torch.arange(n)
    for row in range(t):
        pos = n - t + row
        last = torch.where(attn[row] > threshold, torch.full_like(last, pos), last)
    order = sorted(range(n), key=lambda i: (int(last[i]), i), reverse=True)
    return torch.tensor(sorted(order[:budget]))


def test_reasoning_chain_makes_lru_drop_a_premise():
    chain = ex.reasoning_chain()
    keep = student_lru(chain["attn"], chain["budget"], chain["threshold"])
    assert 0 not in keep.tolist() and 1 not in keep.tolist()
    assert len(chain["labels"]) == 16 and torch.allclose(chain["attn"].sum(1), torch.ones(12))


def test_check_lru_keep_and_wrongly_dropped():
    assert ex.check_lru_keep(student_lru).passed
    fifo = lambda attn, budget, thr: torch.arange(attn.shape[1] - budget, attn.shape[1])  # noqa: E731
    assert ex.check_lru_keep(fifo).status == "failed"
    older_first = lambda attn, budget, thr: student_lru(attn.flip(0), budget, thr)  # noqa: E731
    assert ex.check_lru_keep(older_first).status == "failed"
    assert ex.check_lru_keep(stub).status == "not solved yet"

    chain = ex.reasoning_chain()
    keep = student_lru(chain["attn"], chain["budget"], chain["threshold"])
    dropped = [i for i in range(16) if i not in keep.tolist()]
    truth = max(dropped, key=lambda i: float(chain["future"][i]))
    assert ex.check_wrongly_dropped(truth).passed
    assert ex.check_wrongly_dropped(lambda: truth).passed
    assert ex.check_wrongly_dropped(int(torch.argmax(chain["future"][keep]))).status == "failed"
    assert ex.check_wrongly_dropped(stub).status == "not solved yet"


def student_probabilities(scores, budget):
    s = scores.double()
    capped = torch.zeros_like(s, dtype=torch.bool)
    while True:
        p = torch.where(capped, torch.ones_like(s), (budget - capped.sum()) * s / s[~capped].sum())
        if not (p[~capped] > 1).any():
            return p
        capped |= p > 1


def test_check_probabilities():
    assert ex.check_probabilities(student_probabilities).passed
    naive = lambda s, k: torch.clamp(k * s / s.sum(), max=1.0)  # noqa: E731
    assert ex.check_probabilities(naive).status == "failed"
    assert ex.check_probabilities(lambda s, k: student_probabilities(s, k).float()).passed
    assert ex.check_probabilities(stub).status == "not solved yet"


def unclamped_systematic(p, u):
    c = torch.cumsum(p.double(), 0)
    hits = torch.floor(c - u) - torch.floor(torch.cat([torch.zeros(1, dtype=c.dtype), c[:-1]]) - u)
    return torch.nonzero(hits > 0).flatten()


def student_systematic(p, u):
    c = torch.cumsum(p.double(), 0)
    k = round(float(c[-1]))
    c = c * (k / float(c[-1]))
    upper = torch.floor(c - u).clamp(max=k - 1 if u > 0 else k)
    lower = torch.cat([torch.tensor([float(math.floor(-u))], dtype=c.dtype), upper[:-1]])
    return torch.nonzero(upper > lower).flatten()


def test_check_systematic():
    assert ex.check_systematic(student_systematic).passed
    off_by_u = lambda p, u: student_systematic(p, 0.5 * u)  # noqa: E731
    assert ex.check_systematic(off_by_u).status == "failed"
    # The formula without the cap keeps K + 1 items for a tiny u: the check's edge offsets catch it.
    p = ev.inclusion_probabilities(torch.tensor([1.0, 1.2, 1.1, 1.3, 1.05, 1.15], dtype=torch.float64), 2)
    assert unclamped_systematic(p, 1e-300).numel() == 3
    result = ex.check_systematic(unclamped_systematic)
    assert result.status == "failed" and "Hint:" in result.message
    assert ex.check_systematic(lambda p, u: torch.topk(p, round(float(p.sum()))).indices.sort().values).status == "failed"
    assert ex.check_systematic(stub).status == "not solved yet"


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    from labsrc.exercises.core import ExerciseFailed
    with pytest.raises(ExerciseFailed):
        ex.check_probabilities(lambda s, k: torch.clamp(k * s / s.sum(), max=1.0))


def test_checks_never_print_the_answer(capsys):
    chain = ex.reasoning_chain()
    ex.check_wrongly_dropped(15)
    out = capsys.readouterr().out
    keep = ev.LRU(threshold=chain["threshold"]).select(
        ev.TokenStats.from_attention(chain["attn"][None], torch.ones(16, 1), threshold=chain["threshold"]), 8)
    dropped = [i for i in range(16) if i not in keep.tolist()]
    truth = max(dropped, key=lambda i: float(chain["future"][i]))
    assert "failed" in out and f" {truth} " not in out and f"{truth}." not in out


def student_ever_kept(scores, budget, rounds):
    return 1.0 - (1.0 - student_probabilities(scores, budget)) ** rounds


def test_check_ever_kept():
    assert ex.check_ever_kept(student_ever_kept).passed
    uncapped = lambda s, k, r: 1.0 - (1.0 - torch.clamp(k * s / s.sum(), max=1.0)) ** r  # noqa: E731
    assert ex.check_ever_kept(uncapped).status == "failed"
    once = lambda s, k, r: student_probabilities(s, k)  # noqa: E731
    assert ex.check_ever_kept(once).status == "failed"
    expected_count = lambda s, k, r: r * student_probabilities(s, k)  # noqa: E731
    assert ex.check_ever_kept(expected_count).status == "failed"
    assert ex.check_ever_kept(stub).status == "not solved yet"


def test_ever_kept_prediction_matches_simulation():
    """The quantity Exercise 4 predicts is what repeated stochastic_keep draws measure."""
    s = torch.tensor([30.0, 8, 4, 3, 2, 2, 1, 1, 0.5, 0.5, 0.2, 0.1], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    trials, rounds = 1500, 4
    ever = torch.zeros(len(s), dtype=torch.float64)
    for _ in range(trials):
        kept = torch.zeros(len(s), dtype=torch.bool)
        for _ in range(rounds):
            kept[ev.stochastic_keep(s, 5, gen)] = True
        ever += kept.double()
    ever /= trials
    predicted = student_ever_kept(s, 5, rounds)
    se = torch.sqrt(predicted * (1 - predicted) / trials).clamp_min(1e-3)
    assert float(((ever - predicted).abs() / se).max()) < 4.5


@pytest.mark.parametrize("check, library, args", [
    (ex.check_scores, lambda a, v, al, be, ga, la: ev.value_aware_scores(a, v, al, be, ga, la), None),
    (ex.check_lru_keep, lambda attn, b, thr: ev.LRU(threshold=thr).select(
        ev.TokenStats.from_attention(attn[None], torch.ones(attn.shape[1], 1), threshold=thr), b), None),
    (ex.check_probabilities, ev.inclusion_probabilities, None),
    (ex.check_probabilities, lambda s, k: ev.inclusion_probabilities(s, k).clone(), None),
    (ex.check_systematic, ev.systematic_indices, None),
    (ex.check_systematic, lambda p, u: ev.systematic_indices(p, u), None),
    (ex.check_ever_kept, lambda s, k, r: 1 - (1 - ev.inclusion_probabilities(s, k)) ** r, None),
])
def test_checks_refuse_a_call_to_the_library_function(check, library, args, capsys):
    result = check(library)
    assert result.status == "failed" and "labsrc.evict" in result.message and "Hint:" in result.message


def test_nested_helper_calling_the_library_is_refused():
    def answer(p, u):
        def helper(q):
            return ev.systematic_indices(q, u)
        return helper(p)
    assert ex.check_systematic(answer).status == "failed"


def test_refusal_does_not_leak_the_answer(capsys):
    ex.check_systematic(ev.systematic_indices)
    out = capsys.readouterr().out
    assert "floor" not in out.split("Hint:")[0] and "clamp" not in out
