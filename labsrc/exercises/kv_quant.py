"""Checks for the exercises of the KV-cache quantization chapter.

Each check calls the student's function on seeded random inputs and compares it with the answer computed
here (from :mod:`labsrc.kvquant` or from the definition); it prints ``passed``, what is wrong with a hint,
or ``not solved yet`` while the function still raises ``NotImplementedError``. Answers are never printed.

* :func:`check_scale_zero` -- ``fn(group, bits) -> (scale, zero)`` of one quantization group.
* :func:`check_mse_ratio` -- ``fn(channel_var, per_channel_steps) -> float``, the predicted MSE ratio.
* :func:`check_cache_bytes` -- ``fn(n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size) -> bytes``.
* :func:`check_unpack_kernel` -- a ``@triton.jit`` kernel that unpacks INT4 codes and dequantizes them,
  launched here under the interpreter on odd sizes; skipped, with a message, where Triton is unavailable.

The checks refuse an answer that calls the :mod:`labsrc` function it is asked to write (the answer has to be
the student's own), and their hints name the idea to use, never the value or the formula.
"""
from __future__ import annotations


import torch

from labsrc import kvquant, runtime
from labsrc.exercises.core import (FAILED, NOT_SOLVED, Result, _report, _with_hint, as_number, check_function,
                                   exercise, hidden, randint, refuse_library, triton_missing)


# ------------------------------------------------------------------------------------------- own work only
def _own_work(name: str, fn, forbidden: tuple) -> Result | None:
    """A failed result when ``fn`` calls one of the ``forbidden`` library functions, else None."""
    return refuse_library(name, fn, forbidden, "write it yourself from the definition in the text.")


# ------------------------------------------------------------------------------------------- scale and zero
def _pair_as_tensor(fn):
    """The student's ``(scale, zero)`` as a float64 tensor of two numbers; anything else is passed through
    so that the check reports what it got."""
    def wrapped(*args):
        got = fn(*args)
        try:
            s, z = got
            return torch.tensor([float(s), float(z)], dtype=torch.float64)
        except (TypeError, ValueError):
            return got
    return wrapped


def _group_inputs(gen: torch.Generator) -> tuple:
    g, d = randint(gen, 1, 64), [8, 16, 64][randint(gen, 0, 2)]
    shift, spread = float(torch.randn(1, generator=gen)) * 3, float(torch.rand(1, generator=gen)) * 4 + 0.1
    group = torch.randn(g, d, generator=gen, dtype=torch.float64) * spread + shift
    return group, [2, 4, 8][randint(gen, 0, 2)]


def _scale_zero_reference(group, bits):
    lo, hi = group.min(), group.max()
    return torch.stack([(hi - lo) / (2 ** bits - 1), lo]).to(torch.float64)


@exercise
def check_scale_zero(fn) -> Result:
    """Check ``fn(group, bits) -> (scale, zero)``: the step and the (real-valued) zero point of one group.

    Convention of the chapter: ``z`` is the value code 0 stands for, ``x_hat = q * s + z`` with ``q`` in
    ``[0, 2**bits - 1]``, and the grid spans exactly the group's range (no fp16 rounding here).
    """
    refused = _own_work("step and zero point of a group", fn, (kvquant.scale_zero, kvquant.quantize))
    if refused is not None:
        return refused
    return check_function("step and zero point of a group", _pair_as_tensor(fn), _scale_zero_reference,
                          _group_inputs, trials=8, seed=21, rtol=1e-9, atol=1e-12, explain=_explain_scale_zero,
                          hint="re-read 'Uniform asymmetric quantization' and dequantize the lowest and the "
                               "highest code with your step and zero point: they should land on the ends of "
                               "the group's range.")


def _explain_scale_zero(got, expected, group, bits) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != (2,):
        return "Return the pair (scale, zero) as two numbers."
    wrong = [what for i, what in enumerate(("step", "zero point"))
             if not torch.isclose(got[i], expected[i], rtol=1e-9, atol=1e-12)]
    said = " and the ".join(wrong)
    ratio = (got[0] / expected[0]).item() if expected[0] != 0 else float("nan")
    extra = f" (your step is {ratio:.4g} times the right one)" if "step" in wrong else ""
    return f"The {said} {'is' if len(wrong) == 1 else 'are'} wrong{extra}, for {bits} bits."


# ------------------------------------------------------------------------------------------- MSE ratio
def _ratio_inputs(gen: torch.Generator) -> tuple:
    d = randint(gen, 2, 128)
    var = torch.exp(torch.randn(d, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen)) * 2)
    return var, bool(randint(gen, 0, 3) == 0)  # mostly shared steps, sometimes per-channel steps


@exercise
def check_mse_ratio(fn) -> Result:
    """Check ``fn(channel_var, per_channel_steps) -> float``: predicted MSE without / with normalisation."""
    refused = _own_work("predicted gain of variance normalisation", fn, (kvquant.predicted_mse_ratio,))
    if refused is not None:
        return refused
    return check_function("predicted gain of variance normalisation", as_number(fn),
                          lambda v, per: kvquant.predicted_mse_ratio(v, per_channel_steps=per), _ratio_inputs,
                          trials=10, seed=22, rtol=1e-9, explain=_explain_ratio,
                          hint="re-read 'What normalisation gains: the rate-distortion argument, corrected' "
                               "for the case of the failing trial, and try your function on two channels of "
                               "equal variance, where the answer should be 1.")


def _explain_ratio(got, expected, var, per_channel_steps) -> str:
    return f"This trial has {'one step per channel' if per_channel_steps else 'one step shared by the channels'}."


# ------------------------------------------------------------------------------------------- bytes
def _bytes_inputs(gen: torch.Generator) -> tuple:
    return (randint(gen, 1, 40_000), randint(gen, 1, 80), [1, 2, 4, 8][randint(gen, 0, 3)],
            [64, 80, 128][randint(gen, 0, 2)], [2, 4, 8][randint(gen, 0, 2)], [32, 64, 128][randint(gen, 0, 2)])


def _bytes_reference(n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size):
    return kvquant.kv_bytes(n_tokens, n_layers, n_kv_heads, head_dim, bits=bits, group_size=group_size,
                            granularity="group", stats=True)


@exercise
def check_cache_bytes(fn) -> Result:
    """Check ``fn(n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size) -> bytes`` of a KVarN cache.

    One sequence; K and V in every layer and KV head: packed codes, an fp16 step and fp16 zero point per
    group of ``group_size`` tokens (a trailing partial group is a group), and fp16 mean and std per channel.
    """
    refused = _own_work("bytes of a KVarN cache", fn, (kvquant.kv_bytes, kvquant.kvarn_bytes_source))
    if refused is not None:
        return refused
    return check_function("bytes of a KVarN cache", as_number(fn), _bytes_reference, _bytes_inputs,
                          trials=10, seed=23, rtol=1e-12, atol=0.5, explain=_explaining_bytes(fn),
                          arg_names=("n_tokens", "n_layers", "n_kv_heads", "head_dim", "bits", "group_size"),
                          hint="re-read 'Experiment 5: memory, measured against the formulas' and list what "
                               "the cache holds besides the codes.")


def _explaining_bytes(fn):
    """``explain`` for the byte count: a count right when group_size divides n_tokens but wrong here has the
    trailing partial group wrong."""
    def explain(got, expected, n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size) -> str:
        if n_tokens % group_size == 0:
            return ""
        whole = group_size * -(-n_tokens // group_size)
        args = (whole, n_layers, n_kv_heads, head_dim, bits, group_size)
        if as_number(fn)(*args) == _bytes_reference(*args):
            return (f"Your count is right for {whole} tokens, a whole number of groups, and wrong here: look at "
                    f"the last, partial group.")
        return ""
    return explain


# ------------------------------------------------------------------------------------------- INT4 unpack kernel
UNPACK_KERNEL = "INT4 unpack-and-dequantize kernel"
UNPACK_BLOCK_T = 16  # tokens per program when the check launches the student's kernel


def _unpack_inputs(gen: torch.Generator) -> tuple:
    """One head's INT4 cache of odd size: T tokens, D = 2 * DP channels with DP odd, a random group size."""
    t = randint(gen, 1, 97) | 1
    dp = randint(gen, 1, 12) * 2 + 1
    g = [1, 3, 8, 32, 64][randint(gen, 0, 4)]
    x = torch.randn(t, 2 * dp, generator=gen) * (float(torch.rand(1, generator=gen)) * 4 + 0.1) \
        + float(torch.randn(1, generator=gen)) * 3
    return x, g


def _launch_unpack(kernel, qt) -> torch.Tensor:
    """Launch the student's kernel on one head's packed INT4 cache ``qt``; the output starts as NaN so an
    element the kernel never writes shows."""
    from labsrc.kernels._triton import triton

    t, d = qt.shape
    dp = d // 2
    dev = runtime.DEVICE  # the GPU where there is one (compiled), else the CPU (interpreted)
    out = torch.full((t, d), float("nan"), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(t, UNPACK_BLOCK_T),)
    kernel[grid](qt.packed.to(dev), qt.scale.reshape(-1).to(dev), qt.zero.reshape(-1).to(dev), out, t, dp,
                 qt.group_size, BLOCK_T=UNPACK_BLOCK_T, BLOCK_DP=triton.next_power_of_2(dp))
    return out.cpu()


def _unsolved_cause(err: BaseException) -> bool:
    """True when ``err`` (possibly the interpreter's wrapper) comes from ``raise NotImplementedError``."""
    while err is not None:
        if isinstance(err, NotImplementedError):
            return True
        err = err.__cause__ or err.__context__
    return False


@exercise
def check_unpack_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T,
    BLOCK_DP)`` that unpacks one head's INT4 codes and dequantizes them.

    ``p_ptr``: uint8 ``(T, DP)``, channel ``j`` in the low nibble of byte ``j`` and channel ``j + DP`` in the
    high nibble; ``scale_ptr``, ``zero_ptr``: fp16, one per group of ``GROUP`` tokens; ``out_ptr``: fp32
    ``(T, 2 * DP)``. The check launches one program per ``BLOCK_T`` tokens on random odd sizes and compares
    with :func:`labsrc.kernels.kvquant.dequantize_unpack_ref`. Without Triton (macOS, Windows) it prints
    that the kernel exercise is skipped and returns without failing.
    """
    from labsrc.kernels import kvquant as kk

    if not runtime.HAS_TRITON:
        return triton_missing(UNPACK_KERNEL)
    from triton.runtime.jit import KernelInterface

    if not isinstance(kernel, KernelInterface):
        return _report(Result(UNPACK_KERNEL, FAILED, "expected a Triton kernel (a function decorated with "
                                                     f"@triton.jit), got {type(kernel).__name__}."))
    refused = _own_work(UNPACK_KERNEL, kernel, (kk.dequantize_unpack, kk.dequantize_unpack_ref))
    if refused is not None:
        return refused
    hint = ("re-read 'Unpack and dequantize' and the packing layout above; the first wrong element's channel "
            "(below DP or not) and token (its group) say which part of the unpacking to look at.")
    trials, seed = (12, 1025) if hidden() else (6, 25)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        x, g = _unpack_inputs(gen)
        qt = kk.quantize_pack_ref(x, 4, g)
        try:
            got = _launch_unpack(kernel, qt)
        except Exception as err:  # noqa: BLE001 - a student's kernel may fail in many ways; report which
            if _unsolved_cause(err):
                return _report(Result(UNPACK_KERNEL, NOT_SOLVED,
                                      "Fill in the kernel above, then run this cell again."))
            return _report(Result(UNPACK_KERNEL, FAILED, _with_hint(
                f"trial {trial + 1} (T={x.shape[0]}, D={x.shape[1]}, group {g}): the launch raised "
                f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}", hint)))
        expected = kk.dequantize_unpack_ref(qt).float()
        if torch.isnan(got).any():
            return _report(Result(UNPACK_KERNEL, FAILED, _with_hint(
                f"trial {trial + 1} (T={x.shape[0]}, D={x.shape[1]}, group {g}): "
                f"{int(torch.isnan(got).sum())} output element(s) were never written.", hint)))
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            bad = ~torch.isclose(got, expected, rtol=1e-5, atol=1e-6)
            t0, c0 = (int(i) for i in bad.nonzero()[0])
            return _report(Result(UNPACK_KERNEL, FAILED, _with_hint(
                f"trial {trial + 1} (T={x.shape[0]}, D={x.shape[1]}, group {g}): {int(bad.sum())} of "
                f"{bad.numel()} elements differ, the first at token {t0} (group {t0 // g}), channel {c0} "
                f"({'a low' if c0 < x.shape[1] // 2 else 'a high'} nibble).", hint)))
    return _report(Result(UNPACK_KERNEL, "passed", f"agrees with the reference on {trials} random odd sizes."))
