"""Bench entries ``chunk_linear_attention`` and ``chunk_gated_delta_rule``: the chapter-8 kernels against softmax
FlashAttention (chapter 3's kernel, causal) at the same length, and against the token-by-token PyTorch form.

The question is where linear attention starts to win. Causal softmax attention costs ``2 T^2 D`` FLOPs per head
(half of ``QK^T`` and ``PV``); a chunked linear layer with chunks of ``C`` costs per head and token about
``2C(K + V) + 4KV`` (intra-chunk products plus the state read and write), and the delta rule adds its UT
transform, ``2C(2K + V) + 2KV + 4 (log2 C - 1) C^2``. Both are linear in ``T``, so past some length they win
even though their per-token constant is larger. The reported TFLOP/s are those of the chunked form's own
FLOPs (:func:`chunk_flops`), against the bf16 peak.

Each GPU case is run at T = 2K..64K, H = 16, K = V = 128 (Gated-DeltaNet-like heads), bf16; the baseline is
FlashAttention at the same ``(B, H, T, 128)``. The token-by-token PyTorch baseline (one Python step per token)
is a separate case at T = 2K only, where it still finishes in seconds.
"""
from __future__ import annotations

import math

import torch

from labsrc import linear_attention as la, runtime
from labsrc.bench import Case, register
from labsrc.exercises import tolerance
from labsrc.kernels.flash_attention import flash_attention
from labsrc.kernels.linear_attention import chunk_gated_delta_rule, chunk_linear_attention

# (B, T, H, K, V)
_GPU = [(1, 2048, 16, 128, 128), (1, 8192, 16, 128, 128), (1, 32768, 16, 128, 128), (1, 65536, 16, 128, 128)]
_GPU_RECURRENT = [(1, 2048, 16, 128, 128)]
_TINY = [(1, 37, 2, 16, 16)]
_TINY_RECURRENT = [(1, 21, 2, 16, 16)]
_CHUNK = {"gpu": 32, "tiny": 16}   # on a GPU the kernels' tiles fit in registers at 32 tokens, not 64 (_configs)


def chunk_flops(kind: str, B: int, T: int, H: int, K: int, V: int, C: int) -> float:
    """FLOPs of the chunked forward (see the module docstring); ``kind`` is ``"linear"`` or ``"delta"``."""
    per_token = 2 * C * (K + V) + 4 * K * V
    if kind == "delta":
        per_token += 2 * C * (2 * K + V) + 2 * K * V + 4 * max(int(math.log2(C)) - 1, 0) * C * C
    return float(B * H * T * per_token)


def _inputs(B, T, H, K, V, dtype, seed):
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.1 * torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    lam = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32))       # RetNet's per-head decays
    return [x.to(device, dtype) for x in (q, k, v)] + [x.to(device) for x in (g, beta, lam)]


def _case(kind, B, T, H, K, V, dtype, chunk, baseline) -> Case:
    q, k, v, g, beta, lam = _inputs(B, T, H, K, V, dtype, T + H)
    if kind == "delta":
        def kernel():
            return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)

        def reference(recurrent=False):
            fn = la.gated_delta_rule_recurrent if recurrent else la.gated_delta_rule_chunked
            return fn(q, k, v, g, beta) if recurrent else fn(q, k, v, g, beta, chunk_size=chunk)
    else:
        def kernel():
            return chunk_linear_attention(q, k, v, lam, chunk, K ** -0.5)

        def reference(recurrent=False):
            if recurrent:
                return la.linear_attention_recurrent(q, k, v, lam, K ** -0.5)
            return la.lightning_attention(q, k, v, lam, chunk, K ** -0.5)

    if baseline == "flash":
        qf, kf, vf = (x.transpose(1, 2) for x in (q, k, v))        # (B, H, T, D) views, no copy

        def run_baseline():
            return flash_attention(qf, kf, vf, causal=True)
        name = "FlashAttention (ch. 3, causal)"
    else:
        def run_baseline():
            return reference(recurrent=True)
        name = "PyTorch token-by-token"

    def check():
        got = kernel()[0].float()
        want = reference()[0].float()
        rtol, atol = tolerance(dtype)
        scale = max(1.0, float(want.abs().max()))
        if not torch.allclose(got, want, rtol=rtol, atol=atol * scale):
            raise AssertionError(f"{kind} kernel differs from its chunked reference at T={T}: max diff "
                                 f"{(got - want).abs().max().item():.3g}")

    elem = q.element_size()
    bytes_moved = B * T * H * (2 * K + 2 * V) * elem + (2 * B * T * H * 4 if kind == "delta" else 0)
    label = f"B={B} T={T} H={H} K={K} V={V} C={chunk} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=run_baseline, check=check, bytes_moved=bytes_moved,
                flops=chunk_flops(kind, B, T, H, K, V, chunk), baseline_name=name,
                extra={"softmax_causal_GFLOP": 2.0 * B * H * T * T * K / 1e9})


def _entry(kind, size):
    dtype = torch.bfloat16 if size == "gpu" else torch.float32
    chunk = _CHUNK[size]
    shapes, recurrent = (_GPU, _GPU_RECURRENT) if size == "gpu" else (_TINY, _TINY_RECURRENT)
    return ([_case(kind, *s, dtype, chunk, "flash") for s in shapes]
            + [_case(kind, *s, dtype, chunk, "recurrent") for s in recurrent])


@register("chunk_linear_attention")
def linear_entry(size: str) -> list[Case]:
    return _entry("linear", size)


@register("chunk_gated_delta_rule")
def delta_entry(size: str) -> list[Case]:
    return _entry("delta", size)
