"""Checks for the exercises of the KV-cache quantization chapter.

Each check calls the student's function on seeded random inputs and compares it with the answer computed
here (from :mod:`labsrc.kv_quant` or from the definition); it prints ``passed``, what is wrong with a hint,
or ``not solved yet`` while the function still raises ``NotImplementedError``. Answers are never printed.

* :func:`check_scale_zero` -- ``fn(group, bits) -> (scale, zero)`` of one quantization group.
* :func:`check_fp16_params` -- ``fn(group, bits) -> (codes, scale, zero)`` with an fp16 step and zero point
  that still keep every element within half a step: the fixed version of a given quantizer (debugging).
* :func:`check_group_size` -- ``fn(x, bits, max_ratio) -> g``: the largest group size whose measured error
  stays within a budget (an experiment; the check measures the answer and twice it).
* :func:`check_unpack_kernel` -- a ``@triton.jit`` kernel that unpacks INT4 codes with KIVI's per-channel
  steps and zero points (a layout the chapter's kernels do not cover) and dequantizes them, launched here
  under the interpreter on odd sizes; skipped, with a message, where Triton is unavailable.

The checks refuse an answer that calls the :mod:`labsrc` function it is asked to write (the answer has to be
the student's own), and their hints name the idea to use, never the value or the formula.
"""
from __future__ import annotations


import torch

from labsrc import kv_quant, runtime
from labsrc.exercises.core import (FAILED, NOT_SOLVED, Refused, Result, _report, as_number,
                                   check_function, exercise, fail, guarded, launch_failed, randint, refusal,
                                   refuse_library, seed_for, trials_for, triton_missing)


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
    refused = _own_work("step and zero point of a group", fn, (kv_quant.scale_zero, kv_quant.quantize))
    if refused is not None:
        return refused
    return check_function("step and zero point of a group", _pair_as_tensor(fn), _scale_zero_reference,
                          _group_inputs, trials=8, seed=21, rtol=1e-9, atol=1e-12,
                          forbidden=(kv_quant.scale_zero, kv_quant.quantize),
                          hint="re-read 'Uniform asymmetric quantization' and dequantize the lowest and the "
                               "highest code with your step and zero point: they should land on the ends of "
                               "the group's range.")


# ------------------------------------------------------------------------------------------- MSE ratio
# ------------------------------------------------------------------- fp16 step and zero point (debugging)
def _offset_group_inputs(gen: torch.Generator) -> tuple:
    """A group whose values sit far from zero relative to their range (a channel mean of tens to hundreds, a
    range of a few tenths to a few units), where one fp16 rounding step of the zero point is a good part of a
    quantization step; now and then a group near zero."""
    g, d = randint(gen, 1, 48), [8, 16, 64][randint(gen, 0, 2)]
    shift = float(torch.randn(1, generator=gen)) * 150 if randint(gen, 0, 3) else float(torch.randn(1, generator=gen))
    spread = float(torch.rand(1, generator=gen)) * 2 + 0.05
    group = torch.randn(g, d, generator=gen, dtype=torch.float64) * spread + shift
    return group, [2, 4, 8][randint(gen, 0, 2)]


def _fp16_spacing(v: float) -> float:
    """The gap between fp16 numbers around ``v`` (the subnormal gap near zero)."""
    v = abs(v)
    return 2.0 ** -24 if v < 2.0 ** -14 else 2.0 ** (torch.tensor(v).log2().floor().item() - 10)


def _fp16_problem(got, group: torch.Tensor, bits: int) -> str | None:
    """What is wrong with ``got = (codes, scale, zero)`` for ``group``, or None: fp16 step and zero point,
    integer codes in range, every element within half a (stored) step, and a grid no wider than the group's
    range plus a few fp16 spacings of the zero point and a hair of the step."""
    try:
        codes, scale, zero = got
    except (TypeError, ValueError):
        return f"expected (codes, scale, zero), got {type(got).__name__}."
    levels = 2 ** bits - 1
    for name, v in (("scale", scale), ("zero", zero)):
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            return f"{name} should be a one-element tensor, got {type(v).__name__}."
        if v.dtype != torch.float16:
            return f"{name} is {v.dtype}; the cache stores it in torch.float16."
    if not isinstance(codes, torch.Tensor) or codes.shape != group.shape:
        shape = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
        return f"codes should be a tensor of the group's shape {tuple(group.shape)}, got {shape}."
    q = codes.double()
    if not torch.equal(q, q.round()) or q.min() < 0 or q.max() > levels:
        return f"codes must be whole numbers in [0, {levels}]."
    s, z = float(scale), float(zero)
    if not s > 0:
        return "the stored step is not positive."
    err = (q * s + z - group).abs()
    far = err > s / 2 * (1 + 1e-6) + 1e-12
    if bool(far.any()):
        first = int(far.flatten().nonzero()[0])
        return (f"element {first} (flat index) is not within half a stored step of its reconstruction "
                "codes * scale + zero.")
    lo, hi = float(group.min()), float(group.max())
    # a safe rounding moves the zero point down by up to a few fp16 spacings (the library's rule, one part in
    # 1024 of |lo| and then a rounding, moves it by up to 2.5) and the step up by a few parts in 1000
    widest = (hi - lo + 3 * _fp16_spacing(lo)) * (1 + 2.0 ** -8) + levels * 2.0 ** -23
    if levels * s > widest:
        return "the stored grid is wider than the group's range plus what rounding to fp16 requires."
    return None


@exercise
def check_fp16_params(fn) -> Result:
    """Check ``fn(group, bits) -> (codes, scale, zero)``: one group quantized with its step and zero point stored
    in fp16, such that every element still lies within half a stored step of its reconstruction
    ``codes * scale + zero``, the codes are whole numbers in ``[0, 2**bits - 1]``, and the grid is no wider than
    the group's range plus what fp16 rounding costs. Groups sit far from zero, where fp16's spacing is a good
    part of a step."""
    name = "fp16 step and zero point"
    refused = _own_work(name, fn, (kv_quant.quantize, kv_quant.QuantizedTensor))
    if refused is not None:
        return refused
    hint = ("rebuild the failing group (this message gives its size, mean and bits), run your function on it, "
            "and compare each element with its reconstruction from what the function returns.")
    trials = trials_for(12)
    gen = torch.Generator().manual_seed(seed_for(41))
    answer = guarded(fn, (kv_quant.quantize, kv_quant.QuantizedTensor))
    for trial in range(trials):
        group, bits = _offset_group_inputs(gen)
        try:
            got = answer(group.clone(), bits)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        except Refused as refused:
            return refusal(name, refused.names, hint)
        problem = _fp16_problem(got, group, bits)
        if problem:
            where = (f"trial {trial + 1} of {trials}, a group of {group.numel()} values with mean "
                     f"{float(group.mean()):.1f}, {bits} bits")
            return fail(name, where, problem, hint)
    return _report(Result(name, "passed", f"every element within half a stored step in {trials} groups."))


# ------------------------------------------------------------------------ the group size (experiment)
def _head_inputs(gen: torch.Generator) -> tuple:
    """A synthetic key head (T, D): Gaussian channels of uneven spread and mean, now and then an outlier token."""
    t, d = [128, 192, 256][randint(gen, 0, 2)], [16, 32][randint(gen, 0, 1)]
    spread = torch.exp(torch.randn(d, generator=gen) * 0.5)
    x = torch.randn(t, d, generator=gen) * spread + torch.randn(d, generator=gen)
    if randint(gen, 0, 1):
        x[randint(gen, 0, t - 1)] *= 4
    return x, [4, 8][randint(gen, 0, 1)], [1.5, 2.0, 3.0, 4.0][randint(gen, 0, 3)]


def _mse_ratio_at(x: torch.Tensor, bits: int, g: int) -> float:
    """MSE of per-group quantization (g tokens by all channels, no normalisation) over the per-token MSE."""
    per_group = kv_quant.mse(x, kv_quant.quantize(x, bits, g, normalize=False, granularity="group").dequantize())
    per_token = kv_quant.mse(x, kv_quant.quantize(x, bits, normalize=False, granularity="token").dequantize())
    return float(per_group / per_token)


@exercise
def check_group_size(fn) -> Result:
    """Check ``fn(x, bits, max_ratio) -> g``: a power-of-two group size at most ``T`` whose per-group MSE (``g``
    tokens by all channels share a step, no normalisation) is at most ``max_ratio`` times the per-token MSE,
    while ``2 g`` is over that bound or longer than the head (checked by measuring both)."""
    name = "largest group within an error budget"
    hint = ("re-read 'Which numbers share a step' and measure, on a head like the failing one, the error of the "
            "group sizes you are choosing between.")
    trials = trials_for(4)
    gen = torch.Generator().manual_seed(seed_for(43))
    answer = as_number(guarded(fn, (_mse_ratio_at,)))
    for trial in range(trials):
        x, bits, bound = _head_inputs(gen)
        t = x.shape[0]
        try:
            got = answer(x.clone(), bits, bound)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        except Refused as refused:
            return refusal(name, refused.names, hint)
        where = (f"trial {trial + 1} of {trials}, a head of {t} tokens by {x.shape[1]} channels, INT{bits}, "
                 f"bound {bound:g}")
        if isinstance(got, bool) or not isinstance(got, int) or got < 1 or got > t or got & (got - 1):
            return fail(name, where, "the answer is not a power of two between 1 and the head's length.", hint)
        if _mse_ratio_at(x, bits, got) > bound or (2 * got <= t and _mse_ratio_at(x, bits, 2 * got) <= bound):
            # one message whichever way it misses: which way would turn the search into a bisection
            return fail(name, where, "the group size returned is not the largest power of two whose measured "
                                     "error meets the bound on this head.", hint)
    return _report(Result(name, "passed", f"measured within the bound, and twice it over, on {trials} heads."))


UNPACK_KERNEL = "INT4 unpack with per-channel steps (KIVI keys)"
UNPACK_BLOCK_T = 16  # tokens per program when the check launches the student's kernel


def _unpack_inputs(gen: torch.Generator) -> tuple:
    """One head of odd size: T tokens, D = 2 * DP channels with DP odd, uneven channels, a random group size."""
    t = randint(gen, 1, 97) | 1
    dp = randint(gen, 1, 12) * 2 + 1
    g = [1, 3, 8, 32, 64][randint(gen, 0, 4)]
    spread = torch.exp(torch.randn(2 * dp, generator=gen))       # uneven channels: per-channel steps differ
    x = torch.randn(t, 2 * dp, generator=gen) * spread + torch.randn(2 * dp, generator=gen) * 3
    return x, g


def per_channel_pack(x: torch.Tensor, group: int) -> tuple:
    """KIVI-style INT4 keys of one head ``x (T, D)``: a step and a zero point per channel per group of ``group``
    tokens, fp16 ``(G, D)``; codes packed planar, ``(T, D/2)`` uint8 (channel j low nibble, j + D/2 high)."""
    t, d = x.shape
    n_groups = -(-t // group)
    scale = torch.empty(n_groups, d, dtype=torch.float16)
    zero = torch.empty(n_groups, d, dtype=torch.float16)
    codes = torch.empty(t, d, dtype=torch.uint8)
    for k in range(n_groups):
        rows = x[k * group:(k + 1) * group].double()
        lo, hi = rows.min(0).values, rows.max(0).values
        zero[k] = lo.half()
        scale[k] = ((hi - lo) / 15).clamp_min(1e-3).half()
        q = ((rows - zero[k].double()) / scale[k].double()).round().clamp(0, 15)
        codes[k * group:(k + 1) * group] = q.to(torch.uint8)
    packed = codes[:, : d // 2] | (codes[:, d // 2:] << 4)
    return packed.contiguous(), scale, zero, codes


def per_channel_unpack_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    """The reconstruction each code stands for: its channel's and group's step and zero point, fp32."""
    rows = torch.arange(codes.shape[0]) // group
    return (codes.float() * scale[rows].float() + zero[rows].float()).float()


def _launch_unpack(kernel, packed, scale, zero, t, d, group) -> torch.Tensor:
    """Launch the student's kernel; the output starts as NaN so an element the kernel never writes shows."""
    from labsrc.kernels._triton import triton

    dp = d // 2
    dev = runtime.DEVICE  # the GPU where there is one (compiled), else the CPU (interpreted)
    out = torch.full((t, d), float("nan"), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(t, UNPACK_BLOCK_T),)
    kernel[grid](packed.to(dev), scale.reshape(-1).to(dev), zero.reshape(-1).to(dev), out, t, dp, group,
                 BLOCK_T=UNPACK_BLOCK_T, BLOCK_DP=triton.next_power_of_2(dp))
    return out.cpu()


@exercise
def check_unpack_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T,
    BLOCK_DP)`` that unpacks one head's INT4 keys quantized per channel (KIVI) and dequantizes them.

    ``p_ptr``: uint8 ``(T, DP)``, channel ``j`` in the low nibble of byte ``j`` and channel ``j + DP`` in the
    high nibble; ``scale_ptr``, ``zero_ptr``: fp16 ``(G, 2 * DP)`` row-major, one step and zero point per channel
    per group of ``GROUP`` tokens; ``out_ptr``: fp32 ``(T, 2 * DP)``. The check launches one program per
    ``BLOCK_T`` tokens on random odd sizes and compares with :func:`per_channel_unpack_ref`. Without Triton
    (macOS, Windows) it prints that the kernel exercise is skipped.
    """
    from labsrc.kernels import kv_quant as kk

    if not runtime.HAS_TRITON:
        return triton_missing(UNPACK_KERNEL)
    from triton.runtime.jit import KernelInterface

    if not isinstance(kernel, KernelInterface):
        try:
            kernel()
        except NotImplementedError:
            return _report(Result(UNPACK_KERNEL, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
        except Exception:  # noqa: BLE001 - anything else is simply not a kernel
            pass
        return _report(Result(UNPACK_KERNEL, FAILED, "expected a Triton kernel (a function decorated with "
                                                     f"@triton.jit), got {type(kernel).__name__}."))
    refused = _own_work(UNPACK_KERNEL, kernel, (kk.dequantize_unpack, kk.dequantize_unpack_ref))
    if refused is not None:
        return refused
    hint = ("re-read 'Unpack and dequantize' and the per-channel grouping in 'Grouping: token, channel, group of "
            "tokens'; the first wrong element's channel and token say which load to look at.")
    trials = trials_for(6)
    gen = torch.Generator().manual_seed(seed_for(25))
    for trial in range(trials):
        x, g = _unpack_inputs(gen)
        t, d = x.shape
        packed, scale, zero, codes = per_channel_pack(x, g)
        where = f"trial {trial + 1} (T={t}, D={d}, group {g})"
        try:
            got = _launch_unpack(kernel, packed, scale, zero, t, d, g)
        except Exception as err:  # noqa: BLE001 - a student's kernel may fail in many ways; report which
            return _report(launch_failed(UNPACK_KERNEL, err, where, hint))
        expected = per_channel_unpack_ref(codes, scale, zero, g)
        if torch.isnan(got).any():
            return fail(UNPACK_KERNEL, where, "some output elements were never written.", hint)
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            bad = ~torch.isclose(got, expected, rtol=1e-5, atol=1e-6)
            t0, c0 = (int(i) for i in bad.nonzero()[0])
            return fail(UNPACK_KERNEL, f"{where}, first at token {t0}, channel {c0}",
                        "the output differs from the reference there.", hint)
    return _report(Result(UNPACK_KERNEL, "passed", f"agrees with the reference on {trials} random odd sizes."))
