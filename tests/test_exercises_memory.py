"""The memory chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, and the
kernel exercise catches a missing mask and says it is skipped without Triton."""
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


def merge_right(sa, ia, sb, ib, k):
    s, i = torch.cat([sa, sb], 1), torch.cat([ia, ib], 1)
    rows = []
    for srow, irow in zip(s.tolist(), i.tolist()):
        rows.append(sorted(zip(srow, irow), key=lambda p: (-p[0], p[1]))[:k])
    return torch.tensor([[p[0] for p in r] for r in rows]), torch.tensor([[p[1] for p in r] for r in rows])


def merge_wrong_ties(sa, ia, sb, ib, k):          # ties broken by position, not by id
    s, i = torch.cat([sb, sa], 1), torch.cat([ib, ia], 1)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    return s.gather(1, order), i.gather(1, order)


def chunks_right(n, size, overlap):
    if n <= size:
        return [(0, n)] if n else []
    step, spans, s = size - overlap, [], 0
    while s + size < n:
        spans.append((s, s + size))
        s += step
    return spans + [(n - size, n)]


def chunks_wrong_no_overlap(n, size, overlap):   # forgets the overlap: a fact at a boundary is split
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def mix_right(q, kl, vl, mk, mv, gate):
    B, H, T, D = q.shape
    kl = kl.repeat_interleave(H // kl.shape[1], 1)
    vl = vl.repeat_interleave(H // vl.shape[1], 1)
    s = q @ kl.transpose(-1, -2) / math.sqrt(D)
    Tk = kl.shape[2]
    s = s.masked_fill(torch.ones(T, Tk, dtype=torch.bool).tril(Tk - T).logical_not(), float("-inf"))
    local = torch.softmax(s, -1) @ vl
    mem = torch.einsum("bhtk,bhtkd->bhtd", torch.softmax(torch.einsum("bhtd,bhtkd->bhtk", q, mk) / math.sqrt(D), -1),
                       mv)
    g = torch.sigmoid(gate)[None, :, None, None]
    return g * mem + (1 - g) * local


def _joint(q, kl, vl, mk, mv, gate=None):   # the source's single softmax over both, no gate
    B, H, T, D = q.shape
    kl = kl.repeat_interleave(H // kl.shape[1], 1)
    vl = vl.repeat_interleave(H // vl.shape[1], 1)
    Tk = kl.shape[2]
    s = (q @ kl.transpose(-1, -2) / math.sqrt(D)).masked_fill(
        torch.ones(T, Tk, dtype=torch.bool).tril(Tk - T).logical_not(), float("-inf"))
    sm = torch.einsum("bhtd,bhtkd->bhtk", q, mk) / math.sqrt(D)
    p = torch.softmax(torch.cat([s, sm], -1), -1)
    return p[..., :Tk] @ vl + torch.einsum("bhtk,bhtkd->bhtd", p[..., Tk:], mv)


@triton.jit
def kernel_right(q_ptr, mk_ptr, mv_ptr, out_ptr, scale, K: tl.constexpr, D: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    km = k < K
    q = tl.load(q_ptr + t * D + d, mask=dm, other=0.0)
    tile = t * K * D + k[:, None] * D + d[None, :]
    m2 = km[:, None] & dm[None, :]
    rows = tl.load(mk_ptr + tile, mask=m2, other=0.0)
    s = tl.sum(q[None, :] * rows, 1) * scale
    s = tl.where(km, s, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    p = p / tl.sum(p, 0)
    vals = tl.load(mv_ptr + tile, mask=m2, other=0.0)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * vals, 0), mask=dm)


@triton.jit
def kernel_no_row_mask(q_ptr, mk_ptr, mv_ptr, out_ptr, scale, K: tl.constexpr, D: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + t * D + d, mask=dm, other=0.0)
    tile = t * K * D + k[:, None] * D + d[None, :]
    m2 = (k[:, None] < K) & dm[None, :]
    rows = tl.load(mk_ptr + tile, mask=m2, other=0.0)
    s = tl.sum(q[None, :] * rows, 1) * scale          # padded rows score 0 and take part in the softmax
    p = tl.exp(s - tl.max(s, 0))
    p = p / tl.sum(p, 0)
    vals = tl.load(mv_ptr + tile, mask=m2, other=0.0)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * vals, 0), mask=dm)


@triton.jit
def kernel_no_store_mask(q_ptr, mk_ptr, mv_ptr, out_ptr, scale, K: tl.constexpr, D: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    km = k < K
    q = tl.load(q_ptr + t * D + d, mask=dm, other=0.0)
    tile = t * K * D + k[:, None] * D + d[None, :]
    m2 = km[:, None] & dm[None, :]
    s = tl.where(km, tl.sum(q[None, :] * tl.load(mk_ptr + tile, mask=m2, other=0.0), 1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    p = p / tl.sum(p, 0)
    vals = tl.load(mv_ptr + tile, mask=m2, other=0.0)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * vals, 0))     # lanes d >= D spill into the next row


CASES = [
    (ex.check_memory_topk_merge, merge_right, merge_wrong_ties),
    (ex.check_overlap_chunks, chunks_right, chunks_wrong_no_overlap),
    (ex.check_gated_memory_mix, mix_right, _joint),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_retrieved_rows_kernel, kernel_right, kernel_no_row_mask),
              (ex.check_retrieved_rows_kernel, kernel_right, kernel_no_store_mask)]


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_retrieved_rows_kernel(kernel_no_store_mask)
    assert result.status == "failed" and "outside the output" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_retrieved_rows_kernel, kernel_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_memory_topk_merge, lambda sa, ia, sb, ib, k: memory.topk_merge(sa, ia, sb, ib, k), "topk_merge"),
    (ex.check_overlap_chunks, lambda n, s, o: memory.chunk_spans(n, s, o), "chunk_spans"),
    (ex.check_gated_memory_mix, lambda *a: memory.knn_memory_attention_ref(*a), "knn_memory_attention_ref"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
