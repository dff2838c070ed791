"""Checks for the exercises of the pipeline chapter (pipeline speculative decoding).

Each check calls the student's function on seeded random cases and compares it with :mod:`labsrc.pipeline`;
it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` for the stub. Expected answers are
computed here, never printed.

* :func:`check_pipeline_bubble` -- ``fn(timelines, wall) -> float``: the bubble fraction of a run from its
  per-rank timelines.
* :func:`check_pipeline_balance` -- ``fn(layer_times, P) -> list[int]``: layers per stage, contiguous, so
  that the slowest stage is as fast as it can be.
* :func:`check_pipeline_plain_time` -- ``fn(stage_times, draft_time, comm_time, k, alpha) -> float``: the
  expected seconds per token of the plain schedule (derive ``E[tokens per window]`` yourself).
* :func:`check_pipeline_verify_kernel` -- a ``@triton.jit`` kernel doing the last stage's greedy
  verification of one window per program, launched under the interpreter and compared with
  :func:`labsrc.kernels.verify.greedy_verify_ref`.

A check refuses an answer that calls the library function the exercise asks the student to write.
"""
from __future__ import annotations

import math

import torch

from labsrc import runtime
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _report, exercise,
                                   hidden, randint, refuse_library)
from labsrc.kernels import verify as kverify
from labsrc.pipeline import simulate as sim
from labsrc.pipeline import stages as pstages
from labsrc import speculative

__all__ = ["check_pipeline_bubble", "check_pipeline_balance", "check_pipeline_plain_time",
           "check_pipeline_verify_kernel"]


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


def _bubble_slip(got, timelines, wall) -> str:
    """Recognise a bubble fraction that counts waits as busy, or takes the share of wall instead of P * wall."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return ""
    P = len(timelines)
    busy = sum(e[2] - e[1] for tl in timelines for e in tl if e[0] in ("draft", "forward", "verify"))
    waits = sum(e[2] - e[1] for tl in timelines for e in tl if e[0] == "wait")
    if waits and math.isclose(got, 1 - (busy + waits) / (P * wall), rel_tol=1e-9, abs_tol=1e-12):
        return " It counts the 'wait' events as busy time."
    if P > 1 and math.isclose(got, 1 - busy / wall, rel_tol=1e-9, abs_tol=1e-12):
        return f" It takes the busy time as a share of one rank's wall time; the pipeline has {P} ranks."
    if not 0 <= got <= 1:
        return " A fraction lies in [0, 1]."
    return ""


@exercise
def check_pipeline_bubble(fn) -> Result:
    """Check ``fn(timelines, wall) -> float``: one minus the busy share of the pipeline's ``P * wall``
    rank-seconds, where only ``draft``, ``forward`` and ``verify`` events keep a rank busy."""
    name = "bubble fraction of a timeline"
    hint = ("re-read the task of Exercise 1 (which events keep a rank busy, and over what the share is taken) "
            "and work the failing trial's timelines out by hand.")
    seed, trials = (31, 8) if not hidden() else (31 + HIDDEN_SEED_OFFSET, 16)
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
            return _report(Result(name, FAILED, f"trial {trial + 1} ({len(timelines)} ranks, events {kinds}): "
                                                f"returned {got!r}, which is wrong.{_bubble_slip(got, timelines, wall)}"
                                                f" Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} random timelines."))


# -------------------------------------------------------------------------------------------- balance

def _balance_case(gen):
    L = randint(gen, 2, 12)
    P = randint(gen, 1, min(L, 5))
    times = [randint(gen, 1, 40) / 10 for _ in range(L)]
    if randint(gen, 0, 2) == 0:                  # a heavy layer (an MoE layer, the head) in the mix
        times[randint(gen, 0, L - 1)] *= 5
    return times, P


@exercise
def check_pipeline_balance(fn) -> Result:
    """Check ``fn(layer_times, P) -> list[int]``: how many consecutive layers each of the ``P`` stages takes
    (each at least one, summing to ``len(layer_times)``) so that the slowest stage's total time is as small
    as any contiguous split allows."""
    name = "balance layers over stages"
    hint = ("re-read Exercise 2's task: the split must be the best of all contiguous splits, not a good one; "
            "try your function on a profile with one very heavy layer at either end.")
    seed, trials = (32, 10) if not hidden() else (32 + HIDDEN_SEED_OFFSET, 20)
    refused = refuse_library(name, fn, (pstages.split_layers,), hint, owner="labsrc.pipeline",
                             args=_balance_case(torch.Generator().manual_seed(seed)))
    if refused is not None:
        return refused
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        times, P = _balance_case(gen)
        got, unsolved = _call(fn, list(times), P)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        where = f"trial {trial + 1} ({len(times)} layers, P = {P})"
        try:
            counts = [int(c) for c in got]
        except (TypeError, ValueError):
            return _report(Result(name, FAILED, f"{where}: expected a list of P ints, got {type(got).__name__}. "
                                                f"Hint: {hint}"))
        if len(counts) != P or any(c < 1 for c in counts) or sum(counts) != len(times):
            return _report(Result(name, FAILED, f"{where}: {counts} is not P positive counts summing to the "
                                                f"number of layers. Hint: {hint}"))
        bounds, start = [], 0
        for c in counts:
            bounds.append(sum(times[start:start + c]))
            start += c
        best = max(sum(times[r.start:r.stop]) for r in pstages.split_layers(len(times), P, times))
        if max(bounds) > best + 1e-9:
            return _report(Result(name, FAILED, f"{where}: the slowest stage of {counts} takes {max(bounds):.3g}, "
                                                f"and a better split exists. Hint: {hint}"))
    return _report(Result(name, PASSED, f"optimal on {trials} random layer profiles."))


# ------------------------------------------------------------------------------------------ plain time

def _plain_case(gen):
    P = randint(gen, 1, 4)
    stage_times = [randint(gen, 5, 50) / 1000 for _ in range(P)]
    alpha = [0.0, 1.0, 0.5, 0.7, 0.83, 0.9, 0.35][randint(gen, 0, 6)]
    return stage_times, randint(gen, 1, 20) / 10000, randint(gen, 0, 30) / 10000, randint(gen, 1, 16), alpha


def _plain_reference(stage_times, draft_time, comm_time, k, alpha):
    P = len(stage_times)
    cycle = k * draft_time + sum(stage_times) + (P * comm_time if P > 1 else 0.0)
    return cycle / speculative.expected_tokens_per_step(alpha, k)


def _plain_slip(fn, args) -> str:
    """Separate the time of one cycle from the tokens it emits: at alpha = 0 every cycle emits one token."""
    stage_times, draft_time, comm_time, k, alpha = args
    try:
        at_zero = _number(fn(list(stage_times), draft_time, comm_time, k, 0.0))
        right = _plain_reference(stage_times, draft_time, comm_time, k, 0.0)
        if isinstance(at_zero, (int, float)) and math.isclose(at_zero, right, rel_tol=1e-6):
            return " At alpha = 0 (one token per cycle) it is right: the expected tokens per cycle are off."
        return " At alpha = 0 (one token per cycle) it is wrong too: the time of one cycle is off."
    except Exception:  # noqa: BLE001 - an answer that fails at alpha = 0 gets the plain message
        return ""


@exercise
def check_pipeline_plain_time(fn) -> Result:
    """Check ``fn(stage_times, draft_time, comm_time, k, alpha) -> float``: the expected seconds per token of
    the plain schedule for one sequence: stage 0 drafts ``k`` tokens, the window goes through every stage
    (``P - 1`` hops) and the verdict comes back (one more hop; no hops at all when ``P = 1``); each draft is
    accepted with probability ``alpha`` up to the first rejection and the target always adds one token."""
    name = "time per token of the plain schedule"
    hint = ("re-read 'The idea' and the schedule in Exercise 3's task; the message says whether the time of one "
            "cycle or the tokens it emits is off.")
    seed, trials = (33, 10) if not hidden() else (33 + HIDDEN_SEED_OFFSET, 20)
    refused = refuse_library(name, fn, (speculative.expected_tokens_per_step, speculative.speedup,
                                        sim.expected_committed, sim.simulate, sim.source_time_per_token), hint,
                             owner="labsrc", args=_plain_case(torch.Generator().manual_seed(seed)))
    if refused is not None:
        return refused
    gen = torch.Generator().manual_seed(seed)
    cases = [_plain_case(gen) for _ in range(trials)]
    cases[0] = ([0.02, 0.02], 0.001, 0.0005, 4, 1.0)      # alpha = 1 first: a division by zero shows at once
    for trial, args in enumerate(cases):
        where = f"trial {trial + 1} (P = {len(args[0])}, k = {args[3]}, alpha = {args[4]})"
        try:
            got, unsolved = _call(fn, *[list(args[0])] + list(args[1:]))
        except ArithmeticError as err:
            return _report(Result(name, FAILED, f"{where}: raised {type(err).__name__}. Hint: {hint}"))
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        got = _number(got)
        want = _plain_reference(*args)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isclose(got, want, rel_tol=1e-6):
            return _report(Result(name, FAILED, f"{where}: returned {got!r}, which is wrong."
                                                f"{_plain_slip(fn, args)} Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} configurations, alpha = 0 and 1 included."))


# ---------------------------------------------------------------------------------------------- kernel

_KERNEL_SIZES = ((1, 5, 37), (3, 1, 10), (2, 9, 100), (4, 17, 64), (1, 3, 1), (2, 6, 129))
_POISON = -99


def _kernel_case(gen, size):
    B, N, V = size
    levels = randint(gen, 2, 6)                        # few levels: ties are common
    logits = torch.randint(0, levels, (B, N, V), generator=gen).float() + torch.randn(B, N, V, generator=gen) * \
        (randint(gen, 0, 1) * 0.1)
    preds = logits.argmax(-1)
    first = torch.randint(0, V, (B,), generator=gen)
    tokens = torch.cat([first[:, None], preds[:, :-1]], 1)
    flip = torch.rand(B, N, generator=gen) < 0.25
    tokens = torch.where(flip, torch.randint(0, V, (B, N), generator=gen), tokens)
    return logits, tokens, first


def _run_kernel(kernel, logits, tokens, first):
    import triton

    B, N, V = logits.shape
    preds_store = torch.full((B * N + 16,), _POISON, dtype=torch.int64)
    acc_store = torch.full((B + 16,), _POISON, dtype=torch.int64)
    preds, accepted = preds_store[8:8 + B * N].view(B, N), acc_store[8:8 + B]
    kernel[(B,)](logits, tokens, first, preds, accepted, N, V, BLOCK_N=triton.next_power_of_2(N),
                 BLOCK_V=triton.next_power_of_2(V))
    guards = torch.cat([preds_store[:8], preds_store[-8:], acc_store[:8], acc_store[-8:]])
    if not bool((guards == _POISON).all()):
        return preds, accepted, "the kernel wrote outside its outputs (a store without a mask?)."
    return preds, accepted, None


@exercise
def check_pipeline_verify_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(logits, tokens, first, preds, accepted, N, V, BLOCK_N, BLOCK_V)``
    launched on grid ``(B,)``, one program per window: ``logits (B, N, V)`` float32, ``tokens (B, N)`` and
    ``first (B,)`` int64, all contiguous; it writes ``preds[b, i] = argmax(logits[b, i])`` (the first index of
    the maximum) and ``accepted[b]`` = the leading window tokens that match ``[first[b], preds[b, :-1]]``.
    ``BLOCK_N >= N`` and ``BLOCK_V >= V`` are powers of two (the whole window is one tile). Without Triton the
    check says it is skipped."""
    name = "greedy verification kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'The kernel: greedy verification on the last stage' and trace the window named above by "
            "hand; these logits have many equal maxima.")
    refused = refuse_library(name, kernel, (kverify._greedy_verify_kernel, kverify.greedy_verify,
                                            kverify.greedy_verify_ref), hint, owner="labsrc.kernels.verify")
    if refused is not None:
        return refused
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of B programs")) is not None:
        return _report(unlaunchable)
    seed, sizes = 34, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((b + 1, n + 2, v + 7) for b, n, v in sizes)
    gen = torch.Generator().manual_seed(seed)
    for trial, size in enumerate(sizes):
        logits, tokens, first = _kernel_case(gen, size)
        try:
            preds, accepted, problem = _run_kernel(kernel, logits, tokens, first)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (B={size[0]}, N={size[1]}, V={size[2]}): the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
        if problem is None:
            want_p, want_a = kverify.greedy_verify_ref(logits, tokens, first)
            if (preds == _POISON).any() or (accepted == _POISON).any():
                problem = "some outputs were never written."
            elif not torch.equal(preds, want_p):
                bad = (preds != want_p).nonzero()[0].tolist()
                problem = f"preds differ first at window {bad[0]}, row {bad[1]} (a tie broken the wrong way?)."
            elif not torch.equal(accepted, want_a):
                b = int((accepted != want_a).nonzero()[0])
                problem = f"accepted is wrong for window {b}."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (B={size[0]}, N={size[1]}, V={size[2]}): {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to greedy_verify_ref on {len(sizes)} launches, ties included."))
