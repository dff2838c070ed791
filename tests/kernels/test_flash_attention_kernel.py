"""Tests of the FlashAttention and flash-decoding kernels (labsrc.kernels.flash_attention).

Every kernel call writes into outputs pre-filled with NaN, so an element the kernel forgets to write fails the
comparison. Each result is compared with two independent definitions: the plain PyTorch reference evaluated in
float64 (ground truth, so the tolerance measures only the kernel's error) and PyTorch's
``scaled_dot_product_attention`` (also in float64), at the lab's tolerance for the input dtype.

The full Cartesian product of the listed sizes is far too slow for the Triton interpreter on two cores, so the
grids below are seeded samples in which every listed value of every dimension occurs several times, paired
with varied values of the others.

bf16 under the interpreter: ``tl.dot`` on bf16 operands returns garbage in Triton's interpreter, so the kernels
upcast bf16 tiles to fp32 when interpreted (the ``UPCAST`` flag). The bf16 cases here therefore test bf16
loads, stores and the rest of the kernel, but not bf16 tensor-core dots; those run only on a GPU.
"""
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import labsrc
import labsrc.kernels.flash_attention as attention_module
from labsrc import runtime
from labsrc.exercises import tolerance
from labsrc.kernels.flash_attention import (decode_attention, decode_attention_ref, flash_attention,
                                      flash_attention_backward, flash_attention_backward_ref, flash_attention_ref)

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]



def _cover(dims: dict, n: int, seed: int) -> list[dict]:
    """``n`` combinations in which each value of each dimension appears at least ``n // len(values)`` times,
    shuffled independently per dimension (a seeded, pairwise-flavoured sample of the product)."""
    rng = random.Random(seed)
    columns = {}
    for name, values in dims.items():
        column = (list(values) * math.ceil(n / len(values)))[:n]
        rng.shuffle(column)
        columns[name] = column
    return [dict(zip(columns, row)) for row in zip(*columns.values())]


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=DEV)


def _bottom_right_mask(tq, tk):
    i = torch.arange(tq, device=DEV)[:, None]
    j = torch.arange(tk, device=DEV)[None, :]
    return j <= i + (tk - tq)


def _sdpa(q, k, v, causal, scale):
    """PyTorch's SDPA in float64 with an explicit bottom-right mask (its is_causal is top-left aligned)."""
    mask = _bottom_right_mask(q.shape[2], k.shape[2]) if causal else None
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def _assert_close(actual, expected, dtype, what):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _run_flash(q, k, v, causal, sm_scale=None):
    """Call the kernel with NaN-poisoned out and lse_out, and return what it wrote."""
    B, Hq, Tq, D = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, Tq), float("nan"), device=DEV)
    result, lse_result = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True, out=out,
                                         lse_out=lse)
    assert result.data_ptr() == out.data_ptr() and lse_result.data_ptr() == lse.data_ptr()
    return out, lse


def _check_flash(q, k, v, causal, sm_scale=None):
    dtype = q.dtype
    out, lse = _run_flash(q, k, v, causal, sm_scale)
    ref_out, ref_lse = flash_attention_ref(q.double(), k.double(), v.double(), causal=causal, sm_scale=sm_scale,
                                           return_lse=True)
    assert not out.isnan().any(), "the kernel left elements of out unwritten (still NaN)"
    assert not lse.isnan().any(), "the kernel left elements of lse unwritten (still NaN)"
    # The kernel's output is rounded to the input dtype; compare with the ground truth rounded the same way.
    _assert_close(out, ref_out.to(dtype), dtype, "output vs reference")
    _assert_close(lse, ref_lse, torch.float32, "log-sum-exp vs reference")
    # SDPA gives nan for rows that see no key; those rows are checked separately (test_empty_causal_rows).
    seen = torch.isfinite(ref_lse)
    sdpa = _sdpa(q, k, v, causal, sm_scale)
    _assert_close(out[seen], sdpa[seen].to(dtype), dtype, "output vs SDPA")


# --- the main grid -------------------------------------------------------------------------------------------
FLASH_DIMS = dict(
    batch=[1, 2, 3],
    heads=[(1, 1), (4, 1), (5, 1), (8, 2)],
    tq=[1, 17, 63, 129, 257],
    tk=[1, 17, 63, 129, 257],
    d=[16, 32, 48, 64, 80, 96, 128],
    causal=[False, True],
    dtype=DTYPES,
)
FLASH_CASES = _cover(FLASH_DIMS, n=21, seed=2024)


def _case_id(c):
    return "B{batch}-H{heads[0]}:{heads[1]}-Tq{tq}-Tk{tk}-D{d}-{c}-{t}".format(
        c="causal" if c["causal"] else "full", t=str(c["dtype"]).removeprefix("torch."), **c)


@pytest.mark.parametrize("index", range(len(FLASH_CASES)), ids=[_case_id(c) for c in FLASH_CASES])
def test_flash_attention_matches_reference_and_sdpa(index):
    case = FLASH_CASES[index]
    gen = torch.Generator().manual_seed(1000 + index)
    (hq, hkv), dtype = case["heads"], case["dtype"]
    q = _rand(gen, case["batch"], hq, case["tq"], case["d"], dtype=dtype)
    k = _rand(gen, case["batch"], hkv, case["tk"], case["d"], dtype=dtype)
    v = _rand(gen, case["batch"], hkv, case["tk"], case["d"], dtype=dtype)
    _check_flash(q, k, v, case["causal"])


def test_grid_covers_every_listed_value():
    for name, values in FLASH_DIMS.items():
        assert {repr(c[name]) for c in FLASH_CASES} == {repr(v) for v in values}, name
    assert any(c["causal"] and c["tq"] < c["tk"] for c in FLASH_CASES), "no causal case with Tq < Tk"


# --- targeted cases ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_chunked_prefill_is_bottom_right_aligned(dtype):
    # A chunk of 40 new queries after 89 cached tokens: the last query must see every key.
    gen = torch.Generator().manual_seed(1)
    q = _rand(gen, 1, 4, 40, 96, dtype=dtype)
    k = _rand(gen, 1, 2, 129, 96, dtype=dtype)
    v = _rand(gen, 1, 2, 129, 96, dtype=dtype)
    _check_flash(q, k, v, causal=True)
    # Equivalent to running the full 129-token causal prefill and keeping its last 40 rows.
    q_full = torch.cat([_rand(gen, 1, 4, 89, 96, dtype=dtype), q], dim=2)
    full = flash_attention(q_full, k, v, causal=True)
    # Not bit-equal: a row sits at a different position of a different query tile in the two runs, and the
    # tile matmul (NumPy's BLAS under the interpreter, the tensor cores on a GPU) may sum in another order.
    _assert_close(flash_attention(q, k, v, causal=True), full[:, :, 89:], dtype, "chunk vs full prefill")


def test_square_causal_matches_sdpa_is_causal():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_rand(gen, 1, 4, 77, 64, dtype=torch.float32) for _ in range(3))
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    _assert_close(flash_attention(q, k, v, causal=True), expected, torch.float32, "vs SDPA is_causal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_empty_causal_rows_give_zero_output_and_minus_inf_lse(dtype):
    # Tq > Tk with causal: query i sees keys j <= i - (Tq - Tk), so the first Tq - Tk rows see nothing.
    gen = torch.Generator().manual_seed(3)
    tq, tk = 129, 17
    q = _rand(gen, 2, 4, tq, 48, dtype=dtype)
    k = _rand(gen, 2, 2, tk, 48, dtype=dtype)
    v = _rand(gen, 2, 2, tk, 48, dtype=dtype)
    out, lse = _run_flash(q, k, v, causal=True)
    empty = tq - tk
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.equal(lse[:, :, :empty], torch.full_like(lse[:, :, :empty], float("-inf")))
    assert torch.isfinite(lse[:, :, empty:]).all()
    _check_flash(q, k, v, causal=True)  # the other rows are ordinary attention


def test_custom_scale_and_strided_views():
    # Hugging Face hands the kernel q/k/v as transpose(1, 2) views of (B, T, H, D) tensors.
    gen = torch.Generator().manual_seed(4)
    q = _rand(gen, 2, 33, 6, 80, dtype=torch.float32).transpose(1, 2)
    k = _rand(gen, 2, 50, 3, 80, dtype=torch.float32).transpose(1, 2)
    v = _rand(gen, 2, 50, 3, 80, dtype=torch.float32).transpose(1, 2)
    assert not q.is_contiguous()
    _check_flash(q, k, v, causal=True, sm_scale=0.125)
    out_view = torch.full((2, 33, 6, 80), float("nan"), device=DEV).transpose(1, 2)  # a strided out works too
    flash_attention(q, k, v, causal=True, sm_scale=0.125, out=out_view)
    _assert_close(out_view, flash_attention_ref(q.double(), k.double(), v.double(), causal=True, sm_scale=0.125),
                  torch.float32, "strided out")


@pytest.mark.parametrize("sm_scale", [0.3, 1.0])
def test_fp32_error_with_large_scores_is_that_of_any_fp32_softmax(sm_scale):
    # fp32 softmax has an absolute error of about eps * |score| in each exponent, so with scores several times
    # larger than 1/sqrt(D) gives, even PyTorch's own fp32 attention misses the lab's fp32 atol (1e-6) against
    # float64. The honest check there: the kernel is no less accurate than plain PyTorch in fp32.
    gen = torch.Generator().manual_seed(13)
    q = _rand(gen, 2, 6, 33, 80, dtype=torch.float32)
    k, v = (_rand(gen, 2, 3, 50, 80, dtype=torch.float32) for _ in range(2))
    truth = flash_attention_ref(q.double(), k.double(), v.double(), causal=True, sm_scale=sm_scale)
    kernel_err = (flash_attention(q, k, v, causal=True, sm_scale=sm_scale).double() - truth).abs().max()
    torch_err = (flash_attention_ref(q, k, v, causal=True, sm_scale=sm_scale).double() - truth).abs().max()
    assert kernel_err <= 2 * torch_err, f"kernel error {kernel_err:.3g} vs PyTorch fp32 error {torch_err:.3g}"


def test_return_values_and_defaults():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (_rand(gen, 1, 2, 9, 32, dtype=torch.float16) for _ in range(3))
    out = flash_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float16 and out.is_contiguous()
    out2, lse = flash_attention(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 9) and lse.dtype == torch.float32
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    # The default scale is 1/sqrt(D).
    torch.testing.assert_close(flash_attention(q, k, v, sm_scale=1 / math.sqrt(32)), out, rtol=0, atol=0)


def test_reference_in_fp32_agrees_with_float64_ground_truth():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (_rand(gen, 2, 4, 65, 48, dtype=torch.float32) for _ in range(3))
    out, lse = flash_attention_ref(q, k, v, causal=True, return_lse=True)
    out64, lse64 = flash_attention_ref(q.double(), k.double(), v.double(), causal=True, return_lse=True)
    _assert_close(out, out64, torch.float32, "fp32 reference")
    _assert_close(lse, lse64, torch.float32, "fp32 reference lse")


# --- decode --------------------------------------------------------------------------------------------------
def _check_decode(q, k_cache, v_cache, seq_lens, num_splits, sm_scale=None):
    dtype = q.dtype
    # Poison the cache past each sequence's length: a kernel that reads beyond seq_lens[b] produces NaN.
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(seq_lens.tolist()):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    out = torch.full_like(q, float("nan"))
    result = decode_attention(q, k_cache, v_cache, seq_lens, sm_scale=sm_scale, num_splits=num_splits, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "decode left elements unwritten or read past seq_lens (NaN)"
    ref = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), seq_lens, sm_scale=sm_scale)
    _assert_close(out, ref.to(dtype), dtype, "decode vs reference")
    for b, n in enumerate(seq_lens.tolist()):
        sdpa = _sdpa(q[b : b + 1, :, None], k_cache[b : b + 1, :, :n], v_cache[b : b + 1, :, :n], False, sm_scale)
        _assert_close(out[b], sdpa[0, :, 0].to(dtype), dtype, f"decode vs SDPA (sequence {b})")


DECODE_DIMS = dict(
    batch=[1, 2, 3],
    heads=[(1, 1), (4, 1), (5, 1), (8, 2)],
    tmax=[1, 17, 63, 129, 257],
    d=[16, 32, 48, 64, 80, 96, 128],
    splits=[None, 1, 3, 16],
    dtype=DTYPES,
)
DECODE_CASES = _cover(DECODE_DIMS, n=14, seed=7)


def _decode_id(c):
    return "B{batch}-H{heads[0]}:{heads[1]}-T{tmax}-D{d}-S{splits}-{t}".format(
        t=str(c["dtype"]).removeprefix("torch."), **c)


@pytest.mark.parametrize("index", range(len(DECODE_CASES)), ids=[_decode_id(c) for c in DECODE_CASES])
def test_decode_attention_matches_reference_and_sdpa(index):
    case = DECODE_CASES[index]
    gen = torch.Generator().manual_seed(100 + index)
    (hq, hkv), dtype, B, tmax = case["heads"], case["dtype"], case["batch"], case["tmax"]
    q = _rand(gen, B, hq, case["d"], dtype=dtype)
    k_cache = _rand(gen, B, hkv, tmax, case["d"], dtype=dtype)
    v_cache = _rand(gen, B, hkv, tmax, case["d"], dtype=dtype)
    # Ragged lengths that include both extremes, 1 and Tmax.
    lens = torch.randint(1, tmax + 1, (B,), generator=gen)
    lens[0] = 1 if index % 2 else tmax
    lens[-1] = tmax if index % 2 else 1
    # (num_splits may not exceed Tmax; an int above it is clipped, which for Tmax = 1 means one split.)
    splits = case["splits"] and min(case["splits"], tmax)
    _check_decode(q, k_cache, v_cache, lens.to(DEV), splits)


def test_decode_grid_covers_every_listed_value():
    for name, values in DECODE_DIMS.items():
        assert {repr(c[name]) for c in DECODE_CASES} == {repr(v) for v in values}, name


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_ragged_batch_with_many_splits(dtype):
    # More splits than some sequences have keys: those splits are empty and must weigh nothing in the merge.
    gen = torch.Generator().manual_seed(8)
    q = _rand(gen, 4, 8, 80, dtype=dtype)
    k_cache = _rand(gen, 4, 2, 200, 80, dtype=dtype)
    v_cache = _rand(gen, 4, 2, 200, 80, dtype=dtype)
    lens = torch.tensor([1, 200, 7, 131], dtype=torch.int32, device=DEV)
    _check_decode(q, k_cache, v_cache, lens, num_splits=9, sm_scale=0.2)


def test_decode_with_one_key_per_split():
    # The extreme num_splits == Tmax: every split of the longest sequence holds exactly one key.
    gen = torch.Generator().manual_seed(14)
    q = _rand(gen, 2, 4, 48, dtype=torch.float32)
    k_cache, v_cache = (_rand(gen, 2, 1, 23, 48, dtype=torch.float32) for _ in range(2))
    _check_decode(q, k_cache, v_cache, torch.tensor([23, 5], device=DEV), num_splits=23)


def test_decode_equals_flash_attention_on_the_last_token():
    # Decode is the Tq = 1 case of causal prefill: the same numbers by two different kernels.
    gen = torch.Generator().manual_seed(9)
    q = _rand(gen, 1, 4, 1, 64, dtype=torch.float32)
    k, v = (_rand(gen, 1, 2, 150, 64, dtype=torch.float32) for _ in range(2))
    dec = decode_attention(q[:, :, 0], k, v, torch.tensor([150], device=DEV), num_splits=4)
    _assert_close(dec, flash_attention(q, k, v, causal=True)[:, :, 0], torch.float32, "decode vs flash")


def test_decode_strided_cache_and_default_splits():
    # A cache preallocated as (B, Tmax, Hkv, D) and viewed as (B, Hkv, Tmax, D) has non-unit position strides.
    gen = torch.Generator().manual_seed(10)
    k_cache = _rand(gen, 2, 190, 2, 32, dtype=torch.float16).transpose(1, 2)
    v_cache = _rand(gen, 2, 190, 2, 32, dtype=torch.float16).transpose(1, 2)
    q = _rand(gen, 2, 4, 32, dtype=torch.float16)
    _check_decode(q, k_cache, v_cache, torch.tensor([190, 100], device=DEV), num_splits=None)


# --- one rule for every online-softmax merge: scores that are all -inf contribute nothing ---------------------
# Padded rows (query heads past the group, queries past Tq) load q = 0, and 0 * -inf = nan there; those rows are
# never stored, but the interpreter's NumPy matmul and max over them warn.
def _PADDED_ROWS_NAN(test):
    test = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")(test)
    return pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")(test)


def _minus_inf_keys(gen, dtype, B, hq, hkv, t, d, blocked):
    """q with positive entries and K whose keys in ``blocked[b]`` are -inf: those keys score exactly -inf."""
    q = _rand(gen, B, hq, d, dtype=dtype).abs() + 0.1
    k_cache = _rand(gen, B, hkv, t, d, dtype=dtype)
    v_cache = _rand(gen, B, hkv, t, d, dtype=dtype)
    for b, keys in enumerate(blocked):
        k_cache[b, :, keys] = float("-inf")
    return q, k_cache, v_cache


@_PADDED_ROWS_NAN
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_whose_scores_are_all_minus_inf_contributes_nothing(dtype):
    # Sequence 0: 64 keys in 4 splits of 16; keys 16..31 (exactly split 1) and 40..47 (the start of split 2)
    # score -inf. Before the fix the split kernel formed exp2(-inf - -inf) = nan and the whole row was NaN.
    # Sequence 1: every key scores -inf, so the row has no key at all: output 0, as in the reference.
    # Sequence 2: 3 keys and 4 splits (one split empty), the middle key -inf.
    gen = torch.Generator().manual_seed(18)
    blocked = [list(range(16, 32)) + list(range(40, 48)), list(range(64)), [1]]
    q, k_cache, v_cache = _minus_inf_keys(gen, dtype, 3, 4, 2, 64, 32, blocked)
    seq_lens = torch.tensor([64, 64, 3], device=DEV)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, seq_lens, num_splits=4, out=out)
    ref = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), seq_lens)
    assert not out.isnan().any(), "a split of -inf scores turned the output into NaN"
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a row with no finite score must give output 0"
    _assert_close(out, ref.to(dtype), dtype, "decode with -inf scores vs reference")


@pytest.mark.parametrize("tmax, lens", [(40, [1, 2, 3, 39]), (9, [1, 9])])
def test_decode_many_more_splits_than_keys(tmax, lens):
    # num_splits = Tmax: short sequences leave most splits empty (lse -inf), which must weigh nothing.
    gen = torch.Generator().manual_seed(19)
    B = len(lens)
    q = _rand(gen, B, 4, 16, dtype=torch.float32)
    k_cache, v_cache = (_rand(gen, B, 4, tmax, 16, dtype=torch.float32) for _ in range(2))
    _check_decode(q, k_cache, v_cache, torch.tensor(lens, device=DEV), num_splits=tmax)


@_PADDED_ROWS_NAN
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_minus_inf_scores_follow_the_same_rule(dtype):
    # The prefill kernel under the same rule: a key block of -inf scores adds nothing, a row whose every
    # score is -inf gives output 0 and log-sum-exp -inf (as the reference, and as a causal row with no key).
    gen = torch.Generator().manual_seed(20)
    q = _rand(gen, 2, 4, 70, 48, dtype=dtype).abs() + 0.1
    k, v = (_rand(gen, 2, 2, 150, 48, dtype=dtype) for _ in range(2))
    k[0, :, 64:128] = float("-inf")  # one whole key block (BLOCK_N = 64 under the interpreter)
    k[1] = float("-inf")  # batch row 1: no finite score at all
    out, lse = _run_flash(q, k, v, causal=False)
    ref_out, ref_lse = flash_attention_ref(q.double(), k.double(), v.double(), return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
    _assert_close(out, ref_out.to(dtype), dtype, "flash with -inf scores vs reference")
    _assert_close(lse, ref_lse, torch.float32, "flash lse with -inf scores vs reference")


# --- memory layout: every tensor the kernels read, index tensors included ---------------------------------------
def _int32_views(values):
    """The same int32 lengths as four different memory layouts: packed, sliced, a column of a matrix, expanded."""
    n = len(values)
    packed = torch.tensor(values, dtype=torch.int32, device=DEV)
    sliced = torch.stack([packed, torch.full_like(packed, 10**6)], dim=1).flatten()[::2]  # stride 2
    column = torch.stack([packed, packed + 10**6]).t()[:, 0]  # a transposed matrix's column: stride 2
    views = dict(packed=packed, sliced=sliced, column=column)
    if len(set(values)) == 1:  # one length for every sequence, written once and expanded: stride 0
        views["expanded"] = torch.tensor([values[0]], dtype=torch.int32, device=DEV).expand(n)
    for name, view in views.items():
        assert view.tolist() == list(values), name
    return views


@pytest.mark.parametrize("layout", ["packed", "sliced", "column", "expanded"])
def test_decode_reads_seq_lens_by_value_whatever_its_layout(layout):
    # Before the fix an int32 view went to the kernel as it was (`.to(int32)` keeps it): a sliced view was read
    # as [3, 1e6, ...] and an expanded one past its single element.
    gen = torch.Generator().manual_seed(15)
    values = [37, 37, 37] if layout == "expanded" else [37, 5, 64]
    seq_lens = _int32_views(values)[layout]
    q = _rand(gen, 3, 4, 48, dtype=torch.float32)
    k_cache, v_cache = (_rand(gen, 3, 2, 64, 48, dtype=torch.float32) for _ in range(2))
    _check_decode(q, k_cache, v_cache, seq_lens, num_splits=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_expanded_and_sliced_inputs(dtype):
    # One prompt's cache shared by a batch (expand over batch and K/V heads: stride 0), queries sliced out of a
    # wider tensor, lengths from a transposed matrix: all read by value, compared with the reference.
    gen = torch.Generator().manual_seed(16)
    k_one, v_one = (_rand(gen, 1, 1, 70, 32, dtype=dtype) for _ in range(2))
    k_cache, v_cache = k_one.expand(3, 2, 70, 32), v_one.expand(3, 2, 70, 32)
    q = _rand(gen, 3, 8, 32, dtype=dtype)[:, ::2]  # (3, 4, 32), head stride 2 * D
    seq_lens = _int32_views([70, 9, 41])["column"]
    out = torch.full((3, 4, 32), float("nan"), dtype=dtype, device=DEV)
    decode_attention(q, k_cache, v_cache, seq_lens, num_splits=4, out=out)
    ref = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), seq_lens)
    _assert_close(out, ref.to(dtype), dtype, "decode with expanded/sliced inputs vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_with_expanded_and_sliced_inputs(dtype):
    gen = torch.Generator().manual_seed(17)
    q = _rand(gen, 2, 4, 2 * 45, 48, dtype=dtype)[:, :, ::2]  # every other position: stride 2 * D
    k = _rand(gen, 1, 1, 33, 48, dtype=dtype).expand(2, 2, 33, 48)  # one K shared by batch and heads
    v = _rand(gen, 2, 33, 2, 48, dtype=dtype).transpose(1, 2)
    _check_flash(q, k, v, causal=True)
    _check_flash(q, k, v, causal=False, sm_scale=0.3)


def test_expanded_outputs_are_refused():
    # Writing through a stride-0 view would make several outputs share one memory location.
    with pytest.raises(ValueError, match="out must not be an expanded view"):
        flash_attention(**_flash_args(out=torch.zeros(1, 4, 5, 32).expand(2, 4, 5, 32)))
    with pytest.raises(ValueError, match="lse_out must not be an expanded view"):
        flash_attention(**_flash_args(lse_out=torch.zeros(1, 4, 5).expand(2, 4, 5)), return_lse=True)
    with pytest.raises(ValueError, match="out must not be an expanded view"):
        decode_attention(**_decode_args(out=torch.zeros(2, 1, 32).expand(2, 4, 32)))


# --- the backward pass -----------------------------------------------------------------------------------------
@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Make every torch.empty_like in the kernel module return NaN, so a gradient element (or a delta) the
    backward kernels forget to write fails the comparison instead of passing with leftover memory."""
    real = torch.empty_like

    def nan_like(t, *args, **kwargs):
        buf = real(t, *args, **kwargs)
        return buf.fill_(float("nan")) if buf.is_floating_point() else buf

    monkeypatch.setattr(torch, "empty_like", nan_like)


def _grad_bounds(dout, q, k, v, causal, sm_scale=None):
    """The size of what each gradient element sums (float64; see flash_attention_backward_ref's
    return_bounds): the scale its rounding error is relative to, since the sums cancel."""
    return flash_attention_backward_ref(dout.double(), q.double(), k.double(), v.double(), causal=causal,
                                        sm_scale=sm_scale, return_bounds=True)[1]


def _assert_grad_close(got, truth, bound, dtype, what):
    rtol, atol = tolerance(dtype)
    err = (got.double() - truth.to(dtype).double()).abs()
    allowed = atol + rtol * (bound + truth.abs())
    worst = int((err - allowed).argmax())
    assert bool((err <= allowed).all()), (
        f"{what}: {int((err > allowed).sum())} of {err.numel()} elements off; worst error "
        f"{err.flatten()[worst]:.3g} where {allowed.flatten()[worst]:.3g} is allowed (rtol={rtol}, atol={atol})")


def _kernel_grads(q, k, v, dout, causal, sm_scale=None):
    """Gradients through flash_attention's autograd path, on leaf copies that keep q/k/v's strides."""
    leaves = [t.detach().clone().requires_grad_() if t.is_contiguous() else
              t.detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, sm_scale=sm_scale)
    assert out.requires_grad and out.grad_fn is not None, "flash_attention returned a tensor without a graph"
    out.backward(dout)
    return [t.grad for t in leaves]


def _sdpa_grads(q, k, v, dout, causal, sm_scale):
    """SDPA's gradients in float64 (GQA via enable_gqa). Its is_causal is top-left aligned, so it is used for
    Tq == Tk; Tq < Tk uses an explicit bottom-right mask. Causal Tq > Tk has rows with no key, which SDPA turns
    into NaN: None there (the reference covers it)."""
    tq, tk = q.shape[2], k.shape[2]
    if causal and tq > tk:
        return None
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if causal and tq == tk:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=sm_scale, enable_gqa=True)
    else:
        mask = _bottom_right_mask(tq, tk) if causal else None
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    out.backward(dout.double())
    return [t.grad for t in leaves]


def _check_grads(q, k, v, causal, sm_scale=None, dout=None, seed=0):
    dtype = q.dtype
    if dout is None:
        dout = _rand(torch.Generator().manual_seed(seed), *q.shape, dtype=dtype)
    got = _kernel_grads(q, k, v, dout, causal, sm_scale)
    truth = flash_attention_backward_ref(dout.double(), q.double(), k.double(), v.double(), causal=causal,
                                         sm_scale=sm_scale)
    sdpa = _sdpa_grads(q, k, v, dout, causal, sm_scale)
    bounds = _grad_bounds(dout, q, k, v, causal, sm_scale)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert got[i].shape == (q, k, v)[i].shape and got[i].dtype == dtype
        assert not got[i].isnan().any(), f"{name} has NaN (an element left unwritten?)"
        _assert_grad_close(got[i], truth[i], bounds[i], dtype, f"{name} vs reference")
        if sdpa is not None:
            _assert_grad_close(got[i], sdpa[i], bounds[i], dtype, f"{name} vs SDPA")
    return got


BWD_DIMS = dict(
    batch=[1, 2, 3],
    heads=[(1, 1), (4, 1), (6, 2), (8, 2)],
    tq=[1, 17, 63, 129],
    tk=[1, 17, 63, 129],
    d=[16, 32, 48, 64, 80, 96, 128],
    causal=[False, True],
    dtype=DTYPES,
)
BWD_CASES = _cover(BWD_DIMS, n=14, seed=2025)


@pytest.mark.parametrize("index", range(len(BWD_CASES)), ids=[_case_id(c) for c in BWD_CASES])
def test_flash_attention_gradients_match_reference_and_sdpa(index, poisoned_buffers):
    case = BWD_CASES[index]
    gen = torch.Generator().manual_seed(3000 + index)
    (hq, hkv), dtype = case["heads"], case["dtype"]
    q = _rand(gen, case["batch"], hq, case["tq"], case["d"], dtype=dtype)
    k = _rand(gen, case["batch"], hkv, case["tk"], case["d"], dtype=dtype)
    v = _rand(gen, case["batch"], hkv, case["tk"], case["d"], dtype=dtype)
    _check_grads(q, k, v, case["causal"], seed=index)


def test_backward_grid_covers_every_listed_value():
    for name, values in BWD_DIMS.items():
        assert {repr(c[name]) for c in BWD_CASES} == {repr(v) for v in values}, name
    assert any(c["causal"] and c["tq"] < c["tk"] for c in BWD_CASES), "no causal case with Tq < Tk"
    assert any(c["causal"] and c["tq"] > c["tk"] for c in BWD_CASES), "no causal case with empty rows"


def test_backward_reference_equals_autograd_of_the_forward_reference():
    # The hand-written formulas against autograd through flash_attention_ref, in float64, GQA and causal with
    # empty rows; and gradcheck (finite differences) on the reference itself.
    gen = torch.Generator().manual_seed(23)
    q = _rand(gen, 2, 4, 9, 16, dtype=torch.float64).requires_grad_()
    k, v = (_rand(gen, 2, 2, 6, 16, dtype=torch.float64).requires_grad_() for _ in range(2))
    dout = _rand(gen, 2, 4, 9, 16, dtype=torch.float64)
    for causal in (False, True):
        flash_attention_ref(q, k, v, causal=causal, sm_scale=0.3).backward(dout)
        by_hand = flash_attention_backward_ref(dout, q.detach(), k.detach(), v.detach(), causal=causal, sm_scale=0.3)
        for mine, auto in zip(by_hand, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(mine, auto, rtol=1e-12, atol=1e-12)
        q.grad = k.grad = v.grad = None
    small = [t.detach()[:1, :, :4].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attention_ref(a, b, c, causal=True), small)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_rows_without_keys_get_zero_gradient(dtype, poisoned_buffers):
    # Causal, Tq > Tk: the first Tq - Tk rows see no key, so they neither receive nor pass on any gradient.
    gen = torch.Generator().manual_seed(24)
    q = _rand(gen, 1, 4, 90, 48, dtype=dtype)
    k, v = (_rand(gen, 1, 2, 20, 48, dtype=dtype) for _ in range(2))
    dq, dk, dv = _check_grads(q, k, v, causal=True, seed=24)
    assert torch.equal(dq[:, :, :70], torch.zeros_like(dq[:, :, :70]))
    # Those rows' dO must not leak into dK/dV: poisoning it with huge values changes nothing.
    dout = _rand(torch.Generator().manual_seed(24), 1, 4, 90, 48, dtype=dtype)
    loud = dout.clone()
    loud[:, :, :70] = 1e4
    _, dk2, dv2 = _kernel_grads(q, k, v, loud, causal=True)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_with_strided_expanded_inputs_and_custom_scale(dtype):
    # HF-style transpose(1, 2) views for q and v, one K expanded over the batch (its gradient is summed back
    # through the expand by autograd), a custom scale, bottom-right causal with Tq < Tk.
    gen = torch.Generator().manual_seed(25)
    q = _rand(gen, 2, 33, 6, 80, dtype=dtype).transpose(1, 2).requires_grad_()
    k_one = _rand(gen, 1, 3, 50, 80, dtype=dtype).requires_grad_()
    v = _rand(gen, 2, 50, 3, 80, dtype=dtype).transpose(1, 2).requires_grad_()
    k = k_one.expand(2, 3, 50, 80)
    dout = _rand(gen, 2, 6, 33, 80, dtype=dtype)
    flash_attention(q, k, v, causal=True, sm_scale=0.2).backward(dout)
    dq, dk, dv = flash_attention_backward_ref(dout.double(), q.double(), k.double(), v.double(), causal=True,
                                              sm_scale=0.2)
    bq, bk, bv = _grad_bounds(dout, q, k, v, causal=True, sm_scale=0.2)
    _assert_grad_close(q.grad, dq, bq, dtype, "dq")
    _assert_grad_close(k_one.grad, dk.sum(0, keepdim=True), bk.sum(0, keepdim=True), dtype, "dk through expand")
    _assert_grad_close(v.grad, dv, bv, dtype, "dv")


def test_backward_reads_an_expanded_incoming_gradient():
    # out.sum() hands the backward a stride-0 (expanded) dO: it must be read by value, not as packed memory.
    gen = torch.Generator().manual_seed(26)
    q = _rand(gen, 2, 4, 21, 32, dtype=torch.float32).requires_grad_()
    k, v = (_rand(gen, 2, 2, 30, 32, dtype=torch.float32).requires_grad_() for _ in range(2))
    flash_attention(q, k, v, causal=True).sum().backward()
    ones = torch.ones(2, 4, 21, 32, dtype=torch.float64)
    truth = flash_attention_backward_ref(ones, q.double(), k.double(), v.double(), causal=True)
    bounds = _grad_bounds(ones, q, k, v, causal=True)
    for got, want, bound, name in zip((q.grad, k.grad, v.grad), truth, bounds, "qkv"):
        _assert_grad_close(got, want, bound, torch.float32, f"d{name} of out.sum()")


def test_backward_only_for_inputs_that_require_grad():
    gen = torch.Generator().manual_seed(27)
    q = _rand(gen, 1, 2, 12, 32, dtype=torch.float32).requires_grad_()
    k, v = (_rand(gen, 1, 2, 12, 32, dtype=torch.float32) for _ in range(2))
    flash_attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None
    ones = torch.ones(1, 2, 12, 32)
    _assert_grad_close(q.grad, flash_attention_backward_ref(ones.double(), q.double(), k.double(), v.double())[0],
                       _grad_bounds(ones, q, k, v, causal=False)[0], torch.float32, "dq")
    # No input requires grad, or grad mode is off: the plain forward, no graph.
    assert flash_attention(q.detach(), k, v).grad_fn is None
    with torch.no_grad():
        assert flash_attention(q, k, v).grad_fn is None
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert out.grad_fn is not None and not lse.requires_grad  # lse carries no gradient


def test_flash_attention_backward_called_directly_equals_autograd():
    gen = torch.Generator().manual_seed(28)
    q = _rand(gen, 2, 4, 19, 48, dtype=torch.float16)
    k, v = (_rand(gen, 2, 1, 40, 48, dtype=torch.float16) for _ in range(2))
    dout = _rand(gen, 2, 4, 19, 48, dtype=torch.float16)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    direct = flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    for a, b in zip(direct, _kernel_grads(q, k, v, dout, causal=True)):
        assert torch.equal(a, b)


def test_backward_is_deterministic():
    # No atomics: dK/dV sum the GQA group inside one program and dQ has its own kernel, so two runs agree bit
    # for bit (on a GPU too, where atomic adds would make the order of the sums vary from run to run).
    gen = torch.Generator().manual_seed(29)
    q = _rand(gen, 2, 8, 45, 64, dtype=torch.float16)
    k, v = (_rand(gen, 2, 2, 70, 64, dtype=torch.float16) for _ in range(2))
    dout = _rand(gen, 2, 8, 45, 64, dtype=torch.float16)
    first, second = (_kernel_grads(q, k, v, dout, causal=True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_autograd_refusals():
    args = _flash_args()
    args["q"].requires_grad_()
    with pytest.raises(ValueError, match="out and lse_out cannot be used when q, k or v require grad"):
        flash_attention(**args, out=torch.empty(2, 4, 5, 32))
    dargs = _decode_args()
    dargs["k_cache"].requires_grad_()
    with pytest.raises(ValueError, match="decode_attention is inference-only"):
        decode_attention(**dargs)
    with torch.no_grad():  # inference under no_grad is fine: no graph is being recorded
        decode_attention(**dargs)


BWD_ERRORS = [
    (dict(dout=torch.zeros(2, 4, 5)), ValueError, r"dout must have 4 dimensions \(B, Hq, Tq, D\)"),
    (dict(dout=torch.zeros(2, 4, 6, 32)), ValueError, r"dout must have the shape of q \(2, 4, 5, 32\)"),
    (dict(dout=torch.zeros(2, 4, 5, 32, dtype=torch.float16)), TypeError, "dout must have the same dtype as q"),
    (dict(dout=torch.zeros(2, 4, 5, 32, device="meta")), ValueError, "dout must be on the same device as q"),
    (dict(out=torch.zeros(2, 4, 5, 16)), ValueError, r"out must have shape \(2, 4, 5, 32\)"),
    (dict(lse=torch.zeros(2, 4, 6)), ValueError, r"lse must be float32 of shape \(2, 4, 5\)"),
    (dict(lse=torch.zeros(2, 4, 5, dtype=torch.float64)), ValueError, "lse must be float32"),
    (dict(sm_scale=-2.0), ValueError, "sm_scale must be a finite positive number"),
]


@pytest.mark.parametrize("change, error, message", BWD_ERRORS, ids=[m for _, _, m in BWD_ERRORS])
def test_flash_attention_backward_error_messages(change, error, message):
    args = _flash_args()
    args.update(dout=torch.zeros(2, 4, 5, 32), out=torch.zeros(2, 4, 5, 32), lse=torch.zeros(2, 4, 5))
    args.update(change)
    with pytest.raises(error, match=message):
        flash_attention_backward(**args)




# No shrinking phase: under the interpreter shrinking a failure can take many minutes; the failing example
# is printed as it was generated.
@settings(max_examples=15, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(batch=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), hkv=st.integers(1, 2), tq=st.integers(1, 80),
       tk=st.integers(1, 80), d=st.sampled_from([16, 24, 48, 80, 96, 128]), causal=st.booleans(),
       dtype=st.sampled_from(DTYPES), scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
# A large scale in fp16 (scores of std ~17): once failed a bound that ignored the cancellation inside delta.
@example(batch=1, group=2, hkv=2, tq=39, tk=74, d=96, causal=False, dtype=torch.float16, scale=1.7155596532073203,
         transposed=False, seed=170)
def test_property_gradients_match_reference(batch, group, hkv, tq, tk, d, causal, dtype, scale, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (batch, hkv * group, tq, d), (batch, hkv, tk, d)
    if transposed:  # (B, T, H, D) storage viewed as (B, H, T, D), as Hugging Face models pass them
        q = _rand(gen, batch, tq, hkv * group, d, dtype=dtype).transpose(1, 2)
        k, v = (_rand(gen, batch, tk, hkv, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    else:
        q = _rand(gen, *shape_q, dtype=dtype)
        k, v = (_rand(gen, *shape_kv, dtype=dtype) for _ in range(2))
    dout = _rand(gen, *shape_q, dtype=dtype)
    got = _kernel_grads(q, k, v, dout, causal, scale)
    truth = flash_attention_backward_ref(dout.double(), q.double(), k.double(), v.double(), causal=causal,
                                         sm_scale=scale)
    bounds = _grad_bounds(dout, q, k, v, causal, scale)
    for g, t, bound, name in zip(got, truth, bounds, ("dq", "dk", "dv")):
        _assert_grad_close(g, t, bound, dtype, name)


# --- every error message -------------------------------------------------------------------------------------
def _flash_args(**change):
    gen = torch.Generator().manual_seed(11)
    args = dict(q=_rand(gen, 2, 4, 5, 32, dtype=torch.float32), k=_rand(gen, 2, 2, 7, 32, dtype=torch.float32),
                v=_rand(gen, 2, 2, 7, 32, dtype=torch.float32))
    args.update(change)
    return args


FLASH_ERRORS = [
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(k=torch.zeros(2, 7, 32)), ValueError, r"k must have 4 dimensions \(B, Hkv, Tk, D\)"),
    (dict(v=torch.zeros(2, 2, 7, 32, 1)), ValueError, "v must have 4 dimensions"),
    (dict(q=torch.zeros(2, 4, 5, 32, dtype=torch.float64)), TypeError, "q must be float32, float16 or bfloat16"),
    (dict(k=torch.zeros(2, 2, 7, 32, dtype=torch.float16)), TypeError, "k must have the same dtype as q"),
    (dict(v=torch.zeros(2, 2, 7, 32, dtype=torch.bfloat16)), TypeError, "v must have the same dtype as q"),
    (dict(k=torch.zeros(2, 2, 7, 32, device="meta")), ValueError, "k must be on the same device as q"),
    (dict(q=torch.zeros(2, 4, 5, 32, device="meta"), k=torch.zeros(2, 2, 7, 32, device="meta"),
          v=torch.zeros(2, 2, 7, 32, device="meta")), ValueError, "q must hold data"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale must be a real number or None"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale must be a finite positive number"),
    (dict(sm_scale=float("inf")), ValueError, "sm_scale must be a finite positive number"),
    (dict(v=torch.zeros(2, 2, 8, 32)), ValueError, r"v must have the same shape as k \(2, 2, 7, 32\)"),
    (dict(k=torch.zeros(3, 2, 7, 32), v=torch.zeros(3, 2, 7, 32)), ValueError, r"k must have the same batch size as q \(2\)"),
    (dict(k=torch.zeros(2, 2, 7, 48), v=torch.zeros(2, 2, 7, 48)), ValueError, r"k must have the same head dim as q \(32\)"),
    (dict(k=torch.zeros(2, 2, 0, 32), v=torch.zeros(2, 2, 0, 32)), ValueError, "q and k must be non-empty"),
    (dict(k=torch.zeros(2, 3, 7, 32), v=torch.zeros(2, 3, 7, 32)), ValueError, "Hq=4 must be a multiple of k's heads Hkv=3"),
    (dict(q=torch.zeros(2, 4, 5, 8), k=torch.zeros(2, 2, 7, 8), v=torch.zeros(2, 2, 7, 8)), ValueError, "head dim D=8 is not supported"),
    (dict(q=torch.zeros(2, 4, 5, 256), k=torch.zeros(2, 2, 7, 256), v=torch.zeros(2, 2, 7, 256)), ValueError, "head dim D=256"),
    (dict(q=torch.zeros(2, 4, 32, 5).transpose(-1, -2)), ValueError, "q must be contiguous in its last"),
    (dict(v=torch.zeros(2, 2, 32, 7).transpose(-1, -2)), ValueError, "v must be contiguous in its last"),
    (dict(out=torch.zeros(2, 4, 5, 32).numpy()), TypeError, "out must be a torch.Tensor or None"),
    (dict(out=torch.zeros(2, 4, 6, 32)), ValueError, r"out must have shape \(2, 4, 5, 32\)"),
    (dict(out=torch.zeros(2, 4, 5, 32, device="meta")), ValueError, "out must be on the same device as q"),
    (dict(out=torch.zeros(2, 4, 32, 5).transpose(-1, -2)), ValueError, "out must be contiguous in its last"),
    (dict(out=torch.zeros(2, 4, 5, 32, dtype=torch.float16)), TypeError, "out must have the same dtype as q"),
    (dict(lse_out=torch.zeros(2, 4, 6)), ValueError, r"lse_out must have shape \(2, 4, 5\)"),
    (dict(lse_out=torch.zeros(2, 4, 5, dtype=torch.float16)), TypeError, "lse_out must be float32"),
    (dict(return_lse=None), TypeError, "return_lse must be a bool"),
]


@pytest.mark.parametrize("change, error, message", FLASH_ERRORS, ids=[m for _, _, m in FLASH_ERRORS])
def test_flash_attention_error_messages(change, error, message):
    with pytest.raises(error, match=message):
        flash_attention(**_flash_args(**change))


def _decode_args(**change):
    gen = torch.Generator().manual_seed(12)
    args = dict(q=_rand(gen, 2, 4, 32, dtype=torch.float32), k_cache=_rand(gen, 2, 2, 10, 32, dtype=torch.float32),
                v_cache=_rand(gen, 2, 2, 10, 32, dtype=torch.float32), seq_lens=torch.tensor([3, 10]))
    args.update(change)
    return args


DECODE_ERRORS = [
    (dict(q=torch.zeros(2, 4, 1, 32)), ValueError, r"q must have 3 dimensions \(B, Hq, D\)"),
    (dict(k_cache=None), TypeError, "k_cache must be a torch.Tensor"),
    (dict(v_cache=torch.zeros(2, 10, 32)), ValueError, "v_cache must have 4 dimensions"),
    (dict(seq_lens=torch.tensor(3)), ValueError, r"seq_lens must have 1 dimensions \(B,\)"),
    (dict(q=torch.zeros(2, 4, 32, dtype=torch.int8)), TypeError, "q must be float32, float16 or bfloat16"),
    (dict(k_cache=torch.zeros(2, 2, 10, 32, dtype=torch.float16)), TypeError, "k_cache must have the same dtype as q"),
    (dict(v_cache=torch.zeros(2, 2, 10, 32, dtype=torch.bfloat16)), TypeError, "v_cache must have the same dtype"),
    (dict(seq_lens=torch.tensor([3.0, 10.0])), TypeError, "seq_lens must be int32 or int64"),
    (dict(seq_lens=torch.tensor([3, 10], device="meta")), ValueError, "seq_lens must be on the same device as q"),
    (dict(sm_scale=0), ValueError, "sm_scale must be a finite positive number"),
    (dict(v_cache=torch.zeros(2, 2, 11, 32)), ValueError, "v_cache must have the same shape as k_cache"),
    (dict(k_cache=torch.zeros(1, 2, 10, 32), v_cache=torch.zeros(1, 2, 10, 32)), ValueError, "k_cache must have the same batch size"),
    (dict(k_cache=torch.zeros(2, 2, 10, 16), v_cache=torch.zeros(2, 2, 10, 16)), ValueError, "k_cache must have the same head dim"),
    (dict(k_cache=torch.zeros(2, 2, 0, 32), v_cache=torch.zeros(2, 2, 0, 32)), ValueError, "q and k_cache must be non-empty"),
    (dict(k_cache=torch.zeros(2, 3, 10, 32), v_cache=torch.zeros(2, 3, 10, 32)), ValueError, "Hkv=3"),
    (dict(q=torch.zeros(2, 4, 136), k_cache=torch.zeros(2, 2, 10, 136), v_cache=torch.zeros(2, 2, 10, 136)), ValueError, "head dim D=136"),
    (dict(k_cache=torch.zeros(2, 2, 32, 10).transpose(-1, -2)), ValueError, "k_cache must be contiguous in its last"),
    (dict(seq_lens=torch.tensor([3, 10, 4])), ValueError, r"seq_lens must have one length per sequence, shape \(2,\)"),
    (dict(seq_lens=torch.tensor([0, 10])), ValueError, r"seq_lens must lie in \[1, Tmax=10\], got values from 0 to 10"),
    (dict(seq_lens=torch.tensor([3, 11])), ValueError, r"seq_lens must lie in \[1, Tmax=10\]"),
    (dict(num_splits=2.0), TypeError, "num_splits must be an int or None"),
    (dict(num_splits=0), ValueError, r"num_splits must lie in \[1, Tmax=10\]"),
    (dict(num_splits=11), ValueError, r"num_splits must lie in \[1, Tmax=10\]"),
    (dict(out=torch.zeros(2, 4, 31)), ValueError, r"out must have shape \(2, 4, 32\)"),
    (dict(out=torch.zeros(2, 4, 32, dtype=torch.float16)), TypeError, "out must have the same dtype as q"),
]


@pytest.mark.parametrize("change, error, message", DECODE_ERRORS, ids=[m for _, _, m in DECODE_ERRORS])
def test_decode_attention_error_messages(change, error, message):
    with pytest.raises(error, match=message):
        decode_attention(**_decode_args(**change))


# --- launch limits: refused up front with the limit in the message, or handled by looping -----------------------


@pytest.mark.parametrize("sm_scale, error, message", [
    (float("nan"), ValueError, "sm_scale must be a finite positive number"),
    (np.float32("nan"), ValueError, "sm_scale must be a finite positive number"),
    (-0.0, ValueError, "sm_scale must be a finite positive number"),
    (1e39, ValueError, "product with log2\\(e\\) is a normal float32"),  # inf once it is a float32
    (1e-40, ValueError, "product with log2\\(e\\) is a normal float32"),  # a float32 subnormal
    (True, TypeError, "sm_scale must be a real number or None, got bool"),
    (torch.tensor(0.5), TypeError, "sm_scale must be a real number or None, got Tensor"),
])
def test_sm_scale_must_be_a_finite_positive_float32(sm_scale, error, message):
    with pytest.raises(error, match=message):
        flash_attention(**_flash_args(sm_scale=sm_scale))
    with pytest.raises(error, match=message):
        decode_attention(**_decode_args(sm_scale=sm_scale))


def test_sm_scale_at_the_edges_of_float32_is_accepted():
    gen = torch.Generator().manual_seed(21)
    q, k, v = (_rand(gen, 1, 2, 9, 16, dtype=torch.float32) for _ in range(3))
    for scale in (np.float64(0.25), 1e-30, 1e30 / 64):  # numpy numbers count as real numbers
        _check_flash(q, k * 1e-30 if scale > 1 else k, v, causal=True, sm_scale=float(scale))


def test_num_splits_beyond_the_merge_kernels_tile_is_refused():
    args = _decode_args(k_cache=torch.zeros(2, 2, 300, 32), v_cache=torch.zeros(2, 2, 300, 32))
    with pytest.raises(ValueError, match=r"num_splits=257 exceeds the merge kernel's limit of 256 splits"):
        decode_attention(**args, num_splits=257)


def test_decode_group_beyond_one_tile_is_refused():
    args = _decode_args(q=torch.zeros(2, 258, 32))  # 129 query heads per K/V head
    with pytest.raises(ValueError, match=r"at most 128 query heads per K/V head \(Hq // Hkv\), got Hq=258"):
        decode_attention(**args)
    decode_attention_ref(**args)  # a launch limit of the kernel, not a rule of attention


def test_heads_beyond_the_grid_axis_limit_are_refused(monkeypatch):
    # The real limit is 65535 programs on grid axis 1; lower it so that the check runs at a testable size.
    monkeypatch.setattr(attention_module.common, "GRID_AXIS_LIMIT", 3)
    with pytest.raises(ValueError, match="Hq=4 heads exceed the launch limit of 3 programs on grid axis 1"):
        flash_attention(**_flash_args())
    flash_attention_ref(**_flash_args())


@pytest.mark.parametrize("limit", [4, 9])
def test_batch_beyond_the_grid_axis_limit_is_launched_in_chunks(monkeypatch, limit):
    # B * Hq = 5 * 4 = 20 programs on axis 1 against a limit of 4 (one sequence per launch) or 9 (two, then a
    # ragged last chunk): every chunk must land in its own slice of out and lse.
    monkeypatch.setattr(attention_module.common, "GRID_AXIS_LIMIT", limit)
    gen = torch.Generator().manual_seed(22)
    q = _rand(gen, 5, 4, 19, 32, dtype=torch.float32)
    k, v = (_rand(gen, 5, 2, 23, 32, dtype=torch.float32) for _ in range(2))
    _check_flash(q, k, v, causal=True)


def test_tensors_beyond_32_bit_offsets_are_refused(monkeypatch):
    # Offsets inside one (batch, head) slice are 32-bit in the kernels; a real case needs > 8 GB of memory,
    # so lower the limit to test the check.
    monkeypatch.setattr(attention_module.common, "MAX_INT32_OFFSET", 200)  # q spans 159, k 223
    with pytest.raises(ValueError, match=r"k spans 223 elements inside one \(batch, head\) slice .* at most 200"):
        flash_attention(**_flash_args())
    with pytest.raises(ValueError, match=r"k_cache spans 319 elements .* at most 200"):
        decode_attention(**_decode_args())


@settings(max_examples=25, deadline=None)
@given(sm_scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([1e-39, 1e-38, 2e38, 3e38])),  # around float32's limits
       num_splits=st.integers(-3, 300))
def test_property_bad_scalar_arguments_raise_the_documented_error(sm_scale, num_splits):
    # Random sm_scale and num_splits: each is accepted exactly when the documented rule says so, and refused
    # with the documented message otherwise (checked without launching: the checks run before any kernel).
    fp32 = torch.finfo(torch.float32)
    scale_ok = (math.isfinite(sm_scale) and sm_scale > 0
                and fp32.tiny <= sm_scale * attention_module.LOG2E <= fp32.max)
    splits_ok = 1 <= num_splits <= min(260, attention_module.MAX_NUM_SPLITS)
    args = _decode_args(k_cache=torch.zeros(2, 2, 260, 32), v_cache=torch.zeros(2, 2, 260, 32))
    call = lambda: attention_module._check_decode_args(**args, sm_scale=sm_scale, num_splits=num_splits, out=None)
    if scale_ok and splits_ok:
        call()
    else:
        message = "num_splits" if scale_ok else "sm_scale must be a finite positive number"
        with pytest.raises(ValueError, match=message):
            call()


def test_compiled_kernels_refuse_cpu_tensors(monkeypatch):
    # Only reachable on a GPU box; pretend the kernels are compiled to test the message on the CPU too.
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    with pytest.raises(ValueError, match="q must be on a CUDA device for the compiled Triton kernels"):
        flash_attention(**_flash_args())
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        decode_attention(**_decode_args())


def test_references_check_their_arguments_too():
    with pytest.raises(ValueError, match="Hq=4 must be a multiple"):
        flash_attention_ref(**_flash_args(k=torch.zeros(2, 3, 7, 32), v=torch.zeros(2, 3, 7, 32)))
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, Tmax=10\]"):
        decode_attention_ref(**_decode_args(seq_lens=torch.tensor([0, 4])))


# The GPU path compiles, even without a GPU: tests/test_gpucheck.py compiles every kernel of labsrc.kernels,
# these included, for sm_80 and sm_90 in each autotune configuration (python -m labsrc.gpucheck --compile-only).
