"""The Triton SSM kernels (labsrc.kernels.ssm) against their references and transformers' PyTorch scans.

Every output buffer is prefilled with NaN (the wrappers allocate through ``_alloc``, swapped here), so an
element a kernel forgets to write fails the comparison. Lengths are odd (1, 7, 63, 257, 1000), channel and head
counts not powers of two, state sizes from 1 to 64, groups dividing heads, with and without the optional
arguments. The kernels upcast every tile to float32 right after loading it, so low-precision inputs are compared
with the reference on the same (rounded) inputs, to the output dtype's rounding.
"""
import logging
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import labsrc  # noqa: F401  (interpreter switch before triton)
from labsrc import runtime, ssm
from labsrc.kernels import ssm as K
from transformers.models.mamba.modeling_mamba import mamba_selective_scan
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

logging.getLogger("transformers").setLevel(logging.ERROR)

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Scans accumulate over hundreds of steps in float32 in another order than the reference: 1e-4 for float32;
# a half-precision output is one rounding of the float32 result.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(K, "_alloc", lambda shape, device, dtype: torch.full(shape, float("nan"), device=device,
                                                                            dtype=dtype))


def gen_for(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------------
# linear_scan
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,with_h0", [((1,), False), ((3, 7), True), ((5, 63), False), ((2, 3, 257), True),
                                           ((2, 1000), True)], ids=str)
def test_linear_scan_matches_loop(shape, with_h0, dtype):
    gen = gen_for(shape, with_h0)
    a = torch.rand(*shape, generator=gen).to(DEV, dtype)
    b = torch.randn(*shape, generator=gen).to(DEV, dtype)
    h0 = torch.randn(*shape[:-1], generator=gen).to(DEV) if with_h0 else None
    got = K.linear_scan(a, b, h0)
    assert got.dtype == dtype and got.shape == b.shape
    close(got, ssm.linear_scan_loop(a.float(), b.float(), h0), dtype)


def test_linear_scan_strided_and_expanded_views():
    gen = gen_for("views")
    base = torch.rand(40, 6, generator=gen).to(DEV)
    a = base.t()                                                  # (6, 40), stride (1, 6)
    b = torch.randn(40, generator=gen).to(DEV).expand(6, 40)      # stride (0, 1)
    h0 = torch.randn(12, generator=gen).to(DEV)[::2]              # stride 2
    close(K.linear_scan(a, b, h0), ssm.linear_scan_loop(a, b, h0), torch.float32)


def test_linear_scan_nan_propagates_forward_only():
    a = torch.full((2, 300), 0.9, device=DEV)
    b = torch.ones(2, 300, device=DEV)
    b[0, 100] = float("nan")
    got = K.linear_scan(a, b)
    assert torch.isfinite(got[0, :100]).all() and torch.isnan(got[0, 100:]).all() and torch.isfinite(got[1]).all()


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 3), l=st.integers(1, 300), decay=st.floats(0.0, 1.2), seed=st.integers(0, 99))
def test_linear_scan_property(rows, l, decay, seed):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.rand(rows, l, generator=gen) * decay).to(DEV)
    b = torch.randn(rows, l, generator=gen).to(DEV)
    close(K.linear_scan(a, b), ssm.linear_scan_loop(a.double(), b.double()), torch.float32)


def test_linear_scan_errors():
    a = torch.rand(2, 5, device=DEV)
    with pytest.raises(TypeError, match="a and b must have one dtype"):
        K.linear_scan(a, a.half())
    with pytest.raises(TypeError, match="a must be float32, float16 or bfloat16 for the kernel"):
        K.linear_scan(a.double(), a.double())
    with pytest.raises(ValueError, match="b must have the shape of a"):
        K.linear_scan(a, a[:, :3])
    with pytest.raises(ValueError, match="h0 must have shape"):
        K.linear_scan(a, a, torch.zeros(5, device=DEV))
    with pytest.raises(ValueError, match="a requires grad"):
        K.linear_scan(a.clone().requires_grad_(), a)
    with pytest.raises(ValueError, match="meta"):
        K.linear_scan(a.to("meta"), a.to("meta"))
    with torch.no_grad():  # under no_grad a leaf that requires grad is fine
        K.linear_scan(a.clone().requires_grad_(), a)


# ---------------------------------------------------------------------------------------------------------
# selective_scan
# ---------------------------------------------------------------------------------------------------------

def sel_args(b, d, l, n, dtype=torch.float32, optional=True, key=0):
    gen = gen_for("sel", b, d, l, n, key)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV, dtype)  # noqa: E731
    kw = dict(u=r(b, d, l), delta=r(b, d, l) * 0.5, A=(-torch.rand(d, n, generator=gen) * 2).to(DEV),
              B=r(b, n, l), C=r(b, n, l))
    if optional:
        kw.update(D=torch.randn(d, generator=gen).to(DEV), z=r(b, d, l),
                  delta_bias=(torch.randn(d, generator=gen) * 0.3).to(DEV))
    else:
        kw["delta"] = kw["delta"].abs() + 0.01
    return kw


SEL_SHAPES = [(1, 1, 1, 1), (2, 3, 7, 4), (1, 5, 63, 16), (1, 3, 257, 5), (1, 2, 40, 64)]


@pytest.mark.parametrize("optional", [True, False], ids=["D-z-bias-softplus", "plain"])
@pytest.mark.parametrize("shape", SEL_SHAPES, ids=lambda s: "b{}-d{}-l{}-n{}".format(*s))
def test_selective_scan_matches_reference_and_transformers(shape, optional):
    kw = sel_args(*shape, optional=optional)
    y, last = K.selective_scan(**kw, delta_softplus=optional, return_last_state=True)
    y_ref, last_ref = ssm.selective_scan_ref(**kw, delta_softplus=optional, return_last_state=True)
    close(y, y_ref, torch.float32)
    close(last, last_ref, torch.float32)
    y_hf, last_hf = mamba_selective_scan(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw.get("D"), kw.get("z"),
                                         kw.get("delta_bias"), optional, True)
    close(y, y_hf, torch.float32)
    close(last, last_hf, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_selective_scan_half_inputs(dtype):
    kw = sel_args(2, 3, 45, 8, dtype=dtype)
    y, last = K.selective_scan(**kw, delta_softplus=True, return_last_state=True)
    y_ref, last_ref = ssm.selective_scan_ref(**kw, delta_softplus=True, return_last_state=True)
    assert y.dtype == dtype and last.dtype == torch.float32
    close(y, y_ref, dtype)
    close(last, last_ref, torch.float32)


def test_selective_scan_views_and_no_last_state():
    kw = sel_args(2, 3, 30, 6)
    kw["B"] = kw["B"].transpose(1, 2).contiguous().transpose(1, 2)        # (b, n, l) with stride 1 along n
    kw["u"] = torch.randn(2, 30, 3, generator=gen_for("u")).to(DEV).transpose(1, 2)
    kw["A"] = kw["A"][:1].expand(3, 6)                                     # one row for every channel
    kw["D"] = torch.randn(6, generator=gen_for("D")).to(DEV)[::2]
    y = K.selective_scan(**kw, delta_softplus=True)
    close(y, ssm.selective_scan_ref(**kw, delta_softplus=True), torch.float32)


def test_selective_scan_nan_stays_in_its_channel():
    kw = sel_args(1, 3, 50, 4, optional=False)
    kw["u"][0, 1, 20] = float("nan")
    y = K.selective_scan(**kw)
    assert torch.isfinite(y[0, 1, :20]).all() and torch.isnan(y[0, 1, 20:]).all()
    assert torch.isfinite(y[0, [0, 2]]).all()


@settings(max_examples=6, deadline=None)
@given(d=st.integers(1, 3), l=st.integers(1, 80), n=st.integers(1, 20), optional=st.booleans(),
       seed=st.integers(0, 99))
def test_selective_scan_property(d, l, n, optional, seed):
    kw = sel_args(1, d, l, n, optional=optional, key=seed)
    got = K.selective_scan(**kw, delta_softplus=optional)
    close(got, ssm.selective_scan_ref(**kw, delta_softplus=optional), torch.float32)


def test_selective_scan_errors():
    kw = sel_args(1, 3, 5, 2)
    with pytest.raises(TypeError, match="delta_softplus must be a bool"):
        K.selective_scan(**kw, delta_softplus=1)
    with pytest.raises(TypeError, match="return_last_state must be a bool"):
        K.selective_scan(**kw, return_last_state="yes")
    with pytest.raises(TypeError, match="u must be float32, float16 or bfloat16 for the kernel"):
        K.selective_scan(**{**kw, "u": kw["u"].double()})
    with pytest.raises(ValueError, match="B must have shape"):
        K.selective_scan(**{**kw, "B": kw["B"][:, :1]})
    with pytest.raises(ValueError, match="z must have shape"):
        K.selective_scan(**{**kw, "z": kw["z"][..., :4]})
    with pytest.raises(ValueError, match="delta requires grad"):
        K.selective_scan(**{**kw, "delta": kw["delta"].clone().requires_grad_()})
    big = sel_args(1, 1, 2, K.MAX_STATE + 1, optional=False)
    with pytest.raises(ValueError, match="state size n = 257"):
        K.selective_scan(**big)


# ---------------------------------------------------------------------------------------------------------
# ssd
# ---------------------------------------------------------------------------------------------------------

def ssd_args(b, l, h, p, g, n, dtype=torch.float32, with_d=True, with_state=True, key=0):
    gen = gen_for("ssd", b, l, h, p, g, n, key)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV, dtype)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=(torch.rand(b, l, h, generator=gen) * 0.6 + 0.02).to(DEV),
                A=(-torch.rand(h, generator=gen) * 2 - 0.05).to(DEV), B=r(b, l, g, n), C=r(b, l, g, n),
                D=torch.randn(h, generator=gen).to(DEV) if with_d else None,
                initial_state=torch.randn(b, h, p, n, generator=gen).to(DEV) if with_state else None)


SSD_SHAPES = [  # (b, l, h, p, g, n, chunk)
    (1, 1, 1, 1, 1, 1, 16),
    (2, 7, 3, 5, 1, 4, 16),
    (1, 63, 6, 4, 3, 8, 16),
    (1, 257, 5, 3, 5, 2, 64),
    (2, 33, 4, 20, 2, 64, 32),
    (1, 1000, 2, 8, 1, 16, 256),
]


@pytest.mark.parametrize("optional", [True, False], ids=["D-state", "plain"])
@pytest.mark.parametrize("shape", SSD_SHAPES, ids=lambda s: "b{}-l{}-h{}-p{}-g{}-n{}-q{}".format(*s))
def test_ssd_matches_reference_and_transformers(shape, optional):
    *dims, q = shape
    kw = ssd_args(*dims, with_d=optional, with_state=optional)
    y, s = K.ssd(**kw, chunk_size=q)
    y_ref, s_ref = ssm.ssd_chunked(**kw, chunk_size=q)
    close(y, y_ref, torch.float32)
    close(s, s_ref, torch.float32)
    y_hf, s_hf = mamba2_chunk_scan(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], chunk_size=q, D=kw["D"],
                                   initial_states=kw["initial_state"], return_final_states=True)
    close(y, y_hf, torch.float32)
    close(s, s_hf, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_ssd_half_inputs(dtype):
    kw = ssd_args(1, 50, 4, 16, 2, 16, dtype=dtype)
    y, s = K.ssd(**kw, chunk_size=16)
    y_ref, s_ref = ssm.ssd_chunked(**kw, chunk_size=16)
    assert y.dtype == dtype and s.dtype == torch.float32
    close(y, y_ref, dtype)
    close(s, s_ref, torch.float32)


def test_ssd_views():
    kw = ssd_args(2, 40, 4, 6, 2, 8)
    kw["x"] = kw["x"].transpose(1, 2).contiguous().transpose(1, 2)           # (b, l, h, p) stride over h first
    kw["B"] = kw["B"][:, :, :1].expand(2, 40, 2, 8)                          # both groups the same
    kw["dt"] = torch.rand(2, 80, 4, generator=gen_for("dt")).to(DEV)[:, ::2] + 0.05
    kw["A"] = kw["A"][:1].expand(4)
    y, s = K.ssd(**kw, chunk_size=16)
    y_ref, s_ref = ssm.ssd_chunked(**kw, chunk_size=16)
    close(y, y_ref, torch.float32)
    close(s, s_ref, torch.float32)


def test_ssd_result_does_not_depend_on_chunk_size():
    kw = ssd_args(1, 100, 2, 4, 1, 8)
    results = [K.ssd(**kw, chunk_size=q) for q in (16, 32, 128)]
    for y, s in results[1:]:
        close(y, results[0][0], torch.float32)
        close(s, results[0][1], torch.float32)


def test_ssd_nan_as_in_the_reference():
    kw = ssd_args(1, 40, 2, 3, 1, 4)
    kw["x"][0, 20, 1, 2] = float("nan")
    y, s = K.ssd(**kw, chunk_size=16)
    y_ref, s_ref = ssm.ssd_chunked(**kw, chunk_size=16)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.equal(torch.isnan(s), torch.isnan(s_ref))
    assert torch.isfinite(y[:, :16]).all() and torch.isfinite(y[:, :, 0]).all() and torch.isnan(y[:, 20:, 1]).any()


@settings(max_examples=10, deadline=None)
@given(l=st.integers(1, 70), h_per_g=st.integers(1, 3), g=st.integers(1, 2), p=st.integers(1, 20),
       n=st.integers(1, 40), q=st.sampled_from([16, 32]), seed=st.integers(0, 99))
def test_ssd_property(l, h_per_g, g, p, n, q, seed):
    kw = ssd_args(1, l, h_per_g * g, p, g, n, key=seed)
    y, s = K.ssd(**kw, chunk_size=q)
    y_ref, s_ref = ssm.ssd_recurrent(**{k: (v.double() if v is not None else None) for k, v in kw.items()})
    close(y, y_ref, torch.float32)
    close(s, s_ref, torch.float32)


def test_ssd_errors():
    kw = ssd_args(1, 6, 4, 2, 2, 3)
    for q in (8, 24, 512):
        with pytest.raises(ValueError, match="chunk_size must be a power of two from 16 to 256"):
            K.ssd(**kw, chunk_size=q)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        K.ssd(**kw, chunk_size=0)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16 for the kernel"):
        K.ssd(**{**kw, "x": kw["x"].double()})
    with pytest.raises(ValueError, match="must divide"):
        K.ssd(**{**kw, "B": kw["B"][:, :, :1].expand(1, 6, 3, 3), "C": kw["C"][:, :, :1].expand(1, 6, 3, 3)})
    with pytest.raises(ValueError, match="initial_state must have shape"):
        K.ssd(**{**kw, "initial_state": kw["initial_state"][:, :2]})
    with pytest.raises(ValueError, match="x requires grad"):
        K.ssd(**{**kw, "x": kw["x"].clone().requires_grad_()})
    big = ssd_args(1, 2, 1, 1, 1, K.MAX_STATE + 1)
    with pytest.raises(ValueError, match="state size n = 257"):
        K.ssd(**big, chunk_size=16)


@settings(max_examples=15, deadline=None)
@given(which=st.sampled_from(["x", "dt", "A", "B", "C", "D", "initial_state"]),
       how=st.sampled_from(["drop_dim", "shrink", "int", "list"]))
def test_ssd_random_bad_arguments_are_refused_naming_the_argument(which, how):
    kw = ssd_args(1, 5, 2, 3, 1, 4)
    t = kw[which]
    if how == "drop_dim":
        bad, err = t[0], ValueError
    elif how == "shrink":
        bad, err = t[..., :-1] if t.shape[-1] > 1 else t[..., :0], ValueError
    elif how == "int":
        bad, err = t.to(torch.int32), TypeError
    else:
        bad, err = t.tolist(), TypeError
    # x and B define the sizes the others are checked against: shrinking one of them is reported on the
    # first argument that no longer fits
    expected = "must have shape" if how == "shrink" and which in ("x", "B") else which
    with pytest.raises(err, match=expected):
        K.ssd(**{**kw, which: bad}, chunk_size=16)
