"""The pipeline chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, and the kernel
exercise catches a missing mask, a wrong tie-break and a wrong count, and says it is skipped without Triton."""
import labsrc  # noqa: F401

import itertools

import pytest

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime
from labsrc.exercises import pipeline as ex
from labsrc.kernels._triton import tl, triton
from labsrc.pipeline import simulate as sim
from labsrc.pipeline.stages import split_layers


def bubble_right(timelines, wall):
    busy = sum(e[2] - e[1] for tl_ in timelines for e in tl_ if e[0] in ("draft", "forward", "verify"))
    return 1 - busy / (len(timelines) * wall)


def bubble_wrong_counts_waits(timelines, wall):
    busy = sum(e[2] - e[1] for tl_ in timelines for e in tl_ if e[0] != "skip")
    return 1 - busy / (len(timelines) * wall)


def balance_right(times, P):
    L = len(times)
    best, arg = None, None
    for cuts in itertools.combinations(range(1, L), P - 1):
        b = (0,) + cuts + (L,)
        worst = max(sum(times[x:y]) for x, y in zip(b, b[1:]))
        if best is None or worst < best:
            best, arg = worst, [y - x for x, y in zip(b, b[1:])]
    return arg


def balance_wrong_even(times, P):       # even counts ignore the measured times
    base, extra = divmod(len(times), P)
    return [base + (1 if s < extra else 0) for s in range(P)]


def plain_right(stage_times, draft_time, comm_time, k, alpha):
    P = len(stage_times)
    cycle = k * draft_time + sum(stage_times) + (P * comm_time if P > 1 else 0.0)
    tokens = sum(alpha ** i for i in range(k + 1))
    return cycle / tokens


def plain_wrong_no_bonus(stage_times, draft_time, comm_time, k, alpha):   # forgets the target's own token
    P = len(stage_times)
    cycle = k * draft_time + sum(stage_times) + (P * comm_time if P > 1 else 0.0)
    return cycle / max(sum(alpha ** i for i in range(1, k + 1)), 1e-9)


@triton.jit
def verify_right(logits, tokens, first, preds, accepted, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    ok = (rows < N)[:, None] & (cols < V)[None, :]
    x = tl.load(logits + b * N * V + rows[:, None] * V + cols[None, :], mask=ok, other=float("-inf"))
    m = tl.max(x, axis=1)
    pred = tl.min(tl.where((x == m[:, None]) & ok, cols[None, :], V), axis=1).to(tl.int64)
    tl.store(preds + b * N + rows, pred, mask=rows < N)
    nxt = tl.load(tokens + b * N + rows + 1, mask=rows + 1 < N, other=-1)
    run = tl.min(tl.where((rows + 1 < N) & (nxt != pred), rows, N - 1), axis=0)
    ok0 = tl.load(tokens + b * N) == tl.load(first + b)
    tl.store(accepted + b, tl.where(ok0, run + 1, 0).to(tl.int64))


@triton.jit
def verify_last_tie(logits, tokens, first, preds, accepted, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    ok = (rows < N)[:, None] & (cols < V)[None, :]
    x = tl.load(logits + b * N * V + rows[:, None] * V + cols[None, :], mask=ok, other=float("-inf"))
    m = tl.max(x, axis=1)
    pred = tl.max(tl.where((x == m[:, None]) & ok, cols[None, :], -1), axis=1).to(tl.int64)   # last maximum
    tl.store(preds + b * N + rows, pred, mask=rows < N)
    nxt = tl.load(tokens + b * N + rows + 1, mask=rows + 1 < N, other=-1)
    run = tl.min(tl.where((rows + 1 < N) & (nxt != pred), rows, N - 1), axis=0)
    ok0 = tl.load(tokens + b * N) == tl.load(first + b)
    tl.store(accepted + b, tl.where(ok0, run + 1, 0).to(tl.int64))


@triton.jit
def verify_no_store_mask(logits, tokens, first, preds, accepted, N, V, BLOCK_N: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    ok = (rows < N)[:, None] & (cols < V)[None, :]
    x = tl.load(logits + b * N * V + rows[:, None] * V + cols[None, :], mask=ok, other=float("-inf"))
    m = tl.max(x, axis=1)
    pred = tl.min(tl.where((x == m[:, None]) & ok, cols[None, :], V), axis=1).to(tl.int64)
    tl.store(preds + b * N + rows, pred)                                  # rows past N spill over
    nxt = tl.load(tokens + b * N + rows + 1, mask=rows + 1 < N, other=-1)
    run = tl.min(tl.where((rows + 1 < N) & (nxt != pred), rows, N - 1), axis=0)
    ok0 = tl.load(tokens + b * N) == tl.load(first + b)
    tl.store(accepted + b, tl.where(ok0, run + 1, 0).to(tl.int64))


@triton.jit
def verify_counts_all_matches(logits, tokens, first, preds, accepted, N, V, BLOCK_N: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    ok = (rows < N)[:, None] & (cols < V)[None, :]
    x = tl.load(logits + b * N * V + rows[:, None] * V + cols[None, :], mask=ok, other=float("-inf"))
    m = tl.max(x, axis=1)
    pred = tl.min(tl.where((x == m[:, None]) & ok, cols[None, :], V), axis=1).to(tl.int64)
    tl.store(preds + b * N + rows, pred, mask=rows < N)
    nxt = tl.load(tokens + b * N + rows + 1, mask=rows + 1 < N, other=-1)
    hits = tl.sum(((rows + 1 < N) & (nxt == pred)).to(tl.int64), axis=0)   # matches after a miss count too
    ok0 = tl.load(tokens + b * N) == tl.load(first + b)
    tl.store(accepted + b, tl.where(ok0, hits + 1, 0).to(tl.int64))


CASES = [
    (ex.check_pipeline_bubble, bubble_right, bubble_wrong_counts_waits),
    (ex.check_pipeline_balance, balance_right, balance_wrong_even),
    (ex.check_pipeline_plain_time, plain_right, plain_wrong_no_bonus),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_pipeline_verify_kernel, verify_right, verify_last_tie),
              (ex.check_pipeline_verify_kernel, verify_right, verify_no_store_mask),
              (ex.check_pipeline_verify_kernel, verify_right, verify_counts_all_matches)]

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


@needs_triton
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_pipeline_verify_kernel(verify_no_store_mask)
    assert result.status == "failed" and "outside its outputs" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_pipeline_verify_kernel, verify_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_pipeline_bubble, lambda t, w: sim.bubble_fraction(t, w), "bubble_fraction"),
    (ex.check_pipeline_balance, lambda t, P: [len(r) for r in split_layers(len(t), P, t)], "split_layers"),
    (ex.check_pipeline_plain_time,
     lambda st, d, c, k, a: (k * d + sum(st) + (len(st) * c if len(st) > 1 else 0)) / sim.expected_committed(a, k),
     "expected_committed"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message


def test_plain_time_message_does_not_leak_the_answer(lenient, capsys):
    ex.check_pipeline_plain_time(plain_wrong_no_bonus)
    out = capsys.readouterr().out
    assert f"{ex._plain_reference([0.02, 0.02], 0.001, 0.0005, 4, 1.0)!r}" not in out
