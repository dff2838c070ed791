"""Checks for the exercises of the weight-quantization chapter.

Each check runs the student's answer on seeded cases and compares it with what the check measures itself with
:mod:`labsrc.weight_quant` (or computes from the definition); it prints ``passed``, what is wrong with a hint, or
``not solved yet`` while the answer still raises ``NotImplementedError``. Answers are never printed.

* :func:`check_rtn_outlier_ratio` -- a prediction, ``fn(n_groups, outlier) -> ratio``: how many times larger
  the RMS error of 8-bit RTN is with one step for the whole tensor than with one step per group of 32, for a
  weight whose groups all peak at 1 but one, which holds an outlier. Judged against the ratio the check
  measures with :func:`labsrc.weight_quant.quantize_rtn`.
* :func:`check_mxfp4_worst_error` -- a derivation, ``(floor, rceil)``: the largest relative error a block's
  largest element can suffer under MXFP4's floor rule and under the round-up (RCEIL) rule, judged against a
  dense sweep of block maxima.
* :func:`check_gptq_fix` -- debugging, ``fn(W, H, scale) -> Q``: the GPTQ pass of the exercise with its bug
  fixed, against an independent pass that updates the inverse Hessian of the free columns after every column.
* :func:`check_cheapest_config` -- an experiment, ``fn(w, bound) -> (bits, group_size)``: the RTN format with
  the fewest stored bytes whose relative weight error meets ``bound``, judged by the check's own sweep.
* :func:`check_int4_gemv_kernel` -- a ``@triton.jit`` kernel computing ``y = W_hat @ x`` straight from 4-bit
  codes packed eight to an int32 word (the layout of GPTQ/AWQ checkpoints, not the chapter's planar bytes),
  launched here under the interpreter; skipped, with a message, where Triton is unavailable.
"""
from __future__ import annotations

import math

import torch

from labsrc import runtime
from labsrc import weight_quant as wq
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, NOT_SOLVED, PASSED, Result, _report,
                                   _with_hint, exercise, hidden, launch_failed, randint, refuse_library, triton_missing)

__all__ = ["outlier_weight", "check_rtn_outlier_ratio", "check_mxfp4_worst_error", "gptq_buggy", "check_gptq_fix",
           "config_candidates", "check_cheapest_config", "pack_int32", "check_int4_gemv_kernel"]

_OWN = "write it yourself from the definition in the text."


def _not_solved(title: str, what: str = "function") -> Result:
    return _report(Result(title, NOT_SOLVED, f"Fill in the {what} above, then run this cell again."))


def _trials_and_seed(trials: int, seed: int) -> tuple[int, int]:
    """The visible case set, or the hidden one (another seed, more trials) inside ``hidden=True``."""
    return (trials * HIDDEN_TRIALS, seed + HIDDEN_SEED_OFFSET) if hidden() else (trials, seed)


def _number(x) -> float | None:
    """``x`` as a float when it is a real number (or a one-element tensor); else None."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


# ------------------------------------------------------------------------------ RTN: one outlier, two groupings
GROUP = 32
RATIO_RTOL = 0.08
"""How close a predicted ratio must come to the measured one. The measurement averages the squared errors of 12
random weights, which leaves it within about 2% of its expectation; a prediction from the right error model
lands within 4%."""


def outlier_weight(n_groups: int, outlier: float, gen: torch.Generator | None = None) -> torch.Tensor:
    """The exercise's weight: ``(n_groups, 32)`` fp32, one group of 32 per row, entries uniform in ``[-1, 1]``
    and one entry of every row exactly ``+-1`` (so every group's largest magnitude is 1), then one entry of row 0
    replaced by ``outlier``."""
    if not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be a positive int, got {n_groups!r}")
    if not isinstance(outlier, (int, float)) or not abs(outlier) > 1:
        raise ValueError(f"outlier must be a number larger than 1 in magnitude, got {outlier!r}")
    gen = torch.Generator().manual_seed(0) if gen is None else gen
    w = torch.rand(n_groups, GROUP, generator=gen, dtype=torch.float64) * 2 - 1
    at = torch.randint(0, GROUP, (n_groups,), generator=gen)
    sign = torch.where(torch.rand(n_groups, generator=gen) < 0.5, -1.0, 1.0).double()
    w[torch.arange(n_groups), at] = sign
    w[0, (int(at[0]) + 1) % GROUP] = float(outlier)
    return w.float()


def measured_outlier_ratio(n_groups: int, outlier: float, draws: int = 12, seed: int = 0) -> float:
    """The ratio the exercise asks to predict, measured: RMS error of 8-bit symmetric RTN with one step for the
    whole tensor over the RMS error with one step per group of 32, the squared errors summed over ``draws``
    random weights from :func:`outlier_weight`."""
    gen = torch.Generator().manual_seed(seed)
    per_tensor = per_group = 0.0
    for _ in range(draws):
        w = outlier_weight(n_groups, outlier, gen)
        per_tensor += float((wq.dequantize(wq.quantize_rtn(w, 8, per_tensor=True)) - w).double().pow(2).sum())
        per_group += float((wq.dequantize(wq.quantize_rtn(w, 8, GROUP)) - w).double().pow(2).sum())
    return math.sqrt(per_tensor / per_group)


def _ratio_case(gen):
    """A grouping and an outlier large enough that the outlier's own group shows in the ratio (the ratio of
    the steps alone misses the measurement by more than the tolerance)."""
    n_groups = [2, 4, 8, 16, 64, 256, 1024][randint(gen, 0, 6)]
    return n_groups, float(randint(gen, max(3, math.ceil(math.sqrt(0.4 * n_groups))), 40))


@exercise
def check_rtn_outlier_ratio(fn) -> Result:
    """Check ``fn(n_groups, outlier) -> float``, a prediction of ``RMS error per tensor / RMS error per group``
    (8-bit symmetric RTN, groups of 32) for :func:`outlier_weight`, against the ratio measured here, within
    ``RATIO_RTOL``."""
    title = "RTN error with an outlier: per tensor against per group"
    refused = refuse_library(title, fn, (wq.quantize_rtn, wq.dequantize, wq._params, measured_outlier_ratio), _OWN)
    if refused is not None:
        return refused
    hint = ("re-read 'The quantization formula' on what sets a group's step and how far rounding moves a "
            "weight, then add up the squared error group by group; the outlier's own group has a step too.")
    trials, seed = _trials_and_seed(5, 121)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        n_groups, outlier = _ratio_case(gen)
        where = f"trial {trial + 1} (n_groups={n_groups}, outlier={outlier:g})"
        try:
            got = _number(fn(n_groups, outlier))
        except NotImplementedError:
            return _not_solved(title)
        if got is None:
            return _report(Result(title, FAILED, _with_hint(f"{where}: return one finite number, the ratio.", hint)))
        truth = measured_outlier_ratio(n_groups, outlier, seed=seed + trial)
        if abs(got - truth) > RATIO_RTOL * truth:
            said = "too large" if got > truth else "too small"
            if abs(got - outlier) <= RATIO_RTOL * outlier:
                said += ("; it is the ratio of the two steps, which would hold if every group paid the "
                         "per-group step only")
            return _report(Result(title, FAILED, _with_hint(
                f"{where}: the prediction is {said} (the measured ratio is not within {RATIO_RTOL:.0%} of it).",
                hint)))
    return _report(Result(title, PASSED, f"within {RATIO_RTOL:.0%} of the measured ratio on {trials} weights."))


# ------------------------------------------------------------------------------- MXFP4: the worst block maximum
def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """E2M1 rounding (ties to even, saturating at 6) of positive fp32 values, through the library's encoder."""
    magnitudes = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    return magnitudes[(wq.e2m1_encode(v) & 7).long()]


def _worst_errors(points: int = 20001) -> tuple[float, float]:
    """The largest relative error of a block's largest element over a dense sweep of maxima across one octave
    (the rules are scale-invariant), under the floor rule (the library's quantizer) and the round-up rule."""
    m = torch.linspace(1.0, 2.0, points)[:-1] * 4.0          # every mantissa, at one exponent
    block = torch.zeros(m.numel(), 32)
    block[:, 0] = m
    codes, scales = wq.mxfp4_quantize(block)
    floor_vals = wq.mxfp4_dequantize(codes, scales)[:, 0]
    floor = float(((floor_vals - m).abs() / m).max())
    up = torch.ceil(torch.log2(m.double() / 6.0))              # the smallest power of two X with max / X <= 6
    scale = torch.exp2(up).float()
    rceil = float(((_e2m1_round(m / scale) * scale - m).abs() / m).max())
    return floor, rceil


WORST_ATOL = 0.005
"""How close each derived worst case must be to the sweep's (the sweep samples maxima 1/5000 of an octave
apart, so its supremum is within 1e-4 of the true one)."""


@exercise
def check_mxfp4_worst_error(answer) -> Result:
    """Check ``answer = (floor, rceil)``: the largest relative error ``|v_hat - v| / |v|`` the largest element
    ``v`` of an MXFP4 block can suffer under the floor rule of eq. (eq-wq-mx) and under the rule that picks the
    smallest power-of-two scale that clips nothing (the supremum, as a fraction), each within ``WORST_ATOL`` of
    a dense sweep measured here."""
    title = "MXFP4: the worst error of a block's largest element"
    hint = ("re-read 'MXFP4: a 4-bit float with a shared power-of-two scale': under each rule, where can the "
            "block's largest element land after the division, and which E2M1 values are its neighbours there?")
    got = answer
    if callable(answer):
        try:
            got = answer()
        except NotImplementedError:
            return _not_solved(title)
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(_number(x) is not None for x in got)):
        return _report(Result(title, FAILED, _with_hint(
            "give two numbers, (floor, rceil), each a fraction such as 0.1 for 10%.", hint)))
    floor, rceil = _worst_errors()
    wrong = []
    for said, mine, truth in (("floor rule", float(got[0]), floor), ("round-up rule", float(got[1]), rceil)):
        if abs(mine - truth) > WORST_ATOL:
            extra = " (as a percentage? give a fraction)" if abs(mine / 100 - truth) <= WORST_ATOL else ""
            wrong.append(f"the {said}'s worst case is {'too large' if mine > truth else 'too small'}{extra}")
    if wrong:
        return _report(Result(title, FAILED, _with_hint("; ".join(wrong).capitalize() + ".", hint)))
    return _report(Result(title, PASSED, "both worst cases agree with a sweep of 20,000 block maxima."))


# ------------------------------------------------------------------------------------ GPTQ: find the bug
def gptq_buggy(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exercise's GPTQ pass, with its bug: quantize ``W (N, K)`` column by column to the grid
    ``scale[n] * {-8, ..., 7}`` of each row, compensating the columns not yet quantized; ``H (K, K)`` positive
    definite. Returns the dequantized weight ``Q (N, K)``."""
    W = W.clone()
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
        err = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j + 1:] -= err[:, None] * Hinv[j, j + 1:][None, :]
    return Q


def _gptq_ref(W, H, scale):
    """GPTQ as eq. (eq-wq-obs) states it, computed another way than the chapter's Cholesky rows: after each
    column the inverse Hessian is replaced by the inverse over the columns still free (a Schur complement)."""
    W = W.clone()
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
        step = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j + 1:] -= step[:, None] * Hinv[j, j + 1:][None, :]
        Hinv = Hinv - Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / Hinv[j, j]
    return Q


def _gptq_case(gen):
    n, k = randint(gen, 1, 12), randint(gen, 2, 24)
    x = torch.randn(4 * k, k, generator=gen, dtype=torch.float64) @ torch.randn(k, k, generator=gen,
                                                                               dtype=torch.float64)
    H = 2 * x.T @ x / x.shape[0]
    H += 0.01 * H.diag().mean() * torch.eye(k, dtype=torch.float64)
    W = torch.randn(n, k, generator=gen, dtype=torch.float64)
    # a step per row that rounds finely enough for the compensation to matter: a third of RTN's
    return W, H, W.abs().amax(1) / 21


def _loss(W, Q, H) -> float:
    d = (W - Q).double()
    return float(torch.einsum("nk,kl,nl->", d, H.double(), d))


@exercise
def check_gptq_fix(fn) -> Result:
    """Check ``fn(W, H, scale) -> Q``: the GPTQ pass of :func:`gptq_buggy` with its bug fixed, equal (to 1e-9) to
    an independent pass on random float64 layers; ``W`` must not be changed."""
    title = "GPTQ: the bug in the error propagation"
    refused = refuse_library(title, fn, (wq.gptq_quantize, gptq_buggy), _OWN)
    if refused is not None:
        return refused
    hint = ("re-read 'GPTQ: quantize a column, let the others absorb the error' on which coordinates are still "
            "free at each step, and compare your pass with the buggy one on K = 2 and on K = 3.")
    trials, seed = _trials_and_seed(6, 123)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        W, H, scale = _gptq_case(gen)
        where = f"trial {trial + 1} (N={W.shape[0]}, K={W.shape[1]})"
        before = W.clone()
        try:
            got = fn(W, H, scale)
        except NotImplementedError:
            return _not_solved(title)
        if not torch.equal(W, before):
            return _report(Result(title, FAILED, _with_hint(f"{where}: your function changed W in place; work on a "
                                                            f"copy.", hint)))
        if not isinstance(got, torch.Tensor) or got.shape != W.shape:
            return _report(Result(title, FAILED, _with_hint(
                f"{where}: expected the dequantized weight of shape {tuple(W.shape)}, got "
                f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}.", hint)))
        want = _gptq_ref(W, H, scale)
        got = got.double()
        if torch.allclose(got, want, rtol=0, atol=1e-9 * float(scale.max())):
            continue
        bad = ~torch.isclose(got, want, rtol=0, atol=1e-9 * float(scale.max()))
        first = int(bad.any(0).nonzero()[0])
        if torch.allclose(got, gptq_buggy(W, H, scale)):
            said = "your pass returns what the buggy one does here."
        else:
            said = f"columns before {first} are right and column {first} is the first wrong one."
        worse = _loss(W, got, H) > _loss(W, want, H) * (1 + 1e-9)
        said += " Its layer-output error is larger than GPTQ's." if worse else ""
        return _report(Result(title, FAILED, _with_hint(f"{where}: {said}", hint)))
    return _report(Result(title, PASSED, f"equal to GPTQ on {trials} random layers."))


# ------------------------------------------------------------------------- the cheapest format under a bound
def config_candidates(k: int) -> list[tuple[int, int | None]]:
    """The formats the experiment chooses from for a weight with ``k`` input columns: ``(bits, group_size)``
    with bits 2, 3, 4 or 8 and groups of 16, 32, 64 or 128 columns or one per output channel (``None``)."""
    return [(b, g) for b in (2, 3, 4, 8) for g in (16, 32, 64, 128, None) if g is None or g < k]


def _relative_error(w, bits, g) -> float:
    w_hat = wq.dequantize(wq.quantize_rtn(w, bits, g))
    return float((w_hat - w).double().norm() / w.double().norm())


def _sweep(w) -> dict:
    """``{(bits, group_size): (stored bytes, relative error)}`` for every candidate format of ``w``."""
    return {(b, g): (wq.quantize_rtn(w, b, g).nbytes, _relative_error(w, b, g)) for b, g in config_candidates(w.shape[1])}


def _cheapest_ref(table: dict, bound: float):
    meeting = [(nbytes, config) for config, (nbytes, err) in table.items() if err <= bound]
    return min(meeting)[1] if meeting else None


def _config_case(gen):
    """A heavy-tailed weight (Student-t, 3 degrees of freedom: a few large entries, as trained layers have), its
    sweep, and a bound among the errors of the 3- and 4-bit formats, where group size and bits trade."""
    n, k = randint(gen, 16, 48), [128, 256][randint(gen, 0, 1)]
    z = torch.randn(4, n, k, generator=gen, dtype=torch.float64)
    # Student-t with 3 degrees of freedom: a normal over the root of an independent chi-square / 3
    w = (z[0] / torch.sqrt(z[1:].pow(2).sum(0) / 3) * 0.02).float()
    table = _sweep(w)
    errs = sorted(err for (b, _), (_, err) in table.items() if b in (3, 4))
    lo, hi = errs[0], errs[-1]
    bound = math.exp(math.log(lo) + float(torch.rand(1, generator=gen)) * (math.log(hi) - math.log(lo)))
    return w, bound, table


@exercise
def check_cheapest_config(fn) -> Result:
    """Check ``fn(w, bound) -> (bits, group_size)``: among :func:`config_candidates`, the symmetric RTN format
    (``quantize_rtn``) with the fewest stored bytes (``QuantizedWeight.nbytes``) whose relative weight error
    ``||W_hat - W||_F / ||W||_F`` is at most ``bound``, on heavy-tailed random weights. The check runs the sweep
    itself."""
    title = "the cheapest format under an error bound"
    hint = ("re-read 'Round-to-nearest, packing and the cost of a shared step': measure every candidate's "
            "error and stored bytes on the failing weight, the steps counted, and print them side by side.")
    trials, seed = _trials_and_seed(3, 126)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        w, bound, table = _config_case(gen)
        where = f"trial {trial + 1} (w {tuple(w.shape)}, bound {bound:.4g})"
        try:
            got = fn(w.clone(), bound)
        except NotImplementedError:
            return _not_solved(title)
        got = tuple(got) if isinstance(got, list) else got
        if got == _cheapest_ref(table, bound):
            continue
        if got not in table:
            said = "the answer is not one of config_candidates(K): give (bits, group_size)."
        elif table[got][1] > bound:
            said = f"{got} does not meet the bound on this weight."
        else:
            said = f"{got} meets the bound, but another candidate stores fewer bytes."
        return _report(Result(title, FAILED, _with_hint(f"{where}: {said}", hint)))
    return _report(Result(title, PASSED, f"picks the cheapest format that meets the bound on {trials} weights."))


# ------------------------------------------------------------------------------------------- GEMV kernel
GEMV_KERNEL = "INT4 GEMV kernel (int32 words)"
GEMV_BLOCK_N = 32
GEMV_BLOCK_W = 32
PER_WORD = 8


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``(N, K)`` (``K`` a multiple of 8) into int32 words ``(N, K/8)``: column ``8 w + i`` in
    bits ``4 i .. 4 i + 3`` of word ``w``, the order of GPTQ/AWQ checkpoints along K (a code of 8 or more in the
    top nibble makes the word negative)."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.is_floating_point():
        raise TypeError("codes must be a 2-D integer tensor (N, K)")
    if codes.shape[1] % PER_WORD:
        raise ValueError(f"codes must have a multiple of 8 columns, got {codes.shape[1]}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("codes must hold 4-bit values in [0, 15]")
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, PER_WORD)
    words = (c << (4 * torch.arange(PER_WORD))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _gemv_inputs(gen):
    n = randint(gen, 1, 40)
    k = PER_WORD * randint(gen, 1, 40)
    g = [3, 16, 24, 40, k][randint(gen, 0, 4)]
    w = torch.randn(n, k, generator=gen) * 0.1
    qw = wq.quantize_rtn(w, 4, g, bool(randint(gen, 0, 1)))
    return qw, torch.randn(k, generator=gen)


def _launch_gemv(kernel, qw, x):
    from labsrc.kernels._triton import triton

    n, k = qw.shape
    dev = runtime.DEVICE
    y = torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
    words = pack_int32(qw.codes)
    groups = qw.scales.shape[1]
    kernel[(triton.cdiv(n, GEMV_BLOCK_N),)](x.to(dev), words.to(dev), qw.scales.to(dev), qw.zeros.to(dev), y, n,
                                            k // PER_WORD, groups, qw.group_size, BLOCK_N=GEMV_BLOCK_N,
                                            BLOCK_W=GEMV_BLOCK_W)
    return y.cpu()


def _gemv_slips(qw, x) -> list[tuple[str, torch.Tensor]]:
    """What a kernel with a typical slip would return, to name the slip: the top code of a word read with its
    sign, or the codes of a word in reverse order."""
    n, k = qw.shape
    codes = qw.codes.long()
    s = qw.scales.float().repeat_interleave(qw.group_size, 1)[:, :k]
    z = qw.zeros.float().repeat_interleave(qw.group_size, 1)[:, :k]
    signed = codes.clone()
    top = signed[:, PER_WORD - 1::PER_WORD]
    signed[:, PER_WORD - 1::PER_WORD] = torch.where(top >= 8, top - 16, top)
    reverse = codes.reshape(n, -1, PER_WORD).flip(-1).reshape(n, k)
    return [("the eighth code of a word, when it is 8 or more, is read as a negative number",
             ((signed.float() - z) * s).double() @ x.double()),
            ("the eight codes of each word are read in the reverse order", ((reverse.float() - z) * s).double()
             @ x.double())]


@exercise
def check_int4_gemv_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, WORDS, G, GROUP, BLOCK_N,
    BLOCK_W)`` computing ``y = W_hat @ x`` for one activation vector ``x`` (fp32, ``K = 8 * WORDS``) from a
    4-bit weight packed eight codes to an int32 word (``q_ptr``: int32 ``(N, WORDS)``, column ``8 w + i`` in
    bits ``4 i .. 4 i + 3`` of word ``w``, see :func:`pack_int32`; ``s_ptr`` fp16 and ``z_ptr`` uint8
    ``(N, G)``, one per ``GROUP`` columns; ``w = (q - z) * s``); ``y_ptr``: fp32 ``(N,)``. One program per
    ``BLOCK_N`` rows, looping over the words ``BLOCK_W`` at a time. Compared with ``dequantize(qw) @ x`` on
    random odd sizes, group sizes that do not divide K included, symmetric and asymmetric. Without Triton it
    prints that the kernel exercise is skipped (and, when grading, raises: see ``triton_missing``).
    """
    from labsrc.kernels import weight_quant as kw

    if not runtime.HAS_TRITON:
        return triton_missing(GEMV_KERNEL)
    from triton.runtime.jit import KernelInterface

    if not isinstance(kernel, KernelInterface):
        try:
            kernel()
        except NotImplementedError:
            return _not_solved(GEMV_KERNEL, "kernel")
        except Exception:  # noqa: BLE001 - any other failure: it is not a launchable kernel
            pass
        return _report(Result(GEMV_KERNEL, FAILED, "expected a Triton kernel (a function decorated with "
                                                   f"@triton.jit), got {type(kernel).__name__}."))
    refused = refuse_library(GEMV_KERNEL, kernel, (kw.int4_matmul, kw.int4_matmul_ref, kw._int4_matmul_kernel,
                                                   wq.dequantize), _OWN)
    if refused is not None:
        return refused
    hint = ("re-read 'The kernels' for the walk over K and the group lookup, and the word layout in the task; "
            "the message says which rows are wrong, and a trial whose GROUP does not divide 8 tests the group "
            "of each code.")
    trials, seed = _trials_and_seed(4, 125)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        qw, x = _gemv_inputs(gen)
        where = f"trial {trial + 1} (N={qw.shape[0]}, K={qw.shape[1]}, group {qw.group_size})"
        try:
            got = _launch_gemv(kernel, qw, x)
        except Exception as err:  # noqa: BLE001 - a student's kernel may fail in many ways; report which
            return _report(launch_failed(GEMV_KERNEL, err, where, hint))
        expected = (wq.dequantize(qw).double() @ x.double()).float()
        if torch.isnan(got).any():
            return _report(Result(GEMV_KERNEL, FAILED, _with_hint(
                f"{where}: {int(torch.isnan(got).sum())} output element(s) were never written.", hint)))
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            bad = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-4)
            rows = bad.nonzero().flatten()
            full = (qw.shape[0] // GEMV_BLOCK_N) * GEMV_BLOCK_N
            tail = (" (only rows of the last, partial block of BLOCK_N rows)" if 0 < full <= int(rows.min())
                    else "")
            slip = next((f" It is what you get when {said}." for said, y in _gemv_slips(qw, x)
                         if torch.allclose(got, y.float(), rtol=1e-4, atol=1e-4)), "")
            return _report(Result(GEMV_KERNEL, FAILED, _with_hint(
                f"{where}: {int(bad.sum())} of {bad.numel()} outputs differ, the first at row "
                f"{int(rows[0])}{tail}.{slip}", hint)))
    return _report(Result(GEMV_KERNEL, PASSED, f"agrees with the reference on {trials} random odd sizes."))
