"""The RoPE chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is "not
solved yet", hidden cases raise); the prediction's truth is what stepping through positions measures; the
debugging check names each bug left in; the kernel check catches the rotate-half layout and a missing mask and
says it is skipped without Triton. (The wavelength check's contract test is in tests/test_rope.py.)"""
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


# ------------------------------------------------------------------------------ the first new angle
def first_new_right(head_dim, base, train_length, method, factor):
    first = None
    for i in range(head_dim // 2):
        theta = base ** (-2 * i / head_dim)
        if (train_length - 1) * theta >= 2 * math.pi:
            continue
        slowdown = factor if method == "linear" else factor ** (2 * i / (head_dim - 2))
        n = math.floor((train_length - 1) * slowdown) + 2
        first = n if first is None else min(first, n)
    return first


def first_new_as_pi(head_dim, base, train_length, method, factor):   # NTK read as slowing every pair by s
    return first_new_right(head_dim, base, train_length, "linear", factor)


def first_new_position(head_dim, base, train_length, method, factor):   # the position, not the length
    return first_new_right(head_dim, base, train_length, method, factor) - 1


def first_new_slowest_pair(head_dim, base, train_length, method, factor):   # only the slowest pair counted
    return math.floor((train_length - 1) * factor) + 2


def measured_first_new(head_dim, base, train_length, method, factor):
    """Step through positions with the library's own rescaled frequencies (the chapter's measurement)."""
    inv0 = rope.rope_frequencies(head_dim, base)[0].double()
    inv = rope.rope_frequencies(head_dim, base, method, factor=factor)[0].double()
    seen = (train_length - 1) * inv0
    slow = seen < 2 * math.pi
    positions = torch.arange(train_length, int(factor * train_length) + 3, dtype=torch.float64)
    new = (positions[:, None] * inv[slow] > seen[slow]).any(-1)
    return int(positions[new.nonzero()[0, 0]]) + 1


@pytest.mark.parametrize("config", [(40, 1e4, 512, "ntk", 4.0), (40, 1e4, 512, "linear", 2.5),
                                    (64, 5e5, 1024, "ntk", 6.5), (128, 1e4, 4096, "ntk", 1.5),
                                    (96, 1e6, 2048, "linear", 3.5)])
def test_the_prediction_is_what_the_measurement_finds(config):
    """The check's closed form agrees with stepping through positions with float32 library frequencies."""
    assert ex._first_new_reference(*config) == measured_first_new(*config)


def test_ntk_meets_a_new_angle_well_before_s_times_l_on_the_lab_head():
    """The point of the exercise: NTK configured for 4x lets a middle pair out of range near 2x."""
    assert ex._first_new_reference(40, 1e4, 512, "ntk", 4.0) < 0.6 * ex._first_new_reference(40, 1e4, 512, "linear", 4.0)


def test_first_new_angle_check_fails_the_pi_reading_of_ntk_without_naming_it(lenient, capsys):
    result = ex.check_first_new_angle(first_new_as_pi)
    assert result.status == "failed" and "position interpolation" not in result.message and "trial" in result.message


def test_first_new_angle_check_fails_an_off_by_one_without_saying_so(lenient, capsys):
    result = ex.check_first_new_angle(first_new_position)
    assert result.status == "failed" and "off by" not in result.message and "trial" in result.message


def test_no_drawn_configuration_sits_on_a_tie():
    gen = torch.Generator().manual_seed(27 + 1000)
    for _ in range(200):
        head_dim, base, length, method, factor = ex._first_new_inputs(gen)
        if method == "linear":
            assert not float((length - 1) * factor).is_integer()


# ------------------------------------------------------------------------ the decode step's rotation
def rotate_right(x, past_len, inv_freq):
    T, D = x.shape[-2], x.shape[-1]
    freqs = (past_len + torch.arange(T, dtype=torch.float64))[:, None] * inv_freq.double()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)
    return (x.double() * emb.cos() + rotated.double() * emb.sin()).to(x.dtype)


def rotate_buggy(x, past_len, inv_freq):          # the exercise's given version, both bugs
    T, D = x.shape[-2], x.shape[-1]
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    emb = freqs.repeat_interleave(2, dim=-1)
    rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)
    return (x.double() * emb.cos() + rotated.double() * emb.sin()).to(x.dtype)


def rotate_positions_fixed_only(x, past_len, inv_freq):
    T, D = x.shape[-2], x.shape[-1]
    freqs = (past_len + torch.arange(T, dtype=torch.float64))[:, None] * inv_freq.double()[None, :]
    emb = freqs.repeat_interleave(2, dim=-1)
    rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)
    return (x.double() * emb.cos() + rotated.double() * emb.sin()).to(x.dtype)


def rotate_layout_fixed_only(x, past_len, inv_freq):
    return rotate_right(x, 0, inv_freq)


def test_rotation_reference_is_the_library_rotation_at_the_offset_positions():
    gen = torch.Generator().manual_seed(0)
    x, past, inv = ex._rotate_inputs(gen)
    cos, sin = rope.rope_cos_sin(inv.double(), past + x.shape[1], dtype=torch.float64)
    pos = torch.arange(past, past + x.shape[1])
    ref = rope.apply_rope_ref(x[None].double(), x[None].double(), cos, sin, pos)[0][0].float()
    torch.testing.assert_close(ex._rotate_reference(x, past, inv), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wrong, said", [(rotate_buggy, "length of some pairs"),
                                         (rotate_positions_fixed_only, "length of some pairs"),
                                         (rotate_layout_fixed_only, "starts at this step")])
def test_rotation_check_fails_each_bug_without_naming_it(wrong, said, lenient, capsys):
    result = ex.check_rotate_new_tokens(wrong)
    assert result.status == "failed" and said not in result.message


# ------------------------------------------------------------------------------------ the kernel
# Each wrong kernel below differs from kernel_right in one place, named in its comment.
@triton.jit
def kernel_right(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + p * HALF, sin_ptr + p * HALF
    x1 = tl.load(x_row + 2 * d, mask=mask, other=0.0)
    x2 = tl.load(x_row + 2 * d + 1, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + 2 * d, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_row + 2 * d + 1, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def kernel_rotate_half(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + p * HALF, sin_ptr + p * HALF
    x1 = tl.load(x_row + d, mask=mask, other=0.0)                 # the chapter's layout, not the task's
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
    c_row, s_row = cos_ptr + p * HALF, sin_ptr + p * HALF
    x1 = tl.load(x_row + 2 * d, mask=mask, other=0.0)
    x2 = tl.load(x_row + 2 * d + 1, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + 2 * d, x1 * cos + x2 * sin, mask=mask)      # rotates by -angle
    tl.store(o_row + 2 * d + 1, x2 * cos - x1 * sin, mask=mask)


@triton.jit
def kernel_no_store_mask(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + p * HALF, sin_ptr + p * HALF
    x1 = tl.load(x_row + 2 * d, mask=mask, other=0.0)
    x2 = tl.load(x_row + 2 * d + 1, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + 2 * d, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_row + 2 * d + 1, x2 * cos + x1 * sin)             # lanes d >= HALF spill into the next row


@triton.jit
def kernel_position_ignored(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x_row, o_row = x_ptr + t * 2 * HALF, out_ptr + t * 2 * HALF
    c_row, s_row = cos_ptr + t * HALF, sin_ptr + t * HALF        # row t instead of row positions[t]
    x1 = tl.load(x_row + 2 * d, mask=mask, other=0.0)
    x2 = tl.load(x_row + 2 * d + 1, mask=mask, other=0.0)
    cos = tl.load(c_row + d, mask=mask, other=0.0)
    sin = tl.load(s_row + d, mask=mask, other=0.0)
    tl.store(o_row + 2 * d, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_row + 2 * d + 1, x2 * cos + x1 * sin, mask=mask)


needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")

CASES = [
    (ex.check_first_new_angle, first_new_right, first_new_as_pi),
    (ex.check_first_new_angle, first_new_right, first_new_slowest_pair),
    (ex.check_rotate_new_tokens, rotate_right, rotate_buggy),
    (ex.check_rotate_new_tokens, rotate_right, rotate_layout_fixed_only),
]
if runtime.HAS_TRITON:   # without Triton the kernel check only says it is skipped (tested below)
    CASES += [(ex.check_rope_kernel, kernel_right, kernel_rotate_half),
              (ex.check_rope_kernel, kernel_right, kernel_no_store_mask),
              (ex.check_rope_kernel, kernel_right, kernel_wrong_sign)]


def test_interleaved_reference_is_rope_on_reordered_coordinates():
    """Interleaved RoPE is the rotate-half rotation of the same pairs, with the coordinates reordered."""
    gen = torch.Generator().manual_seed(1)
    x, cos, sin, positions = ex._kernel_case(gen, (9, 6))
    order = torch.cat([torch.arange(0, 12, 2), torch.arange(1, 12, 2)])    # evens first, then odds
    full = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    half_layout = rope.apply_rope_ref(x[:, order][None, None], x[:, order][None, None], *full, positions)[0][0, 0]
    torch.testing.assert_close(ex.interleaved_rope_ref(x, cos, sin, positions)[:, order], half_layout)


@needs_triton
@pytest.mark.parametrize("wrong, said", [(kernel_no_store_mask, "outside the output"),
                                         (kernel_rotate_half, "rotate-half layout"),
                                         (kernel_wrong_sign, "wrong way round"),
                                         (kernel_position_ignored, "program id")])
def test_kernel_check_fails_each_slip_without_naming_it(wrong, said, lenient, capsys):
    """A write outside the output is an invariant the kernel breaks, and is said; a slip is not named."""
    result = ex.check_rope_kernel(wrong)
    assert result.status == "failed" and ((said in result.message) == ("outside" in said))


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_rope_kernel, kernel_right, monkeypatch, capsys)


def test_wavelength_check_refuses_a_call_to_the_library_function(lenient, capsys):
    result = ex.check_wavelength(lambda i, d, b: float(rope.wavelengths(rope.rope_frequencies(d, b)[0].double())[i]))
    assert result.status == "failed" and "wavelengths" in result.message and "Hint:" in result.message
