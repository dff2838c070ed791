"""Bench entries ``flash_attention``, ``flash_attention_backward`` and ``decode_attention``: the lab's Triton
attention against PyTorch SDPA.

* ``flash_attention`` (prefill) is compute-bound, so its figure of merit is TFLOP/s: a causal pass over
  ``T`` tokens does ``4 * B * Hq * D * T(T+1)/2`` flops (two matmuls, 2 flops per multiply-add, only the
  visible query/key pairs). GPU sizes: T from 1K to 32K, D 64 and 128, GQA 8:1 (32 query heads, 4 K/V heads),
  bf16, with the batch shrinking as T grows so every case holds 16K tokens.
* ``flash_attention_backward`` times the backward alone (dQ, dK, dV from dO and the saved output and
  log-sum-exp) against SDPA's backward (``torch.autograd.grad`` on a retained graph). Its flops follow
  FlashAttention-2's convention, 2.5x the forward's: five matmuls (recompute S, dP, dV, dK, dQ) instead of two.
  (The lab's kernel recomputes S and dP twice, once for dK/dV and once for dQ, so it does 7 of them; the
  convention keeps the figure comparable across implementations.) Same GPU sizes as the forward, up to 16K.
* ``decode_attention`` (one token per sequence) is memory-bound, so its figure of merit is GB/s: it must read
  every cached key and value once, ``2 * B * Hkv * T * D * elem`` bytes (plus q and the output). GPU sizes:
  contexts from 1K to 32K, with a batch large enough that the caches hold about 8 GiB -- thousands of
  programs, enough to fill any current GPU.

The baseline is ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa=True`` (on a GPU it
picks its own fastest backend). Each case checks the kernel before it is timed: against the reference on
the full problem at tiny size, and on its first and last rows at GPU size (the reference materialises the
score matrix, which at 32K tokens would not fit).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labsrc.bench import Case, register
from labsrc import runtime
from labsrc.exercises import tolerance
from labsrc.kernels.flash_attention import (decode_attention, decode_attention_ref, flash_attention,
                                      flash_attention_backward, flash_attention_backward_ref, flash_attention_ref)

_GQA = (32, 4)  # (Hq, Hkv): 8 query heads per K/V head
_FLASH_GPU = [(t, d) for t in (1024, 4096, 16384, 32768) for d in (64, 128)]
_BACKWARD_GPU = [(t, d) for t in (1024, 4096, 16384) for d in (64, 128)]
_DECODE_GPU = [1024, 4096, 16384, 32768]
_DECODE_CACHE_BYTES = 8 * 2**30


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=runtime.DEVICE)


def _assert_close(actual, expected, dtype, what):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _flash_case(batch, hq, hkv, t, d, dtype, rows_checked=None) -> Case:
    gen = torch.Generator().manual_seed(t + d)
    q = _randn(gen, batch, hq, t, d, dtype=dtype)
    k = _randn(gen, batch, hkv, t, d, dtype=dtype)
    v = _randn(gen, batch, hkv, t, d, dtype=dtype)

    def kernel():
        return flash_attention(q, k, v, causal=True)

    def baseline():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def check():
        out = flash_attention(q, k, v, causal=True, out=torch.full_like(q, float("nan")))
        if rows_checked is None:  # the whole problem
            _assert_close(out, flash_attention_ref(q, k, v, causal=True), dtype, "flash_attention vs reference")
            return
        n = rows_checked  # first rows (few keys each) and last rows (all keys), bottom-right aligned
        first = flash_attention_ref(q[:1, :, :n], k[:1, :, :n], v[:1, :, :n], causal=True)
        last = flash_attention_ref(q[:1, :, -n:], k[:1], v[:1], causal=True)
        _assert_close(out[:1, :, :n], first, dtype, "flash_attention first rows vs reference")
        _assert_close(out[:1, :, -n:], last, dtype, "flash_attention last rows vs reference")

    flops = 4 * batch * hq * d * t * (t + 1) // 2
    label = f"B={batch} Hq:Hkv={hq}:{hkv} T={t} D={d} causal {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, flops=flops, baseline_name="SDPA",
                extra=dict(T=t, D=d))


def _assert_grad_close(actual, expected, bound, dtype, what):
    # A gradient is a sum of cancelling terms: its rounding error scales with the terms' magnitudes (``bound``,
    # from flash_attention_backward_ref(return_bounds=True)), so the dtype tolerance applies to that.
    rtol, atol = tolerance(dtype)
    err = (actual.double() - expected.to(dtype).double()).abs()
    allowed = atol + rtol * (bound.double() + expected.double().abs())
    if not bool((err <= allowed).all()):
        worst = int((err - allowed).argmax())
        raise AssertionError(f"{what}: {int((err > allowed).sum())} elements off; worst error "
                             f"{err.flatten()[worst]:.3g}, allowed {allowed.flatten()[worst]:.3g}")


# The forward outputs and SDPA's autograd graph of the one backward case being measured. Built on first use
# and dropped when the next case starts, so that a list of GPU-size cases never holds all their graphs at once.
_BACKWARD_LIVE: dict = {}


def _backward_case(batch, hq, hkv, t, d, dtype, rows_checked=None) -> Case:
    gen = torch.Generator().manual_seed(t + d + 1)
    q = _randn(gen, batch, hq, t, d, dtype=dtype)
    k = _randn(gen, batch, hkv, t, d, dtype=dtype)
    v = _randn(gen, batch, hkv, t, d, dtype=dtype)
    dout = _randn(gen, batch, hq, t, d, dtype=dtype)
    me = object()

    def live():
        if _BACKWARD_LIVE.get("case") is not me:
            _BACKWARD_LIVE.clear()
            out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            sdpa_out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            _BACKWARD_LIVE.update(case=me, out=out, lse=lse, leaves=leaves, sdpa_out=sdpa_out)
        return _BACKWARD_LIVE

    def kernel():
        state = live()
        return flash_attention_backward(dout, q, k, v, state["out"], state["lse"], causal=True)

    def baseline():
        state = live()
        return torch.autograd.grad(state["sdpa_out"], state["leaves"], dout, retain_graph=True)

    def check():
        dq, dk, dv = kernel()
        n = t if rows_checked is None else rows_checked
        # The last n queries against all keys: their dq is exact, and with causal masking the last n keys are
        # seen by no other query, so dk/dv of those keys are exact too (the full problem when n = t).
        (rdq, rdk, rdv), (bq, bk, bv) = flash_attention_backward_ref(
            dout[:1, :, -n:], q[:1, :, -n:], k[:1], v[:1], causal=True, return_bounds=True)
        _assert_grad_close(dq[:1, :, -n:], rdq, bq, dtype, "dq (last rows) vs reference")
        _assert_grad_close(dk[:1, :, -n:], rdk[:, :, -n:], bk[:, :, -n:], dtype, "dk (last keys) vs reference")
        _assert_grad_close(dv[:1, :, -n:], rdv[:, :, -n:], bv[:, :, -n:], dtype, "dv (last keys) vs reference")

    flops = 2.5 * 4 * batch * hq * d * t * (t + 1) // 2
    label = f"B={batch} Hq:Hkv={hq}:{hkv} T={t} D={d} causal {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, flops=flops, baseline_name="SDPA backward",
                extra=dict(T=t, D=d))


def _decode_case(batch, hq, hkv, t, d, dtype, sequences_checked=None) -> Case:
    gen = torch.Generator().manual_seed(t)
    q = _randn(gen, batch, hq, d, dtype=dtype)
    k_cache = _randn(gen, batch, hkv, t, d, dtype=dtype)
    v_cache = _randn(gen, batch, hkv, t, d, dtype=dtype)
    lens = torch.full((batch,), t, dtype=torch.int32, device=runtime.DEVICE)

    def kernel():
        return decode_attention(q, k_cache, v_cache, lens)

    def baseline():
        return F.scaled_dot_product_attention(q[:, :, None], k_cache, v_cache, enable_gqa=True)

    def check():
        out = decode_attention(q, k_cache, v_cache, lens, out=torch.full_like(q, float("nan")))
        n = batch if sequences_checked is None else sequences_checked
        expected = decode_attention_ref(q[:n], k_cache[:n], v_cache[:n], lens[:n])
        _assert_close(out[:n], expected, dtype, "decode_attention vs reference")
        if out.isnan().any():
            raise AssertionError("decode_attention left elements of its output unwritten")

    elem = q.element_size()
    bytes_moved = 2 * batch * hkv * t * d * elem + 2 * batch * hq * d * elem
    label = f"B={batch} Hq:Hkv={hq}:{hkv} T={t} D={d} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved,
                baseline_name="SDPA", extra=dict(T=t, D=d))


@register("flash_attention")
def flash_entry(size: str) -> list[Case]:
    if size == "gpu":
        hq, hkv = _GQA
        return [_flash_case(max(1, 16384 // t), hq, hkv, t, d, torch.bfloat16, rows_checked=128)
                for t, d in _FLASH_GPU]
    # Interpreter smoke: one small GQA problem per dtype (bf16 is upcast inside the kernel there).
    return [_flash_case(1, 4, 1, 80, 48, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]


@register("flash_attention_backward")
def backward_entry(size: str) -> list[Case]:
    if size == "gpu":
        hq, hkv = _GQA
        return [_backward_case(max(1, 16384 // t), hq, hkv, t, d, torch.bfloat16, rows_checked=128)
                for t, d in _BACKWARD_GPU]
    # Interpreter smoke: a small GQA problem with a non-power-of-two head dim, per dtype.
    return [_backward_case(1, 4, 2, 70, 48, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]


@register("decode_attention")
def decode_entry(size: str) -> list[Case]:
    if size == "gpu":
        hq, hkv = _GQA
        d, elem = 128, 2
        cases = []
        for t in _DECODE_GPU:
            batch = max(1, min(4096, _DECODE_CACHE_BYTES // (2 * hkv * t * d * elem)))
            cases.append(_decode_case(batch, hq, hkv, t, d, torch.bfloat16, sequences_checked=2))
        return cases
    return [_decode_case(2, 8, 1, 150, 64, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
