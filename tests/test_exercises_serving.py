"""The serving chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse the block manager's own functions, and the kernel exercise
catches a missing mask and says it is skipped without Triton."""
import labsrc  # noqa: F401

import math

import pytest

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime
from labsrc.exercises import serving as ex
from labsrc.kernels._triton import tl, triton
from labsrc.serving import blocks


def slots_right(table, start, end, bs):
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


def slots_wrong(table, start, end, bs):  # forgets the table: as if blocks were contiguous
    return list(range(start, end))


def slots_library(table, start, end, bs):
    return blocks.slot_mapping(table, start, end, bs)


def cow_right(table, ref, free, n, bs):
    if n % bs == 0:
        b = free.pop(0)
        ref[b] = 1
        return table + [b], None
    if ref[table[-1]] > 1:
        new = free.pop(0)
        ref[table[-1]] -= 1
        ref[new] = 1
        return table[:-1] + [new], (table[-1], new)
    return table, None


def cow_wrong(table, ref, free, n, bs):  # writes into the shared block: no copy
    if n % bs == 0:
        b = free.pop(0)
        ref[b] = 1
        return table + [b], None
    return table, None


def admit_right(n, bs, owned, evictable, free, running, max_seqs):
    return running < max_seqs and math.ceil(n / bs) - owned <= free


def admit_wrong(n, bs, owned, evictable, free, running, max_seqs):  # counts evictable hits as free
    return running < max_seqs and math.ceil(n / bs) - owned - evictable <= free


def hash_right(tokens, bs):
    out, prev = [], None
    for i in range(len(tokens) // bs):
        prev = hash((prev, tuple(tokens[i * bs:(i + 1) * bs])))
        out.append(prev)
    return out


def hash_buggy(tokens, bs):  # each block alone: equal blocks at different prefixes collide
    return [hash(tuple(tokens[i * bs:(i + 1) * bs])) for i in range(len(tokens) // bs)]


@triton.jit
def gather_right(pool_ptr, table_ptr, out_ptr, PAGE, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    block = tl.load(table_ptr + t // PAGE).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    row = tl.load(pool_ptr + (block * PAGE + t % PAGE) * ROW + offs, mask=mask)
    tl.store(out_ptr + t * ROW + offs, row, mask=mask)


@triton.jit
def gather_no_table(pool_ptr, table_ptr, out_ptr, PAGE, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    row = tl.load(pool_ptr + t * ROW + offs, mask=mask)  # reads the pool as if it were contiguous
    tl.store(out_ptr + t * ROW + offs, row, mask=mask)


@triton.jit
def gather_no_store_mask(pool_ptr, table_ptr, out_ptr, PAGE, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    block = tl.load(table_ptr + t // PAGE).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    row = tl.load(pool_ptr + (block * PAGE + t % PAGE) * ROW + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * ROW + offs, row)


CASES = [
    (ex.check_slot_mapping, slots_right, slots_wrong),
    (ex.check_slot_mapping, slots_right, slots_library),
    (ex.check_cow_append, cow_right, cow_wrong),
    (ex.check_admission, admit_right, admit_wrong),
    (ex.check_prefix_hash, hash_right, hash_buggy),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_gather_kernel, gather_right, gather_no_table),
              (ex.check_gather_kernel, gather_right, gather_no_store_mask)]


def test_library_answer_is_refused_by_name(lenient, capsys):
    result = ex.check_slot_mapping(slots_library)
    assert result.status == "failed" and "slot_mapping" in result.message


def test_buggy_hash_is_told_it_collides(lenient, capsys):
    assert "same hash" in ex.check_prefix_hash(hash_buggy).message


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_write_past_the_output(lenient, capsys):
    result = ex.check_gather_kernel(gather_no_store_mask)
    assert result.status == "failed" and "past its output" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_gather_kernel, gather_right, monkeypatch, capsys)
