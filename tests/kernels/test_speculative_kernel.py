"""Tests of the tree-attention kernel (labsrc.kernels.speculative) against its reference and against
PyTorch's scaled_dot_product_attention with the explicit mask, on random trees.

Outputs are pre-filled with NaN (an element the kernel forgets fails). bf16 under the interpreter: tiles are
upcast to fp32 after loading (``tl.dot`` on bf16 returns garbage there), so bf16 dots run only on a GPU.
"""
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from labsrc import runtime
from labsrc.exercises import tolerance
from labsrc.kernels.speculative import tree_attention, tree_attention_ref
from labsrc.speculative import tree_attention_mask

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _random_parents(rng, n):
    return [rng.randrange(-1, i) for i in range(n)]


def _inputs(seed, B, Hq, Hkv, N, P, D, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g).to(dtype=dtype, device=DEV)
    k = torch.randn(B, Hkv, P + N, D, generator=g).to(dtype=dtype, device=DEV)
    v = torch.randn(B, Hkv, P + N, D, generator=g).to(dtype=dtype, device=DEV)
    rng = random.Random(seed)
    mask = torch.stack([tree_attention_mask(_random_parents(rng, N)) for _ in range(B)]).to(DEV)
    return q, k, v, mask


def _sdpa(q, k, v, mask, scale=None):
    B, N, P = q.shape[0], q.shape[2], k.shape[2] - q.shape[2]
    full = torch.cat([torch.ones(B, N, P, dtype=torch.bool, device=q.device), mask.expand(B, N, N)], -1)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=full[:, None],
                                          scale=scale, enable_gqa=True)


def _run(q, k, v, mask, **kw):
    out = torch.full_like(q, float("nan"))
    res = tree_attention(q, k, v, mask, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    return out


def _close(a, b, dtype):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,N,P,D", [(1, 2, 1, 7, 0, 16), (2, 4, 2, 21, 37, 40), (1, 3, 3, 33, 5, 24)])
def test_matches_reference_and_sdpa(dtype, B, Hq, Hkv, N, P, D):
    q, k, v, mask = _inputs(N * 7 + P, B, Hq, Hkv, N, P, D, dtype)
    out = _run(q, k, v, mask)
    ref64 = tree_attention_ref(q.double(), k.double(), v.double(), mask)
    _close(out, ref64, dtype)
    _close(ref64, _sdpa(q, k, v, mask), torch.float64)
    _close(tree_attention_ref(q, k, v, mask), ref64, dtype)


def test_chain_tree_is_causal_attention_and_shared_mask():
    # A chain (every node the child of the previous) is ordinary causal attention over prefix + chain.
    q, k, v, _ = _inputs(1, 2, 2, 1, 9, 11, 32, torch.float32)
    chain = tree_attention_mask(list(range(-1, 8)))
    out = _run(q, k, v, chain)                            # a (N, N) mask shared by the batch
    causal = F.scaled_dot_product_attention(q, k.expand(2, 2, 20, 32), v.expand(2, 2, 20, 32),
                                            attn_mask=torch.ones(9, 20, dtype=torch.bool).tril(11))
    _close(out, causal, torch.float32)


def test_strided_and_expanded_views_and_int_mask():
    q, k, v, mask = _inputs(3, 2, 4, 2, 10, 13, 32, torch.float32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)     # head/position strides swapped
    kx = k[:1].expand(2, -1, -1, -1)
    vx = v[:1].expand(2, -1, -1, -1)
    mask_int = mask.to(torch.int64).transpose(1, 2).contiguous().transpose(1, 2)  # strided, integer
    out = _run(qt, kx, vx, mask_int)
    _close(out, tree_attention_ref(q.double(), kx.double(), vx.double(), mask), torch.float32)


def test_sm_scale_and_nan_propagation():
    q, k, v, mask = _inputs(4, 1, 2, 1, 6, 4, 16, torch.float32)
    _close(_run(q, k, v, mask, sm_scale=0.3), tree_attention_ref(q, k, v, mask, sm_scale=0.3), torch.float32)
    k2 = k.clone()
    k2[0, 0, 4 + 2] = float("nan")                         # tree node 2's key: only its descendants see it
    out = _run(q, k2, v, mask)
    ref = tree_attention_ref(q, k2, v, mask)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    seen = mask[0, :, 2]
    assert torch.isnan(out[0, :, seen]).all() and not torch.isnan(out[0, :, ~seen]).any()


def test_row_without_keys_is_zero():
    q, k, v, _ = _inputs(5, 1, 2, 2, 4, 0, 16, torch.float32)
    empty = torch.zeros(4, 4, dtype=torch.bool)
    assert torch.equal(_run(q, k, v, empty), torch.zeros_like(q))


def test_tree_mask_from_parents():
    m = tree_attention_mask([-1, 0, 0, 1, -1])
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="parent must come before"):
        tree_attention_mask([-1, 2, 0])


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(q=torch.zeros(1, 2, 4)), ValueError, "q must have 4 dimensions"),
    (dict(k=torch.zeros(1, 1, 3, 16), v=torch.zeros(1, 1, 3, 16)), ValueError, "prefix and then the N=4"),
    (dict(tree_mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "tree_mask must have shape"),
    (dict(tree_mask=torch.ones(4, 4)), TypeError, "tree_mask must be a bool"),
    (dict(tree_mask=[[1]]), TypeError, "tree_mask must be a torch.Tensor"),
    (dict(k=torch.zeros(1, 1, 9, 16, dtype=torch.float16)), TypeError, "same dtype as q"),
    (dict(q=torch.zeros(1, 3, 4, 16), k=torch.zeros(1, 2, 9, 16), v=torch.zeros(1, 2, 9, 16)), ValueError,
     "multiple of k's heads"),
    (dict(q=torch.zeros(1, 2, 4, 8), k=torch.zeros(1, 1, 9, 8), v=torch.zeros(1, 1, 9, 8)), ValueError, "head dim"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(out=torch.zeros(1, 2, 4, 16).expand(1, 2, 4, 16).as_strided((1, 2, 4, 16), (0, 0, 0, 1))),
     ValueError, "expanded view"),
    (dict(q=torch.zeros(1, 2, 4, 16, requires_grad=True)), ValueError, "inference-only"),
    (dict(q=torch.zeros(1, 2, 4, 16, dtype=torch.int32)), TypeError, "q must be float32"),
])
def test_errors(kwargs, err, match):
    args = dict(q=torch.zeros(1, 2, 4, 16), k=torch.zeros(1, 1, 9, 16), v=torch.zeros(1, 1, 9, 16),
                tree_mask=torch.ones(4, 4, dtype=torch.bool))
    args.update(kwargs)
    with pytest.raises(err, match=match):
        tree_attention(args["q"], args["k"], args["v"], args["tree_mask"], sm_scale=args.get("sm_scale"),
                       out=args.get("out"))


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 40), st.integers(0, 70), st.sampled_from([16, 24, 48]), st.sampled_from([(2, 1), (2, 2), (4, 2)]),
       st.sampled_from(DTYPES), st.integers(0, 10_000))
def test_property_random_trees(N, P, D, heads, dtype, seed):
    Hq, Hkv = heads
    q, k, v, mask = _inputs(seed, 1, Hq, Hkv, N, P, D, dtype)
    _close(_run(q, k, v, mask), tree_attention_ref(q.double(), k.double(), v.double(), mask), dtype)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["q", "k", "v"]), st.integers(1, 3))
def test_property_bad_shapes_refused(which, extra):
    args = dict(q=torch.zeros(1, 2, 4, 16), k=torch.zeros(1, 1, 9, 16), v=torch.zeros(1, 1, 9, 16))
    shape = list(args[which].shape)
    shape[-1] += extra
    args[which] = torch.zeros(shape)
    with pytest.raises(ValueError):
        tree_attention(args["q"], args["k"], args["v"], torch.ones(4, 4, dtype=torch.bool))
