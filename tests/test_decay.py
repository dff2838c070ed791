"""Chunked decays at extreme gates: the chunked forms (references and kernels) against the recurrences.

The chunked gated delta rule, SSD and Lightning attention used to take the decay between two positions of a
chunk as ``exp(cs_t - cs_s)``, a difference of prefix sums. After one very negative log-decay the later small
ones vanish in float32 spacing (an O(1) error against the recurrence), and a log-decay of ``-inf`` (a decay of
exactly zero: a reset) gave NaN. These tests put reset gates at random positions and compare with the
recurrent forms in float64, never only with flash-linear-attention, whose naive chunk has the same flaw.
Kernels run under the Triton interpreter in float32; tolerances are float32 rounding of O(1) outputs.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import labsrc  # noqa: F401  (interpreter before triton)
from labsrc import linear_attention as la, ssm
from labsrc.decay import segsum
from labsrc.kernels import linear_attention as kla, ssm as kssm
from labsrc.kernels._decay import chunk_segsum, last_row
from labsrc.kernels._triton import tl, triton

RESETS = (-1e9, -200.0, float("-inf"))   # a huge log-decay, one beyond float32's exp range, a decay of zero


def _loop_segsum(a):
    T = a.shape[-1]
    out = torch.full((T, T), float("-inf"), dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            out[t, s] = sum(float(a[k]) for k in range(s + 1, t + 1))
    return out


def test_segsum_sums_each_segment():
    a = -torch.rand(9, dtype=torch.float64)
    a[4] = -1e9
    torch.testing.assert_close(segsum(a), _loop_segsum(a), rtol=0, atol=1e-12)
    # after the huge step the small ones survive: the segment (5, 8] is exactly the sum of its three terms
    assert segsum(a)[8, 5] == pytest.approx(float(a[6] + a[7] + a[8]), abs=1e-15)


def test_segsum_minus_inf_is_a_zero_decay_not_nan():
    a = torch.tensor([-0.1, float("-inf"), -0.2, -0.3])
    seg = segsum(a)
    assert not torch.isnan(seg).any()
    assert seg[1, 0] == float("-inf") and seg[3, 0] == float("-inf")      # segments across the reset
    assert seg[3, 1] == pytest.approx(-0.5) and seg[2, 2] == 0             # segments after it are untouched
    nan = segsum(torch.tensor([-0.1, float("nan"), -0.2]))
    assert torch.isnan(nan[1, 0]) and torch.isnan(nan[2, 0]) and nan[2, 1] == pytest.approx(-0.2)


def _gates(gen, B, T, H, resets, where):
    g = -torch.rand(B, T, H, generator=gen) * 0.2
    for i, (t, h) in enumerate(where):
        g[:, t % T, h % H] = resets[i % len(resets)]
    return g


def _delta_inputs(gen, B, T, H, K, V):
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, beta


@settings(max_examples=12, deadline=None)
@given(T=st.integers(2, 70), H=st.integers(1, 2), K=st.integers(1, 20), V=st.integers(1, 20),
       chunk=st.sampled_from([16, 32]), resets=st.lists(st.sampled_from(RESETS), min_size=1, max_size=3),
       where=st.lists(st.tuples(st.integers(0, 69), st.integers(0, 1)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_gated_delta_rule_reset_gates_match_the_recurrence(T, H, K, V, chunk, resets, where, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, beta = _delta_inputs(gen, 1, T, H, K, V)
    g = _gates(gen, 1, T, H, resets, where)
    h0 = torch.randn(1, H, K, V, generator=gen)
    want, want_s = la.gated_delta_rule_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                 initial_state=h0.double(), output_final_state=True)
    ref, ref_s = la.gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             chunk_size=chunk)
    with torch.no_grad():
        got, got_s = kla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                chunk_size=chunk)
    for out, state in ((ref, ref_s), (got, got_s)):
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), want_s, rtol=1e-4, atol=1e-4)


def test_gated_delta_rule_small_gates_after_a_huge_one_are_kept():
    # the failure in its plainest form: one step of g = -1e9, then g = -0.05 per step; the decays between two
    # later steps must stay exp(-0.05 * gap), which a difference of prefix sums rounds to 1
    gen = torch.Generator().manual_seed(0)
    q, k, v, beta = _delta_inputs(gen, 1, 32, 1, 8, 8)
    g = torch.full((1, 32, 1), -0.05)
    g[0, 1, 0] = -1e9
    want, _ = la.gated_delta_rule_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double())
    ref, _ = la.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=32)
    with torch.no_grad():
        got, _ = kla.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32)
    torch.testing.assert_close(ref.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def _ssd_inputs(gen, l, h, p, n):
    x = torch.randn(1, l, h, p, generator=gen)
    dt = torch.rand(1, l, h, generator=gen) * 0.5 + 0.05
    B = torch.randn(1, l, 1, n, generator=gen)
    C = torch.randn(1, l, 1, n, generator=gen)
    return x, dt, B, C


@settings(max_examples=12, deadline=None)
@given(l=st.integers(2, 70), h=st.integers(1, 2), p=st.integers(1, 20), n=st.integers(1, 20),
       chunk=st.sampled_from([16, 32]), big_dt=st.sampled_from([1e3, 1e9, 1e30]),
       where=st.lists(st.tuples(st.integers(0, 69), st.integers(0, 1)), min_size=1, max_size=3),
       minus_inf_A=st.booleans(), seed=st.integers(0, 2**16))
def test_ssd_extreme_decays_match_the_recurrence(l, h, p, n, chunk, big_dt, where, minus_inf_A, seed):
    gen = torch.Generator().manual_seed(seed)
    x, dt, B, C = _ssd_inputs(gen, l, h, p, n)
    A = -torch.rand(h, generator=gen) - 0.1
    if minus_inf_A:
        A[0] = -math.inf                     # head 0 forgets everything at every step: y_t reads only x_t
    # steps with a huge dt (dt * A far below float32's exp range): x is zeroed there so that dt * x stays
    # finite (a dt of inf would make dt * x NaN in the recurrence too; A = -inf is the decay of exactly zero)
    for t, hh in where:
        dt[0, t % l, hh % h] = big_dt
        x[0, t % l, hh % h] = 0.0
    s0 = torch.randn(1, h, p, n, generator=gen)
    args = (x, dt, A, B, C)
    want, want_s = ssm.ssd_recurrent(*(a.double() for a in args), initial_state=s0.double())
    ref, ref_s = ssm.ssd_chunked(*args, initial_state=s0, chunk_size=chunk)
    with torch.no_grad():
        got, got_s = kssm.ssd(*args, initial_state=s0, chunk_size=chunk)
    for out, state in ((ref, ref_s), (got, got_s)):
        assert not torch.isnan(out).any() and not torch.isnan(state).any()
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), want_s, rtol=1e-4, atol=1e-4)


def test_ssd_decay_mask_and_attention_form_survive_minus_inf():
    gen = torch.Generator().manual_seed(1)
    x, dt, B, C = _ssd_inputs(gen, 11, 2, 4, 3)
    A = torch.tensor([-math.inf, -0.5])
    want, _ = ssm.ssd_recurrent(x.double(), dt.double(), A.double(), B.double(), C.double())
    got = ssm.ssd_attention(x.double(), dt.double(), A.double(), B.double(), C.double())
    torch.testing.assert_close(got, want)
    L = ssm.ssd_decay_mask(dt, A)
    assert torch.equal(L[0, 0], torch.eye(11)), "A = -inf: only the diagonal (no decay across a step) survives"


@pytest.mark.parametrize("lam", [1e-50, 1e-300])
def test_lightning_decay_that_underflows_float32_is_zero(lam):
    # a float64 decay in (0, 1] that float32 holds as 0: log gives -inf, which must act as a decay of zero
    gen = torch.Generator().manual_seed(2)
    q, k, v, _ = _delta_inputs(gen, 1, 40, 2, 8, 8)
    decay = torch.tensor([0.9, lam], dtype=torch.float64)
    want, want_s = la.linear_attention_recurrent(q.double(), k.double(), v.double(), decay,
                                                 output_final_state=True)   # float64 keeps lam > 0
    ref, ref_s = la.lightning_attention(q, k, v, decay, 16, output_final_state=True)
    with torch.no_grad():
        got, got_s = kla.chunk_linear_attention(q, k, v, decay, 16, output_final_state=True)
    for out, state in ((ref, ref_s), (got, got_s)):
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), want_s, rtol=1e-4, atol=1e-4)


@triton.jit
def _segsum_probe(a_ptr, seg_ptr, last_ptr, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    seg = chunk_segsum(tl.load(a_ptr + rows), BLOCK)
    tl.store(seg_ptr + rows[:, None] * BLOCK + rows[None, :], seg)
    tl.store(last_ptr + rows, last_row(seg, BLOCK))


def _tile_segsum(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch chunk_segsum and last_row on one chunk ``a (BLOCK,)`` float32; returns the tile and the row."""
    n = a.shape[0]
    seg = torch.full((n, n), float("nan"))
    last = torch.full((n,), float("nan"))
    _segsum_probe[(1,)](a.contiguous(), seg, last, BLOCK=n)
    return seg, last


@pytest.mark.skipif(not labsrc.runtime.HAS_TRITON, reason="launches a Triton kernel")
@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([16, 32]), specials=st.lists(st.tuples(st.integers(0, 31),
                                                                st.sampled_from(RESETS + (float("nan"),))),
                                                      max_size=3), seed=st.integers(0, 2**16))
def test_chunk_segsum_tile_equals_segsum(n, specials, seed):
    """The kernels' tile against its PyTorch twin, extreme and NaN steps included (NaN only where it belongs)."""
    a = -torch.rand(n, generator=torch.Generator().manual_seed(seed))
    for i, value in specials:
        a[i % n] = value
    seg, last = _tile_segsum(a)
    want = segsum(a.double())
    torch.testing.assert_close(seg.double(), want, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(last.double(), want[-1], rtol=1e-6, atol=1e-6, equal_nan=True)
