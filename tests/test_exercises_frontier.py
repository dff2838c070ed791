"""The frontier chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, and the
kernel exercise catches a missing causal mask, a write past the output, and says it is skipped without
Triton."""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import frontier, runtime
from labsrc.exercises import frontier as ex
from labsrc.kernels._triton import tl, triton


def lambda_right(layer, lq1, lk1, lq2, lk2):
    init = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
    return torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + init


def lambda_wrong_zero_based(layer, lq1, lk1, lq2, lk2):      # counts layers from 0
    init = 0.8 - 0.6 * math.exp(-0.3 * layer)
    return torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + init


def topk_right(scores, capacity):
    B, T = scores.shape
    k = max(1, math.floor(capacity * T + 0.5))
    rows = [sorted(sorted(range(T), key=lambda t: (-float(r[t]), t))[:k]) for r in scores]
    return torch.tensor(rows)


def topk_wrong_ties(scores, capacity):                      # torch.topk: ties not to the earlier position
    B, T = scores.shape
    k = max(1, math.floor(capacity * T + 0.5))
    flipped = scores.flip(1)
    idx = torch.sort(flipped, dim=1, descending=True, stable=True).indices[:, :k]
    return (T - 1 - idx).sort(1).values


@triton.jit
def kernel_right(q1, k1, q2, k2, v, out, lam, scale, T: tl.constexpr, D: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    m = (t[:, None] < T) & (d[None, :] < D)
    off = t[:, None] * D + d[None, :]
    a = tl.load(q1 + off, mask=m, other=0.0)
    b = tl.load(k1 + off, mask=m, other=0.0)
    c = tl.load(q2 + off, mask=m, other=0.0)
    e = tl.load(k2 + off, mask=m, other=0.0)
    vv = tl.load(v + off, mask=m, other=0.0)
    vis = (t[None, :] <= t[:, None]) & (t[None, :] < T)
    s1 = tl.where(vis, tl.dot(a, tl.trans(b)) * scale, float("-inf"))
    s2 = tl.where(vis, tl.dot(c, tl.trans(e)) * scale, float("-inf"))
    p1 = tl.exp(s1 - tl.max(s1, 1)[:, None])
    p1 = p1 / tl.sum(p1, 1)[:, None]
    p2 = tl.exp(s2 - tl.max(s2, 1)[:, None])
    p2 = p2 / tl.sum(p2, 1)[:, None]
    tl.store(out + off, tl.dot(p1 - lam * p2, vv), mask=m)


@triton.jit
def kernel_not_causal(q1, k1, q2, k2, v, out, lam, scale, T: tl.constexpr, D: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    m = (t[:, None] < T) & (d[None, :] < D)
    off = t[:, None] * D + d[None, :]
    vis = (t[None, :] < T) & (t[:, None] >= 0)                     # forgets the causal mask
    s1 = tl.dot(tl.load(q1 + off, mask=m, other=0.0), tl.trans(tl.load(k1 + off, mask=m, other=0.0))) * scale
    s2 = tl.dot(tl.load(q2 + off, mask=m, other=0.0), tl.trans(tl.load(k2 + off, mask=m, other=0.0))) * scale
    s1 = tl.where(vis, s1, float("-inf"))
    s2 = tl.where(vis, s2, float("-inf"))
    p1 = tl.exp(s1 - tl.max(s1, 1)[:, None])
    p1 = p1 / tl.sum(p1, 1)[:, None]
    p2 = tl.exp(s2 - tl.max(s2, 1)[:, None])
    p2 = p2 / tl.sum(p2, 1)[:, None]
    tl.store(out + off, tl.dot(p1 - lam * p2, tl.load(v + off, mask=m, other=0.0)), mask=m)


@triton.jit
def kernel_no_store_mask(q1, k1, q2, k2, v, out, lam, scale, T: tl.constexpr, D: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    m = (t[:, None] < T) & (d[None, :] < D)
    off = t[:, None] * D + d[None, :]
    vis = (t[None, :] <= t[:, None]) & (t[None, :] < T)
    s1 = tl.dot(tl.load(q1 + off, mask=m, other=0.0), tl.trans(tl.load(k1 + off, mask=m, other=0.0))) * scale
    s2 = tl.dot(tl.load(q2 + off, mask=m, other=0.0), tl.trans(tl.load(k2 + off, mask=m, other=0.0))) * scale
    s1 = tl.where(vis, s1, float("-inf"))
    s2 = tl.where(vis, s2, float("-inf"))
    p1 = tl.exp(s1 - tl.max(s1, 1)[:, None])
    p1 = p1 / tl.sum(p1, 1)[:, None]
    p2 = tl.exp(s2 - tl.max(s2, 1)[:, None])
    p2 = p2 / tl.sum(p2, 1)[:, None]
    tl.store(out + off, tl.dot(p1 - lam * p2, tl.load(v + off, mask=m, other=0.0)))   # rows past T spill


CASES = [
    (ex.check_diff_lambda, lambda_right, lambda_wrong_zero_based),
    (ex.check_mod_capacity_topk, topk_right, topk_wrong_ties),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_diff_softmax_kernel, kernel_right, kernel_not_causal)]


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_diff_softmax_kernel(kernel_no_store_mask)
    assert result.status == "failed" and "outside the output" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_diff_softmax_kernel, kernel_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_diff_lambda, lambda layer, *v: frontier.reparam_lambda(*v, 0.2), "reparam_lambda"),
    (ex.check_mod_capacity_topk, lambda s, c: frontier.mod_route(s, c), "mod_route"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
