"""The weight-quantization chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the
stub is "not solved yet", hidden cases raise), name the typical wrong answer in their message without giving the
answer, refuse answers that call the labsrc function they ask for, and the GEMV kernel exercise catches a
sign-extended top code and unwritten rows and says it is skipped without Triton."""
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
def ratio_right(n_groups, outlier):
    return math.sqrt(outlier**2 * n_groups / (n_groups - 1 + outlier**2))


def ratio_wrong_steps_only(n_groups, outlier):
    return float(outlier)          # the ratio of the steps: forgets that the outlier's group keeps its step


def worst_right():
    return 0.25, 0.2


def worst_wrong_clipping_ignored():
    return 0.2, 0.2                # as if the floor rule's largest element never went past 6


def gptq_right(W, H, scale):
    W = W.clone()
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j + 1:] -= err[:, None] * U[j, j + 1:][None, :]
    return Q


def gptq_wrong_as_given(W, H, scale):
    """The buggy pass typed out again (calling ex.gptq_buggy is refused)."""
    W = W.clone()
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
        err = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j + 1:] -= err[:, None] * Hinv[j, j + 1:][None, :]
    return Q


def gptq_wrong_in_place(W, H, scale):
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
    (ex.check_gptq_fix, gptq_right, gptq_wrong_as_given),
    (ex.check_gptq_fix, gptq_right, gptq_wrong_in_place),
    (ex.check_cheapest_config, cheapest_right, cheapest_wrong_fewest_bits),
]


@pytest.fixture
def lenient_env(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


# ------------------------------------------------------------------------------------- what the hints say
def test_the_ratio_of_the_steps_is_named_as_the_slip(lenient_env, capsys):
    result = ex.check_rtn_outlier_ratio(ratio_wrong_steps_only)
    assert "ratio of the two steps" in result.message and "outlier's own group" in result.message


def test_the_prediction_is_judged_against_a_measurement():
    """The truth the check uses is a measurement with quantize_rtn, and the error model of the solution lands
    well inside the tolerance of it (so the tolerance is not what makes the right answer pass)."""
    for n_groups, outlier in ((2, 4.0), (64, 16.0), (1024, 30.0)):
        measured = ex.measured_outlier_ratio(n_groups, outlier)
        assert abs(ratio_right(n_groups, outlier) / measured - 1) < ex.RATIO_RTOL / 2


def test_a_percentage_for_the_worst_case_is_named(lenient_env):
    result = ex.check_mxfp4_worst_error((25.0, 20.0))
    assert result.status == "failed" and "percentage" in result.message
    assert ex.check_mxfp4_worst_error((0.25, 0.2)).passed     # a tuple as well as a function


def test_the_sweep_finds_the_worst_cases_it_judges_by():
    floor, rceil = ex._worst_errors()
    assert 0.249 < floor < 0.25 and abs(rceil - 0.2) < 1e-6


def test_the_gptq_check_says_the_answer_is_the_given_pass_and_where_it_goes_wrong(lenient_env):
    result = ex.check_gptq_fix(gptq_wrong_as_given)
    assert "what the buggy one does" in result.message

    def late_bug(W, H, scale):           # right for the first columns, then stops compensating
        Q = gptq_right(W[:, :2], H[:2, :2], scale)
        rest = torch.clamp(torch.round(W[:, 2:] / scale[:, None]), -8, 7) * scale[:, None]
        return torch.cat([Q, rest], 1)

    result = ex.check_gptq_fix(late_bug)
    assert result.status == "failed" and "first wrong one" in result.message


def test_the_buggy_gptq_pass_is_worse_than_gptq_and_right_on_two_columns():
    """What the exercise says of the given pass, on the check's own cases: GPTQ's on two columns, worse than
    GPTQ on wider layers, and on some of them worse even than plain RTN."""
    gen = torch.Generator().manual_seed(7)
    worse = worse_than_rtn = 0
    for _ in range(20):
        W, H, scale = ex._gptq_case(gen)
        buggy = ex._loss(W, ex.gptq_buggy(W, H, scale), H)
        if W.shape[1] == 2:
            assert torch.equal(ex.gptq_buggy(W, H, scale), ex._gptq_ref(W, H, scale))
        worse += buggy > ex._loss(W, ex._gptq_ref(W, H, scale), H)
        rtn = torch.clamp(torch.round(W / scale[:, None]), -8, 7) * scale[:, None]
        worse_than_rtn += buggy > ex._loss(W, rtn, H)
    assert worse >= 10 and worse_than_rtn >= 1


def test_the_cheapest_config_check_says_the_cheaper_format_exists(lenient_env):
    result = ex.check_cheapest_config(cheapest_wrong_fewest_bits)
    assert "another candidate stores fewer bytes" in result.message
    result = ex.check_cheapest_config(lambda w, bound: (2, None))
    assert "does not meet the bound" in result.message


def test_checks_refuse_answers_that_call_the_library(lenient_env):
    def via_library(n_groups, outlier):
        return ex.measured_outlier_ratio(n_groups, outlier)

    def via_buggy(W, H, scale):
        return ex.gptq_buggy(W, H, scale)

    def via_gptq(W, H, scale):
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
