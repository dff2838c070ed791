"""Checks for the exercises of the FlashAttention chapter.

Each check calls the student's function on seeded random inputs and compares it with an answer computed here
(never printed); it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the function still
raises ``NotImplementedError``.

:func:`tl_load` is a small PyTorch stand-in for Triton's ``tl.load`` that the masked-load exercise uses: it reads
``flat[offsets]`` where ``mask`` is true and returns ``other`` elsewhere, and it raises ``IndexError`` for an
unmasked offset outside the buffer (on a GPU that is an illegal memory access, or silently wrong data).
"""
from __future__ import annotations

import math

import torch

from labsrc.exercises.core import Result, as_number, check_function, exercise, randint




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


@exercise
def check_tiled_causal_bytes(fn) -> Result:
    """Check ``fn(T, D, block_m, dtype_bytes) -> bytes`` moved by tiled causal attention (Tq = Tk = T, one head):
    Q read once, O written once, and each query block reads the K and V rows that any of its queries can see."""
    return check_function("bytes moved by tiled causal attention", as_number(fn), _tiled_causal_reference,
                          _tiled_inputs, trials=10, seed=33, rtol=1e-12, atol=0.5,
                          hint="Query block i holds rows [i*block_m, min((i+1)*block_m, T)); its last row sees "
                               "keys up to and including itself. The last block may be partial.")


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
