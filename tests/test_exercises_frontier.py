"""The frontier chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, name the
failing case and the invariant broken there (where the measured weight changes sign, a fraction no length
reaches, the rounding of the routed count, a norm over the padded lanes), and the kernel exercise says it is
skipped without Triton."""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import frontier, kv_cache, runtime
from labsrc.exercises import frontier as ex
from labsrc.kernels._triton import tl, triton


# ----------------------------------------------------------------------------- the distractor
def sign_change_right(needle, distractor, lam):
    en, ed = math.exp(needle), math.exp(distractor)
    return (lam * (en + ed - 2) - ed + 1) / (1 - lam)


def sign_change_wrong_needle_in_both(needle, distractor, lam):   # both maps see the needle: never a change
    en, ed = math.exp(needle), math.exp(distractor)
    return (lam * (en + ed - 2) - (en + ed - 2)) / (1 - lam)


def test_the_measured_sign_change_is_where_the_weight_turns():
    """The check's truth, measured on the maps, lies between a length where the differential weight is negative
    and one where it is positive (the case the chapter's figure suggests: needle 4, distractor 2, lam 0.8)."""
    T = ex._sign_change_truth(4.0, 2.0, 0.8)
    below, above = math.floor(T), math.ceil(T)
    w1, w2 = ex._distractor_weights(below, 4.0, 2.0, 0.8)
    assert w1 - 0.8 * w2 < 0
    w1, w2 = ex._distractor_weights(above, 4.0, 2.0, 0.8)
    assert w1 - 0.8 * w2 > 0
    assert math.isclose(T, sign_change_right(4.0, 2.0, 0.8), rel_tol=1e-9)


def test_the_sign_change_check_refuses_a_softmax(lenient, capsys):
    def softmax_answer(needle, distractor, lam):
        w = torch.softmax(torch.tensor([needle, distractor, 0.0]), 0)
        return float(w[1] / w[0])
    result = ex.check_distractor_sign_change(softmax_answer)
    assert result.status == "failed" and "softmax" in result.message


# ----------------------------------------------------------------------------- MoD
def mod_right(capacity, T, d):
    k = max(1, math.floor(capacity * T + 0.5))
    return k * (8 * d + k + 1) / (T * (8 * d + T + 1))


def mod_wrong_matmuls_only(capacity, T, d):
    return max(1, math.floor(capacity * T + 0.5)) / T


def mod_wrong_no_rounding(capacity, T, d):
    k = capacity * T
    return k * (8 * d + k + 1) / (T * (8 * d + T + 1))


def test_the_mod_check_names_the_failing_case_not_the_slip(lenient, capsys):
    result = ex.check_mod_block_fraction(mod_wrong_no_rounding)
    assert result.status == "failed" and result.case and result.case in result.message
    assert "whole number" not in result.message and "round" not in result.message


def test_the_mod_reference_is_the_chapter_count_for_one_layer():
    """Two layers of the chapter's recall model (variant_flops_per_token) are twice one block of it."""
    T, d = 72, 32
    full = frontier.variant_flops_per_token("standard", d, T)
    assert math.isclose(frontier.variant_flops_per_token("mod", d, T, capacity=0.5) / full,
                        ex._mod_fraction_ref(0.5, T, d))


# ----------------------------------------------------------------------------- YOCO
def yoco_right(n_layers, window, fraction):
    lowest, highest = 1 / n_layers, 0.5 + 1 / n_layers
    return window / (2 * (fraction - lowest)) if lowest < fraction < highest else None


def yoco_wrong_window_always_full(n_layers, window, fraction):   # forgets that the share is flat below the window
    lowest = 1 / n_layers
    return window / (2 * (fraction - lowest)) if lowest < fraction else None


def test_the_yoco_check_names_an_unreachable_fraction(lenient, capsys):
    result = ex.check_yoco_length(yoco_wrong_window_always_full)
    assert result.status == "failed" and "no length gives this fraction" in result.message


@triton.jit
def kernel_right(q1, k1, q2, k2, v, out, lam, scale, lam_init, eps, T: tl.constexpr, D: tl.constexpr,
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
    y = tl.dot(p1 - lam * p2, tl.load(v + off, mask=m, other=0.0))
    ms = tl.sum(y * y, 1) / D
    tl.store(out + off, y / tl.sqrt(ms + eps)[:, None] * (1 - lam_init), mask=m)


@triton.jit
def kernel_mean_over_block(q1, k1, q2, k2, v, out, lam, scale, lam_init, eps, T: tl.constexpr,
                           D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
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
    y = tl.dot(p1 - lam * p2, tl.load(v + off, mask=m, other=0.0))
    ms = tl.sum(y * y, 1) / BLOCK_D                       # the padded lanes counted in the mean
    tl.store(out + off, y / tl.sqrt(ms + eps)[:, None] * (1 - lam_init), mask=m)


@triton.jit
def kernel_no_store_mask(q1, k1, q2, k2, v, out, lam, scale, lam_init, eps, T: tl.constexpr,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
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
    y = tl.dot(p1 - lam * p2, tl.load(v + off, mask=m, other=0.0))
    ms = tl.sum(y * y, 1) / D
    tl.store(out + off, y / tl.sqrt(ms + eps)[:, None] * (1 - lam_init))     # rows past T spill


CASES = [
    (ex.check_distractor_sign_change, sign_change_right, sign_change_wrong_needle_in_both),
    (ex.check_mod_block_fraction, mod_right, mod_wrong_matmuls_only),
    (ex.check_yoco_length, yoco_right, yoco_wrong_window_always_full),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_diff_norm_kernel, kernel_right, kernel_mean_over_block)]


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_mean_over_the_padded_lanes(lenient, capsys):
    result = ex.check_diff_norm_kernel(kernel_mean_over_block)
    assert result.status == "failed" and "padding included" in result.message


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_diff_norm_kernel(kernel_no_store_mask)
    assert result.status == "failed" and "outside the output" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_diff_norm_kernel, kernel_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_mod_block_fraction, lambda c, T, d: frontier.mod_flops_fraction(c, T), "mod_flops_fraction"),
    (ex.check_yoco_length, lambda L, w, f: kv_cache.kv_cache_bytes(L, 1, 1, w) / f, "kv_cache_bytes"),
    (ex.check_distractor_sign_change, lambda *a: frontier.diff_attention(*a), "diff_attention"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
