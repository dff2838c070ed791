"""Checks for the exercises of the linear-attention chapter (linear attention, Performer, Lightning, Gated
DeltaNet).

Each check calls the student's function on seeded random cases and compares it with
:mod:`labsrc.linear_attention`; it prints ``passed``, what is wrong (with a hint), or ``not solved yet``.
Expected answers are computed here, never printed.

* :func:`check_association_costs` -- ``fn(T, d, dv)``: the FLOPs of ``(phi(Q) phi(K)^T) V`` and of
  ``phi(Q) (phi(K)^T V)`` (non-causal, the two matrix products only, a multiply-add counted as 2 FLOPs).
* :func:`check_delta_step` -- ``fn(S, k, v, beta, g)``: one step of the gated delta rule for one head.
* :func:`check_chunk_output` -- ``fn(q, k, v, gamma, S)``: the output of one chunk of decayed linear attention,
  intra-chunk (masked, quadratic) plus inter-chunk (the state carried in).
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
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, NOT_SOLVED, PASSED, Result, _report,
                                   check_function, diagnose_number, exercise, hidden, randint, refuse_library)

__all__ = ["check_association_costs", "check_delta_step", "check_chunk_output", "check_features_needed",
           "check_recurrent_kernel", "delta_step_reference", "chunk_output_reference"]


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
    if hidden():
        seed, trials = 41 + HIDDEN_SEED_OFFSET, 8 * HIDDEN_TRIALS
    else:
        seed, trials = 41, 8
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


# ------------------------------------------------------------------------------------------ delta step

def delta_step_reference(S, k, v, beta, g):
    """One gated delta rule step for one head: ``S (K, V)``, ``k (K,)``, ``v (V,)``, scalars ``beta``, ``g``."""
    out, state = la.gated_delta_rule_recurrent(
        k[None, None, None].double(), k[None, None, None].double(), v[None, None, None].double(),
        torch.tensor([[[g]]], dtype=torch.float64), torch.tensor([[[beta]]], dtype=torch.float64),
        initial_state=S[None, None].double(), output_final_state=True)
    return state[0, 0].to(S.dtype)


def _explaining_delta(fn):
    """``explain`` for the delta step: beta = 0 leaves only the decay, g = 0 only the delta update."""
    def explain(got, expected, S, k, v, beta, g) -> str:
        def right(b_, g_):
            return torch.allclose(fn(S.clone(), k, v, b_, g_), delta_step_reference(S, k, v, b_, g_), rtol=1e-9,
                                  atol=1e-12)
        decay_ok, update_ok = right(0.0, g), right(beta, 0.0)
        if not decay_ok:
            return "With beta = 0 (only the decay acts) your state is already wrong."
        if not update_ok:
            return "The decay alone is right; with g = 0 (no decay) the update is wrong."
        return "The decay alone and the update alone are right; together they are not: look at their order."
    return explain


def _delta_inputs(gen):
    K, V = randint(gen, 2, 12), randint(gen, 1, 9)
    S = torch.randn(K, V, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(K, generator=gen, dtype=torch.float64), dim=0)
    v = torch.randn(V, generator=gen, dtype=torch.float64)
    beta = float(torch.rand(1, generator=gen))
    g = -float(torch.rand(1, generator=gen)) * 2
    return S, k, v, beta, g


@exercise
def check_delta_step(fn) -> Result:
    """Check ``fn(S, k, v, beta, g) -> S_new``: decay by ``exp(g)``, then move the state's prediction for ``k``
    a fraction ``beta`` of the way to ``v``."""
    name = "one gated delta rule step"
    hint = ("re-read 'The delta rule and gating' and 'Why the delta rule fixes the overwrite', then test your "
            "step with beta = 0 and with g = 0 separately.")
    refused = _refuse(name, fn, (la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked), hint,
                      _delta_inputs(torch.Generator().manual_seed(42)))
    if refused is not None:
        return refused
    return check_function(name, fn, delta_step_reference, _delta_inputs, trials=8, seed=42, rtol=1e-9,
                          atol=1e-12, hint=hint, explain=_explaining_delta(fn))


# ---------------------------------------------------------------------------------------- chunk output

def chunk_output_reference(q, k, v, gamma, S):
    """One chunk, one head: ``exp(gamma) * (q S) + lower(q k^T * exp(gamma_i - gamma_j)) v``."""
    n = q.shape[0]
    diff = gamma[:, None] - gamma[None, :]
    lower = torch.ones(n, n, dtype=torch.bool).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()
    return (q * gamma.exp()[:, None]) @ S + ((q @ k.T) * decay) @ v


def _explaining_chunk(fn):
    """``explain`` for the chunk output: S = 0 leaves only the chunk's own tokens, v = 0 only the state."""
    def explain(got, expected, q, k, v, gamma, S) -> str:
        def right(v_, S_):
            return torch.allclose(fn(q, k, v_, gamma, S_), chunk_output_reference(q, k, v_, gamma, S_),
                                  rtol=1e-9, atol=1e-10)
        own_ok, state_ok = right(v, torch.zeros_like(S)), right(torch.zeros_like(v), S)
        if own_ok and not state_ok:
            return "From S = 0 your output is right: the part that reads the carried-in state is wrong."
        if state_ok and not own_ok:
            return "The part that reads the state is right; the chunk's own tokens are wrong."
        return ""
    return explain


def _chunk_inputs(gen):
    n, K, V = randint(gen, 1, 20), randint(gen, 2, 10), randint(gen, 1, 9)
    q, k = (torch.randn(n, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(n, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen) * 3)
    S = torch.randn(K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g.cumsum(0), S


@exercise
def check_chunk_output(fn) -> Result:
    """Check ``fn(q, k, v, gamma, S) -> o (n, V)`` for one chunk of one head: ``q, k (n, K)``, ``v (n, V)``,
    ``gamma (n,)`` the cumulative log decay from the chunk's start (``gamma_i = sum_{j <= i} g_j``), ``S (K, V)``
    the state before the chunk."""
    name = "one chunk's output"
    hint = ("re-read 'Blocks: Lightning attention' and compare your output with a token-by-token recurrence "
            "on a chunk of one token and of two.")
    refused = _refuse(name, fn, (la.lightning_attention, la.gated_delta_rule_chunked), hint,
                      _chunk_inputs(torch.Generator().manual_seed(43)))
    if refused is not None:
        return refused
    return check_function(name, fn, chunk_output_reference, _chunk_inputs, trials=8, seed=43, rtol=1e-9,
                          atol=1e-10, hint=hint, explain=_explaining_chunk(fn))


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
    trials = 4 * (HIDDEN_TRIALS if hidden() else 1)
    gen = torch.Generator().manual_seed(44 + (HIDDEN_SEED_OFFSET if hidden() else 0))
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
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((t + 2, k + 3, v + 1) for t, k, v in sizes)
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
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, K={K}, V={V}): the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
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
