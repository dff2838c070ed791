"""Checks for the exercises of the pipeline chapter (pipeline speculative decoding).

Each check calls the student's function on its cases and compares it with the truth it computes itself (the
lab's own functions, or the discrete-event simulator :mod:`labsrc.pipeline.simulate` as the measurement);
it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` for the stub. Expected answers are
computed here, never printed.

* :func:`check_pipeline_bubble` -- ``fn(timelines, wall) -> float``: the bubble fraction of a run from its
  per-rank timelines.
* :func:`check_pipeline_predicted_bubble` -- ``fn(stage_times, draft_time, comm_time, k, sequences) ->
  float``: a prediction of a schedule's long-run bubble from its stage times, compared with the simulator.
* :func:`check_pipeline_split` -- ``fn(case) -> list[int]``: the layers per stage chosen for a configuration
  (:func:`split_case` and others the check draws), judged by re-running the simulator on the choice against the
  best contiguous split; the answer may not call the simulator.
* :func:`check_pipeline_lenient_kernel` -- a ``@triton.jit`` kernel doing a lenient (top-delta) verification
  of one window per program and emitting the target's next token, launched under the interpreter and compared
  with :func:`lenient_verify_ref`.

A check refuses an answer that calls the library function the exercise asks the student to write (or, for the
prediction, the simulator that measures it).
"""
from __future__ import annotations

import contextvars
import itertools
import math

import torch

from labsrc import runtime
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import NOT_SOLVED, PASSED, Result, _report, exercise, hidden, randint, refuse_library
from labsrc.kernels import pipeline as kverify
from labsrc.pipeline import simulate as sim

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["check_pipeline_bubble", "check_pipeline_predicted_bubble", "check_pipeline_split", "split_case",
           "check_pipeline_lenient_kernel", "lenient_verify_ref"]


def _call(fn, *args):
    """``(value, None)``, or ``(None, Result)`` for the stub."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, Result("", NOT_SOLVED, "Fill in the function above, then run this cell again.")


def _number(x):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        try:
            x = x.item()
        except (TypeError, ValueError):
            pass
    return x


# --------------------------------------------------------------------------------------------- bubble

def _timelines(gen) -> tuple[list, float]:
    """Random per-rank timelines: compute events (draft, forward, verify) with waits and zero-length skips."""
    P = randint(gen, 1, 4)
    ranks, end = [], 0.0
    for r in range(P):
        t, events = float(randint(gen, 0, 3)) / 10, []
        for i in range(randint(gen, 1, 7)):
            what = ["draft", "forward", "verify", "wait", "skip"][randint(gen, 0, 4)]
            if r == 0 and i == 0:
                what = "draft"
            length = 0.0 if what == "skip" else randint(gen, 1, 20) / 10
            events.append((what, t, t + length, randint(gen, 0, 2), i))
            t += length + randint(gen, 0, 5) / 10
        ranks.append(events)
        end = max(end, t)
    return ranks, end + randint(gen, 0, 10) / 10


def _bubble_slip(got) -> str:
    """The invariant a bubble fraction breaks outright, when it does: a fraction lies in [0, 1]."""
    if isinstance(got, (int, float)) and not isinstance(got, bool) and not 0 <= got <= 1:
        return " It breaks an invariant: a fraction lies in [0, 1]."
    return ""


@exercise
def check_pipeline_bubble(fn) -> Result:
    """Check ``fn(timelines, wall) -> float``: one minus the busy share of the pipeline's ``P * wall``
    rank-seconds, where only ``draft``, ``forward`` and ``verify`` events keep a rank busy."""
    name = "bubble fraction of a timeline"
    hint = ("re-read the task of Exercise 1 (which events keep a rank busy, and over what the share is taken) "
            "and work the failing trial's timelines out by hand.")
    seed, trials = seed_for(31), trials_for(8)
    gen = torch.Generator().manual_seed(seed)
    first = _timelines(torch.Generator().manual_seed(seed))
    refused = refuse_library(name, fn, (sim.bubble_fraction, sim.busy_fraction), hint, owner="labsrc.pipeline",
                             args=first)
    if refused is not None:
        return refused
    for trial in range(trials):
        timelines, wall = _timelines(gen)
        got, unsolved = _call(fn, timelines, wall)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        got = _number(got)
        want = sim.bubble_fraction(timelines, wall)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isclose(got, want, rel_tol=1e-9,
                                                                                          abs_tol=1e-12):
            kinds = sorted({e[0] for tl in timelines for e in tl})
            return failed(name, f"trial {trial + 1} ({len(timelines)} ranks, events {kinds}): the answer is not "
                                f"the bubble fraction of these timelines.{_bubble_slip(got)} Hint: {hint}")
    return _report(Result(name, PASSED, "right on all the check's random timelines."))


# ------------------------------------------------------------------------------------ predicted bubble

BUBBLE_TOLERANCE = 0.02
"""How far a predicted bubble may be from the simulated one (fill and drain move a finite run by less)."""

_SIM_TOKENS = 200


def _bubble_case(gen):
    P = randint(gen, 1, 4)
    stage_times = [randint(gen, 1, 10) / 1000 for _ in range(P)]
    return (stage_times, randint(gen, 1, 20) / 10000, randint(gen, 0, 10) / 10000, randint(gen, 1, 8),
            [1, 2, 3, 5, 8][randint(gen, 0, 4)])


def _bubble_simulated(stage_times, draft_time, comm_time, k, sequences):
    """The measurement: the simulator's bubble for a long run, every window accepting half its drafts (the
    bubble of this schedule does not depend on how many are accepted, only the tokens per window do)."""
    return sim.simulate(list(stage_times), draft_time, comm_time, k, 0.5, micro_batches=sequences,
                        schedule="overlapped", depth=1, tokens=_SIM_TOKENS, accept=lambda s, w: k // 2)["bubble"]


@exercise
def check_pipeline_predicted_bubble(fn) -> Result:
    """Check ``fn(stage_times, draft_time, comm_time, k, sequences) -> float``: the predicted long-run bubble
    fraction of the overlapped schedule with one window in flight per sequence and ``sequences`` sequences
    (``sequences = 1`` is the plain schedule), against the simulator's measurement of a long run, within
    :data:`BUBBLE_TOLERANCE`. Stage 0 drafts ``k`` tokens (``draft_time`` each) and then runs its layers;
    every hop, the verdict's way back included, takes ``comm_time`` (none when there is one stage)."""
    name = "predicted bubble of a schedule"
    hint = ("for the configuration named, draw two windows on a timeline by hand, one row per stage, with the "
            "verdict's way back.")
    seed, trials = seed_for(35), trials_for(10)
    refused = refuse_library(name, fn, (sim.simulate, sim.bubble_fraction, sim.busy_fraction), hint,
                             owner="labsrc.pipeline", args=_bubble_case(torch.Generator().manual_seed(seed)))
    if refused is not None:
        return refused
    gen = torch.Generator().manual_seed(seed)
    cases = [([0.003, 0.003, 0.004], 0.0005, 0.0005, 4, 1), ([0.003, 0.003, 0.004], 0.0005, 0.0005, 4, 6)]
    cases += [_bubble_case(gen) for _ in range(trials - len(cases))]
    for trial, args in enumerate(cases):
        stage_times, draft_time, comm_time, k, sequences = args
        got, unsolved = _call(fn, list(stage_times), draft_time, comm_time, k, sequences)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        got = _number(got)
        where = (f"trial {trial + 1} (P = {len(stage_times)}, stage times {[round(t * 1e3, 1) for t in stage_times]}"
                 f" ms, draft {draft_time * 1e3:g} ms a token, k = {k}, hops {comm_time * 1e3:g} ms, "
                 f"{sequences} sequence{'s' if sequences > 1 else ''})")
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            return failed(name, f"{where}: return a number. Hint: {hint}")
        measured = _bubble_simulated(*args)
        if not abs(got - measured) <= BUBBLE_TOLERANCE:
            return failed(name, f"{where}: the prediction is not within {BUBBLE_TOLERANCE} of the "
                                f"simulator's bubble on this configuration. Hint: {hint}")
    return _report(Result(name, PASSED, f"within {BUBBLE_TOLERANCE} of the simulated bubble on all the check's "
                                        "configurations."))


# ---------------------------------------------------------------------------------------- stage split

SPLIT_TOLERANCE = 0.02
"""How much slower than the best contiguous split a chosen split may simulate (relative)."""


def split_case() -> dict:
    """The configuration of the stage-split experiment: per-layer seconds of one window (the last layer
    carries the head), the draft's seconds per token, the window ``k``, the seconds per hop, the number of
    stages and the sequences in flight."""
    return dict(layer_times=[1e-3] * 7 + [2e-3], draft_time=0.5e-3, k=4, comm_time=0.1e-3, stages=3,
                sequences=6)


def _random_split_case(gen) -> dict:
    """A configuration like :func:`split_case`: 6 to 12 layers of uneven cost, 2 to 4 stages, and a draft whose
    window costs one and a half to four mean layers (where a split that ignores it is measurably slower)."""
    layers = randint(gen, 6, 12)
    layer_times = [randint(gen, 4, 24) / 10_000 for _ in range(layers)]
    k = randint(gen, 2, 8)
    window = sum(layer_times) / layers * randint(gen, 15, 40) / 10
    return dict(layer_times=layer_times, draft_time=round(window / k, 7), k=k,
                comm_time=randint(gen, 0, 3) / 10_000, stages=randint(gen, 2, min(4, layers // 2)),
                sequences=randint(gen, 4, 8))


def _split_time(case: dict, counts) -> float:
    """Simulated seconds per token of the overlapped schedule (one window in flight per sequence) with the
    layers split as ``counts`` (layers per stage, in order): the measurement the experiment is judged by."""
    times = case["layer_times"]
    stage_times, start = [], 0
    for c in counts:
        stage_times.append(sum(times[start:start + c]))
        start += c
    k = case["k"]
    return sim.simulate(stage_times, case["draft_time"], case["comm_time"], k, 0.5,
                        micro_batches=case["sequences"], schedule="overlapped", depth=1, tokens=96,
                        accept=lambda s, w: k // 2)["time_per_token"]


def _best_split_time(case: dict) -> float:
    layers, stages = len(case["layer_times"]), case["stages"]
    best = math.inf
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0,) + cuts + (layers,)
        best = min(best, _split_time(case, [b - a for a, b in zip(bounds, bounds[1:])]))
    return best


# The configurations a test cell's hidden section wrote out (``hidden=[{...}, ...]``): they live in the instructor
# notebook, which nbgrader strips from the release, not in this package.
_NOTEBOOK_CASES: contextvars.ContextVar = contextvars.ContextVar("split_notebook_cases", default=None)


def check_pipeline_split(fn, *, hidden=False) -> Result:
    """Check ``fn(case) -> list[int]`` (see :func:`_check_pipeline_split`). ``hidden`` is what the test cell's
    hidden section passes: True (or a seed) for the check's own further configurations, or a list of
    configurations written out in the notebook, which are checked after those. (A core-level ``hidden_cases``
    would let every chapter do this; until then the chapter keeps the cases here.)"""
    cases = [hidden] if isinstance(hidden, dict) else hidden if isinstance(hidden, (list, tuple)) else None
    token = _NOTEBOOK_CASES.set(cases)
    try:
        return _check_pipeline_split(fn, hidden=True if cases is not None else hidden)
    finally:
        _NOTEBOOK_CASES.reset(token)


@exercise
def _check_pipeline_split(fn) -> Result:
    """Check ``fn(case) -> list[int]``: layers per stage (contiguous, each stage at least one, in order) for
    the configuration ``case`` (:func:`split_case`'s keys), judged by re-running the simulator on the chosen
    split: within :data:`SPLIT_TOLERANCE` of the best contiguous split's time per token. The answer may not
    call the simulator (it is the measurement), so it must encode what the student learned from measuring.
    Visible: :func:`split_case` and two random configurations; hidden: random configurations from another seed
    and any the notebook's hidden section writes out."""
    name = "the stage split chosen by measurement"
    hint = ("simulate a few splits of the failing configuration in a scratch cell, watching which stage is "
            "busiest, and ask what your rule leaves out.")
    refused = refuse_library(name, fn, (sim.simulate, _split_time, _best_split_time, sim.bubble_fraction,
                                        sim.busy_fraction), hint, owner="labsrc.pipeline", args=(split_case(),))
    if refused is not None:
        return refused
    gen = torch.Generator().manual_seed(seed_for(37))
    cases = ([] if hidden() else [split_case()]) + [_random_split_case(gen) for _ in range(4 if hidden() else 2)]
    cases += list(_NOTEBOOK_CASES.get() or [])
    for trial, case in enumerate(cases):
        got, unsolved = _call(fn, dict(case, layer_times=list(case["layer_times"])))
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        layers, stages = len(case["layer_times"]), case["stages"]
        where = (f"configuration {trial + 1} ({layers} layers of {[round(t * 1e3, 1) for t in case['layer_times']]}"
                 f" ms over {stages} stages, draft {case['draft_time'] * 1e3:g} ms a token, k = {case['k']}, hops "
                 f"{case['comm_time'] * 1e3:g} ms, {case['sequences']} sequences)")
        try:
            counts = [int(c) for c in got]
        except (TypeError, ValueError):
            return failed(name, f"{where}: return a list of ints, one per stage. Hint: {hint}")
        if len(counts) != stages or any(c < 1 for c in counts) or sum(counts) != layers:
            return failed(name, f"{where}: the split is not one positive count per stage, summing to the "
                                f"number of layers. Hint: {hint}")
        if not _split_time(case, counts) <= _best_split_time(case) * (1 + SPLIT_TOLERANCE):
            return failed(name, f"{where}: the split does not simulate within "
                                f"{SPLIT_TOLERANCE:.0%} of the best contiguous split. Hint: {hint}")
    return _report(Result(name, PASSED, f"within {SPLIT_TOLERANCE:.0%} of the best split's simulated time per "
                                        "token on all the check's configurations."))


# ---------------------------------------------------------------------------------------------- kernel

_KERNEL_SIZES = ((1, 4, 37), (3, 1, 10), (2, 8, 100), (4, 15, 64), (1, 3, 1), (2, 6, 129))
_DELTAS = (0.0, 0.25, 1.0, 2.5)
_POISON = -99


def _lenient_case(gen, size):
    """Logits on a grid of quarters (exact in float32, many ties), drafts that are the row's first maximum, a
    tied or near maximum, or random, and a margin ``delta``."""
    B, K, V = size
    levels = randint(gen, 2, 12)
    logits = torch.randint(0, levels, (B, K + 1, V), generator=gen).float() / 4
    first_max = logits[:, :K].argmax(-1)
    near = torch.topk(logits[:, :K] + torch.rand(B, K, V, generator=gen) * 0.01, min(3, V), -1).indices[..., -1]
    pick = torch.randint(0, 4, (B, K), generator=gen)
    drafts = torch.where(pick <= 1, first_max, torch.where(pick == 2, near, torch.randint(0, V, (B, K),
                                                                                            generator=gen)))
    return logits.contiguous(), drafts.contiguous(), _DELTAS[randint(gen, 0, len(_DELTAS) - 1)]


def lenient_verify_ref(logits, drafts, delta):
    """``(accepted (B,), next_token (B,))``: the leading drafts whose logit is within ``delta`` of their row's
    maximum, and the first index of the maximum of the row after them (the correction, or the bonus token)."""
    K = drafts.shape[1]
    best = logits.max(-1).values
    mine = logits[:, :K].gather(-1, drafts[..., None])[..., 0]
    ok = mine >= best[:, :K] - delta
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(logits.shape[0])
    return accepted, logits[rows, accepted].argmax(-1)


def _run_lenient(kernel, logits, drafts, delta):
    import triton

    B, K1, V = logits.shape
    K = K1 - 1
    store = torch.full((2 * B + 32,), _POISON, dtype=torch.int64)
    accepted, next_token = store[8:8 + B], store[16 + B:16 + 2 * B]
    kernel[(B,)](logits, drafts, accepted, next_token, K, V, delta, BLOCK_K=triton.next_power_of_2(K + 1),
                 BLOCK_V=triton.next_power_of_2(V))
    guards = torch.cat([store[:8], store[8 + B:16 + B], store[16 + 2 * B:]])
    if not bool((guards == _POISON).all()):
        return accepted, next_token, "the kernel wrote outside its outputs."
    return accepted, next_token, None


def _explain_lenient(accepted, next_token, logits, drafts, delta) -> str:
    want_a, want_n = lenient_verify_ref(logits, drafts, delta)
    if (accepted == _POISON).any() or (next_token == _POISON).any():
        return "some outputs were never written."
    if not torch.equal(accepted, want_a):
        b = int((accepted != want_a).nonzero()[0])
        K = drafts.shape[1]
        best = logits.max(-1).values[b, :K]
        mine = logits[b, :K].gather(-1, drafts[b, :, None])[:, 0]
        on_edge = bool(((mine == best - delta) & (torch.arange(K) < max(int(want_a[b]), int(accepted[b])) + 1))
                       .any())
        return (f"accepted is wrong for window {b} (delta = {delta:g})"
                + (": one of its drafts sits exactly at the edge of the margin." if on_edge else "."))
    b = int((next_token != want_n).nonzero()[0])
    return f"next_token is wrong for window {b}, whose accepted count is right (a tie broken the wrong way?)."


@exercise
def check_pipeline_lenient_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(logits, drafts, accepted, next_token, K, V, delta, BLOCK_K,
    BLOCK_V)`` launched on grid ``(B,)``, one program per window: ``logits (B, K + 1, V)`` float32 and ``drafts
    (B, K)`` int64, contiguous; draft ``i`` is judged by row ``i`` and passes when its logit is at least the
    row's maximum minus ``delta``. It writes ``accepted[b]``, the number of leading drafts that pass, and
    ``next_token[b]``, the first index of the maximum of row ``accepted[b]`` (:func:`lenient_verify_ref`).
    ``BLOCK_K >= K + 1`` and ``BLOCK_V >= V`` are powers of two. Without Triton the check says it is skipped."""
    name = "lenient verification kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read the task of this exercise and 'The kernel: greedy verification on the last stage', and "
            "trace the window named in this message by hand; these logits have many equal maxima.")
    refused = refuse_library(name, kernel, (kverify._greedy_verify_kernel, kverify.greedy_verify,
                                            kverify.greedy_verify_ref), hint, owner="labsrc.kernels.pipeline")
    if refused is not None:
        return refused
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of B programs")) is not None:
        return _report(unlaunchable)
    seed, sizes = 34, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed_for(seed), sizes + tuple((b + 1, k + 2, v + 7) for b, k, v in sizes)
    gen = torch.Generator().manual_seed(seed)
    for trial, size in enumerate(sizes):
        logits, drafts, delta = _lenient_case(gen, size)
        where = f"trial {trial + 1} (B={size[0]}, K={size[1]}, V={size[2]}, delta = {delta:g})"
        try:
            accepted, next_token, problem = _run_lenient(kernel, logits, drafts, delta)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, where, hint))
        if problem is None:
            want_a, want_n = lenient_verify_ref(logits, drafts, delta)
            if not (torch.equal(accepted, want_a) and torch.equal(next_token, want_n)):
                problem = _explain_lenient(accepted, next_token, logits, drafts, delta)
        if problem:
            return failed(name, f"{where}: {problem} Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the reference on all the check's launches, ties included."))
