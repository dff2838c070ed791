"""Checks for the exercises of the position-encoding chapter (RoPE and context extension).

Each check calls the student's function on several seeded random configurations and compares it with the truth
computed here (from :mod:`labsrc.rope`, or from the angles themselves); it prints ``passed``, what is wrong (with
a hint), or ``not solved yet`` when the function still raises ``NotImplementedError``. Expected answers are
computed here, never printed.

* :func:`check_wavelength` -- ``fn(i, head_dim, base)``: tokens per full turn of pair ``i`` (a warm-up).
* :func:`check_first_new_angle` -- ``fn(head_dim, base, train_length, method, factor)``: a prediction, the
  shortest context at which a model whose frequencies were rescaled by ``method`` (position interpolation or
  NTK-aware scaling, configured for ``factor``) meets a rotation angle that training never produced; the
  chapter then measures it on the lab model's frequencies.
* :func:`check_rotate_new_tokens` -- ``fn(x, past_len, inv_freq)``: the fixed version of a given decode-step
  rotation with two bugs (a debugging exercise).
* :func:`check_rope_kernel` -- a ``@triton.jit`` kernel that rotates one head in the *interleaved* layout (pair
  ``i`` is coordinates ``2i`` and ``2i + 1``, which the chapter's rotate-half kernel does not cover), one program
  per token, launched by the check on odd sizes under Triton's interpreter.

The wavelength check refuses an answer that calls the :mod:`labsrc.rope` function it asks the student to write
(read in the answer's code, and watched while the answer runs, however the function was imported).
"""
from __future__ import annotations

import math

import torch

from labsrc import rope
from labsrc.exercises.core import not_a_kernel, skipped_without_triton, stub_raised
from labsrc.exercises.core import (FAILED, NOT_SOLVED, seed_for, PASSED, Result, _report, as_number,
                                   check_function, exercise, hidden, randint, refuse_library, tolerance)

__all__ = ["check_wavelength", "check_first_new_angle", "check_rotate_new_tokens", "check_rope_kernel"]

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
                                     _wavelength_inputs, trials=8, seed=21, rtol=1e-5, hint=hint)


# ------------------------------------------------------------------------------- the first new angle

_METHODS = ("linear", "ntk")
# Lengths L with L - 1 odd and factors ending in .5: (L - 1) * s is never a whole number, so no position turns a
# rescaled pair exactly to its largest trained angle, and no answer hangs on how float arithmetic rounds a tie.
_TRAIN_LENGTHS = (512, 1000, 1024, 2048, 4096)
_FACTORS = (1.5, 2.5, 3.5, 6.5, 12.5)


def _first_new_inputs(gen):
    while True:
        args = (_pick(gen, _HEAD_DIMS), _pick(gen, _BASES), _pick(gen, _TRAIN_LENGTHS), _pick(gen, _METHODS),
                _pick(gen, _FACTORS))
        if _first_new_reference(*args, margin=True) is not None:
            return args


def _first_new_reference(head_dim, base, train_length, method, factor, margin=False):
    """The shortest context (tokens, positions 0 .. n-1) in which some pair turns past the largest angle it
    reached in training, for pairs that never completed a turn there. The angle of position m, counted in
    trained positions of pair i, is m times the pair's slow-down ratio; the ratios are exact here (1, 1/s,
    s^(-2i/(D-2))) so that a tie is a tie. With ``margin``, None for a configuration within 1e-6 of a tie."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    theta = base ** (-2 * i / head_dim)
    slow = (train_length - 1) * theta < 2 * math.pi
    if method == "linear":
        stretch = torch.full_like(i, float(factor))
    else:
        stretch = float(factor) ** (2 * i / (head_dim - 2))
    reach = (train_length - 1) * stretch[slow]        # the last position whose angle is not new, per slow pair
    if margin and method == "ntk" and bool(((reach - reach.round()).abs() < 1e-6).any()):
        return None
    return int(torch.floor(reach).min()) + 2


@exercise
def check_first_new_angle(fn) -> Result:
    """Check ``fn(head_dim, base, train_length, method, factor) -> int``: the shortest context (a number of
    tokens, positions ``0 .. n-1``) at which a model trained at ``train_length`` with RoPE base ``base``, its
    frequencies rescaled by ``method`` ("linear": position interpolation, "ntk": NTK-aware scaling, each
    configured for ``factor``), rotates some pair past every angle that pair reached in training. An angle equal
    to the largest trained one is not new."""
    name = "first context with a new angle"
    hint = ("re-read 'What a longer context shows the model' and 'Stretching the frequencies'; for the failing "
            "configuration, find which pairs can meet a new angle at all, then when each of them does.")
    # the whole of labsrc.rope is refused while the answer runs: stepping positions through the library's
    # rescaled frequencies until a new angle appears would measure n instead of deriving it
    return check_function(name, as_number(fn), _first_new_reference, _first_new_inputs, trials=10, seed=27,
                          hint=hint, forbidden=(rope,), owner="the lab")


# --------------------------------------------------------------------------- a decode step's rotation

def _rotate_inputs(gen):
    half = randint(gen, 2, 24)
    heads, t = randint(gen, 1, 3), randint(gen, 1, 5)
    inv_freq = _pick(gen, _BASES) ** (-torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    past = randint(gen, 1, 3000)
    return torch.randn(heads, t, 2 * half, generator=gen), past, inv_freq.float()


def _rotate_reference(x, past_len, inv_freq):
    # angles in float64: at positions in the thousands a float32 angle is off by about 1e-4 radians
    angles = torch.arange(past_len, past_len + x.shape[-2], dtype=torch.float64)[:, None] * inv_freq.double()
    table = torch.cat([angles, angles], dim=-1)
    return (x.double() * table.cos() + rope.rotate_half(x.double()) * table.sin()).to(x.dtype)


@exercise
def check_rotate_new_tokens(fn) -> Result:
    """Check ``fn(x, past_len, inv_freq) -> tensor``: the rotate-half RoPE of the ``T`` new tokens ``x (H, T, D)``
    of a decode step, which follow ``past_len`` cached tokens, with inverse frequencies ``inv_freq (D/2,)``; the
    output has ``x``'s shape and dtype (compared in float32 precision)."""
    name = "rotation of a decode step's new tokens"
    hint = ("re-read the real form of RoPE in 'The idea' and test your function on one token at a known position "
            "against the chapter's rope_real.")
    return check_function(name, fn, _rotate_reference, _rotate_inputs, trials=8, seed=28, rtol=1e-4, atol=1e-5,
                          hint=hint, forbidden=(_rotate_reference,), owner="the lab")


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
    """One head ``x (T, D)``, half tables ``cos, sin (rows, D/2)`` (one angle per pair) and positions."""
    T, half = size
    D = 2 * half
    rows = T + randint(gen, 3, 60)
    inv_freq = _pick(gen, _BASES) ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    cos, sin = rope.rope_cos_sin(inv_freq, rows, attention_scaling=_pick(gen, (1.0, 1.2)))
    x = torch.randn(T, D, generator=gen)
    positions = torch.randint(0, rows, (T,), generator=gen).to(_pick(gen, (torch.int64, torch.int32)))
    return x, cos[:, :half].contiguous(), sin[:, :half].contiguous(), positions


def interleaved_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
    """RoPE in the interleaved (GPT-J) layout: pair i is coordinates 2i and 2i + 1, turned by the angle whose
    cosine and sine are ``cos[positions, i]``, ``sin[positions, i]`` (tables of one column per pair)."""
    c, s_ = cos[positions.long()], sin[positions.long()]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s_
    out[..., 1::2] = odd * c + even * s_
    return out


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


@exercise
def check_rope_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HALF, BLOCK)`` that
    rotates one head ``x (T, D)`` into ``out`` in the interleaved layout (pair ``i`` = coordinates ``2i`` and
    ``2i + 1``), one program per token (grid ``(T,)``), against :func:`interleaved_rope_ref`. ``x`` and ``out``
    are contiguous float32 ``(T, D)``, ``cos`` and ``sin`` contiguous float32 ``(rows, HALF)`` (one column per
    pair), ``D = 2 * HALF``, ``BLOCK`` the next power of two >= ``HALF``, positions int32 or int64. Sizes are odd
    and ``HALF`` is rarely a power of two. Without Triton (macOS, Windows) the check says it is skipped."""
    name = "interleaved RoPE kernel for one head"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'The kernel' and the task's layout, and compare your output for the token this message names "
            "with a rotation of that token's pairs done by hand.")
    seed, sizes = seed_for(26), _KERNEL_SIZES
    if hidden():
        sizes = sizes + tuple((t + 2, h + 4) for t, h in sizes)
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
            if stub_raised(err):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={size[0]}, D={2 * size[1]}): the launch "
                                                f"raised {type(cause or err).__name__}: {cause or err}. "
                                                f"Hint: {hint}"))
        if problem is None:
            expected = interleaved_rope_ref(x, cos, sin, positions)
            if torch.isnan(out).any():
                problem = "some output elements were never written."
            elif not torch.allclose(out, expected, rtol=rtol, atol=atol):
                bad = ~torch.isclose(out, expected, rtol=rtol, atol=atol)
                t, d = (int(i) for i in bad.nonzero()[0])
                problem = f"the output differs from the reference first at token {t}, column {d}."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={size[0]}, D={2 * size[1]}): {problem} "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the interleaved reference on {len(sizes)} launches with odd "
                                        "sizes."))
