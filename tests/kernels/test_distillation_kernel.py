"""The fused KD kernel (labsrc.kernels.distillation.kd_kl) against kd_loss's soft term and its gradient.

Every buffer the kernels write is prefilled with NaN (``_new`` patched), so a row or column the kernel forgets
fails. Vocabularies 1, 7, 1000 and 2500 (several 1024-wide blocks, the last one partial, so the online
rescaling runs), every dtype, transposed, sliced and expanded inputs, -inf and NaN entries, each error message,
and hypothesis property tests. No tl.dot: bf16 runs natively under the interpreter.
"""
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labsrc  # noqa: F401  (interpreter switch before triton)
from labsrc import distillation, runtime
from labsrc.kernels import distillation as kd

DEV = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32 arithmetic inside; the inputs are rounded once to the dtype, so both sides see the same values
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}
GRAD_TOL = {torch.float32: (1e-5, 1e-7), torch.float16: (2e-3, 1e-6), torch.bfloat16: (1.6e-2, 1e-5)}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(kd, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))


def pair(shape, dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)
    t = (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)
    return s, t


def grads(s, t, T, go):
    """(kernel gradient, autograd gradient of the reference in fp32)."""
    a = s.clone().requires_grad_(True)
    kd.kd_kl(a, t, T).backward(go)
    b = s.float().clone().requires_grad_(True)
    kd.kd_kl_ref(b, t.float(), T).backward(go)
    return a.grad, b.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, T", [((3, 1), 1.0), ((2, 5, 7), 2.0), ((4, 1000), 0.5), ((3, 2500), 4.0)])
def test_forward_and_backward_match_the_reference(shape, T, dtype):
    s, t = pair(shape, dtype, zlib.crc32(repr((shape, T)).encode()))
    got = kd.kd_kl(s, t, T)
    want = kd.kd_kl_ref(s, t, T)
    assert got.shape == shape[:-1] and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    # and the reference is kd_loss's soft term: T² times the mean over rows
    torch.testing.assert_close(T * T * got.mean(), distillation.kd_loss(s, t, T=T), rtol=1e-4, atol=1e-6)
    go = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(1)).to(DEV)
    g_kernel, g_ref = grads(s, t, T, go)
    assert g_kernel.dtype == dtype
    rtol, atol = GRAD_TOL[dtype]
    torch.testing.assert_close(g_kernel.float(), g_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(g_kernel, kd.kd_kl_backward_ref(go, s, t, T), rtol=rtol, atol=atol)


def test_strided_and_expanded_views():
    s, t = pair((300, 6), torch.float32, 5)
    st_, tt = s.t(), t.t()                      # (6, 300), row stride 1: copied to rows
    torch.testing.assert_close(kd.kd_kl(st_, tt, 2.0), kd.kd_kl_ref(st_, tt, 2.0), rtol=1e-5, atol=1e-6)
    sl, tl_ = s[::3].t()[:, ::2], t[::3].t()[:, ::2]  # sliced both ways
    torch.testing.assert_close(kd.kd_kl(sl, tl_, 1.5), kd.kd_kl_ref(sl, tl_, 1.5), rtol=1e-5, atol=1e-6)
    one = t.t()[:1].expand(6, 300)              # one teacher row shared by every student row (stride 0)
    torch.testing.assert_close(kd.kd_kl(st_, one, 1.0), kd.kd_kl_ref(st_, one, 1.0), rtol=1e-5, atol=1e-6)
    a = st_.clone().requires_grad_(True)
    kd.kd_kl(a, one, 3.0).sum().backward()
    torch.testing.assert_close(a.grad, kd.kd_kl_backward_ref(torch.ones(6), st_, one, 3.0), rtol=1e-5, atol=1e-7)


def test_non_finite_entries_follow_the_reference():
    s, t = pair((5, 1500), torch.float32, 6)
    s[0, :40] = t[0, :40] = float("-inf")      # a padded vocabulary: no mass on either side
    t[1, 1100:] = float("-inf")                # the teacher gives no mass; the student's values do not matter
    t[2] = float("-inf")                       # a dead teacher row: KL 0, gradient 0
    s[3, 7] = float("-inf")                    # the student rules out a token the teacher allows: KL inf
    s[4, 3] = float("nan")                     # NaN propagates
    got = kd.kd_kl(s, t, 2.0)
    want = kd.kd_kl_ref(s, t, 2.0)
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-6)
    assert got[2] == 0 and want[2] == 0
    assert got[3] == float("inf") and want[3] == float("inf")
    assert got[4].isnan() and want[4].isnan()
    a = s[:3].clone().requires_grad_(True)
    kd.kd_kl(a, t[:3], 2.0).sum().backward()
    want_g = kd.kd_kl_backward_ref(torch.ones(3), s[:3], t[:3], 2.0)
    torch.testing.assert_close(a.grad, want_g, rtol=1e-5, atol=1e-7)
    assert (a.grad[2] == 0).all() and torch.isfinite(a.grad[:2]).all()


def test_no_grad_path_and_empty_batch():
    s, t = pair((0, 9), torch.float32, 7)
    assert kd.kd_kl(s, t).shape == (0,)
    s, t = pair((2, 9), torch.float32, 8)
    with torch.no_grad():
        out = kd.kd_kl(s.requires_grad_(True), t.requires_grad_(True))
    assert not out.requires_grad


@pytest.mark.parametrize("make, exc, match", [
    (lambda s, t: (s.numpy(), t, 1.0), TypeError, "student_logits must be a torch.Tensor"),
    (lambda s, t: (s, t.long(), 1.0), TypeError, "teacher_logits must be one of"),
    (lambda s, t: (s.double(), t.double(), 1.0), TypeError, "student_logits must be one of"),
    (lambda s, t: (s, t.half(), 1.0), TypeError, "dtype of student_logits"),
    (lambda s, t: (s, t[:, :5], 1.0), ValueError, "shape of student_logits"),
    (lambda s, t: (s[:, :0], t[:, :0], 1.0), ValueError, "V >= 1"),
    (lambda s, t: (s, t.clone().requires_grad_(True), 1.0), ValueError, "must not require grad"),
    (lambda s, t: (s, t, 0.0), ValueError, "T must be"),
    (lambda s, t: (s, t, float("nan")), ValueError, "T must be"),
    (lambda s, t: (s, t, True), ValueError, "T must be"),
    (lambda s, t: (s, t, 1e-40), ValueError, "overflow"),
])
def test_each_error_message(make, exc, match):
    s, t = pair((2, 6), torch.float32, 9)
    with pytest.raises(exc, match=match):
        kd.kd_kl(*make(s, t))


def test_launch_limits_are_refused(monkeypatch):
    s, t = pair((3, 6), torch.float32, 10)
    monkeypatch.setattr(kd, "_MAX_GRID_AXIS_0", 2)
    with pytest.raises(ValueError, match="rows but one launch"):
        kd.kd_kl(s, t)
    monkeypatch.setattr(kd, "_MAX_GRID_AXIS_0", 2 ** 31 - 1)
    monkeypatch.setattr(kd, "_MAX_V", 5)
    with pytest.raises(ValueError, match="int32"):
        kd.kd_kl(s, t)


def test_reference_takes_float64():
    s, t = pair((2, 11), torch.float64, 11)
    want = (torch.softmax(t / 2, -1) * (torch.log_softmax(t / 2, -1) - torch.log_softmax(s / 2, -1))).sum(-1)
    torch.testing.assert_close(kd.kd_kl_ref(s, t, 2.0), want)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 4), V=st.integers(1, 1300), T=st.floats(0.25, 16.0),
       scale=st.sampled_from([0.01, 1.0, 30.0]), transpose=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2 ** 16))
def test_property_matches_reference(rows, V, T, scale, transpose, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (V, rows) if transpose else (rows, V)
    s = (torch.randn(*shape, generator=gen) * scale).to(dtype)
    t = (torch.randn(*shape, generator=gen) * scale).to(dtype)
    if transpose:
        s, t = s.t(), t.t()
    got = kd.kd_kl(s, t, T)
    torch.testing.assert_close(got, kd.kd_kl_ref(s, t, T), rtol=1e-4, atol=1e-5)
    assert (got >= -1e-5).all()  # a KL divergence is never negative


@settings(max_examples=15, deadline=None)
@given(bad=st.sampled_from(["T_neg", "T_str", "shape", "dtype", "int", "list", "scalar"]))
def test_property_bad_arguments_raise(bad):
    s, t = torch.zeros(2, 4), torch.zeros(2, 4)
    args = {"T_neg": (s, t, -1.0), "T_str": (s, t, "2"), "shape": (s, t[:1]), "dtype": (s, t.bfloat16()),
            "int": (s.int(), t.int()), "list": ([0.0], t), "scalar": (torch.tensor(1.0), torch.tensor(1.0))}[bad]
    with pytest.raises((TypeError, ValueError)):
        kd.kd_kl(*args)
