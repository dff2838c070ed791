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
                          trials=8, seed=31, rtol=1e-9, atol=1e-9, explain=_explaining_merge(fn),
                          hint="re-read 'Online softmax' and test your merge on a tiny case against softmax "
                               "attention over both chunks' keys at once; in these trials the two chunks' "
                               "scores sit on very different scales.")


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
                          arg_names=("T", "D", "dtype_bytes"),
                          hint="re-read 'How many bytes each version moves': list each op of naive attention "
                               "with every tensor it reads and writes and that tensor's shape.")


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


_TILED_HINT = ("re-read 'Tiled attention in plain PyTorch' and count, query block by query block, the key and "
               "value rows that block reads under the causal mask.")


def _explaining_merge(fn):
    """``explain`` for the merge: two properties any right merge has, tried on the failing trial's chunks."""
    def explain(got, expected, m1, l1, o1, m2, l2, o2) -> str:
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.isfinite(got).all():
            return "Some outputs are inf or NaN: an exp overflowed or divided by zero."
        same = fn(m1, l1, o1, m1, l1, o1)
        if not (isinstance(same, torch.Tensor) and torch.allclose(same, o1, rtol=1e-9, atol=1e-9)):
            return "Merging the first chunk with itself does not give back its own output o1."
        swapped = fn(m2, l2, o2, m1, l1, o1)
        if not (isinstance(swapped, torch.Tensor) and torch.allclose(swapped, got, rtol=1e-9, atol=1e-9)):
            return "Your merge depends on which chunk comes first; the union of two chunks does not."
        level = fn(m1, l1, o1, m1, l2, o2)   # both chunks with the same row max
        if isinstance(level, torch.Tensor) and torch.allclose(level, _merge_reference(m1, l1, o1, m1, l2, o2),
                                                              rtol=1e-9, atol=1e-9):
            return "Your merge is right when the two chunks have the same row max, and wrong when they do not."
        return ""
    return explain


def _explaining_tiled(fn):
    """``explain`` for the tiled count: a count that is right when block_m divides T but wrong here has the
    partial last query block wrong."""
    def explain(got, expected, T, D, block_m, dtype_bytes) -> str:
        if T % block_m == 0:
            return ""
        whole = block_m * -(-T // block_m)
        if as_number(fn)(whole, D, block_m, dtype_bytes) == _tiled_causal_reference(whole, D, block_m, dtype_bytes):
            return (f"Your count is right for T={whole}, a multiple of block_m, and wrong here: look at the last, "
                    f"partial query block.")
        return ""
    return explain


def _explain_tile(got, expected, k, start, block_n, block_d) -> str:
    """Where the wrong lanes of a key tile are: past the last row, past the last column, or inside the matrix."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    T, D = k.shape
    bad = ~((got == expected) | (torch.isnan(got) & torch.isnan(expected)))
    rows = torch.arange(block_n)[:, None] + start
    cols = torch.arange(block_d)[None, :]
    places = [((rows < T) & (cols < D), "inside the matrix"), ((rows < T) & (cols >= D), "in columns past D"),
              ((rows >= T), "in rows past the matrix's last row")]
    wrong = [where for region, where in places if bool((bad & region).any())]
    return f"The wrong lanes are {' and '.join(wrong)} (T={T}, D={D}, start={start})." if wrong else ""


def _explain_block_update(got, expected, q, k, v, vis, m, l, acc, scale, block_n) -> str:
    """Which part of the state (m, l or acc) goes wrong first, and for what kind of row."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    bad = ~torch.isclose(got.double(), expected.double(), rtol=1e-4, atol=1e-4, equal_nan=True)
    if not bad.any():
        return ""
    row = int(bad.any(1).nonzero()[0])
    part = "m" if bad[row, 0] else "l" if bad[row, 1] else "acc"
    seen = "a fresh row (nothing seen before)" if m[row] == float("-inf") else "a row with an earlier state"
    sees = "none of this block's keys" if int(vis[row]) == 0 else f"{int(vis[row])} of its {k.shape[0]} keys"
    nan = " and comes out NaN" if torch.isnan(got[row]).any() else ""
    return f"Row {row} is wrong first, in {part}{nan}: it is {seen} that may see {sees}."


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
                              _tiled_inputs, trials=10, seed=33, rtol=1e-12, atol=0.5, explain=_explaining_tiled(fn),
                              arg_names=("T", "D", "block_m", "dtype_bytes"), hint=_TILED_HINT)
    return check_function("predicted vs measured bytes of tiled causal attention", as_number(fn),
                          lambda T, D, block_m, dtype_bytes: measure(T, D, block_m) * dtype_bytes // 4,
                          _measured_inputs, trials=6, seed=36, rtol=1e-12, atol=0.5, explain=_explaining_tiled(fn),
                          hint=_TILED_HINT)


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
                          trials=12, seed=34, rtol=0.0, atol=0.0, explain=_explain_tile,
                          hint="re-read 'Reading the forward kernel' on masks, then print your offsets and mask "
                               "for the failing trial's last rows and columns.")


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
    refused = refuse_library(name, kernel, _library_objects(), "write the update yourself, in your own kernel.",
                             owner="the lab")
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
                          trials=10, seed=35, rtol=1e-4, atol=atol, explain=_explain_block_update,
                          hint="re-read 'Online softmax' and 'Reading the forward kernel', and follow the row "
                               "named above through your kernel on paper: what it had seen before this block, "
                               "and which of this block's keys it may see.")


def _block_update_reference_launch(q, k, v, vis, m, l, acc, scale, block_n):
    return _block_update_reference(q, k, v, vis, m, l, acc, scale)
