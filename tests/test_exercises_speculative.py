"""The speculative-decoding chapter's exercise checks keep the contract (right passes, wrong fails with a hint,
the stub is "not solved yet", hidden cases raise), refuse answers that call the library function they ask for,
name the typical slips, and the kernel exercise catches a missing fallback and mask and says it is skipped
without Triton."""
import labsrc  # noqa: F401

import re

import pytest
import torch
from transformers import DynamicCache

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime, speculative
from labsrc.exercises import speculative as ex
from labsrc.kernels._triton import tl, triton


# ------------------------------------------------------------------------------------ acceptance prediction
def _predictions(p):
    """The six numbers worked out from the task's words (not from the checker's own drafts)."""
    top = p.sort(descending=True).values
    lookup = float(top[0])
    mixed = float(torch.minimum(p, 0.5 * p + 0.5 / p.numel()).sum())
    swapped = 1.0 - float(top[0] - top[1])
    return [lookup, mixed, swapped], [1.0, 1.0, 0.0]


def acceptance_right(p):
    return _predictions(p)


def acceptance_wrong_greedy_like_sampled(p):      # greedy acceptance taken to be the sampled one
    sampled, _ = _predictions(p)
    return sampled, sampled


def acceptance_rounded(p):                         # read off the printed table: three decimals
    sampled, greedy = _predictions(p)
    return [round(a, 3) for a in sampled], greedy


def acceptance_monte_carlo(p):                     # the measurement the chapter's next cell used to make
    g = torch.Generator().manual_seed(7)
    n, V = 20000, p.numel()
    top2 = p.argsort(descending=True)[:2]
    swapped = p.clone()
    swapped[top2] = p[top2.flip(0)]
    sampled = []
    for q in (torch.nn.functional.one_hot(p.argmax(), V).double(), (p + 1 / V) / 2, swapped):
        x = torch.multinomial(q, n, replacement=True, generator=g)
        u = torch.rand(n, generator=g, dtype=torch.float64)
        sampled.append(float((u < (p[x] / q[x]).clamp(max=1)).double().mean()))
    return sampled, [1.0, 1.0, 0.0]


def test_a_prediction_read_from_the_printed_table_fails(lenient, capsys):
    assert ex.check_spec_acceptance(acceptance_rounded).status == "failed"


def test_a_monte_carlo_estimate_fails(lenient, capsys):
    assert ex.check_spec_acceptance(acceptance_monte_carlo).status == "failed"


def test_the_acceptance_check_names_the_draft_and_the_mode_not_the_direction(lenient, capsys):
    result = ex.check_spec_acceptance(acceptance_wrong_greedy_like_sampled)
    assert result.status == "failed" and "under greedy decoding" in result.message
    assert "lookup" in result.message and not re.search(r"\b(too|low|high)\b", result.message)


def test_the_acceptance_check_names_a_malformed_answer(lenient, capsys):
    result = ex.check_spec_acceptance(lambda p: [0.5, 0.5, 0.5])
    assert result.status == "failed" and "two sequences of three numbers" in result.message


def test_the_three_drafts_differ_in_sampled_and_greedy_acceptance():
    """The exercise's point: each draft ranks differently under sampling and under greedy decoding."""
    sampled, greedy = ex._acceptances(ex.acceptance_target())
    assert greedy == [1.0, 1.0, 0.0]
    assert min(sampled) > 0.2 and max(sampled) < 0.95
    assert sampled[2] > sampled[0], "the swapped draft, never accepted greedily, beats the lookup when sampling"


def test_the_measured_acceptance_agrees_with_the_exact_one():
    """verify_batch over many windows lands near the exact acceptance the check grades against."""
    p = ex.acceptance_target()
    g = torch.Generator().manual_seed(0)
    n = 20000
    for q, want in zip(ex._drafts(p).values(), ex._acceptances(p)[0]):
        x = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
        _, n_acc = speculative.verify_batch(x, q.expand(n, 1, -1), p.expand(n, 2, -1), generator=g)
        assert abs(float(n_acc.double().mean()) - want) < 0.01


# ------------------------------------------------------------------------------------ tokens by position
def tokens_right(alphas):
    total, reach = 1.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


def tokens_wrong_iid_mean(alphas):               # the chapter's i.i.d. formula at the mean acceptance
    k, a = len(alphas), sum(alphas) / len(alphas)
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def tokens_wrong_independent(alphas):            # each draft counted on its own, not after the earlier ones
    return 1 + sum(alphas)


@pytest.mark.parametrize("wrong,said", [(tokens_wrong_iid_mean, "trial"),
                                        (tokens_wrong_independent, "trial")])
def test_the_tokens_hint_names_the_slip(wrong, said, lenient, capsys):
    result = ex.check_spec_tokens_by_position(wrong)
    assert result.status == "failed" and said in result.message


# ------------------------------------------------------------------------------------------- tree mask
def mask_right(parents):
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            m[i] = m[par]
        m[i, i] = True
    return m


def mask_wrong_parent_only(parents):           # forgets the grandparents
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            m[i, par] = True
    return m


# ------------------------------------------------------------------------------------------- rollback
def _loop(target, draft, ids, n, k, keep_rejected):
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[None, :-1], cache=cache)
        seq = ids.tolist()
        while len(seq) < ids.numel() + n:
            xs = []
            for _ in range(k):
                xs.append(int(draft(input_ids=torch.tensor([seq + xs])).logits[0, -1].argmax()))
            best = target(input_ids=torch.tensor([[seq[-1]] + xs]), cache=cache).logits[0].argmax(-1).tolist()
            n_acc = 0
            while n_acc < k and xs[n_acc] == best[n_acc]:
                n_acc += 1
            seq += xs[:n_acc] + [best[n_acc]]
            drop = k - n_acc - keep_rejected
            if drop > 0:
                cache.crop(-drop)
    return torch.tensor(seq[: ids.numel() + n])


def rollback_right(target, draft, ids, n, k):
    return _loop(target, draft, ids, n, k, keep_rejected=0)


def rollback_buggy(target, draft, ids, n, k):    # the chapter's bug: the first rejected draft's key stays
    return _loop(target, draft, ids, n, k, keep_rejected=1)


def rollback_plain(target, draft, ids, n, k):    # right tokens, but no speculation at all
    draft(input_ids=ids[None])
    seq = ids.tolist()
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return torch.tensor(seq)


def test_the_rollback_check_says_where_the_output_departs(lenient, capsys):
    result = ex.check_spec_rollback(rollback_buggy)
    assert result.status == "failed" and "differs from plain greedy decoding" in result.message


def test_the_rollback_check_refuses_plain_decoding(lenient, capsys):
    result = ex.check_spec_rollback(rollback_plain)
    assert result.status == "failed" and "plain decoding" in result.message


def test_the_tiny_draft_is_accepted_often_but_not_always():
    """The rollback check needs windows that are fully accepted and windows with a rejection."""
    target, draft = ex.tiny_pair()
    runs = [speculative.speculative_generate(target, draft, torch.randint(2, 24, (1, 8), generator=g), 12, k=3,
                                             stop_at_eos=False)[1]
            for g in (torch.Generator().manual_seed(s) for s in range(3))]
    rate = sum(r.accepted for r in runs) / sum(r.drafted for r in runs)
    assert 0.3 < rate < 0.95


# ------------------------------------------------------------------------------------------- the kernel
@triton.jit
def kernel_right(p_ptr, q_ptr, u_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=mask, other=0.0)
    q = tl.load(q_ptr + row * V + offs, mask=mask, other=0.0)
    w = tl.maximum(p - q, 0.0)
    w = tl.where(tl.sum(w, 0) > 0, w, p)
    c = tl.cumsum(w, 0)
    below = (c <= tl.load(u_ptr + row) * tl.sum(w, 0)) & mask
    tl.store(out_ptr + row, tl.minimum(tl.sum(below.to(tl.int64), 0), V - 1))


@triton.jit
def kernel_no_fallback(p_ptr, q_ptr, u_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=mask, other=0.0)
    q = tl.load(q_ptr + row * V + offs, mask=mask, other=0.0)
    w = tl.maximum(p - q, 0.0)                               # an empty residual where p == q
    c = tl.cumsum(w, 0)
    below = (c <= tl.load(u_ptr + row) * tl.sum(w, 0)) & mask
    tl.store(out_ptr + row, tl.minimum(tl.sum(below.to(tl.int64), 0), V - 1))


@triton.jit
def kernel_samples_p(p_ptr, q_ptr, u_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=mask, other=0.0)   # samples the target, not the residual
    c = tl.cumsum(p, 0)
    below = (c <= tl.load(u_ptr + row) * tl.sum(p, 0)) & mask
    tl.store(out_ptr + row, tl.minimum(tl.sum(below.to(tl.int64), 0), V - 1))


@triton.jit
def kernel_no_load_mask(p_ptr, q_ptr, u_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    p = tl.load(p_ptr + row * V + offs)                       # lanes past V read the next row
    q = tl.load(q_ptr + row * V + offs)
    w = tl.maximum(p - q, 0.0)
    w = tl.where(tl.sum(w, 0) > 0, w, p)
    c = tl.cumsum(w, 0)
    below = c <= tl.load(u_ptr + row) * tl.sum(w, 0)
    tl.store(out_ptr + row, tl.minimum(tl.sum(below.to(tl.int64), 0), V - 1))


# the kernel without load masks reads past a row on purpose (the check must catch it); numpy warns on the garbage
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

CASES = [
    (ex.check_spec_acceptance, acceptance_right, acceptance_wrong_greedy_like_sampled),
    (ex.check_spec_tokens_by_position, tokens_right, tokens_wrong_iid_mean),
    (ex.check_spec_tree_mask, mask_right, mask_wrong_parent_only),
    (ex.check_spec_rollback, rollback_right, rollback_buggy),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_spec_residual_sample_kernel, kernel_right, kernel_no_fallback),
              (ex.check_spec_residual_sample_kernel, kernel_right, kernel_samples_p),
              (ex.check_spec_residual_sample_kernel, kernel_right, kernel_no_load_mask)]

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


def test_library_answers_are_refused(lenient, capsys):
    assert ex.check_spec_acceptance(lambda p: speculative.acceptance_rate(p, p)).status == "failed"
    assert ex.check_spec_tokens_by_position(
        lambda a: speculative.expected_tokens_per_step(a[0], len(a))).status == "failed"
    assert ex.check_spec_tree_mask(lambda par: speculative.tree_attention_mask(par)).status == "failed"
    assert ex.check_spec_rollback(
        lambda t, d, ids, n, k: speculative.speculative_generate(t, d, ids[None], n, k=k)[0][0]).status == "failed"
    assert "asks you to write" in capsys.readouterr().out


@needs_triton
def test_the_kernel_hint_says_the_rows_hold_the_targets_own_samples(lenient, capsys):
    result = ex.check_spec_residual_sample_kernel(kernel_samples_p)
    assert result.status == "failed" and "target's own distribution" in result.message


@needs_triton
def test_the_kernel_hint_names_row_zero_without_the_fallback(lenient, capsys):
    result = ex.check_spec_residual_sample_kernel(kernel_no_fallback)
    assert result.status == "failed" and "only row 0, where p == q" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_spec_residual_sample_kernel, kernel_right, monkeypatch,
                                             capsys)
