"""The distillation chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub
is "not solved yet", hidden cases raise), refuse answers that call the labsrc.distill function they ask for, and
the kernel exercise catches a missing mask and says it is skipped without Triton."""
import labsrc  # noqa: F401

import pytest
import torch
import torch.nn.functional as F

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import distill, runtime
from labsrc.exercises import distill as ex
from labsrc.kernels._triton import tl, triton


def kd_right(s, t, labels, T, alpha):
    keep = labels != -100
    ce = F.cross_entropy(s[keep], labels[keep])
    p, log_p = F.softmax(t / T, -1), F.log_softmax(t / T, -1)
    kl = (p * (log_p - F.log_softmax(s / T, -1))).sum(-1)[keep].mean()
    return float(alpha * ce + (1 - alpha) * T * T * kl)


def kd_wrong_no_t_squared(s, t, labels, T, alpha):
    keep = labels != -100
    ce = F.cross_entropy(s[keep], labels[keep])
    p, log_p = F.softmax(t / T, -1), F.log_softmax(t / T, -1)
    kl = (p * (log_p - F.log_softmax(s / T, -1))).sum(-1)[keep].mean()
    return float(alpha * ce + (1 - alpha) * kl)


def kd_wrong_padding_counted(s, t, labels, T, alpha):
    ce = F.cross_entropy(s, labels.clamp_min(0))
    p, log_p = F.softmax(t / T, -1), F.log_softmax(t / T, -1)
    kl = (p * (log_p - F.log_softmax(s / T, -1))).sum(-1).mean()
    return float(alpha * ce + (1 - alpha) * T * T * kl)


def grad_right(s, t, T):
    return T * (torch.softmax(s / T, -1) - torch.softmax(t / T, -1))


def grad_wrong_sign(s, t, T):
    return T * (torch.softmax(t / T, -1) - torch.softmax(s / T, -1))


def grad_wrong_one_over_t(s, t, T):
    return (torch.softmax(s / T, -1) - torch.softmax(t / T, -1)) / T


def map_right(N, M):
    return [m * N // M for m in range(M + 1)]


def map_wrong_first_layers(N, M):
    return list(range(M + 1))


def map_wrong_no_embedding(N, M):
    return [(m + 1) * N // M for m in range(M)]


@triton.jit
def kernel_right(s_ptr, t_ptr, out_ptr, V, inv_T, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    a = tl.load(t_ptr + r * V + cols, mask=mask, other=float("-inf")) * inv_T
    b = tl.load(s_ptr + r * V + cols, mask=mask, other=float("-inf")) * inv_T
    ea = tl.exp(a - tl.max(a, 0))
    eb = tl.exp(b - tl.max(b, 0))
    za, zb = tl.sum(ea, 0), tl.sum(eb, 0)
    lse_a = tl.max(a, 0) + tl.log(za)
    lse_b = tl.max(b, 0) + tl.log(zb)
    d = tl.where(mask, a, 0.0) - tl.where(mask, b, 0.0)   # no -inf - -inf in the padded lanes
    tl.store(out_ptr + r, tl.sum(ea * d, 0) / za - lse_a + lse_b)


@triton.jit
def kernel_no_max(s_ptr, t_ptr, out_ptr, V, inv_T, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    a = tl.load(t_ptr + r * V + cols, mask=mask, other=float("-inf")) * inv_T
    b = tl.load(s_ptr + r * V + cols, mask=mask, other=float("-inf")) * inv_T
    ea, eb = tl.exp(a), tl.exp(b)            # overflows for large logits
    za, zb = tl.sum(ea, 0), tl.sum(eb, 0)
    d = tl.where(mask, a - b, 0.0)
    tl.store(out_ptr + r, tl.sum(ea * d, 0) / za - tl.log(za) + tl.log(zb))


@triton.jit
def kernel_padding_counted(s_ptr, t_ptr, out_ptr, V, inv_T, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    a = tl.load(t_ptr + r * V + cols, mask=mask, other=0.0) * inv_T   # padded lanes count as logit 0
    b = tl.load(s_ptr + r * V + cols, mask=mask, other=0.0) * inv_T
    ea = tl.exp(a - tl.max(a, 0))
    eb = tl.exp(b - tl.max(b, 0))
    za, zb = tl.sum(ea, 0), tl.sum(eb, 0)
    lse_a = tl.max(a, 0) + tl.log(za)
    lse_b = tl.max(b, 0) + tl.log(zb)
    tl.store(out_ptr + r, tl.sum(ea * (a - b), 0) / za - lse_a + lse_b)


CASES = [
    (ex.check_kd_loss_by_hand, kd_right, kd_wrong_no_t_squared),
    (ex.check_kd_loss_by_hand, kd_right, kd_wrong_padding_counted),
    (ex.check_kd_soft_gradient, grad_right, grad_wrong_sign),
    (ex.check_kd_soft_gradient, grad_right, grad_wrong_one_over_t),
    (ex.check_tinybert_layer_map, map_right, map_wrong_first_layers),
    (ex.check_tinybert_layer_map, map_right, map_wrong_no_embedding),
]
if runtime.HAS_TRITON:   # without Triton the kernel check only says it is skipped (tested below)
    CASES += [(ex.check_kd_kl_kernel, kernel_right, kernel_no_max),
              (ex.check_kd_kl_kernel, kernel_right, kernel_padding_counted)]


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_kd_kl_kernel, kernel_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_kd_loss_by_hand, lambda s, t, y, T, a: float(distill.kd_loss(s, t, y, T=T, alpha=a)), "kd_loss"),
    (ex.check_kd_soft_gradient, lambda s, t, T: T * T * distill.soft_kl(s, t, T), "soft_kl"),
    (ex.check_tinybert_layer_map, lambda N, M: distill.tinybert_layer_map(N, M), "tinybert_layer_map"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message


def test_kd_message_does_not_leak_the_answer(lenient, capsys):
    ex.check_kd_loss_by_hand(kd_wrong_no_t_squared)
    out = capsys.readouterr().out
    args = ex._kd_inputs(torch.Generator().manual_seed(131))
    assert f"{ex._kd_reference(*args):.4f}"[:6] not in out
