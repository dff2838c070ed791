"""The Triton kernels chunk_linear_attention and chunk_gated_delta_rule against their chunked PyTorch references
(and, for the delta rule, flash-linear-attention's naive reference).

Output buffers are filled with NaN (the module's ``_empty`` is patched), so an element a kernel forgets to write
fails the comparison. Sizes are odd (T = 1, 15, 64, 100, 257; H = 3; K, V = 12, 20, 40) so every mask is
exercised; strided and expanded views, every dtype, each error message, and hypothesis properties. The kernels
upcast every tile to fp32, so bf16 needs no special handling under the interpreter.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import labsrc  # noqa: F401
from labsrc import linear_attention as la, runtime
from labsrc.kernels import linear_attention as kla

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

# (B, T, H, K, V, chunk)
SHAPES = [(1, 1, 1, 16, 16, 16), (2, 15, 3, 12, 20, 16), (1, 64, 2, 32, 16, 32), (1, 100, 3, 40, 12, 64),
          (1, 257, 1, 16, 24, 64)]


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    monkeypatch.setattr(kla, "_empty", lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                               device=device))


def make(shape, dtype=torch.float32, gate="mixed", betas="uniform", seed=0):
    B, T, H, K, V, _ = shape
    gen = torch.Generator().manual_seed(seed + 31 * T + H)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    u = torch.rand(B, T, H, generator=gen)
    g = {"none": torch.zeros_like(u), "strong": -3.0 - 2 * u, "mixed": -0.5 * u}[gate]
    beta = {"near0": 1e-3 * u, "near1": 1 - 1e-3 * u, "uniform": u}[betas]
    h0 = torch.randn(B, H, K, V, generator=gen)
    lam = 0.6 + 0.4 * torch.rand(H, generator=gen)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [x.to(DEV) for x in (g, beta, h0, lam)]


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    assert not torch.isnan(got).any(), "an element was never written"
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def reference_gdr(q, k, v, g, beta, h0, chunk, scale=None):
    """The chunked reference on the kernel's (rounded) inputs, in float64, output rounded once."""
    o, s = la.gated_delta_rule_chunked(q.double(), k.double(), v.double(), g.double(), beta.double(), scale,
                                       None if h0 is None else h0.double(), True, chunk)
    return o.to(v.dtype), s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_delta_rule_kernel_matches_chunked_reference(shape, dtype):
    q, k, v, g, beta, h0, _ = make(shape, dtype)
    chunk = shape[-1]
    for initial in (None, h0):
        o, s = kla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                          chunk_size=chunk)
        ro, rs = reference_gdr(q, k, v, g, beta, initial, chunk)
        assert o.dtype == dtype and s.dtype == torch.float32
        close(o, ro, dtype)
        close(s, rs, torch.float32 if dtype == torch.float32 else torch.float16)


@pytest.mark.parametrize("gate,betas", [("none", "near1"), ("strong", "near0"), ("none", "near0"),
                                        ("strong", "near1")])
def test_gated_delta_rule_kernel_edge_gates(gate, betas):
    shape = (2, 100, 3, 12, 20, 32)
    q, k, v, g, beta, h0, _ = make(shape, gate=gate, betas=betas)
    o, s = kla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=32)
    ro, rs = reference_gdr(q, k, v, g, beta, h0, 32)
    close(o, ro, torch.float32)
    close(s, rs, torch.float32)


def test_gated_delta_rule_kernel_matches_flash_linear_attention():
    naive_recurrent, naive_chunk = la.fla_naive()
    shape = (2, 100, 3, 12, 20, 64)
    q, k, v, g, beta, h0, _ = make(shape)
    o, s = kla.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.4, initial_state=h0, output_final_state=True)
    for fn, args in ((naive_recurrent, (q, k, v, beta, g)), (naive_chunk, (q, k, v, g, beta))):
        ro, rs = fn(*args, scale=0.4, initial_state=h0, output_final_state=True)
        close(o, ro, torch.float32)
        close(s, rs, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_attention_kernel_matches_lightning(shape, dtype):
    q, k, v, _, _, h0, lam = make(shape, dtype)
    chunk = shape[-1]
    for decay, initial in ((None, None), (lam, h0)):
        o, s = kla.chunk_linear_attention(q, k, v, decay, chunk, 0.5, initial, True)
        ro, rs = la.lightning_attention(q.double(), k.double(), v.double(), None if decay is None else
                                        decay.double(), 7, 0.5, None if initial is None else initial.double(),
                                        True)
        close(o, ro.to(dtype), dtype)
        close(s, rs, torch.float32 if dtype == torch.float32 else torch.float16)


def test_strided_and_expanded_views():
    B, T, H, K, V = 2, 37, 3, 12, 20
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(B, H, T, 2 * K, generator=gen).to(DEV)
    q = big[..., ::2].transpose(1, 2)                       # last dim not dense: copied
    k = torch.nn.functional.normalize(big[..., K:], dim=-1).transpose(1, 2)    # strided, dense last dim
    v = torch.randn(1, T, 1, V, generator=gen).to(DEV).expand(B, T, H, V)      # expanded
    g = (-0.3 * torch.rand(T, 1, generator=gen)).to(DEV).expand(B, T, H)       # expanded gate
    beta = torch.rand(B, H, T, generator=gen).to(DEV).transpose(1, 2)          # transposed
    o, s = kla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    ro, rs = reference_gdr(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                           None, 16)
    close(o, ro, torch.float32)
    close(s, rs, torch.float32)
    o, s = kla.chunk_linear_attention(q, k, v, None, 16, 1.0, None, True)
    ro, rs = la.lightning_attention(q.double(), k.double(), v.double(), None, 16, 1.0, None, True)
    close(o, ro, torch.float32)
    close(s, rs, torch.float32)


def test_nan_propagates_as_in_the_reference():
    shape = (1, 40, 2, 16, 16, 16)
    q, k, v, g, beta, _, lam = make(shape)
    v = v.clone()
    v[0, 20, 1, 3] = float("nan")
    o, _ = kla.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    ro, _ = la.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=16)
    assert torch.equal(torch.isnan(o), torch.isnan(ro)) and torch.isnan(o).any()
    o, _ = kla.chunk_linear_attention(q, k, v, lam, 16)
    ro, _ = la.lightning_attention(q, k, v, lam, 16)
    assert torch.equal(torch.isnan(o), torch.isnan(ro)) and torch.isnan(o).any()


def _args():
    q, k, v, g, beta, h0, _ = make((1, 5, 2, 16, 16, 16))
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


@pytest.mark.parametrize("change,exc,message", [
    (dict(chunk_size=48), ValueError, "chunk_size must be 16, 32, 64 or 128"),
    (dict(q=torch.zeros(1, 5, 2, 16, dtype=torch.float64), k=torch.zeros(1, 5, 2, 16, dtype=torch.float64),
          v=torch.zeros(1, 5, 2, 16, dtype=torch.float64)), TypeError, "q must be float32, float16 or bfloat16"),
    (dict(q=torch.zeros(1, 5, 2, 300), k=torch.zeros(1, 5, 2, 300), initial_state=None), ValueError,
     r"K \(the head dim of q and k\) = 300 exceeds"),
    (dict(v=torch.zeros(1, 5, 2, 257), initial_state=None), ValueError, r"V \(the head dim of v\) = 257"),
    (dict(g=torch.zeros(1, 5, 2, dtype=torch.int32)), TypeError, "g must be a float tensor"),
    (dict(beta=torch.full((1, 5, 2), 2.0)), ValueError, "beta must lie in"),
    (dict(g=torch.ones(1, 5, 2)), ValueError, "g must be <= 0"),
    (dict(q=torch.zeros(1, 5, 2, 16, requires_grad=True)), ValueError, "inference-only"),
])
def test_gated_delta_rule_kernel_error_messages(change, exc, message):
    args = {**_args(), **change}
    chunk = args.pop("chunk_size", 16)
    with pytest.raises(exc, match=message):
        kla.chunk_gated_delta_rule(**args, chunk_size=chunk)


def test_linear_attention_kernel_error_messages():
    a = _args()
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\]"):
        kla.chunk_linear_attention(a["q"], a["k"], a["v"], torch.tensor([1.0, 1.5]))
    with pytest.raises(ValueError, match="chunk_size must be 16, 32, 64 or 128"):
        kla.chunk_linear_attention(a["q"], a["k"], a["v"], None, 100)
    with pytest.raises(ValueError, match="inference-only"):
        kla.chunk_linear_attention(a["q"], a["k"], a["v"], torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="B \\* H = 70000 programs exceed"):
        z = torch.zeros(35000, 1, 2, 16)
        kla.chunk_linear_attention(z, z, z)


@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 70), H=st.integers(1, 3), K=st.integers(1, 33), V=st.integers(1, 33),
       chunk=st.sampled_from([16, 32]), gate=st.sampled_from(["none", "strong", "mixed"]),
       betas=st.sampled_from(["near0", "near1", "uniform"]), with_state=st.booleans(), seed=st.integers(0, 99))
def test_property_kernel_equals_reference(T, H, K, V, chunk, gate, betas, with_state, seed):
    q, k, v, g, beta, h0, lam = make((1, T, H, K, V, chunk), gate=gate, betas=betas, seed=seed)
    h0 = h0 if with_state else None
    o, s = kla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      chunk_size=chunk)
    ro, rs = reference_gdr(q, k, v, g, beta, h0, chunk)
    close(o, ro, torch.float32)
    close(s, rs, torch.float32)
    o, s = kla.chunk_linear_attention(q, k, v, lam, chunk, 1.0, h0, True)
    ro, rs = la.lightning_attention(q.double(), k.double(), v.double(), lam.double(), chunk, 1.0,
                                    None if h0 is None else h0.double(), True)
    close(o, ro, torch.float32)
    close(s, rs, torch.float32)


@settings(max_examples=10, deadline=None)
@given(bad=st.sampled_from(["chunk", "dtype", "shape", "gate", "scale"]), value=st.integers(0, 3))
def test_property_bad_arguments_are_refused_naming_them(bad, value):
    a = _args()
    kw = dict(chunk_size=16)
    name = {"chunk": "chunk_size", "dtype": "q", "shape": "v", "gate": "g", "scale": "scale"}[bad]
    if bad == "chunk":
        kw["chunk_size"] = (0, 8, 24, 256)[value]
    elif bad == "dtype":
        a["q"] = a["q"].to((torch.int32, torch.int64, torch.bool, torch.uint8)[value])
    elif bad == "shape":
        a["v"] = a["v"][:, : 4 - value] if value < 4 else a["v"][None]
    elif bad == "gate":
        a["g"] = a["g"][..., :1].expand(1, 5, 2)[:, :value + 1] if value < 3 else torch.ones(1, 5, 2)
    else:
        kw["scale"] = (-1.0, 0.0, float("inf"), float("nan"))[value]
    with pytest.raises((ValueError, TypeError), match=name):
        kla.chunk_gated_delta_rule(**a, **kw)
