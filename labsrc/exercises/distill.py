"""Checks for the exercises of the distillation chapter.

Each check calls the student's function on several seeded random cases and compares it with
:mod:`labsrc.distill`; it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the function
still raises ``NotImplementedError``. Expected answers are computed here, never printed.

* :func:`check_kd_loss_by_hand` -- ``fn(student_logits, teacher_logits, labels, T, alpha)``: the KD loss of
  Hinton et al. over ``(N, V)`` logits with ``-100`` labels ignored.
* :func:`check_kd_soft_gradient` -- ``fn(student_logits, teacher_logits, T)``: the gradient of the soft term
  ``T² KL(p_T || q_T)`` with respect to one row of student logits, in closed form.
* :func:`check_tinybert_layer_map` -- ``fn(n_teacher, n_student)``: TinyBERT's uniform layer mapping.
* :func:`check_kd_kl_kernel` -- a ``@triton.jit`` kernel that computes one row's KL between temperature
  softmaxes, one program per row, launched by the check under Triton's interpreter and compared with
  :func:`labsrc.kernels.distill.kd_kl_ref`.

A check refuses an answer that calls the :mod:`labsrc.distill` function the exercise asks the student to write.
"""
from __future__ import annotations

import numpy as np
import torch

from labsrc import distill, runtime
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _report, as_number,
                                   check_function, diagnose_number, exercise, hidden, randint, refuse_library)

__all__ = ["check_kd_loss_by_hand", "check_kd_soft_gradient", "check_tinybert_layer_map", "check_kd_kl_kernel"]


def _forbidden():
    from labsrc.kernels import distill as kd
    return (distill.kd_loss, distill.soft_kl, distill.generalized_jsd, distill._kl_terms, kd.kd_kl, kd.kd_kl_ref,
            kd.kd_kl_backward_ref, distill.tinybert_layer_map)


def _refuse(name, fn, make_inputs, seed, hint):
    return refuse_library(name, fn, _forbidden(), hint, owner="labsrc.distill",
                          args=make_inputs(torch.Generator().manual_seed(seed)))


def _temperature(gen):
    return (0.5, 1.0, 2.0, 3.0, 5.0)[randint(gen, 0, 4)]


# ------------------------------------------------------------------------------------------ the KD loss
def _kd_inputs(gen):
    N, V = randint(gen, 2, 9), randint(gen, 3, 50)
    s = torch.randn(N, V, generator=gen) * 2
    t = torch.randn(N, V, generator=gen) * 2
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.3] = -100
    labels[0] = 0  # at least one token counts
    alpha = (0.0, 0.25, 0.5, 0.9)[randint(gen, 0, 3)]
    return s, t, labels, _temperature(gen), alpha


def _kd_reference(s, t, labels, T, alpha):
    return float(distill.kd_loss(s, t, labels, T=T, alpha=alpha))


def _explaining_kd(fn):
    """``explain`` for the KD loss: judge the hard term (alpha = 1) and the soft term (alpha = 0) on their own."""
    def explain(got, expected, s, t, labels, T, alpha) -> str:
        def alone(a, lab=labels):
            return as_number(fn)(s, t, lab, T, a), _kd_reference(s, t, lab, T, a)
        said = []
        for a, term in ((1.0, "hard"), (0.0, "soft")):
            mine, right = alone(a)
            if not (isinstance(mine, (int, float)) and abs(mine - right) <= 1e-4 * abs(right) + 1e-6):
                slip = diagnose_number(float(mine), right) if isinstance(mine, (int, float)) else ""
                said.append(f"the {term} term alone is wrong.{slip}")
        if not said:
            return "Each term alone is right: look at how they are mixed by alpha."
        everyone = torch.where(labels == -100, torch.zeros_like(labels), labels)
        mine, _ = alone(0.0)
        if (labels == -100).any() and isinstance(mine, (int, float)) and \
                abs(mine - _kd_reference(s, t, everyone, T, 0.0)) <= 1e-4 * abs(mine) + 1e-6:
            said.append("Your soft term averages over every token, the ignored ones (label -100) too.")
        return " ".join(x[0].upper() + x[1:] for x in said)
    return explain


def _explain_gradient(got, expected, s, t, T) -> str:
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and abs(float(got.sum())) > 1e-4:
        return "Your gradient does not sum to 0 over the vocabulary; the gradient of this loss does."
    return ""


def _explain_map(got, expected, N, M) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"The list has one entry per student layer plus the embeddings: {M + 1} here."
    if int(got[0]) != int(expected[0]) or int(got[-1]) != int(expected[-1]):
        return "One of the two ends of your list is wrong."
    return "The ends are right; the spacing in between is not."


@exercise
def check_kd_loss_by_hand(fn) -> Result:
    """Check ``fn(student_logits (N, V), teacher_logits (N, V), labels (N,), T, alpha) -> float``:
    ``alpha * CE + (1 - alpha) * T² * KL(softmax(t/T) || softmax(s/T))``, both averaged over the tokens whose
    label is not -100."""
    name = "KD loss by hand"
    hint = ("re-read 'The KD loss and its T²' and compute each term on its own (alpha = 1 keeps only the "
            "hard term, alpha = 0 only the soft one).")
    refused = _refuse(name, fn, _kd_inputs, 131, hint)
    if refused is not None:
        return refused
    return check_function(name, as_number(fn), _kd_reference, _kd_inputs, trials=6, seed=131, rtol=1e-4,
                          atol=1e-6, hint=hint, explain=_explaining_kd(fn))


# ------------------------------------------------------------------------------ the soft term's gradient
def _grad_inputs(gen):
    V = randint(gen, 2, 40)
    return torch.randn(V, generator=gen) * 3, torch.randn(V, generator=gen) * 3, _temperature(gen)


def _grad_reference(s, t, T):
    s = s.clone().requires_grad_(True)
    distill.kd_loss(s[None], t[None], T=T).backward()
    return s.grad


@exercise
def check_kd_soft_gradient(fn) -> Result:
    """Check ``fn(student_logits (V,), teacher_logits (V,), T) -> (V,)``: the gradient of
    ``T² KL(softmax(t/T) || softmax(s/T))`` with respect to ``s``, written in closed form (no autograd)."""
    name = "gradient of the soft term"
    hint = ("re-read 'The KD loss and its T²' and compare your gradient with autograd's on a small case in a "
            "scratch cell; the message says whether it is off by a constant factor or in sign.")
    refused = _refuse(name, fn, _grad_inputs, 132, hint)
    if refused is not None:
        return refused

    def no_autograd(s, t, T):
        with torch.no_grad():
            return fn(s, t, T)

    return check_function(name, no_autograd, _grad_reference, _grad_inputs, trials=6, seed=132, rtol=1e-4,
                          atol=1e-6, hint=hint, explain=_explain_gradient)


# ---------------------------------------------------------------------------------- TinyBERT's layer map
def _map_inputs(gen):
    M = randint(gen, 1, 6)
    return M * randint(gen, 1, 4), M


@exercise
def check_tinybert_layer_map(fn) -> Result:
    """Check ``fn(n_teacher, n_student) -> list[int]`` of length ``n_student + 1``: the teacher layer each
    student layer learns from (layer 0: the embeddings), TinyBERT's uniform strategy."""
    name = "TinyBERT layer map"
    hint = ("re-read 'Beyond the logits: DistilBERT and TinyBERT' on the uniform strategy, and check your "
            "list's length, its two ends and the spacing of its entries.")
    refused = _refuse(name, fn, _map_inputs, 133, hint)
    if refused is not None:
        return refused

    def as_list(N, M):
        got = fn(N, M)
        return torch.tensor([int(x) for x in got]) if isinstance(got, (list, tuple, torch.Tensor)) else got

    return check_function(name, as_list, lambda N, M: torch.tensor(distill.tinybert_layer_map(N, M)),
                          _map_inputs, trials=8, seed=133, hint=hint, explain=_explain_map)


# --------------------------------------------------------------------------------------- the KL kernel
# (rows, V): odd vocabularies, rarely powers of two, so that a missing mask shows
_KERNEL_SIZES = ((3, 7), (1, 1), (4, 100), (2, 257), (5, 33), (1, 640))
_GUARD = 64


def _guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _run_kernel(kernel, s, t, T):
    import triton  # only reached when Triton is installed

    R, V = s.shape
    sg, _ = _guarded(s)
    tg, _ = _guarded(t)
    out, out_store = _guarded(torch.full((R,), float("nan")))
    # Under the interpreter the kernel runs in NumPy, which warns about what a GPU computes silently
    # (-inf - -inf in a masked lane, exp overflow): the comparison below is what judges the kernel.
    with np.errstate(all="ignore"):
        kernel[(R,)](sg, tg, out, V, 1.0 / T, BLOCK=triton.next_power_of_2(V))
    guards = torch.cat([out_store[:_GUARD], out_store[-_GUARD:]])
    if not bool(torch.isnan(guards).all()):
        return out, "the kernel wrote outside the output (one value per row, at out_ptr + row)."
    return out, None


@exercise
def check_kd_kl_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(s_ptr, t_ptr, out_ptr, V, inv_T, BLOCK)`` that writes, for row
    ``r`` of the contiguous float32 ``(R, V)`` student and teacher logits, ``KL(softmax(t/T) || softmax(s/T))``
    to ``out[r]`` (grid ``(R,)``, ``BLOCK`` the next power of two >= ``V``, so one block holds the row),
    against :func:`labsrc.kernels.distill.kd_kl_ref`. Without Triton the check says it is skipped."""
    name = "KD KL kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    from labsrc.kernels.distill import kd_kl_ref

    hint = ("re-read 'The kernel: the soft term in one pass'. Every third trial has large logits at T = 0.5, "
            "where a softmax computed naively overflows; NaN rows or writes outside point at the masks.")
    seed, sizes = 134, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((r + 1, v + 5) for r, v in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of R programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    for trial, (R, V) in enumerate(sizes):
        # every third case has large logits at a low temperature: exp overflows without the max subtracted
        scale = (0.5, 3.0, 60.0)[trial % 3]
        s = torch.randn(R, V, generator=gen) * scale
        t = torch.randn(R, V, generator=gen) * scale
        T = _temperature(gen) if trial % 3 < 2 else 0.5
        try:
            out, problem = _run_kernel(kernel, s, t, T)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (R={R}, V={V}): the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
        if problem is None:
            expected = kd_kl_ref(s, t, T)
            if torch.isnan(out).any():
                problem = f"{int(torch.isnan(out).sum())} row(s) got NaN or were never written."
            elif not torch.allclose(out, expected, rtol=1e-4, atol=1e-5):
                problem = f"{int((~torch.isclose(out, expected, rtol=1e-4, atol=1e-5)).sum())} of {R} rows differ."
                if trial % 3 == 2:
                    problem += " This is a trial with large logits at a low temperature."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (R={R}, V={V}, T={T}): {problem} "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to kd_kl_ref on {len(sizes)} launches with odd vocabularies."))
