"""Checks for the exercises of the memory-and-retrieval chapter.

* :func:`check_sharded_recall` -- a prediction, ``fn(k, shards, per_shard)``: the expected recall@k of a memory
  whose rows are spread at random over ``shards`` shards when each shard returns only its best ``per_shard``
  rows and the lists are merged. The truth is the exact expectation over the random placement, which the
  notebook's simulation (real searches, then the merge) measures.
* :func:`check_smallest_nprobe` -- an experiment, ``fn(keys, queries, k, nlist, target)``: the smallest
  ``nprobe`` at which a FAISS IVF index (:class:`labsrc.memory.KVMemory`, ``"faiss-ivf"``) reaches recall@k
  ``>= target`` against the exact search; the check measures the recall itself on its own memories.
* :func:`check_fixed_chunks` -- debugging, ``fn(n, size, overlap)``: a chunker whose last chunk splits facts,
  fixed. Judged by the properties a chunker must have (every span inside the document and at most ``size``
  long, every token covered, every run of ``overlap + 1`` tokens whole in some span, no more spans than the
  chapter's rule makes), so any correct fix passes.
* :func:`check_gathered_rows_kernel` -- a ``@triton.jit`` kernel for attention over memory rows gathered by
  their ids (``-1``: not found), the case the chapter's kernel leaves to its caller; launched by the check under
  Triton's interpreter with NaN guard bands and compared with a reference.

Expected answers are never printed.
"""
from __future__ import annotations

import math

import torch

from labsrc import memory
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (NOT_SOLVED, PASSED, Result, _report, check_function, exercise, hidden, randint,
                                   refuse_library, tolerance)

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["check_sharded_recall", "check_smallest_nprobe", "check_fixed_chunks", "check_gathered_rows_kernel"]


# ------------------------------------------------------------------------------------------ sharded recall
def _sharded_recall_ref(k: int, shards: int, per_shard: int) -> float:
    """Exact expected recall@k: the row of global rank r (1..k) comes back iff fewer than ``per_shard`` of the
    r - 1 better rows share its shard, each independently with probability 1 / shards."""
    p = 1.0 / shards
    total = 0.0
    for r in range(1, k + 1):
        better = r - 1
        total += sum(math.comb(better, j) * p ** j * (1 - p) ** (better - j)
                     for j in range(min(per_shard, better + 1)))
    return total / k


def _sharded_inputs(gen):
    k = randint(gen, 1, 48)
    return k, randint(gen, 1, 12), randint(gen, 1, k + 2)


def _explain_sharded(fn):
    def explain(got, expected, k, shards, per_shard) -> str:
        if not 0 <= got <= 1:
            return "A recall is a fraction of the k true rows: it lies in [0, 1]."
        if _as_float(fn, k, 1, per_shard) != 1.0:
            return "With a single shard nothing can be lost, and your prediction for shards = 1 is not 1."
        if _as_float(fn, k, shards, k) != 1.0:
            return "When every shard returns k rows nothing can be lost, and your prediction then is not 1."
        if per_shard < k and _as_float(fn, k, shards, per_shard + 1) < got:
            return "Your prediction falls when each shard returns more rows; it cannot."
        return ""
    return explain


def _as_float(fn, *args):
    """The student's answer as a float (a one-element tensor counts), or NaN when it is not a number."""
    try:
        got = fn(*args)
        return float(got.item() if isinstance(got, torch.Tensor) else got)
    except Exception:  # noqa: BLE001 - an answer that fails on the probe case says nothing here
        return float("nan")


@exercise
def check_sharded_recall(fn) -> Result:
    """Check ``fn(k, shards, per_shard) -> float``: the expected fraction of the exact top ``k`` rows that a
    sharded search returns when every row lands on one of ``shards`` shards uniformly and independently, each
    shard returns its best ``per_shard`` rows, and the merge keeps the best ``k`` of all of them (the memory
    is much larger than ``k``)."""
    name = "recall of a sharded search"
    hint = ("re-read 'A kNN memory' and follow one of the true top-k rows: ask which of the rows better than it "
            "can push it out of its own shard's list. Compare with measure_sharded_recall.")
    refused = refuse_library(name, fn, (memory.topk_merge, memory.recall_at_k), hint, owner="labsrc.memory",
                             args=(8, 4, 2))
    if refused is not None:
        return refused

    def answer(*args):
        got = fn(*args)
        return float(got.item()) if isinstance(got, torch.Tensor) and got.numel() == 1 else got

    return check_function(name, answer, _sharded_recall_ref, _sharded_inputs, trials=12, seed=141, rtol=1e-6,
                          atol=1e-9, hint=hint, explain=_explain_sharded(answer))


# ------------------------------------------------------------------------------------------ IVF: choose nprobe
def _ivf_memory(seed: int, n: int, dim: int, clusters: int, noise: float, n_queries: int = 48):
    """Keys and queries drawn around ``clusters`` random centres (attention keys are clustered too)."""
    gen = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(clusters, dim, generator=gen)
    keys = centers[torch.randint(0, clusters, (n,), generator=gen)] + noise * torch.randn(n, dim, generator=gen)
    queries = centers[torch.randint(0, clusters, (n_queries,), generator=gen)]
    return keys, queries + noise * torch.randn(n_queries, dim, generator=gen)


def _recall_by_nprobe(keys, queries, k: int, nlist: int) -> list[float]:
    """Recall@k of one trained ``faiss-ivf`` memory at nprobe = 1 .. nlist (index i: nprobe i + 1)."""
    exact = memory.KVMemory(keys.shape[1])
    exact.add(keys, keys)
    _, truth = exact.search_ids(queries, k)
    ivf = memory.KVMemory(keys.shape[1], "faiss-ivf", nlist=nlist, nprobe=1)
    ivf.add(keys, keys)
    ivf.search_ids(queries, k)                   # trains the index once; below only nprobe changes
    recalls = []
    for nprobe in range(1, nlist + 1):
        ivf._index.nprobe = nprobe
        recalls.append(memory.recall_at_k(ivf.search_ids(queries, k)[1], truth))
    return recalls


# (seed, rows, dim, clusters, noise, k, nlist, target): more clusters than cells, so a query's neighbours
# straddle cells and recall climbs gradually with nprobe
_IVF_CASES = ((1401, 2048, 24, 512, 1.0, 16, 32, 0.92), (1402, 3000, 32, 96, 1.5, 8, 48, 0.975))
# Each target lies a few hits away from the recall at the answer and at the nprobe below it, so the answer does
# not hinge on one query's rounding.


def _random_ivf_case(gen) -> tuple:
    """A clustered memory like those of ``_IVF_CASES``, with a target halfway between the recalls at two
    neighbouring nprobe whose recalls differ by at least three hits (so the answer does not hinge on rounding)."""
    while True:
        seed, n, dim = randint(gen, 0, 10 ** 6), randint(gen, 1500, 3000), (16, 24, 32)[randint(gen, 0, 2)]
        clusters, noise = randint(gen, 64, 800), (1.0, 1.2, 1.5)[randint(gen, 0, 2)]
        k, nlist = (8, 12, 16)[randint(gen, 0, 2)], (24, 32, 40)[randint(gen, 0, 2)]
        keys, queries = _ivf_memory(seed, n, dim, clusters, noise)
        recalls = _recall_by_nprobe(keys, queries, k, nlist)
        hit = 1 / (queries.shape[0] * k)
        steps = [p for p in range(2, nlist + 1) if recalls[p - 1] - recalls[p - 2] >= 3 * hit and recalls[p - 1] < 1]
        if steps:
            p = steps[randint(gen, 0, len(steps) - 1)]
            return seed, n, dim, clusters, noise, k, nlist, round((recalls[p - 1] + recalls[p - 2]) / 2, 6)


@exercise
def check_smallest_nprobe(fn) -> Result:
    """Check ``fn(keys, queries, k, nlist, target) -> int``: the smallest ``nprobe`` at which
    ``memory.KVMemory(dim, "faiss-ivf", nlist=nlist, nprobe=nprobe)`` holding ``keys`` returns, for
    ``queries``, at least a fraction ``target`` of the exact top ``k`` (recall@k as ``memory.recall_at_k``
    counts it). The check measures recall at every nprobe on clustered memories of its own."""
    name = "the smallest nprobe that meets a recall target"
    hint = ("measure the recall of the failing memory at the nprobe you return and at the one before it, against "
            "the exact index's top k.")
    gen = torch.Generator().manual_seed(seed_for(1403))
    cases = tuple(_random_ivf_case(gen) for _ in range(2)) if hidden() else _IVF_CASES
    for seed, n, dim, clusters, noise, k, nlist, target in cases:
        keys, queries = _ivf_memory(seed, n, dim, clusters, noise)
        setting = f"{n} keys of width {dim}, k = {k}, nlist = {nlist}, target {target}"
        try:
            got = fn(keys, queries, k, nlist, target)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, int) and not (isinstance(got, float) and got.is_integer()):
            return failed(name, f"{setting}: return a whole number of cells to probe. Hint: {hint}")
        got = int(got)
        recalls = _recall_by_nprobe(keys, queries, k, nlist) if 1 <= got <= nlist else None
        if recalls is None or recalls[got - 1] < target or (got > 1 and recalls[got - 2] >= target):
            return failed(name, f"{setting}: the answer is not the smallest nprobe (from 1 to nlist) at which the "
                                f"index's recall@k reaches the target. Hint: {hint}")
    return _report(Result(name, PASSED, "the smallest nprobe on all the check's memories, measured."))


# ------------------------------------------------------------------------------------------ the chunker bug
def _chunk_cases(gen, trials: int):
    fixed = [(0, 5, 2), (5, 5, 0), (7, 5, 4), (100, 10, 3), (101, 64, 32)]
    drawn = []
    for _ in range(trials):
        size = randint(gen, 1, 70)
        drawn.append((randint(gen, 0, 400), size, randint(gen, 0, size - 1)))
    return fixed + drawn


def _chunk_problem(got, n: int, size: int, overlap: int) -> tuple[str, str] | None:
    """``(where, what)`` is wrong with the spans ``got`` for ``(n, size, overlap)`` (``where``: the token or run
    of the case where it breaks, or ''), or None when they are a valid chunking."""
    try:
        spans = [(int(s), int(e)) for s, e in got]
    except (TypeError, ValueError):
        return "", "return a list of (start, end) pairs."
    if any(not 0 <= s < e <= n for s, e in spans):
        return "", "a span is empty or leaves the document's tokens."
    if any(e - s > size for s, e in spans):
        return "", "a span is not within size tokens, so it does not fit the retriever's chunk."
    covered = set()
    for s, e in spans:
        covered.update(range(s, e))
    if covered != set(range(n)):
        return f"token {min(set(range(n)) - covered)}", "it is in no span."
    run = min(overlap + 1, n)
    for start in range(n - run + 1 if run else 0):
        if not any(s <= start and start + run <= e for s, e in spans):
            return (f"the run of {run} tokens from token {start}",
                    "no span holds it whole, so a fact there is lost.")
    if len(spans) > len(memory.chunk_spans(n, size, overlap)):
        return "", "there are more spans than the chapter's rule needs (duplicates waste the index)."
    return None


@exercise
def check_fixed_chunks(fn) -> Result:
    """Check ``fn(n, size, overlap) -> list of (start, end)``: spans of at most ``size`` tokens that cover all
    ``n`` tokens, hold every run of ``overlap + 1`` tokens whole, and are no more than the chapter's rule
    (:func:`labsrc.memory.chunk_spans`) makes; none when ``n == 0``."""
    name = "the chunker that splits facts, fixed"
    hint = ("run the handed-out chunker on the case named in this message and list every span it makes; then ask "
            "which runs of overlap + 1 tokens each span boundary cuts.")
    refused = refuse_library(name, fn, (memory.chunk_spans,), hint, owner="labsrc.memory", args=(100, 10, 3))
    if refused is not None:
        return refused
    seed, trials = 142, 25
    if hidden():
        seed, trials = seed_for(seed), trials_for(trials)
    cases = _chunk_cases(torch.Generator().manual_seed(seed), trials)
    for n, size, overlap in cases:
        try:
            got = fn(n, size, overlap)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        except Exception as err:  # noqa: BLE001 - a crash on an edge case is the student's bug to see
            return failed(name, f"n={n}, size={size}, overlap={overlap}: it raised "
                                f"{type(err).__name__}: {err}. Hint: {hint}")
        problem = _chunk_problem(got, n, size, overlap)
        if problem:
            where, what = problem
            case = ", ".join(p for p in (f"n={n}, size={size}, overlap={overlap}", where) if p)
            return failed(name, f"{case}: {what} Hint: {hint}")
    return _report(Result(name, PASSED, "a valid chunking on all the check's cases, edge cases included."))


# ------------------------------------------------------------------------------------------ the kernel
_KERNEL_SIZES = ((3, 5, 16, 40), (1, 1, 16, 3), (4, 7, 24, 50), (2, 16, 40, 33), (5, 3, 64, 9), (6, 13, 20, 70))
_GUARD = 64      # (T, K, D, N): queries, ids per query, head dim, memory rows


def _guarded(values: torch.Tensor):
    """``values`` inside a buffer of NaN guard bands: a load or store outside the tensor shows up as NaN."""
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _gathered_ref(q, keys, values, ids, scale):
    """Attention of each query over the memory rows its ids name (-1: not found); 0 where none is found."""
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        rows = ids[t][ids[t] >= 0]
        if rows.numel():
            out[t] = torch.softmax(keys[rows] @ q[t] * scale, 0) @ values[rows]
    return out


def _gather_ids(gen, T: int, K: int, N: int) -> torch.Tensor:
    """Distinct ids per query, best first in no particular order, a random tail of -1 (an index that found
    fewer than K rows); the last query of a launch with T > 1 finds nothing at all."""
    ids = torch.stack([torch.randperm(N, generator=gen)[:K] if K <= N else
                       torch.randint(0, N, (K,), generator=gen) for _ in range(T)])
    found = torch.randint(1, K + 1, (T,), generator=gen)
    ids[torch.arange(K)[None, :] >= found[:, None]] = -1
    if T > 1:
        ids[-1] = -1
    return ids


@exercise
def check_gathered_rows_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(q_ptr, keys_ptr, values_ptr, ids_ptr, out_ptr, scale, K, D,
    BLOCK_K, BLOCK_D)``: for query ``t`` (one program each, grid ``(T,)``), attention over the memory rows
    ``ids[t]`` names, ``out[t] = softmax(scale * keys[ids] @ q[t]) @ values[ids]`` over the ids that are not
    ``-1``, and 0 when all ``K`` are ``-1``. ``q``, ``out``: contiguous float32 ``(T, D)``; ``keys``,
    ``values``: ``(N, D)``; ``ids``: int64 ``(T, K)``; ``BLOCK_K >= K``, ``BLOCK_D >= D`` powers of two
    (``K``, ``D`` constexpr). Without Triton (macOS, Windows) the check says it is skipped."""
    name = "attention over rows gathered by id (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    import triton

    hint = ("re-read 'The kernel' and 'A kNN memory' (an index may leave some of the K slots empty), then follow "
            "the query row named in this message through your kernel: an id of -1 names no row.")
    seed, sizes = 144, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed_for(seed), sizes + tuple((t + 1, k + 2, d, n + 5) for t, k, d, n in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of T programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance(torch.float32)
    for trial, (T, K, D, N) in enumerate(sizes):
        q = torch.randn(T, D, generator=gen)
        keys, values = torch.randn(N, D, generator=gen), torch.randn(N, D, generator=gen)
        ids = _gather_ids(gen, T, K, N)
        scale = 1 / math.sqrt(D)
        qg, kg, vg = (_guarded(x)[0] for x in (q, keys, values))
        out, store = _guarded(torch.full_like(q, float("nan")))
        try:
            kernel[(T,)](qg, kg, vg, ids, out, scale, K=K, D=D, BLOCK_K=triton.next_power_of_2(K),
                         BLOCK_D=triton.next_power_of_2(D))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, f"trial {trial + 1} (T={T}, K={K}, D={D})", hint))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        want = _gathered_ref(q, keys, values, ids, scale)
        problem = None
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor (a lane past D stored without a mask?)."
        elif torch.isnan(out).any():
            rows = sorted({int(r) for r in torch.isnan(out).nonzero()[:, 0]})
            empty = [r for r in rows if bool((ids[r] < 0).all())]
            problem = f"{int(torch.isnan(out).sum())} output element(s) are NaN or were never written (rows {rows})."
            if empty:
                problem += f" Row {empty[0]}'s index found no row at all (every id is -1)."
        elif not torch.allclose(out, want, rtol=rtol, atol=atol):
            bad = ~torch.isclose(out, want, rtol=rtol, atol=atol)
            row = int(bad.nonzero()[0, 0])
            problem = f"{int(bad.sum())} of {bad.numel()} elements differ (first in row {row})."
            if bool((ids[row] < 0).any()):
                problem += f" Row {row} has ids of -1: rows the index did not find."
        if problem:
            return failed(name, f"trial {trial + 1} (T={T}, K={K}, D={D}): {problem} Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the reference on all the check's launches with odd sizes."))
