"""Bench entry ``kv_store``: the Triton KV-cache store against PyTorch's ``index_copy_``.

The store is a pure copy, so the figure of merit is GB/s: it must read the new K and V rows and the slot
indices and write the rows into the cache, ``2 * 2 * n_rows * n_kv_heads * head_dim * element_size`` bytes
plus the slots. Slot validation (a host sync) is switched off in the timed call, as an engine that
allocates slots itself would, and the baseline does not validate either.
"""
from __future__ import annotations

import torch

from labsrc.bench import Case, register
from labsrc import runtime
from labsrc.kernels.kv_cache import kv_store, kv_store_ref

# (n_slots, n_rows, n_kv_heads, head_dim): a decode step of 256 sequences and a 4096-token prefill chunk,
# each into a 64K-slot cache with Llama-3-like heads (8 x 128).
_GPU = [(65536, 256, 8, 128), (65536, 4096, 8, 128)]
_TINY = [(101, 37, 3, 48)]


def _case(n_slots: int, n_rows: int, heads: int, dim: int, dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(n_rows)
    device = runtime.DEVICE
    k_cache = torch.zeros(n_slots, heads, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype=dtype, device=device)
    v_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype=dtype, device=device)
    slots = torch.randperm(n_slots, generator=gen)[:n_rows].to(device)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)

    def kernel():
        kv_store(k_cache, v_cache, k_new, v_new, slots, validate_slots=False)

    def baseline():
        ref_k.index_copy_(0, slots, k_new)
        ref_v.index_copy_(0, slots, v_new)

    def check():
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        kv_store(k_cache, v_cache, k_new, v_new, slots)
        expected_k, expected_v = kv_store_ref(torch.full_like(k_cache, float("nan")),
                                              torch.full_like(v_cache, float("nan")), k_new, v_new, slots)
        if not (torch.equal(k_cache.nan_to_num(0.5), expected_k.nan_to_num(0.5))
                and torch.equal(v_cache.nan_to_num(0.5), expected_v.nan_to_num(0.5))):
            raise AssertionError(f"kv_store differs from kv_store_ref at {n_slots=} {n_rows=} {heads=} {dim=} {dtype}")

    elem = k_new.element_size()
    bytes_moved = 2 * 2 * n_rows * heads * dim * elem + slots.numel() * slots.element_size()
    label = f"slots={n_slots} rows={n_rows} H={heads} D={dim} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=kernel, baseline=baseline, check=check, bytes_moved=bytes_moved,
                baseline_name="index_copy_")


@register("kv_store")
def entry(size: str) -> list[Case]:
    shapes = _GPU if size == "gpu" else _TINY
    dtypes = (torch.float16, torch.bfloat16) if size == "gpu" else (torch.float32, torch.float16, torch.bfloat16)
    return [_case(*shape, dtype) for shape in shapes for dtype in dtypes]
