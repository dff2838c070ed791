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
* :func:`check_features_needed` -- ``fn(q, k, v, make_proj, candidates, bound)``: the fewest positive random
  features whose FAVOR+ estimate stays under an error bound.
* :func:`check_recurrent_kernel` -- a ``@triton.jit`` kernel for causal linear attention with decay, one
  program per (batch x head) holding the state in registers, launched under the interpreter on odd sizes.
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import linear_attention as la, runtime
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, NOT_SOLVED, PASSED, Result, _report,
                                   check_function, diagnose_number, exercise, hidden, randint, refuse_library)

try:  # issue 44's core: the hidden cases' seed is the one written in the instructor notebook's hidden section
    from labsrc.exercises.core import seed_for, trials_for
except ImportError:  # the core before it: a fixed offset from the visible seed
    def seed_for(visible: int) -> int:
        return visible + HIDDEN_SEED_OFFSET if hidden() else visible

    def trials_for(visible: int) -> int:
        return visible * HIDDEN_TRIALS if hidden() else visible


__all__ = ["check_association_costs", "check_read_after_two_writes", "check_chunked_attention",
           "check_features_needed", "check_recurrent_kernel", "read_measurement", "decayed_attention_reference"]


def _refuse(name, fn, forbidden, hint, args):
    return refuse_library(name, fn, forbidden, hint, owner="labsrc.linear_attention", args=args)


# ----------------------------------------------------------------------------------------------- costs

def _cost_inputs(gen):
    return randint(gen, 16, 70000), randint(gen, 8, 256), randint(gen, 8, 256)


def _cost_reference(T, d, dv):
    return (2 * T * T * d + 2 * T * T * dv, 4 * T * d * dv)


def _cost_scaling(fn, args) -> str:
    """Name the size (T, d or dv) whose doubling moves a wrong count unlike the right one."""
    try:
        got0, want0 = fn(*args), _cost_reference(*args)
        for i, size in enumerate(("T", "d", "dv")):
            doubled = args[:i] + (2 * args[i],) + args[i + 1:]
            got1, want1 = fn(*doubled), _cost_reference(*doubled)
            for g0, g1, w0, w1, order in zip(got0, got1, want0, want1, ("quadratic", "linear")):
                if g0 and not math.isclose(g1 / g0, w1 / w0, rel_tol=1e-6):
                    return (f"; doubling {size} multiplies the {order} order's count by {w1 / w0:g}, yours by "
                            f"{g1 / g0:g}")
    except Exception:  # noqa: BLE001 - an answer that is not a pair of numbers is reported as such
        pass
    return ""


@exercise
def check_association_costs(fn) -> Result:
    """Check ``fn(T, d, dv) -> (quadratic_flops, linear_flops)``."""
    name = "cost of the two association orders"
    hint = ("re-read the task of Exercise 1 on what counts as a FLOP, and write down the shapes of both "
            "products of the wrong order.")
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
            which = ""
            if isinstance(got, (tuple, list)) and len(got) == 2:
                wrong = [label for x, w, label in zip(got, want, ("the quadratic order", "the linear order"))
                         if not (isinstance(x, numbers.Real) and math.isclose(float(x), w, rel_tol=1e-9))]
                factor = "".join(diagnose_number(float(x), w) for x, w in zip(got, want)
                                 if isinstance(x, numbers.Real) and not math.isclose(float(x), w, rel_tol=1e-9))
                which = f" ({' and '.join(wrong)} is wrong{_cost_scaling(fn, args)}).{factor}"
            else:
                which = " (return a pair of numbers)."
            return _report(Result(name, FAILED, f"trial {trial + 1} with T, d, dv = {args}{which} Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} random sizes."))


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
    """Which coefficient is wrong, and which simplification the answer is right under (unit keys, no decay)."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(x, numbers.Real) for x in got)):
        return "return a pair of numbers (coef_a, coef_b)."
    wrong = [name for name, x, w in zip(("coef_a", "coef_b"), got, want)
             if not math.isclose(float(x), w, rel_tol=1e-9, abs_tol=1e-12)]
    said = f"{' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} wrong."
    beta1, beta2, g, key_norm = args
    for changed, what in (((beta1, beta2, 0.0, key_norm), "without decay (g = 0)"),
                          ((beta1, beta2, g, 1.0), "for a unit key")):
        try:
            right = all(math.isclose(float(x), w, rel_tol=1e-9, abs_tol=1e-12)
                        for x, w in zip(fn(*changed), read_measurement(*changed)))
        except Exception:  # noqa: BLE001 - an answer that fails on the simpler case says nothing here
            right = False
        if right:
            return f"{said} Your coefficients are right {what}, so look at the other argument."
    return said


@exercise
def check_read_after_two_writes(fn) -> Result:
    """Check ``fn(beta1, beta2, g, key_norm) -> (coef_a, coef_b)``: the delta rule's read of key ``k`` after
    writing ``(k, a)`` with ``beta1`` into an empty state, then ``(k, b)`` with ``beta2`` after a decay
    ``exp(g)``, as the coefficients of ``a`` and ``b``; ``key_norm`` is ``|k|``. The truth is measured by running
    the chapter's recurrence."""
    name = "the read after two writes of one key"
    hint = ("re-read 'The delta rule and gating' and apply the update twice by hand: first with a unit key and "
            "no decay, then with each in turn.")
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
            return _report(Result(name, FAILED, f"trial {trial + 1} ({shown}): {_read_problem(fn, got, want, args)} "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the recurrence's read on {trials} random cases."))


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
    """``explain``: the chunk of the first wrong token, and whether the answer is right without decay or on a
    single chunk (which separates the decay from what crosses chunks)."""
    def explain(got, expected, q, k, v, g, chunk) -> str:
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return ""
        bad = ~torch.isclose(got, expected, rtol=1e-9, atol=1e-10)
        t = int(bad.any(1).nonzero()[0])
        said = f"The first wrong token is {t}, in chunk {t // chunk}."

        def right(g_, chunk_):
            return torch.allclose(fn(q, k, v, g_, chunk_), decayed_attention_reference(q, k, v, g_), rtol=1e-9,
                                  atol=1e-10)
        if right(torch.zeros_like(g), chunk):
            said += " Without decay (g = 0) your output is right."
        if right(g, q.shape[0]):
            said += " With one chunk holding the whole sequence it is right."
        return said
    return explain


@exercise
def check_chunked_attention(fn) -> Result:
    """Check ``fn(q, k, v, g, chunk) -> o (T, V)``: causal linear attention with a per-token log-decay ``g (T,)``
    for one head, computed chunk by chunk (``q, k (T, K)``, ``v (T, V)``, float64), against the token-by-token
    recurrence."""
    name = "chunked linear attention with decay"
    hint = ("re-read 'Blocks: Lightning attention' and write the recurrence out for the first two tokens of the "
            "second chunk: which decay has the carried-in state seen by the time each of them reads it?")
    refused = _refuse(name, fn, (la.lightning_attention, la.gated_delta_rule_chunked, decayed_attention_reference),
                      hint, _chunked_inputs(torch.Generator().manual_seed(43)))
    if refused is not None:
        return refused
    return check_function(name, fn, decayed_attention_reference, _chunked_inputs, trials=8, seed=43, rtol=1e-9,
                          atol=1e-10, hint=hint, explain=_explaining_chunked(fn))


# ----------------------------------------------------------------------------------- features needed

_CANDIDATES = (4, 8, 16, 32, 64, 128, 256, 512)


def _favor_error(q, k, v, proj):
    ref = la.softmax_attention(q, k, v, causal=False)
    return float((la.favor_attention(q, k, v, proj, "positive") - ref).abs().mean())


def _features_reference(q, k, v, make_proj, candidates, bound):
    for m in candidates:
        if _favor_error(q, k, v, make_proj(m)) < bound:
            return m
    return None


def _features_case(gen):
    T, d = randint(gen, 16, 48), (8, 16)[randint(gen, 0, 1)]
    temp = (0.5, 1.0, 1.5)[randint(gen, 0, 2)]
    q = torch.randn(1, T, 1, d, generator=gen, dtype=torch.float64) * temp
    k = torch.randn(1, T, 1, d, generator=gen, dtype=torch.float64) * temp
    v = torch.randn(1, T, 1, 4, generator=gen, dtype=torch.float64)
    seed = randint(gen, 0, 10 ** 6)

    def make_proj(m, _d=d, _seed=seed):
        return la.orthogonal_projection(m, _d, torch.Generator().manual_seed(_seed + m), dtype=torch.float64)

    errors = [_favor_error(q, k, v, make_proj(m)) for m in _CANDIDATES]
    # a bound between two measured errors, away from both, so rounding cannot flip the answer
    pick = randint(gen, 0, len(errors) - 1)
    bound = errors[pick] * 1.05
    return q, k, v, make_proj, _CANDIDATES, bound


@exercise
def check_features_needed(fn) -> Result:
    """Check ``fn(q, k, v, make_proj, candidates, bound) -> m``: the first ``m`` in ``candidates`` whose FAVOR+
    estimate with positive features and projection ``make_proj(m)`` has a mean absolute error below ``bound``
    against exact softmax attention (non-causal), or None when none does."""
    name = "random features under an error bound"
    hint = ("re-read 'Experiment 1: how many random features does Performer need?' and print, for the failing "
            "case, the error of every candidate as the task defines it (which estimate, against which exact "
            "attention, which mean).")
    trials = trials_for(4)
    gen = torch.Generator().manual_seed(seed_for(44))
    for trial in range(trials):
        case = _features_case(gen)
        try:
            got = fn(*case)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        want = _features_reference(*case)
        if got != want:
            if isinstance(got, numbers.Integral) and want is not None and got < want:
                problem = "your m is too small: its error is not below the bound."
            elif got is None or (isinstance(got, numbers.Integral) and (want is None or got > want)):
                problem = "a smaller m already meets the bound (or none does)."
            else:
                problem = f"expected an m from candidates or None, got {type(got).__name__}."
            return _report(Result(name, FAILED, f"trial {trial + 1}: {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} random cases."))


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
                undecayed, _ = la.linear_attention_recurrent(*as_bthk, torch.ones(q.shape[0], dtype=torch.float64))
                if decay != 1 and torch.allclose(out, undecayed[0].permute(1, 0, 2).float(), rtol=1e-4, atol=1e-4):
                    problem += " Your outputs are those of a state that never decays."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, K={K}, V={V}): {problem} "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to linear_attention_recurrent on {len(sizes)} launches."))
