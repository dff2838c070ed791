"""Tests of labsrc.kernels.kv_store against its PyTorch reference.

kv_store is a copy, so the comparison is exact for every dtype (bf16 included: no tl.dot is involved, so the
interpreter's bf16 problem does not arise). Destination caches are poisoned with NaN: the stored rows must
be overwritten with the new values and every other row must keep its NaN.
"""
import labsrc  # noqa: F401  (before triton)

import pytest
import torch

from labsrc import runtime
from labsrc.kernels.kv_store import kv_store, kv_store_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE = runtime.DEVICE


def _inputs(n_slots, n_rows, heads, dim, dtype, seed, slot_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.full((n_slots, heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full((n_slots, heads, dim), float("nan"), dtype=dtype)
    k_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype)
    v_new = torch.randn(n_rows, heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(n_slots, generator=gen)[:n_rows].to(slot_dtype)
    return [t.to(DEVICE) for t in (k_cache, v_cache, k_new, v_new, slots)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_slots,n_rows,heads,dim", [(1, 1, 1, 1), (101, 37, 3, 48), (67, 67, 5, 20),
                                                       (300, 7, 2, 129), (64, 1, 8, 64)])
def test_matches_reference_and_leaves_other_slots(dtype, n_slots, n_rows, heads, dim):
    k_cache, v_cache, k_new, v_new, slots = _inputs(n_slots, n_rows, heads, dim, dtype, seed=n_slots + dim)
    k_ref, v_ref = kv_store_ref(k_cache.clone(), v_cache.clone(), k_new, v_new, slots)
    k_out, v_out = kv_store(k_cache, v_cache, k_new, v_new, slots)
    assert k_out is k_cache and v_out is v_cache  # in place
    touched = torch.zeros(n_slots, dtype=torch.bool, device=DEVICE)
    touched[slots.long()] = True
    # the stored rows: exactly the new rows (a copy changes no bits), none left NaN
    assert torch.equal(k_out[slots.long()], k_new) and torch.equal(v_out[slots.long()], v_new)
    assert not torch.isnan(k_out[touched]).any() and not torch.isnan(v_out[touched]).any()
    # the rest: still the poison, as in the reference
    assert torch.isnan(k_out[~touched]).all() and torch.isnan(v_out[~touched]).all()
    assert torch.equal(k_out.nan_to_num(0.5), k_ref.nan_to_num(0.5))
    assert torch.equal(v_out.nan_to_num(0.5), v_ref.nan_to_num(0.5))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_untouched_rows_keep_their_values_int32_slots(slot_dtype):
    k_cache, v_cache, k_new, v_new, slots = _inputs(53, 11, 3, 17, torch.float16, seed=7, slot_dtype=slot_dtype)
    gen = torch.Generator().manual_seed(8)
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen).to(k_cache))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen).to(v_cache))
    k_expected, v_expected = kv_store_ref(k_cache.clone(), v_cache.clone(), k_new, v_new, slots)
    kv_store(k_cache, v_cache, k_new, v_new, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_decode_steps_append_like_a_growing_cache():
    """Storing one token per step at slots 0, 1, 2, ... rebuilds the concatenation of the steps' rows."""
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, 2, 24, generator=gen) for _ in range(9)]
    k_cache = torch.full((9, 2, 24), float("nan"), device=DEVICE)
    v_cache = torch.full((9, 2, 24), float("nan"), device=DEVICE)
    for t, row in enumerate(steps):
        kv_store(k_cache, v_cache, row.to(DEVICE), (2 * row).to(DEVICE), torch.tensor([t], device=DEVICE))
    assert torch.equal(k_cache.cpu(), torch.cat(steps)) and torch.equal(v_cache.cpu(), 2 * torch.cat(steps))


def test_zero_rows_is_a_no_op():
    k_cache, v_cache, k_new, v_new, slots = _inputs(10, 0, 2, 4, torch.float32, seed=0)
    kv_store(k_cache, v_cache, k_new, v_new, slots)
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


# --- validation: one test per error message ----------------------------------------------------------------
def _good():
    return _inputs(20, 4, 2, 8, torch.float32, seed=1)


@pytest.mark.parametrize("bad_slot", [-1, 20, 1000])
def test_out_of_range_slot(bad_slot):
    k_cache, v_cache, k_new, v_new, slots = _good()
    slots[2] = bad_slot
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 20\)"):
        kv_store(k_cache, v_cache, k_new, v_new, slots)


def test_duplicate_slots():
    k_cache, v_cache, k_new, v_new, slots = _good()
    slots[1] = slots[0]
    with pytest.raises(ValueError, match="slots must be distinct"):
        kv_store(k_cache, v_cache, k_new, v_new, slots)


@pytest.mark.parametrize("which", ["v_cache", "k_new", "v_new"])
def test_dtype_mismatch(which):
    args = dict(zip(["k_cache", "v_cache", "k_new", "v_new", "slots"], _good()))
    args[which] = args[which].half()
    with pytest.raises(TypeError, match=f"{which} has dtype torch.float16 but k_cache has torch.float32"):
        kv_store(**args)


def test_unsupported_dtype():
    args = dict(zip(["k_cache", "v_cache", "k_new", "v_new", "slots"], _good()))
    args["k_cache"] = args["k_cache"].double()
    with pytest.raises(TypeError, match="k_cache has dtype torch.float64; supported"):
        kv_store(**args)


def test_slot_dtype():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(TypeError, match="slots must be int32 or int64"):
        kv_store(k_cache, v_cache, k_new, v_new, slots.float())


def test_not_a_tensor():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(TypeError, match="slots must be a torch.Tensor"):
        kv_store(k_cache, v_cache, k_new, v_new, [0, 1, 2, 3])


def test_wrong_rank():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match=r"k_new must be 3-D \[rows, n_kv_heads, head_dim\]"):
        kv_store(k_cache, v_cache, k_new.reshape(4, 16), v_new, slots)


def test_cache_shapes_differ():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match="v_cache shape .* must equal k_cache shape"):
        kv_store(k_cache, v_cache[:10].contiguous(), k_new, v_new, slots)


def test_row_shape_mismatch():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match="k_new rows .* must match the cache's"):
        kv_store(k_cache, v_cache, k_new[:, :1].contiguous(), v_new, slots)


def test_new_shapes_differ():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match="v_new shape .* must equal k_new shape"):
        kv_store(k_cache, v_cache, k_new, v_new[:3].contiguous(), slots)


def test_slots_shape():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match=r"slots must have shape \(4,\)"):
        kv_store(k_cache, v_cache, k_new, v_new, slots[:3])


def test_contiguity():
    k_cache, v_cache, k_new, v_new, slots = _good()
    strided = torch.empty(4, 8, 2, device=DEVICE).transpose(1, 2)  # shape (4, 2, 8), not contiguous
    strided.copy_(k_new)
    with pytest.raises(ValueError, match="k_new must be contiguous"):
        kv_store(k_cache, v_cache, strided, v_new, slots)


@pytest.mark.skipif(not runtime.HAS_CUDA, reason="needs a second device")
def test_device_mismatch():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match="slots is on cpu but k_cache is on cuda"):
        kv_store(k_cache, v_cache, k_new, v_new, slots.cpu())


@pytest.mark.skipif(runtime.HAS_CUDA, reason="the meta-device stand-in is for CPU-only machines")
def test_device_mismatch_cpu_machine():
    k_cache, v_cache, k_new, v_new, slots = _good()
    with pytest.raises(ValueError, match="v_new is on meta but k_cache is on cpu"):
        kv_store(k_cache, v_cache, k_new, v_new.to("meta"), slots)


def test_compiled_kernel_needs_cuda(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    args = [t.cpu() for t in _good()]
    with pytest.raises(ValueError, match="compiled Triton kernels need CUDA tensors"):
        kv_store(*args)
