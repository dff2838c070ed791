"""The eviction chapter's exercise checks: a right answer passes, a wrong one fails, a stub is 'not solved'."""
import math

import pytest
import torch

from labsrc import kv_eviction as ev
from labsrc.exercises import kv_eviction as ex


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

    def dropped_most(attn, future, budget, threshold):
        keep = student_lru(attn, budget, threshold).tolist()
        dropped = [i for i in range(attn.shape[1]) if i not in keep]
        return max(dropped, key=lambda i: float(future[i]))

    def kept_most(attn, future, budget, threshold):
        return int(torch.argmax(future))

    assert ex.check_wrongly_dropped(dropped_most).passed
    chain = ex.reasoning_chain()
    truth = dropped_most(chain["attn"], chain["future"], chain["budget"], chain["threshold"])
    assert ex.check_wrongly_dropped(lambda *a: truth).status == "failed", "the chain's answer alone is not enough"
    assert ex.check_wrongly_dropped(kept_most).status == "failed"
    assert ex.check_wrongly_dropped(stub).status == "not solved yet"


def student_probabilities(scores, budget):
    s = scores.double()
    capped = torch.zeros_like(s, dtype=torch.bool)
    while True:
        p = torch.where(capped, torch.ones_like(s), (budget - capped.sum()) * s / s[~capped].sum())
        if not (p[~capped] > 1).any():
            return p
        capped |= p > 1


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    from labsrc.exercises.core import ExerciseFailed
    with pytest.raises(ExerciseFailed):
        ex.check_ever_kept(lambda s, k, r: torch.clamp(k * s / s.sum(), max=1.0))


def test_checks_never_print_the_answer(capsys):
    chain = ex.reasoning_chain()
    result = ex.check_wrongly_dropped(lambda *a: 15)
    out = capsys.readouterr().out.replace(result.case, "")      # the case's own numbers are its inputs
    assert "keeps token" not in out and "attends another" not in out, "no word on where the answer is"
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
    (ex.check_ever_kept, lambda s, k, r: ev.retention_frequencies(ev.stochastic_keep, s, k, draws=200), None),
])
def test_checks_refuse_a_call_to_the_library_function(check, library, args, capsys):
    result = check(library)
    assert result.status == "failed" and "labsrc.kv_eviction" in result.message and "Hint:" in result.message


def test_nested_helper_calling_the_library_is_refused():
    def answer(scores, budget, rounds):
        def helper(s):
            return ev.retention_frequencies(ev.stochastic_keep, s, budget, draws=100)
        return helper(scores)
    assert ex.check_ever_kept(answer).status == "failed"


def test_ever_kept_may_use_one_draws_library_probabilities():
    """The prediction is about independent draws; the capped probabilities of one draw come from the library."""
    assert ex.check_ever_kept(lambda s, k, r: 1 - (1 - ev.inclusion_probabilities(s, k)) ** r).passed


# ------------------------------------------------------------------------------ the buggy LRU of Exercise 2
def buggy_lru(attn, budget, threshold):          # the exercise's given version, both bugs
    t, n_tok = attn.shape
    qpos = torch.arange(n_tok - t, n_tok)
    used = torch.where(attn > threshold, qpos[:, None].expand(t, n_tok), torch.full((t, n_tok), -1))
    last = used.max(0).values
    order = torch.argsort(last, descending=True, stable=True)
    return torch.sort(order[:budget]).values


def lru_arrival_fixed_only(attn, budget, threshold):   # ties still go to the older token
    t, n_tok = attn.shape
    qpos = torch.arange(n_tok - t, n_tok)
    used = torch.where(attn > threshold, qpos[:, None].expand(t, n_tok), torch.full((t, n_tok), -1))
    last = torch.maximum(used.max(0).values, torch.arange(n_tok))
    order = torch.argsort(last, descending=True, stable=True)
    return torch.sort(order[:budget]).values


def lru_ties_fixed_only(attn, budget, threshold):      # arrival still not counted as a use
    t, n_tok = attn.shape
    qpos = torch.arange(n_tok - t, n_tok)
    used = torch.where(attn > threshold, qpos[:, None].expand(t, n_tok), torch.full((t, n_tok), -1))
    last = used.max(0).values
    order = torch.argsort(last.flip(0), descending=True, stable=True)
    return torch.sort(n_tok - 1 - order[:budget]).values


@pytest.mark.parametrize("wrong, said", [
    (buggy_lru, "two slips"),
    (lru_arrival_fixed_only, "keeps the older one"),
    (lru_ties_fixed_only, "what the task counts as a use"),
])
def test_lru_check_fails_each_bug_without_naming_it(wrong, said):
    result = ex.check_lru_keep(wrong)
    assert result.status == "failed" and said not in result.message and "Hint:" in result.message


# ------------------------------------------------------------------------- the kernel of Exercise 3
from exercise_contract import (  # noqa: E402,F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode,
    test_right_answer_passes, test_strict_mode_passes_right_and_raises_on_wrong_and_stub,
    test_stub_is_not_solved_yet, test_wrong_answer_fails_with_hint)
from labsrc import runtime  # noqa: E402
from labsrc.kernels._triton import tl, triton  # noqa: E402


@triton.jit
def sums_right(q_ptr, k_ptr, lse_ptr, out_ptr, N, W, D, scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n, mask_d = offs_n < N, offs_d < D
    keys = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for w in range(W):
        q = tl.load(q_ptr + w * D + offs_d, mask=mask_d, other=0.0)
        s = tl.sum(keys * q[None, :], axis=1) * scale
        acc += tl.where(mask_n & (offs_n <= N - W + w), tl.exp(s - tl.load(lse_ptr + w)), 0.0)
    tl.store(out_ptr + offs_n, acc, mask=mask_n)


@triton.jit
def sums_not_causal(q_ptr, k_ptr, lse_ptr, out_ptr, N, W, D, scale, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n, mask_d = offs_n < N, offs_d < D
    keys = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for w in range(W):
        q = tl.load(q_ptr + w * D + offs_d, mask=mask_d, other=0.0)
        s = tl.sum(keys * q[None, :], axis=1) * scale
        acc += tl.where(mask_n, tl.exp(s - tl.load(lse_ptr + w)), 0.0)      # every key visible
    tl.store(out_ptr + offs_n, acc, mask=mask_n)


@triton.jit
def sums_store_unmasked(q_ptr, k_ptr, lse_ptr, out_ptr, N, W, D, scale, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n, mask_d = offs_n < N, offs_d < D
    keys = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for w in range(W):
        q = tl.load(q_ptr + w * D + offs_d, mask=mask_d, other=0.0)
        s = tl.sum(keys * q[None, :], axis=1) * scale
        acc += tl.where(mask_n & (offs_n <= N - W + w), tl.exp(s - tl.load(lse_ptr + w)), 0.0)
    tl.store(out_ptr + offs_n, acc)                                           # lanes past N spill


@triton.jit
def sums_raw_exp(q_ptr, k_ptr, lse_ptr, out_ptr, N, W, D, scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n, mask_d = offs_n < N, offs_d < D
    keys = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for w in range(W):
        q = tl.load(q_ptr + w * D + offs_d, mask=mask_d, other=0.0)
        s = tl.sum(keys * q[None, :], axis=1) * scale
        acc += tl.where(mask_n & (offs_n <= N - W + w), tl.exp(s), 0.0)       # lse forgotten
    tl.store(out_ptr + offs_n, acc, mask=mask_n)


def ever_kept_one_draw(scores, budget, rounds):   # forgets that the draws repeat
    return student_probabilities(scores, budget)


CASES = [(ex.check_lru_keep, student_lru, buggy_lru), (ex.check_ever_kept, student_ever_kept, ever_kept_one_draw)]
if runtime.HAS_TRITON:   # without Triton the kernel check only says it is skipped (tested below)
    CASES += [(ex.check_attention_sums_kernel, sums_right, sums_not_causal),
              (ex.check_attention_sums_kernel, sums_right, sums_store_unmasked)]

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


@needs_triton
@pytest.mark.parametrize("wrong, said", [(sums_not_causal, "after its own position"),
                                         (sums_store_unmasked, "outside the output"),
                                         (sums_raw_exp, "ignores lse")])
def test_kernel_check_fails_each_slip_naming_only_invariants(wrong, said):
    """Writing outside the output is an invariant and is said; a slip of the computation is not named."""
    result = ex.check_attention_sums_kernel(wrong)
    assert result.status == "failed" and ((said in result.message) == ("outside" in said))


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_attention_sums_kernel, sums_right, monkeypatch, capsys)


def test_attention_sums_reference_is_the_window_statistic_of_the_library():
    """The kernel's quantity is H2O's accumulated attention: the library's TokenStats over the same window."""
    gen = torch.Generator().manual_seed(0)
    q, k, lse = ex._sum_case(gen, (4, 11, 6))
    probs = torch.softmax(ex._masked_logits(q, k), -1).float()
    stats = ev.TokenStats.from_attention(probs[None], torch.ones(11, 1))
    torch.testing.assert_close(ex.attention_sums_ref(q, k, lse), probs.sum(0))
    torch.testing.assert_close(stats.acc.float(), ex.attention_sums_ref(q, k, lse))
