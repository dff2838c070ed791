"""Bench entry ``greedy_verify``: the last pipeline stage's greedy verification against PyTorch.

The kernel reads each window's ``N x V`` logits once (argmax per row) and writes ``N + 1`` integers, so it is
bandwidth-bound: the figure of merit is GB/s of logits read. The baseline is what the reference does with
PyTorch ops: ``argmax``, a shifted compare and a cumulative product (three kernels and two temporaries on a
GPU).
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.bench import Case, register
from labsrc.kernels.pipeline import greedy_verify, greedy_verify_ref

# (B, N, V): 64 sequences verifying k = 16 drafts (N = 17) with Llama-3's 128K vocab, and one window of 9.
_GPU = [(64, 17, 128256), (1, 9, 128256)]
_TINY = [(3, 9, 1000)]


def _case(B: int, N: int, V: int, dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(B * N + V)
    device = runtime.DEVICE
    logits = torch.randn(B, N, V, generator=gen).to(dtype=dtype, device=device)
    preds = logits.float().argmax(-1)
    first = torch.randint(0, V, (B,), generator=gen).to(device)
    tokens = torch.cat([first[:, None], preds[:, :-1]], 1)

    def kernel():
        greedy_verify(logits, tokens, first)

    def baseline():
        greedy_verify_ref(logits, tokens, first)

    def check():
        got, want = greedy_verify(logits, tokens, first), greedy_verify_ref(logits, tokens, first)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise AssertionError(f"greedy_verify differs from greedy_verify_ref at {B=} {N=} {V=} {dtype}")

    bytes_moved = logits.numel() * logits.element_size() + tokens.numel() * 8 + B * 8 + (B * N + B) * 8
    label = f"B={B} N={N} V={V} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved,
                baseline_name="argmax+cumprod")


@register("greedy_verify")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16, torch.float32) if size == "gpu" else (torch.float32, torch.float16, torch.bfloat16)
    return [_case(*shape, dtype) for shape in shapes for dtype in dtypes]
