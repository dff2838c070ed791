"""The serving chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse the block manager's own code, say which count of a wrong fork
prediction is off, and the packed-gather kernel exercise catches a missing mask and a wrong table row and says
it is skipped without Triton."""
import labsrc  # noqa: F401

import math

import pytest
import torch

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


def fork_right(prompt_len, n, new_tokens, bs):
    shared = prompt_len // bs                       # full prompt blocks: named by every sample's table
    own = math.ceil((prompt_len + new_tokens) / bs) - shared
    copies = n - 1 if prompt_len % bs else 0        # the last writer of a shared partial block keeps it
    return shared + n * own, copies


def fork_wrong_no_copies(prompt_len, n, new_tokens, bs):   # the partial block is shared for ever
    shared = math.ceil(prompt_len / bs)
    return shared + n * (math.ceil((prompt_len + new_tokens) / bs) - shared), 0


def fork_wrong_n_copies(prompt_len, n, new_tokens, bs):    # every sample copies, the last one too
    blocks, copies = fork_right(prompt_len, n, new_tokens, bs)
    return blocks + (copies > 0), copies + (copies > 0)


def admit_right(n, bs, owned, evictable, free, running, max_seqs):
    return running < max_seqs and math.ceil(n / bs) - owned <= free


def admit_wrong(n, bs, owned, evictable, free, running, max_seqs):  # counts evictable hits as free
    return running < max_seqs and math.ceil(n / bs) - owned - evictable <= free


def lookup_right(prompt, published, bs):
    n = 0
    for h in blocks.block_hashes(prompt, bs):
        if published.get(h) != tuple(prompt[n:n + bs]):
            break
        n += bs
    return n - bs if n and n == len(prompt) else n     # at least one token left to compute


def lookup_as_given(prompt, published, bs):   # the handed-out lookup, typed out again
    n = 0
    for h in blocks.block_hashes(prompt, bs):
        if published.get(h) != tuple(prompt[n:n + bs]):
            break
        n += bs
    return n


@triton.jit
def packed_right(pool_ptr, tables_ptr, cu_ptr, out_ptr, PAGE, MAX_BLOCKS, ROW: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    s = tl.program_id(0)
    first = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - first
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    tmask = t < n
    block = tl.load(tables_ptr + s * MAX_BLOCKS + t // PAGE, mask=tmask, other=0).to(tl.int64)
    mask = tmask[:, None] & (r < ROW)[None, :]
    rows = tl.load(pool_ptr + (block * PAGE + t % PAGE)[:, None] * ROW + r[None, :], mask=mask)
    tl.store(out_ptr + (first + t)[:, None] * ROW + r[None, :], rows, mask=mask)


@triton.jit
def packed_first_table_row(pool_ptr, tables_ptr, cu_ptr, out_ptr, PAGE, MAX_BLOCKS, ROW: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):   # every sequence reads table row 0
    s = tl.program_id(0)
    first = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - first
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    tmask = t < n
    block = tl.load(tables_ptr + t // PAGE, mask=tmask, other=0).to(tl.int64)
    mask = tmask[:, None] & (r < ROW)[None, :]
    rows = tl.load(pool_ptr + (block * PAGE + t % PAGE)[:, None] * ROW + r[None, :], mask=mask)
    tl.store(out_ptr + (first + t)[:, None] * ROW + r[None, :], rows, mask=mask)


@triton.jit
def packed_no_token_mask(pool_ptr, tables_ptr, cu_ptr, out_ptr, PAGE, MAX_BLOCKS, ROW: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):     # stores the whole tile
    s = tl.program_id(0)
    first = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - first
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    tmask = t < n
    block = tl.load(tables_ptr + s * MAX_BLOCKS + t // PAGE, mask=tmask, other=0).to(tl.int64)
    mask = tmask[:, None] & (r < ROW)[None, :]
    rows = tl.load(pool_ptr + (block * PAGE + t % PAGE)[:, None] * ROW + r[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + (first + t)[:, None] * ROW + r[None, :], rows, mask=(r < ROW)[None, :])


CASES = [
    (ex.check_slot_mapping, slots_right, slots_wrong),
    (ex.check_slot_mapping, slots_right, slots_library),
    (ex.check_fork_blocks, fork_right, fork_wrong_no_copies),
    (ex.check_fork_blocks, fork_right, fork_wrong_n_copies),
    (ex.check_admission, admit_right, admit_wrong),
    (ex.check_cached_prefix, lookup_right, lookup_as_given),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_packed_gather_kernel, packed_right, packed_first_table_row),
              (ex.check_packed_gather_kernel, packed_right, packed_no_token_mask)]


def test_library_answer_is_refused_by_name(lenient, capsys):
    result = ex.check_slot_mapping(slots_library)
    assert result.status == "failed" and "slot_mapping" in result.message


def test_the_lookup_check_names_the_request_not_the_bug(lenient, capsys):
    message = ex.check_cached_prefix(lookup_as_given).message
    assert "full block" in message and "at least one" not in message and "last token" not in message


def test_the_lookup_truth_is_the_block_managers_allocation():
    """A prompt made of whole published blocks reuses all but its last block, as the manager allocates it."""
    published = [list(range(8))]
    assert ex.cached_tokens_measurement(list(range(8)), published, 4) == 4
    assert ex.cached_tokens_measurement(list(range(6)), published, 4) == 4
    assert ex.cached_tokens_measurement(list(range(10)), published, 4) == 8


def test_the_measured_fork_matches_the_closed_form_on_a_grid():
    """The measurement the prediction is checked against is the block manager itself; on a grid of cases it
    equals the count worked out by hand (so the exercise has one right answer)."""
    for bs in (1, 3, 4, 16):
        for prompt in (1, bs, 2 * bs + 1, 37):
            for n in (1, 2, 5):
                for new in (1, bs, 9):
                    assert ex.fork_measurement(prompt, n, new, bs) == fork_right(prompt, n, new, bs)


def test_fork_check_says_which_count_is_wrong_and_refuses_the_block_manager(lenient, capsys):
    result = ex.check_fork_blocks(fork_wrong_no_copies)
    assert result.status == "failed" and "the copies" in result.message and "partly filled" in result.message
    assert "too" not in result.message.split("Hint")[0]
    result = ex.check_fork_blocks(lambda p, n, g, bs: ex.fork_measurement(p, n, g, bs))
    assert result.status == "failed" and "fork_measurement" in result.message

    def simulated(p, n, g, bs):
        bm = blocks.BlockManager(num_blocks=n * (p + g), block_size=bs)
        bm.allocate(0, list(range(p)))
        for child in range(1, n):
            bm.fork(0, child)
        return len(bm.block_table(0)), 0

    result = ex.check_fork_blocks(simulated)
    assert result.status == "failed" and "BlockManager" in result.message


def test_admission_check_catches_the_given_bug(lenient, capsys):
    message = ex.check_admission(admit_wrong).message
    assert "the verdict differs" in message and "admit a request" not in message


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_write_past_the_output(lenient, capsys):
    result = ex.check_packed_gather_kernel(packed_no_token_mask)
    assert result.status == "failed" and "past the packed output" in result.message


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_the_sequence_and_token_of_a_wrong_row(lenient, capsys):
    result = ex.check_packed_gather_kernel(packed_first_table_row)
    assert result.status == "failed" and "sequence 1, its token" in result.message


def test_the_packed_reference_is_each_sequence_gathered_in_turn():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(9, 4, 5, generator=gen)
    tables = torch.tensor([[3, 7, -1], [0, 8, 2]], dtype=torch.int32)
    got = ex.packed_gather_reference(pool, tables, [6, 9])
    want = torch.cat([pool[3], pool[7, :2], pool[0], pool[8], pool[2, :1]])
    assert torch.equal(got, want)


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_packed_gather_kernel, packed_right, monkeypatch, capsys)
