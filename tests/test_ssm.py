"""The SSM references (labsrc.ssm) against plain loops and against transformers' PyTorch scans."""
import logging
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import labsrc  # noqa: F401  (interpreter switch before anything imports triton)
from labsrc import ssm
from transformers.models.mamba.modeling_mamba import mamba_selective_scan
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

# transformers warns once that mamba_ssm is absent and it falls back to its PyTorch scans: the ones we want.
logging.getLogger("transformers").setLevel(logging.ERROR)


def ssd_inputs(b, l, h, p, g, n, seed=0, dtype=torch.float32, with_d=True, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    x = r(b, l, h, p)
    dt = (torch.rand(b, l, h, generator=gen, dtype=torch.float64) * 0.6 + 0.02).to(dtype)
    A = (-torch.rand(h, generator=gen, dtype=torch.float64) * 2 - 0.05).to(dtype)
    B, C = r(b, l, g, n), r(b, l, g, n)
    D = r(h) if with_d else None
    s0 = r(b, h, p, n) if with_state else None
    return x, dt, A, B, C, D, s0


def ssd_loop(x, dt, A, B, C, D=None, s0=None):
    """The most literal SSD: Python loops over batch, head, step; float64."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    y = torch.zeros(b, l, h, p, dtype=torch.float64)
    final = torch.zeros(b, h, p, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // g)
            S = torch.zeros(p, n, dtype=torch.float64) if s0 is None else s0[bi, hi].double()
            for t in range(l):
                S = math.exp(float(dt[bi, t, hi] * A[hi])) * S + float(dt[bi, t, hi]) * torch.outer(
                    x[bi, t, hi], B[bi, t, gi])
                y[bi, t, hi] = S @ C[bi, t, gi]
                if D is not None:
                    y[bi, t, hi] += float(D[hi]) * x[bi, t, hi]
            final[bi, hi] = S
    return y, final


SSD_GRID = [  # (b, l, h, p, g, n, chunk)
    (1, 1, 1, 1, 1, 1, 4),
    (2, 7, 3, 5, 1, 4, 4),
    (1, 63, 6, 4, 3, 8, 16),
    (1, 257, 5, 3, 5, 2, 64),
    (2, 33, 4, 2, 2, 64, 8),
]


@pytest.mark.parametrize("shape", SSD_GRID, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_d,with_state", [(True, True), (False, False)])
def test_ssd_recurrent_and_chunked_match_loop(shape, with_d, with_state):
    b, l, h, p, g, n, q = shape
    args = ssd_inputs(b, l, h, p, g, n, seed=l + h, dtype=torch.float64, with_d=with_d, with_state=with_state)
    y0, s0 = ssd_loop(*args)
    y1, s1 = ssm.ssd_recurrent(*args)
    y2, s2 = ssm.ssd_chunked(*args, chunk_size=q)
    for y, s in ((y1, s1), (y2, s2)):
        torch.testing.assert_close(y, y0, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(s, s0, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", SSD_GRID, ids=lambda s: "x".join(map(str, s)))
def test_ssd_chunked_matches_transformers_mamba2_chunk_scan(shape):
    b, l, h, p, g, n, q = shape
    x, dt, A, B, C, D, s0 = ssd_inputs(b, l, h, p, g, n, seed=3 * l + n)
    y, s = ssm.ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=q)
    y_hf, s_hf = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=q, D=D, initial_states=s0, return_final_states=True)
    torch.testing.assert_close(y, y_hf, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_hf, rtol=1e-4, atol=1e-4)


def test_ssd_matches_transformers_with_dt_bias_softplus():
    """transformers folds dt_bias/softplus into the scan; ours takes dt already positive: same result."""
    x, dt_raw, A, B, C, D, s0 = ssd_inputs(2, 45, 4, 3, 2, 6, seed=9)
    dt_raw = torch.randn_like(dt_raw)
    dt_bias = torch.randn(4)
    dt = torch.nn.functional.softplus(dt_raw + dt_bias)
    y, s = ssm.ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16)
    y_hf, s_hf = mamba2_chunk_scan(x, dt_raw, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True,
                                   initial_states=s0, return_final_states=True)
    torch.testing.assert_close(y, y_hf, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_hf, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ssd_low_precision_inputs_compute_in_float32(dtype):
    args = ssd_inputs(1, 21, 2, 4, 1, 8, seed=5, dtype=dtype)
    y, s = ssm.ssd_chunked(*args, chunk_size=8)
    assert y.dtype == dtype and s.dtype == torch.float32
    y64, s64 = ssm.ssd_recurrent(*(t.double() for t in args))
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    torch.testing.assert_close(s.double(), s64, rtol=1e-4, atol=1e-4)


def test_ssd_state_carries_across_calls():
    """Running two halves with the first half's final state equals one run: the cache used in decoding."""
    x, dt, A, B, C, D, s0 = ssd_inputs(2, 40, 3, 4, 3, 5, seed=11, dtype=torch.float64)
    y, s = ssm.ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=8)
    ya, sa = ssm.ssd_chunked(x[:, :17], dt[:, :17], A, B[:, :17], C[:, :17], D, s0, chunk_size=8)
    yb, sb = ssm.ssd_recurrent(x[:, 17:], dt[:, 17:], A, B[:, 17:], C[:, 17:], D, sa)
    torch.testing.assert_close(torch.cat([ya, yb], 1), y)
    torch.testing.assert_close(sb, s)


def test_ssd_attention_duality_and_semiseparable_mask():
    x, dt, A, B, C, D, _ = ssd_inputs(2, 24, 4, 3, 2, 5, seed=2, dtype=torch.float64, with_state=False)
    y_att = ssm.ssd_attention(x, dt, A, B, C, D)
    y_rec, _ = ssm.ssd_recurrent(x, dt, A, B, C, D)
    torch.testing.assert_close(y_att, y_rec)
    L = ssm.ssd_decay_mask(dt, A)
    assert L.shape == (2, 4, 24, 24)
    assert torch.all(torch.triu(L, 1) == 0)
    # every block on or below the diagonal has rank one: L[t, s] = e^{cs_t} e^{-cs_s}
    block = L[0, 1, 12:24, 0:12]
    sv = torch.linalg.svdvals(block)
    assert sv[1] < 1e-10 * sv[0]


def test_ssd_poisoned_input_propagation():
    """A NaN in x at step 9 reaches every later output of its head through the state. The recurrence keeps
    the earlier steps clean; the chunked form also spoils the earlier steps of the NaN's chunk (0 * NaN in
    the masked intra-chunk product; transformers' mamba2_chunk_scan spreads it to every step of the head);
    other heads stay clean."""
    x, dt, A, B, C, D, s0 = ssd_inputs(1, 20, 2, 3, 1, 4, seed=4)
    x[0, 9, 1, 0] = float("nan")
    y, s = ssm.ssd_recurrent(x, dt, A, B, C, D, s0)
    assert torch.isfinite(y[:, :9]).all() and torch.isfinite(y[:, :, 0]).all()
    assert torch.isnan(y[:, 9:, 1]).any(dim=-1).all()
    assert torch.isnan(s[:, 1]).any() and torch.isfinite(s[:, 0]).all()
    y, s = ssm.ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=8)
    assert torch.isfinite(y[:, :8]).all() and torch.isfinite(y[:, :, 0]).all()
    assert torch.isnan(y[:, 8:, 1]).any(dim=-1).all()
    assert torch.isnan(s[:, 1]).any() and torch.isfinite(s[:, 0]).all()


@settings(max_examples=15, deadline=None)
@given(l=st.integers(1, 40), h_per_g=st.integers(1, 3), g=st.integers(1, 2), p=st.integers(1, 4),
       n=st.integers(1, 9), q=st.integers(1, 17), seed=st.integers(0, 1000))
def test_ssd_chunked_property(l, h_per_g, g, p, n, q, seed):
    args = ssd_inputs(1, l, h_per_g * g, p, g, n, seed=seed, dtype=torch.float64)
    y1, s1 = ssm.ssd_recurrent(*args)
    y2, s2 = ssm.ssd_chunked(*args, chunk_size=q)
    torch.testing.assert_close(y2, y1, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-9)


def test_ssd_errors_name_the_argument():
    x, dt, A, B, C, D, s0 = ssd_inputs(1, 6, 4, 2, 2, 3)
    cases = [
        (dict(x=x[0]), ValueError, "x must have 4 dimensions"),
        (dict(x=x.int()), TypeError, "x must be float16"),
        (dict(x=x.tolist()), TypeError, "x must be a torch.Tensor"),
        (dict(dt=dt[:, :5]), ValueError, "dt must have shape"),
        (dict(A=A[:3]), ValueError, "A must have shape"),
        (dict(B=B[:, :, :1].expand(1, 6, 3, 3)), ValueError, "must divide"),
        (dict(B=B[:, :5]), ValueError, "B must have shape"),
        (dict(C=C[..., :2]), ValueError, "C must have shape"),
        (dict(D=D[:2]), ValueError, "D must have shape"),
        (dict(initial_state=s0[..., :2]), ValueError, "initial_state must have shape"),
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (dict(chunk_size=2.5), ValueError, "chunk_size must be a positive int"),
        (dict(x=x[:, :0], dt=dt[:, :0], B=B[:, :0], C=C[:, :0]), ValueError, "non-empty"),
    ]
    base = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=s0, chunk_size=4)
    for change, err, msg in cases:
        with pytest.raises(err, match=msg):
            ssm.ssd_chunked(**{**base, **change})
    with pytest.raises(ValueError, match="meta"):
        ssm.ssd_recurrent(x, dt, A.to("meta"), B, C)


# ---------------------------------------------------------------------------------------------------------
# the selective scan
# ---------------------------------------------------------------------------------------------------------

def sel_inputs(b, d, l, n, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(u=r(b, d, l), delta=r(b, d, l) * 0.5, A=(-torch.rand(d, n, generator=gen, dtype=torch.float64) * 2).to(dtype),
                B=r(b, n, l), C=r(b, n, l), D=r(d), z=r(b, d, l), delta_bias=r(d) * 0.3)


@pytest.mark.parametrize("b,d,l,n", [(1, 1, 1, 1), (2, 3, 7, 4), (1, 5, 63, 16)])
@pytest.mark.parametrize("optional", [True, False])
def test_selective_scan_ref_vs_loop_and_transformers(b, d, l, n, optional):
    kw = sel_inputs(b, d, l, n, seed=l)
    if not optional:
        kw.update(D=None, z=None, delta_bias=None)
        kw["delta"] = kw["delta"].abs() + 0.01
    softplus = optional
    y, last = ssm.selective_scan_ref(**kw, delta_softplus=softplus, return_last_state=True)
    if l <= 7:
        y0, last0 = ssm.selective_scan_loop(**{k: (v.double() if v is not None else None) for k, v in kw.items()},
                                            delta_softplus=softplus, return_last_state=True)
        torch.testing.assert_close(y.double(), y0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last.double(), last0, rtol=1e-5, atol=1e-5)
    y_hf, last_hf = mamba_selective_scan(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"],
                                         kw["delta_bias"], softplus, True)
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, last_hf, rtol=1e-5, atol=1e-5)
    assert y.shape == (b, d, l) and last.shape == (b, d, n)


def test_selective_scan_without_selection_is_the_lti_convolution():
    """With delta, B, C constant in time the selective scan is an LTI SSM: its convolution gives the same y."""
    d, n, l = 1, 4, 30
    A = -torch.rand(d, n, dtype=torch.float64) - 0.1
    Bv, Cv = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    u = torch.randn(1, d, l, dtype=torch.float64)
    delta = torch.full((1, d, l), 0.3, dtype=torch.float64)
    y = ssm.selective_scan_ref(u, delta, A, Bv[None, :, None].expand(1, n, l), Cv[None, :, None].expand(1, n, l))
    Ab, Bb = torch.exp(0.3 * A[0]), 0.3 * Bv  # Mamba's simplified B discretisation (delta B)
    K = ssm.ssm_kernel(Ab, Bb, Cv, l)
    torch.testing.assert_close(y[0, 0], ssm.ssm_conv(K, u[0, 0]))


def test_selective_scan_errors():
    kw = sel_inputs(1, 3, 5, 2)
    cases = [(dict(u=kw["u"][0]), ValueError, "u must have 3"), (dict(delta=kw["delta"][..., :4]), ValueError, "delta"),
             (dict(A=kw["A"][:2]), ValueError, "A must have shape"), (dict(B=kw["B"][:, :1]), ValueError, "B must"),
             (dict(C=kw["C"].int()), TypeError, "C must be float16"), (dict(D=kw["D"][:1]), ValueError, "D must"),
             (dict(z=kw["z"][:, :2]), ValueError, "z must"), (dict(delta_bias=kw["D"][None]), ValueError, "delta_bias")]
    for change, err, msg in cases:
        with pytest.raises(err, match=msg):
            ssm.selective_scan_ref(**{**kw, **change})


# ---------------------------------------------------------------------------------------------------------
# scans
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("l", [1, 2, 7, 8, 63, 257])
def test_linear_scan_ref_and_blelloch_match_loop(l):
    gen = torch.Generator().manual_seed(l)
    a = torch.rand(3, l, generator=gen, dtype=torch.float64)
    b = torch.randn(3, l, generator=gen, dtype=torch.float64)
    h0 = torch.randn(3, generator=gen, dtype=torch.float64)
    ref = ssm.linear_scan_loop(a, b, h0)
    torch.testing.assert_close(ssm.linear_scan_ref(a, b, h0), ref)
    torch.testing.assert_close(ssm.blelloch_scan(a[1], b[1]), ssm.linear_scan_loop(a[1], b[1]))


def test_blelloch_trace_and_work_depth():
    trace = []
    ssm.blelloch_scan(torch.rand(8, dtype=torch.float64), torch.rand(8, dtype=torch.float64), trace)
    ups = [t for t in trace if t[0] == "up"]
    downs = [t for t in trace if t[0] == "down"]
    assert len(ups) == 7 and len(downs) == 7  # P - 1 combines each way
    assert ups[-1] == ("up", 2, 3, 7) and downs[0] == ("down", 2, 3, 7)
    wd = ssm.scan_work_depth(8)
    assert wd["sequential"] == (7, 7) and wd["hillis_steele"] == (7 + 6 + 4, 3) and wd["blelloch"] == (14 + 8, 7)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2)), min_size=3, max_size=3))
def test_scan_combine_is_associative(triple):
    p, q, r = triple
    left = ssm.scan_combine(ssm.scan_combine(p, q), r)
    right = ssm.scan_combine(p, ssm.scan_combine(q, r))
    assert left == pytest.approx(right, rel=1e-12, abs=1e-12)


def test_linear_scan_errors():
    a = torch.rand(2, 5)
    with pytest.raises(ValueError, match="b must have the shape of a"):
        ssm.linear_scan_ref(a, a[:, :4])
    with pytest.raises(ValueError, match="h0 must have shape"):
        ssm.linear_scan_ref(a, a, torch.zeros(3))
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        ssm.linear_scan_ref([1.0], a)


# ---------------------------------------------------------------------------------------------------------
# S4: HiPPO, discretisation, the two faces of an LTI SSM
# ---------------------------------------------------------------------------------------------------------

def test_hippo_legs_entries():
    A, B = ssm.hippo_legs(5)
    assert A.dtype == torch.float64 and A.shape == (5, 5) and B.shape == (5,)
    assert A[3, 1] == pytest.approx(-math.sqrt(7) * math.sqrt(3))
    assert A[2, 2] == -3 and A[1, 3] == 0 and B[4] == pytest.approx(3.0)
    assert torch.all(torch.linalg.eigvals(A).real < 0)


def test_legs_memory_reconstructs_and_random_a_does_not():
    t = torch.linspace(0, 1, 300, dtype=torch.float64)
    f = torch.sin(6 * t) + 0.5 * torch.cos(17 * t)
    c = ssm.legs_memory(f, 32)
    err = (ssm.legs_reconstruct(c[-1], 300) - f).abs().mean()
    assert err < 0.02
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(32, 32, generator=gen, dtype=torch.float64) / 32 ** 0.5
    A_rand = M - 2 * torch.eye(32, dtype=torch.float64)  # stable, no Legendre structure
    c_rand = ssm.legs_memory(f, 32, A_rand, torch.randn(32, generator=gen, dtype=torch.float64))
    assert (ssm.legs_reconstruct(c_rand[-1], 300) - f).abs().mean() > 10 * err


@pytest.mark.parametrize("method", ["zoh", "bilinear"])
def test_discretize_square_and_diagonal_agree_and_faces_match(method):
    a = -torch.rand(6, dtype=torch.float64) - 0.1
    a[2] = 0.0  # the ZOH limit dt*B
    B = torch.randn(6, dtype=torch.float64)
    Ad, Bd = ssm.discretize(a, B, 0.25, method)
    As, Bs = ssm.discretize(torch.diag(a).clone(), B, 0.25, method) if method == "bilinear" else (None, None)
    if method == "zoh":
        nz = a != 0
        As, Bs = ssm.discretize(torch.diag(a[nz]), B[nz], 0.25, method)
        torch.testing.assert_close(torch.diagonal(As), Ad[nz])
        torch.testing.assert_close(Bs, Bd[nz])
        assert Bd[2] == pytest.approx(0.25 * float(B[2]))
        torch.testing.assert_close(Ad, torch.exp(0.25 * a))
    else:
        torch.testing.assert_close(torch.diagonal(As), Ad)
        torch.testing.assert_close(Bs, Bd)
    A, Bh = ssm.hippo_legs(8)
    Ab, Bb = ssm.discretize(A, Bh, 0.05, method)
    C = torch.randn(8, dtype=torch.float64)
    u = torch.randn(2, 60, dtype=torch.float64)
    K = ssm.ssm_kernel(Ab, Bb, C, 60)
    torch.testing.assert_close(ssm.ssm_conv(K, u), ssm.ssm_recurrent(Ab, Bb, C, u))


def test_discretize_zoh_is_exact_for_constant_input():
    """ZOH is exact when u is constant over the step: compare with a fine Euler integration."""
    A, B = ssm.hippo_legs(4)
    Ab, Bb = ssm.discretize(A, B, 0.1, "zoh")
    x = torch.zeros(4, dtype=torch.float64)
    for _ in range(10000):
        x = x + 1e-5 * (A @ x + B)
    torch.testing.assert_close(Bb, x, rtol=1e-3, atol=1e-5)


def test_discretize_errors():
    A, B = ssm.hippo_legs(3)
    with pytest.raises(ValueError, match="method must be"):
        ssm.discretize(A, B, 0.1, "euler")
    with pytest.raises(ValueError, match="dt must be a positive"):
        ssm.discretize(A, B, 0.0)
    with pytest.raises(ValueError, match="A must be square"):
        ssm.discretize(A[:2], B, 0.1)
    with pytest.raises(ValueError, match="B must have shape"):
        ssm.discretize(A, B[:2], 0.1)
    with pytest.raises(ValueError, match="K must have length"):
        ssm.ssm_conv(torch.zeros(3), torch.zeros(4))


def test_state_bytes_is_length_free():
    assert ssm.ssm_state_bytes(2, 4, 16, 8, conv_dim=10, conv_kernel=4, bytes_per_el=2) == 2 * (512 + 40) * 2
