"""Checks for the KV-cache eviction chapter's exercises.

Each check takes the student's function, computes the truth with :mod:`labsrc.evict` (or with code here),
and prints passed / failed / not solved yet without revealing the answer.

* :func:`check_scores`: the value-aware score A^alpha ||V||^beta R^gamma, on a small hand-sized case and
  on random ones.
* :func:`check_lru_keep` and :func:`check_wrongly_dropped`: LRU on a reasoning chain
  (:func:`reasoning_chain`), and the premise token it drops although the verification step needs it.
* :func:`check_probabilities` and :func:`check_systematic`: the budget correction (capping at 1 and
  redistributing) and the systematic sampler that keeps exactly the budget, including a ``u`` so small that
  ``K - u`` rounds to ``K``.
* :func:`check_ever_kept`: a prediction, the chance that a token is kept at least once over several
  independent re-evictions, which the chapter then measures by simulation.

Every check refuses an answer whose code calls the :mod:`labsrc.evict` function the exercise asks the
student to write (:func:`refuses_library`): the point is to write it.
"""
from __future__ import annotations

import numbers

import torch

from labsrc import evict as ev
from labsrc.exercises.core import (FAILED, PASSED, Result, _call, _report, _with_hint, check_function, exercise,
                                   randint, refuse_library)

__all__ = ["hand_case", "check_scores", "reasoning_chain", "check_lru_keep", "check_wrongly_dropped",
           "check_probabilities", "check_systematic", "check_ever_kept", "refuses_library"]


def refuses_library(name: str, fn, forbidden: tuple) -> Result | None:
    """A failed Result when ``fn`` is, or its code refers to, one of the ``forbidden`` objects of
    :mod:`labsrc.evict` (what the exercise asks for); None when the answer is the student's own
    (:func:`labsrc.exercises.core.refuse_library`)."""
    return refuse_library(name, fn, forbidden, "use torch operations only.", owner="labsrc.evict")


def _as(dtype):
    """Wrap a student's function so that a tensor answer is compared in ``dtype``; errors pass through."""
    def wrap(fn):
        def call(*args):
            out = fn(*args)
            return out.to(dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() == dtype.is_floating_point else out
        return call
    return wrap


def hand_case() -> tuple[torch.Tensor, torch.Tensor]:
    """A case small enough to score on paper: 2 heads, a window of 2 queries, 4 tokens with 2-D values.
    Returns ``(attn (2, 2, 4), values (4, 2))``."""
    attn = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.4, 0.2]],
                         [[0.9, 0.1, 0.0, 0.0], [0.1, 0.1, 0.1, 0.7]]])
    values = torch.tensor([[3.0, 4.0], [0.0, 1.0], [1.0, 1.0], [0.6, 0.8]])
    return attn, values


def _score_inputs(gen: torch.Generator):
    g = int(torch.randint(1, 4, (1,), generator=gen))
    w = int(torch.randint(1, 6, (1,), generator=gen))
    n = int(torch.randint(w, 13, (1,), generator=gen))
    d = int(torch.randint(1, 7, (1,), generator=gen))
    attn = torch.softmax(torch.randn(g, w, n, generator=gen), -1)
    values = torch.randn(n, d, generator=gen)
    alpha, beta, gamma, lam = (float(x) for x in torch.rand(4, generator=gen) * torch.tensor([2.0, 1.0, 1.0, 1.0]))
    return attn, values, alpha, beta, gamma, lam


@exercise
def check_scores(fn) -> Result:
    """``fn(attn, values, alpha, beta, gamma, lam)`` must return the ``(N,)`` value-aware scores
    A_i^alpha * ||V_i||^beta * R_i^gamma with A_i summed over heads and window queries and
    R_i = exp(-lam (N - i) / N), i = 0 for the oldest token. First the hand case, then random cases."""
    first = [True]

    def make(gen):
        if first[0]:
            first[0] = False
            attn, values = hand_case()
            return attn, values, 1.0, 0.5, 0.3, 0.5
        return _score_inputs(gen)

    def reference(attn, values, alpha, beta, gamma, lam):
        return ev.value_aware_scores(attn, values, alpha, beta, gamma, lam)

    refused = refuses_library("value-aware scores", fn, (ev.value_aware_scores, ev.ValueAware, ev.recency))
    if refused is not None:
        return refused
    return check_function("value-aware scores", _as(torch.float32)(fn), reference, make, trials=6, rtol=1e-4,
                          atol=1e-6, explain=_explain_scores,
                          hint="trial 1 is the hand case of Exercise 1: score it on paper following 'The "
                               "value-aware score, a loop at a time', then compare token by token.")


def _explain_scores(got, expected, attn, values, alpha, beta, gamma, lam) -> str:
    """Recognise scores that leave one factor of the rule out (as if its exponent were 0)."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"There is one score per token: {attn.shape[-1]} here."
    for name, exps in (("attention", (0.0, beta, gamma)), ("value-norm", (alpha, 0.0, gamma)),
                       ("recency", (alpha, beta, 0.0))):
        if exps != (alpha, beta, gamma) and torch.allclose(
                got.double(), ev.value_aware_scores(attn, values, *exps, lam).double(), rtol=1e-4, atol=1e-6):
            return f"Your scores equal the rule without its {name} factor."
    return ""


def _explain_keep(got, expected, *args) -> str:
    """Say how a wrong set of kept indices is off (counts and order, never which tokens)."""
    if not isinstance(got, torch.Tensor) or got.dim() != 1:
        return "Return a 1-D tensor of indices."
    items = got.tolist()
    if items != sorted(items):
        return "The indices are not sorted."
    if len(set(items)) != len(items):
        return "An index appears twice."
    if len(items) != len(expected):
        return f"You keep {len(items)} tokens; the budget keeps {len(expected)}."
    extra = len(set(items) - set(expected.tolist()))
    return f"{extra} of the tokens you keep are ones the policy drops."


def reasoning_chain() -> dict:
    """A 16-token reasoning chain and the attention its first 12 decode queries paid.

    Returns a dict with ``labels`` (what each token is), ``attn`` ``(12, 16)`` (query rows, the last at
    position 15; each row is a softmax over the tokens it could see), ``future`` ``(16,)`` (the attention of
    the verification step that comes next), ``budget`` and ``threshold`` (LRU counts a token as used
    when a query gives it more than ``threshold`` of its attention).
    """
    labels = (["premise: a+b=10", "premise: a-b=2", "question: find a^2-b^2"]
              + [f"step 1.{i}" for i in range(4)] + [f"step 2.{i}" for i in range(4)]
              + ["so a=6", "so b=4", "check:", "a^2-b^2 ="] + ["verify"])[:16]
    n, t = 16, 12
    attn = torch.zeros(t, n)
    for row in range(t):
        pos = n - t + row                       # query positions 4..15
        weights = torch.full((pos + 1,), 0.2)
        if pos < 8:                             # the first steps read the premises
            weights[0] += 3.0
            weights[1] += 3.0
            weights[2] += 1.0
        else:                                   # later steps read the steps just before them
            weights[max(pos - 3, 0):pos + 1] += 2.0
        attn[row, : pos + 1] = weights / weights.sum()
    future = torch.full((n,), 0.01)
    future[1] = 0.6                             # verification re-reads a premise
    future[0] = 0.2
    future[12:] += 0.04
    future = future / future.sum()
    return {"labels": labels, "attn": attn, "future": future, "budget": 8, "threshold": 0.1}


def _lru_keep_reference(attn: torch.Tensor, budget: int, threshold: float) -> torch.Tensor:
    stats = ev.TokenStats.from_attention(attn[None], torch.ones(attn.shape[1], 1), threshold=threshold)
    return ev.LRU(threshold=threshold).select(stats, budget)


def _lru_inputs(gen: torch.Generator):
    n = int(torch.randint(6, 15, (1,), generator=gen))
    t = int(torch.randint(1, n + 1, (1,), generator=gen))
    logits = torch.randn(t, n, generator=gen) * 2
    qpos = n - t + torch.arange(t)
    attn = torch.softmax(logits.masked_fill(torch.arange(n)[None] > qpos[:, None], float("-inf")), -1)
    budget = int(torch.randint(1, n, (1,), generator=gen))
    return attn, budget, 0.15


@exercise
def check_lru_keep(fn) -> Result:
    """``fn(attn, budget, threshold)`` with ``attn`` ``(T, N)`` (query rows, the last query at position
    N - 1) must return the sorted int64 indices LRU keeps: the ``budget`` tokens whose last use is latest,
    where a use is a query giving the token more than ``threshold`` attention and a token's arrival counts
    as its first use; ties go to the newer token."""
    chain = reasoning_chain()
    first = [True]

    def make(gen):
        if first[0]:
            first[0] = False
            return chain["attn"], chain["budget"], chain["threshold"]
        return _lru_inputs(gen)

    refused = refuses_library("LRU keep", fn, (ev.LRU, ev.make_policy, ev.TokenStats))
    if refused is not None:
        return refused

    return check_function("LRU keep", _as(torch.int64)(fn), _lru_keep_reference, make, trials=6,
                          explain=_explain_keep,
                          hint="re-read 'Why FIFO and LRU drop the premise, and dormant tokens' and write down "
                               "each token's last use for the failing trial by hand.")


@exercise
def check_wrongly_dropped(answer) -> Result:
    """``answer`` (an int, or a function returning one): the index of the token that LRU drops from
    :func:`reasoning_chain` although the verification step attends it more than any other dropped token."""
    chain = reasoning_chain()
    keep = _lru_keep_reference(chain["attn"], chain["budget"], chain["threshold"])
    dropped = torch.ones(chain["attn"].shape[1], dtype=torch.bool)
    dropped[keep] = False
    future = chain["future"].masked_fill(~dropped, -1.0)
    expected = int(torch.argmax(future))
    name = "token LRU wrongly drops"
    got, unsolved = _call(answer)
    if unsolved is not None:
        unsolved.name = name
        return _report(unsolved)
    section = "re-read 'Why FIFO and LRU drop the premise, and dormant tokens'."
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.is_floating_point():
        got = got.item()            # a one-element integer tensor counts as the index it holds
    if isinstance(got, numbers.Integral) and not isinstance(got, bool):
        got = int(got)              # and so does a NumPy integer
    if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got < len(dropped):
        return _report(Result(name, FAILED, _with_hint(
            f"{got!r} is not a token index of the chain (0 to {len(dropped) - 1}).", section)))
    if got != expected:   # an index is right or wrong: no "too large", which would allow a binary search
        why = (f"LRU keeps token {got}, so it is not dropped" if not dropped[got] else
               f"token {got} is dropped, but the verification step attends another dropped token more")
        return _report(Result(name, FAILED, _with_hint(f"{why}.", section)))
    return _report(Result(name, PASSED))


def _prob_inputs(gen: torch.Generator):
    n = int(torch.randint(3, 20, (1,), generator=gen))
    scores = torch.rand(n, generator=gen, dtype=torch.float64) ** 4 * 10      # heavy tail: caps bind
    budget = int(torch.randint(1, n + 1, (1,), generator=gen))
    return scores, budget


@exercise
def check_probabilities(fn) -> Result:
    """``fn(scores, budget)`` must return keep-probabilities (compared in float64 to float32 precision)
    proportional to ``scores``, capped at
    1 and summing exactly to ``budget`` (cap, then share the remaining budget among the uncapped, repeat)."""
    refused = refuses_library("capped keep probabilities", fn, (ev.inclusion_probabilities,))
    if refused is not None:
        return refused
    return check_function("capped keep probabilities", _as(torch.float64)(fn), ev.inclusion_probabilities,
                          _prob_inputs, trials=8, rtol=1e-5, atol=1e-6, explain=_explain_probabilities,
                          hint="re-read 'Keep-probabilities that really sum to K' and check the three "
                               "properties the task asks for on the failing trial, one at a time.")


def _explain_probabilities(got, expected, scores, budget) -> str:
    """Which property of the keep-probabilities the answer breaks: the cap, the sum, or the proportions."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    g = got.double()
    if (g > 1 + 1e-9).any():
        return f"{int((g > 1 + 1e-9).sum())} probabilities exceed 1."
    if not torch.isclose(g.sum(), torch.tensor(float(budget), dtype=torch.float64), rtol=1e-6):
        return f"They sum to {g.sum().item():.6g}, not to the budget {budget}."
    return "Among the tokens below the cap, the probabilities are not in proportion to the scores."


def _explain_systematic(got, expected, p, u) -> str:
    k = int(round(float(p.sum())))
    if isinstance(got, torch.Tensor) and got.dim() == 1 and got.numel() != k:
        return f"You keep {got.numel()} items for u = {u!r}; the points are K = {k}."
    return _explain_keep(got, expected)


def _systematic_inputs(gen: torch.Generator):
    scores, budget = _prob_inputs(gen)
    p = ev.inclusion_probabilities(scores, budget)
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    return p, u


# Offsets a uniform draw reaches only rarely but a check must cover: u = 0, and u so small that K - u rounds
# to K (where counting points with floor(C - u) alone finds a (K+1)-th point that does not exist).
_EDGE_U = (1e-300, 0.0, 1e-17)


@exercise
def check_systematic(fn) -> Result:
    """``fn(p, u)`` must return the sorted int64 indices chosen by systematic sampling: item i is kept when
    one of the points u, u + 1, ..., u + K - 1 (K = sum p) falls in [C_{i-1}, C_i), C the cumulative sum
    of ``p``. Besides random cases the check tries offsets at the edge of [0, 1)."""
    edges = list(_EDGE_U)

    def make(gen):
        p, u = _systematic_inputs(gen)
        if not edges:
            return p, u
        # Uncapped probabilities (no edge C_i is an exact integer before the last): there the only count
        # that can go wrong at a tiny u is the (K+1)-th point.
        n = randint(gen, 6, 15)
        scores = 1.0 + torch.rand(n, generator=gen, dtype=torch.float64)
        return ev.inclusion_probabilities(scores, randint(gen, 1, 2)), edges.pop(0)

    refused = refuses_library("systematic sampling", fn, (ev.systematic_indices, ev.stochastic_keep))
    if refused is not None:
        return refused
    return check_function("systematic sampling", _as(torch.int64)(fn), ev.systematic_indices, make,
                          trials=8 + len(_EDGE_U), explain=_explain_systematic,
                          hint="re-read systematic sampling in 'Keep-probabilities that really sum to K' and "
                               "draw the failing trial's points on the cumulative sum of p by hand.")


def _ever_kept_reference(scores: torch.Tensor, budget: int, rounds: int) -> torch.Tensor:
    return 1.0 - (1.0 - ev.inclusion_probabilities(scores, budget)) ** rounds


def _ever_kept_inputs(gen: torch.Generator):
    scores, budget = _prob_inputs(gen)
    return scores, budget, int(torch.randint(1, 12, (1,), generator=gen))


def _explain_ever_kept(got, expected, scores, budget, rounds) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    once = ev.inclusion_probabilities(scores, budget)
    if rounds > 1 and torch.allclose(got.double(), once, rtol=1e-5, atol=1e-6):
        return f"Your answer is one draw's probability; this trial re-evicts {rounds} times."
    if (got.double() > 1 + 1e-9).any() or (got.double() < -1e-9).any():
        return "Some of your values are not probabilities (outside [0, 1])."
    return ""


@exercise
def check_ever_kept(fn) -> Result:
    """``fn(scores, budget, rounds)`` must return, for each token, the probability (float64) that the
    stochastic keep (capped probabilities, systematic sampling) keeps it at least once over ``rounds``
    independent re-evictions of the same scores, each with a fresh draw."""
    refused = refuses_library("kept at least once", fn,
                              (ev.inclusion_probabilities, ev.retention_frequencies, ev.stochastic_keep))
    if refused is not None:
        return refused
    return check_function("kept at least once", _as(torch.float64)(fn), _ever_kept_reference,
                          _ever_kept_inputs, trials=8, rtol=1e-5, atol=1e-6, explain=_explain_ever_kept,
                          hint="test your prediction with rounds = 1 first, where it must equal one draw's "
                               "keep-probabilities; then compare it with the simulation after this exercise.")
