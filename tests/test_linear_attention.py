"""The from-scratch references of the linear-attention chapter (labsrc.linear_attention): each form against
another (quadratic vs recurrent vs chunked), against flash-linear-attention's naive references (code we did
not write), Performer's features against the softmax kernel they estimate, and every error message.

Grids use odd lengths (1, 15, 64, 100, 257 where it is cheap), head counts and head dims that are not powers of
two, with and without an initial state, no decay (g = 0) and strong decay, beta near 0 and near 1."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import labsrc  # noqa: F401
from labsrc import linear_attention as la

pytestmark = pytest.mark.filterwarnings("error")   # fla's import warnings are silenced in fla_naive only

# (B, T, H, K, V)
SHAPES = [(1, 1, 1, 4, 3), (2, 15, 3, 12, 7), (1, 64, 2, 16, 16), (2, 100, 3, 10, 6), (1, 257, 1, 6, 5)]
GATES = ["none", "strong", "mixed"]
BETAS = ["near0", "near1", "uniform"]


def inputs(shape, gate="mixed", betas="uniform", dtype=torch.float64, seed=0, normalize=True):
    B, T, H, K, V = shape
    gen = torch.Generator().manual_seed(seed * 1000 + T * 7 + H)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    if normalize:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    u = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = {"none": torch.zeros_like(u), "strong": -3.0 - 2 * u, "mixed": -0.5 * u}[gate]
    beta = {"near0": 1e-3 * u, "near1": 1 - 1e-3 * u, "uniform": u}[betas]
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v)] + [g, beta, h0]


# -------------------------------------------------------------------------------------------- delta rule

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("betas", BETAS)
def test_chunked_delta_rule_equals_recurrent(shape, gate, betas):
    q, k, v, g, beta, h0 = inputs(shape, gate, betas)
    for initial in (None, h0):
        o1, s1 = la.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=initial, output_final_state=True)
        for chunk in (16, 64):
            o2, s2 = la.gated_delta_rule_chunked(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                                 chunk_size=chunk)
            torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
@pytest.mark.parametrize("gate,betas", [("none", "near1"), ("strong", "near0"), ("mixed", "uniform")])
def test_delta_rule_matches_flash_linear_attention(shape, gate, betas):
    naive_recurrent, naive_chunk = la.fla_naive()
    q, k, v, g, beta, h0 = inputs(shape, gate, betas)
    scale = 0.7
    for initial in (None, h0):
        ours, s_ours = la.gated_delta_rule_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial,
                                                     output_final_state=True)
        chunked, s_chunked = la.gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, initial_state=initial,
                                                         output_final_state=True, chunk_size=16)
        # fla computes in float32 whatever it is given: compare at float32 accuracy
        theirs, s_theirs = naive_recurrent(q, k, v, beta, g, scale=scale, initial_state=initial,
                                           output_final_state=True)
        theirs_c, s_theirs_c = naive_chunk(q, k, v, g, beta, chunk_size=16, scale=scale, initial_state=initial,
                                           output_final_state=True)
        for a, b in ((ours, theirs), (chunked, theirs_c), (ours, theirs_c)):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5)
        for a, b in ((s_ours, s_theirs), (s_chunked, s_theirs_c)):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5)


def test_delta_rule_default_scale_and_no_final_state():
    q, k, v, g, beta, _ = inputs((1, 9, 2, 9, 4))
    o, s = la.gated_delta_rule_recurrent(q, k, v, g, beta)
    o2, _ = la.gated_delta_rule_recurrent(q, k, v, g, beta, scale=9 ** -0.5)
    assert s is None and torch.equal(o, o2)
    assert la.gated_delta_rule_chunked(q, k, v, g, beta)[1] is None


def test_delta_rule_with_beta_one_stores_the_value_exactly():
    """beta = 1, unit keys, no decay: after writing (k, v) the state returns v for k, whatever was stored
    before (the overwrite linear attention cannot do)."""
    q, k, v, g, beta, h0 = inputs((1, 6, 1, 8, 5), gate="none")
    beta = torch.ones_like(beta)
    _, S = la.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(torch.einsum("hkv,hk->hv", S[0], k[0, -1]), v[0, -1], rtol=1e-12, atol=1e-12)


def test_delta_rule_state_continues_across_calls():
    q, k, v, g, beta, h0 = inputs((2, 40, 2, 6, 3))
    o, s = la.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, s1 = la.gated_delta_rule_chunked(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23],
                                         initial_state=h0, output_final_state=True, chunk_size=8)
    o2, s2 = la.gated_delta_rule_chunked(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:],
                                         initial_state=s1, output_final_state=True, chunk_size=8)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_delta_rule_low_precision_inputs(dtype):
    q, k, v, g, beta, h0 = inputs((2, 30, 3, 8, 6), dtype=dtype)
    o, s = la.gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0.float(), output_final_state=True,
                                       chunk_size=16)
    assert o.dtype == dtype and s.dtype == torch.float32
    ref, s_ref = la.gated_delta_rule_recurrent(q.double(), k.double(), v.double(), g, beta, initial_state=h0,
                                               output_final_state=True)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(o.double(), ref.to(dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-5)


def test_nan_in_one_head_stays_in_that_head():
    q, k, v, g, beta, _ = inputs((1, 20, 2, 4, 3))
    v = v.clone()
    v[0, 5, 1, 0] = float("nan")
    # value columns never mix (the state's columns evolve independently): only column 0 of head 1 is hit
    o, _ = la.gated_delta_rule_recurrent(q, k, v, g, beta)
    assert torch.isfinite(o[:, :, 0]).all() and torch.isfinite(o[:, :, 1, 1:]).all()
    assert torch.isfinite(o[:, :5, 1, 0]).all() and torch.isnan(o[:, 5:, 1, 0]).all()
    o, _ = la.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=4)   # NaN from its chunk's start (t = 4)
    assert torch.isfinite(o[:, :, 0]).all() and torch.isfinite(o[:, :, 1, 1:]).all()
    assert torch.isfinite(o[:, :4, 1, 0]).all() and torch.isnan(o[:, 4:, 1, 0]).all()


# --------------------------------------------------------------------------------- linear attention, Lightning

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("decayed", [False, True])
def test_lightning_equals_recurrent(shape, decayed):
    q, k, v, *_, h0 = inputs(shape, normalize=False)
    gen = torch.Generator().manual_seed(1)
    decay = (0.5 + 0.5 * torch.rand(shape[2], generator=gen, dtype=torch.float64)) if decayed else None
    for initial in (None, h0):
        o1, s1 = la.linear_attention_recurrent(q, k, v, decay, 0.3, initial, True)
        for block in (1, 16, 64):
            o2, s2 = la.lightning_attention(q, k, v, decay, block, 0.3, initial, True)
            torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fm", la.FEATURE_MAPS)
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
def test_linear_attention_quadratic_equals_rnn_with_a_ones_column(shape, fm):
    """Katharopoulos's causal form = the RNN form with the denominator as an extra value column of ones."""
    q, k, v, *_ = inputs(shape, normalize=False)
    if fm == "identity":   # identity features can make the denominator vanish; keep them positive
        q, k = q.abs(), k.abs()
    eps = 1e-6   # relu features can give a zero denominator
    ref = la.linear_attention(q, k, v, feature_map=fm, causal=True, eps=eps)
    ones = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    num, _ = la.linear_attention_recurrent(la.phi(q, fm), la.phi(k, fm), ones)
    torch.testing.assert_close(num[..., :-1] / (num[..., -1:] + eps), ref, rtol=1e-9, atol=1e-9)
    # the non-causal form: every query sees the whole sequence, i.e. the causal output of the last token
    full = la.linear_attention(q, k, v, feature_map=fm, causal=False, eps=eps)
    torch.testing.assert_close(full[:, -1], ref[:, -1], rtol=1e-9, atol=1e-9)


def test_linear_attention_is_softmax_smoother_with_exp_features():
    """With phi(q).phi(k) = exp(q.k) exactly (the kernel view), linear attention is softmax attention."""
    q, k, v, *_ = inputs((1, 11, 2, 3, 4), normalize=False)
    ref = la.softmax_attention(q, k, v, causal=True, scale=1.0)
    scores = torch.einsum("bthk,bshk->bhts", q, k).exp().tril()
    out = torch.einsum("bhts,bshv->bthv", scores, v) / scores.sum(-1).transpose(1, 2)[..., None]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------------ Performer

def test_orthogonal_projection_rows_are_orthogonal_within_blocks():
    w = la.orthogonal_projection(20, 8, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert w.shape == (20, 8)
    for block in (w[:8], w[8:16]):
        gram = block @ block.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-10
    with pytest.raises(ValueError, match="m must be a positive int"):
        la.orthogonal_projection(0, 4)


@pytest.mark.parametrize("kind", ["positive", "trig"])
def test_performer_features_estimate_the_softmax_kernel_without_bias(kind):
    """The mean of phi(q).phi(k) over many independent projections approaches exp(q.k) (a 6-sigma band)."""
    gen = torch.Generator().manual_seed(3)
    d = 4
    x = torch.randn(2, d, generator=gen, dtype=torch.float64) * 0.5
    exact = math.exp(float(x[0] @ x[1]))
    draws = []
    for _ in range(400):
        w = la.orthogonal_projection(8, d, gen, dtype=torch.float64)
        f = la.performer_features(x, w, kind)
        draws.append(float(f[0] @ f[1]))
    draws = torch.tensor(draws, dtype=torch.float64)
    assert abs(float(draws.mean()) - exact) < 6 * float(draws.std()) / math.sqrt(len(draws))
    if kind == "positive":
        assert bool((la.performer_features(x, w, kind) > 0).all())


def test_favor_attention_converges_to_softmax_with_more_features():
    q, k, v, *_ = inputs((1, 32, 2, 8, 4), normalize=False)
    ref = la.softmax_attention(q * 0.5, k * 0.5, v, causal=False)
    errs = []
    for m in (8, 512):
        w = la.orthogonal_projection(m, 8, torch.Generator().manual_seed(m), dtype=torch.float64)
        errs.append(float((la.favor_attention(q * 0.5, k * 0.5, v, w) - ref).abs().mean()))
    assert errs[1] < errs[0] / 3


# -------------------------------------------------------------------------------------------- arithmetic

def test_state_bytes():
    assert la.state_bytes("softmax", n_heads=8, head_dim=64, n_kv_heads=2, tokens=10) == 2 * 2 * 64 * 10 * 2
    assert la.state_bytes("linear", n_heads=8, head_dim=64) == 8 * 64 * 64 * 4
    with pytest.raises(ValueError, match="kind must be"):
        la.state_bytes("mamba", n_heads=1, head_dim=1)


# ------------------------------------------------------------------------------------------ error messages

def _base():
    q, k, v, g, beta, h0 = inputs((1, 5, 2, 4, 3))
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


@pytest.mark.parametrize("change,exc,message", [
    (dict(q="x"), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(5, 2, 4, dtype=torch.float64)), ValueError, "q must have 4 dimensions"),
    (dict(k=torch.zeros(1, 5, 2, 5, dtype=torch.float64)), ValueError, "k must have the shape of q"),
    (dict(v=torch.zeros(1, 4, 2, 3, dtype=torch.float64)), ValueError, "v must be"),
    (dict(v=torch.zeros(1, 5, 2, 3, dtype=torch.float32)), TypeError, "share one dtype"),
    (dict(q=torch.zeros(1, 5, 2, 4, dtype=torch.int64)), TypeError, "q must be float32"),
    (dict(g=torch.zeros(1, 5, 3, dtype=torch.float64)), ValueError, "g must have shape"),
    (dict(g=torch.ones(1, 5, 2, dtype=torch.float64)), ValueError, "g must be <= 0"),
    (dict(g=torch.zeros(1, 5, 2, dtype=torch.int64)), TypeError, "g must be a float tensor"),
    (dict(beta=torch.full((1, 5, 2), 1.5, dtype=torch.float64)), ValueError, "beta must lie in"),
    (dict(beta=[0.5]), TypeError, "beta must be a torch.Tensor"),
    (dict(scale=-1.0), ValueError, "scale must be a finite positive"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite positive"),
    (dict(initial_state=torch.zeros(1, 2, 4, 4)), ValueError, "initial_state must have shape"),
    (dict(initial_state=torch.zeros(1, 2, 4, 3, dtype=torch.float16)), TypeError, "initial_state must be float32"),
    (dict(initial_state="s"), TypeError, "initial_state must be a torch.Tensor"),
    (dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
])
def test_delta_rule_error_messages(change, exc, message):
    args = {**_base(), **change}
    chunk = args.pop("chunk_size", 16)
    with pytest.raises(exc, match=message):
        la.gated_delta_rule_chunked(**args, chunk_size=chunk)
    if "chunk_size" not in change:
        with pytest.raises(exc, match=message):
            la.gated_delta_rule_recurrent(**args)


@pytest.mark.parametrize("change,exc,message", [
    (dict(decay=torch.ones(3, dtype=torch.float64)), ValueError, r"decay must have shape \(H,\)"),
    (dict(decay=torch.tensor([0.5, 0.0], dtype=torch.float64)), ValueError, r"decay must lie in \(0, 1\]"),
    (dict(decay=torch.tensor([1, 1])), TypeError, "decay must be a float tensor"),
    (dict(decay=0.9), TypeError, "decay must be a torch.Tensor"),
    (dict(q=torch.zeros(1, 0, 2, 4, dtype=torch.float64), k=torch.zeros(1, 0, 2, 4, dtype=torch.float64),
          v=torch.zeros(1, 0, 2, 3, dtype=torch.float64)), ValueError, "at least one token"),
])
def test_linear_error_messages(change, exc, message):
    base = _base()
    args = {**dict(q=base["q"], k=base["k"], v=base["v"], decay=None), **change}
    with pytest.raises(exc, match=message):
        la.lightning_attention(**args)
    with pytest.raises(exc, match=message):
        la.linear_attention_recurrent(**args)


def test_other_error_messages():
    q, k, v, *_ = inputs((1, 5, 2, 4, 3))
    with pytest.raises(ValueError, match="feature_map must be one of"):
        la.linear_attention(q, k, v, feature_map="softmax")
    with pytest.raises(TypeError, match="causal must be a bool"):
        la.linear_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="kind must be 'positive' or 'trig'"):
        la.performer_features(q, torch.zeros(3, 4), "cos")
    with pytest.raises(ValueError, match="proj must be an"):
        la.performer_features(q, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        la.lightning_attention(q, k, v, block_size=0)


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 40), H=st.integers(1, 3), K=st.integers(1, 9), V=st.integers(1, 9),
       chunk=st.sampled_from([1, 3, 16, 64]), gate=st.sampled_from(GATES), betas=st.sampled_from(BETAS),
       seed=st.integers(0, 1000))
def test_property_chunked_equals_recurrent(T, H, K, V, chunk, gate, betas, seed):
    q, k, v, g, beta, h0 = inputs((1, T, H, K, V), gate, betas, seed=seed)
    o1, s1 = la.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = la.gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         chunk_size=chunk)
    torch.testing.assert_close(o2, o1, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(s2, s1, rtol=1e-8, atol=1e-8)
