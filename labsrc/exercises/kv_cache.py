"""Checks for the exercises of the KV-cache chapter.

Each check calls the student's function on several seeded random configurations and compares it with
:mod:`labsrc.kvmath`; it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the
function still raises ``NotImplementedError``. Expected answers are computed here, never printed. A function
that calls the :mod:`labsrc.kvmath` function it is asked to write (or any of its helpers that would do the
work) fails: the exercise is the derivation, not the call.
"""
from __future__ import annotations

import torch

from labsrc import kvmath
from labsrc.exercises.core import (FAILED, NOT_SOLVED, PASSED, Result, _report, _with_hint, as_number,
                                   check_function, check_value, exercise, hidden, randint, refuse_library,
                                   triton_missing)
from labsrc.kernels._triton import HAS_TRITON


def _library() -> tuple:
    """What a student's code may not use: :mod:`labsrc.kvmath` and the functions that would do the work, and
    the lab's own KV-store kernel (its module is imported only where Triton is)."""
    found = [kvmath, kvmath.kv_cache_bytes, kvmath.gqa_cache_bytes, kvmath.kv_bytes_per_token,
             kvmath.kv_equals_weights_context, kvmath.mla_cache_bytes, kvmath.mla_equivalent_kv_heads,
             kvmath.mlkv_cache_bytes, kvmath.reservation_utilisation, kvmath.paged_utilisation, kvmath.calculator,
             kvmath.PRESETS, kvmath.ModelPreset.weight_bytes, kvmath.ModelPreset.kv_bytes_per_token]
    if HAS_TRITON:
        from labsrc.kernels import kv_store
        found += [kv_store, kv_store.kv_store, kv_store.kv_store_ref, kv_store._kv_store_kernel]
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
    return kvmath.gqa_cache_bytes(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)


@exercise
def check_gqa_bytes(fn) -> Result:
    """Check ``fn(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes) -> bytes`` of a GQA cache."""
    name, hint = ("KV-cache bytes of a GQA model",
                  "compare your count with the failing trial's arguments, then re-read 'How many bytes': "
                  "list what one token adds to one layer's cache and which head count that is.")
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_function(
        name, as_number(fn), _gqa_reference, _gqa_inputs, trials=8, seed=11, rtol=1e-12, atol=0.5, hint=hint,
        arg_names=("n_layers", "n_heads", "n_kv_heads", "head_dim", "seq_len", "batch", "dtype_bytes"))


@exercise
def check_v3_crossover(fn) -> Result:
    """Check ``fn() -> tokens``: the context at which DeepSeek-V3's bf16 cache (batch 1) weighs as much as its
    bf16 weights, all 671B of them resident. The student computes it from the published shape, not from kvmath."""
    name, hint = ("DeepSeek-V3: context at which the cache outweighs the weights",
                  "the answer divides two byte counts, so check each on its own against 'MLA and MLKV against "
                  "the source': which parameters are resident (not only those one token reads), and what one "
                  "token adds to one layer's MLA cache.")
    v3 = kvmath.PRESETS["DeepSeek-V3"]
    expected = kvmath.kv_equals_weights_context(v3.weight_bytes(2), v3.kv_bytes_per_token(2))
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_value(name, fn, expected, rtol=2e-3, hint=hint)


def _waste_inputs(gen: torch.Generator) -> tuple:
    max_len = [512, 1000, 2048, 4096][randint(gen, 0, 3)]
    n = randint(gen, 1, 300)
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    return lengths, max_len


def _waste_reference(lengths, max_len):
    return 1.0 - kvmath.reservation_utilisation(lengths.numpy(), max_len)


@exercise
def check_reservation_waste(fn) -> Result:
    """Check ``fn(lengths, max_len) -> fraction`` of reserved slots left empty when each request reserves
    ``max_len`` slots and uses ``lengths[i]`` of them (``lengths`` is a 1-D int64 tensor)."""
    name, hint = ("fraction wasted by max-length reservation",
                  "re-read 'Fragmentation: reserving the maximum length'; your answer must lie in [0, 1], be 0 "
                  "when every request uses all max_len slots, and grow as requests get shorter.")
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_function(
        name, as_number(fn), _waste_reference, _waste_inputs, trials=8, seed=13, rtol=1e-6, atol=1e-9, hint=hint)


def _mla_heads_inputs(gen: torch.Generator) -> tuple:
    return ([128, 256, 384, 512, 1536][randint(gen, 0, 4)], [16, 32, 64][randint(gen, 0, 2)],
            [64, 96, 128, 192][randint(gen, 0, 3)])


def _mla_heads_reference(kv_lora_rank, qk_rope_head_dim, head_dim):
    return kvmath.mla_equivalent_kv_heads(kv_lora_rank, qk_rope_head_dim, head_dim)


@exercise
def check_mla_equivalent_heads(fn) -> Result:
    """Check ``fn(kv_lora_rank, qk_rope_head_dim, head_dim) -> heads``: how many GQA K/V heads of ``head_dim``
    cost as many cache bytes per layer and token as one MLA latent plus its RoPE key (a float)."""
    name, hint = ("MLA as an equivalent number of K/V heads",
                  "re-read 'MLA and MLKV against the source' and count, for one token and one layer, the "
                  "numbers each design caches; the failing trial shows which argument your count misuses.")
    refused = _asks_library(name, fn, hint)
    return refused if refused is not None else check_function(
        name, as_number(fn), _mla_heads_reference, _mla_heads_inputs, trials=8, seed=14, rtol=1e-9, hint=hint,
        arg_names=("kv_lora_rank", "qk_rope_head_dim", "head_dim"))


# ----------------------------------------------------------------------------------------------------------
# The kernel exercise: a masked copy of new K/V rows into cache slots, written as a @triton.jit kernel.
KV_STORE_BLOCK = 32
"""The ``BLOCK`` the check launches the student's kernel with: smaller than most of its row sizes and not a
divisor of them, so a kernel without a mask (or with the wrong one) is caught."""


def _is_kernel(obj) -> bool:
    """A Triton kernel (``@triton.jit``, compiled or interpreted) is launched as ``kernel[grid](...)``."""
    return callable(getattr(obj, "__getitem__", None)) and hasattr(obj, "fn")


def _store_inputs(gen: torch.Generator) -> tuple:
    """One random store: odd, non-power-of-two row sizes (n_kv_heads x head_dim), distinct scattered slots of
    either index dtype, every cache dtype; caches poisoned with NaN so a missing or stray write shows."""
    heads, dim = randint(gen, 1, 5), [7, 24, 33, 48, 50][randint(gen, 0, 4)]
    n_slots = randint(gen, 5, 60)
    n_rows = randint(gen, 1, n_slots)
    dtype = [torch.float32, torch.float16, torch.bfloat16][randint(gen, 0, 2)]
    slot_dtype = [torch.int32, torch.int64][randint(gen, 0, 1)]
    slots = torch.randperm(n_slots, generator=gen)[:n_rows].to(slot_dtype)
    k_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype)
    v_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype)
    return n_slots, k_new, v_new, slots


def _kernel_problem(kernel, n_slots, k_new, v_new, slots) -> str | None:
    """Launch the student's kernel on one store and say what is wrong, or None when it matches kv_store_ref."""
    from labsrc.kernels._triton import triton
    from labsrc.kernels.kv_store import kv_store_ref

    n_rows, heads, dim = k_new.shape
    row_size = heads * dim
    shape = (n_slots, heads, dim)
    k_cache = torch.full(shape, float("nan"), dtype=k_new.dtype)
    v_cache = torch.full(shape, float("nan"), dtype=k_new.dtype)
    k_ref, v_ref = kv_store_ref(k_cache.clone(), v_cache.clone(), k_new, v_new, slots)
    grid = (n_rows, triton.cdiv(row_size, KV_STORE_BLOCK))
    kernel[grid](k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK=KV_STORE_BLOCK)
    for name, got, want in (("k_cache", k_cache, k_ref), ("v_cache", v_cache, v_ref)):
        written = ~torch.isnan(want).all(dim=(1, 2))
        if not torch.equal(got[written], want[written]):
            diff = (got[written] != want[written]).flatten(1)      # NaN != NaN: an unwritten element counts
            bad = diff.any(dim=1).sum()
            first = int(diff.any(dim=0).nonzero()[0])
            return (f"{int(bad)} of the {n_rows} slots that should hold a new row differ in {name}; the first "
                    f"wrong element is element {first} of a row of {row_size} (block {first // KV_STORE_BLOCK}).")
        if not torch.isnan(got[~written]).all():
            return f"{name} changed at slots that no new row was meant for."
    return None


def _not_implemented(err: BaseException) -> bool:
    """The student build's stub raises NotImplementedError; Triton's interpreter re-raises it wrapped."""
    seen = err
    while seen is not None:
        if isinstance(seen, NotImplementedError) or "NotImplementedError" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@exercise
def check_kv_store_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK)`` that
    copies ``k_new[i]``/``v_new[i]`` to ``k_cache[slots[i]]``/``v_cache[slots[i]]``, launched on the grid
    ``(n_rows, cdiv(row_size, BLOCK))`` under the interpreter on random stores, against ``kv_store_ref``.

    Without Triton (macOS, Windows) it says the exercise is skipped and neither passes nor fails.
    """
    name = "a masked copy into cache slots, as a Triton kernel"
    hint = ("re-read 'The kernel: storing new rows into a preallocated cache'. The trial above has row sizes "
            "that BLOCK does not divide: 'differ' points at the source or destination addresses of a row, "
            "'changed at slots' at a write past the end of a row or into the wrong row.")
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
    trials = 6 * (2 if hidden() else 1)
    gen = torch.Generator().manual_seed(15 + (1000 if hidden() else 0))
    for trial in range(trials):
        n_slots, k_new, v_new, slots = _store_inputs(gen)
        try:
            problem = _kernel_problem(kernel, n_slots, k_new, v_new, slots)
        except Exception as err:  # noqa: BLE001 - a crash inside the student's kernel is reported, not raised
            if _not_implemented(err):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            problem = f"the launch raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if problem:
            what = (f"trial {trial + 1} ({k_new.shape[0]} rows of {tuple(k_new.shape[1:])} {k_new.dtype} into "
                    f"{n_slots} slots, {slots.dtype} slots, BLOCK={KV_STORE_BLOCK})")
            return _report(Result(name, FAILED, _with_hint(f"{what}: {problem}", hint)))
    return _report(Result(name, PASSED, f"equal to kv_store_ref on {trials} random stores."))
