"""Bench entry ``tree_attention``: verifying a draft tree in one launch, against PyTorch's SDPA with the mask.

The tree's ``N`` queries read the whole prefix (``P`` keys) and their ancestors among the ``N`` tree keys. With
``N`` in the tens and ``P`` in the thousands the work is reading K and V once per query block: the kernel is
bound by memory bandwidth, so its figure of merit is GB/s of K/V (and q, out) moved. The baseline is
``scaled_dot_product_attention`` with the dense ``N x (P + N)`` boolean mask built per call (what one would
write without a kernel), grouped-query heads expanded by SDPA (``enable_gqa``).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from labsrc import runtime
from labsrc.bench import Case, register
from labsrc.exercises import tolerance
from labsrc.kernels.speculative import tree_attention, tree_attention_ref
from labsrc.speculative import tree_attention_mask

# (B, Hq, Hkv, N, P, D): a Llama-3-8B-like layer verifying a tree of N nodes after a prefix of P tokens.
_GPU = [(1, 32, 8, 64, 4096, 128), (8, 32, 8, 32, 8192, 128), (1, 32, 8, 256, 16384, 128)]
_TINY = [(1, 4, 2, 13, 37, 32), (2, 4, 1, 6, 20, 16)]


def _case(B, Hq, Hkv, N, P, D, dtype) -> Case:
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(N * 1000 + P)
    q = torch.randn(B, Hq, N, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, P + N, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, P + N, D, generator=gen).to(device, dtype)
    rng = random.Random(N + P)
    mask = tree_attention_mask([rng.randrange(-1, i) for i in range(N)]).to(device)
    out = torch.empty_like(q)

    def kernel():
        tree_attention(q, k, v, mask, out=out)

    def baseline():
        full = torch.cat([torch.ones(N, P, dtype=torch.bool, device=device), mask], -1)
        F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)

    def check():
        got = tree_attention(q, k, v, mask, out=torch.full_like(q, float("nan")))
        rtol, atol = tolerance(dtype)
        torch.testing.assert_close(got.double(), tree_attention_ref(q.double(), k.double(), v.double(), mask),
                                   rtol=rtol, atol=atol)

    elem = q.element_size()
    bytes_moved = (2 * B * Hkv * (P + N) * D + 2 * B * Hq * N * D) * elem + N * N
    flops = 4 * B * Hq * N * (P + N) * D
    label = f"B={B} Hq={Hq} Hkv={Hkv} N={N} P={P} D={D} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved, flops=flops,
                baseline_name="torch sdpa + dense mask")


@register("tree_attention")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16, torch.float16) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_case(*shape, dtype) for shape in shapes for dtype in dtypes]
