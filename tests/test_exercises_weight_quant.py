"""The weight-quantization chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the
stub is "not solved yet", hidden cases raise), name the typical wrong answer in their message without giving the
answer, refuse answers that call the labsrc function they ask for, and the GEMV kernel exercise catches a
sign-extended top code and unwritten rows and says it is skipped without Triton."""
import labsrc  # noqa: F401

import math
import re

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
def ratio_right(n_groups, outlier):
    return math.sqrt(outlier**2 * n_groups / (n_groups - 1 + outlier**2))


def ratio_wrong_steps_only(n_groups, outlier):
    return float(outlier)          # the ratio of the steps: forgets that the outlier's group keeps its step


def worst_right(grid):
    top = grid[-1]
    emax = math.floor(math.log2(top))

    def rounding(lo, hi):            # supremum of the rounding error for values in (lo, hi]
        pts = [g for g in grid if g > 0]
        worst = 0.0
        for a, b in zip(pts, pts[1:]):
            mid = (a + b) / 2
            if lo < mid <= hi:
                worst = max(worst, (b - a) / (a + b))
            if a <= lo < mid:
                worst = max(worst, (lo - a) / lo)
            if mid <= lo < b:
                worst = max(worst, (b - lo) / lo)
        return worst

    return max(rounding(2.0 ** emax, top), 1 - top / 2.0 ** (emax + 1)), rounding(top / 2, top)


def worst_wrong_clipping_ignored(grid):   # as if the floor rule's largest element never went past the grid
    floor, rceil = worst_right(grid)
    return rceil, rceil


def worst_e2m1_only(grid):               # MXFP4's two numbers, whatever the format
    return 0.25, 0.2


def _blocked(W, H, scale, block, reach_past_block):
    W = W.clone()
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    K = W.shape[1]
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        E = torch.zeros(W.shape[0], b1 - b0, dtype=W.dtype)
        for j in range(b0, b1):
            Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
            err = (W[:, j] - Q[:, j]) / U[j, j]
            end = K if reach_past_block else b1
            W[:, j + 1:end] -= err[:, None] * U[j, j + 1:end][None, :]
            E[:, j - b0] = err
        W[:, b1:] -= E @ U[b0:b1, b1:]
    return Q


def gptq_right(W, H, scale, block):
    return _blocked(W, H, scale, block, reach_past_block=False)


def gptq_wrong_as_given(W, H, scale, block):
    """The buggy pass typed out again (calling ex.gptq_blocked_buggy is refused)."""
    return _blocked(W, H, scale, block, reach_past_block=True)


def gptq_wrong_in_place(W, H, scale, block):
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
        W[:, j + 1:] -= ((W[:, j] - Q[:, j]) / U[j, j])[:, None] * U[j, j + 1:][None, :]
    return Q


def _sweep(w):
    for bits, g in ex.config_candidates(w.shape[1]):
        qw = wq.quantize_rtn(w, bits, g)
        yield bits, g, qw.nbytes, float((wq.dequantize(qw) - w).norm() / w.norm())


def cheapest_right(w, bound):
    return min((nbytes, (bits, g)) for bits, g, nbytes, err in _sweep(w) if err <= bound)[1]


def cheapest_wrong_fewest_bits(w, bound):
    """Counts the code bits only, not the steps: picks the fewest bits, then the first group size."""
    return min((bits, i, (bits, g)) for i, (bits, g, _, err) in enumerate(_sweep(w)) if err <= bound)[2]


CASES = [
    (ex.check_rtn_outlier_ratio, ratio_right, ratio_wrong_steps_only),
    (ex.check_mxfp4_worst_error, worst_right, worst_wrong_clipping_ignored),
    (ex.check_mxfp4_worst_error, worst_right, worst_e2m1_only),
    (ex.check_gptq_fix, gptq_right, gptq_wrong_as_given),
    (ex.check_gptq_fix, gptq_right, gptq_wrong_in_place),
    (ex.check_cheapest_config, cheapest_right, cheapest_wrong_fewest_bits),
]


@pytest.fixture
def lenient_env(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


# ------------------------------------------------------------------------------------- what the hints say
def test_the_ratio_check_names_the_case_not_the_direction(lenient_env, capsys):
    result = ex.check_rtn_outlier_ratio(ratio_wrong_steps_only)
    assert result.status == "failed" and "n_groups=" in result.message
    assert not re.search(r"\b(too|large|small|ratio of the two steps)\b", result.message)


def test_the_prediction_is_judged_against_a_measurement():
    """The truth the check uses is a measurement with quantize_rtn, and the error model of the solution lands
    well inside the tolerance of it (so the tolerance is not what makes the right answer pass)."""
    for n_groups, outlier in ((2, 4.0), (64, 16.0), (1024, 30.0)):
        measured = ex.measured_outlier_ratio(n_groups, outlier)
        assert abs(ratio_right(n_groups, outlier) / measured - 1) < ex.RATIO_RTOL / 2


def test_the_worst_case_check_names_the_format(lenient_env):
    result = ex.check_mxfp4_worst_error(worst_e2m1_only)
    assert result.status == "failed" and "E3M2" in result.message and "0.25" not in result.message


def test_the_sweep_finds_the_worst_cases_it_judges_by():
    """E2M1 under the floor rule, as the library's MXFP4 quantizer measures it, and the sweep's two suprema."""
    floor, rceil = ex._worst_errors(ex.fp_grid(2, 1))
    assert 0.249 < floor < 0.25 and abs(rceil - 0.2) < 1e-4
    m = torch.linspace(1.0, 2.0, 2001)[:-1] * 4.0
    block = torch.zeros(m.numel(), 32)
    block[:, 0] = m
    codes, scales = wq.mxfp4_quantize(block)
    library = float(((wq.mxfp4_dequantize(codes, scales)[:, 0] - m).abs() / m).max())
    assert abs(library - floor) < 1e-3


def test_the_element_grids_are_the_mx_formats():
    assert ex.fp_grid(2, 1) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert ex.fp_grid(2, 3)[-1] == 7.5 and ex.fp_grid(3, 2)[-1] == 28.0 and ex.fp_grid(4, 3)[-1] == 480.0


def test_the_gptq_check_says_where_it_goes_wrong(lenient_env):
    result = ex.check_gptq_fix(gptq_wrong_as_given)
    assert result.status == "failed" and "first that does not" in result.message
    assert "block=" in result.message and "twice" not in result.message


def test_the_buggy_blocked_pass_is_right_in_one_block_and_worse_with_several():
    """What the exercise says of the given pass, on the check's own cases: GPTQ's when one block holds the layer,
    worse than GPTQ's output error on most layers with several blocks."""
    gen = torch.Generator().manual_seed(7)
    several = worse = 0
    for _ in range(30):
        W, H, scale, block = ex._gptq_case(gen)
        buggy = ex.gptq_blocked_buggy(W, H, scale, block)
        right = ex._gptq_ref(W, H, scale)
        assert torch.allclose(gptq_right(W, H, scale, block), right, rtol=0, atol=1e-9)
        if block >= W.shape[1]:
            assert torch.allclose(buggy, right, rtol=0, atol=1e-9)
        elif block < W.shape[1] - 1:
            several += 1
            d_b, d_r = (W - buggy), (W - right)
            worse += float(torch.einsum("nk,kl,nl->", d_b, H, d_b)) > float(torch.einsum("nk,kl,nl->", d_r, H, d_r))
    assert worse >= several // 2 > 0


def test_the_cheapest_config_check_states_the_invariant(lenient_env):
    for wrong in (cheapest_wrong_fewest_bits, lambda w, bound: (2, None)):
        result = ex.check_cheapest_config(wrong)
        assert result.status == "failed" and "not both within the bound and the fewest stored bytes" in result.message


def test_checks_refuse_answers_that_call_the_library(lenient_env):
    def via_library(n_groups, outlier):
        return ex.measured_outlier_ratio(n_groups, outlier)

    def via_buggy(W, H, scale, block):
        return ex.gptq_blocked_buggy(W, H, scale, block)

    def via_gptq(W, H, scale, block):
        return wq.gptq_quantize(W.float(), H.float())

    for check, answer in ((ex.check_rtn_outlier_ratio, via_library), (ex.check_gptq_fix, via_buggy),
                          (ex.check_gptq_fix, via_gptq)):
        result = check(answer)
        assert result.status == "failed" and "write it yourself" in result.message, check.__name__
        with pytest.raises(ExerciseFailed):
            check(answer, hidden=True)


def test_pack_int32_puts_column_8w_plus_i_in_nibble_i():
    codes = torch.randint(0, 16, (3, 24), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    words = ex.pack_int32(codes)
    assert words.dtype == torch.int32 and words.shape == (3, 3)
    back = torch.stack([(words.long() >> (4 * i)) & 15 for i in range(8)], -1).reshape(3, 24)
    assert torch.equal(back, codes.long())
    with pytest.raises(ValueError, match="multiple of 8"):
        ex.pack_int32(codes[:, :5])


# ------------------------------------------------------------------------------------------- the kernel
@triton.jit
def gemv_right(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, WORDS, G, GROUP, BLOCK_N: tl.constexpr,
               BLOCK_W: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(0, WORDS, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        w_ok = w < WORDS
        mask = n_ok[:, None] & w_ok[None, :]
        word = tl.load(q_ptr + rn[:, None] * WORDS + w[None, :], mask=mask, other=0)
        for i in tl.static_range(8):
            col = 8 * w + i
            code = ((word >> (4 * i)) & 15).to(tl.float32)
            g = rn[:, None] * G + (col // GROUP)[None, :]
            z = tl.load(z_ptr + g, mask=mask, other=0).to(tl.float32)
            s = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum((code - z) * s * tl.load(x_ptr + col, mask=w_ok, other=0.0)[None, :], axis=1)
    tl.store(y_ptr + rn, acc, mask=n_ok)


@triton.jit
def gemv_wrong_signed_top(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, WORDS, G, GROUP, BLOCK_N: tl.constexpr,
                          BLOCK_W: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(0, WORDS, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        w_ok = w < WORDS
        mask = n_ok[:, None] & w_ok[None, :]
        word = tl.load(q_ptr + rn[:, None] * WORDS + w[None, :], mask=mask, other=0)
        for i in tl.static_range(8):
            col = 8 * w + i
            if i == 7:
                code = (word >> 28).to(tl.float32)     # an arithmetic shift keeps the sign: no mask
            else:
                code = ((word >> (4 * i)) & 15).to(tl.float32)
            g = rn[:, None] * G + (col // GROUP)[None, :]
            z = tl.load(z_ptr + g, mask=mask, other=0).to(tl.float32)
            s = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum((code - z) * s * tl.load(x_ptr + col, mask=w_ok, other=0.0)[None, :], axis=1)
    tl.store(y_ptr + rn, acc, mask=n_ok)


@triton.jit
def gemv_wrong_skips_last_rows(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, WORDS, G, GROUP, BLOCK_N: tl.constexpr,
                               BLOCK_W: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < (N // BLOCK_N) * BLOCK_N   # forgets the partial last block of rows: they stay NaN
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(0, WORDS, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        mask = n_ok[:, None] & (w < WORDS)[None, :]
        word = tl.load(q_ptr + rn[:, None] * WORDS + w[None, :], mask=mask, other=0)
        acc += tl.sum((word & 15).to(tl.float32), axis=1)
    tl.store(y_ptr + rn, acc, mask=n_ok)


@triton.jit
def gemv_stub(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, WORDS, G, GROUP, BLOCK_N: tl.constexpr,
              BLOCK_W: tl.constexpr):
    # YOUR CODE HERE (what nbgrader leaves in the student build)
    raise NotImplementedError()


@needs_triton
def test_gemv_kernel_right_passes_and_wrong_fails_with_hint(lenient_env, capsys):
    assert ex.check_int4_gemv_kernel(gemv_right).passed
    assert "passed" in capsys.readouterr().out
    signed = ex.check_int4_gemv_kernel(gemv_wrong_signed_top)
    assert signed.status == "failed" and "Hint:" in signed.message and "negative number" in signed.message
    assert "never written" in ex.check_int4_gemv_kernel(gemv_wrong_skips_last_rows).message


@needs_triton
def test_gemv_kernel_stub_is_not_solved_and_hidden_raises(lenient_env, monkeypatch):
    assert ex.check_int4_gemv_kernel(gemv_stub).status == "not solved yet"
    assert ex.check_int4_gemv_kernel(gemv_right, hidden=True).passed
    for bad in (gemv_stub, gemv_wrong_signed_top):
        with pytest.raises(ExerciseFailed):
            ex.check_int4_gemv_kernel(bad, hidden=True)
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed):
        ex.check_int4_gemv_kernel(gemv_wrong_signed_top)


@needs_triton
def test_gemv_kernel_refuses_a_python_function(lenient_env):
    from labsrc.kernels import weight_quant as kw

    def not_a_kernel(*args, **kwargs):
        return kw.int4_matmul(*args)

    result = ex.check_int4_gemv_kernel(not_a_kernel)
    assert result.status == "failed" and "@triton.jit" in result.message


def test_gemv_kernel_is_skipped_with_a_message_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_int4_gemv_kernel, gemv_stub, monkeypatch, capsys)
