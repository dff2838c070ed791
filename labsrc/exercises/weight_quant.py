"""Checks for the exercises of the weight-quantization chapter.

Each check runs the student's answer on seeded cases and compares it with what the check measures itself with
:mod:`labsrc.weight_quant` (or computes from the definition); it prints ``passed``, what is wrong with a hint, or
``not solved yet`` while the answer still raises ``NotImplementedError``. Answers are never printed.

* :func:`check_rtn_outlier_ratio` -- a prediction, ``fn(n_groups, outlier) -> ratio``: how many times larger
  the RMS error of 8-bit RTN is with one step for the whole tensor than with one step per group of 32, for a
  weight whose groups all peak at 1 but one, which holds an outlier. Judged against the ratio the check
  measures with :func:`labsrc.weight_quant.quantize_rtn`.
* :func:`check_mxfp4_worst_error` -- a derivation, ``fn(grid) -> (floor, rceil)``: the largest relative error a
  block's largest element can suffer under MX's floor rule and under the round-up (RCEIL) rule, for an element
  format given by its magnitudes (E2M1 and others), judged against a dense sweep of block maxima.
* :func:`check_gptq_fix` -- debugging, ``fn(W, H, scale, block) -> Q``: the blocked GPTQ pass of the exercise
  with its bug fixed, against an independent unblocked pass that updates the inverse Hessian of the free
  columns after every column.
* :func:`check_cheapest_config` -- an experiment, ``fn(w, bound) -> (bits, group_size)``: the RTN format with
  the fewest stored bytes whose relative weight error meets ``bound``, judged by re-running the measurement on
  the chosen format.
* :func:`check_int4_gemv_kernel` -- a ``@triton.jit`` kernel computing ``y = W_hat @ x`` straight from 4-bit
  codes packed eight to an int32 word (the layout of GPTQ/AWQ checkpoints, not the chapter's planar bytes),
  launched here under the interpreter; skipped, with a message, where Triton is unavailable.
"""
from __future__ import annotations

import math

import torch

from labsrc import runtime
from labsrc import weight_quant as wq
from labsrc.exercises.core import (NOT_SOLVED, PASSED, Result, _report, _with_hint, exercise, hidden, launch_failed,
                                   randint, refuse_library, triton_missing)

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["outlier_weight", "check_rtn_outlier_ratio", "fp_grid", "check_mxfp4_worst_error", "gptq_blocked_buggy",
           "check_gptq_fix",
           "config_candidates", "check_cheapest_config", "pack_int32", "check_int4_gemv_kernel"]

_OWN = "write it yourself from the definition in the text."


def _not_solved(title: str, what: str = "function") -> Result:
    message = {"function": "Fill in the function above, then run this cell again.",
               "kernel": "Fill in the kernel above, then run this cell again."}[what]
    return _report(Result(title, NOT_SOLVED, message))


def _trials_and_seed(trials: int, seed: int) -> tuple[int, int]:
    """The visible case set, or the hidden one (another seed, more trials) inside ``hidden=True``."""
    return trials_for(trials), seed_for(seed)


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
        raise ValueError(f"outlier must be a number of magnitude over 1, got {outlier!r}")
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
    hint = ("add up the squared error group by group for the failing case, each group with the step it pays, "
            "then measure that case with quantize_rtn in a scratch cell.")
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
            return failed(title, _with_hint(f"{where}: return one finite number, the ratio.", hint))
        truth = measured_outlier_ratio(n_groups, outlier, seed=seed + trial)
        if not abs(got - truth) <= RATIO_RTOL * truth:
            return failed(title, _with_hint(
                f"{where}: the prediction is not within {RATIO_RTOL:.0%} of the ratio the check measures.", hint))
    return _report(Result(title, PASSED, f"within {RATIO_RTOL:.0%} of the measured ratio on all the check's weights."))


# ------------------------------------------------------------------------------- MXFP4: the worst block maximum
def fp_grid(exponent_bits: int, mantissa_bits: int) -> list[float]:
    """The non-negative magnitudes of a small float element format ExMy as MX uses them (OCP MX: bias
    ``2^(x-1) - 1``, subnormals, no infinities or NaN): E2M1 is ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``."""
    if exponent_bits < 1 or mantissa_bits < 0:
        raise ValueError(f"need at least one exponent bit and no negative mantissa bits, got "
                         f"E{exponent_bits}M{mantissa_bits}")
    bias, steps = 2 ** (exponent_bits - 1) - 1, 2 ** mantissa_bits
    values = {k / steps * 2.0 ** (1 - bias) for k in range(steps)}
    values |= {(1 + k / steps) * 2.0 ** (e - bias) for e in range(1, 2 ** exponent_bits) for k in range(steps)}
    return sorted(values)


def _round_to_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Each positive value of ``v`` rounded to its nearest point of ``grid`` (float64), saturating at the top."""
    idx = torch.searchsorted(grid, v.clamp(max=float(grid[-1])))
    hi = grid[idx.clamp(max=grid.numel() - 1)]
    lo = grid[(idx - 1).clamp(min=0)]
    return torch.where((v - lo).abs() <= (hi - v).abs(), lo, hi)


def _worst_errors(grid, points: int = 40001) -> tuple[float, float]:
    """The largest relative error of a block's largest element ``m`` over a dense sweep of one octave of maxima
    (both rules are scale-invariant), quantized with the element format ``grid``: the floor rule divides by
    ``2^(floor(log2 m) - emax)`` with ``emax = floor(log2 max(grid))`` (MX's rule, eq. eq-wq-mx, clipping above
    the grid), the round-up rule by the smallest power of two that leaves ``m`` at most ``max(grid)``."""
    g = torch.tensor(grid, dtype=torch.float64)
    top = float(g[-1])
    emax = math.floor(math.log2(top))
    m = 2.0 ** emax * (1 + torch.arange(points, dtype=torch.float64) / points)   # [2^emax, 2^(emax + 1))
    floor = float(((_round_to_grid(m, g) - m).abs() / m).max())
    up = (top / 2) * (1 + torch.arange(1, points + 1, dtype=torch.float64) / points)  # (top / 2, top]
    rceil = float(((_round_to_grid(up, g) - up).abs() / up).max())
    return floor, rceil


WORST_ATOL = 0.002
"""How close each derived worst case must be to the sweep's (the sweep samples maxima 1/40,000 of an octave
apart, so its supremum is within 1e-4 of the true one)."""

_VISIBLE_FORMATS = ((2, 1), (3, 2), (1, 2))
_HIDDEN_FORMATS = ((2, 3), (3, 0), (4, 3), (2, 2), (5, 2), (3, 1))


@exercise
def check_mxfp4_worst_error(fn) -> Result:
    """Check ``fn(grid) -> (floor, rceil)``: for an element format given by its non-negative magnitudes ``grid``
    (sorted, 0 first; :func:`fp_grid`), the largest relative error ``|v_hat - v| / |v|`` the largest element
    ``v`` of an MX block can suffer under the floor rule of eq. (eq-wq-mx) and under the rule that picks the
    smallest power-of-two scale that clips nothing (the supremum, as a fraction), each within ``WORST_ATOL`` of a
    dense sweep measured here. Visible: E2M1 (MXFP4), E3M2 and E1M2; hidden: other formats."""
    title = "MX: the worst error of a block's largest element"
    hint = ("under each rule, where can the block's largest element land after the division, and which grid "
            "values are its neighbours there? Sweep a few maxima of the failing format in a scratch cell.")
    refused = refuse_library(title, fn, (wq.mxfp4_quantize, wq.mxfp4_dequantize, wq.e2m1_encode, _worst_errors,
                                         _round_to_grid), _OWN, args=(fp_grid(2, 1),))
    if refused is not None:
        return refused
    formats = _HIDDEN_FORMATS if hidden() else _VISIBLE_FORMATS
    for e, m in formats:
        grid = fp_grid(e, m)
        where = f"E{e}M{m} (grid {grid if len(grid) <= 8 else f'of {len(grid)} magnitudes up to {grid[-1]:g}'})"
        try:
            got = fn(list(grid))
        except NotImplementedError:
            return _not_solved(title)
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(_number(x) is not None for x in got)):
            return failed(title, _with_hint(
                f"{where}: give two numbers, (floor, rceil), each a fraction such as 0.1 for 10%.", hint))
        truths = _worst_errors(grid)
        wrong = [said for said, mine, truth in zip(("the floor rule's", "the round-up rule's"), got, truths)
                 if not abs(float(mine) - truth) <= WORST_ATOL]
        if wrong:
            return failed(title, _with_hint(
                f"{where}: {' and '.join(wrong)} worst case {'is' if len(wrong) == 1 else 'are'} not within "
                f"{WORST_ATOL} of a dense sweep of block maxima.", hint))
    return _report(Result(title, PASSED, "both worst cases agree with a dense sweep on all the check's formats."))


# ------------------------------------------------------------------------------------ GPTQ: find the bug
def gptq_blocked_buggy(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The exercise's GPTQ pass in blocks of ``block`` columns, with its bug: quantize ``W (N, K)`` column by
    column to the grid ``scale[n] * {-8, ..., 7}`` of each row, compensating the columns not yet quantized
    inside the block at once and the columns after the block lazily, one matrix product per block; ``H (K, K)``
    positive definite. Returns the dequantized weight ``Q (N, K)``."""
    W = W.clone()
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    K = W.shape[1]
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        E = torch.zeros(W.shape[0], b1 - b0, dtype=W.dtype)
        for j in range(b0, b1):
            Q[:, j] = torch.clamp(torch.round(W[:, j] / scale), -8, 7) * scale
            err = (W[:, j] - Q[:, j]) / U[j, j]
            W[:, j + 1:] -= err[:, None] * U[j, j + 1:][None, :]
            E[:, j - b0] = err
        W[:, b1:] -= E @ U[b0:b1, b1:]
    return Q


def _gptq_ref(W, H, scale, block=None):
    """GPTQ as eq. (eq-wq-obs) states it, one column at a time and without blocks (``block`` changes nothing),
    computed another way than the chapter's Cholesky rows: after each column the inverse Hessian is replaced by
    the inverse over the columns still free (a Schur complement)."""
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
    block = (1, 2, 3, 4, 5, 8, 32)[randint(gen, 0, 6)]
    # a step per row that rounds finely enough for the compensation to matter: a third of RTN's
    return W, H, W.abs().amax(1) / 21, block


@exercise
def check_gptq_fix(fn) -> Result:
    """Check ``fn(W, H, scale, block) -> Q``: the blocked GPTQ pass of :func:`gptq_blocked_buggy` with its bug
    fixed, equal (to 1e-9) to an unblocked pass computed another way, on random float64 layers and block sizes
    (one column, several, more than the layer has); ``W`` must not be changed."""
    title = "GPTQ in blocks, fixed"
    refused = refuse_library(title, fn, (wq.gptq_quantize, gptq_blocked_buggy, _gptq_ref), _OWN)
    if refused is not None:
        return refused
    hint = ("run the handed-out pass and an unblocked one on the failing sizes, and follow one column's error "
            "to every column it reaches, counting how often it arrives.")
    trials, seed = _trials_and_seed(8, 123)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        W, H, scale, block = _gptq_case(gen)
        where = f"trial {trial + 1} (N={W.shape[0]}, K={W.shape[1]}, block={block})"
        before = W.clone()
        try:
            got = fn(W, H, scale, block)
        except NotImplementedError:
            return _not_solved(title)
        if not torch.equal(W, before):
            return failed(title, _with_hint(f"{where}: your function changed W in place; work on a "
                                                            f"copy.", hint))
        if not isinstance(got, torch.Tensor) or got.shape != W.shape:
            return failed(title, _with_hint(
                f"{where}: return the dequantized weight, of W's shape.", hint))
        want = _gptq_ref(W, H, scale)
        got = got.double()
        if torch.allclose(got, want, rtol=0, atol=1e-9 * float(scale.max())):
            continue
        bad = ~torch.isclose(got, want, rtol=0, atol=1e-9 * float(scale.max()))
        first = int(bad.any(0).nonzero()[0])
        said = f"columns before {first} agree with GPTQ and column {first} is the first that does not."
        return failed(title, _with_hint(f"{where}: {said}", hint))
    return _report(Result(title, PASSED, "equal to GPTQ on all the check's random layers and block sizes."))


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
    ``||W_hat - W||_F / ||W||_F`` is at most ``bound``, on heavy-tailed random weights. The check re-runs the
    measurement on the chosen format and compares its bytes with every candidate's that meets the bound."""
    title = "the cheapest format under an error bound"
    hint = ("measure the failing weight yourself: each candidate's error as the task defines it, and what it "
            "stores, steps included.")
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
        # the candidate the answer names (2.0 names 2), so the measurement below runs on the library's own types
        got = next((c for c in table if got is not None and c == got), got)
        want = _cheapest_ref(table, bound)
        if got is None and want is None:
            continue
        if got is not None and got not in table:
            said = "the answer is not one of config_candidates(K): give (bits, group_size), or None."
        elif got is None:
            said = "some candidate meets the bound on this weight, and the answer is None."
        elif want is None:
            said = "no candidate meets the bound on this weight, and the answer is not None."
        else:
            # the measurement, re-run on the choice: it must meet the bound and store no more than any that does
            nbytes, err = wq.quantize_rtn(w, *got).nbytes, _relative_error(w, *got)
            if err <= bound and nbytes <= table[want][0]:
                continue
            said = "the answer is not both within the bound and the fewest stored bytes among those that are."
        return failed(title, _with_hint(f"{where}: {said}", hint))
    return _report(Result(title, PASSED, "picks the cheapest format that meets the bound on all the check's weights."))


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
        return failed(GEMV_KERNEL, "expected a Triton kernel (a function decorated with "
                                   f"@triton.jit), got {type(kernel).__name__}.")
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
            return failed(GEMV_KERNEL, _with_hint(
                f"{where}: some output elements were never written.", hint))
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            bad = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-4)
            rows = bad.nonzero().flatten()
            full = (qw.shape[0] // GEMV_BLOCK_N) * GEMV_BLOCK_N
            tail = (" (only rows of the last, partial block of BLOCK_N rows)" if 0 < full <= int(rows.min())
                    else "")
            slip = next((f" It is what you get when {said}." for said, y in _gemv_slips(qw, x)
                         if torch.allclose(got, y.float(), rtol=1e-4, atol=1e-4)), "")
            return failed(GEMV_KERNEL, _with_hint(
                f"{where}, row {int(rows[0])}{tail}: the first output that differs from the reference.{slip}", hint))
    return _report(Result(GEMV_KERNEL, PASSED, "agrees with the reference on all the check's random odd sizes."))
