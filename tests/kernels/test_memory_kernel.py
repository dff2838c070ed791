"""The kNN-memory attention kernel against its PyTorch reference (and the reference against fp64).

Outputs are written into NaN-poisoned buffers, so a row the kernel forgets fails. Sizes are odd (T = 5, 7;
Tk = 9, 13; K = 0, 3, 37 -- 37 rows take two blocks of retrieved rows), head dims 16, 40 (not a power of
two: masked lanes) and 64, GQA 2:1 and 4:1, strided and expanded views. The kernel has no tl.dot, so bf16
runs natively under the interpreter."""
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labsrc  # noqa: F401
from labsrc import runtime
from labsrc.exercises import tolerance
from labsrc.kernels.memory import knn_memory_attention, knn_memory_attention_ref

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(B, H, Hkv, T, Tk, K, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    kl, vl = torch.randn(B, Hkv, Tk, D, generator=g), torch.randn(B, Hkv, Tk, D, generator=g)
    mk, mv = torch.randn(B, H, T, K, D, generator=g), torch.randn(B, H, T, K, D, generator=g)
    gate = 2 * torch.randn(H, generator=g)
    return [x.to(DEV, dtype) for x in (q, kl, vl, mk, mv)] + [gate.to(DEV)]


def poisoned(q):
    return torch.full_like(q, float("nan"))


def check(args, dtype, **kw):
    out = poisoned(args[0])
    got = knn_memory_attention(*args, out=out, **kw)
    assert got is out
    want = knn_memory_attention_ref(*args, **kw)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return got


SHAPES = [  # (B, H, Hkv, T, Tk, K, D)
    (2, 4, 2, 5, 9, 3, 40),     # GQA 2:1, D not a power of two, a decode-like window longer than T
    (1, 4, 1, 7, 7, 37, 16),    # MQA, square causal, two blocks of retrieved rows
    (1, 2, 2, 5, 13, 0, 64),    # an empty memory: the output is the local part times (1 - g)
]


# every dtype on the first shape, float32 on the others (each launch takes about a second interpreted)
CASES = [(SHAPES[0], d) for d in DTYPES] + [(s, torch.float32) for s in SHAPES[1:]]


@pytest.mark.parametrize("shape, dtype", CASES,
                         ids=lambda c: str(c) if isinstance(c, torch.dtype) else
                         "B{}-H{}-Hkv{}-T{}-Tk{}-K{}-D{}".format(*c))
def test_kernel_matches_reference(shape, dtype):
    check(make(*shape, dtype, zlib.crc32(repr(shape).encode())), dtype)


def test_reference_in_fp32_matches_fp64():
    args = make(1, 4, 2, 5, 9, 6, 40, torch.float64, 1)
    want = knn_memory_attention_ref(*args)
    got = knn_memory_attention_ref(*[a.float() for a in args])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_rows_without_local_keys_and_sm_scale():
    """T > Tk: the first T - Tk queries see no local key (output: the memory part times g), and a custom
    scale reaches both softmaxes."""
    args = make(1, 2, 1, 6, 3, 4, 16, torch.float32, 2)
    got = check(args, torch.float32, sm_scale=0.3)
    _, mem, local = knn_memory_attention_ref(*args, sm_scale=0.3, return_parts=True)
    assert torch.equal(local[:, :, :3], torch.zeros_like(local[:, :, :3]))
    g = torch.sigmoid(args[-1])[None, :, None, None]
    torch.testing.assert_close(got[:, :, :3], (g * mem)[:, :, :3], rtol=1e-5, atol=1e-6)


def test_strided_and_expanded_views():
    """q as a transposed (B, T, H, D) buffer, the local K/V expanded over the batch (stride 0), the memory
    rows a slice of a larger buffer, the gate a strided fp16 view, and a last dim that needs a copy."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, T, Tk, K, D = 2, 4, 2, 5, 9, 3, 40
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    kl = torch.randn(1, Hkv, Tk, D, generator=g).expand(B, -1, -1, -1)
    vl = torch.randn(1, Hkv, D, Tk, generator=g).transpose(2, 3).expand(B, -1, -1, -1)  # last dim strided
    big = torch.randn(B, H, T, 2 * K, D, generator=g)
    mk, mv = big[:, :, :, ::2], big[:, :, :, 1::2]
    gate = torch.randn(2 * H, generator=g).half()[::2]
    assert not q.is_contiguous() and kl.stride(0) == 0 and vl.stride(-1) != 1 and gate.stride(0) == 2
    check([q, kl, vl, mk, mv, gate], torch.float32)


def test_nonfinite_inputs_follow_the_reference():
    """A -inf-scoring (huge negative) memory row contributes nothing; NaN in a query gives NaN in its row."""
    args = make(1, 2, 1, 3, 4, 3, 16, torch.float32, 4)
    q = args[0].clone()
    q[0, 1, 2, 0] = float("nan")
    args[0] = q
    out = knn_memory_attention(*args)
    want = knn_memory_attention_ref(*args)
    assert torch.isnan(out[0, 1, 2]).all() and torch.isnan(want[0, 1, 2]).all()
    torch.testing.assert_close(out[0, 0], want[0, 0], rtol=1e-5, atol=1e-6)


def test_inference_only():
    args = make(1, 2, 1, 3, 4, 3, 16, torch.float32, 5)
    args[0].requires_grad_(True)
    with pytest.raises(ValueError, match="inference-only"):
        knn_memory_attention(*args)
    with torch.no_grad():
        knn_memory_attention(*args)
    out = knn_memory_attention_ref(*args)          # the reference is differentiable
    out.sum().backward()
    assert args[0].grad is not None


def _good():
    return make(1, 4, 2, 3, 5, 2, 16, torch.float32, 6)


BAD = [
    (lambda a: a.__setitem__(0, a[0].long()), TypeError, "q must be float32"),
    (lambda a: a.__setitem__(1, a[1].half()), TypeError, "k_local must have the dtype"),
    (lambda a: a.__setitem__(4, a[4][..., :8]), ValueError, "mem_v must have the shape"),
    (lambda a: a.__setitem__(3, a[3][:, :, :2]), ValueError, "mem_k must be"),
    (lambda a: a.__setitem__(slice(1, 3), [a[1][:, :1].expand(1, 3, 5, 16)] * 2), ValueError, "k_local's heads"),
    (lambda a: a.__setitem__(2, a[2][:, :, :4]), ValueError, "v_local must have the shape"),
    (lambda a: a.__setitem__(5, a[5][:3]), ValueError, "gate must hold one logit"),
    (lambda a: a.__setitem__(5, torch.ones(4, dtype=torch.long)), TypeError, "gate must be a floating"),
    (lambda a: a.__setitem__(0, a[0][..., :8]), ValueError, "head dim"),
    (lambda a: a.__setitem__(slice(1, 3), [a[1][:, :, :0]] * 2), ValueError, "at least one key"),
    (lambda a: a.__setitem__(0, [1.0]), TypeError, "q must be a torch.Tensor"),
    (lambda a: a.__setitem__(3, a[3][0]), ValueError, "mem_k must have 5 dimensions"),
]


@pytest.mark.parametrize("mutate, exc, match", BAD, ids=[m for _, _, m in BAD])
def test_errors_name_the_argument(mutate, exc, match):
    args = _good()
    mutate(args)
    with pytest.raises(exc, match=match):
        knn_memory_attention(*args)
    with pytest.raises(exc, match=match):
        knn_memory_attention_ref(*args)


def test_scale_and_out_errors():
    args = _good()
    with pytest.raises(ValueError, match="sm_scale"):
        knn_memory_attention(*args, sm_scale=-1.0)
    with pytest.raises(TypeError, match="sm_scale"):
        knn_memory_attention(*args, sm_scale="big")
    with pytest.raises(ValueError, match="out must match"):
        knn_memory_attention(*args, out=torch.empty(1, 4, 3, 8))
    with pytest.raises(ValueError, match="expanded"):
        knn_memory_attention(*args, out=torch.empty(1, 4, 1, 16).expand(1, 4, 3, 16))


def test_launch_limit_is_refused(monkeypatch):
    import labsrc.kernels.memory as km
    monkeypatch.setattr(km, "GRID_AXIS_LIMIT", 3)
    with pytest.raises(ValueError, match="launch limit"):
        knn_memory_attention(*_good())


@settings(max_examples=10, deadline=None)
@given(H=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2]), T=st.integers(1, 4), extra=st.integers(-1, 4),
       K=st.integers(0, 5), D=st.sampled_from([16, 24, 40]), scale=st.sampled_from([None, 0.05, 1.0]),
       big=st.booleans(), seed=st.integers(0, 10**6))
def test_property_kernel_equals_reference(H, group, T, extra, K, D, scale, big, seed):
    Hkv = max(1, H // group)
    Tk = max(1, T + extra)
    args = make(1, H, Hkv, T, Tk, K, D, torch.float32, seed)
    if big:   # large logits: the online softmax must subtract the running maximum
        args[0] = args[0] * 30
    if seed % 2:   # a (B, T, H, D) buffer viewed as (B, H, T, D): strided, read without a copy
        args[0] = args[0].transpose(1, 2).contiguous().transpose(1, 2)
    check(args, torch.float32, sm_scale=scale)


@settings(max_examples=15, deadline=None)
@given(case=st.sampled_from(BAD))
def test_property_random_bad_arguments_are_refused_by_name(case):
    mutate, exc, match = case
    args = _good()
    mutate(args)
    with pytest.raises(exc, match=match):
        knn_memory_attention(*args)


# --------------------------------------------------------------------- padded (invalid) retrieved rows
@settings(max_examples=8, deadline=None)
@given(T=st.integers(1, 6), K=st.integers(1, 40), D=st.sampled_from([16, 24]), H=st.sampled_from([1, 2]),
       density=st.sampled_from([0.0, 0.3, 0.8]), expanded=st.booleans(), seed=st.integers(0, 2**16))
def test_invalid_rows_are_never_read(T, K, D, H, density, expanded, seed):
    """Rows marked invalid hold NaN here: the kernel and the reference must neither weight nor read them,
    and must equal the reference over the valid rows only; a query with no valid row has a memory half of
    0. The mask may be an expanded view (one mask shared by the heads)."""
    args = make(1, H, 1, T, T + 2, K, D, torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 1)
    valid = torch.rand(1, 1 if expanded else H, T, K, generator=g) < density
    valid = valid.expand(1, H, T, K) if expanded else valid
    mk, mv = args[3].clone(), args[4].clone()
    mk[~valid] = float("nan")
    mv[~valid] = float("nan")
    args[3], args[4] = mk, mv
    got = check(args, torch.float32, mem_valid=valid)
    assert not torch.isnan(got).any()
    _, mem, _ = knn_memory_attention_ref(*args, mem_valid=valid, return_parts=True)
    for h in range(H):
        for t in range(T):
            keep = valid[0, h, t]
            if not keep.any():
                assert torch.equal(mem[0, h, t], torch.zeros(D)), "no valid row: the memory half is 0"
                continue
            s = mk[0, h, t][keep] @ args[0][0, h, t] / D ** 0.5
            want = torch.softmax(s, 0) @ mv[0, h, t][keep]
            torch.testing.assert_close(mem[0, h, t], want, rtol=1e-5, atol=1e-5)


def test_mem_valid_errors():
    args = make(1, 2, 1, 3, 3, 4, 16, torch.float32, 0)
    with pytest.raises(TypeError, match="mem_valid must be a bool"):
        knn_memory_attention(*args, mem_valid=torch.ones(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"mem_valid must have shape \(B, H, T, K\)"):
        knn_memory_attention(*args, mem_valid=torch.ones(1, 2, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mem_valid must be a bool torch.Tensor"):
        knn_memory_attention_ref(*args, mem_valid=[True])
