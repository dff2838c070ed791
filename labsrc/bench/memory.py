"""Bench entry ``knn_memory_attention``: the Memorizing Transformer's gated local + memory attention.

The decode shape: one new query per sequence (``T`` small) attends to its local window and to the ``K`` rows
retrieved for it. Each program reads its query, the visible local keys and values of its K/V head and its own
retrieved rows once, so the kernel is bound by memory bandwidth and its figure of merit is GB/s: the minimum
traffic is ``q`` and ``out`` plus, per query head, ``2 * Tk * D`` local elements (read once per query head: the
group shares them, but the kernel does not share the loads across programs) and ``2 * K * D`` memory elements.
The baseline is the PyTorch reference (:func:`labsrc.kernels.memory.knn_memory_attention_ref`).
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.bench import Case, register
from labsrc.exercises import tolerance
from labsrc.kernels.memory import knn_memory_attention, knn_memory_attention_ref

# (B, H, Hkv, T, Tk, K, D)
_GPU = [(8, 32, 8, 1, 4096, 64, 128),     # a decode step of 8 sequences, a 4K local window, 64 retrieved rows
        (1, 32, 8, 16, 2048, 256, 128)]   # a short chunk with many retrieved rows
_TINY = [(1, 4, 2, 1, 37, 8, 40), (2, 2, 1, 3, 17, 5, 16)]


def _case(B, H, Hkv, T, Tk, K, D, dtype) -> Case:
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(B * 7919 + Tk)
    q = torch.randn(B, H, T, D, generator=gen).to(device, dtype)
    kl = torch.randn(B, Hkv, Tk, D, generator=gen).to(device, dtype)
    vl = torch.randn(B, Hkv, Tk, D, generator=gen).to(device, dtype)
    mk = torch.randn(B, H, T, K, D, generator=gen).to(device, dtype)
    mv = torch.randn(B, H, T, K, D, generator=gen).to(device, dtype)
    gate = torch.randn(H, generator=gen).to(device)
    out = torch.empty_like(q)

    def kernel():
        knn_memory_attention(q, kl, vl, mk, mv, gate, out=out)

    def baseline():
        knn_memory_attention_ref(q, kl, vl, mk, mv, gate)

    def check():
        got = knn_memory_attention(q, kl, vl, mk, mv, gate, out=torch.full_like(q, float("nan")))
        rtol, atol = tolerance(dtype)
        torch.testing.assert_close(got, knn_memory_attention_ref(q, kl, vl, mk, mv, gate), rtol=rtol, atol=atol)

    elem = q.element_size()
    bytes_moved = (2 * q.numel() + B * H * T * 2 * (Tk + K) * D) * elem
    label = f"B={B} H={H} Hkv={Hkv} T={T} Tk={Tk} K={K} D={D} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved,
                baseline_name="knn_memory_attention_ref")


@register("knn_memory_attention")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16, torch.float16) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_case(*shape, dtype) for shape in shapes for dtype in dtypes]
