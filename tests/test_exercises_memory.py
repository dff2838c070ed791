"""The memory chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, name the
typical slips (a prediction that ignores the shard, an nprobe that is not the smallest, the chunker's split
fact, an id of -1 loaded as a row), and the kernel exercise says it is skipped without Triton."""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import memory, runtime
from labsrc.exercises import memory as ex
from labsrc.kernels._triton import tl, triton


# ----------------------------------------------------------------------------- the sharded search's recall
def recall_right(k, shards, per_shard):
    """The row of rank r survives iff fewer than per_shard of the r - 1 better rows share its shard."""
    p = 1 / shards
    return sum(sum(math.comb(r, j) * p ** j * (1 - p) ** (r - j) for j in range(min(per_shard, r + 1)))
               for r in range(k)) / k


def recall_wrong_proportional(k, shards, per_shard):     # "each shard returns per_shard of k/shards rows"
    return min(1.0, per_shard * shards / k)


def simulated_recall(k, shards, per_shard, trials=4000, n=400):
    """The measurement the notebook makes: random scores, random shards, each shard's top per_shard, merged."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(trials, n, generator=gen)
    shard = torch.randint(0, shards, (trials, n), generator=gen)
    truth = scores.topk(k, 1).indices
    kept = torch.zeros(trials, n, dtype=torch.bool)
    for s in range(shards):
        top = scores.masked_fill(shard != s, float("-inf")).topk(per_shard, 1).indices
        kept.scatter_(1, top, True)
    merged = scores.masked_fill(~kept, float("-inf")).topk(k, 1).indices
    hits = (merged[:, :, None] == truth[:, None, :]).any(1).sum()
    return hits.item() / truth.numel()


def test_the_sharded_reference_is_what_a_simulation_measures():
    for k, shards, per_shard in ((16, 4, 4), (32, 8, 6), (10, 3, 2)):
        assert abs(ex._sharded_recall_ref(k, shards, per_shard) - simulated_recall(k, shards, per_shard)) < 0.01


def test_the_sharded_check_names_the_failing_case_not_the_slip(lenient, capsys):
    result = ex.check_sharded_recall(lambda k, s, p: p / k)
    assert result.status == "failed" and result.case and result.case in result.message
    assert "single shard" not in result.message


# ----------------------------------------------------------------------------- the smallest nprobe
def nprobe_right(keys, queries, k, nlist, target):
    exact = memory.KVMemory(keys.shape[1])
    exact.add(keys, keys)
    _, truth = exact.search_ids(queries, k)
    for nprobe in range(1, nlist + 1):
        ivf = memory.KVMemory(keys.shape[1], "faiss-ivf", nlist=nlist, nprobe=nprobe)
        ivf.add(keys, keys)
        if memory.recall_at_k(ivf.search_ids(queries, k)[1], truth) >= target:
            return nprobe
    return nlist


def nprobe_wrong_all_cells(keys, queries, k, nlist, target):       # meets any target, and wastes the index
    return nlist


def test_the_nprobe_check_states_the_invariant_without_a_direction(lenient, capsys):
    for wrong in (nprobe_wrong_all_cells, lambda *a: 1):
        result = ex.check_smallest_nprobe(wrong)
        assert result.status == "failed" and "not the smallest nprobe" in result.message
        assert "below" not in result.message and "smaller" not in result.message


# ----------------------------------------------------------------------------- the chunker
def chunks_buggy(n, size, overlap):      # the exercise's chunker: the remainder starts where the last span ends
    if n <= size:
        return [(0, n)] if n else []
    spans, start = [], 0
    while start + size <= n:
        spans.append((start, start + size))
        start += size - overlap
    if spans[-1][1] < n:
        spans.append((spans[-1][1], n))
    return spans


def chunks_fixed_by_rule(n, size, overlap):
    if n <= size:
        return [(0, n)] if n else []
    spans, start = [], 0
    while start + size < n:
        spans.append((start, start + size))
        start += size - overlap
    return spans + [(n - size, n)]


def chunks_fixed_short_tail(n, size, overlap):   # another right fix: the remainder keeps the overlap
    if n <= size:
        return [(0, n)] if n else []
    spans, start = [], 0
    while start + size <= n:
        spans.append((start, start + size))
        start += size - overlap
    if spans[-1][1] < n:
        spans.append((start, n))
    return spans


def test_the_chunker_check_accepts_any_right_fix(lenient, capsys):
    assert ex.check_fixed_chunks(chunks_fixed_short_tail).passed


def test_the_chunker_check_names_the_split_run(lenient, capsys):
    result = ex.check_fixed_chunks(chunks_buggy)
    assert result.status == "failed" and "no span holds it whole" in result.message


def test_the_chunker_check_names_a_chunk_that_is_too_long(lenient, capsys):
    result = ex.check_fixed_chunks(lambda n, size, overlap: [(0, n)] if n else [])
    assert result.status == "failed" and "not within size tokens" in result.message


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def kernel_right(q_ptr, keys_ptr, values_ptr, ids_ptr, out_ptr, scale, K: tl.constexpr, D: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    ids = tl.load(ids_ptr + t * K + k, mask=k < K, other=-1)
    found = ids >= 0
    rows = tl.where(found, ids, 0)
    m2 = found[:, None] & dm[None, :]
    q = tl.load(q_ptr + t * D + d, mask=dm, other=0.0)
    keys = tl.load(keys_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0)
    s = tl.where(found, tl.sum(q[None, :] * keys, 1) * scale, float("-inf"))
    p = tl.where(found, tl.exp(s - tl.max(s, 0)), 0.0)
    p = p / tl.maximum(tl.sum(p, 0), 1e-30)
    vals = tl.load(values_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * vals, 0), mask=dm)


@triton.jit
def kernel_empty_row_nan(q_ptr, keys_ptr, values_ptr, ids_ptr, out_ptr, scale, K: tl.constexpr,
                         D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    ids = tl.load(ids_ptr + t * K + k, mask=k < K, other=-1)
    found = ids >= 0
    m2 = found[:, None] & dm[None, :]
    q = tl.load(q_ptr + t * D + d, mask=dm, other=0.0)
    keys = tl.load(keys_ptr + ids[:, None] * D + d[None, :], mask=m2, other=0.0)
    s = tl.where(found, tl.sum(q[None, :] * keys, 1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))                     # all -inf when nothing was found: 0 / 0
    p = p / tl.sum(p, 0)
    vals = tl.load(values_ptr + ids[:, None] * D + d[None, :], mask=m2, other=0.0)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * vals, 0), mask=dm)


@triton.jit
def kernel_loads_missing_rows(q_ptr, keys_ptr, values_ptr, ids_ptr, out_ptr, scale, K: tl.constexpr,
                              D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    km = k < K
    ids = tl.load(ids_ptr + t * K + k, mask=km, other=0)
    m2 = km[:, None] & dm[None, :]                  # an id of -1 reads the row before the memory
    q = tl.load(q_ptr + t * D + d, mask=dm, other=0.0)
    keys = tl.load(keys_ptr + ids[:, None] * D + d[None, :], mask=m2, other=0.0)
    s = tl.where(km, tl.sum(q[None, :] * keys, 1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    p = p / tl.sum(p, 0)
    vals = tl.load(values_ptr + ids[:, None] * D + d[None, :], mask=m2, other=0.0)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * vals, 0), mask=dm)


def test_the_gathered_reference_gives_zero_where_nothing_was_found():
    q, keys = torch.randn(2, 4), torch.randn(5, 4)
    ids = torch.tensor([[3, 1, -1], [-1, -1, -1]])
    out = ex._gathered_ref(q, keys, keys, ids, 0.5)
    want = torch.softmax(keys[[3, 1]] @ q[0] * 0.5, 0) @ keys[[3, 1]]
    assert torch.allclose(out[0], want) and torch.equal(out[1], torch.zeros(4))


CASES = [
    (ex.check_sharded_recall, recall_right, recall_wrong_proportional),
    (ex.check_smallest_nprobe, nprobe_right, nprobe_wrong_all_cells),
    (ex.check_fixed_chunks, chunks_fixed_by_rule, chunks_buggy),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_gathered_rows_kernel, kernel_right, kernel_empty_row_nan),
              (ex.check_gathered_rows_kernel, kernel_right, kernel_loads_missing_rows)]


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_query_that_found_nothing(lenient, capsys):
    result = ex.check_gathered_rows_kernel(kernel_empty_row_nan)
    assert result.status == "failed" and "found no row" in result.message


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_ids_that_are_not_rows(lenient, capsys):
    result = ex.check_gathered_rows_kernel(kernel_loads_missing_rows)
    assert result.status == "failed" and ("NaN" in result.message or "-1" in result.message)


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_gathered_rows_kernel, kernel_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_fixed_chunks, lambda n, s, o: memory.chunk_spans(n, s, o), "chunk_spans"),
    (ex.check_sharded_recall, lambda k, s, p: memory.recall_at_k(torch.zeros(1, k), torch.zeros(1, k)),
     "recall_at_k"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
