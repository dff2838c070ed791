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
    a1, a2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    return (a1[:, None] * o1 + a2[:, None] * o2) / (a1 + a2)[:, None]


def wrong_merge_forgets_max(m1, l1, o1, m2, l2, o2):
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
def right_block_kernel(Q, K, V, VIS, M, L, ACC, Tq, n_keys, D, qk_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask, d_mask = offs_m < Tq, offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    m = tl.load(M + offs_m, mask=row_mask, other=float("-inf"))
    l = tl.load(L + offs_m, mask=row_mask, other=0.0)
    acc = tl.load(ACC + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    vis = tl.load(VIS + offs_m, mask=row_mask, other=0)
    kv_mask = (offs_n[:, None] < n_keys) & d_mask[None, :]
    k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(offs_n[None, :] < vis[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = alpha * l + tl.sum(p, 1)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    tl.store(M + offs_m, m_new, mask=row_mask)
    tl.store(L + offs_m, l, mask=row_mask)
    tl.store(ACC + offs_m[:, None] * D + offs_d[None, :], acc, mask=tile_mask)


@triton.jit
def wrong_block_kernel_no_inf_guard(Q, K, V, VIS, M, L, ACC, Tq, n_keys, D, qk_scale,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Right except for the -inf rule: a row whose scores are all -inf so far gets exp(-inf - -inf) = NaN."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask, d_mask = offs_m < Tq, offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    m = tl.load(M + offs_m, mask=row_mask, other=float("-inf"))
    l = tl.load(L + offs_m, mask=row_mask, other=0.0)
    acc = tl.load(ACC + offs_m[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0)
    vis = tl.load(VIS + offs_m, mask=row_mask, other=0)
    kv_mask = (offs_n[:, None] < n_keys) & d_mask[None, :]
    k = tl.load(K + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(offs_n[None, :] < vis[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = alpha * l + tl.sum(p, 1)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    tl.store(M + offs_m, m_new, mask=row_mask)
    tl.store(L + offs_m, l, mask=row_mask)
    tl.store(ACC + offs_m[:, None] * D + offs_d[None, :], acc, mask=tile_mask)


CASES = [
    (ex.check_merge, right_merge, wrong_merge_forgets_max),
    (ex.check_naive_bytes, right_naive, wrong_naive_no_round_trip),
    (ex.check_tiled_causal_bytes, right_tiled_causal, wrong_tiled_causal_full_blocks),
    (ex.check_key_tile, right_tile, wrong_tile_no_column_mask),
]
if HAS_TRITON:
    CASES.append((ex.check_online_softmax_kernel, right_block_kernel, wrong_block_kernel_no_inf_guard))


def test_tl_load_masks_and_faults():
    flat = torch.arange(6.0)
    got = ex.tl_load(flat, torch.tensor([0, 5, 6, 7]), torch.tensor([True, True, False, False]), other=-1.0)
    assert got.tolist() == [0.0, 5.0, -1.0, -1.0]
    with pytest.raises(IndexError, match="outside the buffer"):
        ex.tl_load(flat, torch.tensor([6]), torch.tensor([True]))


import labsrc.kernels.attention as attention_kernels  # noqa: E402


@triton.jit
def library_block_kernel(Q, K, V, VIS, M, L, ACC, Tq, n_keys, D, qk_scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Hands the update to the lab's own helper: the check must refuse it whatever it computes."""
    m = tl.load(M + tl.arange(0, BLOCK_M))
    attention_kernels._online_softmax_step(m, m, m[:, None])


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_refuses_the_library_helper_and_plain_functions(lenient, capsys):
    result = ex.check_online_softmax_kernel(library_block_kernel)
    assert result.status == "failed" and "the lab's own attention_kernels" in result.message
    assert "Hint:" in result.message

    def plain_python(*args):
        return right_block_kernel

    result = ex.check_online_softmax_kernel(plain_python)
    assert result.status == "failed" and "@triton.jit" in result.message


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_cases_include_an_all_minus_inf_block():
    gen = torch.Generator().manual_seed(35)
    c = ex._block_update_inputs(gen, all_masked=True)
    assert bool((c[3] == 0).all()) and bool(torch.isneginf(c[4]).all())
    cases = [ex._block_update_inputs(gen) for _ in range(20)]
    assert any(bool((c[3] == 0).any()) and not bool(torch.isinf(c[4]).any()) for c in cases)  # carried + masked
    assert any(c[0].shape[0] % ex.KERNEL_BLOCK_M and c[1].shape[0] % 2 for c in cases)  # odd, ragged sizes


def test_kernel_check_is_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_online_softmax_kernel, right_block_kernel, monkeypatch,
                                             capsys)


@triton.jit
def stub_block_kernel(Q, K, V, VIS, M, L, ACC, Tq, n_keys, D, qk_scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """What the student build's kernel looks like: nbgrader replaces the solution by a raise."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    raise NotImplementedError()


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_stub_is_not_solved_yet(lenient, capsys):
    assert ex.check_online_softmax_kernel(stub_block_kernel).status == "not solved yet"


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
