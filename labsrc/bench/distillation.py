"""Bench entries ``kd_kl`` and ``kd_kl_backward``: the fused distillation loss against PyTorch.

Per row the forward reads the student's and the teacher's logits once and writes one KL and two log-sum-exps;
the backward reads both rows again and writes the student's gradient. Both are bound by memory bandwidth, so
the figure of merit is GB/s of that minimum traffic (goal on a GPU: most of the HBM bandwidth). The baseline
is :func:`labsrc.distillation.soft_kl` (two log-softmaxes, a product and a sum: it writes and reads back several
``(rows, V)`` fp32 tensors) and, for the backward, PyTorch autograd through it.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.bench import Case, register
from labsrc.distillation import soft_kl
from labsrc.kernels.distillation import kd_kl, kd_kl_backward_ref, kd_kl_ref

# (rows, V): a batch of 8k tokens at Llama-3's 128k vocabulary, 32k tokens at a 32k vocabulary
_GPU = [(8192, 128256), (32768, 32000)]
_TINY = [(5, 1500), (3, 257)]


def _inputs(rows, V, dtype):
    gen = torch.Generator().manual_seed(rows + V)
    s = (torch.randn(rows, V, generator=gen) * 3).to(runtime.DEVICE, dtype)
    t = (torch.randn(rows, V, generator=gen) * 3).to(runtime.DEVICE, dtype)
    return s, t


def _forward_case(rows, V, dtype, T=2.0) -> Case:
    s, t = _inputs(rows, V, dtype)

    def check():
        torch.testing.assert_close(kd_kl(s, t, T), kd_kl_ref(s, t, T), rtol=1e-4, atol=1e-5)

    return Case(f"rows={rows} V={V} {str(dtype).removeprefix('torch.')}",
                kernel=lambda: kd_kl(s, t, T), baseline=lambda: soft_kl(s, t, T), check=check,
                bytes_moved=2 * rows * V * s.element_size() + 12 * rows, baseline_name="torch soft_kl")


def _backward_case(rows, V, dtype, T=2.0) -> Case:
    s, t = _inputs(rows, V, dtype)
    a = s.clone().requires_grad_(True)
    b = s.clone().requires_grad_(True)
    go = torch.ones(rows, device=s.device)

    def kernel():
        a.grad = None
        kd_kl(a, t, T).backward(go)

    def baseline():
        b.grad = None
        soft_kl(b, t, T).backward(go)

    def check():
        kernel()
        torch.testing.assert_close(a.grad.float(), kd_kl_backward_ref(go, s, t, T).float(), rtol=2e-2, atol=1e-5)

    # forward + backward: read both rows twice, write the gradient once
    return Case(f"rows={rows} V={V} {str(dtype).removeprefix('torch.')} fwd+bwd", kernel=kernel,
                baseline=baseline, check=check, bytes_moved=5 * rows * V * s.element_size() + 24 * rows,
                baseline_name="torch autograd")


@register("kd_kl")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16, torch.float32) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_forward_case(r, v, d) for r, v in shapes for d in dtypes]


@register("kd_kl_backward")
def entry_backward(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    return [_backward_case(r, v, torch.bfloat16 if size == "gpu" else torch.float32) for r, v in shapes]
