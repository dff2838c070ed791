"""Checks for the exercises of the architecture-frontier chapter.

* :func:`check_distractor_sign_change` -- a derivation, ``fn(needle, distractor, lam)``: the sequence length at
  which differential attention stops turning a distractor's weight negative, when only the first map sees the
  needle. The truth is measured on the two maps of :func:`labsrc.kernels.frontier.diff_attention_ref` built for
  that case, on both sides of the change.
* :func:`check_mod_block_fraction` -- a derivation, ``fn(capacity, T, d)``: the fraction of a full block's
  FLOPs that a Mixture-of-Depths block does at a capacity, counted as :func:`labsrc.kv_cache.forward_flops`
  counts them.
* :func:`check_yoco_length` -- a derivation, ``fn(n_layers, window, fraction)``: the context at which a
  YOCO-style model (sliding-window lower half, one shared global cache for the upper half) keeps ``fraction`` of
  the ordinary cache, graded by counting both caches' bytes at the returned length.
* :func:`check_diff_norm_kernel` -- a ``@triton.jit`` kernel that fuses the DIFF layer's per-head RMSNorm and
  ``(1 - lambda_init)`` scale into one block of differential attention (the chapter's kernel leaves both to
  PyTorch), launched by the check under Triton's interpreter and compared with
  :func:`labsrc.frontier.diff_head_norm` of :func:`labsrc.kernels.frontier.diff_attention_ref`.

Expected answers are never printed; a failure names the case and the invariant the answer breaks there.
"""
from __future__ import annotations

import math

import torch

from labsrc import frontier, kv_cache
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (NOT_SOLVED, PASSED, Result, _report, as_number, check_function, exercise, hidden,
                                   randint, refuse_library, tolerance)
from labsrc.kernels import frontier as kfr

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["check_distractor_sign_change", "check_mod_block_fraction", "check_yoco_length",
           "check_diff_norm_kernel"]


# ------------------------------------------------------------------------------------------ the distractor
def _distractor_weights(T, needle, distractor, lam) -> tuple[float, float]:
    """Build the case and measure the distractor's weight in each map: keys along the all-ones query, scaled so
    that the last query's scaled scores are exactly ``needle`` (first map only), ``distractor`` (both maps) and 0
    elsewhere; the two maps' last rows of :func:`labsrc.kernels.frontier.diff_attention_ref`."""
    d_needle, d_distractor = T // 3, (2 * T) // 3
    s1, s2 = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    s1[d_needle], s1[d_distractor], s2[d_distractor] = needle, distractor, distractor
    D = 16                                           # every key a multiple of the all-ones query
    q = torch.ones(1, 1, T, D, dtype=torch.float64)
    k1, k2 = ((s * math.sqrt(D) / D)[None, None, :, None].expand(1, 1, T, D) for s in (s1, s2))
    v = torch.zeros(1, 1, T, D, dtype=torch.float64)
    _, a1, a2 = kfr.diff_attention_ref(q, k1, q, k2, v, lam, return_maps=True)
    return float(a1[0, 0, -1, d_distractor]), float(a2[0, 0, -1, d_distractor])


def _sign_change_truth(needle, distractor, lam) -> float:
    """The length at which the measured differential weight ``w1 - lam w2`` changes sign. Its sign is that of
    ``1 / w2 - lam / w1``, which is affine in T (each map's denominator grows by one per token), so the maps
    measured at two lengths fix its root."""
    def h(T):
        w1, w2 = _distractor_weights(T, needle, distractor, lam)
        return 1 / w2 - lam / w1
    a, b = 8, 64
    return a - h(a) * (b - a) / (h(b) - h(a))


def _sign_change_case(gen):
    """(needle, distractor, lam) whose sign change falls between 4 and 100,000 tokens, where the maps can be
    built and measured on both sides of it."""
    while True:
        needle = round(2 + 9 * float(torch.rand((), generator=gen)), 2)
        distractor = round(5 * float(torch.rand((), generator=gen)) - 1, 2)
        lam = round(0.1 + 0.85 * float(torch.rand((), generator=gen)), 2)
        T = _sign_change_truth(needle, distractor, lam)
        if 4 < T < 1e5 and abs(T - round(T)) > 0.05:
            return needle, distractor, lam


@exercise
def check_distractor_sign_change(fn) -> Result:
    """Check ``fn(needle, distractor, lam) -> T``: the sequence length at which the distractor's weight under
    differential attention (the first map minus ``lam`` times the second) changes sign, for the last query of a
    causal sequence whose scaled scores are ``needle`` on one key in the first map only, ``distractor`` on one key
    in both maps and 0 elsewhere. The truth is measured on the maps of
    :func:`labsrc.kernels.frontier.diff_attention_ref` built for that case (on both sides of the change)."""
    name = "where the subtraction stops turning a distractor negative"
    hint = ("write each map's softmax denominator for the last query as a function of T, then the sign of the "
            "differential weight; check your length on a case by building the two maps at lengths on both sides "
            "of it.")
    refused = refuse_library(name, fn, (kfr.diff_attention_ref, frontier.diff_attention, torch.softmax,
                                        torch.nn.functional.softmax, torch.nn.functional.log_softmax,
                                        torch.logsumexp, torch.Tensor.softmax),
                             hint, owner="torch's or labsrc.frontier", args=(6.0, 1.0, 0.8))
    if refused is not None:
        return refused
    trials, seed = trials_for(8), seed_for(151)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        case = _sign_change_case(gen)
        where = "trial {} (needle={}, distractor={}, lam={})".format(trial + 1, *case)
        try:
            got = fn(*case)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        got = got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            return failed(name, f"{where}: return one finite number, a length. Hint: {hint}")
        if not math.isclose(got, _sign_change_truth(*case), rel_tol=1e-6):
            return failed(name, f"{where}: the measured differential weight does not change sign "
                                f"at the returned length. Hint: {hint}")
    return _report(Result(name, PASSED, "right on all the check's cases, measured on both sides of each change."))


# ------------------------------------------------------------------------------------------ MoD's FLOPs
def _mod_inputs(gen):
    capacity = [0.125, 0.25, 0.3, 0.37, 0.5, 0.75, 1.0, 0.01, 0.6][randint(gen, 0, 8)]
    return capacity, randint(gen, 1, 4096), [16, 32, 64, 128, 512, 4096][randint(gen, 0, 5)]


def _mod_fraction_ref(capacity, T, d):
    """A block of ``8 d^2`` matmul weights (attention projections and MLP) over ``T`` tokens against one that
    runs only its routed tokens, both causal, FLOPs as ``kv_cache.forward_flops`` counts them."""
    k = frontier.mod_capacity_count(T, capacity)
    return kv_cache.forward_flops(8 * d * d, 1, d, k, k) / kv_cache.forward_flops(8 * d * d, 1, d, T, T)


def _explain_mod(fn):
    def explain(got, expected, capacity, T, d) -> str:
        k = frontier.mod_capacity_count(T, capacity)
        if capacity * T != k:
            whole = max(1, k) / T                   # a capacity at which the routed count needs no rounding
            if math.isclose(as_number(fn)(whole, T, d), _mod_fraction_ref(whole, T, d), rel_tol=1e-6):
                return ("Your answer is right when capacity x T is a whole number, and wrong on this case, "
                        "where it is not.")
        return ""
    return explain


@exercise
def check_mod_block_fraction(fn) -> Result:
    """Check ``fn(capacity, T, d) -> float``: the FLOPs of a Mixture-of-Depths block of width ``d`` (attention
    projections ``4 d^2`` and MLP ``4 d^2`` weights) that routes ``round(capacity T)`` tokens (halves up, at
    least 1) of a ``T``-token sequence, causal attention among them, over the FLOPs of the same block run on all
    ``T`` tokens; FLOPs as :func:`labsrc.kv_cache.forward_flops` counts them."""
    name = "the share of a block's FLOPs a MoD block does"
    hint = ("count a full block's matmul FLOPs and attention FLOPs for T tokens separately, then a routed "
            "block's, on the failing case by hand.")
    refused = refuse_library(name, fn, (kv_cache.forward_flops, frontier.variant_flops_per_token,
                                        frontier.mod_flops_fraction, frontier.mod_capacity_count), hint,
                             owner="labsrc", args=(0.5, 72, 32))
    if refused is not None:
        return refused
    return check_function(name, as_number(fn), _mod_fraction_ref, _mod_inputs, trials=14, seed=152, rtol=1e-9,
                          atol=1e-12, hint=hint, explain=_explain_mod(fn))


# ------------------------------------------------------------------------------------------ YOCO's cache
def _yoco_share(n_layers, window, seq_len) -> float:
    """YOCO's cache over the ordinary one at ``seq_len`` tokens, counted with
    :func:`labsrc.kv_cache.kv_cache_bytes` (one KV head of 128, fp16; the shape cancels): the lower half's
    ``window``-token caches and one global cache, against every layer caching every token. ``seq_len`` may be
    fractional (the bytes are linear in it on each side of the window)."""
    def cache(layers, tokens):           # linear in tokens: interpolate kv_cache_bytes between integers
        lo = math.floor(tokens)
        base = kv_cache.kv_cache_bytes(layers, 1, 128, max(lo, 1), 1, 2) * (lo >= 1)
        return base + (tokens - lo) * kv_cache.kv_cache_bytes(layers, 1, 128, 1, 1, 2)
    yoco = cache(n_layers // 2, min(seq_len, window)) + cache(1, seq_len)
    return yoco / cache(n_layers, seq_len)


def _yoco_inputs(gen):
    n_layers, window = 2 * randint(gen, 2, 40), [512, 1024, 4096, 8192][randint(gen, 0, 3)]
    lowest, highest = _yoco_share(n_layers, window, 1e15), _yoco_share(n_layers, window, window)
    kind = randint(gen, 0, 5)
    if kind == 0:          # below what any length reaches
        fraction = lowest * (0.5 + 0.4 * float(torch.rand((), generator=gen)))
    elif kind == 1:        # above it
        fraction = min(0.999, highest + (1 - highest) * (0.1 + 0.8 * float(torch.rand((), generator=gen))))
    else:
        fraction = lowest + (highest - lowest) * (0.02 + 0.96 * float(torch.rand((), generator=gen)))
    return n_layers, window, round(fraction, 6)


@exercise
def check_yoco_length(fn) -> Result:
    """Check ``fn(n_layers, window, fraction) -> seq_len or None``: the sequence length at which a YOCO-style
    model's KV cache (the lower ``n_layers / 2`` layers keep their last ``window`` tokens, the upper half reads
    one global cache of every token) is ``fraction`` of the ordinary cache of the same shape (every layer caches
    every token), or None when no length gives that fraction. Graded by measuring both caches' bytes at the
    returned length (:func:`labsrc.kv_cache.kv_cache_bytes`)."""
    name = "the context at which YOCO keeps a given share of the cache"
    hint = ("write both caches' bytes for a sequence longer than the window and for one shorter, and see what "
            "their ratio depends on.")
    refused = refuse_library(name, fn, (frontier.shared_kv_bytes, kv_cache.mlkv_cache_bytes, kv_cache.kv_cache_bytes),
                             hint, owner="labsrc", args=(32, 4096, 0.1))
    if refused is not None:
        return refused
    trials, seed = trials_for(12), seed_for(153)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        n_layers, window, fraction = case = _yoco_inputs(gen)
        where = f"trial {trial + 1} (n_layers={n_layers}, window={window}, fraction={fraction})"
        try:
            got = fn(*case)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        got = got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
        reachable = _yoco_share(n_layers, window, 1e15) < fraction < _yoco_share(n_layers, window, window)
        if got is None:
            problem = None if not reachable else "some length gives this fraction, and the answer is None."
        elif not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got) or got <= 0:
            problem = "return a positive length, or None."
        elif not reachable:
            problem = "no length gives this fraction, and the answer is a length."
        elif not math.isclose(_yoco_share(n_layers, window, got), fraction, rel_tol=1e-6):
            problem = "at the returned length the two caches' bytes are not in this ratio."
        else:
            problem = None
        if problem:
            return failed(name, f"{where}: {problem} Hint: {hint}")
    return _report(Result(name, PASSED, "right on all the check's shapes, measured at your lengths."))


# ------------------------------------------------------------------------------------------ the kernel
_KERNEL_SIZES = ((5, 16), (1, 16), (17, 24), (16, 40), (29, 16), (9, 20))   # (T, D)
_GUARD = 4096    # covers a whole (BLOCK_T, BLOCK_D) tile stored without a mask: no write leaves the buffer
_EPS = 1e-5


def _guarded(values: torch.Tensor):
    """``values`` inside a buffer of NaN guard bands: a load or store outside the tensor shows up as NaN."""
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def _normed_ref(q1, k1, q2, k2, v, lam, lam_init, eps=_EPS):
    attn = kfr.diff_attention_ref(*(t[None, None] for t in (q1, k1, q2, k2, v)), lam)
    return frontier.diff_head_norm(attn, lam_init, eps=eps)[0, 0]


def _norm_slip(out, q1, k1, q2, k2, v, lam, lam_init, block_d) -> str:
    """Recognise the chapter's unnormalised output, a norm over the padded lanes, or a missing scale."""
    rtol, atol = tolerance(torch.float32)
    attn = kfr.diff_attention_ref(*(t[None, None] for t in (q1, k1, q2, k2, v)), lam)[0, 0]
    D = attn.shape[-1]
    padded = attn * torch.rsqrt(attn.pow(2).sum(-1, keepdim=True) / block_d + _EPS) * (1 - lam_init)
    guesses = (("differential attention without the normalisation and scale", attn),
               ("a mean over all BLOCK_D lanes, padding included", padded),
               ("the RMSNorm without the (1 - lambda_init) scale", _normed_ref(q1, k1, q2, k2, v, lam, 0.0)))
    for said, alt in guesses:
        if (said.startswith("a mean") and block_d == D) or alt.shape != out.shape:
            continue
        if torch.allclose(out, alt, rtol=rtol, atol=atol):
            return f" Your outputs are those of {said}."
    return ""


@exercise
def check_diff_norm_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(q1, k1, q2, k2, v, out, lam, scale, lam_init, eps, T, D, BLOCK_T,
    BLOCK_D)`` for one head whose ``T`` queries form one block: causal differential attention
    ``y = softmax(q1 k1^T scale + causal) v - lam * softmax(q2 k2^T scale + causal) v``, then each row of
    ``y`` RMS-normalised over its ``D`` features (``eps`` inside the root) and multiplied by
    ``(1 - lam_init)``, as :func:`labsrc.frontier.diff_head_norm` does. All tensors contiguous float32
    ``(T, D)``, grid ``(1,)``, ``BLOCK_T >= max(T, 16)`` and ``BLOCK_D >= max(D, 16)`` powers of two (``T``,
    ``D`` constexpr). Without Triton (macOS, Windows) the check says it is skipped."""
    name = "differential attention with its per-head norm in one kernel (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    import triton

    hint = ("re-read 'Differential attention' on the per-head normalisation and 'The kernel', then follow the "
            "query row named in this message through your kernel; D is rarely a power of two here, so mind which lanes "
            "a row's mean runs over.")
    seed, sizes = 154, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed_for(seed), sizes + tuple((t + 2, d + 4) for t, d in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of one program")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance(torch.float32)
    for trial, (T, D) in enumerate(sizes):
        q1, k1, q2, k2, v = (torch.randn(T, D, generator=gen) for _ in range(5))
        lam = float(torch.rand((), generator=gen)) * 0.8 + 0.1
        lam_init = float(torch.rand((), generator=gen)) * 0.6 + 0.2
        block_d = max(16, triton.next_power_of_2(D))
        ins = [_guarded(t)[0] for t in (q1, k1, q2, k2, v)]
        out, store = _guarded(torch.full_like(q1, float("nan")))
        try:
            kernel[(1,)](*ins, out, lam, 1 / math.sqrt(D), lam_init, _EPS, T=T, D=D,
                         BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_D=block_d)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, f"trial {trial + 1} (T={T}, D={D})", hint))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        problem = None
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor (a row past T or a lane past D without a mask?)."
        elif torch.isnan(out).any():
            problem = f"{int(torch.isnan(out).sum())} output element(s) are NaN or were never written."
        else:
            want = _normed_ref(q1, k1, q2, k2, v, lam, lam_init)
            if not torch.allclose(out, want, rtol=rtol, atol=atol):
                bad = ~torch.isclose(out, want, rtol=rtol, atol=atol)
                problem = (f"{int(bad.sum())} of {bad.numel()} elements differ (first in row "
                           f"{int(bad.nonzero()[0, 0])}).{_norm_slip(out, q1, k1, q2, k2, v, lam, lam_init, block_d)}")
        if problem:
            return failed(name, f"trial {trial + 1} (T={T}, D={D}): {problem} Hint: {hint}")
    return _report(Result(name, PASSED, "equal to the reference on all the check's launches with odd sizes."))
