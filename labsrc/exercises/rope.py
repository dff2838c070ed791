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
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from labsrc import rope
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, NOT_SOLVED, PASSED, Result, _report,
                                   as_number, check_function, exercise, hidden)

__all__ = ["check_wavelength", "check_position_interpolation", "check_ntk_base", "check_yarn_unscaled"]

_HEAD_DIMS = (32, 64, 80, 96, 128)
_BASES = (10000.0, 500000.0, 1000000.0)


def _pick(gen: torch.Generator, options):
    return options[int(torch.randint(len(options), (1,), generator=gen))]



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
    return check_function("wavelength of pair i", as_number(fn), _wavelength_reference, _wavelength_inputs,
                          trials=8, seed=21, rtol=1e-5,
                          hint="pair i turns by theta_i = base**(-2i/head_dim) radians per token.")


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
    return check_function("position interpolation", _as_float32(fn), _pi_reference, _pi_inputs, trials=6, seed=22,
                          hint="rotating position m/s by theta_i is the same as rotating position m by what?")


# ----------------------------------------------------------------------------------------------- NTK base

def _ntk_inputs(gen):
    return _pick(gen, _BASES), _pick(gen, (2.0, 4.0, 8.0, 16.0, 3.0)), _pick(gen, _HEAD_DIMS)


def _ntk_reference(base, factor, head_dim):
    return rope.ntk_base(base, factor, head_dim)


@exercise
def check_ntk_base(fn) -> Result:
    """Check ``fn(base, factor, head_dim) -> float``: the base for which the slowest pair is slowed by exactly
    ``factor`` while pair 0 keeps its frequency."""
    return check_function("NTK-aware base", as_number(fn), _ntk_reference, _ntk_inputs, trials=8, seed=23,
                          rtol=1e-6,
                          hint="write theta_i with the new base b' and require theta'_last = theta_last / s for "
                               "the last pair, i = head_dim/2 - 1; solve for b'.")


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


@exercise
def check_yarn_unscaled(fn) -> Result:
    """Check ``fn(head_dim, base, factor, original_max_position, beta_fast, beta_slow)``: the indices of the
    pairs whose frequency YaRN leaves exactly as trained (a list of ints or a boolean mask over the pairs)."""
    name = "pairs YaRN leaves unscaled"
    hint = ("count how many full turns each pair makes over the original context; YaRN keeps the pairs that "
            "turn at least beta_fast times.")
    seed, trials = 24, 8
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, trials * HIDDEN_TRIALS
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        args = _yarn_inputs(gen)
        try:
            got = fn(*args)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        indices, problem = _as_indices(got, args[0] // 2)
        if indices is not None:
            expected = _yarn_reference(*args)
            if indices != expected:
                extra, missing = set(indices) - set(expected), set(expected) - set(indices)
                problem = " and ".join(
                    text for text, wrong in (("your answer lists pairs that YaRN does scale", extra),
                                             ("it misses pairs that YaRN leaves alone", missing)) if wrong) + "."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} with inputs {args}: {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} random configurations."))
