"""Checks for the exercises of the KV-cache chapter.

Each check calls the student's function on several seeded random configurations and compares it with what
this module computes or measures: closed forms from :mod:`labsrc.kv_cache`, a paged cache's utilisation measured
on seeded request mixes (for the prediction), a store into a head-major cache (for the kernel). It prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the
function still raises ``NotImplementedError``. Expected answers are computed here, never printed. A function
that calls the :mod:`labsrc.kv_cache` function it is asked to write (or any of its helpers that would do the
work) fails: the exercise is the derivation, not the call.
"""
from __future__ import annotations

import math

import torch

from labsrc import kv_cache
from labsrc.exercises.core import stub_raised
from labsrc.exercises.core import (FAILED, NOT_SOLVED, PASSED, Refused, Result, _report, _with_hint, as_number,
                                   check_function, exercise, fail, guarded, randint, refusal, refuse_library,
                                   seed_for, trials_for, triton_missing)
from labsrc.kernels._triton import HAS_TRITON


def _library() -> tuple:
    """What a student's code may not use: :mod:`labsrc.kv_cache` and the functions that would do the work, and
    the lab's own KV-store kernel (its module is imported only where Triton is)."""
    found = [kv_cache, kv_cache.kv_cache_bytes, kv_cache.gqa_cache_bytes, kv_cache.kv_bytes_per_token,
             kv_cache.kv_equals_weights_context, kv_cache.mla_cache_bytes, kv_cache.mla_equivalent_kv_heads,
             kv_cache.mlkv_cache_bytes, kv_cache.reservation_utilisation, kv_cache.paged_utilisation, kv_cache.calculator,
             kv_cache.PRESETS, kv_cache.ModelPreset.weight_bytes, kv_cache.ModelPreset.kv_bytes_per_token]
    if HAS_TRITON:
        from labsrc.kernels import kv_cache as kv_cache_kernel
        found += [kv_cache_kernel, kv_cache_kernel.kv_store, kv_cache_kernel.kv_store_ref,
                  kv_cache_kernel._kv_store_kernel]
    return tuple(found)


def _asks_library(name: str, fn, hint: str, what: str = "derive the answer yourself") -> Result | None:
    """A failed result when ``fn`` calls the lab's own implementation instead of computing the answer."""
    return refuse_library(name, fn, _library(), f"{what}. {hint}")


def _gqa_inputs(gen: torch.Generator) -> tuple:
    n_kv_heads = [1, 2, 4, 8][randint(gen, 0, 3)]
    n_heads = n_kv_heads * randint(gen, 1, 8)
    return (randint(gen, 1, 96), n_heads, n_kv_heads, [64, 96, 128, 256][randint(gen, 0, 3)],
            randint(gen, 1, 200_000), randint(gen, 1, 16), [1, 2, 4][randint(gen, 0, 2)])


def _gqa_reference(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return kv_cache.gqa_cache_bytes(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)


@exercise
def check_gqa_bytes(fn) -> Result:
    """Check ``fn(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes) -> bytes`` of a GQA cache."""
    name, hint = ("KV-cache bytes of a GQA model",
                  "compare your count with the failing trial's arguments, then re-read 'How many bytes': "
                  "list what one token adds to one layer's cache and which head count that is.")
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_function(
        name, as_number(fn), _gqa_reference, _gqa_inputs, trials=8, seed=11, rtol=1e-12, atol=0.5, hint=hint,
        forbidden=_library())


def _rate_inputs(gen: torch.Generator) -> tuple:
    """A model and a card of today's sizes, at a context from 1K to 1M tokens: sometimes only a few sequences
    fit beside the weights (the whole number matters), sometimes not one, sometimes not even the weights."""
    weight_bytes = randint(gen, 1, 400) * 1e9
    kv_bytes_per_token = randint(gen, 8, 400) * 1024
    context = 2 ** randint(gen, 10, 20) + randint(gen, 0, 999)
    hbm_bytes = [24e9, 40e9, 80e9, 141e9, 192e9][randint(gen, 0, 4)]
    hbm_bytes_per_s = [0.9e12, 2.0e12, 3.35e12, 4.8e12, 8e12][randint(gen, 0, 4)]
    return weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s


def _rate_at(batch, weight_bytes, kv_bytes_per_token, context, hbm_bytes_per_s):
    """Eq. (eq-kv-floor)'s tokens/s ceiling of one batch size."""
    return batch * hbm_bytes_per_s / (weight_bytes + batch * context * kv_bytes_per_token)


def _rate_reference(weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s):
    batch = max(0, int((hbm_bytes - weight_bytes) // (context * kv_bytes_per_token)))
    return 0.0 if batch == 0 else _rate_at(batch, weight_bytes, kv_bytes_per_token, context, hbm_bytes_per_s)


@exercise
def check_decode_rate_ceiling(fn) -> Result:
    """Check ``fn(weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s) -> tokens/s``: the
    bandwidth ceiling of decode on one card that holds the weights and as many whole sequences of ``context``
    tokens as fit beside them (0 when not one fits)."""
    name, hint = ("decode ceiling when memory caps the batch",
                  "work the failing trial by hand: how many whole sequences fit, what one step of that batch "
                  "reads, and how many tokens that step produces.")
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_function(
        name, as_number(fn), _rate_reference, _rate_inputs, trials=12, seed=12, rtol=1e-9, atol=1e-9, hint=hint,
        forbidden=_library())


def _paged_inputs(gen: torch.Generator) -> tuple:
    """A seeded log-normal mix of request lengths (median and spread drawn too), and a block size from a
    twentieth to a third of the median: blocks small enough that a request spans several, large enough that
    their waste shows."""
    median = [150, 300, 600, 1200][randint(gen, 0, 3)]
    sigma = 0.4 + 0.7 * float(torch.rand((), generator=gen))
    sizes = [b for b in (8, 16, 32, 64, 128, 256) if median / 20 <= b <= median / 3]
    block_size = sizes[randint(gen, 0, len(sizes) - 1)]
    lengths = kv_cache.sample_request_lengths(PAGED_REQUESTS, 1 << 20, seed=randint(gen, 0, 10**6), median=median,
                                              sigma=sigma)
    return lengths, block_size


PAGED_REQUESTS = 4000
"""Requests in each mix the check serves: enough that the measured utilisation is close to its expectation."""
PAGED_TOLERANCE = 0.005
"""How far a prediction may be from the measured utilisation (a fraction: half a percentage point)."""


@exercise
def check_paged_utilisation(fn) -> Result:
    """Check ``fn(mean_length, block_size) -> fraction``: a *prediction*, from the mean request length alone,
    of the fraction of allocated slots that hold a token when caches grow in blocks of ``block_size``. It is
    compared, within ``PAGED_TOLERANCE``, with the utilisation *measured* by serving seeded random request mixes
    in blocks (mixes whose mean the prediction is given)."""
    name, hint = ("predicted utilisation of a paged cache",
                  "re-read 'Fragmentation: reserving the maximum length' and think about one request: how many "
                  "slots of its last block stay empty, on average over many requests of different lengths?")
    refused = _asks_library(name, fn, hint, "predict it yourself")
    if refused is not None:
        return refused
    trials = trials_for(8)
    gen = torch.Generator().manual_seed(seed_for(17))
    predict = as_number(guarded(fn, _library()))
    for trial in range(trials):
        lengths, block_size = _paged_inputs(gen)
        mean = float(lengths.mean())
        try:
            got = predict(mean, block_size)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        except Refused as refused:
            return refusal(name, refused.names, hint)
        measured = kv_cache.paged_utilisation(lengths, block_size)
        case = (f"trial {trial + 1} of {trials}, {PAGED_REQUESTS} requests of mean length {mean:.1f}, "
                f"blocks of {block_size}")
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return fail(name, case, f"expected a number, got {type(got).__name__}.", hint)
        if not abs(got - measured) <= PAGED_TOLERANCE:
            # pass or fail only: the gap to the measurement, or its side, would let a search replace the reasoning
            return fail(name, case, "the prediction is not within the tolerance of the utilisation measured on "
                                    "this mix.", hint)
    return _report(Result(name, PASSED, f"within {PAGED_TOLERANCE} of the measured utilisation on {trials} "
                                        f"request mixes."))


def _mla_heads_inputs(gen: torch.Generator) -> tuple:
    return ([128, 256, 384, 512, 1536][randint(gen, 0, 4)], [16, 32, 64][randint(gen, 0, 2)],
            [64, 96, 128, 192][randint(gen, 0, 3)])


def _mla_heads_reference(kv_lora_rank, qk_rope_head_dim, head_dim):
    return kv_cache.mla_equivalent_kv_heads(kv_lora_rank, qk_rope_head_dim, head_dim)


@exercise
def check_mla_equivalent_heads(fn) -> Result:
    """Check ``fn(kv_lora_rank, qk_rope_head_dim, head_dim) -> heads``: how many GQA K/V heads of ``head_dim``
    cost as many cache bytes per layer and token as one MLA latent plus its RoPE key (a float)."""
    name, hint = ("MLA as an equivalent number of K/V heads",
                  "count, for one token and one layer, the numbers each design caches, and check your relation "
                  "on the failing trial's arguments by hand.")
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_function(
        name, as_number(fn), _mla_heads_reference, _mla_heads_inputs, trials=8, seed=14, rtol=1e-9, hint=hint,
        forbidden=_library())


# ----------------------------------------------------------------------------------------------------------
# The kernel exercise: the store into a head-major cache ([n_kv_heads, n_slots, head_dim], transformers' layout),
# which the chapter's kernel (token-major, [n_slots, n_kv_heads, head_dim]) does not cover.
KV_STORE_BLOCK = 32
"""The ``BLOCK`` the check launches the student's kernel with: smaller than most of its row sizes and not a
divisor of them, so a kernel without a mask (or with the wrong one) is caught."""


def _is_kernel(obj) -> bool:
    """A Triton kernel (``@triton.jit``, compiled or interpreted) is launched as ``kernel[grid](...)``."""
    return callable(getattr(obj, "__getitem__", None)) and hasattr(obj, "fn")


def _store_inputs(gen: torch.Generator) -> tuple:
    """One random store: odd, non-power-of-two row sizes (n_kv_heads x head_dim, several heads in most), distinct
    scattered slots of either index dtype, every cache dtype; caches poisoned with NaN so a missing or stray
    write shows."""
    heads, dim = randint(gen, 2, 5), [7, 24, 33, 48, 50][randint(gen, 0, 4)]
    n_slots = randint(gen, 5, 60)
    n_rows = randint(gen, 1, n_slots)
    dtype = [torch.float32, torch.float16, torch.bfloat16][randint(gen, 0, 2)]
    slot_dtype = [torch.int32, torch.int64][randint(gen, 0, 1)]
    slots = torch.randperm(n_slots, generator=gen)[:n_rows].to(slot_dtype)
    k_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype)
    v_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype)
    return n_slots, k_new, v_new, slots


def _head_major_ref(k_cache, v_cache, k_new, v_new, slots):
    """The store into head-major caches ``[n_kv_heads, n_slots, head_dim]``: head h of new row i goes to
    ``cache[h, slots[i]]``."""
    k_cache[:, slots.long()] = k_new.transpose(0, 1)
    v_cache[:, slots.long()] = v_new.transpose(0, 1)
    return k_cache, v_cache


def _guarded(shape: tuple, guard: int, fill: torch.Tensor | None = None, dtype=None) -> tuple:
    """``(view, storage)``: a contiguous tensor of ``shape`` in the middle of a NaN-filled buffer with ``guard``
    elements on each side, so that a kernel's load or store past either end stays inside memory the check owns
    (the interpreter does not check bounds) and a stray store shows there."""
    numel = math.prod(shape)
    storage = torch.full((numel + 2 * guard,), float("nan"), dtype=fill.dtype if fill is not None else dtype)
    view = storage[guard:guard + numel].view(shape)
    if fill is not None:
        view.copy_(fill)
    return view, storage


def _kernel_problem(kernel, n_slots, k_new, v_new, slots) -> str | None:
    """Launch the student's kernel on one store and say what is wrong, or None when it matches the reference."""
    from labsrc.kernels._triton import triton

    n_rows, heads, dim = k_new.shape
    row_size = heads * dim
    shape = (heads, n_slots, dim)
    # Room for a whole block past any end, in any head, in either layout.
    guard = (KV_STORE_BLOCK // dim + 2) * n_slots * dim + 2 * KV_STORE_BLOCK
    k_cache, k_storage = _guarded(shape, guard, dtype=k_new.dtype)
    v_cache, v_storage = _guarded(shape, guard, dtype=k_new.dtype)
    k_in, _ = _guarded(tuple(k_new.shape), guard, fill=k_new)
    v_in, _ = _guarded(tuple(v_new.shape), guard, fill=v_new)
    k_ref, v_ref = _head_major_ref(k_cache.clone(), v_cache.clone(), k_new, v_new, slots)
    grid = (n_rows, triton.cdiv(row_size, KV_STORE_BLOCK))
    kernel[grid](k_cache, v_cache, k_in, v_in, slots, n_slots, dim, row_size, BLOCK=KV_STORE_BLOCK)
    for name, got, want, new, storage in (("k_cache", k_cache, k_ref, k_new, k_storage),
                                          ("v_cache", v_cache, v_ref, v_new, v_storage)):
        outside = torch.cat([storage[:guard], storage[-guard:]])
        if not torch.isnan(outside).all():
            return f"the kernel wrote outside {name} (past its first or last element)."
        if torch.equal(got.nan_to_num(1e4), want.nan_to_num(1e4)):
            continue
        written = torch.zeros(n_slots, dtype=torch.bool)
        written[slots.long()] = True
        wrong = (got != want) & ~(torch.isnan(got) & torch.isnan(want))        # (heads, slots, dim)
        if bool(wrong[:, ~written].any()):
            h, slot = (int(i) for i in wrong[:, ~written].any(-1).nonzero()[0])
            other = int(torch.arange(n_slots)[~written][slot])
            return f"{name} changed at head {h} of slot {other}, which no new row was meant for."
        h, slot, d = (int(i) for i in wrong.nonzero()[0])
        return (f"{int(wrong.any(-1).sum())} (head, slot) rows of {name} that should hold new values differ; the "
                f"first wrong element is head {h}, slot {slot}, dimension {d} (head_dim {dim}, {heads} heads).")
    return None


@exercise
def check_kv_store_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(k_cache, v_cache, k_new, v_new, slots, n_slots, head_dim, row_size,
    BLOCK)`` that stores head ``h`` of ``k_new[i]``/``v_new[i]`` (``[n_rows, n_kv_heads, head_dim]``) into
    ``k_cache[h, slots[i]]``/``v_cache[h, slots[i]]`` of head-major caches ``[n_kv_heads, n_slots, head_dim]``,
    launched on the grid ``(n_rows, cdiv(row_size, BLOCK))`` under the interpreter on random stores.

    Without Triton (macOS, Windows) it says the exercise is skipped and neither passes nor fails.
    """
    name = "a store into a head-major cache, as a Triton kernel"
    hint = ("re-read 'The kernel: storing new rows into a preallocated cache' and draw where one new row's "
            "elements land in a head-major cache; the failing trial names the first element that went wrong.")
    if not HAS_TRITON:
        return triton_missing(name)
    if not _is_kernel(kernel):
        try:
            kernel()
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
        except Exception:  # noqa: BLE001 - any other outcome is the same failure: it is not a kernel
            pass
        return _report(Result(name, FAILED, _with_hint(
            f"expected a @triton.jit kernel, got {type(kernel).__name__}.", hint)))
    refused = _asks_library(name, kernel, hint, "the kernel must do the copy itself")
    if refused is not None:
        return refused
    trials = trials_for(6)
    gen = torch.Generator().manual_seed(seed_for(15))
    for trial in range(trials):
        n_slots, k_new, v_new, slots = _store_inputs(gen)
        try:
            problem = _kernel_problem(kernel, n_slots, k_new, v_new, slots)
        except Exception as err:  # noqa: BLE001 - a crash inside the student's kernel is reported, not raised
            if stub_raised(err):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            problem = f"the launch raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if problem:
            what = (f"trial {trial + 1} ({k_new.shape[0]} rows of {tuple(k_new.shape[1:])} {k_new.dtype} into "
                    f"{n_slots} slots, {slots.dtype} slots, BLOCK={KV_STORE_BLOCK})")
            return _report(Result(name, FAILED, _with_hint(f"{what}: {problem}", hint)))
    return _report(Result(name, PASSED, f"equal to the reference on {trials} random stores."))
