"""Checks for the exercises of the serving chapter (paged KV cache, scheduling, prefix caching).

Each check calls the student's function on seeded random cases and compares it with :mod:`labsrc.serving`
(its block manager run on the same case, for a prediction); it prints ``passed``, what is wrong (with a
hint), or ``not solved yet`` while the function still raises ``NotImplementedError``. Expected answers are
computed here, never printed.

* :func:`check_slot_mapping` -- ``fn(block_table, start, end, block_size)``: the pool slots of tokens
  ``start .. end - 1``.
* :func:`check_fork_blocks` -- ``fn(prompt_len, n, new_tokens, block_size) -> (blocks_held, copies)``: a
  derivation of what ``n`` parallel samples of one prompt hold, compared with the block manager's own run.
* :func:`check_admission` -- ``fn(num_tokens, block_size, hits_owned, hits_evictable, num_free_blocks,
  num_running, max_num_seqs)``: the scheduler's admission test (the fix of a given test that over-admits).
* :func:`check_cached_prefix` -- ``fn(prompt, published, block_size)``: the tokens a new request reuses from
  the prefix cache (the fix of a given lookup), compared with the block manager's own allocation.
* :func:`check_packed_gather_kernel` -- a ``@triton.jit`` kernel that gathers many sequences of different
  lengths from a paged pool through their block tables into one packed tensor, launched under the interpreter.

A check refuses an answer that calls the :mod:`labsrc.serving.blocks` code the exercise asks for.
"""
from __future__ import annotations

import math

import torch

from labsrc import runtime
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import PASSED, Result, _call, _report, exercise, hidden, randint, refuse_library
from labsrc.serving import blocks as _blocks

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["check_slot_mapping", "check_fork_blocks", "check_admission", "cached_tokens_buggy",
           "check_cached_prefix", "check_packed_gather_kernel", "fork_measurement", "packed_gather_reference"]


def _trials(seed: int, trials: int) -> tuple[torch.Generator, int]:
    if hidden():
        seed, trials = seed_for(seed), trials_for(trials)
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


def _slot_problem(got, want, table, start, end, block_size) -> tuple[str, str]:
    """``(where, what)`` is wrong with a slot list: its type or length, or the first wrong token (``where``) and
    whether its slot lies in a block the sequence owns."""
    if not isinstance(got, list):
        return "", "return a list of slots."
    if len(got) != len(want):
        return "", "the answer does not hold one slot per token."
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    owned = "" if got[i] // block_size in table else ", in a block this sequence does not own"
    return f"token {start + i}", f"its slot is the first that is wrong{owned}."


@exercise
def check_slot_mapping(fn) -> Result:
    """Check ``fn(block_table, start, end, block_size) -> list[int]``: where tokens ``start .. end - 1`` go."""
    name = "slot mapping from a block table"
    hint = "place the token named in this message by hand: which entry of the table, which offset in that block?"
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
            where, what = _slot_problem(got, want, *args)
            case = f"trial {trial + 1} (block_size={args[3]}, tokens {args[1]}..{args[2] - 1})"
            return failed(name, f"{', '.join(p for p in (case, where) if p)}: {what} Hint: {hint}")
    return _report(Result(name, PASSED, "agrees with the block manager on all the check's random tables."))


# ------------------------------------------------------------------------------------------- forks, predicted
def fork_measurement(prompt_len, n, new_tokens, block_size, gen=None):
    """What the block manager does for parallel sampling: a prompt of ``prompt_len`` tokens is allocated and its
    K/V written, forked into ``n`` sequences, and each sequence then appends ``new_tokens`` tokens of its own
    (round robin). Returns ``(blocks_held, copies)``: the distinct blocks the ``n`` tables name at the end and
    the copy-on-write copies made on the way."""
    gen = gen or torch.Generator().manual_seed(0)
    need = n * (-(-(prompt_len + new_tokens) // block_size)) + 1
    bm = _blocks.BlockManager(num_blocks=need, block_size=block_size)
    bm.allocate(0, torch.randint(5, 4096, (prompt_len,), generator=gen).tolist())
    bm.mark_computed(0, prompt_len)
    for child in range(1, n):
        bm.fork(0, child)
    copies = 0
    for _ in range(new_tokens):
        for seq in range(n):
            bm.append_slot(seq, randint(gen, 5, 4095))
            copies += len(bm.take_copies())
    bm.check_invariants()
    return len({b for seq in range(n) for b in bm.block_table(seq)}), copies


def _fork_inputs(gen):
    bs = (1, 2, 4, 16)[randint(gen, 0, 3)]
    prompt = randint(gen, 1, 60)
    if randint(gen, 0, 2) == 0:
        prompt = bs * max(1, prompt // bs)      # a prompt that fills its last block
    return prompt, randint(gen, 1, 6), randint(gen, 1, 40), bs


@exercise
def check_fork_blocks(fn) -> Result:
    """Check ``fn(prompt_len, n, new_tokens, block_size) -> (blocks_held, copies)``: the prediction, without a
    block manager, of the blocks ``n`` parallel samples of one prompt hold after ``new_tokens`` tokens each, and of
    the copy-on-write copies made. The truth is measured by running :class:`labsrc.serving.BlockManager`."""
    name = "blocks and copies of parallel samples"
    hint = ("draw the tables of two samples of the failing case, block by block, and mark which blocks they "
            "share and when the first write into a shared block happens.")
    # the manager by name, its fork and append (caught when called through other code), and this measurement
    refused = refuse_library(name, fn, (_blocks.BlockManager, _blocks.BlockManager.fork,
                                        _blocks.BlockManager.append_slot, fork_measurement), hint,
                             owner="labsrc.serving",
                             args=_fork_inputs(torch.Generator().manual_seed(92)))
    if refused is not None:
        return refused
    gen, trials = _trials(92, 12)
    for trial in range(trials):
        args = _fork_inputs(gen)
        got, unsolved = _call(fn, *args)
        if unsolved is not None:
            return _unsolved(name, unsolved)
        prompt, n, new, bs = args
        case = (f"trial {trial + 1} (prompt of {prompt} tokens, {n} samples, {new} new tokens each, blocks of "
                f"{bs}; the prompt's last block is {'full' if prompt % bs == 0 else 'partly filled'})")
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in got)):
            return failed(name, f"{case}: return a pair of whole numbers (blocks_held, copies). Hint: {hint}")
        want = fork_measurement(*args, gen=torch.Generator().manual_seed(trial))
        wrong = [what for what, g, w in zip(("the blocks held", "the copies"), got, want) if g != w]
        if wrong:
            return failed(name, f"{case}: {' and '.join(wrong)} differ from what the block "
                                f"manager does. Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the block manager's own count on all the check's forks."))


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
    hint = ("for the failing queue, count the blocks the request still has to take out of the free pool, then "
            "check every limit the scheduler applies.")
    gen, trials = _trials(93, 40)
    for trial in range(trials):
        args = _admission_inputs(gen)
        got, unsolved = _call(fn, *args)
        if unsolved is not None:
            return _unsolved(name, unsolved)
        if not isinstance(got, (bool, int)) or bool(got) != _admission_reference(*args):
            return failed(name, f"trial {trial + 1} (num_tokens={args[0]}, block_size={args[1]}, "
                                f"hits {args[2]} held + {args[3]} evictable, {args[4]} free, "
                                f"{args[5]} of {args[6]} running): the verdict differs from whether "
                                f"the request's allocation succeeds. Hint: {hint}")
    return _report(Result(name, PASSED, "right on all the check's random queues."))


# ------------------------------------------------------------------------------------------ prefix-cache lookup
def cached_tokens_buggy(prompt, published, block_size):
    """The exercise's prefix-cache lookup, with its bug: how many leading tokens of ``prompt`` are already in the
    cache, walking the chapter's hash chain; ``published`` maps the chain hash of every published block to its
    tokens."""
    n = 0
    for h in _blocks.block_hashes(prompt, block_size):
        if published.get(h) != tuple(prompt[n:n + block_size]):
            break
        n += block_size
    return n


def cached_tokens_measurement(prompt, published_prompts, block_size) -> int:
    """The truth: publish ``published_prompts`` on a :class:`labsrc.serving.BlockManager` (allocated and computed,
    so their full blocks are published) and allocate ``prompt``; the manager returns the tokens it reuses."""
    need = sum(len(p) for p in published_prompts) + len(prompt)
    bm = _blocks.BlockManager(num_blocks=need // block_size + len(published_prompts) + 2, block_size=block_size)
    for i, p in enumerate(published_prompts):
        bm.allocate(("published", i), list(p))
        bm.mark_computed(("published", i), len(p))
    return bm.allocate("request", list(prompt))


def _lookup_case(gen):
    """Published prompts and a request that shares some of their blocks: a published prompt cut at a block
    boundary (the whole request cached), cut inside a block, continued past it, or diverging after a few
    blocks."""
    bs = (1, 2, 4, 16)[randint(gen, 0, 3)]
    published = [torch.randint(0, 50, (bs * randint(gen, 1, 5) + randint(gen, 0, bs - 1),), generator=gen).tolist()
                 for _ in range(randint(gen, 1, 3))]
    base = published[randint(gen, 0, len(published) - 1)]
    full = len(base) // bs
    kind = randint(gen, 0, 3)
    if kind == 0:
        prompt = base[:bs * randint(gen, 1, full)]
    elif kind == 1:
        prompt = base[:bs * randint(gen, 0, full - 1) + randint(gen, 1, max(1, bs - 1))]
    elif kind == 2:
        prompt = base + torch.randint(0, 50, (randint(gen, 1, 2 * bs),), generator=gen).tolist()
    else:
        cut = bs * randint(gen, 0, full - 1)
        prompt = base[:cut] + [t + 50 for t in base[cut:]]
    return prompt, published, bs


@exercise
def check_cached_prefix(fn) -> Result:
    """Check ``fn(prompt, published, block_size) -> int``: the tokens of ``prompt`` a new request reuses from the
    prefix cache (whole published blocks of its prefix), where ``published`` maps the chain hash
    (:func:`labsrc.serving.blocks.block_hashes`) of every published block to its tokens; compared with what
    :class:`labsrc.serving.BlockManager` reuses when it allocates the same prompt."""
    name = "prefix-cache lookup, fixed"
    hint = ("follow the failing request past the lookup: what does the engine compute for it in its first step, "
            "and what does it need from that step?")
    refused = refuse_library(name, fn, (_blocks.BlockManager, _blocks.BlockManager.allocate, cached_tokens_buggy,
                                        cached_tokens_measurement), hint, owner="labsrc.serving",
                             args=([1, 2, 3, 4], {}, 2))
    if refused is not None:
        return refused
    gen, trials = _trials(94, 16)
    for trial in range(trials):
        prompt, published_prompts, bs = _lookup_case(gen)
        published = {}
        for p in published_prompts:
            for i, h in enumerate(_blocks.block_hashes(p, bs)):
                published.setdefault(h, tuple(p[i * bs:(i + 1) * bs]))
        got, unsolved = _call(fn, list(prompt), dict(published), bs)
        if unsolved is not None:
            return _unsolved(name, unsolved)
        shared = 0
        for h in _blocks.block_hashes(prompt, bs):
            if h not in published:
                break
            shared += 1
        case = (f"trial {trial + 1} (a prompt of {len(prompt)} tokens in blocks of {bs}, its first {shared} full "
                f"block{'s' if shared != 1 else ''} published)")
        if isinstance(got, bool) or not isinstance(got, int):
            return failed(name, f"{case}: return a whole number of tokens. Hint: {hint}")
        if got != cached_tokens_measurement(prompt, published_prompts, bs):
            return failed(name, f"{case}: the count differs from the tokens the block manager "
                                f"reuses for this prompt. Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the block manager's reuse on all the check's requests."))


# ------------------------------------------------------------------------------------- packed gather kernel
# (sequence lengths, PAGE, ROW = Hkv * D, BLOCK_T): ragged sequences, an empty one, blocks of 1 to 32 tokens,
# tiles that cross blocks and blocks that cross tiles.
_KERNEL_CASES = (((13, 1, 7), 4, 40, 8), ((37, 16), 16, 24, 16), ((5, 0, 9, 3), 1, 8, 4), ((70, 33), 32, 80, 32))


def _packed_case(gen, lens, page):
    """A pool with every sequence's blocks scattered over it, the padded tables (-1 past a sequence's blocks),
    and the prefix sums of the lengths."""
    need = [-(-n // page) for n in lens]
    num_blocks = sum(need) + randint(gen, 1, 5)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(1, max(need))), -1, dtype=torch.int32)
    start = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = order[start:start + nb]
        start += nb
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return tables, cu


def packed_gather_reference(pool, tables, lens):
    """Every sequence's rows, gathered through its table and packed one after another: ``(sum(lens), ROW)``."""
    page = pool.shape[1]
    parts = [pool[tables[s, :-(-n // page)].long()].reshape(-1, pool.shape[2])[:n] for s, n in enumerate(lens)]
    return torch.cat(parts) if parts else pool.new_zeros(0, pool.shape[2])


def _gather_source(row: torch.Tensor, pool: torch.Tensor) -> str:
    """Where in the pool a wrongly gathered row came from, when it is a whole pool row."""
    flat = pool.reshape(-1, pool.shape[-1])
    hits = (flat == row).all(1).nonzero()
    if hits.numel() == 0:
        return " (no row of the pool: a partial or mixed read)"
    index = int(hits[0])
    return f" (it is the pool's block {index // pool.shape[1]}, offset {index % pool.shape[1]})"


@exercise
def check_packed_gather_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(pool_ptr, tables_ptr, cu_ptr, out_ptr, PAGE, MAX_BLOCKS, ROW,
    BLOCK_T, BLOCK_R)`` launched with grid ``(num_seqs, cdiv(max_len, BLOCK_T))``: program ``(s, j)`` copies
    tokens ``j * BLOCK_T ..`` of sequence ``s`` (``cu[s + 1] - cu[s]`` tokens, its blocks in row ``s`` of the
    int32 ``tables (num_seqs, MAX_BLOCKS)``) from the contiguous float32 pool ``(num_blocks, PAGE, ROW)`` to rows
    ``cu[s] + t`` of the packed output ``(cu[-1], ROW)``. ``BLOCK_R`` is the next power of two >= ``ROW``. Without
    Triton the check says it is skipped."""
    name = "a packed gather of many sequences (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read 'Paged attention in PyTorch' and 'The kernel'; for the packed row named in this message, work "
            "out by hand which sequence and token it is, which table entry and offset hold that token, and "
            "compare with what your program read and where it wrote.")
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of (sequences, token tiles) programs")) is not None:
        return _report(unlaunchable)
    import triton  # only reached when Triton is installed

    gen = torch.Generator().manual_seed(seed_for(95))
    cases = _KERNEL_CASES
    if hidden():
        cases = cases + tuple((tuple(n + 3 for n in lens), page, row + 8, bt) for lens, page, row, bt in cases)
    for trial, (lens, page, row, block_t) in enumerate(cases):
        tables, cu = _packed_case(gen, lens, page)
        num_blocks = int(tables.max()) + 1 + randint(gen, 0, 3)
        # Guards, so that a kernel with a missing mask reads NaN and writes where the check looks, never into
        # memory it does not own: a NaN block before the pool (a table's -1 padding lands there), -1 entries
        # past the tables, and a tile's worth of NaN rows past the packed output.
        pool_store = torch.full(((num_blocks + 2) * page * row,), float("nan"))
        pool = pool_store[page * row:(num_blocks + 1) * page * row].view(num_blocks, page, row)
        pool.copy_(torch.randn(num_blocks, page, row, generator=gen))
        table_store = torch.full((tables.numel() + 64,), -1, dtype=torch.int32)
        table_store[:tables.numel()] = tables.flatten()
        tables = table_store[:tables.numel()].view(tables.shape)
        total = int(cu[-1])
        out = torch.full((total + block_t + 1, row), float("nan"))
        pool_before = pool_store.clone()
        grid = (len(lens), triton.cdiv(max(lens), block_t))
        try:
            kernel[grid](pool, tables, cu, out, page, tables.shape[1], ROW=row, BLOCK_T=block_t,
                         BLOCK_R=triton.next_power_of_2(row))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, f"trial {trial + 1}", hint))
        problem = None
        got = out[:total]
        expected = packed_gather_reference(pool, tables, lens)
        if not torch.equal(pool_store.nan_to_num(7.0), pool_before.nan_to_num(7.0)):
            problem = "the kernel changed the pool."
        elif not bool(torch.isnan(out[total:]).all()):
            problem = "the kernel wrote past the packed output (a token past its sequence stored without a mask?)."
        elif torch.isnan(got).any():
            problem = f"{int(torch.isnan(got).any(1).sum())} packed row(s) were never written."
        elif not torch.equal(got, expected):
            bad = int((got != expected).any(1).nonzero()[0])
            s = int((cu[1:] > bad).nonzero()[0])
            problem = (f"packed row {bad} (sequence {s}, its token {bad - int(cu[s])}) holds the wrong row"
                       f"{_gather_source(got[bad], pool)}.")
        if problem:
            return failed(name, f"trial {trial + 1} (lengths {list(lens)}, PAGE={page}, ROW={row}, "
                                f"BLOCK_T={block_t}): {problem} Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the packed gather on all the check's launches (ragged and empty "
                                        "sequences, blocks of 1 to 32 tokens)."))
