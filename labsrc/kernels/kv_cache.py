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

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SLOT_DTYPES = (torch.int32, torch.int64)

# On a GPU a block of 1024 elements (2 KiB of fp16) per program keeps enough bytes in flight; the
# interpreter runs one program at a time in NumPy, so fewer, larger blocks are faster there.
_BLOCK_GPU = 1024
_BLOCK_INTERPRETER = 4096

# Triton's launch limits. Rows go on grid axis 0 (up to 2^31 - 1 programs: a prefill of 100K tokens is one
# program per token); the blocks of a row on axis 1, which CUDA caps at 65535. A row with more blocks than
# that is not refused: each program of axis 1 loops over every 65535th block (see the kernel). A row of
# 2^31 elements or more would overflow the kernel's int32 offsets within the row, so it is refused.
_MAX_GRID_AXIS_0 = 2 ** 31 - 1
_MAX_GRID_AXIS_1 = 65535
_MAX_ROW_SIZE = 2 ** 31 - 1


@triton.jit
def _kv_store_kernel(
    k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    # int64 offsets: slot * row_size overflows int32 for a cache above 2^31 elements
    # (one layer of 2M slots x 8 K/V heads x 128 dims).
    slot = tl.load(slots + row).to(tl.int64)
    src_row = row.to(tl.int64) * row_size
    dst_row = slot * row_size
    # Program j of axis 1 copies blocks j, j + n, j + 2n, ... of the row (n programs on
    # that axis): one block each in the usual case, several when the row has more blocks
    # than the 65535 that axis 1 can launch.
    for start in range(tl.program_id(1) * BLOCK, row_size, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_size
        tl.store(
            k_cache + dst_row + offs,
            tl.load(k_new + src_row + offs, mask=mask),
            mask=mask,
        )
        tl.store(
            v_cache + dst_row + offs,
            tl.load(v_new + src_row + offs, mask=mask),
            mask=mask,
        )


_NAMES = ("k_cache", "v_cache", "k_new", "v_new", "slots")


def _check_values(k_cache, v_cache, k_new, v_new, slots) -> None:
    """Types, ranks, dtypes and shapes: what :func:`kv_store` and :func:`kv_store_ref` both require."""
    named = dict(zip(_NAMES, (k_cache, v_cache, k_new, v_new, slots)))
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
    if k_cache.shape[1] < 1 or k_cache.shape[2] < 1:
        raise ValueError(f"k_cache must have n_kv_heads >= 1 and head_dim >= 1, got shape {tuple(k_cache.shape)}")
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


def _check_slots(slots: torch.Tensor, n_slots: int) -> None:
    """Every slot inside the cache and no slot twice (costs a device-to-host sync)."""
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= n_slots:
            raise ValueError(f"slots must lie in [0, {n_slots}) (the cache's n_slots), got values in [{lo}, {hi}]")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct: two new rows aimed at one slot would race")


def _check_launch(n_rows: int, row_size: int) -> None:
    """Refuse, before anything is copied or launched, what Triton cannot launch."""
    if n_rows > _MAX_GRID_AXIS_0:
        raise ValueError(f"k_new has {n_rows} rows but one launch handles at most {_MAX_GRID_AXIS_0} "
                         f"(Triton's grid axis 0 limit); store them in chunks")
    if row_size > _MAX_ROW_SIZE:
        raise ValueError(f"a row of k_new holds n_kv_heads * head_dim = {row_size} elements; the kernel's int32 "
                         f"offsets within a row allow at most {_MAX_ROW_SIZE}")


def _check_placement(k_cache, v_cache, k_new, v_new, slots) -> None:
    """One device, a device the kernel runs on, and caches that can be written in place."""
    named = dict(zip(_NAMES, (k_cache, v_cache, k_new, v_new, slots)))
    device = k_cache.device
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {device}; put all tensors on one device")
    if HAS_TRITON and device.type != "cuda" and not runtime.INTERPRETED:
        raise ValueError(f"tensors are on {device}; compiled Triton kernels need CUDA tensors "
                         "(or run with TRITON_INTERPRET=1)")
    for name in ("k_cache", "v_cache"):
        # The kernel addresses a slot as slot * row_size, so the cache must be one dense block. A copy would
        # not help: the rows would be stored into the copy and the caller's cache left unchanged.
        if not named[name].is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is written in place, so a copy would not be "
                             f"written back); allocate the cache with torch.empty/zeros/full, got strides "
                             f"{named[name].stride()} for shape {tuple(named[name].shape)}")


def kv_store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
    v_new: torch.Tensor, slots: torch.Tensor, *, validate_slots: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy ``k_new[i]`` and ``v_new[i]`` into ``k_cache[slots[i]]`` and ``v_cache[slots[i]]``, in place.

    Args:
        k_cache, v_cache: ``[n_slots, n_kv_heads, head_dim]`` preallocated caches (contiguous, since they are
            written in place); ``n_kv_heads`` and ``head_dim`` at least 1.
        k_new, v_new: ``[n_rows, n_kv_heads, head_dim]`` rows to store, same dtype as the cache. Any strides:
            sliced, transposed or expanded views are copied into the dense layout the kernel reads.
        slots: ``[n_rows]`` int32/int64, distinct, each in ``[0, n_slots)``; any strides.
        validate_slots: check the slot range and distinctness first. It costs a device-to-host sync;
            an engine that allocates the slots itself may switch it off.

    Returns ``(k_cache, v_cache)``; slots not named in ``slots`` are left untouched.
    Raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for wrong shapes, devices, a
    non-contiguous cache, slots, or more rows than one launch can take, naming the argument.
    """
    _check_values(k_cache, v_cache, k_new, v_new, slots)
    if not isinstance(validate_slots, bool):
        raise TypeError(
            f"validate_slots must be a bool, got {type(validate_slots).__name__}"
        )
    n_rows = k_new.shape[0]
    row_size = k_new.shape[1] * k_new.shape[2]
    _check_launch(n_rows, row_size)
    _check_placement(k_cache, v_cache, k_new, v_new, slots)
    # The kernel reads row i at i * row_size and slot i at slots + i: dense layouts,
    # whatever the caller's view.
    k_new, v_new, slots = k_new.contiguous(), v_new.contiguous(), slots.contiguous()
    if validate_slots:
        _check_slots(slots, k_cache.shape[0])
    if not HAS_TRITON:
        # no Triton on this machine (it has Linux wheels only): the reference does the
        # copy
        return kv_store_ref(k_cache, v_cache, k_new, v_new, slots)
    if n_rows == 0:
        return k_cache, v_cache
    block = _BLOCK_INTERPRETER if runtime.INTERPRETED else _BLOCK_GPU
    block = min(block, triton.next_power_of_2(row_size))
    grid = (n_rows, min(triton.cdiv(row_size, block), _MAX_GRID_AXIS_1))
    _kv_store_kernel[grid](k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK=block)
    return k_cache, v_cache


def kv_store_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference of :func:`kv_store`: ``k_cache[slots] = k_new`` (same for V), in place.

    It refuses what :func:`kv_store` refuses (types, dtypes, shapes, slots out of range or repeated), but
    takes any layout and device, since indexing in PyTorch needs neither.
    """
    _check_values(k_cache, v_cache, k_new, v_new, slots)
    _check_slots(slots, k_cache.shape[0])
    k_cache[slots.long()] = k_new
    v_cache[slots.long()] = v_new
    return k_cache, v_cache
