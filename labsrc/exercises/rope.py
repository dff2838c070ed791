"""Checks for the exercises of the position-encoding chapter (RoPE and context extension).

Each check calls the student's function on several seeded random configurations and compares it with
:mod:`labsrc.rope`; it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the function
still raises ``NotImplementedError``. Expected answers are computed here, never printed.

* :func:`check_wavelength` -- ``fn(i, head_dim, base)``: tokens per full turn of pair ``i``.
* :func:`check_position_interpolation` -- ``fn(head_dim, base, factor)``: the inverse frequencies of
  position interpolation.
* :func:`check_ntk_base` -- ``fn(base, factor, head_dim)``: the NTK-aware base for a factor ``s``.
* :func:`check_yarn_unscaled` -- ``fn(head_dim, base, factor, original_max_position, beta_fast, beta_slow)``:
  the indices of the pairs YaRN leaves unscaled.
* :func:`check_unseen_pairs` -- ``fn(head_dim, base, train_length, new_length)``: the pairs whose angles at the
  new length were never reached in training (a prediction the student then checks on the lab model).
* :func:`check_rope_kernel` -- a ``@triton.jit`` kernel that rotates one head, one program per token, launched
  by the check on odd sizes under Triton's interpreter and compared with :func:`labsrc.rope.apply_rope_ref`.

A check refuses an answer that calls the :mod:`labsrc.rope` function the exercise asks the student to write
(read in the answer's code, and watched while the answer runs, however the function was imported).
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from labsrc import rope, runtime
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, NOT_SOLVED, PASSED, Result, _report,
                                   as_number, check_function, exercise, hidden, randint, refuse_library,
                                   tolerance)

__all__ = ["check_wavelength", "check_position_interpolation", "check_ntk_base", "check_yarn_unscaled",
           "check_unseen_pairs", "check_rope_kernel"]

_HEAD_DIMS = (32, 64, 80, 96, 128)
_BASES = (10000.0, 500000.0, 1000000.0)


def _pick(gen: torch.Generator, options):
    return options[int(torch.randint(len(options), (1,), generator=gen))]


def _refuse_library(name, fn, make_inputs, seed, forbidden, hint) -> Result | None:
    """A failed result when the answer refers to one of ``forbidden``, or calls it (directly or not) on the
    check's first inputs, else None (:func:`labsrc.exercises.core.refuse_library`; the run catches a call
    through another library function, ``rope_frequencies(..., "linear")`` calling ``linear_frequencies``)."""
    return refuse_library(name, fn, forbidden, hint, owner="labsrc.rope",
                          args=make_inputs(torch.Generator().manual_seed(seed)))


# ------------------------------------------------------------------------------------------- wavelength

def _wavelength_inputs(gen):
    head_dim = _pick(gen, _HEAD_DIMS)
    return int(torch.randint(head_dim // 2, (1,), generator=gen)), head_dim, _pick(gen, _BASES)


def _wavelength_reference(i, head_dim, base):
    inv_freq, _ = rope.rope_frequencies(head_dim, base)
    return float(rope.wavelengths(inv_freq.double())[i])


@exercise
def check_wavelength(fn) -> Result:
    """Check ``fn(i, head_dim, base) -> float``: how many tokens pair ``i`` needs for one full turn."""
    hint = ("re-read 'Wavelengths, and which pairs complete full turns in training': a wavelength counts tokens, "
            "those pair i needs for one full turn.")
    refused = _refuse_library("wavelength of pair i", fn, _wavelength_inputs, 21, (rope.wavelengths,), hint)
    if refused is not None:   # a Result is falsy unless passed: test for None
        return refused
    return check_function("wavelength of pair i", as_number(fn), _wavelength_reference,
                                     _wavelength_inputs, trials=8, seed=21, rtol=1e-5, hint=hint,
                                     explain=_explain_wavelength, arg_names=("i", "head_dim", "base"))


def _explain_wavelength(got, expected, i, head_dim, base) -> str:
    if isinstance(got, (int, float)) and expected and math.isclose(got * 2 * math.pi, expected, rel_tol=1e-4):
        return "It is the right value divided by 2 pi: a wavelength is in tokens, not in turns or radians."
    if isinstance(got, (int, float)) and expected and math.isclose(got, expected * 2 * math.pi, rel_tol=1e-4):
        return "It is 2 pi times the right value: check the units of the frequency you divide by."
    return ""


# -------------------------------------------------------------------------------- position interpolation

def _pi_inputs(gen):
    return _pick(gen, _HEAD_DIMS), _pick(gen, _BASES), _pick(gen, (2.0, 4.0, 8.0, 16.0, 2.5))


def _pi_reference(head_dim, base, factor):
    return rope.rope_frequencies(head_dim, base, "linear", factor=factor)[0]


def _as_float32(fn):
    def wrapped(*args):
        got = fn(*args)
        if isinstance(got, np.ndarray):
            got = torch.from_numpy(got)
        if isinstance(got, torch.Tensor) and got.is_floating_point():
            got = got.float()
        return got
    return wrapped


@exercise
def check_position_interpolation(fn) -> Result:
    """Check ``fn(head_dim, base, factor) -> tensor (head_dim // 2,)``: the inverse frequencies that squeeze
    positions ``0 .. factor * L`` into the trained range ``0 .. L``."""
    hint = ("re-read 'Stretching the frequencies': after interpolation, position factor * L must turn every "
            "pair by the angle that position L turned it by in training.")
    refused = _refuse_library("position interpolation", fn, _pi_inputs, 22, (rope.linear_frequencies,), hint)
    if refused is not None:   # a Result is falsy unless passed: test for None
        return refused
    return check_function("position interpolation", _as_float32(fn), _pi_reference, _pi_inputs,
                                     trials=6, seed=22, hint=hint)


# ----------------------------------------------------------------------------------------------- NTK base

def _ntk_inputs(gen):
    return _pick(gen, _BASES), _pick(gen, (2.0, 4.0, 8.0, 16.0, 3.0)), _pick(gen, _HEAD_DIMS)


def _ntk_reference(base, factor, head_dim):
    return rope.ntk_base(base, factor, head_dim)


@exercise
def check_ntk_base(fn) -> Result:
    """Check ``fn(base, factor, head_dim) -> float``: the base for which the slowest pair is slowed by exactly
    ``factor`` while pair 0 keeps its frequency."""
    hint = ("re-read the NTK-aware part of 'Stretching the frequencies' and check your base against the task's "
            "condition on the slowest pair.")
    refused = _refuse_library("NTK-aware base", fn, _ntk_inputs, 23,
                              (rope.ntk_base, rope.ntk_frequencies, rope.dynamic_frequencies), hint)
    if refused is not None:   # a Result is falsy unless passed: test for None
        return refused
    return check_function("NTK-aware base", as_number(fn), _ntk_reference, _ntk_inputs, trials=8,
                                     seed=23, rtol=1e-6, hint=hint, explain=_explain_ntk)


def _explain_ntk(got, expected, base, factor, head_dim) -> str:
    """How much the student's base slows the slowest pair (the task's condition), as a number."""
    if not isinstance(got, (int, float)) or got <= 0:
        return "A base is a positive number."
    slowest = (head_dim - 2) / head_dim
    slowed = (got / base) ** slowest
    return f"With your base the slowest pair turns {slowed:.4g} times slower than with base, not {factor:g} times."


# ------------------------------------------------------------------------------------------ YaRN unscaled

def _yarn_inputs(gen):
    # Trained lengths of at least 1024 keep pair 0 above beta_fast turns, so "unscaled" is exactly the set of
    # pairs that turn at least beta_fast times in training (no clamping corner case).
    return (_pick(gen, _HEAD_DIMS), _pick(gen, _BASES), _pick(gen, (2.0, 4.0, 8.0, 16.0)),
            _pick(gen, (1024, 2048, 4096, 8192)), _pick(gen, (16.0, 32.0, 64.0)), _pick(gen, (1.0, 2.0)))


def _yarn_reference(head_dim, base, factor, original_max_position, beta_fast, beta_slow) -> list[int]:
    default, _ = rope.rope_frequencies(head_dim, base)
    yarn, _ = rope.rope_frequencies(head_dim, base, "yarn", factor=factor,
                                    original_max_position=original_max_position, beta_fast=beta_fast,
                                    beta_slow=beta_slow)
    return [int(i) for i in torch.nonzero(yarn == default).flatten()]


def _as_indices(got, n_pairs) -> tuple[list[int] | None, str]:
    """The student's answer as a sorted list of pair indices, or None and what is wrong with it."""
    if isinstance(got, np.ndarray):
        got = torch.from_numpy(got)
    if isinstance(got, torch.Tensor):
        if got.dtype == torch.bool:
            if got.shape != (n_pairs,):
                return None, f"a boolean mask must have shape ({n_pairs},), got {tuple(got.shape)}."
            got = torch.nonzero(got).flatten()
        if got.is_floating_point():
            return None, "pair indices must be integers."
        got = got.flatten().tolist()
    try:
        items = list(got)
    except TypeError:
        return None, f"expected a list of pair indices (or a boolean mask), got {type(got).__name__}."
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
        return None, "pair indices must be integers."
    if any(not 0 <= i < n_pairs for i in items):
        return None, f"pair indices must lie in [0, {n_pairs})."
    if len(set(items)) != len(items):
        return None, "some pair index appears twice."
    return sorted(int(i) for i in items), ""


def _check_pair_set(name, fn, make_inputs, reference, seed, trials, hint, forbidden, *, extra, missing):
    """The check shared by the exercises whose answer is a set of pair indices: ``fn(*inputs)`` against
    ``reference(*inputs)`` on ``trials`` random configurations, saying which way a wrong set is off
    (``extra``: it lists pairs it should not; ``missing``: it leaves some out), never which pairs."""
    refused = _refuse_library(name, fn, make_inputs, seed, forbidden, hint)
    if refused is not None:
        return refused
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, trials * HIDDEN_TRIALS
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        args = make_inputs(gen)
        try:
            got = fn(*args)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        indices, problem = _as_indices(got, args[0] // 2)
        if indices is not None:
            expected = reference(*args)
            if indices != expected:
                wrong = ((extra, set(indices) - set(expected)), (missing, set(expected) - set(indices)))
                problem = " and ".join(f"{text} ({len(pairs)} of them)" for text, pairs in wrong if pairs) + "."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} with inputs {args}: {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} random configurations."))


@exercise
def check_yarn_unscaled(fn) -> Result:
    """Check ``fn(head_dim, base, factor, original_max_position, beta_fast, beta_slow)``: the indices of the
    pairs whose frequency YaRN leaves exactly as trained (a list of ints or a boolean mask over the pairs)."""
    name = "pairs YaRN leaves unscaled"
    hint = ("re-read YaRN in 'Stretching the frequencies' and, with the interactive plot of angles, sort the "
            "pairs of the failing configuration by how far they turn over original_max_position.")
    return _check_pair_set(name, fn, _yarn_inputs, _yarn_reference, 24, 8, hint,
                           (rope.yarn_correction_range, rope.yarn_frequencies),
                           extra="your answer lists pairs that YaRN does scale",
                           missing="it misses pairs that YaRN leaves alone")



# ------------------------------------------------------------------------------------------- unseen pairs

def _unseen_inputs(gen):
    train = _pick(gen, (256, 512, 1000, 2048, 4096))
    return (_pick(gen, _HEAD_DIMS), _pick(gen, _BASES), train,
            int(train * _pick(gen, (1.0, 1.5, 2.0, 4.0, 8.0, 32.0, 256.0))))


def _unseen_reference(head_dim, base, train_length, new_length) -> list[int]:
    # float64 frequencies: no pair of these configurations sits within float32 rounding of the 2 pi boundary
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    unseen = rope.max_angles(inv_freq, train_length, new_length).unseen
    return [int(i) for i in torch.nonzero(unseen).flatten()]


@exercise
def check_unseen_pairs(fn) -> Result:
    """Check ``fn(head_dim, base, train_length, new_length)``: the indices of the pairs whose rotation angles at
    positions ``< new_length`` include angles no position ``< train_length`` produced (a list of ints or a
    boolean mask over the pairs)."""
    name = "pairs that leave the trained range"
    hint = ("re-read 'Wavelengths, and which pairs complete full turns in training' and, for the failing "
            "configuration, draw the arc of angles one pair covers at train_length and at new_length.")
    return _check_pair_set(name, fn, _unseen_inputs, _unseen_reference, 25, 10, hint, (rope.max_angles,),
                           extra="your answer lists pairs whose angles were all seen in training",
                           missing="it misses pairs that reach new angles")


# ------------------------------------------------------------------------------------------ the kernel

# (T, HALF): odd token counts, and half-dims that are not powers of two, so that a missing mask shows.
_KERNEL_SIZES = ((7, 20), (13, 3), (1, 5), (22, 12), (9, 1), (31, 33), (5, 64), (17, 7))
_GUARD = 64   # NaN elements before and after every buffer: a load or store outside the tensor shows up


def _guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, storage)``: ``values`` copied into the middle of a NaN-filled buffer, and that buffer."""
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _kernel_case(gen, size):
    T, half = size
    D = 2 * half
    rows = T + randint(gen, 3, 60)
    inv_freq = _pick(gen, _BASES) ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    cos, sin = rope.rope_cos_sin(inv_freq, rows, attention_scaling=_pick(gen, (1.0, 1.2)))
    x = torch.randn(T, D, generator=gen)
    positions = torch.randint(0, rows, (T,), generator=gen).to(_pick(gen, (torch.int64, torch.int32)))
    return x, cos, sin, positions


def _run_kernel(kernel, x, cos, sin, positions):
    """Launch the student's kernel as the exercise states; return ``(out, problem)``."""
    import triton  # only reached when Triton is installed

    T, D = x.shape
    xg, x_store = _guarded(x)
    out, out_store = _guarded(torch.full_like(x, float("nan")))
    kernel[(T,)](xg, out, cos, sin, positions, HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2))
    if not torch.equal(xg, x):
        return out, "the kernel changed its input x."
    guards = torch.cat([out_store[:_GUARD], out_store[-_GUARD:]])
    if not bool(torch.isnan(guards).all()):
        return out, "the kernel wrote outside the output tensor (a lane past D/2 stored without a mask?)."
    return out, None


def _explain_rotation(out, x, cos, sin, positions) -> str:
    """Recognise a kernel that rotates by the wrong position (the program id) or the wrong way round."""
    rtol, atol = tolerance(torch.float32)
    T = x.shape[0]
    guesses = (("by the angles of position t (the program id), not of positions[t]", cos, sin,
                torch.arange(T, dtype=positions.dtype)),
               ("the wrong way round (by minus the angle)", cos, -sin, positions))
    for said, c, s_, p in guesses:
        try:
            alt = rope.apply_rope_ref(x[None, None], x[None, None], c, s_, p)[0][0, 0]
        except Exception:  # noqa: BLE001 - a guess that does not apply says nothing
            continue
        if torch.allclose(out, alt, rtol=rtol, atol=atol):
            return f" Your kernel rotates every token {said}."
    return ""


@exercise
def check_rope_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF, BLOCK)`` that
    rotates one head ``x (T, D)`` into ``out``, one program per token (grid ``(T,)``), against
    :func:`labsrc.rope.apply_rope_ref`. ``x``, ``out``, ``cos``, ``sin`` are contiguous float32, ``D = 2 * HALF``,
    ``BLOCK`` the next power of two >= ``HALF``, positions int32 or int64. Sizes are odd and ``HALF`` is
    rarely a power of two. Without Triton (macOS, Windows) the check says it is skipped."""
    name = "RoPE kernel for one head"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'The kernel' and compare your output for the token named above with apply_rope_ref on "
            "that token alone; a message about writes or NaN points at the masks.")
    seed, sizes = 26, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((t + 2, h + 4) for t, h in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of T programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance(torch.float32)
    for trial, size in enumerate(sizes):
        x, cos, sin, positions = _kernel_case(gen, size)
        try:
            out, problem = _run_kernel(kernel, x, cos, sin, positions)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={size[0]}, D={2 * size[1]}): the launch "
                                                f"raised {type(cause or err).__name__}: {cause or err}. "
                                                f"Hint: {hint}"))
        if problem is None:
            expected = rope.apply_rope_ref(x[None, None], x[None, None], cos, sin, positions)[0][0, 0]
            if torch.isnan(out).any():
                problem = f"{int(torch.isnan(out).sum())} output element(s) were never written."
            elif not torch.allclose(out, expected, rtol=rtol, atol=atol):
                bad = ~torch.isclose(out, expected, rtol=rtol, atol=atol)
                t, d = (int(i) for i in bad.nonzero()[0])
                half = "first" if d < size[1] else "second"
                problem = (f"{int(bad.sum())} of {bad.numel()} elements differ; the first at token {t}, column "
                           f"{d} (the {half} half).{_explain_rotation(out, x, cos, sin, positions)}")
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={size[0]}, D={2 * size[1]}): {problem} "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to apply_rope_ref on {len(sizes)} launches with odd sizes."))
