"""Checks for the exercises of the state-space chapter (S4, Mamba's selective scan, Mamba-2's SSD).

Each check calls the student's function on seeded random inputs and compares it with :mod:`labsrc.ssm`; it
prints ``passed``, what is wrong (with a hint), or ``not solved yet``. Expected answers are never printed.

* :func:`check_zoh_diagonal` -- ``fn(a, b, dt) -> (Ab, Bb)``: zero-order hold for a diagonal ``A``.
* :func:`check_scan_combine` -- ``fn(left, right) -> (a, b)``: the associative operator of ``h -> a h + b``,
  checked against sequential application and for associativity on random triples.
* :func:`check_ssd_chunk_state` -- ``fn(S, x, dt, A, B) -> S'``: one chunk of SSD's inter-chunk state passing.
* :func:`check_scan_kernel` -- a ``@triton.jit`` kernel that scans rows longer than one block (the carry
  between blocks), launched under Triton's interpreter and compared with :func:`labsrc.ssm.linear_scan_loop`.

A check refuses an answer that calls the :mod:`labsrc.ssm` function the exercise asks the student to write.
"""
from __future__ import annotations

import torch

from labsrc import runtime, ssm
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _report, check_function,
                                   exercise, hidden, randint, refuse_library)

__all__ = ["check_zoh_diagonal", "check_scan_combine", "check_ssd_chunk_state", "check_scan_kernel"]


def _refuse(title, fn, forbidden, hint, args):
    return refuse_library(title, fn, forbidden, hint, owner="labsrc.ssm", args=args)


def _tensor_pair(fn):
    """Turn an answer returning two tensors into one stacked tensor (the checks compare one tensor)."""
    def wrapped(*args):
        got = fn(*args)
        if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
            if got[0].shape == got[1].shape:
                return torch.stack([torch.as_tensor(got[0]), torch.as_tensor(got[1])])
            return torch.cat([got[0].flatten(), got[1].flatten()])
        return got
    return wrapped


# ------------------------------------------------------------------------------------------- ZOH, diagonal

def _zoh_inputs(gen):
    n = randint(gen, 1, 12)
    a = -(torch.rand(n, generator=gen, dtype=torch.float64) * 4.9 + 0.1)
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    dt = float(torch.rand(1, generator=gen, dtype=torch.float64)) * 0.5 + 0.001
    return a, b, dt


def _zoh_reference(a, b, dt):
    Ab, Bb = ssm.discretize(a, b, dt, "zoh")
    return torch.stack([Ab, Bb])


@exercise
def check_zoh_diagonal(fn) -> Result:
    """Check ``fn(a, b, dt) -> (Ab, Bb)``: zero-order hold of ``x' = a x + b u`` for a diagonal ``A`` given
    as its diagonal ``a (N,)`` (float64, negative), ``b (N,)``, a step ``dt``."""
    name = "zero-order hold for a diagonal A"
    hint = ("re-read 'A continuous state space and its discretisation' and test your pair on a case you can "
            "solve by hand: one step from x = 0 with u = 1 held, and the limit of a very small dt.")
    refused = _refuse(name, fn, (ssm.discretize,), hint, _zoh_inputs(torch.Generator().manual_seed(71)))
    if refused is not None:
        return refused
    return check_function(name, _tensor_pair(fn), _zoh_reference, _zoh_inputs, trials=6, seed=71,
                          rtol=1e-9, atol=1e-12, hint=hint, explain=_explain_zoh)


def _explain_zoh(got, expected, a, b, dt) -> str:
    """Which of (Ab, Bb) is wrong, and whether the pair is the forward-Euler step instead of the exact hold."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return "Return the pair (Ab, Bb), each of a's shape."
    euler = torch.stack([1 + dt * a, dt * b])
    if torch.allclose(got, euler, rtol=1e-9, atol=1e-12):
        return "That is the forward-Euler step, a first-order approximation; the task asks for the exact hold."
    ok = [torch.allclose(got[i], expected[i], rtol=1e-9, atol=1e-12) for i in range(2)]
    if ok[0] and not ok[1]:
        return "Ab is right; Bb is wrong."
    if ok[1] and not ok[0]:
        return "Bb is right; Ab is wrong."
    return ""


# ------------------------------------------------------------------------------------------- the combine

def _pair(gen, shape):
    return torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 0.5, torch.randn(
        shape, generator=gen, dtype=torch.float64)


def _combine_inputs(gen):
    shape = (randint(gen, 1, 6),)
    return _pair(gen, shape), _pair(gen, shape), _pair(gen, shape), torch.randn(shape, generator=gen,
                                                                                 dtype=torch.float64)


@exercise
def check_scan_combine(fn) -> Result:
    """Check ``fn(left, right) -> (a, b)`` where ``left = (a1, b1)`` is applied first, then ``right``: the
    single step ``h -> a h + b`` equal to both. Checked on random triples of steps: composing equals applying
    them one after another, and ``fn(fn(p, q), r) == fn(p, fn(q, r))`` (associativity)."""
    name = "the scan's combine operator"
    hint = ("re-read 'The scan: an associative operator and Blelloch's two sweeps' and compose two scalar "
            "steps by hand, left first.")
    refused = _refuse(name, fn, (ssm.scan_combine,), hint,
                      _combine_inputs(torch.Generator().manual_seed(72))[:2])
    if refused is not None:
        return refused
    seed, trials = 72, 8
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, 2 * trials
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        p, q, r, h = _combine_inputs(gen)
        try:
            pq = fn(p, q)
            left, right = fn(pq, r), fn(p, fn(q, r))
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        seq = h
        for a, b in (p, q, r):
            seq = a * seq + b
        problem = None
        try:
            applied = pq[0] * h + pq[1]
            three = left[0] * h + left[1]
            if not torch.allclose(applied, q[0] * (p[0] * h + p[1]) + q[1], rtol=1e-9, atol=1e-12):
                problem = "applying fn(p, q) to h differs from applying p, then q."
                if torch.allclose(applied, p[0] * (q[0] * h + q[1]) + p[1], rtol=1e-9, atol=1e-12):
                    problem += " It equals applying q first, then p: the order is reversed."
            elif not (torch.allclose(left[0], right[0], rtol=1e-9, atol=1e-12)
                      and torch.allclose(left[1], right[1], rtol=1e-9, atol=1e-12)):
                problem = "fn(fn(p, q), r) differs from fn(p, fn(q, r)): the operator is not associative."
            elif not torch.allclose(three, seq, rtol=1e-9, atol=1e-12):
                problem = "composing three steps differs from applying them one after another."
        except (TypeError, IndexError, RuntimeError) as err:
            problem = f"the result is not a pair (a, b) of tensors ({type(err).__name__})."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1}: {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"right and associative on {trials} random triples."))


# ------------------------------------------------------------------------------------- SSD state passing

def _chunk_inputs(gen):
    q, p, n = randint(gen, 1, 24), randint(gen, 1, 6), randint(gen, 1, 10)
    S = torch.randn(p, n, generator=gen, dtype=torch.float64)
    x = torch.randn(q, p, generator=gen, dtype=torch.float64)
    dt = torch.rand(q, generator=gen, dtype=torch.float64) * 0.5 + 0.01
    A = -float(torch.rand(1, generator=gen, dtype=torch.float64)) * 2 - 0.05
    B = torch.randn(q, n, generator=gen, dtype=torch.float64)
    return S, x, dt, A, B


def _chunk_reference(S, x, dt, A, B):
    q, p = x.shape
    n = B.shape[1]
    C = torch.zeros(1, q, 1, n, dtype=torch.float64)
    _, final = ssm.ssd_recurrent(x[None, :, None], dt[None, :, None], torch.tensor([A], dtype=torch.float64),
                                 B[None, :, None], C, initial_state=S[None, None])
    return final[0, 0]


def _explaining_chunk(fn):
    """``explain`` for the chunk state: with x = 0 only the decay of the starting state remains, so the answer on
    that input separates the decay of S from the chunk's own writes."""
    def explain(got, expected, S, x, dt, A, B) -> str:
        quiet = torch.zeros_like(x)
        decay_ok = torch.allclose(fn(S, quiet, dt, A, B), _chunk_reference(S, quiet, dt, A, B), rtol=1e-9,
                                  atol=1e-10)
        writes_ok = torch.allclose(fn(torch.zeros_like(S), x, dt, A, B),
                                   _chunk_reference(torch.zeros_like(S), x, dt, A, B), rtol=1e-9, atol=1e-10)
        if decay_ok and not writes_ok:
            return "With x = 0 your state is right: the decay of S is right, the chunk's own inputs are not."
        if writes_ok and not decay_ok:
            return "From S = 0 your state is right: the chunk's inputs are right, the decay of S is not."
        return ""
    return explain


@exercise
def check_ssd_chunk_state(fn) -> Result:
    """Check ``fn(S, x, dt, A, B) -> S_next`` for one head and one chunk: ``S (p, n)`` the state the chunk
    starts from, ``x (Q, p)``, ``dt (Q,)``, ``A`` a negative float, ``B (Q, n)``; returns the state after the
    chunk, computed the chunked way (no loop over the Q steps needed)."""
    name = "one chunk of SSD state passing"
    hint = ("re-read 'Mamba-2's SSD: recurrence, masked attention and chunks' and compare your state with a "
            "step-by-step loop on a chunk of one and of two steps.")
    refused = _refuse(name, fn, (ssm.ssd_recurrent, ssm.ssd_chunked, ssm.ssd_attention), hint,
                      _chunk_inputs(torch.Generator().manual_seed(73)))
    if refused is not None:
        return refused
    return check_function(name, fn, _chunk_reference, _chunk_inputs, trials=6, seed=73, rtol=1e-9, atol=1e-10,
                          hint=hint, explain=_explaining_chunk(fn))


# ------------------------------------------------------------------------------------------ the kernel

# (rows, L, BLOCK_L): rows longer than one block, lengths that are not multiples of it, a row of one element.
_KERNEL_SIZES = ((2, 40, 16), (3, 7, 16), (1, 1, 16), (2, 100, 32), (1, 33, 16), (2, 64, 16))
_GUARD = 64


def _guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


@exercise
def check_scan_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(a_ptr, b_ptr, h_ptr, L, BLOCK_L)`` that computes
    ``h_t = a_t h_{t-1} + b_t`` (``h_{-1} = 0``) along each row of contiguous float32 ``(rows, L)`` tensors,
    one program per row (grid ``(rows,)``), walking the row in blocks of ``BLOCK_L`` (a power of two, often
    smaller than ``L``) and carrying the last ``h`` of each block into the next. Without Triton (macOS,
    Windows) the check says it is skipped."""
    name = "a blocked scan kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read '`linear_scan`: `tl.associative_scan` and a carry'. Wrong only from a later block on "
            "points at what passes from one block to the next (on a row whose length BLOCK_L does not divide "
            "too); writes outside or never made point at the masks.")
    seed, sizes = 74, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((r + 1, L + 21, B) for r, L, B in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of rows programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    for trial, (rows, L, block) in enumerate(sizes):
        a = torch.rand(rows, L, generator=gen) * 0.5 + 0.6
        b = torch.randn(rows, L, generator=gen)
        ag, _ = _guarded(a)
        bg, _ = _guarded(b)
        h, h_store = _guarded(torch.full_like(a, float("nan")))
        try:
            kernel[(rows,)](ag, bg, h, L, BLOCK_L=block)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (rows={rows}, L={L}, BLOCK_L={block}): the "
                                                f"launch raised {type(cause or err).__name__}: {cause or err}. "
                                                f"Hint: {hint}"))
        problem = None
        guards = torch.cat([h_store[:_GUARD], h_store[-_GUARD:]])
        expected = ssm.linear_scan_loop(a, b)
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor (a lane past L stored without a mask?)."
        elif torch.isnan(h).any():
            problem = f"{int(torch.isnan(h).sum())} output element(s) were never written."
        elif not torch.allclose(h, expected, rtol=1e-4, atol=1e-5):
            bad = ~torch.isclose(h, expected, rtol=1e-4, atol=1e-5)
            t = int(bad.nonzero()[0][1])
            where = "in the first block" if t < block else f"from block {t // block} on (position {t})"
            problem = f"{int(bad.sum())} of {bad.numel()} elements differ, the first {where}."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (rows={rows}, L={L}, BLOCK_L={block}): "
                                                f"{problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the sequential scan on {len(sizes)} launches, rows longer "
                                        "than a block included."))
