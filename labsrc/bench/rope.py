"""Bench entry ``rope``: the Triton RoPE kernel against transformers' ``apply_rotary_pos_emb``.

Rotating q and k is one multiply-add per element, so the kernel is bound by memory bandwidth and its figure
of merit is GB/s (goal on a GPU: at least 80% of the HBM bandwidth). The minimum traffic is reading and
writing q and k, ``2 * (Hq + Hkv) * B * T * D * element_size`` bytes, plus the positions and one cos row and
one sin row per distinct position. The baseline is transformers' function on gathered tables
(``cos[positions]``), the way Llama applies RoPE; both include the gather. The kernel is timed with
``check_positions=False`` (no host sync), as an engine that computes its own positions would call it.
"""
from __future__ import annotations

import torch

from labsrc.bench import Case, register
from labsrc import rope, runtime
from labsrc.exercises import tolerance
from labsrc.kernels.rope import apply_rope, apply_rope_ref
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# (B, Hq, Hkv, T, D, decode): Llama-3-8B-like heads (32 query heads, 8 KV heads, D = 128).
_GPU = [(1, 32, 8, 8192, 128, False),    # one long prefill
        (4, 32, 8, 4096, 128, False),    # a batch of prefills
        (256, 32, 8, 1, 128, True)]      # a decode step of 256 sequences at scattered positions
_TINY = [(1, 4, 2, 17, 80, False), (3, 4, 2, 1, 32, True)]
_TABLE_ROWS = {"gpu": 32768, "tiny": 256}


def _case(B, Hq, Hkv, T, D, decode, dtype, table_rows) -> Case:
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(B * 1000 + T)
    q = torch.randn(B, Hq, T, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, T, D, generator=gen).to(device, dtype)
    inv, scale = rope.rope_frequencies(D, 500000.0, "llama3", factor=8.0, original_max_position=8192,
                                       low_freq_factor=1.0, high_freq_factor=4.0)
    cos, sin = rope.rope_cos_sin(inv, table_rows, scale, dtype=dtype)
    cos, sin = cos.to(device), sin.to(device)
    if decode:   # each sequence at its own position
        positions = torch.randint(0, table_rows, (B, T), generator=gen).to(device)
    else:        # a prompt continuing after a cached prefix
        positions = (torch.arange(T) + (table_rows - T) // 2).to(device)
    pos2d = positions.expand(B, T)
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)

    def kernel():
        apply_rope(q, k, cos, sin, positions, out_q=out_q, out_k=out_k, check_positions=False)

    def baseline():
        apply_rotary_pos_emb(q, k, cos[pos2d], sin[pos2d])

    def check():
        got_q, got_k = apply_rope(q, k, cos, sin, positions, out_q=torch.full_like(q, float("nan")),
                                  out_k=torch.full_like(k, float("nan")))
        ref_q, ref_k = apply_rope_ref(q, k, cos, sin, positions)
        rtol, atol = tolerance(dtype)
        torch.testing.assert_close(got_q, ref_q, rtol=rtol, atol=atol)
        torch.testing.assert_close(got_k, ref_k, rtol=rtol, atol=atol)

    elem = q.element_size()
    rows = positions.unique().numel()
    bytes_moved = (2 * (Hq + Hkv) * B * T * D * elem + positions.numel() * positions.element_size()
                   + 2 * rows * D * cos.element_size())
    label = f"B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} {'decode' if decode else 'prefill'} " \
            f"{str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved,
                baseline_name="hf apply_rotary_pos_emb")


@register("rope")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.bfloat16, torch.float16) if size == "gpu" else (torch.float32, torch.bfloat16)
    return [_case(*shape, dtype, _TABLE_ROWS[size]) for shape in shapes for dtype in dtypes]
