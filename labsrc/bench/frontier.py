"""Bench entry ``diff_attention``: differential attention's two softmaxes fused in one kernel.

The prefill shape: ``T`` queries of each (batch, head) against their causal keys, twice (two query/key pairs)
over one set of values. Its figure of merit is TFLOP/s: causal attention does about ``2 * T^2 / 2 * (D + Dv)``
FLOPs per map, so the fused kernel does twice that. The baseline is what the kernel replaces: two calls of
chapter 3's :func:`labsrc.kernels.flash_attention.flash_attention` and a subtraction
(:func:`labsrc.frontier.diff_attention`), which reads ``v`` twice and writes two outputs.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.bench import Case, register
from labsrc.exercises import tolerance
from labsrc.frontier import diff_attention
from labsrc.kernels.frontier import diff_attention_fused, diff_attention_ref

# (B, H, T, D): the values are as wide as the queries so that the flash_attention baseline can run
_GPU = [(4, 16, 4096, 64), (1, 16, 16384, 128)]
_TINY = [(1, 2, 37, 16), (2, 1, 20, 40)]


def _case(B, H, T, D, dtype) -> Case:
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(B * 7919 + T)
    q1, k1, q2, k2, v = (torch.randn(B, H, T, D, generator=gen).to(device, dtype) for _ in range(5))
    lam = torch.rand(H, generator=gen).to(device)
    out = torch.empty_like(q1)

    def kernel():
        diff_attention_fused(q1, k1, q2, k2, v, lam, out=out)

    def baseline():
        diff_attention(q1, k1, q2, k2, v, lam)

    def check():
        got = diff_attention_fused(q1, k1, q2, k2, v, lam, out=torch.full_like(q1, float("nan")))
        rtol, atol = tolerance(dtype)
        torch.testing.assert_close(got, diff_attention_ref(q1, k1, q2, k2, v, lam), rtol=rtol, atol=atol)

    flops = 2 * B * H * (T * (T + 1) // 2) * 2 * (D + D)
    label = f"B={B} H={H} T={T} D={D} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, flops=flops,
                baseline_name="2 x flash_attention - lam x")


@register("diff_attention")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16, torch.float16) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_case(*shape, dtype) for shape in shapes for dtype in dtypes]
