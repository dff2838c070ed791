"""The weight-quantization chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the
stub is "not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, and
the GEMV kernel exercise catches a wrong nibble order and unwritten rows and says it is skipped without Triton."""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime
from labsrc import weight_quant as wq
from labsrc.exercises import ExerciseFailed
from labsrc.exercises import weight_quant as ex
from labsrc.kernels._triton import tl, triton

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


# ------------------------------------------------------------------------------------------- right and wrong
def params_right(group, bits, symmetric):
    if symmetric:
        return float(group.abs().max()) / (2 ** (bits - 1) - 1), 2 ** (bits - 1)
    lo, hi = min(float(group.min()), 0.0), max(float(group.max()), 0.0)
    s = (hi - lo) / (2 ** bits - 1)
    return s, round(-lo / s)


def params_wrong_no_zero_in_grid(group, bits, symmetric):
    if symmetric:
        return float(group.abs().max()) / (2 ** (bits - 1) - 1), 2 ** (bits - 1)
    lo, hi = float(group.min()), float(group.max())
    s = (hi - lo) / (2 ** bits - 1)
    return s, round(-lo / s)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def block_right(block):
    e = math.floor(math.log2(float(block.abs().max()))) - 2
    out = []
    for v in (block / 2.0 ** e).tolist():
        a = min(abs(v), 6.0)
        best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))  # nearest; a tie to the even code
        out.append(math.copysign(E2M1[best], v) * 2.0 ** e)
    return e, torch.tensor(out)


def block_wrong_ceil(block):
    e = math.ceil(math.log2(float(block.abs().max()))) - 2
    out = []
    for v in (block / 2.0 ** e).tolist():
        a = min(abs(v), 6.0)
        best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
        out.append(math.copysign(E2M1[best], v) * 2.0 ** e)
    return e, torch.tensor(out)


def gptq_right(w, hinv, q0):
    out = w.clone()
    err = (w[:, 0] - q0) / hinv[0, 0]
    out[:, 1:] -= err[:, None] * hinv[0, 1:][None, :]
    out[:, 0] = q0
    return out


def gptq_wrong_in_place(w, hinv, q0):
    err = (w[:, 0] - q0) / hinv[0, 0]
    w[:, 1:] -= err[:, None] * hinv[0, 1:][None, :]
    w[:, 0] = q0
    return w


def awq_right(w, x, bits, group_size, grid):
    mean = x.abs().mean(0).clamp_min(1e-4)
    best, best_s = None, None
    for i in range(grid):
        s = mean ** (i / grid)
        s = s / torch.sqrt(s.max() * s.min())
        w_hat = wq.dequantize(wq.quantize_rtn(w * s, bits, group_size)) / s
        err = float(((x @ w.T - x @ w_hat.T) ** 2).sum())
        if best is None or err < best:
            best, best_s = err, s
    return best_s


def awq_wrong_alpha_one(w, x, bits, group_size, grid):
    s = x.abs().mean(0).clamp_min(1e-4)
    return s / torch.sqrt(s.max() * s.min())


CASES = [
    (ex.check_wq_group_params, params_right, params_wrong_no_zero_in_grid),
    (ex.check_mxfp4_block, block_right, block_wrong_ceil),
    (ex.check_gptq_column_update, gptq_right, gptq_wrong_in_place),
    (ex.check_awq_search, awq_right, awq_wrong_alpha_one),
]


# ------------------------------------------------------------------------------------------- the kernel
@triton.jit
def gemv_right(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, HALF, G, GROUP, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, HALF, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        mask = n_ok[:, None] & (j < HALF)[None, :]
        byte = tl.load(q_ptr + rn[:, None] * HALF + j[None, :], mask=mask, other=0).to(tl.int32)
        g_lo = rn[:, None] * G + (j // GROUP)[None, :]
        g_hi = rn[:, None] * G + ((j + HALF) // GROUP)[None, :]
        w_lo = ((byte & 15).to(tl.float32) - tl.load(z_ptr + g_lo, mask=mask, other=0).to(tl.float32)) \
            * tl.load(s_ptr + g_lo, mask=mask, other=0.0).to(tl.float32)
        w_hi = ((byte >> 4).to(tl.float32) - tl.load(z_ptr + g_hi, mask=mask, other=0).to(tl.float32)) \
            * tl.load(s_ptr + g_hi, mask=mask, other=0.0).to(tl.float32)
        x_lo = tl.load(x_ptr + j, mask=j < HALF, other=0.0)
        x_hi = tl.load(x_ptr + j + HALF, mask=j < HALF, other=0.0)
        acc += tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)
    tl.store(y_ptr + rn, acc, mask=n_ok)


@triton.jit
def gemv_wrong_swaps_nibbles(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, HALF, G, GROUP, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, HALF, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        mask = n_ok[:, None] & (j < HALF)[None, :]
        byte = tl.load(q_ptr + rn[:, None] * HALF + j[None, :], mask=mask, other=0).to(tl.int32)
        g_lo = rn[:, None] * G + (j // GROUP)[None, :]
        g_hi = rn[:, None] * G + ((j + HALF) // GROUP)[None, :]
        w_lo = ((byte >> 4).to(tl.float32) - tl.load(z_ptr + g_lo, mask=mask, other=0).to(tl.float32)) \
            * tl.load(s_ptr + g_lo, mask=mask, other=0.0).to(tl.float32)
        w_hi = ((byte & 15).to(tl.float32) - tl.load(z_ptr + g_hi, mask=mask, other=0).to(tl.float32)) \
            * tl.load(s_ptr + g_hi, mask=mask, other=0.0).to(tl.float32)
        x_lo = tl.load(x_ptr + j, mask=j < HALF, other=0.0)
        x_hi = tl.load(x_ptr + j + HALF, mask=j < HALF, other=0.0)
        acc += tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)
    tl.store(y_ptr + rn, acc, mask=n_ok)


@triton.jit
def gemv_wrong_skips_last_rows(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, HALF, G, GROUP, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < (N // BLOCK_N) * BLOCK_N   # forgets the partial last block of rows: they stay NaN
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, HALF, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        mask = n_ok[:, None] & (j < HALF)[None, :]
        byte = tl.load(q_ptr + rn[:, None] * HALF + j[None, :], mask=mask, other=0).to(tl.int32)
        g_lo = rn[:, None] * G + (j // GROUP)[None, :]
        w_lo = ((byte & 15).to(tl.float32) - tl.load(z_ptr + g_lo, mask=mask, other=0).to(tl.float32)) \
            * tl.load(s_ptr + g_lo, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(w_lo * tl.load(x_ptr + j, mask=j < HALF, other=0.0)[None, :], axis=1)
    tl.store(y_ptr + rn, acc, mask=n_ok)


@triton.jit
def gemv_stub(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, HALF, G, GROUP, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # YOUR CODE HERE (what nbgrader leaves in the student build)
    raise NotImplementedError()


@pytest.fixture
def lenient_env(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


@needs_triton
def test_gemv_kernel_right_passes_and_wrong_fails_with_hint(lenient_env, capsys):
    assert ex.check_int4_gemv_kernel(gemv_right).passed
    assert "passed" in capsys.readouterr().out
    for wrong in (gemv_wrong_swaps_nibbles, gemv_wrong_skips_last_rows):
        result = ex.check_int4_gemv_kernel(wrong)
        assert result.status == "failed" and "Hint:" in result.message
    assert "never written" in ex.check_int4_gemv_kernel(gemv_wrong_skips_last_rows).message


@needs_triton
def test_gemv_kernel_stub_is_not_solved_and_hidden_raises(lenient_env, monkeypatch):
    assert ex.check_int4_gemv_kernel(gemv_stub).status == "not solved yet"
    assert ex.check_int4_gemv_kernel(gemv_right, hidden=True).passed
    for bad in (gemv_stub, gemv_wrong_swaps_nibbles):
        with pytest.raises(ExerciseFailed):
            ex.check_int4_gemv_kernel(bad, hidden=True)
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed):
        ex.check_int4_gemv_kernel(gemv_wrong_swaps_nibbles)


@needs_triton
def test_gemv_kernel_refuses_a_python_function(lenient_env):
    from labsrc.kernels import weight_quant as kw

    def not_a_kernel(*args, **kwargs):
        return kw.int4_matmul(*args)

    result = ex.check_int4_gemv_kernel(not_a_kernel)
    assert result.status == "failed" and "@triton.jit" in result.message


def test_gemv_kernel_is_skipped_with_a_message_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_int4_gemv_kernel, gemv_stub, monkeypatch, capsys)


def test_checks_refuse_answers_that_call_the_library(lenient_env):
    def via_quantize(block):
        codes, scales = wq.mxfp4_quantize(block.reshape(1, 32))
        return int(scales) - 127, wq.mxfp4_dequantize(codes, scales)[0]

    def via_search(w, x, bits, g, grid):
        return wq.awq_search_scales(w, x, bits, g, grid)

    def via_gptq(w, hinv, q0):
        return wq.gptq_quantize(w.float(), hinv.float())

    for check, answer in ((ex.check_mxfp4_block, via_quantize), (ex.check_awq_search, via_search),
                          (ex.check_gptq_column_update, via_gptq)):
        result = check(answer)
        assert result.status == "failed" and "write it yourself" in result.message, check.__name__
        with pytest.raises(ExerciseFailed):
            check(answer, hidden=True)
