"""Tests of chapter 5's exercise checks: the fp16 debugging task, the group-size experiment, the INT4 unpack
kernel with per-channel steps (a real ``@triton.jit`` kernel launched under the interpreter), and the refusal of
answers that call the library function they should write.

The contract cases of the scale/zero check run in ``tests/test_kv_quant.py``.
"""
import pytest
import torch

from labsrc import kv_quant as kq
from labsrc import runtime
from labsrc.exercises import ExerciseFailed
from labsrc.exercises.core import library_use
from exercise_contract import assert_kernel_check_skips_without_triton
from labsrc.exercises import kv_quant as ex
from labsrc.kernels._triton import tl, triton

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


@triton.jit
def right_kernel(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr, BLOCK_DP: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    prm = (offs_t // GROUP)[:, None] * (2 * DP) + offs_c[None, :]
    lo = (byte & 15).to(tl.float32) * tl.load(scale_ptr + prm, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(zero_ptr + prm, mask=mask, other=0.0).to(tl.float32)
    hi = ((byte >> 4) & 15).to(tl.float32) * tl.load(scale_ptr + prm + DP, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(zero_ptr + prm + DP, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], lo, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], hi, mask=mask)


@triton.jit
def wrong_kernel_swaps_nibbles(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr,
                               BLOCK_DP: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    prm = (offs_t // GROUP)[:, None] * (2 * DP) + offs_c[None, :]
    lo = (byte & 15).to(tl.float32) * tl.load(scale_ptr + prm, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(zero_ptr + prm, mask=mask, other=0.0).to(tl.float32)
    hi = ((byte >> 4) & 15).to(tl.float32) * tl.load(scale_ptr + prm + DP, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(zero_ptr + prm + DP, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], hi, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], lo, mask=mask)


@triton.jit
def wrong_kernel_skips_last_block(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr,
                                  BLOCK_DP: tl.constexpr):
    # Forgets the partial last block of tokens: those outputs stay NaN.
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < (T // BLOCK_T) * BLOCK_T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    prm = (offs_t // GROUP)[:, None] * (2 * DP) + offs_c[None, :]
    lo = (byte & 15).to(tl.float32) * tl.load(scale_ptr + prm, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(zero_ptr + prm, mask=mask, other=0.0).to(tl.float32)
    hi = ((byte >> 4) & 15).to(tl.float32) * tl.load(scale_ptr + prm + DP, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(zero_ptr + prm + DP, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], lo, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], hi, mask=mask)


@triton.jit
def stub_kernel(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr, BLOCK_DP: tl.constexpr):
    # YOUR CODE HERE (what nbgrader leaves in the student build)
    raise NotImplementedError()


@needs_triton
def test_unpack_kernel_right_passes_and_wrong_fails_with_hint(capsys):
    assert ex.check_unpack_kernel(right_kernel).passed
    assert "passed" in capsys.readouterr().out
    for wrong in (wrong_kernel_swaps_nibbles, wrong_kernel_skips_last_block):
        result = ex.check_unpack_kernel(wrong)
        assert result.status == "failed" and "Hint:" in result.message
    assert "never written" in ex.check_unpack_kernel(wrong_kernel_skips_last_block).message


@needs_triton
def test_unpack_kernel_stub_is_not_solved_and_hidden_raises(monkeypatch):
    assert ex.check_unpack_kernel(stub_kernel).status == "not solved yet"
    assert ex.check_unpack_kernel(right_kernel, hidden=True).passed
    for bad in (stub_kernel, wrong_kernel_swaps_nibbles):
        with pytest.raises(ExerciseFailed):
            ex.check_unpack_kernel(bad, hidden=True)
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed):
        ex.check_unpack_kernel(wrong_kernel_swaps_nibbles)


@needs_triton
def test_unpack_kernel_refuses_a_python_function_and_a_library_call():
    from labsrc.kernels import kv_quant as kk

    def not_a_kernel(*args, **kwargs):
        return kk.dequantize_unpack(*args)

    result = ex.check_unpack_kernel(not_a_kernel)
    assert result.status == "failed" and "@triton.jit" in result.message
    assert library_use(not_a_kernel, (kk.dequantize_unpack,)) == ["dequantize_unpack"]


def test_unpack_kernel_is_skipped_with_a_message_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_unpack_kernel, stub_kernel, monkeypatch, capsys)


@triton.jit
def wrong_kernel_one_step_per_group(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr,
                                    BLOCK_DP: tl.constexpr):
    # The chapter's layout: one step per group of tokens, read from channel 0 of the group's row.
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + (offs_t // GROUP) * 2 * DP, mask=mask_t, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + (offs_t // GROUP) * 2 * DP, mask=mask_t, other=0.0).to(tl.float32)
    lo = (byte & 15).to(tl.float32) * s[:, None] + z[:, None]
    hi = ((byte >> 4) & 15).to(tl.float32) * s[:, None] + z[:, None]
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], lo, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], hi, mask=mask)


@needs_triton
def test_unpack_kernel_fails_a_step_shared_by_the_channels_without_naming_the_slip():
    result = ex.check_unpack_kernel(wrong_kernel_one_step_per_group)
    assert result.status == "failed" and "channel 0 of its group" not in result.message


def test_per_channel_pack_round_trips_within_half_a_step():
    """The check's own packing: unpacking the planar nibbles gives the codes, and the reconstruction is within
    half a step of every element (the check compares kernels with it)."""
    x = torch.randn(13, 10) * torch.linspace(0.1, 5, 10)
    packed, scale, zero, codes = ex.per_channel_pack(x, 4)
    assert torch.equal(torch.cat([packed & 15, packed >> 4], dim=1), codes)
    rows = torch.arange(13) // 4
    err = (ex.per_channel_unpack_ref(codes, scale, zero, 4) - x).abs()
    assert bool((err <= scale[rows].float() / 2 + zero[rows].float().abs() * 2 ** -10 + 1e-3).all())


# ----------------------------------------------------------------------------- fp16 step and zero point
def fp16_rounded_unsafely(group, bits):   # the exercise's earlier version: both rounded to nearest
    levels = 2 ** bits - 1
    lo, hi = group.min(), group.max()
    scale = ((hi - lo) / levels).half()
    zero = lo.half()
    return torch.round((group - zero.double()) / scale.double()).clamp(0, levels), scale, zero


def fp16_buggy(group, bits):              # the exercise's given version: codes on the exact grid
    levels = 2 ** bits - 1
    lo, hi = group.min(), group.max()
    step = (hi - lo) / levels
    zero = lo.half()
    if zero.double() > lo:
        zero = torch.nextafter(zero, torch.tensor(float("-inf"), dtype=torch.float16))
    scale = ((hi - zero.double()) / levels).half()
    if zero.double() + levels * scale.double() < hi:
        scale = torch.nextafter(scale, torch.tensor(float("inf"), dtype=torch.float16))
    return torch.round((group - lo) / step).clamp(0, levels), scale, zero


def fp16_fixed(group, bits):
    levels = 2 ** bits - 1
    lo, hi = group.min(), group.max()
    zero = lo.half()
    if zero.double() > lo:
        zero = torch.nextafter(zero, torch.tensor(float("-inf"), dtype=torch.float16))
    scale = ((hi - zero.double()) / levels).half()
    if zero.double() + levels * scale.double() < hi:
        scale = torch.nextafter(scale, torch.tensor(float("inf"), dtype=torch.float16))
    return torch.round((group - zero.double()) / scale.double()).clamp(0, levels), scale, zero


def fp16_library_margins(group, bits):    # the library's rule: a relative margin, not one fp16 step
    levels = 2 ** bits - 1
    lo, hi = group.min(), group.max()
    zero = (lo - lo.abs() * 2 ** -10 - 2 ** -24).half()
    scale = ((hi - zero.double()) / levels * (1 + 2 ** -10) + 2 ** -24).half()
    return torch.round((group - zero.double()) / scale.double()).clamp(0, levels), scale, zero


def fp16_too_wide(group, bits):           # safe, but pays a tenth of a step on every element
    codes, scale, zero = fp16_fixed(group, bits)
    wide = (scale.double() * 1.1).half()
    return torch.round((group - zero.double()) / wide.double()).clamp(0, 2 ** bits - 1), wide, zero


def fp16_float32_params(group, bits):     # right grid, but not stored as the cache stores it
    codes, scale, zero = fp16_fixed(group, bits)
    return codes, scale.float(), zero.float()


def test_fp16_check_accepts_another_safe_rounding():
    assert ex.check_fp16_params(fp16_library_margins).passed


@pytest.mark.parametrize("wrong, said", [(fp16_buggy, "not within half a stored step"),
                                         (fp16_rounded_unsafely, "not within half a stored step"),
                                         (fp16_too_wide, "wider than the group's range"),
                                         (fp16_float32_params, "torch.float16")])
def test_fp16_check_names_what_is_wrong(wrong, said):
    result = ex.check_fp16_params(wrong)
    assert result.status == "failed" and said in result.message and "Hint:" in result.message


# ------------------------------------------------------------------------------ the group-size experiment
def largest_group_right(x, bits, max_ratio):
    per_token = kq.mse(x, kq.quantize(x, bits, normalize=False, granularity="token").dequantize())
    g = 1
    while 2 * g <= x.shape[0] and float(kq.mse(x, kq.quantize(x, bits, 2 * g, normalize=False,
                                                               granularity="group").dequantize()) / per_token) <= max_ratio:
        g *= 2
    return g


def largest_group_one_short(x, bits, max_ratio):   # stops a doubling early
    return max(1, largest_group_right(x, bits, max_ratio) // 2)


def test_group_size_answers_vary_with_the_head_and_the_budget():
    """The experiment is not answered by one constant: the drawn heads and budgets give different sizes."""
    gen = torch.Generator().manual_seed(43)
    sizes = {largest_group_right(*ex._head_inputs(gen)) for _ in range(8)}
    assert len(sizes) >= 2


def test_group_size_check_refuses_a_size_that_is_not_a_power_of_two():
    result = ex.check_group_size(lambda x, bits, r: 3)
    assert result.status == "failed" and "power of two" in result.message


CASES = [(ex.check_fp16_params, fp16_fixed, fp16_buggy),
         (ex.check_group_size, largest_group_right, largest_group_one_short)]
if runtime.HAS_TRITON:
    CASES += [(ex.check_unpack_kernel, right_kernel, wrong_kernel_swaps_nibbles)]

from exercise_contract import (  # noqa: E402,F401 (collected here, run over this module's CASES)
    test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)


def test_checks_refuse_answers_that_call_the_library():
    def via_scale_zero(group, bits):
        return kq.scale_zero(group.min(), group.max(), bits)

    def via_quantize(group, bits):
        q = kq.quantize(group.float()[None], bits, group.numel(), normalize=False)
        return q.codes, q.scale, q.zero

    for check, answer in ((ex.check_scale_zero, via_scale_zero), (ex.check_fp16_params, via_quantize)):
        result = check(answer)
        assert result.status == "failed" and "write it yourself" in result.message, check.__name__
        with pytest.raises(ExerciseFailed):
            check(answer, hidden=True)
