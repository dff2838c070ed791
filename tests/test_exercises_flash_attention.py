"""Each FlashAttention exercise check passes a right answer, fails a wrong one (and raises in strict mode), and
reports "not solved yet" for the student-build stub."""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc.exercises import flash_attention as ex
from labsrc.kernels._triton import HAS_TRITON, tl, triton


def right_merge(m1, l1, o1, m2, l2, o2):
    m = torch.maximum(m1, m2)
    m = torch.where(m == float("-inf"), 0.0, m)
    a1, a2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    total = a1 + a2
    out = (a1[:, None] * o1 + a2[:, None] * o2) / total.clamp_min(1e-300)[:, None]
    return torch.where(total[:, None] > 0, out, 0.0)


def buggy_merge_as_shown(m1, l1, o1, m2, l2, o2):
    """The function the exercise shows: it weighs by the maxima alone, and makes NaN of rows with no keys."""
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return (w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None]


def merge_fixing_only_the_weights(m1, l1, o1, m2, l2, o2):
    m = torch.maximum(m1, m2)
    w1, w2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    return (w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None]


def merge_forgets_max(m1, l1, o1, m2, l2, o2):
    return (l1[:, None] * o1 + l2[:, None] * o2) / (l1 + l2)[:, None]


def right_naive(T, D, dtype_bytes):
    return dtype_bytes * (2 * T * D + T * T + 2 * T * T + T * T + T * D + T * D)


def wrong_naive_no_round_trip(T, D, dtype_bytes):
    return dtype_bytes * (4 * T * D + T * T)


def right_tiled_causal(T, D, block_m, dtype_bytes):
    keys = sum(min(i + block_m, T) for i in range(0, T, block_m))
    return dtype_bytes * D * (2 * T + 2 * keys)


def wrong_tiled_causal_full_blocks(T, D, block_m, dtype_bytes):
    keys = sum((i + 1) * block_m for i in range(math.ceil(T / block_m)))
    return dtype_bytes * D * (2 * T + 2 * keys)


def right_tile(k, start, block_n, block_d):
    T, D = k.shape
    offs_n = start + torch.arange(block_n)
    offs_d = torch.arange(block_d)
    mask = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    return ex.tl_load(k.flatten(), offs_n[:, None] * D + offs_d[None, :], mask, other=0.0)


def wrong_tile_no_column_mask(k, start, block_n, block_d):
    T, D = k.shape
    offs_n = start + torch.arange(block_n)
    offs_d = torch.arange(block_d)
    mask = offs_n[:, None] < T
    return ex.tl_load(k.flatten(), offs_n[:, None] * D + offs_d[None, :], mask, other=0.0)


@triton.jit
def right_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, Tq, Tk, D, sm_scale, CAUSAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask, d_mask = offs_m < Tq, offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_mask, other=float("-inf"))
    delta = tl.load(DELTA + offs_m, mask=row_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    finite = lse != float("-inf")
    lse_or_0 = tl.where(finite, lse, 0.0)
    for start in range(0, Tk, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        seen = finite[:, None] & (offs_n[None, :] < Tk)
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= offs_m[:, None] + Tk - Tq)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        p = tl.where(seen, tl.exp(s - lse_or_0[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dq = tl.dot(ds, k, dq, input_precision="ieee")
    tl.store(DQ + offs_m[:, None] * D + offs_d[None, :], dq * sm_scale, mask=tile_mask)


@triton.jit
def wrong_dq_kernel_ignores_causal(Q, K, V, DO, LSE, DELTA, DQ, Tq, Tk, D, sm_scale, CAUSAL: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Right for non-causal attention; with CAUSAL it still lets every row see every key."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask, d_mask = offs_m < Tq, offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_mask, other=float("-inf"))
    delta = tl.load(DELTA + offs_m, mask=row_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    finite = lse != float("-inf")
    lse_or_0 = tl.where(finite, lse, 0.0)
    for start in range(0, Tk, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        seen = finite[:, None] & (offs_n[None, :] < Tk)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        p = tl.where(seen, tl.exp(s - lse_or_0[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dq = tl.dot(ds, k, dq, input_precision="ieee")
    tl.store(DQ + offs_m[:, None] * D + offs_d[None, :], dq * sm_scale, mask=tile_mask)


@triton.jit
def wrong_dq_kernel_no_inf_guard(Q, K, V, DO, LSE, DELTA, DQ, Tq, Tk, D, sm_scale, CAUSAL: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Masks by multiplying: a row that sees no key (lse = -inf) gets exp(+inf) * 0 = NaN."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask, d_mask = offs_m < Tq, offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_mask, other=float("-inf"))
    delta = tl.load(DELTA + offs_m, mask=row_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, Tk, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        seen = offs_n[None, :] < Tk
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= offs_m[:, None] + Tk - Tq)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        p = tl.exp(s - lse[:, None]) * seen.to(tl.float32)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dq = tl.dot(ds, k, dq, input_precision="ieee")
    tl.store(DQ + offs_m[:, None] * D + offs_d[None, :], dq * sm_scale, mask=tile_mask)


CASES = [
    (ex.check_merge, right_merge, buggy_merge_as_shown),
    (ex.check_naive_bytes, right_naive, wrong_naive_no_round_trip),
    (ex.check_tiled_causal_bytes, right_tiled_causal, wrong_tiled_causal_full_blocks),
    (ex.check_key_tile, right_tile, wrong_tile_no_column_mask),
]
if HAS_TRITON:
    CASES.append((ex.check_dq_kernel, right_dq_kernel, wrong_dq_kernel_ignores_causal))


def test_tl_load_masks_and_faults():
    flat = torch.arange(6.0)
    got = ex.tl_load(flat, torch.tensor([0, 5, 6, 7]), torch.tensor([True, True, False, False]), other=-1.0)
    assert got.tolist() == [0.0, 5.0, -1.0, -1.0]
    with pytest.raises(IndexError, match="outside the buffer"):
        ex.tl_load(flat, torch.tensor([6]), torch.tensor([True]))


import labsrc.kernels.flash_attention as attention_kernels  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the kernel exercise needs Triton")


@triton.jit
def library_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, Tq, Tk, D, sm_scale, CAUSAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Hands the work to the lab's own helper: the check must refuse it whatever it computes."""
    q = tl.load(Q + tl.arange(0, BLOCK_M)[:, None] * D + tl.arange(0, BLOCK_D)[None, :])
    attention_kernels._recompute_p(q, q, q, q, q, Tq, Tk, 0, sm_scale, CAUSAL, "ieee")


@needs_triton
def test_kernel_check_refuses_the_library_helper_and_plain_functions(lenient, capsys):
    result = ex.check_dq_kernel(library_dq_kernel)
    assert result.status == "failed" and "the lab's own attention_kernels" in result.message
    assert "Hint:" in result.message

    def plain_python(*args):
        return right_dq_kernel

    result = ex.check_dq_kernel(plain_python)
    assert result.status == "failed" and "@triton.jit" in result.message


@needs_triton
def test_kernel_check_catches_the_minus_inf_rule_and_names_the_row(lenient, capsys):
    """A kernel that masks by multiplying makes NaN of the rows that see no key (causal, Tq > Tk)."""
    result = ex.check_dq_kernel(wrong_dq_kernel_no_inf_guard)
    assert result.status == "failed" and "sees no key" not in result.message and "trial" in result.message


@needs_triton
def test_kernel_check_names_a_causal_row_for_a_kernel_that_ignores_the_mask(lenient, capsys):
    result = ex.check_dq_kernel(wrong_dq_kernel_ignores_causal)
    assert result.status == "failed" and "first at element" in result.message


def test_kernel_check_cases_cover_causal_rows_without_keys_and_odd_sizes():
    gen = torch.Generator().manual_seed(37)
    cases = [ex._dq_inputs(gen) for _ in range(30)]
    assert any(c[4] and c[0].shape[0] > c[1].shape[0] for c in cases)      # causal, Tq > Tk
    assert any(not c[4] for c in cases)
    assert any(c[0].shape[0] % ex.KERNEL_BLOCK_M and c[1].shape[0] % ex.KERNEL_BLOCK_N and c[0].shape[1] % 2
               for c in cases)
    q, k, v, dout, causal, scale = next(c for c in cases if c[4] and c[0].shape[0] > c[1].shape[0])
    dq, lse, _ = ex._dq_reference(q, k, v, dout, causal, scale)
    assert torch.isneginf(lse).any() and bool((dq[torch.isneginf(lse)] == 0).all())


def test_dq_reference_is_autograd():
    gen = torch.Generator().manual_seed(5)
    for causal in (False, True):
        q, k, v, dout = (torch.randn(n, 7, generator=gen, dtype=torch.float64) for n in (9, 12, 12, 9))
        q.requires_grad_()
        s = (q @ k.T) * 0.3
        if causal:
            s = s.masked_fill(torch.arange(12)[None, :] > torch.arange(9)[:, None] + 3, float("-inf"))
        (torch.softmax(s, -1) @ v).backward(dout)
        torch.testing.assert_close(ex._dq_reference(q.detach(), k, v, dout, causal, 0.3)[0], q.grad)


def test_kernel_check_is_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_dq_kernel, right_dq_kernel, monkeypatch, capsys)


@triton.jit
def stub_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, Tq, Tk, D, sm_scale, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """What the student build's kernel looks like: nbgrader replaces the solution by a raise."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    raise NotImplementedError()


@needs_triton
def test_kernel_stub_is_not_solved_yet(lenient, capsys):
    assert ex.check_dq_kernel(stub_dq_kernel).status == "not solved yet"


def test_merge_check_catches_each_bug_of_the_shown_merge_and_says_where(lenient, capsys):
    """The shown merge has two bugs; fixing one leaves the other caught, each with its own diagnosis."""
    result = ex.check_merge(merge_fixing_only_the_weights)
    assert result.status == "failed" and "neither chunk saw a key" not in result.message
    result = ex.check_merge(buggy_merge_as_shown)
    assert result.status == "failed"
    assert "neither chunk saw a key" not in result.message and "same row max" not in result.message
    result = ex.check_merge(merge_forgets_max)
    assert result.status == "failed"


def test_merge_reference_equals_softmax_over_both_chunks():
    gen = torch.Generator().manual_seed(3)
    s1, s2 = torch.randn(4, 5, generator=gen, dtype=torch.float64), torch.randn(4, 9, generator=gen,
                                                                               dtype=torch.float64)
    v1, v2 = torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(9, 3, generator=gen,
                                                                              dtype=torch.float64)
    whole = torch.softmax(torch.cat([s1, s2], 1), -1) @ torch.cat([v1, v2])
    torch.testing.assert_close(ex._merge_reference(*ex._partial(s1, v1), *ex._partial(s2, v2)), whole)
    one = ex._empty_rows(*ex._partial(s1, v1), torch.tensor([True, False, True, False]))
    two = ex._empty_rows(*ex._partial(s2, v2), torch.tensor([True, True, False, False]))
    got = ex._merge_reference(*one, *two)
    assert bool((got[0] == 0).all())
    torch.testing.assert_close(got[1], (torch.softmax(s1[1], -1) @ v1))
    torch.testing.assert_close(got[2], (torch.softmax(s2[2], -1) @ v2))


def test_tiled_causal_prediction_is_checked_against_a_measurement(lenient, capsys):
    calls = []

    def measure(T, D, block_m):  # stands for the chapter's tiled_attention byte count (fp32)
        calls.append((T, D, block_m))
        return right_tiled_causal(T, D, block_m, 4)

    assert ex.check_tiled_causal_bytes(right_tiled_causal, measure=measure).passed and calls
    assert ex.check_tiled_causal_bytes(wrong_tiled_causal_full_blocks, measure=measure).status == "failed"


def _tiled_measurement(T, D, block_m):  # stands for the chapter's tiled_attention
    return right_tiled_causal(T, D, block_m, 4)


def _measure(T, D, block_m):
    return _tiled_measurement(T, D, block_m)


def test_tiled_causal_prediction_may_not_run_the_measurement(lenient, capsys):
    def calls_the_measurement(T, D, block_m, dtype_bytes):
        return _tiled_measurement(T, D, block_m) * dtype_bytes // 4

    result = ex.check_tiled_causal_bytes(calls_the_measurement, measure=_measure)
    assert result.status == "failed" and "_tiled_measurement" in result.message and "Hint:" in result.message
    assert ex.check_tiled_causal_bytes(right_tiled_causal, measure=_measure).passed
