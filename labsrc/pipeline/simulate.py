"""A discrete-event simulator of the pipeline's two schedules, and the source's closed-form model.

:func:`simulate` replays what :mod:`labsrc.pipeline.schedule` does, on a clock instead of processes: stage 0
drafts ``k`` tokens (``k * draft_time``) and runs its layers (``stage_times[0]``), each later stage ``i``
runs the window when it arrives and is free (FIFO, ``stage_times[i]``), every hop costs ``comm_time`` and
the verdict travels back to stage 0 (one more ``comm_time``). Each drafted token is accepted with
probability ``alpha``, independently, up to the first rejection (the i.i.d. model behind
``E[accepted] = (1 - alpha^(k+1)) / (1 - alpha)``). The schedules and their rules are the real ones:
``plain`` keeps one window in the pipeline; ``overlapped`` keeps up to ``depth`` windows in flight per
sequence and every sequence (micro-batch) in flight, and a rejection makes the later windows of that
sequence stale (the middle stages still compute them, the last stage skips them).

It returns the makespan, tokens per second, each stage's busy fraction and the per-stage timeline in the
same ``(what, start, end, seq, wid)`` form the real ranks record, so measured and simulated runs are drawn
and measured by the same code (:func:`busy_fraction`, :func:`bubble_fraction`).

:func:`source_time_per_token` is the model of the source's 10.4.8:
``T_avg = (T_comm + max(T_d(k), T_t / P)) / E[accepted]``.
"""
from __future__ import annotations

import math
import random
from collections import deque

__all__ = ["simulate", "expected_committed", "source_time_per_token", "source_throughput_max",
           "busy_fraction", "bubble_fraction", "stage_times_from", "COMPUTE"]

COMPUTE = ("draft", "forward", "verify")
"""The timeline events that occupy a stage (``wait`` and ``skip`` do not)."""


def expected_committed(alpha: float, k: int) -> float:
    """Expected tokens one window of ``k`` drafts commits: chapter 10's
    :func:`labsrc.speculative.expected_tokens_per_step`, ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    from labsrc.speculative import expected_tokens_per_step

    return expected_tokens_per_step(alpha, k)


def source_time_per_token(t_target: float, stages: int, t_draft_k: float, t_comm: float,
                          expected_accepted: float) -> float:
    """The source's ``T_avg = (T_comm + max(T_d(k), T_t / P)) / E[accepted_per_cycle]`` (10.4.8)."""
    for name, v in (("t_target", t_target), ("t_draft_k", t_draft_k), ("t_comm", t_comm)):
        _check_nonneg(name, v)
    _check_int("stages", stages, 1)
    if not expected_accepted > 0:
        raise ValueError(f"expected_accepted must be positive, got {expected_accepted!r}")
    return (t_comm + max(t_draft_k, t_target / stages)) / expected_accepted


def source_throughput_max(t_target: float, stages: int, expected_accepted: float) -> float:
    """The source's ``Throughput_max = E[accepted] / (T_t / P)``, tokens per second, reached when the draft
    keeps pace with one stage and communication is free."""
    _check_nonneg("t_target", t_target)
    _check_int("stages", stages, 1)
    return expected_accepted / (t_target / stages)


def busy_fraction(events, wall: float) -> float:
    """The fraction of ``wall`` seconds one rank spent in compute events (``draft``, ``forward``, ``verify``)."""
    if not wall > 0:
        raise ValueError(f"wall must be positive, got {wall!r}")
    return sum(e[2] - e[1] for e in events if e[0] in COMPUTE) / wall


def bubble_fraction(timelines, wall: float) -> float:
    """``1 - (busy time of all ranks) / (P * wall)``: the share of the pipeline's device-time left idle."""
    return 1.0 - sum(busy_fraction(ev, wall) for ev in timelines) / len(timelines)


def stage_times_from(timelines, k: int) -> dict:
    """Per-stage seconds per window and the draft's seconds per token, measured from a run's timelines
    (medians over the windows; stage 0's ``forward`` excludes its drafting)."""
    def med(xs):
        xs = sorted(xs)
        if not xs:
            return 0.0
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])

    stage = []
    for r, ev in enumerate(timelines):
        what = "verify" if r == len(timelines) - 1 else "forward"
        # P = 1: stage 0 is also the last stage and records "verify"
        stage.append(med([e[2] - e[1] for e in ev if e[0] == what and e[4] >= 0 and _not_prefill(e, ev)]))
    draft = med([(e[2] - e[1]) / k for e in timelines[0] if e[0] == "draft"])
    return dict(stage_times=stage, draft_time=draft)


def _not_prefill(event, events) -> bool:
    # prefill windows have no draft event before them on stage 0; on other ranks the first window of a
    # sequence is its prefill. Keep windows whose (seq, wid) is not the first seen for that seq.
    seq, wid = event[3], event[4]
    first = min((e[4] for e in events if e[3] == seq and e[4] >= 0), default=None)
    return wid != first


def _check_alpha(alpha):
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")


def _check_int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _check_nonneg(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def simulate(stage_times, draft_time: float, comm_time: float, k: int, alpha: float, P: int | None = None,
             micro_batches: int = 1, *, schedule: str = "overlapped", depth: int = 2, tokens: int = 64,
             seed: int = 0, accept=None) -> dict:
    """Simulate ``micro_batches`` sequences of ``tokens`` new tokens each through a ``P``-stage pipeline.

    Args:
        stage_times: seconds per window for each stage's target layers (length ``P``; stage 0's excludes
            drafting, the last stage's includes verification). A single number is split evenly over ``P``.
        draft_time: seconds per draft token (a window costs ``k * draft_time`` on stage 0).
        comm_time: seconds per hop between neighbouring stages, and for the verdict's way back.
        k: draft tokens per window; alpha: per-token acceptance probability.
        schedule: ``"plain"`` or ``"overlapped"``; depth: windows in flight per sequence (overlapped).
        accept: optional ``accept(seq, window_index) -> accepted drafts`` replacing the random draw (the
            hand-computed tests use it).

    Returns a dict: ``time`` (makespan, s), ``tokens``, ``time_per_token``, ``tokens_per_s``, ``busy`` (per
    stage, a fraction of the makespan), ``bubble`` (``1 - mean(busy)``), ``windows``, ``stale`` and
    ``timelines`` (per stage, ``(what, start, end, seq, wid)``).
    """
    if isinstance(stage_times, (int, float)) and not isinstance(stage_times, bool):
        if P is None:
            raise ValueError("P is required when stage_times is a single number")
        stage_times = [float(stage_times) / P] * P
    stage_times = [float(t) for t in stage_times]
    if P is None:
        P = len(stage_times)
    _check_int("P", P, 1)
    if len(stage_times) != P:
        raise ValueError(f"stage_times must hold P = {P} numbers, got {len(stage_times)}")
    for i, t in enumerate(stage_times):
        _check_nonneg(f"stage_times[{i}]", t)
    _check_nonneg("draft_time", draft_time)
    _check_nonneg("comm_time", comm_time)
    _check_int("k", k, 1)
    _check_alpha(alpha)
    _check_int("micro_batches", micro_batches, 1)
    _check_int("depth", depth, 1)
    _check_int("tokens", tokens, 1)
    if schedule not in ("plain", "overlapped"):
        raise ValueError(f"schedule must be 'plain' or 'overlapped', got {schedule!r}")
    rng = random.Random(seed)
    per_seq_depth, cap = (1, 1) if schedule == "plain" else (depth, 10 ** 9)
    comm = comm_time if P > 1 else 0.0

    timelines = [[] for _ in range(P)]
    free = [0.0] * P                 # when each stage is next free
    committed = [0] * micro_batches
    # per sequence, the windows in flight, oldest first: [wid, reply_time or None if stale, accepted]
    inflight = [deque() for _ in range(micro_batches)]
    verified = [0] * micro_batches   # windows of each sequence that reached a verdict (for ``accept``)
    replies = []                     # (reply_time, seq, wid) of windows that are not stale
    now, next_wid, turn, n_inflight, n_windows, n_stale = 0.0, 0, 0, 0, 0, 0

    def launch(s: int) -> None:
        nonlocal now, next_wid, n_inflight, n_windows
        wid = next_wid
        next_wid += 1
        # sent behind a window whose verdict will be a rejection: stale (stage 0 does not know yet)
        stale = any(w[2] is not None and w[2] < k for w in inflight[s])
        a = None
        if not stale:
            if accept is not None:
                a = int(accept(s, verified[s]))
                if not 0 <= a <= k:
                    raise ValueError(f"accept returned {a} for a window of {k} drafts")
            else:
                a = 0
                while a < k and rng.random() < alpha:
                    a += 1
            verified[s] += 1
        t0 = now
        now += k * draft_time
        timelines[0].append(("draft", t0, now, s, wid))
        t1 = now
        now += stage_times[0]
        free[0] = now
        reply_at = None
        if P == 1:
            timelines[0].append(("verify", t1, now, s, wid))
            reply_at = now
        else:
            timelines[0].append(("forward", t1, now, s, wid))
            arrive = now + comm
            for i in range(1, P):
                last = i == P - 1
                if last and stale:
                    timelines[i].append(("skip", arrive, arrive, s, wid))
                    break
                start = max(arrive, free[i])
                free[i] = start + stage_times[i]
                timelines[i].append(("verify" if last else "forward", start, free[i], s, wid))
                arrive = free[i] + comm
            else:
                reply_at = arrive
        n_windows += 1
        n_inflight += 1
        inflight[s].append([wid, reply_at, a])
        if reply_at is not None:
            replies.append((reply_at, s, wid))

    def handle(s: int, wid: int) -> None:
        nonlocal n_inflight, n_stale
        w = inflight[s].popleft()
        if w[0] != wid:
            raise RuntimeError("simulator: verdicts out of order")
        n_inflight -= 1
        a = w[2]
        if a == k:
            committed[s] += k
            if not inflight[s]:
                committed[s] += 1          # the target's next token: nothing was sent after it
        else:
            committed[s] += a + 1          # accepted drafts and the correction
            n_stale += len(inflight[s])    # all sent behind it: discarded now
            n_inflight -= len(inflight[s])
            inflight[s].clear()

    def ahead(s: int) -> int:
        return committed[s] + k * len(inflight[s])

    while True:
        replies.sort()
        while replies and replies[0][0] <= now:
            _, s, wid = replies.pop(0)
            handle(s, wid)
        if all(c >= tokens for c in committed) and n_inflight == 0:
            break
        launched = False
        if n_inflight < cap:
            for j in range(micro_batches):
                s = (turn + j) % micro_batches
                if committed[s] < tokens and len(inflight[s]) < per_seq_depth and ahead(s) < tokens + 1:
                    launch(s)
                    turn = s + 1
                    launched = True
                    break
        if not launched:
            if not replies:
                raise RuntimeError("simulator: nothing in flight and nothing to launch")
            wait_to = max(now, replies[0][0])
            if wait_to > now:
                timelines[0].append(("wait", now, wait_to, -1, -1))
            now = wait_to
    makespan = max([now] + [e[2] for tl in timelines for e in tl])
    total = sum(min(c, tokens) for c in committed)
    busy = [busy_fraction(tl, makespan) if makespan > 0 else 0.0 for tl in timelines]
    return dict(time=makespan, tokens=total, time_per_token=makespan / total, tokens_per_s=total / makespan,
                busy=busy, bubble=1.0 - sum(busy) / P, windows=n_windows, stale=n_stale,
                timelines=timelines)
