"""Checks for the exercises of the architecture-frontier chapter.

* :func:`check_distractor_weights` -- a prediction, ``fn(T, needle, distractor, lam)``: the weight the last
  query of a causal sequence gives one distractor key under ordinary and under differential attention, when
  only the first map sees the needle. The truth is measured on the two maps of
  :func:`labsrc.kernels.frontier.diff_attention_ref` built for that case.
* :func:`check_mod_block_fraction` -- a derivation, ``fn(capacity, T, d)``: the fraction of a full block's
  FLOPs that a Mixture-of-Depths block does at a capacity, counted as :func:`labsrc.kv_cache.forward_flops`
  counts them.
* :func:`check_yoco_kv_bytes` -- a derivation, ``fn(n_layers, n_kv_heads, head_dim, seq_len, window,
  dtype_bytes)``: the KV-cache bytes of a YOCO-style model (sliding-window lower half, one shared global cache
  for the upper half), from :func:`labsrc.kv_cache.kv_cache_bytes`.
* :func:`check_diff_norm_kernel` -- a ``@triton.jit`` kernel that fuses the DIFF layer's per-head RMSNorm and
  ``(1 - lambda_init)`` scale into one block of differential attention (the chapter's kernel leaves both to
  PyTorch), launched by the check under Triton's interpreter and compared with
  :func:`labsrc.frontier.diff_head_norm` of :func:`labsrc.kernels.frontier.diff_attention_ref`.

Expected answers are never printed.
"""
from __future__ import annotations

import math

import torch

from labsrc import frontier, kv_cache
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, PASSED, Result, _report, as_number,
                                   check_function, exercise, hidden, randint, refuse_library, tolerance)
from labsrc.kernels import frontier as kfr

__all__ = ["check_distractor_weights", "check_mod_block_fraction", "check_yoco_kv_bytes",
           "check_diff_norm_kernel"]


# ------------------------------------------------------------------------------------------ the distractor
def _distractor_inputs(gen):
    T = randint(gen, 3, 200)
    needle = round(6 * float(torch.rand((), generator=gen)), 2)
    distractor = round(6 * float(torch.rand((), generator=gen)) - 1, 2)
    return T, needle, distractor, round(0.1 + 0.8 * float(torch.rand((), generator=gen)), 2)


def _measured_distractor_ref(T, needle, distractor, lam):
    """Build the case and measure: keys along the all-ones query, scaled so that the last query's scaled scores are exactly
    ``needle`` (first map only), ``distractor`` (both maps) and 0 elsewhere; read the two maps' last rows."""
    d_needle, d_distractor = T // 3, (2 * T) // 3
    s1, s2 = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    s1[d_needle], s1[d_distractor], s2[d_distractor] = needle, distractor, distractor
    D = 16                                           # every key a multiple of the all-ones query
    q = torch.ones(1, 1, T, D, dtype=torch.float64)
    k1, k2 = ((s * math.sqrt(D) / D)[None, None, :, None].expand(1, 1, T, D) for s in (s1, s2))
    v = torch.zeros(1, 1, T, D, dtype=torch.float64)
    _, a1, a2 = kfr.diff_attention_ref(q, k1, q, k2, v, lam, return_maps=True)
    w1, w2 = a1[0, 0, -1, d_distractor], a2[0, 0, -1, d_distractor]
    return torch.stack([w1, w1 - lam * w2])


def _pair(fn):
    """The student's ``(ordinary, differential)`` as a float64 tensor of two, or what they returned."""
    def wrapped(*args):
        got = fn(*args)
        try:
            return torch.tensor([float(x) for x in got], dtype=torch.float64)
        except (TypeError, ValueError):
            return got
    return wrapped


def _explain_distractor(fn):
    def explain(got, expected, T, needle, distractor, lam) -> str:
        if not isinstance(got, torch.Tensor) or got.shape != (2,):
            return "Return two numbers: the weight under ordinary attention, then under differential attention."
        zero = fn(T, needle, distractor, 0.0)
        if isinstance(zero, torch.Tensor) and zero.shape == (2,) and not math.isclose(zero[0], zero[1],
                                                                                       rel_tol=1e-9):
            return "With lam = 0 differential attention is ordinary attention, and your two numbers differ then."
        if math.isclose(got[0], expected[0], rel_tol=1e-6):
            return ("Your weight under ordinary attention is right and the differential one is not: the two "
                    "maps do not see the same keys.")
        return "Your weight under ordinary attention is already off: count every key the last query sees."
    return explain


@exercise
def check_distractor_weights(fn) -> Result:
    """Check ``fn(T, needle, distractor, lam) -> (ordinary, differential)``: for the last query of a causal
    sequence of ``T`` tokens whose scaled scores are, in the first map, ``needle`` on one key, ``distractor``
    on another and 0 on the rest, and in the second map ``distractor`` on the same key and 0 on the rest
    (needle included), the distractor's weight in the first map, and in the first map minus ``lam`` times the
    second."""
    name = "a distractor's weight under ordinary and differential attention"
    hint = ("re-read 'Why the subtraction cancels noise: a needle among distractors' and write each map's "
            "softmax denominator for the last query by hand; then compare with the measurement below.")
    refused = refuse_library(name, fn, (kfr.diff_attention_ref, frontier.diff_attention), hint,
                             owner="labsrc.frontier", args=(9, 3.0, 1.0, 0.5))
    if refused is not None:
        return refused
    answer = _pair(fn)
    return check_function(name, answer, _measured_distractor_ref, _distractor_inputs, trials=12, seed=151,
                          rtol=1e-6, atol=1e-9, hint=hint, explain=_explain_distractor(answer))


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
        if math.isclose(got, k / T, rel_tol=1e-9) and k < T:
            return "That is the routed share of the matmuls alone: attention costs something too."
        if math.isclose(got, (k / T) ** 2, rel_tol=1e-9) and k < T:
            return "That is attention's share alone: the matmuls cost most of a block."
        if capacity * T != k:
            whole = max(1, k) / T                   # a capacity at which the routed count needs no rounding
            if math.isclose(as_number(fn)(whole, T, d), _mod_fraction_ref(whole, T, d), rel_tol=1e-6):
                return (f"Your answer is right when capacity x T is a whole number, and wrong here "
                        f"(capacity x T = {capacity * T:g}): count the routed tokens as the chapter does.")
        return ""
    return explain


@exercise
def check_mod_block_fraction(fn) -> Result:
    """Check ``fn(capacity, T, d) -> float``: the FLOPs of a Mixture-of-Depths block of width ``d`` (attention
    projections ``4 d^2`` and MLP ``4 d^2`` weights) that routes ``round(capacity T)`` tokens (halves up, at
    least 1) of a ``T``-token sequence, causal attention among them, over the FLOPs of the same block run on all
    ``T`` tokens; FLOPs as :func:`labsrc.kv_cache.forward_flops` counts them."""
    name = "the share of a block's FLOPs a MoD block does"
    hint = ("re-read 'Mixture-of-Depths: only some tokens pass through a block' and the counting rule in the task: "
            "count a full block's matmul FLOPs and attention FLOPs for T tokens separately, then a routed "
            "block's.")
    refused = refuse_library(name, fn, (kv_cache.forward_flops, frontier.variant_flops_per_token,
                                        frontier.mod_flops_fraction, frontier.mod_capacity_count), hint,
                             owner="labsrc", args=(0.5, 72, 32))
    if refused is not None:
        return refused
    return check_function(name, as_number(fn), _mod_fraction_ref, _mod_inputs, trials=14, seed=152, rtol=1e-9,
                          atol=1e-12, hint=hint, arg_names=("capacity", "T", "d"), explain=_explain_mod(fn))


# ------------------------------------------------------------------------------------------ YOCO's cache
def _yoco_inputs(gen):
    window = [512, 1024, 4096, 8192][randint(gen, 0, 3)]
    seq_len = randint(gen, 1, 300_000) if randint(gen, 0, 1) else randint(gen, 1, 3 * window)
    return (2 * randint(gen, 1, 40), [1, 2, 4, 8, 32][randint(gen, 0, 4)], [64, 96, 128][randint(gen, 0, 2)],
            seq_len, window, [1, 2, 4][randint(gen, 0, 2)])


def _yoco_bytes_ref(n_layers, n_kv_heads, head_dim, seq_len, window, dtype_bytes):
    """The lower half's sliding-window caches plus one global cache of every token for the upper half."""
    lower = kv_cache.kv_cache_bytes(n_layers // 2, n_kv_heads, head_dim, min(seq_len, window), 1, dtype_bytes)
    return lower + kv_cache.kv_cache_bytes(1, n_kv_heads, head_dim, seq_len, 1, dtype_bytes)


def _explain_yoco(fn):
    def explain(got, expected, n_layers, n_kv_heads, head_dim, seq_len, window, dtype_bytes) -> str:
        if got == kv_cache.kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, 1, dtype_bytes):
            return "That is the ordinary cache of every layer: nothing is shared or windowed."
        if seq_len < window:
            return "In this trial the sequence is shorter than the window."
        return ""
    return explain


@exercise
def check_yoco_kv_bytes(fn) -> Result:
    """Check ``fn(n_layers, n_kv_heads, head_dim, seq_len, window, dtype_bytes) -> bytes`` of one sequence's
    KV cache in a YOCO-style model: the lower ``n_layers / 2`` layers keep the keys and values of their last
    ``window`` tokens, and the upper half reads one global cache (one layer's worth of K and V for every
    token) that is written once. ``n_layers`` is even."""
    name = "the KV bytes of a YOCO-style model"
    hint = ("re-read 'Cross-layer KV: adjacent layers share one cache' and the task: count the two halves "
            "separately, and try a sequence shorter than the window.")
    refused = refuse_library(name, fn, (frontier.shared_kv_bytes, kv_cache.mlkv_cache_bytes), hint,
                             owner="labsrc", args=(32, 8, 128, 1000, 512, 2))
    if refused is not None:
        return refused
    return check_function(name, as_number(fn), _yoco_bytes_ref, _yoco_inputs, trials=12, seed=153, rtol=1e-12,
                          atol=0.5, hint=hint, explain=_explain_yoco(as_number(fn)),
                          arg_names=("n_layers", "n_kv_heads", "head_dim", "seq_len", "window", "dtype_bytes"))


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
            "query row named above through your kernel; D is rarely a power of two here, so mind which lanes "
            "a row's mean runs over.")
    seed, sizes = 154, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((t + 2, d + 4) for t, d in sizes)
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
            return _report(Result(name, FAILED, f"trial {trial + 1} (T={T}, D={D}): {problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to the reference on {len(sizes)} launches with odd sizes."))
