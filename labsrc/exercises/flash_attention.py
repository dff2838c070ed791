"""Checks for the exercises of the FlashAttention chapter.

Each check calls the student's function on seeded random inputs and compares it with an answer computed here
(never printed); it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the function still
raises ``NotImplementedError``.

:func:`tl_load` is a small PyTorch stand-in for Triton's ``tl.load`` that the masked-load exercise uses: it reads
``flat[offsets]`` where ``mask`` is true and returns ``other`` elsewhere, and it raises ``IndexError`` for an
unmasked offset outside the buffer (on a GPU that is an illegal memory access, or silently wrong data).
"""
from __future__ import annotations

import functools
import math
import types

import torch

from labsrc.exercises.core import (FAILED, NOT_SOLVED, Result, _code_names, _report, as_number, check_function,
                                   exercise, randint, refuse_library, triton_missing)




# ---------------------------------------------------------------------------------------------------------------
# Exercise: merge two partial softmax results
# ---------------------------------------------------------------------------------------------------------------

def _partial(scores: torch.Tensor, values: torch.Tensor):
    """(m, l, o) of one chunk of keys: row max, sum of exp(s - m), and the chunk's normalised output."""
    m = scores.max(dim=-1).values
    p = torch.exp(scores - m[:, None])
    l = p.sum(-1)
    return m, l, (p @ values) / l[:, None]


def _merge_inputs(gen: torch.Generator) -> tuple:
    rows, d = randint(gen, 1, 9), randint(gen, 1, 33)
    n1, n2 = randint(gen, 1, 40), randint(gen, 1, 40)
    # Chunks whose scores live on very different scales: exp() without the max shift overflows in fp32.
    s1 = torch.randn(rows, n1, generator=gen, dtype=torch.float64) * 3 + float(randint(gen, -120, 120))
    s2 = torch.randn(rows, n2, generator=gen, dtype=torch.float64) * 3 + float(randint(gen, -120, 120))
    v1 = torch.randn(n1, d, generator=gen, dtype=torch.float64)
    v2 = torch.randn(n2, d, generator=gen, dtype=torch.float64)
    return (*_partial(s1, v1), *_partial(s2, v2))


def _merge_reference(m1, l1, o1, m2, l2, o2):
    m = torch.maximum(m1, m2)
    w1, w2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    return (w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None]


@exercise
def check_merge(fn) -> Result:
    """Check ``fn(m1, l1, o1, m2, l2, o2) -> o``: the softmax-attention output over the union of two key chunks,
    given each chunk's row max ``m`` (rows,), normaliser ``l = sum exp(s - m)`` (rows,) and normalised output
    ``o`` (rows, d). Inputs are fp64."""
    return check_function("merge two partial softmax results", fn, _merge_reference, _merge_inputs,
                          trials=8, seed=31, rtol=1e-9, atol=1e-9,
                          hint="Bring both normalisers to the common max m = max(m1, m2) before weighting the "
                               "two outputs; each o is already divided by its own l.")


# ---------------------------------------------------------------------------------------------------------------
# Exercises: bytes moved by naive and by tiled (causal) attention
# ---------------------------------------------------------------------------------------------------------------

def _naive_inputs(gen: torch.Generator) -> tuple:
    return randint(gen, 1, 200_000), [32, 64, 80, 128, 256][randint(gen, 0, 4)], [1, 2, 4][randint(gen, 0, 2)]


def _naive_reference(T, D, dtype_bytes):
    # read Q, K; write S; read S, write P; read P, V; write O
    return dtype_bytes * (4 * T * D + 4 * T * T)


@exercise
def check_naive_bytes(fn) -> Result:
    """Check ``fn(T, D, dtype_bytes) -> bytes`` moved by naive single-head attention under the chapter's model:
    every tensor that a separate PyTorch op produces (S, then P) is written to memory and read back."""
    return check_function("bytes moved by naive attention", as_number(fn), _naive_reference, _naive_inputs,
                          trials=8, seed=32, rtol=1e-12, atol=0.5,
                          hint="Three ops: S = Q K^T, P = softmax(S), O = P V. Count what each reads and writes.")


def _tiled_inputs(gen: torch.Generator) -> tuple:
    return (randint(gen, 1, 5000), [32, 64, 80, 128][randint(gen, 0, 3)], [16, 32, 64, 128][randint(gen, 0, 3)],
            [1, 2, 4][randint(gen, 0, 2)])


def _tiled_causal_reference(T, D, block_m, dtype_bytes):
    n_blocks = math.ceil(T / block_m)
    keys_read = sum(min((i + 1) * block_m, T) for i in range(n_blocks))
    return dtype_bytes * (2 * T * D + 2 * keys_read * D)


def _measured_inputs(gen: torch.Generator) -> tuple:
    """Sizes small enough to run the chapter's tiled_attention on: odd T, partial last query blocks."""
    return randint(gen, 1, 150), randint(gen, 8, 48), [8, 16, 32][randint(gen, 0, 2)], 4


def check_tiled_causal_bytes(fn, measure=None, *, hidden: bool = False) -> Result:
    """Check ``fn(T, D, block_m, dtype_bytes) -> bytes`` moved by tiled causal attention (Tq = Tk = T, one head):
    Q read once, O written once, and each query block reads the K and V rows that any of its queries can see.

    With ``measure(T, D, block_m) -> bytes`` (the chapter's ``tiled_attention`` count, fp32) the prediction is
    compared with that *measurement* on sizes the student has not seen; without it, with the closed form.
    ``hidden=True`` runs the hidden case set, as for every check (see :func:`~labsrc.exercises.core.exercise`)."""
    return exercise(functools.partial(_check_tiled_causal_bytes, measure=measure))(fn, hidden=hidden)


def _functions_named_by(fn) -> list:
    """The Python functions ``fn``'s code names through its globals (what a measurement runs)."""
    code = getattr(fn, "__code__", None)
    glb = getattr(fn, "__globals__", {})
    names = _code_names(code) if code is not None else set()
    return [glb[n] for n in sorted(names) if isinstance(glb.get(n), types.FunctionType)]


def _check_tiled_causal_bytes(fn, measure) -> Result:
    if measure is not None:
        # A prediction must not run the measurement: refuse a call to it or to what it runs (tiled_attention).
        # The answer itself is left out: a measurement may well be built on the student's own function.
        refused = refuse_library("predicted vs measured bytes of tiled causal attention", fn,
                                 (measure, *(f for f in _functions_named_by(measure) if f is not fn)),
                                 "predict the count from the block structure alone: which key rows does each "
                                 "query block read?", owner="the measurement")
        if refused is not None:
            return refused
    if measure is None:
        return check_function("bytes moved by tiled causal attention", as_number(fn), _tiled_causal_reference,
                              _tiled_inputs, trials=10, seed=33, rtol=1e-12, atol=0.5,
                              hint="Query block i holds rows [i*block_m, min((i+1)*block_m, T)); its last row "
                                   "sees keys up to and including itself. The last block may be partial.")
    return check_function("predicted vs measured bytes of tiled causal attention", as_number(fn),
                          lambda T, D, block_m, dtype_bytes: measure(T, D, block_m) * dtype_bytes // 4,
                          _measured_inputs, trials=6, seed=36, rtol=1e-12, atol=0.5,
                          hint="Query block i holds rows [i*block_m, min((i+1)*block_m, T)); its last row "
                               "sees keys up to and including itself. The last block may be partial.")


# ---------------------------------------------------------------------------------------------------------------
# Exercise: the masked load
# ---------------------------------------------------------------------------------------------------------------

def tl_load(flat: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor, other: float = 0.0) -> torch.Tensor:
    """Emulate ``tl.load(ptr + offsets, mask=mask, other=other)`` on a 1-D tensor ``flat``.

    ``offsets`` and ``mask`` broadcast to one shape. Masked-off lanes read nothing and give ``other``; an unmasked
    lane whose offset lies outside ``flat`` raises ``IndexError`` (a GPU would fault or read garbage there).
    """
    offsets, mask = torch.broadcast_tensors(offsets, mask)
    bad = mask & ((offsets < 0) | (offsets >= flat.numel()))
    if bool(bad.any()):
        raise IndexError(f"unmasked load outside the buffer at offset {int(offsets[bad][0])} "
                         f"(buffer has {flat.numel()} elements)")
    safe = torch.where(mask, offsets, torch.zeros_like(offsets))
    return torch.where(mask, flat[safe], torch.tensor(other, dtype=flat.dtype))


def _tile_inputs(gen: torch.Generator) -> tuple:
    T, D = randint(gen, 1, 50), randint(gen, 1, 40)
    block_n = [4, 8, 16, 32][randint(gen, 0, 3)]
    block_d = 1 << max(0, (D - 1).bit_length())  # next power of two >= D, as a Triton kernel would use
    start = block_n * randint(gen, 0, (T - 1) // block_n)
    k = torch.randn(T, D, generator=gen)
    return k, start, block_n, block_d


def _tile_reference(k, start, block_n, block_d):
    T, D = k.shape
    tile = torch.zeros(block_n, block_d, dtype=k.dtype)
    rows = k[start : start + block_n]
    tile[: rows.shape[0], :D] = rows
    return tile


def _catch_index_error(fn):
    """Turn an out-of-bounds load into a wrong (NaN) answer, so the check reports it instead of crashing."""
    def wrapped(*args):
        try:
            return fn(*args)
        except IndexError as err:
            print(f"  (the load went out of bounds: {err})")
            k, _, block_n, block_d = args
            return torch.full((block_n, block_d), float("nan"), dtype=k.dtype)
    return wrapped


@exercise
def check_key_tile(fn) -> Result:
    """Check ``fn(k, start, block_n, block_d) -> tile``: the ``(block_n, block_d)`` tile of rows
    ``start .. start+block_n`` of the contiguous ``(T, D)`` matrix ``k``, zero where the row is ``>= T`` or the
    column is ``>= D``, loaded with :func:`tl_load` on ``k.flatten()``."""
    return check_function("masked load of a key tile", _catch_index_error(fn), _tile_reference, _tile_inputs,
                          trials=12, seed=34, rtol=0.0, atol=0.0,
                          hint="A lane is valid only if its row is inside the matrix AND its column is; in a "
                               "flattened row-major buffer, column D of row r is column 0 of row r + 1.")


# ---------------------------------------------------------------------------------------------------------------
# Exercise: write the online-softmax update of one key block as a Triton kernel
# ---------------------------------------------------------------------------------------------------------------

# The kernel the student writes is launched with these block sizes: tl.dot needs every dimension >= 16.
KERNEL_BLOCK_M = 16


def _block_update_reference(q, k, v, vis, m, l, acc, qk_scale):
    """Eq. (eq-fa-online) for one key block, in float64: the new (m, l, acc) stacked as (rows, 2 + D).

    Key j is visible to row i iff j < vis[i]; a row that has seen only invisible keys keeps m = -inf, l = 0,
    acc = 0 (the -inf rule: a set of scores that are all -inf adds nothing)."""
    q, k, v, m, l, acc = (t.double() for t in (q, k, v, m, l, acc))
    s = q @ k.T * qk_scale
    visible = torch.arange(k.shape[0])[None, :] < vis[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    m_new = torch.maximum(m, s.max(dim=1).values)
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s - m_safe[:, None])
    l_new = alpha * l + p.sum(1)
    acc_new = alpha[:, None] * acc + p @ v
    return torch.cat([m_new[:, None], l_new[:, None], acc_new], 1).float()


def _block_update_inputs(gen: torch.Generator, all_masked: bool = False) -> tuple:
    """One key block (1..block_n keys) and the running state of Tq rows: either fresh (m = -inf, l = 0,
    acc = 0, as before the first block) or left by an earlier block, with some rows that saw nothing."""
    tq, d = randint(gen, 1, 45), randint(gen, 1, 40)
    block_n = [16, 32][randint(gen, 0, 1)]
    n_keys = randint(gen, 1, block_n)
    q = torch.randn(tq, d, generator=gen)
    k = torch.randn(n_keys, d, generator=gen) * 2
    v = torch.randn(n_keys, d, generator=gen)
    vis = torch.randint(0, n_keys + 1, (tq,), generator=gen, dtype=torch.int32)
    vis[torch.rand(tq, generator=gen) < 0.25] = 0  # rows for which this whole block is masked (-inf scores)
    scale = 1 / math.sqrt(d)
    if all_masked or randint(gen, 0, 2) == 0:  # the first block: nothing seen yet
        m = torch.full((tq,), float("-inf"))
        l, acc = torch.zeros(tq), torch.zeros(tq, d)
        if all_masked or randint(gen, 0, 1) == 0:
            vis.zero_()  # every score of the block is -inf: the state must stay (-inf, 0, 0), never NaN
    else:  # the state an earlier block of keys left, with scores far from this block's
        n0 = randint(gen, 1, 30)
        k0, v0 = torch.randn(n0, d, generator=gen) * 4, torch.randn(n0, d, generator=gen)
        vis0 = torch.randint(0, n0 + 1, (tq,), generator=gen, dtype=torch.int32)
        state = _block_update_reference(q, k0, v0, vis0, torch.full((tq,), float("-inf")), torch.zeros(tq),
                                        torch.zeros(tq, d), scale)
        m, l, acc = state[:, 0].contiguous(), state[:, 1].contiguous(), state[:, 2:].contiguous()
    return q, k, v, vis, m, l, acc, scale, block_n


def _library_objects() -> tuple:
    """The lab's own attention kernels module and the kernels and helpers it defines: a call to them would hand
    in the library's answer instead of the student's."""
    from labsrc.show import _unwrap
    import labsrc.kernels.attention as lib

    return (lib, *(obj for obj in vars(lib).values()
                   if getattr(_unwrap(obj), "__module__", None) == lib.__name__ and callable(_unwrap(obj))))


def _launcher(kernel):
    """Launch the student's kernel like the chapter does and return the updated state (rows, 2 + D)."""
    from labsrc import runtime

    def run(q, k, v, vis, m, l, acc, scale, block_n):
        dev = runtime.DEVICE
        # copies: the kernel updates m, l, acc in place, and the reference still needs the originals
        q, k, v, vis, m, l, acc = (t.to(dev).clone().contiguous() for t in (q, k, v, vis, m, l, acc))
        tq, d = q.shape
        block_d = max(16, 1 << (d - 1).bit_length())
        grid = (-(-tq // KERNEL_BLOCK_M),)
        try:
            kernel[grid](q, k, v, vis, m, l, acc, tq, k.shape[0], d, scale,
                         BLOCK_M=KERNEL_BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d)
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - a compiled stub reports its NotImplementedError inside
            if "NotImplementedError" in repr(err) or "NotImplementedError" in str(err.__cause__):
                raise NotImplementedError from err
            print(f"  (the kernel raised {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})")
            return torch.full((tq, 2 + d), float("nan"))
        return torch.cat([m[:, None], l[:, None], acc], 1).cpu()
    return run


def _is_kernel(fn) -> bool:
    from labsrc.kernels._triton import triton

    return isinstance(fn, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction))


@exercise
def check_online_softmax_kernel(kernel) -> Result:
    """Check the student's ``@triton.jit`` kernel ``kernel(Q, K, V, VIS, M, L, ACC, Tq, n_keys, D, qk_scale,
    BLOCK_M, BLOCK_N, BLOCK_D)``: for each block of BLOCK_M query rows it folds one block of ``n_keys`` keys
    into the running ``(m, l, acc)`` in place (key j visible to row i iff j < VIS[i]; natural-log units).

    It is launched on ``cdiv(Tq, 16)`` programs over random odd sizes, fresh and carried-over states, and blocks
    whose scores are all -inf, and compared with a float64 PyTorch reference. Without Triton it is skipped."""
    from labsrc import runtime

    name = "the online-softmax update of one key block (Triton kernel)"
    if not runtime.HAS_TRITON:
        return triton_missing(name)
    if not callable(kernel) and not _is_kernel(kernel):
        return _report(Result(name, FAILED, "expected a kernel. Hint: decorate the function with @triton.jit."))
    refused = refuse_library(name, kernel, _library_objects(), "write the update with tl.load, tl.dot, tl.max, "
                             "tl.exp and tl.where yourself.", owner="the lab")
    if refused is not None:
        return refused
    if not _is_kernel(kernel):
        try:  # the stub of the student build raises before anything else
            kernel()
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        except Exception:  # noqa: BLE001
            pass
        return _report(Result(name, FAILED, "this is a Python function, not a kernel. Hint: decorate it with "
                                            "@triton.jit and launch nothing yourself; the check launches it."))
    calls = iter(range(1 << 30))

    def make_inputs(gen):  # the first case of every run is a first block whose scores are all -inf
        return _block_update_inputs(gen, all_masked=next(calls) == 0)

    atol = 1e-4 if runtime.INTERPRETED else 2e-2  # a GPU's fp32 tl.dot may use TF32 unless told "ieee"
    return check_function(name, _launcher(kernel), _block_update_reference_launch, make_inputs,
                          trials=10, seed=35, rtol=1e-4, atol=atol,
                          hint="Mask the keys a row may not see to -inf before the row max; when a row's new max "
                               "is still -inf, subtract 0 instead so exp gives 0, not exp(-inf - -inf) = NaN; "
                               "rescale the old l and acc by exp(m_old - m_new) before adding the block.")


def _block_update_reference_launch(q, k, v, vis, m, l, acc, scale, block_n):
    return _block_update_reference(q, k, v, vis, m, l, acc, scale)
