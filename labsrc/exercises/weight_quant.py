"""Checks for the exercises of the weight-quantization chapter.

Each check calls the student's function on seeded random inputs and compares it with the answer computed
from :mod:`labsrc.weight_quant` or from the definition; it prints ``passed``, what is wrong with a hint, or
``not solved yet`` while the function still raises ``NotImplementedError``. Answers are never printed.

* :func:`check_wq_group_params` -- ``fn(group, bits, symmetric) -> (scale, zero)`` of one weight group.
* :func:`check_mxfp4_block` -- ``fn(block) -> (shared_exp, values)``: one MXFP4 block by hand.
* :func:`check_gptq_column_update` -- ``fn(W, Hinv, q0) -> W_new``: GPTQ's first column step.
* :func:`check_awq_search` -- ``fn(w, x, bits, group_size, grid) -> s``: AWQ's grid search.
* :func:`check_int4_gemv_kernel` -- a ``@triton.jit`` kernel computing ``y = W_hat @ x`` straight from the
  packed INT4 weight (the decode-time matrix-vector product), launched here under the interpreter; skipped,
  with a message, where Triton is unavailable.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc import weight_quant as wq
from labsrc.exercises.core import (FAILED, NOT_SOLVED, Result, _report, _with_hint, check_function, exercise,
                                   hidden, randint, refuse_library, triton_missing)

_OWN = "write it yourself from the definition in the text."


# ------------------------------------------------------------------------------------------- scale and zero
def _pair(fn):
    def wrapped(*args):
        got = fn(*args)
        try:
            s, z = got
            return torch.tensor([float(s), float(z)], dtype=torch.float64)
        except (TypeError, ValueError):
            return got
    return wrapped


def _group_inputs(gen):
    g = randint(gen, 2, 128)
    shift = (0.0, 0.2, -0.2)[randint(gen, 0, 2)]  # often all one sign: the grid must still contain 0
    group = torch.randn(g, generator=gen, dtype=torch.float64) * 0.05 + shift
    return group, [2, 3, 4, 8][randint(gen, 0, 3)], bool(randint(gen, 0, 1))


def _group_reference(group, bits, symmetric):
    if symmetric:
        s = group.abs().max() / (2 ** (bits - 1) - 1)
        z = torch.tensor(2.0 ** (bits - 1), dtype=torch.float64)
    else:
        lo, hi = group.min().clamp(max=0), group.max().clamp(min=0)
        s = (hi - lo) / (2 ** bits - 1)
        z = torch.round(-lo / s)
    return torch.stack([s, z]).double()


@exercise
def check_wq_group_params(fn) -> Result:
    """Check ``fn(group, bits, symmetric) -> (scale, zero)`` for one group of weights (no fp16 rounding):
    the chapter's formula, with an integer zero point and a grid that contains 0."""
    title = "step and zero point of a weight group"
    refused = refuse_library(title, fn, (wq.quantize_rtn, wq._params), _OWN)
    if refused is not None:
        return refused
    return check_function(title, _pair(fn), _group_reference, _group_inputs, trials=10, seed=121, rtol=1e-9,
                          atol=1e-12, explain=_explain_group,
                          hint="re-read 'The quantization formula' and quantize then dequantize the failing "
                               "group with your step and zero point: 0 must come back exactly, and every "
                               "weight must land within half a step of itself.")


def _explain_group(got, expected, group, bits, symmetric) -> str:
    kind = "symmetric" if symmetric else "asymmetric"
    if not isinstance(got, torch.Tensor) or got.shape != (2,):
        return "Return the pair (scale, zero) as two numbers."
    wrong = [what for i, what in enumerate(("step", "zero point"))
             if not torch.isclose(got[i], expected[i], rtol=1e-9, atol=1e-12)]
    if not wrong:
        return ""
    extra = ""
    if "step" in wrong and expected[0] != 0:
        extra = f"; your step is {(got[0] / expected[0]).item():.4g} times the right one"
    elif float(got[1]) != round(float(got[1])):
        extra = "; a zero point is a whole code"
    sign = "all positive" if bool((group > 0).all()) else "all negative" if bool((group < 0).all()) else "mixed"
    verb = "are" if len(wrong) == 2 else "is"
    return f"The {' and the '.join(wrong)} of this {kind}, {bits}-bit case ({sign} weights) {verb} wrong{extra}."


# ------------------------------------------------------------------------------------------- MXFP4 block
def _block_inputs(gen):
    scale = 2.0 ** randint(gen, -12, 12)
    block = torch.randn(32, generator=gen) * scale
    if randint(gen, 0, 2) == 0:  # an element on a tie or beyond the clipping edge
        block[randint(gen, 0, 31)] = float(block.abs().max()) * 1.9
    return (block,)


def _block_reference(block):
    codes, scales = wq.mxfp4_quantize(block.reshape(1, 32))
    return torch.cat([torch.tensor([float(int(scales) - 127)]), wq.mxfp4_dequantize(codes, scales)[0]])


def _exp_and_values(fn):
    def wrapped(block):
        got = fn(block)
        try:
            e, values = got
            return torch.cat([torch.tensor([float(e)]), torch.as_tensor(values, dtype=torch.float32).reshape(-1)])
        except (TypeError, ValueError, RuntimeError):
            return got
    return wrapped


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # the E2M1 magnitudes, as the chapter lists them


def _explain_mxfp4(got, expected, block) -> str:
    """Whether the shared exponent or an element is wrong, and what is special about that element."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return "Return (shared_exp, values) with 32 values."
    if got[0] != expected[0]:
        return f"The shared exponent is off by {int(got[0] - expected[0]):+d}."
    i = int((got[1:] != expected[1:]).nonzero()[0])
    scaled = abs(float(block[i])) / 2.0 ** float(expected[0])
    if scaled > _E2M1[-1]:
        said = "beyond the largest E2M1 magnitude"
    elif any(abs(scaled - (a + b) / 2) < 1e-6 for a, b in zip(_E2M1, _E2M1[1:])):
        said = "exactly halfway between two E2M1 magnitudes"
    else:
        said = "between two E2M1 magnitudes, not on a tie"
    return f"The exponent is right; element {i} is the first wrong one, and scaled it lies {said}."


@exercise
def check_mxfp4_block(fn) -> Result:
    """Check ``fn(block) -> (shared_exp, values)`` for one block of 32 fp32 numbers: the unbiased shared
    exponent of the OCP rule and the 32 dequantized MXFP4 values (fp32)."""
    title = "one MXFP4 block"
    refused = refuse_library(title, fn, (wq.mxfp4_quantize, wq.mxfp4_dequantize, wq.e2m1_encode,
                                         wq.fake_quant_mxfp4), _OWN)
    if refused is not None:
        return refused
    return check_function(title, _exp_and_values(fn), _block_reference, _block_inputs, trials=10, seed=122,
                          rtol=0.0, atol=0.0, explain=_explain_mxfp4,
                          hint="re-read 'MXFP4: a 4-bit float with a shared power-of-two scale' for the case "
                               "the message names (the shared exponent, a tie, a value past the largest code).")


# ------------------------------------------------------------------------------------------- GPTQ step
def _gptq_inputs(gen):
    n, k = randint(gen, 1, 12), randint(gen, 2, 24)
    x = torch.randn(4 * k, k, generator=gen, dtype=torch.float64) @ torch.randn(k, k, generator=gen,
                                                                               dtype=torch.float64)
    hinv = torch.linalg.inv(2 * x.T @ x / x.shape[0] + 0.01 * torch.eye(k, dtype=torch.float64))
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    q0 = torch.round(w[:, 0] * 4) / 4
    return w, hinv, q0


def _gptq_reference(w, hinv, q0):
    out = w.clone()
    out[:, 1:] -= ((w[:, 0] - q0) / hinv[0, 0])[:, None] * hinv[0, 1:][None, :]
    out[:, 0] = q0
    return out


def _explain_gptq(got, expected, w, hinv, q0) -> str:
    """Judge column 0 and the correction of the other columns separately."""
    if isinstance(got, str):
        return f"Your function {got}: work on a copy."
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    if not torch.allclose(got[:, 0], expected[:, 0], rtol=1e-9, atol=1e-12):
        return "Column 0 should hold q0 afterwards."
    moved, want = (got[:, 1:] - w[:, 1:]).double(), (expected[:, 1:] - w[:, 1:]).double()
    if not moved.any():
        return "Column 0 is right, but the other columns did not move."
    nonzero = want.abs() > 1e-12
    if nonzero.any():
        c = (moved[nonzero] / want[nonzero]).median().item()
        if torch.allclose(moved, c * want, rtol=1e-6, atol=1e-12):
            return f"Column 0 is right; the other columns move the right way round but {c:.4g} times as far."
    return "Column 0 is right; the other columns move, but not along the right correction."


@exercise
def check_gptq_column_update(fn) -> Result:
    """Check ``fn(W, Hinv, q0) -> W_new``: quantize column 0 of ``W (N, K)`` to ``q0`` and move the other
    columns to compensate, with ``Hinv`` the inverse Hessian ``(K, K)``. ``W`` must not be changed."""
    title = "one GPTQ column update"
    refused = refuse_library(title, fn, (wq.gptq_quantize,), _OWN)
    if refused is not None:
        return refused

    def guarded(w, hinv, q0):
        before = w.clone()
        got = fn(w, hinv, q0)
        if not torch.equal(w, before):
            return "changed W in place"
        return got

    return check_function(title, guarded, _gptq_reference, _gptq_inputs, trials=8, seed=123, rtol=1e-9,
                          atol=1e-12, explain=_explain_gptq,
                          hint="re-read 'GPTQ: quantize a column, let the others absorb the error' and test "
                               "your step on W with two columns, where you can follow it by hand.")


# ------------------------------------------------------------------------------------------- AWQ search
def _awq_inputs(gen):
    k = [32, 64, 96][randint(gen, 0, 2)]
    x = torch.randn(128, k, generator=gen)
    x[:, :randint(gen, 1, 4)] *= 10
    return (torch.randn(randint(gen, 4, 24), k, generator=gen) * 0.05, x, [3, 4][randint(gen, 0, 1)],
            [16, 32][randint(gen, 0, 1)], randint(gen, 4, 10))


def _awq_error(w, x, s, bits, g):
    w_hat = wq.dequantize(wq.quantize_rtn(w * s, bits, g)) / s
    return float(((x @ w.T - x @ w_hat.T).double() ** 2).sum())


@exercise
def check_awq_search(fn) -> Result:
    """Check ``fn(w, x, bits, group_size, grid) -> s``: AWQ's per-input-channel scales from the grid search
    over ``alpha`` in ``{0, 1/grid, ..., (grid-1)/grid}`` (``s = mean|x|^alpha``, normalised so that
    ``max(s) min(s) = 1``), judged by the output error it reaches (symmetric RTN, ``quantize_rtn`` allowed)."""
    title = "AWQ's scale search"
    refused = refuse_library(title, fn, (wq.awq_search_scales, wq.apply_awq), _OWN)
    if refused is not None:
        return refused
    hint = ("re-read 'AWQ: protect the channels that large activations multiply' and the task's grid and "
            "normalisation; print the output error your search measures for each alpha on the failing layer.")
    trials, seed = (8, 1124) if hidden() else (4, 124)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        w, x, bits, g, grid = _awq_inputs(gen)
        try:
            s = fn(w, x, bits, g, grid)
        except NotImplementedError:
            return _report(Result(title, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        if not isinstance(s, torch.Tensor) or s.shape != (w.shape[1],):
            return _report(Result(title, FAILED, _with_hint(
                f"trial {trial + 1}: expected a tensor of shape ({w.shape[1]},), one scale per input channel, "
                f"got {type(s).__name__} {tuple(getattr(s, 'shape', ()))}.", hint)))
        if not bool((s > 0).all()):
            return _report(Result(title, FAILED, _with_hint(f"trial {trial + 1}: scales must be positive.", hint)))
        best = _awq_error(w, x, wq.awq_search_scales(w, x, bits, g, grid), bits, g)
        got = _awq_error(w, x, s.float(), bits, g)
        if got > best * (1 + 1e-4) + 1e-12:
            plain = _awq_error(w, x, torch.ones(w.shape[1]), bits, g)
            worse = " (larger even than with no scaling, alpha = 0)" if got > plain * (1 + 1e-4) else ""
            return _report(Result(title, FAILED, _with_hint(
                f"trial {trial + 1}: your scales give a larger output error than the grid's best{worse}.", hint)))
    return _report(Result(title, "passed", f"reaches the grid's best error on {trials} random layers."))


# ------------------------------------------------------------------------------------------- GEMV kernel
GEMV_KERNEL = "INT4 GEMV kernel"
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 32


def _gemv_inputs(gen):
    n = randint(gen, 1, 70)
    half = randint(gen, 1, 80)
    g = [3, 16, 32, 2 * half][randint(gen, 0, 3)]
    w = torch.randn(n, 2 * half, generator=gen) * 0.1
    return wq.quantize_rtn(w, 4, g, bool(randint(gen, 0, 1))), torch.randn(2 * half, generator=gen)


def _launch_gemv(kernel, qw, x):
    from labsrc.kernels._triton import triton

    n, k = qw.shape
    dev = runtime.DEVICE
    y = torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
    groups = qw.scales.shape[1]
    kernel[(triton.cdiv(n, GEMV_BLOCK_N),)](x.to(dev), qw.qweight.to(dev), qw.scales.to(dev), qw.zeros.to(dev), y,
                                            n, k // 2, groups, qw.group_size, BLOCK_N=GEMV_BLOCK_N,
                                            BLOCK_K=GEMV_BLOCK_K)
    return y.cpu()


def _unsolved(err):
    while err is not None:
        if isinstance(err, NotImplementedError):
            return True
        err = err.__cause__ or err.__context__
    return False


@exercise
def check_int4_gemv_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, HALF, G, GROUP, BLOCK_N,
    BLOCK_K)`` computing ``y = W_hat @ x`` for one activation vector ``x`` (fp32, ``K = 2 * HALF``) and a
    4-bit weight in the planar layout (``q_ptr``: uint8 ``(N, HALF)``, column ``j`` in the low nibble of byte
    ``j`` and column ``j + HALF`` in the high one; ``s_ptr`` fp16 and ``z_ptr`` uint8 ``(N, G)``, one per
    ``GROUP`` columns; ``w = (q - z) * s``); ``y_ptr``: fp32 ``(N,)``. One program per ``BLOCK_N`` rows,
    looping over the bytes ``BLOCK_K`` at a time. Compared with ``dequantize(qw) @ x`` on random odd sizes.
    Without Triton it prints that the kernel exercise is skipped and returns without failing.
    """
    from labsrc.kernels import weight_quant as kw

    if not runtime.HAS_TRITON:
        return triton_missing(GEMV_KERNEL)
    from triton.runtime.jit import KernelInterface

    if not isinstance(kernel, KernelInterface):
        return _report(Result(GEMV_KERNEL, FAILED, "expected a Triton kernel (a function decorated with "
                                                   f"@triton.jit), got {type(kernel).__name__}."))
    refused = refuse_library(GEMV_KERNEL, kernel, (kw.int4_matmul, kw.int4_matmul_ref, kw._int4_matmul_kernel,
                                                   wq.dequantize), _OWN)
    if refused is not None:
        return refused
    hint = ("re-read 'The kernels' and the planar layout in the task; the message says which rows are wrong, "
            "and a trial whose GROUP does not divide HALF tests the group lookup.")
    trials, seed = (10, 1125) if hidden() else (5, 125)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        qw, x = _gemv_inputs(gen)
        where = f"trial {trial + 1} (N={qw.shape[0]}, K={qw.shape[1]}, group {qw.group_size})"
        try:
            got = _launch_gemv(kernel, qw, x)
        except Exception as err:  # noqa: BLE001 - a student's kernel may fail in many ways; report which
            if _unsolved(err):
                return _report(Result(GEMV_KERNEL, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(GEMV_KERNEL, FAILED, _with_hint(
                f"{where}: the launch raised {type(err).__name__}: "
                f"{str(err).splitlines()[0][:160] if str(err) else ''}", hint)))
        expected = (wq.dequantize(qw).double() @ x.double()).float()
        if torch.isnan(got).any():
            return _report(Result(GEMV_KERNEL, FAILED, _with_hint(
                f"{where}: {int(torch.isnan(got).sum())} output element(s) were never written.", hint)))
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            bad = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-4)
            rows = bad.nonzero().flatten()
            full = (qw.shape[0] // GEMV_BLOCK_N) * GEMV_BLOCK_N
            tail = (" (only rows of the last, partial block of BLOCK_N rows)" if int(rows.min()) >= full
                    and full < qw.shape[0] else "")
            return _report(Result(GEMV_KERNEL, FAILED, _with_hint(
                f"{where}: {int(bad.sum())} of {bad.numel()} outputs differ, the first at row "
                f"{int(rows[0])}{tail}.", hint)))
    return _report(Result(GEMV_KERNEL, "passed", f"agrees with the reference on {trials} random odd sizes."))
