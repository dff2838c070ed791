"""Write new K/V rows into a preallocated cache at given slots: the store half of every KV cache.

A serving engine preallocates one big cache of ``n_slots`` token slots per layer and hands each new token a
slot (contiguous per request in a naive engine, scattered over pages in PagedAttention). Every decode step
then has to copy the freshly computed K and V rows of the batch into their slots. That copy is
:func:`kv_store`; it is bandwidth-bound (it reads each new row once and writes it once), so its bench
reports GB/s.

Layout: ``k_cache, v_cache`` are ``[n_slots, n_kv_heads, head_dim]``, ``k_new, v_new`` are
``[n_rows, n_kv_heads, head_dim]`` and ``slots`` is ``[n_rows]`` (int32 or int64); row ``i`` goes to slot
``slots[i]``. Supported dtypes: float32, float16, bfloat16 (a pure copy, so bf16 is exact under the
interpreter too).
"""
from __future__ import annotations

import labsrc  # noqa: F401  (must come before triton: sets TRITON_INTERPRET on CPU-only machines)
from labsrc import runtime

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SLOT_DTYPES = (torch.int32, torch.int64)

# On a GPU a block of 1024 elements (2 KiB of fp16) per program keeps enough bytes in flight; the
# interpreter runs one program at a time in NumPy, so fewer, larger blocks are faster there.
_BLOCK_GPU = 1024
_BLOCK_INTERPRETER = 4096


@triton.jit
def _kv_store_kernel(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    # int64 offsets: slot * row_size overflows int32 for caches above 2^31 elements (e.g. 64K slots x 8 x 128 x 32).
    slot = tl.load(slots + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    src = row.to(tl.int64) * row_size + offs
    dst = slot * row_size + offs
    tl.store(k_cache + dst, tl.load(k_new + src, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v_new + src, mask=mask), mask=mask)


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           slots: torch.Tensor, validate_slots: bool) -> None:
    named = dict(k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, slots=slots)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("k_cache", "v_cache", "k_new", "v_new"):
        t = named[name]
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [rows, n_kv_heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if k_new.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"k_new rows {tuple(k_new.shape[1:])} must match the cache's [n_kv_heads, head_dim] "
                         f"{tuple(k_cache.shape[1:])}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new shape {tuple(v_new.shape)} must equal k_new shape {tuple(k_new.shape)}")
    for name in ("v_cache", "k_new", "v_new"):
        if named[name].dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {named[name].dtype} but k_cache has {k_cache.dtype}; "
                            "convert the new rows to the cache's dtype first")
    if slots.dtype not in SLOT_DTYPES:
        raise TypeError(f"slots must be int32 or int64, got {slots.dtype}")
    if slots.shape != (k_new.shape[0],):
        raise ValueError(f"slots must have shape ({k_new.shape[0]},) (one slot per new row), got {tuple(slots.shape)}")
    device = k_cache.device
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {device}; put all tensors on one device")
    if device.type != "cuda" and not runtime.INTERPRETED:
        raise ValueError(f"tensors are on {device}; compiled Triton kernels need CUDA tensors "
                         "(or run with TRITON_INTERPRET=1)")
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    if validate_slots and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= k_cache.shape[0]:
            raise ValueError(f"slots must lie in [0, {k_cache.shape[0]}) (the cache's n_slots), got values in [{lo}, {hi}]")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct: two new rows aimed at one slot would race")


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slots: torch.Tensor, *, validate_slots: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy ``k_new[i]`` and ``v_new[i]`` into ``k_cache[slots[i]]`` and ``v_cache[slots[i]]``, in place.

    Args:
        k_cache, v_cache: ``[n_slots, n_kv_heads, head_dim]`` preallocated caches (contiguous).
        k_new, v_new: ``[n_rows, n_kv_heads, head_dim]`` rows to store, same dtype as the cache.
        slots: ``[n_rows]`` int32/int64, distinct, each in ``[0, n_slots)``.
        validate_slots: check the slot range and distinctness first. It costs a device-to-host sync;
            an engine that allocates the slots itself may switch it off.

    Returns ``(k_cache, v_cache)``; slots not named in ``slots`` are left untouched.
    Raises ``TypeError`` for a wrong dtype and ``ValueError`` for wrong shapes, devices, contiguity or slots.
    """
    _check(k_cache, v_cache, k_new, v_new, slots, validate_slots)
    n_rows = k_new.shape[0]
    row_size = k_new.shape[1] * k_new.shape[2]
    if n_rows == 0:
        return k_cache, v_cache
    block = _BLOCK_INTERPRETER if runtime.INTERPRETED else _BLOCK_GPU
    block = min(block, triton.next_power_of_2(row_size))
    grid = (n_rows, triton.cdiv(row_size, block))
    _kv_store_kernel[grid](k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK=block)
    return k_cache, v_cache


def kv_store_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference of :func:`kv_store`: ``k_cache[slots] = k_new`` (same for V), in place."""
    k_cache[slots.long()] = k_new
    v_cache[slots.long()] = v_new
    return k_cache, v_cache
