"""Tests of labsrc.kernels.kv_cache against its PyTorch reference.

kv_store is a copy, so the comparison is exact for every dtype (bf16 included: no tl.dot is involved, so the
interpreter's bf16 problem does not arise). Destination caches are poisoned with NaN: the stored rows must
be overwritten with the new values and every other row must keep its NaN.
"""
import labsrc  # noqa: F401  (before triton)

import pytest
import torch

from labsrc import runtime
from labsrc.kernels.kv_cache import kv_store, kv_store_ref

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


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_non_contiguous_cache_is_refused(which):
    """A cache is written in place: a copy would not be written back, so a strided cache is refused."""
    args = dict(zip(["k_cache", "v_cache", "k_new", "v_new", "slots"], _good()))
    strided = torch.full((20, 8, 2), float("nan"), device=DEVICE).transpose(1, 2)  # (20, 2, 8), not contiguous
    args[which] = strided
    with pytest.raises(ValueError, match=f"{which} must be contiguous \\(it is written in place"):
        kv_store(**args)
    assert torch.isnan(strided).all()  # refused before anything was written


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


# --- memory layout: every view the kernel reads is made dense first -----------------------------------------
def _strided(t, how, gen):
    """The same values as ``t`` in a non-contiguous (or expanded) layout."""
    if how == "sliced":      # every other row of a buffer twice as long
        big = torch.randn((2 * t.shape[0],) + tuple(t.shape[1:]), generator=gen).to(t)
        big[::2] = t
        return big[::2]
    if how == "transposed":  # stored [rows, head_dim, heads], viewed as [rows, heads, head_dim]
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "offset":      # a contiguous window that starts inside a larger buffer
        big = torch.randn((t.shape[0] + 3,) + tuple(t.shape[1:]), generator=gen).to(t)
        big[3:] = t
        return big[3:]
    raise AssertionError(how)


def _strided_slots(slots, how):
    if how == "sliced":      # a column of a [n, 2] table: stride 2
        return torch.stack([slots, torch.full_like(slots, -7)], 1)[:, 0]
    if how == "offset":
        return torch.cat([torch.full_like(slots[:1], -7), slots])[1:]
    return slots


def _check_against_reference(k_cache, v_cache, k_new, v_new, slots):
    k_ref, v_ref = kv_store_ref(k_cache.clone(), v_cache.clone(), k_new, v_new, slots)
    kv_store(k_cache, v_cache, k_new, v_new, slots)
    # NaN-poisoned caches: equal_nan compares the untouched (NaN) slots too
    assert torch.equal(k_cache.nan_to_num(0.5), k_ref.nan_to_num(0.5)) and torch.isnan(k_cache).sum() == torch.isnan(k_ref).sum()
    assert torch.equal(v_cache.nan_to_num(0.5), v_ref.nan_to_num(0.5)) and torch.isnan(v_cache).sum() == torch.isnan(v_ref).sum()
    assert torch.equal(k_cache[slots.long()], k_new) and torch.equal(v_cache[slots.long()], v_new)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows_layout", ["sliced", "transposed", "offset"])
@pytest.mark.parametrize("slots_layout", ["dense", "sliced", "offset"])
def test_strided_rows_and_slots_match_reference(dtype, slot_dtype, rows_layout, slots_layout):
    """Before the fix a strided k_new/v_new/slots was refused; a wrapper that only reinterprets a view
    (e.g. ``.to(dtype)``, a no-op when the dtype already matches) would read the wrong memory instead."""
    gen = torch.Generator().manual_seed(len(rows_layout) * 7 + len(slots_layout))
    k_cache, v_cache, k_new, v_new, slots = _inputs(41, 13, 3, 10, dtype, seed=5, slot_dtype=slot_dtype)
    k_new, v_new = _strided(k_new, rows_layout, gen), _strided(v_new, rows_layout, gen)
    slots = _strided_slots(slots, slots_layout)
    _check_against_reference(k_cache, v_cache, k_new, v_new, slots)


def test_expanded_rows_match_reference():
    """One row broadcast to every slot (stride 0 on the row axis), e.g. a padding token."""
    k_cache, v_cache, _, _, slots = _inputs(29, 9, 2, 6, torch.float16, seed=3)
    gen = torch.Generator().manual_seed(4)
    k_row = torch.randn(1, 2, 6, generator=gen).half()
    v_row = torch.randn(2, 1, generator=gen).half()
    k_new = k_row.expand(9, 2, 6)
    v_new = v_row.expand(9, 2, 6)      # stride 0 on the last axis as well
    assert k_new.stride(0) == 0 and v_new.stride(2) == 0
    _check_against_reference(k_cache, v_cache, k_new, v_new, slots)


def test_expanded_single_slot_and_caches_that_are_windows_of_a_buffer():
    """A cache that is a contiguous window of a bigger buffer (storage offset) is written at the right place."""
    buf_k = torch.full((50, 2, 4), float("nan"))
    buf_v = torch.full((50, 2, 4), float("nan"))
    k_cache, v_cache = buf_k[10:30], buf_v[10:30]
    gen = torch.Generator().manual_seed(6)
    k_new = torch.randn(1, 2, 4, generator=gen)
    v_new = torch.randn(1, 2, 4, generator=gen)
    slots = torch.tensor(5).expand(1)                    # an expanded view of one slot: stride 0
    assert slots.stride() == (0,)
    _check_against_reference(k_cache, v_cache, k_new, v_new, slots)
    assert torch.isnan(buf_k[:10]).all() and torch.isnan(buf_k[30:]).all()
    assert torch.equal(buf_k[15], k_new[0]) and torch.equal(buf_v[15], v_new[0])


def test_zero_head_dims_are_refused_by_kernel_and_reference():
    """Both used to accept (kernel: ZeroDivisionError in the launch; reference: a silent no-op)."""
    for shape in [(4, 2, 0), (4, 0, 8)]:
        cache = torch.zeros(shape)
        new = torch.zeros((2,) + shape[1:])
        for fn in (kv_store, kv_store_ref):
            with pytest.raises(ValueError, match="k_cache must have n_kv_heads >= 1 and head_dim >= 1"):
                fn(cache, cache.clone(), new, new.clone(), torch.tensor([0, 1]))


@pytest.mark.parametrize("bad", ["out_of_range", "duplicate", "float_slots", "float64_cache"])
def test_reference_refuses_what_the_kernel_refuses(bad):
    args = dict(zip(["k_cache", "v_cache", "k_new", "v_new", "slots"], _good()))
    if bad == "out_of_range":
        args["slots"][0], exc = -1, ValueError          # the reference used to wrap -1 to the last slot
    elif bad == "duplicate":
        args["slots"][1], exc = args["slots"][0], ValueError
    elif bad == "float_slots":
        args["slots"], exc = args["slots"].float(), TypeError
    else:
        args = {k: (v.double() if v.is_floating_point() else v) for k, v in args.items()}
        exc = TypeError
    for fn in (kv_store, kv_store_ref):
        with pytest.raises(exc):
            fn(**{k: v.clone() for k, v in args.items()})


def test_validate_slots_must_be_a_bool():
    with pytest.raises(TypeError, match="validate_slots must be a bool"):
        kv_store(*_good(), validate_slots="no")


# --- launch limits ----------------------------------------------------------------------------------------
def test_rows_with_more_blocks_than_grid_axis_1_are_looped(monkeypatch):
    """Axis 1 of the grid holds at most 65535 programs; a longer row is covered by each program looping.
    The limit is lowered here so that a small row exercises the loop."""
    from labsrc.kernels import kv_cache as module
    monkeypatch.setattr(module, "_BLOCK_INTERPRETER", 4)
    monkeypatch.setattr(module, "_BLOCK_GPU", 4)
    monkeypatch.setattr(module, "_MAX_GRID_AXIS_1", 2)
    k_cache, v_cache, k_new, v_new, slots = _inputs(23, 7, 3, 11, torch.float32, seed=9)  # 33 elements: 9 blocks
    _check_against_reference(k_cache, v_cache, k_new, v_new, slots)


def test_more_rows_than_grid_axis_0_are_refused_up_front():
    """2^31 rows (an expanded view, no memory) exceed Triton's grid axis 0: refused before any copy."""
    n = 2 ** 31
    k_cache = torch.zeros(4, 1, 1)
    new = torch.zeros(1, 1, 1).expand(n, 1, 1)
    slots = torch.zeros(1, dtype=torch.int64).expand(n)
    with pytest.raises(ValueError, match=r"k_new has 2147483648 rows but one launch handles at most 2147483647"):
        kv_store(k_cache, k_cache.clone(), new, new, slots)


def test_rows_too_long_for_int32_offsets_are_refused(monkeypatch):
    from labsrc.kernels import kv_cache as module
    monkeypatch.setattr(module, "_MAX_ROW_SIZE", 15)
    args = _good()  # rows of 2 * 8 = 16 elements
    with pytest.raises(ValueError, match="n_kv_heads \\* head_dim = 16 elements; .* at most 15"):
        kv_store(*args)


# --- property-based: random shapes, layouts and dtypes against the reference; random bad arguments -------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(n_slots=st.integers(1, 40), frac=st.floats(0, 1), heads=st.integers(1, 4), dim=st.integers(1, 70),
       dtype=st.sampled_from(DTYPES), slot_dtype=st.sampled_from([torch.int32, torch.int64]),
       rows_layout=st.sampled_from(["dense", "sliced", "transposed", "offset", "expanded"]),
       slots_layout=st.sampled_from(["dense", "sliced", "offset"]), seed=st.integers(0, 2 ** 16))
def test_property_matches_reference(n_slots, frac, heads, dim, dtype, slot_dtype, rows_layout, slots_layout, seed):
    n_rows = round(frac * n_slots)
    k_cache, v_cache, k_new, v_new, slots = _inputs(n_slots, n_rows, heads, dim, dtype, seed, slot_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    if rows_layout == "expanded":
        k_new = k_new[:1].expand(n_rows, heads, dim) if n_rows else k_new
    elif rows_layout != "dense":
        k_new, v_new = _strided(k_new, rows_layout, gen), _strided(v_new, rows_layout, gen)
    slots = _strided_slots(slots, slots_layout)
    _check_against_reference(k_cache, v_cache, k_new, v_new, slots)


_BAD = st.one_of(st.just(float("nan")), st.just(float("inf")), st.integers(-5, -1), st.just(0), st.booleans(),
                 st.just(1.5), st.text(max_size=3), st.none(), st.lists(st.integers(0, 3), max_size=3))


@_SETTINGS
@given(which=st.sampled_from(["k_cache", "v_cache", "k_new", "v_new", "slots"]), bad=_BAD)
def test_property_non_tensors_raise_type_error_naming_them(which, bad):
    args = dict(zip(["k_cache", "v_cache", "k_new", "v_new", "slots"], _good()))
    args[which] = bad
    for fn in (kv_store, kv_store_ref):
        with pytest.raises(TypeError, match=f"{which} must be a torch.Tensor"):
            fn(**args)


@_SETTINGS
@given(bad_slot=st.one_of(st.integers(-2 ** 40, -1), st.integers(20, 2 ** 40)), at=st.integers(0, 3),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_property_bad_slots_raise(bad_slot, at, slot_dtype):
    info = torch.iinfo(slot_dtype)
    bad_slot = min(max(bad_slot, info.min), info.max)
    args = dict(zip(["k_cache", "v_cache", "k_new", "v_new", "slots"], _good()))
    args["slots"] = args["slots"].to(slot_dtype)
    args["slots"][at] = bad_slot
    for fn in (kv_store, kv_store_ref):
        with pytest.raises(ValueError, match=r"slots must lie in \[0, 20\)"):
            fn(**{k: v.clone() for k, v in args.items()})


def test_non_finite_rows_are_copied_bit_for_bit():
    """NaN and inf in the new rows land in the cache exactly as in the reference (a copy, no arithmetic)."""
    for dtype in DTYPES:
        k_cache, v_cache, k_new, v_new, slots = _inputs(17, 5, 2, 9, dtype, seed=12)
        k_new[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
        v_new[4, 1, -1] = float("inf")
        k_ref, v_ref = kv_store_ref(k_cache.clone(), v_cache.clone(), k_new, v_new, slots)
        kv_store(k_cache, v_cache, k_new, v_new, slots)
        assert torch.equal(k_cache.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           k_ref.view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert torch.equal(v_cache.nan_to_num(0.5), v_ref.nan_to_num(0.5))
