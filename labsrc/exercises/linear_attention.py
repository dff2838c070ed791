"""Checks for the exercises of the linear-attention chapter (linear attention, Performer, Lightning, Gated
DeltaNet).

Each check calls the student's function on seeded random cases and compares it with :mod:`labsrc.linear_attention`
or with a run of the chapter's own recurrence; it prints ``passed``, what is wrong (with a hint), or ``not solved
yet``. Expected answers are computed here, never printed.

* :func:`check_association_costs` -- ``fn(T, d, dv)``: the FLOPs of ``(phi(Q) phi(K)^T) V`` and of
  ``phi(Q) (phi(K)^T V)`` (non-causal, the two matrix products only, a multiply-add counted as 2 FLOPs).
* :func:`check_read_after_two_writes` -- ``fn(beta1, beta2, g, key_norm)``: the delta rule's read of a key
  written twice, derived in closed form and compared with the recurrence run on it.
* :func:`check_chunked_attention` -- ``fn(q, k, v, g, chunk)``: chunked linear attention with a per-token decay,
  the fix of a given function whose carried-in state is decayed wrongly.
* :func:`check_features_needed` -- ``fn(q, k, v, bound)``: a number of positive random features, chosen by
  measuring, whose FAVOR+ estimate meets an error bound while a quarter as many do not; the check re-runs the
  measurement on its own projections at the answer and at a quarter of it.
* :func:`check_recurrent_kernel` -- a ``@triton.jit`` kernel for causal linear attention with decay, one
  program per (batch x head) holding the state in registers, launched under the interpreter on odd sizes.
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import linear_attention as la, runtime
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (NOT_SOLVED, PASSED, Result, _report, check_function, exercise, hidden, randint,
                                   refuse_library)

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["check_association_costs", "check_read_after_two_writes", "check_chunked_attention",
           "check_features_needed", "check_recurrent_kernel", "read_measurement", "decayed_attention_reference"]


def _refuse(name, fn, forbidden, hint, args):
    return refuse_library(name, fn, forbidden, hint, owner="labsrc.linear_attention", args=args)


# ----------------------------------------------------------------------------------------------- costs

def _cost_inputs(gen):
    return randint(gen, 16, 70000), randint(gen, 8, 256), randint(gen, 8, 256)


def _cost_reference(T, d, dv):
    return (2 * T * T * d + 2 * T * T * dv, 4 * T * d * dv)


@exercise
def check_association_costs(fn) -> Result:
    """Check ``fn(T, d, dv) -> (quadratic_flops, linear_flops)``."""
    name = "cost of the two association orders"
    hint = "write down the shapes of both products of each order, and count a multiply-add as the task does."
    seed, trials = seed_for(41), trials_for(8)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        args = _cost_inputs(gen)
        try:
            got = fn(*args)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        want = _cost_reference(*args)
        ok = (isinstance(got, (tuple, list)) and len(got) == 2
              and all(isinstance(x, numbers.Real) and math.isclose(float(x), w, rel_tol=1e-9)
                      for x, w in zip(got, want)))
        if not ok:
            if isinstance(got, (tuple, list)) and len(got) == 2:
                wrong = [label for x, w, label in zip(got, want, ("the quadratic order", "the linear order"))
                         if not (isinstance(x, numbers.Real) and math.isclose(float(x), w, rel_tol=1e-9))]
                which = f": {' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not the right count."
            else:
                which = ": return a pair of numbers."
            return failed(name, f"trial {trial + 1} with T, d, dv = {args}{which} Hint: {hint}")
    return _report(Result(name, PASSED, "right on all the check's random sizes."))


# --------------------------------------------------------------------------------- read after two writes

def read_measurement(beta1, beta2, g, key_norm, K=6):
    """What the gated delta rule reads back for key ``k`` (``|k| = key_norm``) after two writes of that key,
    ``(k, a)`` with strength ``beta1``, then ``(k, b)`` with strength ``beta2`` and log-decay ``g``, from an empty
    state: run with :func:`labsrc.linear_attention.gated_delta_rule_recurrent` in float64, with ``a`` and ``b``
    the two unit vectors of a two-column value, so that the read's two entries are the coefficients of ``a`` and
    of ``b``. Returns ``(coef_a, coef_b)``."""
    k = torch.zeros(K, dtype=torch.float64)
    k[0], k[-1] = 0.6, 0.8                       # a unit key, then scaled
    k = k * key_norm
    keys = torch.stack([k, k])[None, :, None]   # (1, 2, 1, K)
    values = torch.eye(2, dtype=torch.float64)[None, :, None]
    gates = torch.tensor([0.0, g], dtype=torch.float64)[None, :, None]
    betas = torch.tensor([beta1, beta2], dtype=torch.float64)[None, :, None]
    _, state = la.gated_delta_rule_recurrent(keys, keys, values, gates, betas, output_final_state=True)
    read = k @ state[0, 0]
    return float(read[0]), float(read[1])


def _read_inputs(gen):
    beta1, beta2 = float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen))
    g = -float(torch.rand(1, generator=gen)) * 2
    key_norm = (1.0, 0.5 + float(torch.rand(1, generator=gen)) * 1.5)[randint(gen, 0, 1)]
    return beta1, beta2, g, key_norm


def _read_problem(fn, got, want, args) -> str:
    """Which coefficient is wrong on this case."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(x, numbers.Real) for x in got)):
        return "return a pair of numbers (coef_a, coef_b)."
    wrong = [name for name, x, w in zip(("coef_a", "coef_b"), got, want)
             if not math.isclose(float(x), w, rel_tol=1e-9, abs_tol=1e-12)]
    return f"{' and '.join(wrong)} {'differs' if len(wrong) == 1 else 'differ'} from the recurrence's read."


@exercise
def check_read_after_two_writes(fn) -> Result:
    """Check ``fn(beta1, beta2, g, key_norm) -> (coef_a, coef_b)``: the delta rule's read of key ``k`` after
    writing ``(k, a)`` with ``beta1`` into an empty state, then ``(k, b)`` with ``beta2`` after a decay
    ``exp(g)``, as the coefficients of ``a`` and ``b``; ``key_norm`` is ``|k|``. The truth is measured by running
    the chapter's recurrence."""
    name = "the read after two writes of one key"
    hint = ("apply the update twice by hand on the failing case: first with a unit key and no decay, then with "
            "each in turn.")
    refused = _refuse(name, fn, (la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked, read_measurement),
                      hint, _read_inputs(torch.Generator().manual_seed(42)))
    if refused is not None:
        return refused
    trials = trials_for(8)
    gen = torch.Generator().manual_seed(seed_for(42))
    for trial in range(trials):
        args = _read_inputs(gen)
        try:
            got = fn(*args)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        want = read_measurement(*args)
        ok = (isinstance(got, (tuple, list)) and len(got) == 2
              and all(isinstance(x, numbers.Real) and math.isclose(float(x), w, rel_tol=1e-9, abs_tol=1e-12)
                      for x, w in zip(got, want)))
        if not ok:
            shown = ", ".join(f"{n} = {v:.3g}" for n, v in zip(("beta1", "beta2", "g", "key_norm"), args))
            return failed(name, f"trial {trial + 1} ({shown}): {_read_problem(fn, got, want, args)} "
                                f"Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the recurrence's read on all the check's random cases."))


# --------------------------------------------------------------------------- chunked attention, debugged

def decayed_attention_reference(q, k, v, g, chunk=None):
    """Causal linear attention with a per-token decay, one token at a time in float64: ``S <- exp(g_t) S +
    k_t v_t^T`` and ``o_t = S^T q_t``; ``q, k (T, K)``, ``v (T, V)``, ``g (T,)`` (``chunk`` is the answer's own
    choice and changes nothing)."""
    S = torch.zeros(k.shape[1], v.shape[1], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        S = torch.exp(g[t].double()) * S + torch.outer(k[t].double(), v[t].double())
        out.append(q[t].double() @ S)
    return torch.stack(out).to(v.dtype)


def _chunked_inputs(gen):
    T, K, V = randint(gen, 5, 40), randint(gen, 2, 8), randint(gen, 1, 6)
    q, k = (torch.randn(T, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen) * 1.5 + 0.1)
    return q, k, v, g, randint(gen, 1, 12)


def _explaining_chunked(fn):
    """``explain``: the chunk of the first wrong token (where the case breaks, not why)."""
    def explain(got, expected, q, k, v, g, chunk) -> str:
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return ""
        bad = ~torch.isclose(got, expected, rtol=1e-9, atol=1e-10)
        t = int(bad.any(1).nonzero()[0])
        return f"The first wrong token is {t}, in chunk {t // chunk}."
    return explain


@exercise
def check_chunked_attention(fn) -> Result:
    """Check ``fn(q, k, v, g, chunk) -> o (T, V)``: causal linear attention with a per-token log-decay ``g (T,)``
    for one head, computed chunk by chunk (``q, k (T, K)``, ``v (T, V)``, float64), against the token-by-token
    recurrence."""
    name = "chunked linear attention with decay"
    hint = ("run your function and a token-by-token loop on the failing sizes, with and without decay and with "
            "one chunk or several, and write the recurrence out for the first wrong token.")
    refused = _refuse(name, fn, (la.lightning_attention, la.gated_delta_rule_chunked, decayed_attention_reference),
                      hint, _chunked_inputs(torch.Generator().manual_seed(43)))
    if refused is not None:
        return refused
    return check_function(name, fn, decayed_attention_reference, _chunked_inputs, trials=8, seed=43, rtol=1e-9,
                          atol=1e-10, hint=hint, explain=_explaining_chunked(fn))


# ----------------------------------------------------------------------------------- features needed
FEATURE_PROJECTIONS = 32
"""How many random projections the check averages FAVOR+'s error over, at each number of features."""
FEATURE_SLACK = 1.3
"""How far past the bound the check's own average may lie at the chosen number of features (a factor): the
student's projections are not the check's, so an answer right at the edge may measure a little past it here."""


def _mean_favor_error(q, k, v, m, seed) -> float:
    """The measurement: FAVOR+'s mean absolute error with ``m`` positive orthogonal features against exact
    non-causal softmax attention, averaged over :data:`FEATURE_PROJECTIONS` projections drawn from ``seed``."""
    d = q.shape[-1]
    exact = la.softmax_attention(q, k, v, causal=False)
    gen = torch.Generator().manual_seed(seed)
    errors = [float((la.favor_attention(q, k, v, la.orthogonal_projection(m, d, gen, dtype=torch.float64),
                                        "positive") - exact).abs().mean()) for _ in range(FEATURE_PROJECTIONS)]
    return sum(errors) / len(errors)


def _features_case(gen):
    """Random queries, keys and values, and a bound that some number of features between 12 and 200 meets on
    average: the bound is the check's measured error at that number."""
    T, d = randint(gen, 16, 48), (8, 16)[randint(gen, 0, 1)]
    temp = (0.5, 0.8, 1.0)[randint(gen, 0, 2)]
    q = torch.randn(1, T, 1, d, generator=gen, dtype=torch.float64) * temp
    k = torch.randn(1, T, 1, d, generator=gen, dtype=torch.float64) * temp
    v = torch.randn(1, T, 1, 4, generator=gen, dtype=torch.float64)
    m_star = int(round(math.exp(math.log(12) + float(torch.rand(1, generator=gen)) * math.log(200 / 12))))
    seed = randint(gen, 0, 10 ** 6)
    return q, k, v, _mean_favor_error(q, k, v, m_star, seed), seed


@exercise
def check_features_needed(fn) -> Result:
    """Check ``fn(q, k, v, bound) -> m``: a number of positive random features for which FAVOR+'s mean absolute
    error against exact non-causal softmax attention, averaged over random orthogonal projections, meets
    ``bound`` (within :data:`FEATURE_SLACK`), while a quarter as many do not: the measurement re-run here, on the
    check's own projections, at the answer and at a quarter of it (the error falls like ``1 / sqrt(m)``, so a
    quarter of the features roughly doubles it: the window leaves room for the noise of the student's own
    projections). ``q, k (1, T, 1, d)``, ``v (1, T, 1, 4)``, float64."""
    name = "random features under an error bound"
    hint = ("measure the failing case yourself, at the answer and at a quarter of it, averaging over several "
            "projections, and ask how the error falls as features are added.")
    refused = refuse_library(name, fn, (_mean_favor_error,), hint, owner="the checker")
    if refused is not None:
        return refused
    trials = trials_for(3)
    gen = torch.Generator().manual_seed(seed_for(44))
    for trial in range(trials):
        q, k, v, bound, seed = _features_case(gen)
        where = f"trial {trial + 1} (T={q.shape[1]}, d={q.shape[-1]}, bound={bound:.4g})"
        try:
            got = fn(q.clone(), k.clone(), v.clone(), bound)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        got = got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
        if isinstance(got, bool) or not isinstance(got, numbers.Integral) or not 1 <= got <= 4096:
            return failed(name, f"{where}: return a number of features, a whole number from 1 to "
                                f"4096. Hint: {hint}")
        meets = _mean_favor_error(q, k, v, int(got), seed) <= FEATURE_SLACK * bound
        quarter_fails = got < 4 or _mean_favor_error(q, k, v, int(got) // 4, seed) > bound
        if not (meets and quarter_fails):
            return failed(name, f"{where}: the answer is not a number of features that meets "
                                f"the bound while a quarter as many do not, on the check's "
                                f"projections. Hint: {hint}")
    return _report(Result(name, PASSED, "the measurement agrees on all the check's cases."))


# ------------------------------------------------------------------------------------------ the kernel

_KERNEL_SIZES = ((7, 5, 3), (1, 16, 16), (13, 20, 9), (30, 3, 17), (9, 33, 2))   # (T, K, V)
_GUARD = 64


def _guarded(values):
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _kernel_case(gen, size):
    T, K, V = size
    BH = randint(gen, 1, 3)
    q = torch.randn(BH, T, K, generator=gen)
    k = torch.randn(BH, T, K, generator=gen) / math.sqrt(K)
    v = torch.randn(BH, T, V, generator=gen)
    decay = 0.5 + 0.5 * float(torch.rand(1, generator=gen))
    return q, k, v, decay


@exercise
def check_recurrent_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, K, V, decay, BLOCK_K, BLOCK_V)``
    launched on grid ``(BH,)``: program ``i`` reads ``q, k (BH, T, K)`` and ``v (BH, T, V)`` (contiguous
    float32) at row ``i``, keeps ``S (K, V)`` in registers, and for ``t = 0 .. T-1`` does
    ``S = decay * S + k_t v_t^T`` and writes ``o_t = q_t^T S`` into ``o (BH, T, V)``. ``BLOCK_K``, ``BLOCK_V`` are
    the next powers of two >= ``K``, ``V``. Compared with :func:`labsrc.linear_attention.linear_attention_recurrent`.
    Without Triton the check says it is skipped."""
    name = "recurrent linear attention kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'The kernel'. A first wrong token of 0 points at the state's first update or the output "
            "sum; a later one at what the state carries from one step to the next; writes outside or never "
            "made point at the masks.")
    seed, sizes = 45, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed_for(seed), sizes + tuple((t + 2, k + 3, v + 1) for t, k, v in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of BH programs")) is not None:
        return _report(unlaunchable)
    import triton

    gen = torch.Generator().manual_seed(seed)
    for trial, size in enumerate(sizes):
        q, k, v, decay = _kernel_case(gen, size)
        T, K, V = size
        out, store = _guarded(torch.full_like(v, float("nan")))
        try:
            kernel[(q.shape[0],)](q, k, v, out, T, K, V, decay, BLOCK_K=triton.next_power_of_2(K),
                                  BLOCK_V=triton.next_power_of_2(V))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, f"trial {trial + 1} (T={T}, K={K}, V={V})", hint))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        problem = None
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor (a store without its mask?)."
        else:
            lam = torch.full((1,), decay, dtype=torch.float64)
            as_bthk = [x.double().permute(1, 0, 2)[None] for x in (q, k, v)]   # (1, T, BH, D)
            want, _ = la.linear_attention_recurrent(*as_bthk, lam.expand(q.shape[0]).clone())
            want = want[0].permute(1, 0, 2).float()
            if torch.isnan(out).any():
                problem = f"{int(torch.isnan(out).sum())} output element(s) were never written."
            elif not torch.allclose(out, want, rtol=1e-4, atol=1e-4):
                bad = ~torch.isclose(out, want, rtol=1e-4, atol=1e-4)
                _, t, _ = (int(i) for i in bad.nonzero()[0])
                problem = f"{int(bad.sum())} of {bad.numel()} outputs differ; the first at token {t}."
        if problem:
            return failed(name, f"trial {trial + 1} (T={T}, K={K}, V={V}): {problem} "
                                f"Hint: {hint}")
    return _report(Result(name, PASSED, "equal to linear_attention_recurrent on all the check's launches."))
