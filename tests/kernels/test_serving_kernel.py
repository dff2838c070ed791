"""Paged attention against dense attention over the gathered keys: random block tables (shuffled, shared between
sequences, partly filled last blocks), block sizes 1, 16 and 32, every dtype, strided views, NaN-poisoned
outputs, the chunked-prefill path, each error message, and hypothesis properties."""
import labsrc  # noqa: F401

import pytest
import torch
from hypothesis import given, settings, strategies as st

from labsrc.kernels.flash_attention import decode_attention_ref, flash_attention_ref
from labsrc.kernels.serving import (gather_kv, paged_decode_attention, paged_decode_attention_ref,
                                            paged_prefill_attention, paged_prefill_attention_ref)
from labsrc.exercises.core import tolerance

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_case(seed, lens, page, hq=8, hkv=2, d=40, extra_blocks=3, shared=False, dtype=torch.float32):
    """Pools with random contents and one block table per sequence, drawn from a shuffled pool; with
    ``shared`` every sequence's first block is the same one (a shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in lens]
    num_blocks = sum(need) + extra_blocks
    k_pool = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1
    tables = torch.full((len(lens), width), -7, dtype=torch.int32)  # padding past a table's blocks: never read
    at = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = torch.tensor(order[at:at + nb])
        at += nb
    if shared:
        tables[:, 0] = tables[0, 0]
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(lens)


def dense_truth(q, k_pool, v_pool, tables, lens):
    """Chapter 3's dense decode reference on the keys gathered into one padded cache (float64)."""
    tmax = int(lens.max())
    hkv, d = k_pool.shape[2:]
    k = torch.zeros(len(lens), hkv, tmax, d, dtype=torch.float64)
    v = torch.zeros_like(k)
    for b, n in enumerate(lens.tolist()):
        kb, vb = gather_kv(k_pool.double(), v_pool.double(), tables[b], n)
        k[b, :, :n], v[b, :, :n] = kb, vb
    return decode_attention_ref(q.double(), k, v, lens)


def assert_close(got, truth, dtype):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.double(), truth, rtol=rtol, atol=atol)


@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_dense_attention_on_shuffled_partly_filled_tables(page, dtype):
    q, kp, vp, tables, lens = make_case(page, [1, 37, 70], page, dtype=dtype)
    truth = dense_truth(q, kp, vp, tables, lens)
    out = paged_decode_attention(q, kp, vp, tables, lens, out=torch.full_like(q, float("nan")))
    assert_close(out, truth, dtype)
    assert_close(paged_decode_attention_ref(q, kp, vp, tables, lens), truth, dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_shared_blocks_gqa_groups_and_splits(splits):
    for hq, hkv in ((8, 8), (6, 2), (8, 1)):
        q, kp, vp, tables, lens = make_case(splits + hq, [20, 33, 5], 4, hq=hq, hkv=hkv, d=48, shared=True)
        out = paged_decode_attention(q, kp, vp, tables, lens, num_splits=splits)
        assert_close(out, dense_truth(q, kp, vp, tables, lens), torch.float32)


def test_strided_views_of_every_input_are_read_right():
    q, kp, vp, tables, lens = make_case(3, [9, 17], 4)
    wide = torch.zeros(kp.shape[0], kp.shape[1], kp.shape[2] + 1, kp.shape[3])
    wide[:, :, :-1] = kp
    kp_view = wide[:, :, :-1]  # a non-contiguous pool view
    q_view = torch.cat([q, q], 1)[:, ::2]
    tables_t = tables.t().contiguous().t()  # column-major
    lens_view = torch.stack([lens, lens], 1)[:, 0]
    out = paged_decode_attention(q_view, kp_view, vp, tables_t, lens_view)
    assert_close(out, dense_truth(q_view.contiguous(), kp, vp, tables, lens), torch.float32)


def test_expanded_query_and_sm_scale():
    q, kp, vp, tables, lens = make_case(4, [12, 3], 16)
    qe = q[:1].expand(2, -1, -1)
    out = paged_decode_attention(qe, kp, vp, tables, lens, sm_scale=0.3)
    ref = paged_decode_attention_ref(qe.double(), kp.double(), vp.double(), tables, lens, sm_scale=0.3)
    assert_close(out, ref, torch.float32)


# The interpreter's NumPy matmul warns on the -inf keys (as in tests/kernels/test_flash_attention_kernel.py); the results are
# what the rule defines, checked below.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_minus_inf_keys_contribute_nothing_and_an_all_minus_inf_row_gives_zero():
    q, kp, vp, tables, lens = make_case(5, [8, 8], 4)
    kp[tables[0, 1]] = float("-inf")  # the second block of sequence 0: its scores are -inf (or nan)
    q = q.abs()
    kp = kp.clone()
    # A sequence whose every key scores -inf: output 0 (the merge rule).
    kp[tables[1, 0]] = float("-inf")
    kp[tables[1, 1]] = float("-inf")
    out = paged_decode_attention(q, kp, vp, tables, lens)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_decode_attention_ref(q, kp, vp, tables, lens)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_matches_causal_attention_on_the_gathered_prefix(page, dtype):
    q, kp, vp, tables, lens = make_case(page + 11, [45], page, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    chunk = torch.randn(8, 13, 40, generator=g).to(dtype)
    out = paged_prefill_attention(chunk, kp, vp, tables[0], 45)
    k, v = gather_kv(kp.double(), vp.double(), tables[0], 45)
    truth = flash_attention_ref(chunk.double()[None], k[None], v[None], causal=True)[0]
    assert_close(out, truth, dtype)
    assert_close(paged_prefill_attention_ref(chunk, kp, vp, tables[0], 45), truth, dtype)
    # The last query of the chunk sees every key: decode attention for it agrees.
    last = paged_decode_attention(chunk[:, -1][None], kp, vp, tables[:1], lens)
    assert_close(last[0], truth[:, -1], dtype)


def test_error_messages_name_the_argument():
    q, kp, vp, tables, lens = make_case(6, [10, 20], 4)
    bad = tables.clone()
    bad[1, 0] = kp.shape[0]
    with pytest.raises(ValueError, match="block_tables names block ids"):
        paged_decode_attention(q, kp, vp, bad, lens)
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_decode_attention(q, kp, vp, tables[:, :2], lens)
    with pytest.raises(ValueError, match="multiple of k_pool's heads"):
        paged_decode_attention(q[:, :3], kp, vp, tables, lens)
    with pytest.raises(ValueError, match="same head dim"):
        paged_decode_attention(q[..., :32].contiguous(), kp, vp, tables, lens)
    with pytest.raises(TypeError, match="block_tables must be int32 or int64"):
        paged_decode_attention(q, kp, vp, tables.float(), lens)
    with pytest.raises(TypeError, match="seq_lens must be int32 or int64"):
        paged_decode_attention(q, kp, vp, tables, lens.float())
    with pytest.raises(ValueError, match="seq_lens must be at least 1"):
        paged_decode_attention(q, kp, vp, tables, lens * 0)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention(q, kp, vp, tables[:1], lens)
    with pytest.raises(TypeError, match="v_pool must have the same dtype"):
        paged_decode_attention(q, kp, vp.half(), tables, lens)
    with pytest.raises(ValueError, match="v_pool must have the same shape"):
        paged_decode_attention(q, kp, vp[:-1], tables, lens)
    with pytest.raises(ValueError, match="k_pool must have 4 dimensions"):
        paged_decode_attention(q, kp[0], vp, tables, lens)
    with pytest.raises(ValueError, match="num_splits must lie"):
        paged_decode_attention(q, kp, vp, tables, lens, num_splits=0)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        paged_decode_attention(q, kp, vp, tables, lens, num_splits=2.0)
    with pytest.raises(ValueError, match="out must not be an expanded view"):
        paged_decode_attention(q, kp, vp, tables, lens, out=torch.zeros(1, 8, 40).expand(2, -1, -1))
    with pytest.raises(ValueError, match="inference-only"):
        paged_decode_attention(q.requires_grad_(), kp, vp, tables, lens)
    q = q.detach()
    with pytest.raises(ValueError, match="context_len .* must count"):
        paged_prefill_attention(q[0][:, None].expand(-1, 12, -1), kp, vp, tables[0], 10)
    with pytest.raises(TypeError, match="context_len must be an int"):
        paged_prefill_attention(q[0][:, None], kp, vp, tables[0], 10.0)
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_prefill_attention(q[0][:, None], kp, vp, tables[0], 40)
    # one sequence's table is 1-D: a (1, max_blocks) table used to pass the checks and fail inside the gather
    for fn in (paged_prefill_attention, paged_prefill_attention_ref):
        with pytest.raises(ValueError, match=r"block_table must have 1 dimension"):
            fn(q[0][:, None], kp, vp, tables[:1], 10)


@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), page=st.sampled_from([1, 2, 5, 16, 32]),
       heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]), d=st.sampled_from([16, 24, 40]), seed=st.integers(0, 99),
       shared=st.booleans(), splits=st.none() | st.integers(1, 5))
def test_property_equals_dense_attention(lens, page, heads, d, seed, shared, splits):
    hq, hkv = heads
    q, kp, vp, tables, lens_t = make_case(seed, lens, page, hq=hq, hkv=hkv, d=d, shared=shared)
    out = paged_decode_attention(q, kp, vp, tables, lens_t, num_splits=splits)
    assert_close(out, dense_truth(q, kp, vp, tables, lens_t), torch.float32)


@settings(max_examples=10, deadline=None)
@given(which=st.sampled_from(["block", "len", "heads", "dtype", "table_dtype", "rank"]), seed=st.integers(0, 50))
def test_property_bad_arguments_raise_before_launch(which, seed):
    q, kp, vp, tables, lens = make_case(seed, [5, 9], 4)
    args = dict(q=q, k_pool=kp, v_pool=vp, block_tables=tables, seq_lens=lens)
    if which == "block":
        bad = tables.clone()
        bad[seed % 2, 0] = -1 - seed
        args["block_tables"] = bad
    elif which == "len":
        args["seq_lens"] = lens + tables.shape[1] * 4
    elif which == "heads":
        args["q"] = q[:, :3]
    elif which == "dtype":
        args["k_pool"] = kp.double()
    elif which == "table_dtype":
        args["block_tables"] = tables.to(torch.int16)
    else:
        args["q"] = q[None]
    with pytest.raises((ValueError, TypeError)):
        paged_decode_attention(**args)
