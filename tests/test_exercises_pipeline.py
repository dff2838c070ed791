"""The pipeline chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, name the
failing case (a configuration, never a direction), refuse a split searched with the simulator, and name a draft
on the edge of the margin, and the kernel check says it is skipped without Triton."""
import labsrc  # noqa: F401

import itertools
import re

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
from labsrc.exercises import ExerciseFailed
from labsrc.pipeline.stages import split_layers


def bubble_right(timelines, wall):
    busy = sum(e[2] - e[1] for tl_ in timelines for e in tl_ if e[0] in ("draft", "forward", "verify"))
    return 1 - busy / (len(timelines) * wall)


def bubble_wrong_counts_waits(timelines, wall):
    busy = sum(e[2] - e[1] for tl_ in timelines for e in tl_ if e[0] != "skip")
    return 1 - busy / (len(timelines) * wall)


def predicted_right(stage_times, draft_time, comm_time, k, sequences):
    P = len(stage_times)
    work = k * draft_time + sum(stage_times)
    cycle = work + (P * comm_time if P > 1 else 0.0)
    period = max(cycle / sequences, k * draft_time + stage_times[0], *stage_times[1:])
    return 1 - work / (P * period)


def predicted_wrong_always_full(stage_times, draft_time, comm_time, k, sequences):   # forgets few sequences
    P = len(stage_times)
    work = k * draft_time + sum(stage_times)
    return 1 - work / (P * max(k * draft_time + stage_times[0], *stage_times[1:]))


def predicted_wrong_plain_bound(stage_times, draft_time, comm_time, k, sequences):
    return 1 - 1 / len(stage_times)


def split_right(case):                     # the insight: stage 0 also drafts, so its layers weigh more
    w = list(case["layer_times"])
    w[0] += case["k"] * case["draft_time"]
    return [len(r) for r in split_layers(len(w), case["stages"], w)]


def split_by_search(case):                 # exhaustive search with the simulator: the bypass the check refuses
    layers, stages = len(case["layer_times"]), case["stages"]
    best = None
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        b = (0,) + cuts + (layers,)
        counts = [y - x for x, y in zip(b, b[1:])]
        times = [sum(case["layer_times"][x:y]) for x, y in zip(b, b[1:])]
        t = sim.simulate(times, case["draft_time"], case["comm_time"], case["k"], 0.5,
                         micro_batches=case["sequences"], schedule="overlapped", depth=1, tokens=96)["time_per_token"]
        if best is None or t < best[0]:
            best = (t, counts)
    return best[1]


def split_wrong_layers_only(case):         # balances the layers and forgets the draft on stage 0
    w = case["layer_times"]
    return [len(r) for r in split_layers(len(w), case["stages"], w)]


@triton.jit
def lenient_right(logits, drafts, accepted, next_token, K, V, delta, BLOCK_K: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_V)
    base = logits + b * (K + 1) * V
    x = tl.load(base + rows[:, None] * V + cols[None, :],
                mask=(rows < K + 1)[:, None] & (cols < V)[None, :], other=float("-inf"))
    best = tl.max(x, axis=1)
    first = tl.min(tl.where(x == best[:, None], cols[None, :], V), axis=1)
    d = tl.load(drafts + b * K + rows, mask=rows < K, other=0)
    mine = tl.load(base + rows * V + d, mask=rows < K, other=float("-inf"))
    miss = (rows < K) & (mine < best - delta)
    n = tl.min(tl.where(miss, rows, K), axis=0)
    tl.store(accepted + b, n.to(tl.int64))
    tl.store(next_token + b, tl.sum(tl.where(rows == n, first, 0), axis=0).to(tl.int64))


@triton.jit
def lenient_strict_margin(logits, drafts, accepted, next_token, K, V, delta, BLOCK_K: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_V)
    base = logits + b * (K + 1) * V
    x = tl.load(base + rows[:, None] * V + cols[None, :],
                mask=(rows < K + 1)[:, None] & (cols < V)[None, :], other=float("-inf"))
    best = tl.max(x, axis=1)
    first = tl.min(tl.where(x == best[:, None], cols[None, :], V), axis=1)
    d = tl.load(drafts + b * K + rows, mask=rows < K, other=0)
    mine = tl.load(base + rows * V + d, mask=rows < K, other=float("-inf"))
    miss = (rows < K) & (mine <= best - delta)                          # a draft on the edge fails
    n = tl.min(tl.where(miss, rows, K), axis=0)
    tl.store(accepted + b, n.to(tl.int64))
    tl.store(next_token + b, tl.sum(tl.where(rows == n, first, 0), axis=0).to(tl.int64))


@triton.jit
def lenient_counts_all_passes(logits, drafts, accepted, next_token, K, V, delta, BLOCK_K: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_V)
    base = logits + b * (K + 1) * V
    x = tl.load(base + rows[:, None] * V + cols[None, :],
                mask=(rows < K + 1)[:, None] & (cols < V)[None, :], other=float("-inf"))
    best = tl.max(x, axis=1)
    first = tl.min(tl.where(x == best[:, None], cols[None, :], V), axis=1)
    d = tl.load(drafts + b * K + rows, mask=rows < K, other=0)
    mine = tl.load(base + rows * V + d, mask=rows < K, other=float("-inf"))
    n = tl.sum(((rows < K) & (mine >= best - delta)).to(tl.int32), axis=0)   # passes after a miss count
    tl.store(accepted + b, n.to(tl.int64))
    tl.store(next_token + b, tl.sum(tl.where(rows == n, first, 0), axis=0).to(tl.int64))


@triton.jit
def lenient_next_from_last_accepted(logits, drafts, accepted, next_token, K, V, delta, BLOCK_K: tl.constexpr,
                                    BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_V)
    base = logits + b * (K + 1) * V
    x = tl.load(base + rows[:, None] * V + cols[None, :],
                mask=(rows < K + 1)[:, None] & (cols < V)[None, :], other=float("-inf"))
    best = tl.max(x, axis=1)
    first = tl.min(tl.where(x == best[:, None], cols[None, :], V), axis=1)
    d = tl.load(drafts + b * K + rows, mask=rows < K, other=0)
    mine = tl.load(base + rows * V + d, mask=rows < K, other=float("-inf"))
    miss = (rows < K) & (mine < best - delta)
    n = tl.min(tl.where(miss, rows, K), axis=0)
    tl.store(accepted + b, n.to(tl.int64))
    prev = tl.maximum(n - 1, 0)                                          # the row before: off by one
    tl.store(next_token + b, tl.sum(tl.where(rows == prev, first, 0), axis=0).to(tl.int64))


CASES = [
    (ex.check_pipeline_bubble, bubble_right, bubble_wrong_counts_waits),
    (ex.check_pipeline_predicted_bubble, predicted_right, predicted_wrong_always_full),
    (ex.check_pipeline_split, split_right, split_wrong_layers_only),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_pipeline_lenient_kernel, lenient_right, lenient_strict_margin),
              (ex.check_pipeline_lenient_kernel, lenient_right, lenient_counts_all_passes),
              (ex.check_pipeline_lenient_kernel, lenient_right, lenient_next_from_last_accepted)]

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


def test_the_bubble_check_names_the_configuration_not_the_direction(lenient, capsys):
    for wrong in (predicted_wrong_always_full, predicted_wrong_plain_bound):
        result = ex.check_pipeline_predicted_bubble(wrong)
        assert result.status == "failed" and "trial" in result.message
        assert not re.search(r"\b(too|large|small|larger|smaller)\b", result.message.split("Hint")[0])


def test_the_predicted_bubble_matches_the_simulator_with_random_acceptance():
    """The check measures with every window accepting half its drafts; the bubble does not depend on that."""
    args = ([0.003, 0.003, 0.004], 0.0005, 0.0005, 4, 6)
    runs = [sim.simulate(*args[:4], 0.6, micro_batches=6, schedule="overlapped", depth=1, tokens=400, seed=s)
            for s in range(4)]
    mean = sum(r["bubble"] for r in runs) / len(runs)
    assert abs(mean - predicted_right(*args)) < ex.BUBBLE_TOLERANCE


def test_a_split_from_the_insight_passes_every_case(lenient, capsys):
    assert ex.check_pipeline_split(split_right).passed
    assert ex.check_pipeline_split(split_right, hidden=True).passed


def test_the_split_check_refuses_a_search_with_the_simulator(lenient, capsys):
    result = ex.check_pipeline_split(split_by_search)
    assert result.status == "failed" and "simulate" in result.message


def test_the_split_check_names_the_configuration(lenient, capsys):
    result = ex.check_pipeline_split(split_wrong_layers_only)
    assert result.status == "failed" and "configuration 1" in result.message
    assert "slower" not in result.message


def test_the_split_check_takes_configurations_from_the_notebook(lenient, capsys):
    """The instructor notebook's hidden section writes configurations out (they are not in the package)."""
    case = dict(layer_times=[0.8e-3, 0.8e-3, 2.4e-3, 0.8e-3, 0.8e-3, 0.8e-3, 2.4e-3, 0.8e-3, 1.6e-3],
                draft_time=0.3e-3, k=6, comm_time=0.05e-3, stages=3, sequences=6)
    assert ex.check_pipeline_split(split_right, hidden=[case]).passed
    with pytest.raises(ExerciseFailed, match="configuration 5"):
        ex.check_pipeline_split(lambda c: split_right(c) if c["draft_time"] != 0.3e-3 else [1, 1, 7],
                                hidden=[case])


def test_the_layer_balanced_split_is_clearly_worse():
    """The experiment separates the two answers: balancing the layers alone costs far more than the tolerance."""
    case = ex.split_case()
    ratio = ex._split_time(case, split_wrong_layers_only(case)) / ex._split_time(case, split_right(case))
    assert ratio > 1 + 5 * ex.SPLIT_TOLERANCE


@needs_triton
def test_the_kernel_hint_names_a_draft_on_the_edge(lenient, capsys):
    result = ex.check_pipeline_lenient_kernel(lenient_strict_margin)
    assert result.status == "failed" and "edge of the margin" in result.message


@needs_triton
def test_the_kernel_hint_separates_the_count_from_the_token(lenient, capsys):
    result = ex.check_pipeline_lenient_kernel(lenient_next_from_last_accepted)
    assert result.status == "failed" and "next_token is wrong" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_pipeline_lenient_kernel, lenient_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_pipeline_bubble, lambda t, w: sim.bubble_fraction(t, w), "bubble_fraction"),
    (ex.check_pipeline_predicted_bubble,
     lambda st, d, c, k, m: sim.simulate(st, d, c, k, 0.5, micro_batches=m, depth=1)["bubble"], "simulate"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
