"""The frontier chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, name the
typical slips (the second map normalised like the first, the routed share of the matmuls alone, the rounding of
the routed count, a norm over the padded lanes), and the kernel exercise says it is skipped without Triton."""
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
def distractor_right(T, needle, distractor, lam):
    z1 = (T - 2) + math.exp(needle) + math.exp(distractor)
    z2 = (T - 1) + math.exp(distractor)
    w1, w2 = math.exp(distractor) / z1, math.exp(distractor) / z2
    return w1, w1 - lam * w2


def distractor_wrong_same_denominator(T, needle, distractor, lam):   # both maps normalised like the first
    w1 = math.exp(distractor) / ((T - 2) + math.exp(needle) + math.exp(distractor))
    return w1, (1 - lam) * w1


def test_the_distractor_check_says_the_ordinary_weight_is_right(lenient, capsys):
    result = ex.check_distractor_weights(distractor_wrong_same_denominator)
    assert result.status == "failed" and "ordinary attention is right" in result.message


def test_the_distractor_weight_can_turn_negative():
    """The case the exercise asks about: a strong needle makes the first map's denominator the larger one."""
    ordinary, diff = ex._measured_distractor_ref(64, 4.0, 2.0, 0.8).tolist()
    assert 0 < ordinary and diff < 0


# ----------------------------------------------------------------------------- MoD
def mod_right(capacity, T, d):
    k = max(1, math.floor(capacity * T + 0.5))
    return k * (8 * d + k + 1) / (T * (8 * d + T + 1))


def mod_wrong_matmuls_only(capacity, T, d):
    return max(1, math.floor(capacity * T + 0.5)) / T


def mod_wrong_no_rounding(capacity, T, d):
    k = capacity * T
    return k * (8 * d + k + 1) / (T * (8 * d + T + 1))


def test_the_mod_check_names_the_matmul_share(lenient, capsys):
    result = ex.check_mod_block_fraction(mod_wrong_matmuls_only)
    assert result.status == "failed" and "matmuls alone" in result.message


def test_the_mod_check_names_the_routed_count(lenient, capsys):
    result = ex.check_mod_block_fraction(mod_wrong_no_rounding)
    assert result.status == "failed" and "whole number" in result.message


def test_the_mod_reference_is_the_chapter_count_for_one_layer():
    """Two layers of the chapter's recall model (variant_flops_per_token) are twice one block of it."""
    T, d = 72, 32
    full = frontier.variant_flops_per_token("standard", d, T)
    assert math.isclose(frontier.variant_flops_per_token("mod", d, T, capacity=0.5) / full,
                        ex._mod_fraction_ref(0.5, T, d))


# ----------------------------------------------------------------------------- YOCO
def yoco_right(n_layers, n_kv_heads, head_dim, seq_len, window, dtype_bytes):
    per_token = 2 * n_kv_heads * head_dim * dtype_bytes
    return per_token * (n_layers // 2 * min(seq_len, window) + seq_len)


def yoco_wrong_window_always_full(n_layers, n_kv_heads, head_dim, seq_len, window, dtype_bytes):
    per_token = 2 * n_kv_heads * head_dim * dtype_bytes
    return per_token * (n_layers // 2 * window + seq_len)


def test_the_yoco_check_names_a_sequence_shorter_than_the_window(lenient, capsys):
    result = ex.check_yoco_kv_bytes(yoco_wrong_window_always_full)
    assert result.status == "failed" and "shorter than the window" in result.message


def test_the_yoco_check_names_the_ordinary_cache(lenient, capsys):
    result = ex.check_yoco_kv_bytes(
        lambda L, h, d, T, w, b: kv_cache.kv_cache_bytes(L, h, d, T, 1, b))
    assert result.status == "failed" and "ordinary cache" in result.message


# ----------------------------------------------------------------------------- the kernel
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
    (ex.check_distractor_weights, distractor_right, distractor_wrong_same_denominator),
    (ex.check_mod_block_fraction, mod_right, mod_wrong_matmuls_only),
    (ex.check_yoco_kv_bytes, yoco_right, yoco_wrong_window_always_full),
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
    (ex.check_yoco_kv_bytes, lambda L, h, d, T, w, b: frontier.shared_kv_bytes(L, L // 2, h, d, T)[0],
     "shared_kv_bytes"),
    (ex.check_distractor_weights, lambda *a: frontier.diff_attention(*a), "diff_attention"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
