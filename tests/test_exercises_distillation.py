"""The distillation chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub
is "not solved yet", hidden cases raise), name the typical wrong answer without giving the answer, refuse answers
that call the labsrc.distillation function that computes what they ask for, and the kernel exercise catches padded
rows and a missing maximum and says it is skipped without Triton."""
import labsrc  # noqa: F401

import math
import re

import pytest
import torch
import torch.nn.functional as F

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import distillation, runtime
from labsrc.exercises import distillation as ex
from labsrc.kernels._triton import tl, triton


# ------------------------------------------------------------------------------------------- right and wrong
def _jsd(s, t, beta, T, mix_logs=False, swap=False):
    log_q, log_p = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
    b = 1 - beta if swap else beta
    if mix_logs:
        log_m = (1 - b) * log_q + b * log_p
    else:
        log_m = torch.logsumexp(torch.stack([log_q + math.log(1 - b), log_p + math.log(b)]), 0)
    kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
    return float((b * kl_p + (1 - b) * kl_q).mean())


def jsd_right(s, t, beta, T):
    return _jsd(s, t, beta, T)


def jsd_wrong_as_given(s, t, beta, T):
    return _jsd(s, t, beta, T, mix_logs=True)    # the buggy function typed out (calling it is refused)


def jsd_wrong_weights_swapped(s, t, beta, T):
    return _jsd(s, t, beta, T, swap=True)


def grad_right(s, t, T):
    log_q, log_p = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
    q = log_q.exp()
    return T * q * (log_q - log_p - (q * (log_q - log_p)).sum())


def grad_wrong_forward(s, t, T):
    return T * (torch.softmax(s / T, -1) - torch.softmax(t / T, -1))


def grad_wrong_one_over_t(s, t, T):
    return grad_right(s, t, T) / T


def _bump(mu, sd):
    b = torch.exp(-0.5 * ((ex.GRID.double() - mu) / sd) ** 2)
    return b / b.sum()


def accept_right(w, mu1, sd1, mu2, sd2):
    p = ex.bimodal_teacher(w, mu1, sd1, mu2, sd2)
    mean = w * mu1 + (1 - w) * mu2
    var = w * (sd1**2 + mu1**2) + (1 - w) * (sd2**2 + mu2**2) - mean**2
    heavy = _bump(mu1, sd1) if w >= 0.5 else _bump(mu2, sd2)
    return (float(torch.minimum(p, _bump(mean, math.sqrt(var))).sum()), float(torch.minimum(p, heavy).sum()))


def accept_wrong_lighter_mode(w, mu1, sd1, mu2, sd2):
    """Reverse KL's bump put on the lighter mode."""
    forward, _ = accept_right(w, mu1, sd1, mu2, sd2)
    return forward, min(w, 1 - w)


CASES = [
    (ex.check_jsd_fix, jsd_right, jsd_wrong_as_given),
    (ex.check_jsd_fix, jsd_right, jsd_wrong_weights_swapped),
    (ex.check_reverse_kl_gradient, grad_right, grad_wrong_forward),
    (ex.check_reverse_kl_gradient, grad_right, grad_wrong_one_over_t),
    (ex.check_fit_acceptance, accept_right, accept_wrong_lighter_mode),
]


# ------------------------------------------------------------------------------------- what the hints say
def test_the_jsd_check_names_the_case_not_the_handed_out_bug(lenient, capsys):
    """Fed the handed-out code unchanged, the check names the failing inputs and nothing about the bug
    (issue 44: a checker fed the handed-out code must not name its slip)."""
    result = ex.check_jsd_fix(jsd_wrong_as_given)
    assert result.status == "failed" and result.case and result.case in result.message
    assert "mixture" not in result.message and "handed-out" not in result.message


def test_the_given_jsd_breaks_the_bound_the_exercise_states():
    """What the exercise says of the buggy function: 0 when the two agree, never negative, and far above log 2
    when they put their mass on different tokens; the fixed one stays below."""
    s = torch.tensor([[20.0, 0.0, 0.0]])
    t = torch.tensor([[0.0, 0.0, 20.0]])
    assert ex.jsd_buggy(s, s, 0.5, 1.0) == pytest.approx(0.0, abs=1e-6)
    assert ex.jsd_buggy(s, t, 0.5, 1.0) > 4 * math.log(2)
    assert 0 < jsd_right(s, t, 0.5, 1.0) <= math.log(2)


def test_the_gradient_check_names_the_case_not_the_slip(lenient, capsys):
    for wrong in (grad_wrong_forward, grad_wrong_one_over_t):
        message = ex.check_reverse_kl_gradient(wrong).message
        assert "trial 1" in message and "forward KL" not in message


@pytest.mark.parametrize("how", ["enable_grad", "set_grad_enabled", "helper", "func"])
def test_the_gradient_check_refuses_autograd_however_it_is_switched_on(how, lenient, capsys):
    """torch.enable_grad() inside the answer defeated a plain no_grad() guard (issue 44): the check reads the
    answer's code and watches grad mode while it runs."""
    def by_autograd(s, t, T):
        z = s.double().clone().requires_grad_(True)
        log_q = torch.nn.functional.log_softmax(z / T, -1)
        log_p = torch.nn.functional.log_softmax(t.double() / T, -1)
        (T * T * (log_q.exp() * (log_q - log_p)).sum()).backward()
        return z.grad.float()

    def with_enable_grad(s, t, T):
        with torch.enable_grad():
            return by_autograd(s, t, T)

    def with_set_grad_enabled(s, t, T):
        with torch.set_grad_enabled(True):
            return by_autograd(s, t, T)

    def through_a_helper(s, t, T):
        return _hidden_helper(s, t, T)

    def with_func(s, t, T):
        def loss(z):
            log_q = torch.nn.functional.log_softmax(z / T, -1)
            log_p = torch.nn.functional.log_softmax(t / T, -1)
            return T * T * (log_q.exp() * (log_q - log_p)).sum()
        return torch.func.grad(loss)(s)

    globals()["_hidden_helper"] = with_enable_grad
    answer = {"enable_grad": with_enable_grad, "set_grad_enabled": with_set_grad_enabled,
              "helper": through_a_helper, "func": with_func}[how]
    result = ex.check_reverse_kl_gradient(answer)
    assert result.status == "failed" and "autograd" in result.message


def test_the_acceptance_check_says_which_prediction_is_off(lenient, capsys):
    message = ex.check_fit_acceptance(accept_wrong_lighter_mode).message
    assert "reverse-KL student's acceptance" in message and "forward" not in message.split("Hint")[0]
    assert not re.search(r"\b(too|low|high)\b", message)


def test_the_prediction_is_judged_against_the_fits_and_the_reasoning_lands_well_inside():
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        case = ex._fit_case(gen)
        measured = ex._measured_acceptance(*case)
        for mine, real in zip(accept_right(*case), measured):
            assert abs(mine - real) < ex.ACCEPT_ATOL / 2


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_jsd_fix, lambda s, t, b, T: float(distillation.generalized_jsd(s, t, beta=b, T=T)), "generalized_jsd"),
    (ex.check_jsd_fix, lambda s, t, b, T: ex.jsd_buggy(s, t, b, T), "jsd_buggy"),
    (ex.check_reverse_kl_gradient, lambda s, t, T: T * T * distillation.soft_kl(t, s, T), "soft_kl"),
    (ex.check_fit_acceptance, lambda *a: distillation.fit_unimodal(ex.bimodal_teacher(*a), ex.GRID, 0.0), "fit_unimodal"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message


# ------------------------------------------------------------------------------------------- the kernel
@triton.jit
def kernel_right(s_ptr, t_ptr, y_ptr, out_ptr, V, inv_T, alpha, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    s = tl.load(s_ptr + r * V + cols, mask=mask, other=float("-inf"))
    t = tl.load(t_ptr + r * V + cols, mask=mask, other=float("-inf"))
    y = tl.load(y_ptr + r)
    m1 = tl.max(s, 0)
    ce = m1 + tl.log(tl.sum(tl.exp(s - m1), 0)) - tl.sum(tl.where(cols == y, s, 0.0), 0)
    a, b = t * inv_T, s * inv_T
    ma, mb = tl.max(a, 0), tl.max(b, 0)
    ea = tl.exp(a - ma)
    za, zb = tl.sum(ea, 0), tl.sum(tl.exp(b - mb), 0)
    d = tl.where(mask, a, 0.0) - tl.where(mask, b, 0.0)
    kl = tl.sum(ea * d, 0) / za - (ma + tl.log(za)) + (mb + tl.log(zb))
    loss = alpha * ce + (1 - alpha) * kl / (inv_T * inv_T)
    tl.store(out_ptr + r, tl.where(y == -100, 0.0, loss))


@triton.jit
def kernel_padding_counted(s_ptr, t_ptr, y_ptr, out_ptr, V, inv_T, alpha, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    s = tl.load(s_ptr + r * V + cols, mask=mask, other=float("-inf"))
    t = tl.load(t_ptr + r * V + cols, mask=mask, other=float("-inf"))
    y = tl.load(y_ptr + r)
    m1 = tl.max(s, 0)
    ce = m1 + tl.log(tl.sum(tl.exp(s - m1), 0)) - tl.sum(tl.where(cols == y, s, 0.0), 0)
    a, b = t * inv_T, s * inv_T
    ma, mb = tl.max(a, 0), tl.max(b, 0)
    ea = tl.exp(a - ma)
    za, zb = tl.sum(ea, 0), tl.sum(tl.exp(b - mb), 0)
    d = tl.where(mask, a, 0.0) - tl.where(mask, b, 0.0)
    kl = tl.sum(ea * d, 0) / za - (ma + tl.log(za)) + (mb + tl.log(zb))
    tl.store(out_ptr + r, alpha * ce + (1 - alpha) * kl / (inv_T * inv_T))   # label -100 not written as 0


@triton.jit
def kernel_no_max(s_ptr, t_ptr, y_ptr, out_ptr, V, inv_T, alpha, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    s = tl.load(s_ptr + r * V + cols, mask=mask, other=float("-inf"))
    t = tl.load(t_ptr + r * V + cols, mask=mask, other=float("-inf"))
    y = tl.load(y_ptr + r)
    ce = tl.log(tl.sum(tl.exp(s), 0)) - tl.sum(tl.where(cols == y, s, 0.0), 0)   # overflows for large logits
    a, b = t * inv_T, s * inv_T
    ea = tl.exp(a)
    za, zb = tl.sum(ea, 0), tl.sum(tl.exp(b), 0)
    d = tl.where(mask, a, 0.0) - tl.where(mask, b, 0.0)
    kl = tl.sum(ea * d, 0) / za - tl.log(za) + tl.log(zb)
    loss = alpha * ce + (1 - alpha) * kl / (inv_T * inv_T)
    tl.store(out_ptr + r, tl.where(y == -100, 0.0, loss))


if runtime.HAS_TRITON:   # without Triton the kernel check only says it is skipped (tested below)
    CASES += [(ex.check_kd_row_kernel, kernel_right, kernel_padding_counted),
              (ex.check_kd_row_kernel, kernel_right, kernel_no_max)]


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_the_kernel_check_names_the_padded_rows_and_large_logits(lenient, capsys):
    assert "label is -100 should hold 0" in ex.check_kd_row_kernel(kernel_padding_counted).message
    message = ex.check_kd_row_kernel(kernel_no_max).message
    assert "large logits" in message or "NaN" in message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_kd_row_kernel, kernel_right, monkeypatch, capsys)
