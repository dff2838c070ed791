"""The fused differential-attention kernel against its PyTorch reference (and the reference against fp64 and
against the formula written out by hand).

Outputs are written into NaN-poisoned buffers, so a row the kernel forgets fails. Sizes are odd (T = 1, 5, 19,
37: 37 takes three query and key blocks of 16), head dims 16, 24, 40 (not powers of two: masked lanes), values
wider than the queries (the paper's 2D), strided and expanded views, every dtype (bf16 tiles are upcast under
the interpreter, where bf16 tl.dot returns garbage)."""
import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labsrc  # noqa: F401
from labsrc import runtime
from labsrc.exercises import tolerance
from labsrc.kernels.frontier import diff_attention_fused, diff_attention_ref

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(B, H, T, D, Dv, dtype, seed, lam_tensor=True):
    g = torch.Generator().manual_seed(seed)
    qk = [torch.randn(B, H, T, D, generator=g) for _ in range(4)]
    v = torch.randn(B, H, T, Dv, generator=g)
    lam = torch.rand(H, generator=g).to(DEV) if lam_tensor else 0.3
    return [x.to(DEV, dtype) for x in qk + [v]] + [lam]


def check(args, dtype, **kw):
    B, H, T, _ = args[0].shape
    out = torch.full((B, H, T, args[4].shape[-1]), float("nan"), dtype=dtype, device=DEV)
    got = diff_attention_fused(*args, out=out, **kw)
    assert got is out
    want = diff_attention_ref(*args, **kw)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return got


SHAPES = [(2, 3, 37, 24, 48), (1, 2, 5, 16, 16), (1, 1, 1, 40, 32)]   # (B, H, T, D, Dv)
CASES = [(SHAPES[0], d) for d in DTYPES] + [(s, torch.float32) for s in SHAPES[1:]]


@pytest.mark.parametrize("shape, dtype", CASES,
                         ids=lambda c: str(c) if isinstance(c, torch.dtype) else "B{}-H{}-T{}-D{}-Dv{}".format(*c))
def test_kernel_matches_reference(shape, dtype):
    check(make(*shape, dtype, zlib.crc32(repr(shape).encode())), dtype)


def test_reference_is_the_formula_and_lambda_zero_is_attention():
    """The reference against the formula written out in fp64, and lam = 0 against PyTorch's causal SDPA."""
    q1, k1, q2, k2, v, lam = make(1, 2, 7, 16, 16, torch.float64, 1)
    m = torch.ones(7, 7, dtype=torch.bool).triu(1)

    def attn(q, k):
        return torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(16)).masked_fill(m, -math.inf), -1) @ v

    want = attn(q1, k1) - lam[None, :, None, None].double() * attn(q2, k2)
    torch.testing.assert_close(diff_attention_ref(q1, k1, q2, k2, v, lam), want, rtol=1e-12, atol=1e-12)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q1.float(), k1.float(), v.float(), is_causal=True)
    with torch.no_grad():
        got = diff_attention_fused(q1.float(), k1.float(), q2.float(), k2.float(), v.float(), 0.0)
    torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=1e-5)


def test_reference_in_fp32_matches_fp64():
    args = make(1, 2, 9, 24, 24, torch.float64, 2)
    want = diff_attention_ref(*args)
    got = diff_attention_ref(*[a.float() for a in args])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_scalar_lambda_and_sm_scale():
    check(make(1, 2, 19, 16, 24, torch.float32, 3, lam_tensor=False), torch.float32, sm_scale=0.2)


def test_strided_and_expanded_views():
    """q1 a transposed (B, T, H, D) buffer, k2 expanded over the batch (stride 0), v a slice of a wider
    buffer, k1 with a strided last dim (copied), lam a strided fp16 view."""
    g = torch.Generator().manual_seed(4)
    B, H, T, D = 2, 3, 21, 16
    q1 = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    k1 = torch.randn(B, H, D, T, generator=g).transpose(2, 3)
    q2 = torch.randn(B, H, T, D, generator=g)
    k2 = torch.randn(1, H, T, D, generator=g).expand(B, -1, -1, -1)
    v = torch.randn(B, H, T, 2 * D, generator=g)[..., :D]      # a slice: dense last dim, strided rows
    lam = torch.rand(2 * H, generator=g).half()[::2]
    assert not q1.is_contiguous() and k1.stride(-1) != 1 and k2.stride(0) == 0 and lam.stride(0) == 2
    assert not v.is_contiguous()
    check([q1, k1, q2, k2, v, lam], torch.float32)


def test_nan_in_a_query_stays_in_its_row():
    args = make(1, 2, 5, 16, 16, torch.float32, 5)
    args[0] = args[0].clone()
    args[0][0, 1, 3, 0] = float("nan")
    out = diff_attention_fused(*args)
    want = diff_attention_ref(*args)
    assert torch.isnan(out[0, 1, 3]).all() and torch.isnan(want[0, 1, 3]).all()
    torch.testing.assert_close(out[0, 0], want[0, 0], rtol=1e-5, atol=1e-6)
    assert not torch.isnan(out[0, 1, :3]).any()


def test_inference_only():
    args = make(1, 2, 5, 16, 16, torch.float32, 6)
    args[0].requires_grad_(True)
    with pytest.raises(ValueError, match="inference-only"):
        diff_attention_fused(*args)
    with torch.no_grad():
        diff_attention_fused(*args)
    diff_attention_ref(*args).sum().backward()          # the reference is differentiable
    assert args[0].grad is not None


def _good():
    return make(1, 2, 5, 16, 16, torch.float32, 7)


BAD = [
    (lambda a: a.__setitem__(0, a[0].long()), TypeError, "q1 must be"),
    (lambda a: a.__setitem__(1, a[1].half()), TypeError, "k1 must have the dtype"),
    (lambda a: a.__setitem__(2, a[2][:, :, :4]), ValueError, "q2 must have the shape"),
    (lambda a: a.__setitem__(4, a[4][:, :, :3]), ValueError, "v must be"),
    (lambda a: a.__setitem__(4, a[4][..., :8]), ValueError, "head dim 8 of v"),
    (lambda a: a.__setitem__(slice(0, 4), [x[..., :8] for x in a[:4]]), ValueError, "head dim 8 of q1"),
    (lambda a: a.__setitem__(5, a[5][:1]), ValueError, "lam must hold one weight"),
    (lambda a: a.__setitem__(5, torch.ones(2, dtype=torch.long)), TypeError, "lam must be a float"),
    (lambda a: a.__setitem__(5, "half"), TypeError, "lam must be a real number"),
    (lambda a: a.__setitem__(5, float("inf")), ValueError, "lam must be finite"),
    (lambda a: a.__setitem__(3, [1.0]), TypeError, "k2 must be a torch.Tensor"),
    (lambda a: a.__setitem__(0, a[0][0]), ValueError, "q1 must have 4 dimensions"),
]


@pytest.mark.parametrize("mutate, exc, match", BAD, ids=[m for _, _, m in BAD])
def test_errors_name_the_argument(mutate, exc, match):
    args = _good()
    mutate(args)
    with pytest.raises(exc, match=match):
        diff_attention_fused(*args)
    with pytest.raises(exc, match=match):
        diff_attention_ref(*args)


def test_scale_out_and_launch_errors(monkeypatch):
    args = _good()
    with pytest.raises(ValueError, match="sm_scale"):
        diff_attention_fused(*args, sm_scale=0.0)
    with pytest.raises(TypeError, match="sm_scale"):
        diff_attention_fused(*args, sm_scale="big")
    with pytest.raises(ValueError, match="out must be"):
        diff_attention_fused(*args, out=torch.empty(1, 2, 5, 8))
    with pytest.raises(ValueError, match="expanded"):
        diff_attention_fused(*args, out=torch.empty(1, 2, 1, 16).expand(1, 2, 5, 16))
    import labsrc.kernels.frontier as kf
    monkeypatch.setattr(kf, "GRID_AXIS_LIMIT", 1)
    with pytest.raises(ValueError, match="launch limit"):
        diff_attention_fused(*args)


@settings(max_examples=10, deadline=None)
@given(H=st.integers(1, 3), T=st.integers(1, 35), D=st.sampled_from([16, 24, 40]),
       Dv=st.sampled_from([16, 48]), scale=st.sampled_from([None, 0.05, 1.0]), big=st.booleans(),
       seed=st.integers(0, 10**6))
def test_property_kernel_equals_reference(H, T, D, Dv, scale, big, seed):
    args = make(1, H, T, D, Dv, torch.float32, seed)
    if seed % 2:
        args[1] = args[1].transpose(1, 2).contiguous().transpose(1, 2)
    if not big:
        check(args, torch.float32, sm_scale=scale)
        return
    # Large logits (|s| in the hundreds): both online softmaxes must subtract their running maxima (exp2 of
    # an unshifted score overflows). fp32 rounds such a score by about |s| * 6e-8, which moves each
    # probability by as much, so two fp32 computations legitimately differ by more than the usual fp32
    # tolerance. The rule: the kernel is no further from the fp64 truth than the fp32 reference is (x 4).
    args[0], args[2] = args[0] * 30, args[2] * 30
    with torch.no_grad():
        got = diff_attention_fused(*args, sm_scale=scale)
    truth = diff_attention_ref(*[a.double() for a in args], sm_scale=scale)
    ref_err = (diff_attention_ref(*args, sm_scale=scale).double() - truth).abs().max().item()
    assert torch.isfinite(got).all()
    assert (got.double() - truth).abs().max().item() <= 4 * ref_err + 1e-6


@settings(max_examples=15, deadline=None)
@given(case=st.sampled_from(BAD))
def test_property_random_bad_arguments_are_refused_by_name(case):
    mutate, exc, match = case
    args = _good()
    mutate(args)
    with pytest.raises(exc, match=match):
        diff_attention_fused(*args)
