"""The RoPE chapter's newer exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc.rope function they ask for, and the
kernel exercise catches a missing mask and says it is skipped without Triton. (The first four checks' contract
tests are in tests/test_rope.py.)"""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import rope, runtime
from labsrc.exercises import rope as ex
from labsrc.kernels._triton import tl, triton


def unseen_right(head_dim, base, train_length, new_length):
    pairs = []
    for i in range(head_dim // 2):
        theta = base ** (-2 * i / head_dim)
        trained, new = (train_length - 1) * theta, (new_length - 1) * theta
        if trained < 2 * math.pi and new > trained:
            pairs.append(i)
    return pairs


def unseen_right_mask(head_dim, base, train_length, new_length):
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return ((train_length - 1) * theta < 2 * math.pi) & (new_length > train_length)


def unseen_wrong_fast_pairs(head_dim, base, train_length, new_length):   # the source's reading
    return [i for i in range(head_dim // 2)
            if 2 * math.pi * base ** (2 * i / head_dim) < train_length and new_length > train_length]


def unseen_wrong_every_pair(head_dim, base, train_length, new_length):   # forgets that full turns saw it all
    return list(range(head_dim // 2)) if new_length > train_length else []


@triton.jit
def kernel_right(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + p * 2 * HALF, sin_ptr + p * 2 * HALF
    x1 = tl.load(x_row + d, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + d, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_row + HALF + d, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def kernel_wrong_sign(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + p * 2 * HALF, sin_ptr + p * 2 * HALF
    x1 = tl.load(x_row + d, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + d, x1 * cos + x2 * sin, mask=mask)      # rotates by -angle
    tl.store(o_row + HALF + d, x2 * cos - x1 * sin, mask=mask)


@triton.jit
def kernel_no_store_mask(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + p * 2 * HALF, sin_ptr + p * 2 * HALF
    x1 = tl.load(x_row + d, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + d, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_row + HALF + d, x2 * cos + x1 * sin)          # lanes d >= HALF spill into the next row


@triton.jit
def kernel_position_ignored(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + t * 2 * HALF, sin_ptr + t * 2 * HALF   # row t instead of row positions[t]
    x1 = tl.load(x_row + d, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + d, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_row + HALF + d, x2 * cos + x1 * sin, mask=mask)


needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")

CASES = [
    (ex.check_unseen_pairs, unseen_right, unseen_wrong_fast_pairs),
    (ex.check_unseen_pairs, unseen_right_mask, unseen_wrong_every_pair),
]
if runtime.HAS_TRITON:   # without Triton the kernel check only says it is skipped (tested below)
    CASES += [(ex.check_rope_kernel, kernel_right, kernel_wrong_sign),
              (ex.check_rope_kernel, kernel_right, kernel_no_store_mask),
              (ex.check_rope_kernel, kernel_right, kernel_position_ignored)]


@needs_triton
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_rope_kernel(kernel_no_store_mask)
    assert result.status == "failed" and "outside the output" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_rope_kernel, kernel_right, monkeypatch, capsys)


def test_unseen_pairs_message_does_not_leak_the_answer(lenient, capsys):
    ex.check_unseen_pairs(unseen_wrong_every_pair)
    out = capsys.readouterr().out
    args = ex._unseen_inputs(torch.Generator().manual_seed(25))
    assert str(unseen_right(*args)) not in out


def call_max_angles(head_dim, base, train_length, new_length):
    from labsrc.rope import max_angles as angles          # an alias is caught too
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return angles(inv, train_length, new_length).unseen


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_unseen_pairs, call_max_angles, "max_angles"),
    (ex.check_ntk_base, lambda b, s, d: rope.ntk_base(b, s, d), "ntk_base"),
    (ex.check_position_interpolation, lambda d, b, s: rope.rope_frequencies(d, b, "linear", factor=s)[0],
     "linear_frequencies"),
    (ex.check_wavelength, lambda i, d, b: float(rope.wavelengths(rope.rope_frequencies(d, b)[0].double())[i]),
     "wavelengths"),
    (ex.check_yarn_unscaled,
     lambda d, b, s, L, bf, bs: list(range(rope.yarn_correction_range(d, b, L, bf, bs)[0] + 1)),
     "yarn_correction_range"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
