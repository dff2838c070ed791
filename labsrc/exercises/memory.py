"""Checks for the exercises of the memory-and-retrieval chapter.

* :func:`check_memory_topk_merge` -- ``fn(scores_a, ids_a, scores_b, ids_b, k)``: merge two partial searches
  (best first) into the best ``k`` of both, a tie going to the lower id.
* :func:`check_overlap_chunks` -- ``fn(n, size, overlap)``: chunk spans with overlap, so that a short fact is
  never split (:func:`labsrc.memory.chunk_spans`).
* :func:`check_gated_memory_mix` -- ``fn(q, k_local, v_local, mem_k, mem_v, gate)``: the Memorizing
  Transformer's two softmaxes and gate in plain PyTorch.
* :func:`check_retrieved_rows_kernel` -- a ``@triton.jit`` kernel for attention over the rows retrieved for each
  query, launched by the check under Triton's interpreter and compared with the reference.

Each check compares with :mod:`labsrc.memory` on seeded random cases and refuses an answer that calls the
library function the exercise asks for. Expected answers are never printed.
"""
from __future__ import annotations

import math

import torch

from labsrc import memory, runtime
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _report,
                                   check_function, exercise, hidden, randint, refuse_library, tolerance)
from labsrc.kernels import memory as kmem

__all__ = ["check_memory_topk_merge", "check_overlap_chunks", "check_gated_memory_mix",
           "check_retrieved_rows_kernel"]


# ------------------------------------------------------------------------------------------ top-k merge
def _search(gen, m, k):
    """A partial search: ``k`` best-first scores (small integers, so ties happen) with distinct ids."""
    scores = torch.randint(-3, 4, (m, k), generator=gen).float()
    ids = torch.stack([torch.randperm(60, generator=gen)[:k] for _ in range(m)])
    # best first, and among equal scores the lower id first (what a search returns)
    order = torch.argsort(ids, 1)
    scores, ids = scores.gather(1, order), ids.gather(1, order)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return scores.gather(1, order), ids.gather(1, order)


def _merge_inputs(gen):
    m = randint(gen, 1, 4)
    sa, ia = _search(gen, m, randint(gen, 1, 6))
    sb, ib = _search(gen, m, randint(gen, 1, 6))
    ib = ib + 100                                  # the second shard's rows have other ids
    return sa, ia, sb, ib, randint(gen, 1, 14)


def _merge_reference(sa, ia, sb, ib, k):
    return torch.cat(memory.topk_merge(sa, ia, sb, ib, k), 1)


def _explain_merge(got, expected, sa, ia, sb, ib, k) -> str:
    """How a merged list is off: its length (k may exceed the results), its order, or a tie broken wrongly."""
    held = sa.shape[1] + sb.shape[1]
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"This trial asks for k = {k} of the {held} results the two searches hold."
    n = expected.shape[1] // 2
    scores, ids = got[:, :n], got[:, n:]
    if (scores[:, 1:] > scores[:, :-1]).any():
        return "Your scores are not best first."
    wrong = (got != expected).nonzero()
    row, col = int(wrong[0, 0]), int(wrong[0, 1]) % n
    if torch.equal(scores[row], expected[row, :n]):
        return f"The scores are right; in row {row}, position {col}, equal scores are in the wrong order."
    return f"Row {row}, position {col} holds the wrong result."


@exercise
def check_memory_topk_merge(fn) -> Result:
    """Check ``fn(scores_a, ids_a, scores_b, ids_b, k) -> (scores, ids)``: the best ``min(k, ka + kb)`` of the
    two partial searches, best first, a tie going to the lower id."""
    name = "top-k merge of two partial searches"
    hint = ("re-read the task of Exercise 1 (the order of the results and how a tie is broken) and merge the "
            "failing trial's two searches by hand.")
    refused = refuse_library(name, fn, (memory.topk_merge,), hint, owner="labsrc.memory",
                             args=_merge_inputs(torch.Generator().manual_seed(41)))
    if refused is not None:
        return refused

    def answer(*args):
        got = fn(*args)
        if not (isinstance(got, tuple) and len(got) == 2):
            return got
        return torch.cat([torch.as_tensor(got[0]).float(), torch.as_tensor(got[1]).float()], 1)

    return check_function(name, answer, lambda *a: _merge_reference(*a).float(), _merge_inputs, trials=10,
                          seed=41, rtol=0, atol=0, hint=hint, explain=_explain_merge)


# ------------------------------------------------------------------------------------------ chunking
def _chunk_inputs(gen):
    size = randint(gen, 1, 70)
    return randint(gen, 0, 400), size, randint(gen, 0, size - 1)


@exercise
def check_overlap_chunks(fn) -> Result:
    """Check ``fn(n, size, overlap) -> list of (start, end)``: spans of ``size`` tokens from 0 in steps of
    ``size - overlap``, the last one ending at ``n`` (a single span ``(0, n)`` when ``n <= size``; none
    when ``n == 0``)."""
    name = "chunks with overlap"
    hint = ("re-read 'RAG: chunks, BM25 and dense retrieval' and the rule in the task, and lay out the spans of "
            "the case named above by hand.")
    refused = refuse_library(name, fn, (memory.chunk_spans,), hint, owner="labsrc.memory",
                             args=_chunk_inputs(torch.Generator().manual_seed(42)))
    if refused is not None:
        return refused
    seed, trials = 42, 25
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, 2 * trials
    gen = torch.Generator().manual_seed(seed)
    cases = [(0, 5, 2), (5, 5, 0), (6, 5, 4)] + [_chunk_inputs(gen) for _ in range(trials)]
    for n, size, overlap in cases:
        try:
            got = fn(n, size, overlap)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        try:
            got = [(int(s), int(e)) for s, e in got]
        except (TypeError, ValueError):
            return _report(Result(name, FAILED, f"return a list of (start, end) pairs, got {type(got).__name__}. "
                                                f"Hint: {hint}"))
        want = memory.chunk_spans(n, size, overlap)
        if got != want:
            covered = set()
            for s, e in got:
                covered.update(range(s, e))
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            problem = ("some tokens are in no chunk" if covered != set(range(n)) else
                       "a chunk is longer than size" if any(e - s > size for s, e in got) else
                       "the last span does not end at n" if got and got[-1][1] != n else
                       f"you return {len(got)} spans and the rule {len(want)}" if len(got) != len(want) else
                       f"the spans are not the ones the rule gives, from span {first} on (yours: "
                       f"{got[first]})")
            return _report(Result(name, FAILED, f"n={n}, size={size}, overlap={overlap}: {problem}. Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the rule on {len(cases)} cases, edge cases included."))


# ------------------------------------------------------------------------------------------ gated mix
def _mix_inputs(gen):
    B, hkv, group = randint(gen, 1, 2), randint(gen, 1, 2), randint(gen, 1, 3)
    T, K, D = randint(gen, 1, 5), randint(gen, 1, 6), 16 * randint(gen, 1, 3)
    Tk = T + randint(gen, 0, 4)
    H = hkv * group
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    kl, vl = (torch.randn(B, hkv, Tk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    mk, mv = (torch.randn(B, H, T, K, D, generator=gen, dtype=torch.float64) for _ in range(2))
    gate = 2 * torch.randn(H, generator=gen, dtype=torch.float64)
    return q, kl, vl, mk, mv, gate


def _explaining_mix(fn):
    """``explain`` for the gated mix: a very large gate keeps only the memory part, a very negative one only the
    local part, so each is judged on its own."""
    def explain(got, expected, q, kl, vl, mk, mv, gate) -> str:
        said = []
        for g, part in ((50.0, "memory"), (-50.0, "local")):
            full = torch.full_like(gate, g)
            if not torch.allclose(fn(q, kl, vl, mk, mv, full), kmem.knn_memory_attention_ref(q, kl, vl, mk, mv, full),
                                  rtol=1e-9, atol=1e-10):
                said.append(part)
        if not said:
            return "The local part alone and the memory part alone are right: look at the gate's mix."
        parts = " and the ".join(said) + (" parts are" if len(said) == 2 else " part is")
        return f"With the gate pushed all the way, the {parts} wrong."
    return explain


@exercise
def check_gated_memory_mix(fn) -> Result:
    """Check ``fn(q, k_local, v_local, mem_k, mem_v, gate) -> (B, H, T, D)`` against
    :func:`labsrc.kernels.memory.knn_memory_attention_ref` on float64 inputs with GQA and ``Tk >= T``."""
    name = "gated mix of local and memory attention"
    hint = ("re-read 'Two softmaxes and a gate, against one softmax'; the message says whether the local part, "
            "the memory part or their mix is off. The trials use GQA and more keys than queries (Tk >= T).")
    refused = refuse_library(name, fn, (kmem.knn_memory_attention_ref, kmem.knn_memory_attention,
                                        memory.joint_softmax_attention), hint, owner="labsrc.memory",
                             args=_mix_inputs(torch.Generator().manual_seed(43)))
    if refused is not None:
        return refused
    return check_function(name, fn, kmem.knn_memory_attention_ref, _mix_inputs, trials=6, seed=43,
                          rtol=1e-9, atol=1e-10, hint=hint, explain=_explaining_mix(fn))


# ------------------------------------------------------------------------------------------ the kernel
_KERNEL_SIZES = ((3, 5, 16), (1, 1, 16), (4, 7, 24), (2, 16, 40), (5, 3, 64), (2, 13, 20))   # (T, K, D)
_GUARD = 64


def _guarded(values: torch.Tensor):
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _retrieved_reference(q, mk, mv, scale):
    return torch.softmax(torch.einsum("td,tkd->tk", q, mk) * scale, -1).unsqueeze(1).bmm(mv).squeeze(1)


@exercise
def check_retrieved_rows_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(q_ptr, mk_ptr, mv_ptr, out_ptr, scale, K, D, BLOCK_K, BLOCK_D)``
    that computes, for one head, ``out[t] = softmax(scale * mem_k[t] @ q[t]) @ mem_v[t]``: one program per
    query (grid ``(T,)``), ``q``/``out`` contiguous float32 ``(T, D)``, ``mem_k``/``mem_v`` contiguous float32
    ``(T, K, D)``, ``BLOCK_K >= K`` and ``BLOCK_D >= D`` powers of two (``K``, ``D`` constexpr). Sizes are
    odd. Without Triton (macOS, Windows) the check says it is skipped."""
    name = "attention over retrieved rows in Triton"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    import triton

    hint = ("re-read 'The kernel' and follow the query row named above through your kernel; K and D are not "
            "powers of two in most trials, so NaN or writes outside point at the masks.")
    seed, sizes = 44, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((t + 1, k + 2, d) for t, k, d in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of T programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance(torch.float32)
    for trial, (T, K, D) in enumerate(sizes):
        q = torch.randn(T, D, generator=gen)
        mk, mv = torch.randn(T, K, D, generator=gen), torch.randn(T, K, D, generator=gen)
        scale = 1 / math.sqrt(D)
        qg, _ = _guarded(q)
        mkg, _ = _guarded(mk)
        mvg, _ = _guarded(mv)
        out, store = _guarded(torch.full_like(q, float("nan")))
        try:
            kernel[(T,)](qg, mkg, mvg, out, scale, K=K, D=D, BLOCK_K=triton.next_power_of_2(K),
                         BLOCK_D=triton.next_power_of_2(D))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, K={K}, D={D}): the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        problem = None
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor (a lane past D stored without a mask?)."
        elif torch.isnan(out).any():
            problem = f"{int(torch.isnan(out).sum())} output element(s) are NaN or were never written."
        else:
            want = _retrieved_reference(q, mk, mv, scale)
            if not torch.allclose(out, want, rtol=rtol, atol=atol):
                bad = ~torch.isclose(out, want, rtol=rtol, atol=atol)
                problem = f"{int(bad.sum())} of {bad.numel()} elements differ (first in row {int(bad.nonzero()[0, 0])})."
                if torch.allclose(out, _retrieved_reference(q, mk, mv, 1.0), rtol=rtol, atol=atol):
                    problem += " Your outputs are those of scores that were never scaled."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, K={K}, D={D}): {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the reference on {len(sizes)} launches with odd sizes."))
