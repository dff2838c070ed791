"""Checks for the exercises of the speculative-decoding chapter.

Each check calls the student's function on seeded random cases and compares it with :mod:`labsrc.speculative`;
it prints ``passed``, what is wrong (with a hint), or ``not solved yet``. Expected answers are computed here,
never printed. A check refuses an answer that calls the library function the exercise asks for.

* :func:`check_spec_residual` -- ``fn(p, q)``: the normalised residual ``max(p - q, 0)`` of one row.
* :func:`check_spec_expected_tokens` -- ``fn(alpha, k)``: expected tokens per target call.
* :func:`check_spec_tree_mask` -- ``fn(parents)``: the ancestor-or-self mask of a draft tree.
* :func:`check_spec_cache_keep` -- ``fn(cached, k, n_accepted)``: how many target-cache positions survive a
  verification (the rollback that keeps greedy output identical).
* :func:`check_spec_residual_kernel` -- a ``@triton.jit`` kernel computing the residual distribution, one
  program per row, launched under the interpreter on odd vocabularies.
"""
from __future__ import annotations


import torch

from labsrc import runtime, speculative
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _report,
                                   check_function, exercise, hidden, randint, refuse_library, tolerance)

__all__ = ["check_spec_residual", "check_spec_expected_tokens", "check_spec_tree_mask", "check_spec_cache_keep",
           "check_spec_residual_kernel"]


def _refuse(title, fn, forbidden, hint, args):
    return refuse_library(title, fn, forbidden, hint, owner="labsrc.speculative", args=args)


def _dist(gen, v, sharp):
    return torch.softmax(sharp * torch.randn(v, generator=gen, dtype=torch.float64), -1)


# ------------------------------------------------------------------------------------------- residual
def _residual_inputs(gen):
    v = randint(gen, 2, 40)
    sharp = float(torch.empty(1).uniform_(0.3, 4.0, generator=gen))
    return _dist(gen, v, sharp), _dist(gen, v, sharp)


def _residual_reference(p, q):
    return speculative.residual_distribution(p, q)


def _explain_residual(got, expected, p, q) -> str:
    """Which property of a distribution over the draft's misses the answer breaks."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    g = got.double()
    if (g < -1e-12).any():
        return "It has negative entries: it is not a distribution."
    if not torch.isclose(g.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-6):
        return f"It sums to {g.sum().item():.6g}, not 1."
    covered = (q >= p) & (g > 1e-12)
    if covered.any():
        return (f"It gives probability to token {int(covered.nonzero()[0])}, where the draft already gives at "
                f"least as much as the target.")
    return ""


@exercise
def check_spec_residual(fn) -> Result:
    """``fn(p, q)`` for two float64 distributions ``(V,)`` with ``p != q``: ``max(p - q, 0)`` normalised."""
    name = "residual distribution"
    hint = ("re-read 'Draft, verify, accept or resample' and 'Why the output is exactly the target's', and check "
            "your row against the properties the message names.")
    refused = _refuse(name, fn, (speculative.residual_distribution, speculative._residual), hint,
                      _residual_inputs(torch.Generator().manual_seed(3)))
    if refused is not None:
        return refused
    return check_function(name, fn, _residual_reference, _residual_inputs, trials=6, seed=3, hint=hint,
                          explain=_explain_residual)


# ------------------------------------------------------------------------------------------- E[tokens]
def _tokens_inputs(gen):
    alpha = round(float(torch.rand(1, generator=gen)) * 0.98, 4)
    return alpha, randint(gen, 1, 12)


@exercise
def check_spec_expected_tokens(fn) -> Result:
    """``fn(alpha, k)``: expected tokens one target call emits with window ``k`` and i.i.d. acceptance
    ``alpha`` (accepted drafts plus the token the target adds)."""
    name = "expected tokens per target call"
    hint = ("re-read 'How many tokens per target call' and check your function at the two ends of alpha, where "
            "you can count the tokens of one call without a formula.")
    refused = _refuse(name, fn, (speculative.expected_tokens_per_step, speculative.speedup), hint, (0.6, 4))
    if refused is not None:
        return refused
    return check_function(name, fn, speculative.expected_tokens_per_step, _tokens_inputs, trials=8, seed=4,
                          rtol=1e-9, hint=hint, explain=_explaining_tokens(fn))


def _explaining_tokens(fn):
    """``explain`` for the expected tokens: at alpha = 0 a call emits exactly 1 token."""
    def explain(got, expected, alpha, k) -> str:
        at_zero = fn(0.0, k)
        if not (isinstance(at_zero, (int, float)) and abs(at_zero - 1.0) < 1e-9):
            return f"At alpha = 0 (every draft rejected) your function gives {at_zero!r} tokens per call."
        return ""
    return explain


# ------------------------------------------------------------------------------------------- tree mask
def _tree_inputs(gen):
    n = randint(gen, 1, 14)
    return ([randint(gen, -1, i - 1) for i in range(n)],)


@exercise
def check_spec_tree_mask(fn) -> Result:
    """``fn(parents)`` -> ``(N, N)`` bool tensor, ``[i, j]`` true when node ``j`` is node ``i`` or an ancestor."""
    name = "tree attention mask"
    hint = ("re-read 'The kernel: tree attention', draw the failing trial's tree from its parents list, and "
            "check the entry named above on the drawing.")
    refused = _refuse(name, fn, (speculative.tree_attention_mask,), hint, ([-1, 0, 0, 1],))
    if refused is not None:
        return refused
    return check_function(name, fn, speculative.tree_attention_mask, _tree_inputs, trials=8, seed=5, hint=hint,
                          explain=_explain_tree)


def _explain_tree(got, expected, parents) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    wrong = (got.bool() != expected).nonzero()
    if wrong.numel() == 0:
        return "" if got.dtype == torch.bool else f"Return a bool tensor, not {got.dtype}."
    i, j = (int(x) for x in wrong[0])
    if i == j:
        kind = "itself"
    elif expected[i, j]:
        kind = f"an ancestor of node {i}"
    elif expected[j, i]:
        kind = f"a descendant of node {i}"
    else:
        kind = "on another branch"
    return f"Entry [{i}, {j}] is wrong: node {j} is {kind}."


# ------------------------------------------------------------------------------------------- cache rollback
def _keep_inputs(gen):
    k = randint(gen, 1, 8)
    return randint(gen, 0, 500), k, randint(gen, 0, k)


def _keep_reference(cached, k, n_accepted):
    # the forward appended the newest verified token and k drafts; the accepted drafts stay, the rest go.
    # The token the target emits at the end is not cached yet: it is fed with the next window.
    return cached + 1 + n_accepted


def _explaining_keep(fn):
    """``explain`` for the rollback: compare the answer when no draft and when every draft is accepted."""
    def explain(got, expected, cached, k, n_accepted) -> str:
        said = []
        for n, what in ((0, "no draft is accepted"), (k, "every draft is accepted")):
            if fn(cached, k, n) != _keep_reference(cached, k, n):
                said.append(what)
        return f"Your count is wrong when {' and when '.join(said)}." if said else ""
    return explain


@exercise
def check_spec_cache_keep(fn) -> Result:
    """``fn(cached, k, n_accepted)``: target-cache positions to keep after a verification that started from
    ``cached`` positions and fed the newest verified token plus ``k`` drafts."""
    name = "target cache after rollback"
    hint = ("re-read 'Generation with two caches' and list, for the failing trial, the positions the "
            "verification forward appended and the token each one holds the key of.")
    return check_function(name, fn, _keep_reference, _keep_inputs, trials=10, seed=6, rtol=0.0, atol=0.0,
                          hint=hint, explain=_explaining_keep(fn))


# ------------------------------------------------------------------------------------------- the kernel
_KERNEL_CASES = ((3, 7), (1, 1), (5, 33), (2, 100), (4, 2), (6, 65))
_GUARD = 64


def _guarded(values: torch.Tensor):
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _kernel_inputs(gen, rows, v):
    p = torch.softmax(2 * torch.randn(rows, v, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(rows, v, generator=gen), -1)
    q[0] = p[0]                      # a row where draft and target agree: the residual falls back to p
    return p.contiguous(), q.contiguous()


@exercise
def check_spec_residual_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(p_ptr, q_ptr, out_ptr, V, BLOCK)`` that writes, for each row of
    ``p`` and ``q`` (contiguous float32 ``(R, V)``, one program per row, grid ``(R,)``), the normalised
    residual ``max(p - q, 0) / sum`` into ``out``, or ``p`` itself where that sum is 0 (``p == q``).
    ``BLOCK`` is the next power of two >= ``V``. Without Triton the check says it is skipped."""
    name = "residual-distribution kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read the task of Exercise 5 (row 0 of every trial is a row where draft and target agree) and "
            "the masks of the chapter's kernels; the rows named above are the ones to follow.")
    seed, cases = 7, _KERNEL_CASES
    if hidden():
        seed, cases = seed + HIDDEN_SEED_OFFSET, cases + tuple((r + 1, v + 3) for r, v in cases)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of R programs")) is not None:
        return _report(unlaunchable)
    import triton

    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance(torch.float32)
    for trial, (rows, v) in enumerate(cases):
        p, q = _kernel_inputs(gen, rows, v)
        out, store = _guarded(torch.full_like(p, float("nan")))
        try:
            kernel[(rows,)](p, q, out, v, BLOCK=triton.next_power_of_2(v))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (R={rows}, V={v}): the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        if not bool(torch.isnan(guards).all()):
            return _report(Result(name, FAILED, f"trial {trial + 1} (R={rows}, V={v}): the kernel wrote outside "
                                                f"the output tensor. Hint: {hint}"))
        expected = speculative._residual(p, q)
        if torch.isnan(out).any():
            return _report(Result(name, FAILED, f"trial {trial + 1} (R={rows}, V={v}): "
                                                f"{int(torch.isnan(out).sum())} output element(s) were never "
                                                f"written (or are NaN: a row with p == q?). Hint: {hint}"))
        if not torch.allclose(out, expected, rtol=rtol, atol=atol):
            wrong = ~torch.isclose(out, expected, rtol=rtol, atol=atol)
            rows_bad = wrong.any(1).nonzero().flatten().tolist()
            said = "only row 0, where p == q" if rows_bad == [0] else f"rows {rows_bad[:5]}"
            return _report(Result(name, FAILED, f"trial {trial + 1} (R={rows}, V={v}): {int(wrong.sum())} of "
                                                f"{out.numel()} elements differ from the residual, in {said}. "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"agrees with the reference on {len(cases)} launches."))


