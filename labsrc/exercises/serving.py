"""Checks for the exercises of the serving chapter (paged KV cache, scheduling, prefix caching).

Each check calls the student's function on seeded random cases and compares it with :mod:`labsrc.serving`;
it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` while the function still raises
``NotImplementedError``. Expected answers are computed here, never printed.

* :func:`check_slot_mapping` -- ``fn(block_table, start, end, block_size)``: the pool slots of tokens
  ``start .. end - 1``.
* :func:`check_cow_append` -- ``fn(table, ref_count, free, num_tokens, block_size)``: give the next token a
  slot, opening a block when the last is full and copying the last when it is shared (copy-on-write).
* :func:`check_admission` -- ``fn(num_tokens, block_size, hits_owned, hits_evictable, num_free_blocks,
  num_running, max_num_seqs)``: the scheduler's admission test.
* :func:`check_prefix_hash` -- ``fn(token_ids, block_size)``: block hashes that do not collide across
  prefixes (the bug of hashing each block alone, fixed).
* :func:`check_gather_kernel` -- a ``@triton.jit`` kernel that gathers one sequence's K rows from a paged pool
  through its block table, launched under the interpreter and compared with
  :func:`labsrc.kernels.paged_attention.gather_kv`.

A check refuses an answer that calls the :mod:`labsrc.serving.blocks` function the exercise asks for.
"""
from __future__ import annotations

import math

import torch

from labsrc import runtime
from labsrc.exercises.core import not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _call, _report, exercise,
                                   hidden, randint, refuse_library)
from labsrc.serving import blocks as _blocks

__all__ = ["check_slot_mapping", "check_cow_append", "check_admission", "check_prefix_hash",
           "check_gather_kernel"]


def _trials(seed: int, trials: int) -> tuple[torch.Generator, int]:
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, trials * 2
    return torch.Generator().manual_seed(seed), trials


def _unsolved(name: str, unsolved: Result) -> Result:
    unsolved.name = name
    return _report(unsolved)


# ------------------------------------------------------------------------------------------------ slot mapping
def _slot_inputs(gen):
    bs = (1, 2, 4, 16, 32)[randint(gen, 0, 4)]
    n = randint(gen, 1, 70)
    table = torch.randperm(200, generator=gen)[: -(-n // bs)].tolist()
    start = randint(gen, 0, n - 1)
    return table, start, randint(gen, start + 1, n), bs


def _slot_problem(got, want, table, start, end, block_size) -> str:
    """What is wrong with a slot list: its length, or the first wrong token and where its slot points."""
    if not isinstance(got, list):
        return f"expected a list of slots, got {type(got).__name__}."
    if len(got) != len(want):
        return f"you return {len(got)} slots for {len(want)} tokens."
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    block = got[i] // block_size
    where = ("a block this sequence does not own" if block not in table else
             f"entry {table.index(block)} of the table")
    return (f"the first wrong slot is token {start + i}'s: {got[i]}, in {where}, at offset "
            f"{got[i] % block_size}.")


@exercise
def check_slot_mapping(fn) -> Result:
    """Check ``fn(block_table, start, end, block_size) -> list[int]``: where tokens ``start .. end - 1`` go."""
    name = "slot mapping from a block table"
    hint = "re-read 'Blocks, block tables and slot mappings' and place the token named above by hand."
    refused = refuse_library(name, fn, (_blocks.slot_mapping, _blocks.slot_of), "compute the slots yourself.",
                             owner="labsrc.serving",
                             args=_slot_inputs(torch.Generator().manual_seed(91)))
    if refused is not None:
        return refused
    gen, trials = _trials(91, 8)
    for trial in range(trials):
        args = _slot_inputs(gen)
        got, unsolved = _call(fn, *args)
        if unsolved is not None:
            return _unsolved(name, unsolved)
        got = [int(x) for x in got] if isinstance(got, (list, tuple, torch.Tensor)) else got
        want = _blocks.slot_mapping(*args)
        if got != want:
            return _report(Result(name, FAILED, f"trial {trial + 1} (block_size={args[3]}, tokens {args[1]}.."
                                                f"{args[2] - 1}): {_slot_problem(got, want, *args)} Hint: {hint}"))
    return _report(Result(name, PASSED, f"agrees with the block manager on {trials} random tables."))


# ------------------------------------------------------------------------------------------- copy-on-write
def _cow_reference(table, ref_count, free, num_tokens, block_size):
    table = list(table)
    copy = None
    if num_tokens % block_size == 0:
        block = free.pop(0)
        ref_count[block] = 1
        table.append(block)
    elif ref_count[table[-1]] > 1:
        new = free.pop(0)
        ref_count[table[-1]] -= 1
        ref_count[new] = 1
        copy = (table[-1], new)
        table[-1] = new
    return table, copy


def _cow_inputs(gen):
    bs = (1, 2, 4, 16)[randint(gen, 0, 3)]
    n = randint(gen, 1, 40)
    num_blocks = -(-n // bs) + randint(gen, 1, 6)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = order[: -(-n // bs)]
    free = order[len(table):]
    ref_count = [0] * num_blocks
    for b in table:
        ref_count[b] = 1 + (randint(gen, 0, 2) if randint(gen, 0, 1) else 0)  # shared by a fork or not
    return table, ref_count, free, n, bs


@exercise
def check_cow_append(fn) -> Result:
    """Check ``fn(table, ref_count, free, num_tokens, block_size) -> (new_table, copy)``: give token
    ``num_tokens`` (0-based) of a sequence a slot. ``ref_count`` and ``free`` are updated in place; ``copy`` is
    the ``(src, dst)`` block pair whose K/V must be copied, or None."""
    name = "append with copy-on-write"
    hint = ("re-read 'A block manager, one operation at a time'; the case named above (full, shared or private "
            "last block) is the branch of the append to look at.")
    gen, trials = _trials(92, 12)
    saw_copy = False
    for trial in range(trials):
        table, ref, free, n, bs = _cow_inputs(gen)
        want_ref, want_free = list(ref), list(free)
        want = _cow_reference(table, want_ref, want_free, n, bs)
        got_ref, got_free = list(ref), list(free)
        got, unsolved = _call(fn, list(table), got_ref, got_free, n, bs)
        if unsolved is not None:
            return _unsolved(name, unsolved)
        saw_copy |= want[1] is not None
        if not (isinstance(got, tuple) and len(got) == 2):
            return _report(Result(name, FAILED, f"return (new_table, copy), got {type(got).__name__}. Hint: {hint}"))
        new_table, copy = list(got[0]), (tuple(got[1]) if got[1] is not None else None)
        if new_table != want[0] or copy != want[1]:
            case = "full last block" if n % bs == 0 else ("shared last block" if want[1] else "private last block")
            return _report(Result(name, FAILED, f"trial {trial + 1} ({case}): wrong table or copy. Hint: {hint}"))
        if got_ref != want_ref or got_free != want_free:
            which = " and ".join(w for w, ok in (("ref_count", got_ref == want_ref), ("free", got_free == want_free))
                                 if not ok)
            return _report(Result(name, FAILED, f"trial {trial + 1}: the table is right but {which} was not "
                                                f"updated as the block manager does. Hint: {hint}"))
    assert saw_copy, "the check's cases must include a copy-on-write"
    return _report(Result(name, PASSED, f"agrees with the block manager on {trials} appends."))


# ------------------------------------------------------------------------------------------------- admission
def _admission_reference(num_tokens, block_size, hits_owned, hits_evictable, num_free, num_running, max_seqs):
    need = math.ceil(num_tokens / block_size) - hits_owned  # an evictable hit still leaves the pool
    return num_running < max_seqs and need <= num_free


def _admission_inputs(gen):
    bs = (4, 16)[randint(gen, 0, 1)]
    n = randint(gen, 1, 100)
    full = n // bs
    owned = randint(gen, 0, full)
    evictable = randint(gen, 0, full - owned)
    need = math.ceil(n / bs) - owned
    return n, bs, owned, evictable, max(evictable, need + randint(gen, -3, 2)), randint(gen, 0, 4), randint(gen, 1, 4)


@exercise
def check_admission(fn) -> Result:
    """Check ``fn(num_tokens, block_size, hits_owned, hits_evictable, num_free_blocks, num_running,
    max_num_seqs) -> bool``: may the head of the queue start now? ``hits_owned`` cached blocks of its prefix are
    held by running sequences, ``hits_evictable`` sit in the free pool (counted in ``num_free_blocks``)."""
    name = "admission test"
    hint = ("re-read 'Scheduling one step at a time' and 'Prefix caching', and for the failing queue count the "
            "blocks the request still has to take out of the free pool, then check every limit the scheduler "
            "applies.")
    gen, trials = _trials(93, 40)
    for trial in range(trials):
        args = _admission_inputs(gen)
        got, unsolved = _call(fn, *args)
        if unsolved is not None:
            return _unsolved(name, unsolved)
        if not isinstance(got, (bool, int)) or bool(got) != _admission_reference(*args):
            verdict = "admit a request that must wait" if got else "refuse a request that fits"
            return _report(Result(name, FAILED, f"trial {trial + 1} (num_tokens={args[0]}, block_size={args[1]}, "
                                                f"hits {args[2]} held + {args[3]} evictable, {args[4]} free, "
                                                f"{args[5]} of {args[6]} running): you {verdict}. Hint: {hint}"))
    return _report(Result(name, PASSED, f"right on {trials} random queues."))


# ------------------------------------------------------------------------------------------------ prefix hash
@exercise
def check_prefix_hash(fn) -> Result:
    """Check ``fn(token_ids, block_size) -> list``: one hash per *full* block such that two prompts get the
    same hash for block ``i`` exactly when their first ``i + 1`` blocks are equal."""
    name = "prefix hash without collisions"
    hint = ("re-read 'Prefix caching': the message above names the property of the task your hashes break; "
            "ask what a block's K/V depends on.")
    refused = refuse_library(name, fn, (_blocks.block_hashes,), hint, owner="labsrc.serving",
                             args=([1, 2, 3, 4], 2))
    if refused is not None:
        return refused
    gen, trials = _trials(94, 10)
    for trial in range(trials):
        bs = (1, 2, 4, 16)[randint(gen, 0, 3)]
        common = torch.randint(0, 5, (bs * randint(gen, 0, 3),), generator=gen).tolist()
        block = torch.randint(0, 5, (bs,), generator=gen).tolist()
        a = common + torch.randint(0, 5, (bs,), generator=gen).tolist() + block + [7] * randint(gen, 0, bs - 1)
        b = common + [t + 5 for t in a[len(common):len(common) + bs]] + block + block
        prompts = (a, b, list(a))
        hashes = []
        for p in prompts:
            got, unsolved = _call(fn, list(p), bs)
            if unsolved is not None:
                return _unsolved(name, unsolved)
            hashes.append(list(got))
        full = [len(p) // bs for p in prompts]
        if [len(h) for h in hashes] != full:
            return _report(Result(name, FAILED, f"trial {trial + 1}: expected one hash per full block, got "
                                                f"{[len(h) for h in hashes]} for {full} full blocks. Hint: {hint}"))
        if hashes[0] != hashes[2]:
            return _report(Result(name, FAILED, f"trial {trial + 1}: equal prompts got different hashes (is the "
                                                f"hash deterministic?). Hint: {hint}"))
        shared = len(common) // bs
        if hashes[0][:shared] != hashes[1][:shared]:
            return _report(Result(name, FAILED, f"trial {trial + 1}: equal leading blocks got different hashes, "
                                                f"so a shared prefix is never reused. Hint: {hint}"))
        later = shared + 1  # the same tokens after a different block
        if hashes[0][later] == hashes[1][later]:
            return _report(Result(name, FAILED, f"trial {trial + 1}: block {later} holds the same tokens in both "
                                                f"prompts after different prefixes, and got the same hash: its K/V "
                                                f"would be served to the wrong prompt. Hint: {hint}"))
    return _report(Result(name, PASSED, f"no collision across prefixes and reuse of equal prefixes on {trials} "
                                        "pairs of prompts."))


# ---------------------------------------------------------------------------------------------- gather kernel
_KERNEL_SIZES = ((13, 4, 40), (37, 16, 24), (5, 1, 8), (70, 32, 80))  # (tokens, block_size, Hkv * D)


def _run_gather(kernel, pool, table, n):
    import triton  # only reached when Triton is installed

    num_blocks, page, row = pool.shape
    out = torch.full((n + 1, row), float("nan"))  # one guard row past the end
    pool_before = pool.clone()
    kernel[(n,)](pool, table, out, page, ROW=row, BLOCK=triton.next_power_of_2(row))
    if not torch.equal(pool, pool_before):
        return out[:n], "the kernel changed the pool."
    if not bool(torch.isnan(out[n]).all()):
        return out[:n], "the kernel wrote past its output (a lane past ROW stored without a mask?)."
    return out[:n], None


def _gather_source(row: torch.Tensor, pool: torch.Tensor) -> str:
    """Where in the pool a wrongly gathered row came from, when it is a whole pool row."""
    flat = pool.reshape(-1, pool.shape[-1])
    hits = (flat == row).all(1).nonzero()
    if hits.numel() == 0:
        return " (no row of the pool: a partial or mixed read)"
    index = int(hits[0])
    return f" (it is the pool's block {index // pool.shape[1]}, offset {index % pool.shape[1]})"


@exercise
def check_gather_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(pool_ptr, table_ptr, out_ptr, PAGE, ROW, BLOCK)`` launched with
    grid ``(n,)``: program ``t`` copies row ``t`` of a sequence, ``pool[table[t // PAGE], t % PAGE, :]``, to
    ``out[t, :]``. The pool is contiguous float32 ``(num_blocks, PAGE, ROW)`` (``ROW = Hkv * D``), ``table`` int32,
    ``BLOCK`` the next power of two >= ``ROW``. Without Triton the check says it is skipped."""
    name = "gather through a block table (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'Paged attention in PyTorch' and 'The kernel'; for the row named above, compare the pool "
            "block and offset your kernel read with those the block table gives.")
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of n programs")) is not None:
        return _report(unlaunchable)
    seed = 95 + (HIDDEN_SEED_OFFSET if hidden() else 0)
    gen = torch.Generator().manual_seed(seed)
    from labsrc.kernels.paged_attention import gather_kv
    for trial, (n, page, row) in enumerate(_KERNEL_SIZES):
        num_blocks = -(-n // page) + randint(gen, 1, 5)
        pool = torch.randn(num_blocks, page, row, generator=gen)
        table = torch.randperm(num_blocks, generator=gen)[: -(-n // page)].to(torch.int32)
        try:
            out, problem = _run_gather(kernel, pool, table, n)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if isinstance(err, NotImplementedError) or isinstance(cause, NotImplementedError):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1}: the launch raised "
                                                f"{type(cause or err).__name__}: {cause or err}. Hint: {hint}"))
        if problem is None:
            expected = gather_kv(pool[:, :, None], pool[:, :, None], table, n)[0][0]  # (n, ROW)
            if torch.isnan(out).any():
                problem = f"{int(torch.isnan(out).any(1).sum())} row(s) were never written."
            elif not torch.equal(out, expected):
                bad = (out != expected).any(1).nonzero()[0].item()
                problem = f"row {bad} (of {n}) holds the wrong token's K{_gather_source(out[bad], pool)}."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (n={n}, PAGE={page}, ROW={row}): {problem} "
                                                f"Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to gather_kv on {len(_KERNEL_SIZES)} launches (block sizes 1 to "
                                        "32, ragged last blocks)."))
