"""Checks for the exercises of the architecture-frontier chapter.

* :func:`check_diff_lambda` -- ``fn(layer, lq1, lk1, lq2, lk2)``: the DIFF Transformer's lambda for a layer,
  its schedule ``lambda_init`` and the re-parameterisation (:func:`labsrc.frontier.reparam_lambda`).
* :func:`check_mod_capacity_topk` -- ``fn(scores, capacity)``: Mixture-of-Depths' routed positions, exact
  capacity, ties to the earlier position, in position order (:func:`labsrc.frontier.mod_route`).
* :func:`check_diff_softmax_kernel` -- a ``@triton.jit`` kernel that fuses the two softmaxes of differential
  attention for one query block, launched by the check under Triton's interpreter and compared with
  :func:`labsrc.kernels.frontier.diff_attention_ref`.

Each check compares with :mod:`labsrc.frontier` on seeded random cases and refuses an answer that calls the
library function the exercise asks for. Expected answers are never printed.
"""
from __future__ import annotations

import math

import torch

from labsrc import frontier, runtime
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _report,
                                   check_function, exercise, hidden, randint, refuse_library, tolerance)
from labsrc.kernels import frontier as kfr

__all__ = ["check_diff_lambda", "check_mod_capacity_topk", "check_diff_softmax_kernel"]


# ------------------------------------------------------------------------------------------ lambda
def _lambda_inputs(gen):
    H, D = randint(gen, 1, 4), randint(gen, 2, 9)
    vecs = [0.3 * torch.randn(H, D, generator=gen, dtype=torch.float64) for _ in range(4)]
    return (randint(gen, 1, 40), *vecs)


def _lambda_reference(layer, lq1, lk1, lq2, lk2):
    return frontier.reparam_lambda(lq1, lk1, lq2, lk2, frontier.lambda_init(layer))


def _explaining_lambda(fn):
    """``explain`` for lambda: with the four vectors zero only the layer's schedule remains."""
    def explain(got, expected, layer, lq1, lk1, lq2, lk2) -> str:
        zeros = [torch.zeros_like(x) for x in (lq1, lk1, lq2, lk2)]
        mine, right = fn(layer, *zeros), _lambda_reference(layer, *zeros)
        if not (isinstance(mine, torch.Tensor) and mine.shape == right.shape
                and torch.allclose(mine.double(), right, rtol=1e-9, atol=1e-12)):
            return f"With the four vectors zero your lambda for layer {layer} is already wrong: the schedule."
        return "With the four vectors zero your lambda is right: the part they add is wrong."
    return explain


@exercise
def check_diff_lambda(fn) -> Result:
    """Check ``fn(layer, lq1, lk1, lq2, lk2) -> (H,)``: ``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init(layer)``
    per head, with ``lambda_init(l) = 0.8 - 0.6 exp(-0.3 (l - 1))`` and layers counted from 1."""
    name = "the DIFF Transformer's lambda for one layer"
    hint = ("re-read 'Differential attention' and check your function with all four vectors zero, where only "
            "the layer's schedule is left and you can work it out by hand.")
    refused = refuse_library(name, fn, (frontier.lambda_init, frontier.reparam_lambda), hint,
                             owner="labsrc.frontier", args=_lambda_inputs(torch.Generator().manual_seed(51)))
    if refused is not None:
        return refused
    return check_function(name, fn, _lambda_reference, _lambda_inputs, trials=12, seed=51, rtol=1e-9,
                          atol=1e-12, hint=hint, explain=_explaining_lambda(fn))


# ------------------------------------------------------------------------------------------ MoD top-k
def _route_inputs(gen):
    B, T = randint(gen, 1, 4), randint(gen, 1, 33)
    scores = torch.randint(0, 5, (B, T), generator=gen).double()    # small integers: ties happen
    capacity = [0.5, 0.125, 0.25, 0.3, 1.0, 0.01][randint(gen, 0, 5)]
    return scores, capacity


def _explain_route(got, expected, scores, capacity) -> str:
    """Which rule a routed set breaks: the order, the tie rule, or the choice of scores."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"(T = {scores.shape[1]}, capacity = {capacity}: check the count rule.)"
    if (got[:, 1:] <= got[:, :-1]).any():
        return "The positions of a row are not in increasing order."
    for b in range(got.shape[0]):
        mine, right = got[b].long(), expected[b].long()
        if not torch.equal(mine, right):
            if torch.equal(scores[b, mine].sort().values, scores[b, right].sort().values):
                return f"Row {b} keeps scores as high as the right ones, but breaks a tie the wrong way."
            return f"Row {b} keeps a position whose score is lower than one it leaves out."
    return ""


@exercise
def check_mod_capacity_topk(fn) -> Result:
    """Check ``fn(scores, capacity) -> (B, k)`` positions: ``k = round(capacity * T)`` (halves up, at least
    1), each row's ``k`` highest scores, ties to the earlier position, listed in increasing position."""
    name = "Mixture-of-Depths' capacity top-k"
    hint = ("re-read 'Mixture-of-Depths: only some tokens pass through a block' and the task's rules for the "
            "count, the ties and the order; the message says which of them the failing trial breaks.")
    refused = refuse_library(name, fn, (frontier.mod_route, frontier.mod_capacity_count), hint,
                             owner="labsrc.frontier", args=_route_inputs(torch.Generator().manual_seed(52)))
    if refused is not None:
        return refused

    def answer(scores, capacity):
        got = fn(scores, capacity)
        return torch.as_tensor(got).double() if isinstance(got, (torch.Tensor, list)) else got

    return check_function(name, answer, lambda s, c: frontier.mod_route(s, c).double(), _route_inputs,
                          trials=25, seed=52, rtol=0, atol=0, hint=hint, explain=_explain_route)


# ------------------------------------------------------------------------------------------ the kernel
_KERNEL_SIZES = ((5, 16), (1, 16), (17, 24), (16, 40), (29, 16), (9, 32))   # (T, D)
_GUARD = 4096    # covers a whole (BLOCK_T, BLOCK_D) tile stored without a mask: no write leaves the buffer


def _guarded(values: torch.Tensor):
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _diff_slip(out, q1, k1, q2, k2, v, lam, scale) -> str:
    """Recognise a kernel without the causal mask, without the scale, or with the subtraction turned round."""
    T = q1.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def attend(q, k, masked, sc):
        s = (q @ k.T) * sc
        return torch.softmax(s.masked_fill(~causal, float("-inf")) if masked else s, -1) @ v

    rtol, atol = tolerance(torch.float32)
    guesses = (("without the causal mask", True, scale, False), ("with unscaled scores", False, 1.0, False),
               ("with the two softmaxes' roles swapped", False, scale, True))
    for said, unmasked, sc, swap in guesses:
        a, b = (q2, k2), (q1, k1)
        first, second = (a, b) if swap else (b, a)
        alt = attend(*first, not unmasked, sc) - lam * attend(*second, not unmasked, sc)
        if torch.allclose(out, alt, rtol=rtol, atol=atol):
            return f" Your outputs are those of differential attention {said}."
    return ""


@exercise
def check_diff_softmax_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(q1, k1, q2, k2, v, out, lam, scale, T, D, BLOCK_T, BLOCK_D)``
    that computes causal differential attention for one head whose ``T`` queries form one block:
    ``out = softmax(q1 k1^T scale + causal) v - lam * softmax(q2 k2^T scale + causal) v``, all tensors
    contiguous float32 ``(T, D)``, grid ``(1,)``, ``BLOCK_T >= max(T, 16)`` and ``BLOCK_D >= D`` powers of
    two (``T``, ``D`` constexpr). Sizes are odd. Without Triton (macOS, Windows) the check says it is
    skipped."""
    name = "differential attention's two softmaxes in one kernel (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    import triton

    hint = ("re-read 'The kernel' and follow the query row named above through your kernel; NaN or writes "
            "outside point at the masks (T and D are rarely powers of two here).")
    seed, sizes = 53, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((t + 2, d) for t, d in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of one program")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance(torch.float32)
    for trial, (T, D) in enumerate(sizes):
        q1, k1, q2, k2, v = (torch.randn(T, D, generator=gen) for _ in range(5))
        lam = float(torch.rand((), generator=gen)) * 0.8 + 0.1
        scale = 1 / math.sqrt(D)
        ins = [_guarded(t)[0] for t in (q1, k1, q2, k2, v)]
        out, store = _guarded(torch.full_like(q1, float("nan")))
        try:
            kernel[(1,)](*ins, out, lam, scale, T=T, D=D, BLOCK_T=max(16, triton.next_power_of_2(T)),
                         BLOCK_D=max(16, triton.next_power_of_2(D)))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, D={D}): the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        problem = None
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor (a row past T or a lane past D without a mask?)."
        elif torch.isnan(out).any():
            problem = f"{int(torch.isnan(out).sum())} output element(s) are NaN or were never written."
        else:
            want = kfr.diff_attention_ref(*(t[None, None] for t in (q1, k1, q2, k2, v)), lam)[0, 0]
            if not torch.allclose(out, want, rtol=rtol, atol=atol):
                bad = ~torch.isclose(out, want, rtol=rtol, atol=atol)
                problem = (f"{int(bad.sum())} of {bad.numel()} elements differ (first in row "
                           f"{int(bad.nonzero()[0, 0])}).{_diff_slip(out, q1, k1, q2, k2, v, lam, scale)}")
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, D={D}): {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the reference on {len(sizes)} launches with odd sizes."))
