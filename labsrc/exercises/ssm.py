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
    hint = ("hold u constant over the step and solve x' = a x + b u exactly: x(dt) = e^{a dt} x(0) + "
            "(integral of e^{a s} ds from 0 to dt) b u.")
    refused = _refuse(name, fn, (ssm.discretize,), hint, _zoh_inputs(torch.Generator().manual_seed(71)))
    if refused is not None:
        return refused
    return check_function(name, _tensor_pair(fn), _zoh_reference, _zoh_inputs, trials=6, seed=71,
                          rtol=1e-9, atol=1e-12, hint=hint)


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
    hint = "apply left to h, then right to the result, and collect the terms in h and the rest."
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


@exercise
def check_ssd_chunk_state(fn) -> Result:
    """Check ``fn(S, x, dt, A, B) -> S_next`` for one head and one chunk: ``S (p, n)`` the state the chunk
    starts from, ``x (Q, p)``, ``dt (Q,)``, ``A`` a negative float, ``B (Q, n)``; returns the state after the
    chunk, computed the chunked way (no loop over the Q steps needed)."""
    name = "one chunk of SSD state passing"
    hint = ("the old state decays by exp(A * sum(dt)) over the chunk; step s writes dt_s x_s B_s^T, decayed by "
            "exp(A * (dt_{s+1} + ... + dt_{Q-1})) to the chunk's end.")
    refused = _refuse(name, fn, (ssm.ssd_recurrent, ssm.ssd_chunked, ssm.ssd_attention), hint,
                      _chunk_inputs(torch.Generator().manual_seed(73)))
    if refused is not None:
        return refused
    return check_function(name, fn, _chunk_reference, _chunk_inputs, trials=6, seed=73, rtol=1e-9, atol=1e-10,
                          hint=hint)


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
    hint = ("inside a block, tl.associative_scan((a, b), 0, combine) gives each position's prefix (A, B); "
            "the state entering the block enters as h = A * carry + B, and the carry must be the last *valid* "
            "h (pad the lanes past L with the identity a = 1, b = 0).")
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
