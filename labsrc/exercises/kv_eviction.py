"""Checks for the KV-cache eviction chapter's exercises.

Each check takes the student's function, computes the truth with :mod:`labsrc.kv_eviction` (or with code here),
and prints passed / failed / not solved yet without revealing the answer.

* :func:`check_scores`: the value-aware score A^alpha ||V||^beta R^gamma, on a small hand-sized case and
  on random ones.
* :func:`check_lru_keep` and :func:`check_wrongly_dropped`: LRU on a reasoning chain
  (:func:`reasoning_chain`), and the premise token it drops although the verification step needs it.
* :func:`check_ever_kept`: a prediction, the chance that a token is kept at least once over several
  independent re-evictions, which the chapter then measures by simulation.
* :func:`check_attention_sums_kernel`: a Triton kernel for the statistic every attention-based score needs,
  each key's attention summed over a window of queries, recomputed from the keys and each query row's
  log-sum-exp (the second pass a fused attention kernel forces), run under Triton's interpreter.

Every check refuses an answer whose code calls the :mod:`labsrc.kv_eviction` function the exercise asks the
student to write (:func:`refuses_library`): the point is to write it.
"""
from __future__ import annotations

import numbers

import torch

from labsrc import kv_eviction as ev
from labsrc.exercises.core import (PASSED, Result, _report, fail, seed_for,
                                   check_function, exercise, hidden, launch_failed, not_a_kernel,
                                   refuse_library, skipped_without_triton)

__all__ = ["hand_case", "check_scores", "reasoning_chain", "check_lru_keep", "check_wrongly_dropped",
           "check_ever_kept", "check_attention_sums_kernel", "refuses_library"]


def refuses_library(name: str, fn, forbidden: tuple) -> Result | None:
    """A failed Result when ``fn`` is, or its code refers to, one of the ``forbidden`` objects of
    :mod:`labsrc.kv_eviction` (what the exercise asks for); None when the answer is the student's own
    (:func:`labsrc.exercises.core.refuse_library`)."""
    return refuse_library(name, fn, forbidden, "use torch operations only.", owner="labsrc.kv_eviction")


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
                          atol=1e-6, forbidden=(ev.value_aware_scores, ev.ValueAware, ev.recency),
                          owner="the lab",
                          hint="trial 1 is the hand case of Exercise 1: score it on paper following 'The "
                               "value-aware score, a loop at a time', then compare token by token.")


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


def _last_uses(attn: torch.Tensor, threshold: float, arrival: bool) -> list[int]:
    """Each token's last use (the position of the latest query giving it more than ``threshold``), with its
    arrival counted as a use or not (-1 then for a token no query used)."""
    t, n = attn.shape
    last = [i if arrival else -1 for i in range(n)]
    for row in range(t):
        for i in range(n):
            if float(attn[row, i]) > threshold:
                last[i] = max(last[i], n - t + row)
    return last


def _lru_variant(attn: torch.Tensor, budget: int, threshold: float, *, arrival: bool, newer_wins: bool):
    """The tokens an LRU variant keeps: arrival counted as a use or not, ties to the newer token or not."""
    last = _last_uses(attn, threshold, arrival)
    order = sorted(range(len(last)), key=lambda i: (last[i], i if newer_wins else -i), reverse=True)
    return sorted(order[:budget])


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
                          forbidden=(ev.LRU, ev.make_policy, ev.TokenStats), owner="the lab",
                          hint="re-read 'Why FIFO and LRU drop the premise, and dormant tokens' and write down "
                               "each token's last use for the failing trial by hand.")


def _dropped_reference(attn, future, budget, threshold) -> int:
    keep = _lru_keep_reference(attn, budget, threshold)
    dropped = torch.ones(attn.shape[1], dtype=torch.bool)
    dropped[keep] = False
    return int(torch.argmax(future.masked_fill(~dropped, -1.0)))


@exercise
def check_wrongly_dropped(fn) -> Result:
    """``fn(attn, future, budget, threshold) -> int``: the index of the token LRU drops (see
    :func:`check_lru_keep`) that the future query's attention ``future (N,)`` weighs most. Trial 1 is
    :func:`reasoning_chain`; the others are random histories, each with a future query over all N tokens."""
    chain = reasoning_chain()
    first = [True]

    def make(gen):
        if first[0]:
            first[0] = False
            return chain["attn"], chain["future"], chain["budget"], chain["threshold"]
        attn, budget, threshold = _lru_inputs(gen)
        future = torch.softmax(torch.randn(attn.shape[1], generator=gen) * 2, -1)
        return attn, future, budget, threshold

    def as_index(*args):
        got = fn(*args)
        if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.is_floating_point():
            got = got.item()            # a one-element integer tensor counts as the index it holds
        if isinstance(got, numbers.Integral) and not isinstance(got, bool):
            got = int(got)              # and so does a NumPy integer
        return got

    # an index is right or wrong: the message says neither whether LRU keeps it nor which way the answer lies
    return check_function("token LRU wrongly drops", as_index, _dropped_reference, make, trials=6, rtol=0,
                          atol=0, forbidden=(ev.LRU, ev.make_policy, ev.TokenStats), owner="the lab",
                          hint="re-read 'Why FIFO and LRU drop the premise, and dormant tokens' and run your fixed "
                               "LRU on the failing trial by hand.")


def _prob_inputs(gen: torch.Generator):
    n = int(torch.randint(3, 20, (1,), generator=gen))
    scores = torch.rand(n, generator=gen, dtype=torch.float64) ** 4 * 10      # heavy tail: caps bind
    budget = int(torch.randint(1, n + 1, (1,), generator=gen))
    return scores, budget


def _ever_kept_reference(scores: torch.Tensor, budget: int, rounds: int) -> torch.Tensor:
    return 1.0 - (1.0 - ev.inclusion_probabilities(scores, budget)) ** rounds


def _ever_kept_inputs(gen: torch.Generator):
    scores, budget = _prob_inputs(gen)
    return scores, budget, int(torch.randint(1, 12, (1,), generator=gen))


@exercise
def check_ever_kept(fn) -> Result:
    """``fn(scores, budget, rounds)`` must return, for each token, the probability (float64) that the
    stochastic keep (capped probabilities, systematic sampling) keeps it at least once over ``rounds``
    independent re-evictions of the same scores, each with a fresh draw."""
    # The keep-probabilities of one draw may come from the library (ev.inclusion_probabilities): the
    # prediction is what several independent draws do with them, not the probabilities themselves.
    refused = refuses_library("kept at least once", fn, (ev.retention_frequencies, ev.stochastic_keep))
    if refused is not None:
        return refused
    return check_function("kept at least once", _as(torch.float64)(fn), _ever_kept_reference,
                          _ever_kept_inputs, trials=8, rtol=1e-5, atol=1e-6,
                          forbidden=(ev.retention_frequencies, ev.stochastic_keep), owner="the lab",
                          hint="test your prediction with rounds = 1 first, where it must equal one draw's "
                               "keep-probabilities; then compare it with the simulation after this exercise.")


# ------------------------------------------------------------------------------- the attention-sums kernel
# (W, N, D): windows of one query up to more queries than a key block, key counts that are not multiples of the
# block, head sizes that are not powers of two; and a window as long as the sequence.
_SUM_SIZES = ((3, 17, 5), (1, 9, 8), (6, 40, 12), (4, 4, 3), (5, 23, 16), (2, 70, 7))
_SUM_GUARD = 64   # NaN elements before and after the output: a store outside it shows up


def _sum_case(gen: torch.Generator, size) -> tuple:
    """Queries (W, D), keys (N, D) and the queries' log-sum-exp (W,) under the causal mask, the last query at
    position N - 1; logits are scaled by 1/sqrt(D) and spread wide enough that the row max matters."""
    w, n, d = size
    q = torch.randn(w, d, generator=gen) * 1.5
    k = torch.randn(n, d, generator=gen) * 1.5
    return q, k, _masked_logits(q, k).logsumexp(-1)


def _masked_logits(q: torch.Tensor, k: torch.Tensor, causal: bool = True) -> torch.Tensor:
    w, n = q.shape[0], k.shape[0]
    logits = (q.double() @ k.double().T) / q.shape[1] ** 0.5
    if causal:
        future = torch.arange(n)[None, :] > (n - w + torch.arange(w))[:, None]
        logits = logits.masked_fill(future, float("-inf"))
    return logits


def attention_sums_ref(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Each key's attention summed over the window's queries: (N,) float32."""
    return torch.exp(_masked_logits(q, k) - lse.double()[:, None]).sum(0).float()


@exercise
def check_attention_sums_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(q_ptr, k_ptr, lse_ptr, out_ptr, N, W, D, scale, BLOCK_N, BLOCK_D)``
    that writes, for each of ``N`` keys, its attention summed over a window of ``W`` queries (the last query
    at position ``N - 1``, causal), from contiguous float32 queries ``(W, D)``, keys ``(N, D)`` and the
    queries' log-sum-exp ``(W,)``, one program per ``BLOCK_N`` keys (grid ``cdiv(N, BLOCK_N)``), against
    :func:`attention_sums_ref`. Without Triton (macOS, Windows) the check says it is skipped."""
    name = "attention sums from the log-sum-exp (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'Why the library has no eviction kernel' and compute, for the failing sizes, one key's sum by "
            "hand from the queries that can see it.")
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of cdiv(N, BLOCK_N) programs")) is not None:
        return _report(unlaunchable)
    import triton  # only reached when Triton is installed

    seed, sizes, block_n = seed_for(31), _SUM_SIZES, 8
    if hidden():
        sizes = sizes + tuple((w + 1, n + 5, d + 2) for w, n, d in sizes)
    gen = torch.Generator().manual_seed(seed)
    for trial, size in enumerate(sizes):
        q, k, lse = _sum_case(gen, size)
        w, n, d = size
        store = torch.full((n + 2 * _SUM_GUARD,), float("nan"))
        out = store[_SUM_GUARD:_SUM_GUARD + n]
        where = f"trial {trial + 1} (W={w}, N={n}, D={d})"
        try:
            kernel[(triton.cdiv(n, block_n),)](q, k, lse, out, n, w, d, 1.0 / d ** 0.5,
                                              BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, where, hint))
        expected = attention_sums_ref(q, k, lse)
        problem = None
        if not bool(torch.isnan(torch.cat([store[:_SUM_GUARD], store[-_SUM_GUARD:]])).all()):
            problem = "the kernel wrote outside the output."
        elif torch.isnan(out).any():
            problem = "some outputs are NaN or were never written."
        elif not torch.allclose(out, expected, rtol=1e-4, atol=1e-5):
            bad = ~torch.isclose(out, expected, rtol=1e-4, atol=1e-5)
            where = f"{where}, first at key {int(bad.nonzero()[0])}"
            problem = "the sum differs from the reference there."
        if problem:
            return fail(name, where, problem, hint)
    return _report(Result(name, PASSED, f"equal to the reference on {len(sizes)} launches with odd sizes."))
