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

from labsrc.exercises.core import stub_raised
from labsrc.exercises.core import (FAILED, NOT_SOLVED, Result, _code_names, _report, as_number, check_function,
                                   guarded,
                                   exercise, randint, refuse_library, triton_missing)




# ---------------------------------------------------------------------------------------------------------------
# Exercise: find the bugs in a merge of two partial softmax results (flash-decoding's merge)
# ---------------------------------------------------------------------------------------------------------------

def _partial(scores: torch.Tensor, values: torch.Tensor):
    """(m, l, o) of one chunk of keys: row max, sum of exp(s - m), and the chunk's normalised output."""
    m = scores.max(dim=-1).values
    p = torch.exp(scores - m[:, None])
    l = p.sum(-1)
    return m, l, (p @ values) / l[:, None]


def _empty_rows(m, l, o, rows: torch.Tensor):
    """The chunk's state with ``rows`` made empty, as a split past a sequence's end leaves it: the kernel's
    rule gives such a row m = -inf, l = 0 and o = 0."""
    m, l, o = m.clone(), l.clone(), o.clone()
    m[rows], l[rows], o[rows] = float("-inf"), 0.0, 0.0
    return m, l, o


def _merge_inputs(gen: torch.Generator, empties: bool = False) -> tuple:
    """Two chunks of keys for a few rows: chunks of different sizes whose scores sit far from 0 (exp() without
    the max shift overflows in fp32), near each other or on very different scales; with ``empties``, some rows for which one chunk, or both,
    saw no key (row 0 for both)."""
    rows, d = randint(gen, 2, 9), randint(gen, 1, 33)
    n1, n2 = randint(gen, 1, 40), randint(gen, 1, 40)
    shift1 = randint(gen, -120, 120)
    # Half the time the second chunk's scores sit near the first's (both chunks matter), else far away.
    shift2 = shift1 + randint(gen, -2, 2) if randint(gen, 0, 1) else randint(gen, -120, 120)
    s1 = torch.randn(rows, n1, generator=gen, dtype=torch.float64) * 3 + float(shift1)
    s2 = torch.randn(rows, n2, generator=gen, dtype=torch.float64) * 3 + float(shift2)
    v1 = torch.randn(n1, d, generator=gen, dtype=torch.float64)
    v2 = torch.randn(n2, d, generator=gen, dtype=torch.float64)
    one, two = _partial(s1, v1), _partial(s2, v2)
    if empties:
        kind = torch.randint(0, 4, (rows,), generator=gen)   # 0: both full, 1: first empty, 2: second, 3: both
        kind[0] = 3
        one = _empty_rows(*one, (kind == 1) | (kind == 3))
        two = _empty_rows(*two, (kind == 2) | (kind == 3))
    return (*one, *two)


def _merge_reference(m1, l1, o1, m2, l2, o2):
    """The output over both chunks; a row neither chunk saw a key for is 0 (the chapter's -inf rule)."""
    m = torch.maximum(m1, m2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    total = w1 + w2
    merged = (w1[:, None] * o1 + w2[:, None] * o2) / torch.where(total > 0, total, 1.0)[:, None]
    return torch.where((total > 0)[:, None], merged, torch.zeros_like(merged))


@exercise
def check_merge(fn) -> Result:
    """Check ``fn(m1, l1, o1, m2, l2, o2) -> o``: the softmax-attention output over the union of two key chunks,
    given each chunk's row max ``m`` (rows,), normaliser ``l = sum exp(s - m)`` (rows,) and normalised output
    ``o`` (rows, d). Inputs are fp64. A chunk that saw no key for a row has ``m = -inf, l = 0, o = 0`` there,
    and a row that neither chunk saw a key for must come out 0."""
    calls = iter(range(1 << 30))

    def make_inputs(gen):  # every other trial has empty rows, so that each of the two rules shows on its own
        return _merge_inputs(gen, empties=next(calls) % 2 == 1)

    return check_function("fix the merge of two partial softmax results", fn, _merge_reference, make_inputs,
                          trials=8, seed=31, rtol=1e-9, atol=1e-9, forbidden=_library_objects(),
                          hint="re-read 'Online softmax' and test your merge on a tiny case against softmax "
                               "attention over both chunks' keys at once: two chunks of different sizes, and a "
                               "row with no keys at all.")


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
                          trials=8, seed=32, rtol=1e-12, atol=0.5, forbidden=_library_objects(),
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
                              forbidden=_library_objects(),
                              hint=_TILED_HINT)
    return check_function("predicted vs measured bytes of tiled causal attention", as_number(fn),
                          lambda T, D, block_m, dtype_bytes: measure(T, D, block_m) * dtype_bytes // 4,
                          _measured_inputs, trials=6, seed=36, rtol=1e-12, atol=0.5, hint=_TILED_HINT,
                          forbidden=(measure, *(f for f in _functions_named_by(measure) if f is not fn)),
                          owner="the measurement")


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
        except IndexError:
            # a NaN tile, reported as any wrong element is: naming the fault would name the bug
            k, _, block_n, block_d = args
            return torch.full((block_n, block_d), float("nan"), dtype=k.dtype)
    return wrapped


@exercise
def check_key_tile(fn) -> Result:
    """Check ``fn(k, start, block_n, block_d) -> tile``: the ``(block_n, block_d)`` tile of rows
    ``start .. start+block_n`` of the contiguous ``(T, D)`` matrix ``k``, zero where the row is ``>= T`` or the
    column is ``>= D``, loaded with :func:`tl_load` on ``k.flatten()``."""
    answer = _catch_index_error(guarded(fn, _library_objects(), allowed=(tl_load,)))
    return check_function("masked load of a key tile", answer, _tile_reference, _tile_inputs,
                          trials=12, seed=34, rtol=0.0, atol=0.0,
                          hint="re-read 'Reading the forward kernel' on masks, then print your offsets and mask "
                               "for the failing trial's last rows and columns.")


# ---------------------------------------------------------------------------------------------------------------
# Exercise: the backward pass's dQ kernel (the chapter shows the dK/dV kernel, not this one)
# ---------------------------------------------------------------------------------------------------------------

# The block sizes the check launches the student's kernel with: tl.dot needs every dimension >= 16.
KERNEL_BLOCK_M = KERNEL_BLOCK_N = 16


def _dq_reference(q, k, v, dout, causal, sm_scale):
    """dQ of one head by the formulas of eq. (eq-fa-backward), in float64; and the forward's log-sum-exp and
    delta that the kernel is given. Causal is bottom-right aligned (query i sees keys j <= i + Tk - Tq); a row
    that sees no key has lse = -inf, P = 0 and gradient 0."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    s = q @ k.T * sm_scale
    tq, tk = s.shape
    if causal:
        i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
        s = s.masked_fill(j > i + (tk - tq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.where(seen[:, None], torch.exp(s - torch.where(seen, lse, 0.0)[:, None]), 0.0)
    delta = (dout * (p @ v)).sum(-1)
    ds = p * (dout @ v.T - delta[:, None])
    return (ds @ k) * sm_scale, lse, delta


def _dq_inputs(gen: torch.Generator) -> tuple:
    """One head at odd sizes (rows past a block, head sizes that are not powers of two), causal or not; causal
    cases include Tq > Tk, where the first rows see no key at all."""
    causal = bool(randint(gen, 0, 1))
    tq, tk, d = randint(gen, 1, 40), randint(gen, 1, 45), randint(gen, 1, 40)
    if causal and randint(gen, 0, 2) == 0:
        tk = randint(gen, 1, max(1, tq - 1))           # more queries than keys: some rows see nothing
    q = torch.randn(tq, d, generator=gen)
    k = torch.randn(tk, d, generator=gen) * 1.5
    v = torch.randn(tk, d, generator=gen)
    dout = torch.randn(tq, d, generator=gen)
    return q, k, v, dout, causal, 1 / math.sqrt(d)


def _library_objects() -> tuple:
    """The lab's own attention kernels module and the kernels and helpers it defines: a call to them would hand
    in the library's answer instead of the student's."""
    from labsrc.show import _unwrap
    import labsrc.kernels.flash_attention as lib

    return (lib, *(obj for obj in vars(lib).values()
                   if getattr(_unwrap(obj), "__module__", None) == lib.__name__ and callable(_unwrap(obj))))


def _is_kernel(fn) -> bool:
    from labsrc.kernels._triton import triton

    return isinstance(fn, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction))


def _dq_launcher(kernel):
    """Launch the student's kernel as the exercise states: one program per block of 16 query rows."""
    from labsrc import runtime

    def run(q, k, v, dout, causal, sm_scale):
        dev = runtime.DEVICE
        _, lse, delta = _dq_reference(q, k, v, dout, causal, sm_scale)
        q, k, v, dout = (t.to(dev).contiguous() for t in (q, k, v, dout))
        lse, delta = lse.float().to(dev).contiguous(), delta.float().to(dev).contiguous()
        tq, d = q.shape
        dq = torch.full_like(q, float("nan"))          # a row the kernel forgets to store shows as NaN
        block_d = max(16, 1 << (d - 1).bit_length())
        try:
            kernel[(-(-tq // KERNEL_BLOCK_M),)](q, k, v, dout, lse, delta, dq, tq, k.shape[0], d, sm_scale,
                                                CAUSAL=causal, BLOCK_M=KERNEL_BLOCK_M, BLOCK_N=KERNEL_BLOCK_N,
                                                BLOCK_D=block_d)
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - a compiled stub reports its NotImplementedError inside
            if stub_raised(err):
                raise NotImplementedError from err
            print(f"  (the kernel raised {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})")
            return torch.full((tq, d), float("nan"))
        return dq.cpu()
    return run





@exercise
def check_dq_kernel(kernel) -> Result:
    """Check the student's ``@triton.jit`` kernel ``kernel(Q, K, V, DO, LSE, DELTA, DQ, Tq, Tk, D, sm_scale,
    CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)``: one program per block of BLOCK_M query rows of one head writes that
    block's rows of dQ, recomputing P from the forward's log-sum-exp (natural log; -inf for a row that sees no
    key) and using delta = rowsum(dO * O).

    It is launched on ``cdiv(Tq, 16)`` programs over random odd sizes, causal (bottom-right, Tq > Tk included)
    and not, and compared with a float64 PyTorch reference. Without Triton it is skipped."""
    from labsrc import runtime

    name = "the backward pass's dQ (Triton kernel)"
    if not runtime.HAS_TRITON:
        return triton_missing(name)
    refused = refuse_library(name, kernel, _library_objects(), "write the loop yourself, in your own kernel.",
                             owner="the lab")
    if refused is not None:
        return refused
    if not _is_kernel(kernel):
        try:  # the stub of the student build raises before anything else
            kernel()
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
        except Exception:  # noqa: BLE001
            pass
        return _report(Result(name, FAILED, "this is a Python function, not a kernel. Hint: decorate it with "
                                            "@triton.jit and launch nothing yourself; the check launches it."))
    atol = 1e-4 if runtime.INTERPRETED else 2e-2  # a GPU's fp32 tl.dot may use TF32 unless told "ieee"
    return check_function(name, _dq_launcher(kernel), lambda *args: _dq_reference(*args)[0].float(), _dq_inputs,
                          trials=6, seed=37, rtol=1e-4, atol=atol,
                          hint="re-read 'The backward pass: recompute P, do not store it' and follow the row this "
                               "message names through your kernel on paper: which keys it sees, and what its P is for the "
                               "keys it does not see.")
