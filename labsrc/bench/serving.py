"""Bench entry ``paged_decode_attention``: decode attention read through block tables, against chapter 3's
dense :func:`~labsrc.kernels.flash_attention.decode_attention` on the same keys laid out contiguously.

Decode is memory-bound, so the figure of merit is GB/s of K/V read. The baseline is the same flash-decoding
over a dense cache: the gap between the two is what the block-table indirection costs (scattered blocks of
``block_size`` tokens instead of one contiguous run per sequence).
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.bench import Case, register
from labsrc.exercises import tolerance
from labsrc.kernels.flash_attention import decode_attention
from labsrc.kernels.serving import gather_kv, paged_decode_attention, paged_decode_attention_ref

# (batch, Hq, Hkv, tokens per sequence, head dim, block size): Llama-3-8B-like heads on a GPU.
_GPU = [(64, 32, 8, 4096, 128, 16), (16, 32, 8, 16384, 128, 16), (256, 32, 8, 1024, 128, 32)]
_TINY = [(2, 8, 2, 70, 40, 16)]


def _case(batch, hq, hkv, t, d, page, dtype) -> Case:
    gen = torch.Generator().manual_seed(t)
    device = runtime.DEVICE
    per_seq = -(-t // page)
    num_blocks = batch * per_seq
    k_pool = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype=dtype, device=device)
    v_pool = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32).to(device)
    lens = torch.full((batch,), t, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype=dtype, device=device)
    dense_k = torch.stack([gather_kv(k_pool, v_pool, tables[b], t)[0] for b in range(batch)])
    dense_v = torch.stack([gather_kv(k_pool, v_pool, tables[b], t)[1] for b in range(batch)])

    def kernel():
        return paged_decode_attention(q, k_pool, v_pool, tables, lens)

    def baseline():
        return decode_attention(q, dense_k, dense_v, lens)

    def check():
        out = paged_decode_attention(q, k_pool, v_pool, tables, lens, out=torch.full_like(q, float("nan")))
        n = min(batch, 2)
        expected = paged_decode_attention_ref(q[:n], k_pool, v_pool, tables[:n], lens[:n])
        rtol, atol = tolerance(dtype)
        torch.testing.assert_close(out[:n].double(), expected.double(), rtol=rtol, atol=atol)
        if out.isnan().any():
            raise AssertionError("paged_decode_attention left elements of its output unwritten")

    elem = q.element_size()
    bytes_moved = 2 * batch * hkv * t * d * elem + 2 * batch * hq * d * elem + tables.numel() * 4
    label = f"B={batch} Hq:Hkv={hq}:{hkv} T={t} D={d} page={page} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved,
                baseline_name="dense decode_attention", extra=dict(T=t, D=d, page=page))


@register("paged_decode_attention")
def entry(size: str) -> list[Case]:
    if size == "gpu":
        return [_case(*shape, torch.bfloat16) for shape in _GPU]
    return [_case(*shape, dtype) for shape in _TINY for dtype in (torch.float32, torch.float16, torch.bfloat16)]
