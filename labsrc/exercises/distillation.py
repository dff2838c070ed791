"""Checks for the exercises of the distillation chapter.

Each check runs the student's answer on several seeded random cases and compares it with what the check computes
itself (from :mod:`labsrc.distillation`, from autograd, or by fitting); it prints ``passed``, what is wrong (with a
hint), or ``not solved yet`` when the function still raises ``NotImplementedError``. Expected answers are
computed here, never printed.

* :func:`check_jsd_fix` -- debugging, ``fn(student_logits, teacher_logits, beta, T) -> float``: GKD's generalized
  JSD with the bug of :func:`jsd_buggy` fixed, against the divergence computed from probabilities.
* :func:`check_reverse_kl_gradient` -- a derivation, ``fn(student_logits, teacher_logits, T) -> (V,)``: the
  gradient of ``T² KL(q_T || p_T)`` (reverse KL, which the chapter does not differentiate) in closed form,
  against autograd.
* :func:`check_fit_acceptance` -- a prediction, ``fn(w, mu1, sd1, mu2, sd2) -> (forward, reverse)``: the
  acceptance ``sum min(p, q)`` of the one-bump students that forward and reverse KL fit to a two-mode teacher,
  against :func:`labsrc.distillation.fit_unimodal`'s fits measured here.
* :func:`check_kd_row_kernel` -- a ``@triton.jit`` kernel that computes the whole KD loss of one token (hard
  and soft terms, padding written as 0), one program per row, launched by the check under Triton's
  interpreter.

A check refuses an answer that calls the :mod:`labsrc.distillation` function that computes what it asks for.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from labsrc import distillation
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (NOT_SOLVED, PASSED, Result, _report, _with_hint, as_number, check_function,
                                   exercise, hidden, randint, refuse_library)

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["jsd_buggy", "check_jsd_fix", "check_reverse_kl_gradient", "GRID", "bimodal_teacher",
           "check_fit_acceptance", "check_kd_row_kernel"]


def _forbidden():
    from labsrc.kernels import distillation as kd
    return (distillation.kd_loss, distillation.soft_kl, distillation.generalized_jsd, distillation.losses._gjsd_per_token, distillation.losses._kl_terms,
            distillation.fit_unimodal, distillation.expected_acceptance, kd.kd_kl, kd.kd_kl_ref, kd.kd_kl_backward_ref)


def _refuse(name, fn, make_inputs, seed, hint, extra=()):
    return refuse_library(name, fn, _forbidden() + tuple(extra), hint, owner="labsrc.distillation",
                          args=make_inputs(torch.Generator().manual_seed(seed)))


def _temperature(gen):
    return (0.5, 1.0, 2.0, 3.0, 5.0)[randint(gen, 0, 4)]


# ------------------------------------------------------------------------------------ GKD's JSD: the bug
def jsd_buggy(student_logits, teacher_logits, beta, T):
    """The exercise's generalized JSD, with its bug: ``(N, V)`` logits, ``0 < beta < 1``, the mean over tokens of
    ``beta KL(p || m) + (1 - beta) KL(q || m)`` for the mixture ``m`` of ``q = softmax(student / T)`` and
    ``p = softmax(teacher / T)``."""
    log_q = F.log_softmax(student_logits / T, -1)
    log_p = F.log_softmax(teacher_logits / T, -1)
    log_m = (1 - beta) * log_q + beta * log_p
    kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
    return float((beta * kl_p + (1 - beta) * kl_q).mean())


def _jsd_ref(s, t, beta, T):
    """Eq. (eq-gjsd) from the probabilities themselves, in float64."""
    q = torch.softmax(s.double() / T, -1)
    p = torch.softmax(t.double() / T, -1)
    m = (1 - beta) * q + beta * p

    def kl(a, b):
        return torch.where(a > 0, a * (a.log() - b.log()), torch.zeros_like(a)).sum(-1)

    return float((beta * kl(p, m) + (1 - beta) * kl(q, m)).mean())


def _jsd_inputs(gen):
    N, V = randint(gen, 2, 8), randint(gen, 3, 50)
    scale = (1.0, 3.0, 8.0)[randint(gen, 0, 2)]
    s = torch.randn(N, V, generator=gen) * scale
    t = torch.randn(N, V, generator=gen) * scale
    return s, t, (0.1, 0.3, 0.5, 0.7, 0.9)[randint(gen, 0, 4)], _temperature(gen)


def _explaining_jsd(fn):
    """``explain``: the invariant a wrong value breaks on this case (the bound every generalized JSD keeps), or
    that it is still the handed-out function's value; never how far it is from the truth."""
    def explain(got, expected, s, t, beta, T) -> str:
        if not isinstance(got, (int, float)):
            return ""
        if math.isclose(got, jsd_buggy(s, t, beta, T), rel_tol=1e-4, abs_tol=1e-7):
            return "On this case your function still returns what the handed-out one returns."
        bound = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        if not -1e-9 <= got <= bound + 1e-6:
            return ("It breaks an invariant: a generalized JSD lies between 0 and the entropy of its two "
                    "weights.")
        return ""
    return explain


@exercise
def check_jsd_fix(fn) -> Result:
    """Check ``fn(student_logits (N, V), teacher_logits (N, V), beta, T) -> float``: eq. (eq-gjsd) averaged over
    tokens, ``0 < beta < 1``, the mixture ``m = (1 - beta) q + beta p``, against a float64 computation from
    the probabilities."""
    name = "GKD's JSD, fixed"
    hint = ("evaluate your function on a student and a teacher that put all their mass on different tokens, "
            "and ask what each KL term can be at most there.")
    refused = _refuse(name, fn, _jsd_inputs, 131, hint, extra=(jsd_buggy,))
    if refused is not None:
        return refused
    return check_function(name, as_number(fn), _jsd_ref, _jsd_inputs, trials=6, seed=131, rtol=1e-4, atol=1e-7,
                          hint=hint, explain=_explaining_jsd(fn))


# ------------------------------------------------------------------------------- the reverse KL's gradient
def _grad_inputs(gen):
    V = randint(gen, 2, 40)
    return torch.randn(V, generator=gen) * 3, torch.randn(V, generator=gen) * 3, _temperature(gen)


def _reverse_grad_ref(s, t, T):
    """The gradient by autograd, in float64."""
    z = s.double().clone().requires_grad_(True)
    log_q = F.log_softmax(z / T, -1)
    log_p = F.log_softmax(t.double() / T, -1)
    (T * T * (log_q.exp() * (log_q - log_p)).sum()).backward()
    return z.grad.float()


def _explain_gradient(got, expected, s, t, T) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    if abs(float(got.double().sum())) > 1e-4:
        return "It breaks an invariant: the gradient of any loss of the student's softmax sums to 0 over the vocabulary."
    return ""


# What computes a gradient for the student: refused by name in the answer's code, and watched for while it runs.
_AUTOGRAD_NAMES = ("enable_grad", "set_grad_enabled", "backward", "grad", "vjp", "jvp", "jacrev", "jacfwd",
                   "jacobian", "autograd", "func")


def autograd_use(fn, args) -> list[str]:
    """How the answer ``fn`` reaches autograd, as sentences (empty when it does not): a name in its code from
    :data:`_AUTOGRAD_NAMES` (``torch.enable_grad``, ``.backward``, ``torch.autograd.grad``, ``torch.func``), or,
    while ``fn(*args)`` runs under ``torch.no_grad()``, grad mode switched back on at any Python or C call (a
    context manager, a helper defined elsewhere), or a result that carries a graph. A core-level guard
    (``labsrc.exercises.core``) would serve every chapter; this one serves the reverse-KL exercise."""
    import sys

    from labsrc.exercises.core import _code_names, _plain

    found = []
    code = getattr(_plain(fn), "__code__", None)
    if code is not None:
        named = sorted(_code_names(code) & set(_AUTOGRAD_NAMES))
        if named:
            found.append(f"its code names {', '.join(named)}")
    switched = []

    def hook(frame, event, arg):
        if not switched and torch.is_grad_enabled():
            switched.append(True)

    out = None
    previous = sys.getprofile()
    with torch.no_grad():
        sys.setprofile(hook)
        try:
            out = fn(*args)
        except Exception:  # noqa: BLE001 - a stub or a wrong answer is reported by the check itself
            pass
        finally:
            sys.setprofile(previous)
    if switched:
        found.append("it switches gradient tracking on while it runs")
    if isinstance(out, torch.Tensor) and (out.requires_grad or out.grad_fn is not None):
        found.append("its result carries an autograd graph")
    return found


@exercise
def check_reverse_kl_gradient(fn) -> Result:
    """Check ``fn(student_logits (V,), teacher_logits (V,), T) -> (V,)``: the gradient of
    ``T² KL(softmax(s/T) || softmax(t/T))`` with respect to ``s``, written in closed form (the check calls the
    function under ``torch.no_grad()``), against autograd."""
    name = "gradient of the reverse KL"
    hint = ("differentiate through the softmax in two steps (the loss with respect to q, then q with respect to "
            "the logits), and compare your gradient with autograd's on a small case in a scratch cell.")
    refused = _refuse(name, fn, _grad_inputs, 132, hint)
    if refused is not None:
        return refused
    used = autograd_use(fn, _grad_inputs(torch.Generator().manual_seed(132)))
    if used:
        return failed(name, _with_hint(
            f"the answer uses autograd ({'; '.join(used)}); this exercise asks for the gradient in closed form.",
            hint))

    def no_autograd(s, t, T):
        with torch.no_grad():
            out = fn(s, t, T)
        if isinstance(out, torch.Tensor) and (out.requires_grad or out.grad_fn is not None):
            return None         # a result with a graph came from autograd: it is no closed form
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    return check_function(name, no_autograd, _reverse_grad_ref, _grad_inputs, trials=6, seed=132, rtol=1e-4,
                          atol=1e-5, hint=hint, explain=_explain_gradient)


# ------------------------------------------------------------------------- forward or reverse: acceptance
GRID = torch.linspace(-6, 6, 121)
"""The 1-D vocabulary of the chapter's mode-seeking figure."""
ACCEPT_ATOL = 0.03
"""How close each predicted acceptance must come to the measured one. The fits search means 0.125 and widths
0.1 apart, which moves an acceptance by about 0.01; a prediction from the right reasoning lands within 0.02."""


def _component(mu: float, sd: float) -> torch.Tensor:
    b = torch.exp(-0.5 * ((GRID.double() - mu) / sd) ** 2)
    return b / b.sum()


def bimodal_teacher(w: float, mu1: float, sd1: float, mu2: float, sd2: float) -> torch.Tensor:
    """The exercise's teacher on :data:`GRID`: ``w`` times a bump (a discretised Gaussian, normalised) at ``mu1``
    of width ``sd1`` plus ``1 - w`` times one at ``mu2`` of width ``sd2``; float64 ``(121,)``, summing to 1."""
    if not 0 < w < 1:
        raise ValueError(f"w must lie in (0, 1), got {w!r}")
    if not (sd1 > 0 and sd2 > 0):
        raise ValueError(f"sd1 and sd2 must be positive, got {sd1!r} and {sd2!r}")
    p = w * _component(mu1, sd1) + (1 - w) * _component(mu2, sd2)
    return p / p.sum()


def _measured_acceptance(w, mu1, sd1, mu2, sd2) -> tuple[float, float]:
    """``sum min(p, q)`` of the best bump under forward (beta = 0) and reverse (beta = 1) KL, fitted by
    :func:`labsrc.distillation.fit_unimodal` over means 0.125 and widths 0.1 apart."""
    p = bimodal_teacher(w, mu1, sd1, mu2, sd2)
    means, stds = torch.linspace(-5, 5, 81), torch.linspace(0.3, 3.5, 33)
    out = []
    for beta in (0.0, 1.0):
        mu, sd = distillation.fit_unimodal(p, GRID, beta, means=means, stds=stds)
        out.append(float(torch.minimum(p, _component(mu, sd)).sum()))
    return out[0], out[1]


def _fit_case(gen):
    """Two modes of unequal weight, at least 4.5 widths apart, about the middle of the grid (a bump that covers
    both then stays inside it)."""
    u = torch.rand(5, generator=gen, dtype=torch.float64).tolist()
    w = round(0.55 + 0.3 * u[0], 2)
    sd1, sd2 = round(0.4 + 0.4 * u[1], 2), round(0.4 + 0.4 * u[2], 2)
    gap = 4.5 * max(sd1, sd2) + 0.5 + u[3]
    mu1 = round(-gap / 2 + u[4] - 0.5, 2)
    mu2 = round(mu1 + gap, 2)
    if randint(gen, 0, 1):      # the heavier mode on the right half the time
        mu1, sd1, mu2, sd2 = -mu2, sd2, -mu1, sd1
        w = round(1 - w, 2)
    return w, mu1, sd1, mu2, sd2


@exercise
def check_fit_acceptance(fn) -> Result:
    """Check ``fn(w, mu1, sd1, mu2, sd2) -> (forward, reverse)``: the predicted acceptance ``sum_v min(p_v,
    q_v)`` of the single bump fitted to :func:`bimodal_teacher` by forward KL and by reverse KL, each within
    ``ACCEPT_ATOL`` of the fits measured here with :func:`labsrc.distillation.fit_unimodal`."""
    name = "forward or reverse KL: which student is accepted more"
    hint = ("re-read 'Mode covering and mode seeking': where does each fitted bump sit and how wide is it, "
            "for this teacher? Then how much of the teacher's mass lies under it?")
    refused = _refuse(name, fn, lambda gen: _fit_case(gen), 133, hint)
    if refused is not None:
        return refused
    trials, seed = trials_for(3), seed_for(133)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        case = _fit_case(gen)
        where = "trial {} (w={}, mu1={}, sd1={}, mu2={}, sd2={})".format(trial + 1, *case)
        try:
            got = fn(*case)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in got)):
            return failed(name, _with_hint(f"{where}: return two numbers, (forward, reverse).",
                                                           hint))
        truth = _measured_acceptance(*case)
        wrong = [f"the {said} student's" for said, mine, real in zip(("forward-KL", "reverse-KL"), got, truth)
                 if not abs(mine - real) <= ACCEPT_ATOL]
        if wrong:
            return failed(name, _with_hint(
                f"{where}: the prediction of {' and '.join(wrong)} acceptance is not within the tolerance of "
                f"the fit the check measures.", hint))
    return _report(Result(name, PASSED, f"both predictions within {ACCEPT_ATOL} of the fits on all the check's teachers."))


# ---------------------------------------------------------------------------- the whole KD loss of a token
# (rows, V): odd vocabularies, rarely powers of two, so that a missing mask shows
_KERNEL_SIZES = ((3, 7), (1, 1), (4, 100), (2, 257), (5, 33), (1, 640))
_GUARD = 64


def _guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _kd_rows_ref(s, t, labels, T, alpha):
    """Each token's ``alpha CE + (1 - alpha) T² KL(p_T || q_T)``, 0 for a label of -100; float64."""
    s, t = s.double(), t.double()
    keep = labels != -100
    ce = F.cross_entropy(s, torch.where(keep, labels, 0), reduction="none")
    log_p, log_q = F.log_softmax(t / T, -1), F.log_softmax(s / T, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return torch.where(keep, alpha * ce + (1 - alpha) * T * T * kl, torch.zeros_like(ce)).float()


def _run_kernel(kernel, s, t, labels, T, alpha):
    import triton  # only reached when Triton is installed

    R, V = s.shape
    sg, _ = _guarded(s)
    tg, _ = _guarded(t)
    out, out_store = _guarded(torch.full((R,), float("nan")))
    # Under the interpreter the kernel runs in NumPy, which warns about what a GPU computes silently
    # (-inf - -inf in a masked lane, exp overflow): the comparison below is what judges the kernel.
    with np.errstate(all="ignore"):
        kernel[(R,)](sg, tg, labels.contiguous(), out, V, 1.0 / T, alpha, BLOCK=triton.next_power_of_2(V))
    guards = torch.cat([out_store[:_GUARD], out_store[-_GUARD:]])
    if not bool(torch.isnan(guards).all()):
        return out, "the kernel wrote outside the output (one value per row, at out_ptr + row)."
    return out, None


def _explain_rows(out, s, t, labels, T, alpha) -> str:
    """Which part of the loss is wrong, judged on the kept and the padded rows and the two terms alone."""
    keep = labels != -100
    want = _kd_rows_ref(s, t, labels, T, alpha)
    if (~keep).any() and not torch.allclose(out[~keep], want[~keep], rtol=1e-4, atol=1e-5):
        return " The rows whose label is -100 should hold 0."
    for a, term in ((1.0, "hard"), (0.0, "soft")):
        if alpha == a:
            return f" This trial has alpha = {a:g}, so only the {term} term counts."
    return ""


@exercise
def check_kd_row_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(s_ptr, t_ptr, y_ptr, out_ptr, V, inv_T, alpha, BLOCK)`` that
    writes, for row ``r`` of the contiguous float32 ``(R, V)`` student and teacher logits and int64 labels
    ``(R,)``, the loss of eq. (eq-kd) for that one token, ``alpha CE(y_r, softmax(s_r)) + (1 - alpha) T²
    KL(softmax(t_r/T) || softmax(s_r/T))`` to ``out[r]``, or 0 when ``y_r = -100`` (grid ``(R,)``, ``BLOCK`` the
    next power of two >= ``V``). Without Triton the check says it is skipped."""
    name = "the KD loss of a token, fused (Triton kernel)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'The KD loss and its T²' and 'The kernel: the soft term in one pass'. Every third trial has "
            "large logits at T = 0.5, where a softmax computed naively overflows; NaN rows or writes outside "
            "point at the masks.")
    seed, sizes = 134, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed_for(seed), sizes + tuple((r + 1, v + 5) for r, v in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of R programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    for trial, (R, V) in enumerate(sizes):
        # every third case has large logits at a low temperature: exp overflows without the max subtracted
        scale = (0.5, 3.0, 60.0)[trial % 3]
        s = torch.randn(R, V, generator=gen) * scale
        t = torch.randn(R, V, generator=gen) * scale
        labels = torch.randint(0, V, (R,), generator=gen)
        labels[torch.rand(R, generator=gen) < 0.3] = -100
        T = _temperature(gen) if trial % 3 < 2 else 0.5
        alpha = (0.0, 0.3, 0.5, 1.0)[randint(gen, 0, 3)]
        try:
            out, problem = _run_kernel(kernel, s, t, labels, T, alpha)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, f"trial {trial + 1} (R={R}, V={V})", hint))
        if problem is None:
            expected = _kd_rows_ref(s, t, labels, T, alpha)
            if torch.isnan(out).any():
                problem = f"{int(torch.isnan(out).sum())} row(s) got NaN or were never written."
            elif not torch.allclose(out, expected, rtol=1e-4, atol=1e-4):
                bad = int((~torch.isclose(out, expected, rtol=1e-4, atol=1e-4)).sum())
                problem = f"{bad} of {R} rows differ.{_explain_rows(out, s, t, labels, T, alpha)}"
                if trial % 3 == 2:
                    problem += " This is a trial with large logits at a low temperature."
        if problem:
            return failed(name, f"trial {trial + 1} (R={R}, V={V}, T={T}, alpha={alpha}): "
                                f"{problem} Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the loss of each token on all the check's launches with odd "
                                        "vocabularies."))
