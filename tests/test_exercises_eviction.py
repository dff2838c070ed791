"""The eviction chapter's exercise checks: a right answer passes, a wrong one fails, a stub is 'not solved'."""
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


def student_systematic(p, u):
    c = torch.cumsum(p, 0)
    hits = torch.floor(c - u) - torch.floor(torch.cat([torch.zeros(1, dtype=c.dtype), c[:-1]]) - u)
    return torch.nonzero(hits > 0).flatten()


def test_check_systematic():
    assert ex.check_systematic(student_systematic).passed
    off_by_u = lambda p, u: student_systematic(p, 0.5 * u)  # noqa: E731
    assert ex.check_systematic(off_by_u).status == "failed"
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
