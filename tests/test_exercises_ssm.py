"""The state-space chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc.ssm function they ask for, and the
kernel exercise catches a scan that drops its carry or carries only the last block, and says it is skipped without
Triton."""
import labsrc  # noqa: F401

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime, ssm
from labsrc.exercises import ssm as ex
from labsrc.kernels._triton import tl, triton


def zoh_right(a, b, dt):
    Ab = torch.exp(dt * a)
    return Ab, (Ab - 1) / a * b


def zoh_wrong_euler(a, b, dt):          # forward Euler, not the exact hold
    return 1 + dt * a, dt * b


def combine_right(left, right):
    (a1, b1), (a2, b2) = left, right
    return a1 * a2, a2 * b1 + b2


def combine_wrong_order(left, right):   # applies right first
    (a1, b1), (a2, b2) = left, right
    return a1 * a2, a1 * b2 + b1


def chunk_right(S, x, dt, A, B):
    cs = torch.cumsum(dt * A, 0)
    to_end = torch.exp(cs[-1] - cs)
    return torch.exp(cs[-1]) * S + (x * (dt * to_end)[:, None]).T @ B


def chunk_wrong_no_decay(S, x, dt, A, B):  # forgets that earlier writes decay to the chunk's end
    return torch.exp(A * dt.sum()) * S + (x * dt[:, None]).T @ B


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def kernel_right(a_ptr, b_ptr, h_ptr, L, BLOCK_L: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        idx = start + offs
        mask = idx < L
        a = tl.load(a_ptr + row * L + idx, mask=mask, other=1.0)
        b = tl.load(b_ptr + row * L + idx, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, b), 0, _combine)
        h = A * carry + B
        tl.store(h_ptr + row * L + idx, h, mask=mask)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, h, 0.0), axis=0)


@triton.jit
def kernel_no_carry(a_ptr, b_ptr, h_ptr, L, BLOCK_L: tl.constexpr):   # every block starts from h = 0
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    for start in range(0, L, BLOCK_L):
        idx = start + offs
        mask = idx < L
        a = tl.load(a_ptr + row * L + idx, mask=mask, other=1.0)
        b = tl.load(b_ptr + row * L + idx, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, b), 0, _combine)
        tl.store(h_ptr + row * L + idx, B, mask=mask)


@triton.jit
def kernel_carry_forgets_history(a_ptr, b_ptr, h_ptr, L, BLOCK_L: tl.constexpr):  # carries B, not h
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        idx = start + offs
        mask = idx < L
        a = tl.load(a_ptr + row * L + idx, mask=mask, other=1.0)
        b = tl.load(b_ptr + row * L + idx, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, b), 0, _combine)
        h = A * carry + B
        tl.store(h_ptr + row * L + idx, h, mask=mask)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, B, 0.0), axis=0)


@triton.jit
def kernel_unmasked_store(a_ptr, b_ptr, h_ptr, L, BLOCK_L: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        idx = start + offs
        mask = idx < L
        a = tl.load(a_ptr + row * L + idx, mask=mask, other=1.0)
        b = tl.load(b_ptr + row * L + idx, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, b), 0, _combine)
        h = A * carry + B
        tl.store(h_ptr + row * L + idx, h)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, h, 0.0), axis=0)


needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")

CASES = [
    (ex.check_zoh_diagonal, zoh_right, zoh_wrong_euler),
    (ex.check_scan_combine, combine_right, combine_wrong_order),
    (ex.check_ssd_chunk_state, chunk_right, chunk_wrong_no_decay),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_scan_kernel, kernel_right, kernel_no_carry),
              (ex.check_scan_kernel, kernel_right, kernel_carry_forgets_history)]


@needs_triton
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_scan_kernel(kernel_unmasked_store)
    assert result.status == "failed" and "outside the output" in result.message


@needs_triton
def test_kernel_check_points_at_the_block_boundary(lenient, capsys):
    result = ex.check_scan_kernel(kernel_no_carry)
    assert result.status == "failed" and "from block 1 on" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_scan_kernel, kernel_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_zoh_diagonal, lambda a, b, dt: ssm.discretize(a, b, dt, "zoh"), "discretize"),
    (ex.check_scan_combine, lambda p, q: ssm.scan_combine(p, q), "scan_combine"),
    (ex.check_ssd_chunk_state, lambda S, x, dt, A, B: ssm.ssd_recurrent(
        x[None, :, None], dt[None, :, None], torch.tensor([A], dtype=torch.float64), B[None, :, None],
        B[None, :, None] * 0, initial_state=S[None, None])[1][0, 0], "ssd_recurrent"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message


def test_messages_do_not_leak_the_answer(lenient, capsys):
    ex.check_ssd_chunk_state(chunk_wrong_no_decay)
    out = capsys.readouterr().out
    args = ex._chunk_inputs(torch.Generator().manual_seed(73))
    assert f"{float(chunk_right(*args)[0, 0]):.4f}" not in out
