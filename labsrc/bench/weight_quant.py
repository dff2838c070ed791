"""Bench entries ``int4_matmul`` and ``mxfp4_matmul``: GEMMs that read 4-bit weights and dequantize in registers,
against ``torch.matmul`` on the dequantized fp16/bf16 weight.

At decode (M = 1-16 rows) a linear layer is bound by reading its weight, so the figure of merit is GB/s of
the bytes the kernel must move: the packed weight (K/2 bytes per row), its steps and zero points or E8M0
scales, the activations and the output; the baseline moves the 16-bit weight, four times as many bytes.
At M = 256 the layer approaches the compute bound and TFLOP/s (2 M N K) is the figure that matters. GPU
shapes are a 7B model's attention projection (4096 x 4096) and a 70B model's MLP (28672 x 8192 and its
transpose), for M in 1, 16, 256.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc import weight_quant as wq
from labsrc.bench import Case, register
from labsrc.exercises import tolerance
from labsrc.kernels.weight_quant import int4_matmul, int4_matmul_ref, mxfp4_matmul, mxfp4_matmul_ref

# (M, N, K): N = out_features, K = in_features
_GPU = [(m, n, k) for (n, k) in ((4096, 4096), (28672, 8192), (8192, 28672)) for m in (1, 16, 256)]
_TINY = [(1, 96, 128), (5, 64, 320)]


def _close(got, ref, dtype):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol,
                               atol=atol + 2 * rtol * float(ref.float().abs().max()))


def _weights(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.02


def _int4_case(m, n, k, dtype, group_size=128) -> Case:
    dev = runtime.DEVICE
    qw = wq.quantize_rtn(_weights(n, k, m + n + k), 4, group_size)
    q, s, z = qw.qweight.to(dev), qw.scales.to(dev), qw.zeros.to(dev)
    w16 = wq.dequantize(qw, dtype).to(dev)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dev, dtype)

    def check():
        _close(int4_matmul(x, q, s, z, group_size), int4_matmul_ref(x, q, s, z, group_size), dtype)

    elem = x.element_size()
    bytes_moved = q.numel() + 2 * s.numel() + z.numel() + (m * k + m * n) * elem
    return Case(f"M={m} N={n} K={k} g={group_size} {str(dtype).removeprefix('torch.')}",
                kernel=lambda: int4_matmul(x, q, s, z, group_size), baseline=lambda: torch.matmul(x, w16.T),
                check=check, bytes_moved=bytes_moved, flops=2 * m * n * k,
                baseline_name="torch.matmul, dequantized 16-bit weight",
                extra={"baseline_bytes": n * k * elem + (m * k + m * n) * elem})


def _mxfp4_case(m, n, k, dtype) -> Case:
    dev = runtime.DEVICE
    codes, scales = wq.mxfp4_quantize(_weights(n, k, m + n + k + 1))
    codes, scales = codes.to(dev), scales.to(dev)
    w16 = wq.mxfp4_dequantize(codes.cpu(), scales.cpu(), dtype).to(dev)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dev, dtype)

    def check():
        _close(mxfp4_matmul(x, codes, scales), mxfp4_matmul_ref(x, codes, scales), dtype)

    elem = x.element_size()
    bytes_moved = codes.numel() + scales.numel() + (m * k + m * n) * elem
    return Case(f"M={m} N={n} K={k} {str(dtype).removeprefix('torch.')}",
                kernel=lambda: mxfp4_matmul(x, codes, scales), baseline=lambda: torch.matmul(x, w16.T),
                check=check, bytes_moved=bytes_moved, flops=2 * m * n * k,
                baseline_name="torch.matmul, dequantized 16-bit weight",
                extra={"baseline_bytes": n * k * elem + (m * k + m * n) * elem})


@register("int4_matmul")
def int4_entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.float16, torch.bfloat16) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_int4_case(*shape, dtype) for shape in shapes for dtype in dtypes]


@register("mxfp4_matmul")
def mxfp4_entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16,) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_mxfp4_case(*shape, dtype) for shape in shapes for dtype in dtypes]
