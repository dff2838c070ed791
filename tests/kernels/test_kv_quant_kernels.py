"""Triton KV-quantization kernels against their PyTorch references.

Under the interpreter the kernels compute with the same IEEE fp32 operations as the references (``div_rn``,
half-up rounding, the same fp16 rounding of steps), so codes, steps and zero points are compared bit for bit.
bf16 outputs are compared at bf16 tolerance: the interpreter's fp32 -> bf16 cast may round differently from
torch's by one bf16 ulp. Decode attention's ``tl.dot`` runs on fp16 operands (exact integer codes, hi/lo
splits of fp32 factors) whatever the input dtype, so bf16 inputs need no upcasting under the interpreter.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labsrc  # noqa: F401
from labsrc import kv_quant as kq
from labsrc import runtime
from labsrc.exercises.core import tolerance
from labsrc.kernels import kv_quant as kk

# NaN, inf and fp16-overflow inputs are the point of several tests: the interpreter's NumPy reports them.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _x(shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    return (torch.randn(*shape, generator=gen) * (torch.rand(d, generator=gen) * 3 + 0.1)
            + torch.randn(d, generator=gen)).to(dtype)


@pytest.fixture
def poison(monkeypatch):
    """Every output buffer the wrappers allocate starts as NaN (floats) or 0xAA (bytes), so a slot the kernel
    forgets to write cannot pass by holding the right value by chance."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0xAA)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))


# (shape, bits, group_size, dtype, normalise): odd token counts, partial groups, head dims 64/80/128
QUANT_CASES = [
    ((2, 3, 77, 80), 4, 32, torch.float32, True),
    ((1, 2, 50, 64), 8, 16, torch.float16, False),
    ((3, 45, 128), 2, 128, torch.bfloat16, True),
    ((2, 1, 9, 64), 4, 1, torch.float32, False),  # per token
    ((1, 1, 131, 128), 4, 64, torch.float16, True),
    ((2, 2, 13, 80), 8, 128, torch.bfloat16, False),  # one partial group only
]


@pytest.mark.parametrize("shape,bits,group,dtype,norm", QUANT_CASES)
def test_quantize_pack_matches_ref_bit_for_bit(shape, bits, group, dtype, norm, poison):
    x = _x(shape, seed=sum(shape) + bits, dtype=dtype)
    stats = kq.ChannelStats.of(x) if norm else None
    ref = kk.quantize_pack_ref(x, bits, group, stats)
    got = kk.quantize_pack(x, bits, group, stats)
    assert not torch.isnan(got.scale).any() and not torch.isnan(got.zero).any()
    assert got.packed.shape == ref.packed.shape and got.scale.shape == ref.scale.shape
    if runtime.INTERPRETED:
        assert torch.equal(got.packed, ref.packed)
        assert torch.equal(got.scale, ref.scale) and torch.equal(got.zero, ref.zero)
    else:  # compiled code may fuse a multiply-add and land one code step away, rarely
        diff = (got.codes.int() - ref.codes.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3
        torch.testing.assert_close(got.scale, ref.scale, rtol=2e-3, atol=0)


@pytest.mark.parametrize("shape,bits,group,dtype,norm", QUANT_CASES)
def test_dequantize_unpack_matches_ref(shape, bits, group, dtype, norm, poison):
    x = _x(shape, seed=sum(shape) * 3 + bits, dtype=dtype)
    qt = kq.quantize(x, bits=bits, group_size=group, normalize=norm)
    got = kk.dequantize_unpack(qt)
    ref = kk.dequantize_unpack_ref(qt)
    assert got.dtype == dtype and got.shape == x.shape
    assert not torch.isnan(got).any()
    rtol, atol = tolerance(dtype) if dtype == torch.bfloat16 else (0.0, 0.0)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)


def test_dequantize_unpack_out_dtype():
    qt = kq.quantize(_x((1, 20, 64), seed=1), bits=4, group_size=8)
    got = kk.dequantize_unpack(qt, out_dtype=torch.float16)
    torch.testing.assert_close(got, kk.dequantize_unpack_ref(qt, out_dtype=torch.float16),
                               rtol=tolerance(torch.float16)[0], atol=tolerance(torch.float16)[1])


# (B, Hq, Hkv, T, D, bits, group, normalise keys/values, seq_lens)
DECODE_CASES = [
    (3, 4, 2, 150, 80, 4, 32, True, [150, 1, 77]),
    (2, 8, 1, 67, 64, 8, 16, False, [67, 40]),
    (1, 2, 2, 200, 128, 4, 128, True, [133]),
    (2, 6, 3, 13, 64, 8, 1, True, [13, 3]),  # per-token steps (few tokens: one program per token to quantize)
]


@pytest.mark.parametrize("b,hq,hkv,t,d,bits,group,norm,lens", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_attention_matches_dequantise_then_attend(b, hq, hkv, t, d, bits, group, norm, lens, dtype,
                                                        poison):
    gen = torch.Generator().manual_seed(b * 1000 + t + bits)
    k = _x((b, hkv, t, d), seed=t + d)
    v = _x((b, hkv, t, d), seed=t + d + 1)
    ks = kq.ChannelStats.of(k) if norm else None
    vs = kq.ChannelStats.of(v) if norm else None
    kq_, vq_ = kk.quantize_pack(k, bits, group, ks), kk.quantize_pack(v, bits, group, vs)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = kk.decode_attention_quant_ref(q, kq_, vq_, seq_lens)
    for splits in (1, 3):
        got = kk.decode_attention_quant(q, kq_, vq_, seq_lens, num_splits=splits)
        assert got.dtype == dtype and got.shape == (b, hq, d)
        assert not torch.isnan(got).any()
        rtol, atol = tolerance(dtype)
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol * 10 if dtype == torch.float32 else atol)


def test_decode_attention_close_to_unquantized_attention_at_int8():
    k, v = _x((1, 2, 64, 64), seed=4), _x((1, 2, 64, 64), seed=5)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(6))
    got = kk.decode_attention_quant(q, kk.quantize_pack(k, 8, 16, kq.ChannelStats.of(k)),
                                    kk.quantize_pack(v, 8, 16, kq.ChannelStats.of(v)))
    exact = kk.decode_attention_ref_fp(q, k, v)
    assert float(kq.relative_mse(exact, got)) < 1e-4


def test_decode_ref_fp_handles_lengths():
    k, v = _x((2, 1, 10, 64), seed=7), _x((2, 1, 10, 64), seed=8)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(9))
    lens = torch.tensor([10, 4])
    got = kk.decode_attention_ref_fp(q, k, v, lens)
    short = kk.decode_attention_ref_fp(q[1:], k[1:, :, :4], v[1:, :, :4])
    torch.testing.assert_close(got[1:], short)


# ------------------------------------------------------------------------------------------- errors
def test_quantize_pack_errors():
    x = _x((2, 10, 64), seed=0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        kk.quantize_pack([1.0])
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        kk.quantize_pack(x.double())
    with pytest.raises(ValueError, match="bits must be one of"):
        kk.quantize_pack(x, bits=3)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        kk.quantize_pack(x, group_size=0)
    with pytest.raises(ValueError, match="tokens > 0"):
        kk.quantize_pack(torch.zeros(2, 0, 64))
    with pytest.raises(ValueError, match="head_dim > 0"):
        kk.quantize_pack(torch.zeros(2, 3, 0))
    with pytest.raises(ValueError, match="head_dim 66, which must be a multiple of 4"):
        kk.quantize_pack(torch.zeros(2, 5, 66), bits=2)
    with pytest.raises(ValueError, match="stats have 8 channels but head_dim is 64"):
        kk.quantize_pack(x, stats=kq.ChannelStats(torch.zeros(8), torch.ones(8)))
    with pytest.raises(ValueError, match="do not broadcast"):
        kk.quantize_pack(x, stats=kq.ChannelStats(torch.zeros(3, 64), torch.ones(3, 64)))
    with pytest.raises(TypeError, match="stats must be a ChannelStats"):
        kk.quantize_pack(x, stats=torch.zeros(64))


def test_dequantize_unpack_errors():
    x = _x((2, 10, 64), seed=0)
    with pytest.raises(TypeError, match="qt must be a labsrc.kv_quant.QuantizedTensor"):
        kk.dequantize_unpack(x)
    with pytest.raises(ValueError, match="granularity 'channel'"):
        kk.dequantize_unpack(kq.quantize(x, granularity="channel", group_size=4))
    with pytest.raises(TypeError, match="out_dtype must be"):
        kk.dequantize_unpack(kq.quantize(x), out_dtype=torch.int8)
    bad = kq.quantize(x, group_size=4)
    bad.scale = bad.scale.float()
    with pytest.raises(TypeError, match="qt.scale must have dtype torch.float16"):
        kk.dequantize_unpack(bad)


def test_decode_attention_errors():
    k = kk.quantize_pack(_x((2, 2, 20, 64), seed=1), 4, 8)
    v = kk.quantize_pack(_x((2, 2, 20, 64), seed=2), 4, 8)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match=r"q must be 3-D"):
        kk.decode_attention_quant(q[0], k, v)
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        kk.decode_attention_quant(q.long(), k, v)
    with pytest.raises(TypeError, match="k must be a labsrc.kv_quant.QuantizedTensor"):
        kk.decode_attention_quant(q, k.dequantize(), v)
    with pytest.raises(ValueError, match="decode attention supports bits"):
        kk.decode_attention_quant(q, kk.quantize_pack(_x((2, 2, 20, 64), seed=1), 2, 8),
                                  kk.quantize_pack(_x((2, 2, 20, 64), seed=2), 2, 8))
    with pytest.raises(ValueError, match="does not match the cache shape"):
        kk.decode_attention_quant(torch.randn(2, 4, 80), k, v)
    with pytest.raises(ValueError, match="n_heads 3 must be a positive multiple of n_kv_heads 2"):
        kk.decode_attention_quant(torch.randn(2, 3, 64), k, v)
    with pytest.raises(ValueError, match="k and v must both be"):
        kk.decode_attention_quant(q, k, kk.quantize_pack(_x((2, 2, 21, 64), seed=2), 4, 8))
    with pytest.raises(ValueError, match="k and v must share group_size"):
        kk.decode_attention_quant(q, k, kk.quantize_pack(_x((2, 2, 20, 64), seed=2), 4, 4))
    with pytest.raises(TypeError, match="seq_lens must be an int32 or int64 tensor"):
        kk.decode_attention_quant(q, k, v, seq_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\)"):
        kk.decode_attention_quant(q, k, v, seq_lens=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 20\]"):
        kk.decode_attention_quant(q, k, v, seq_lens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 20\]"):
        kk.decode_attention_quant(q, k, v, seq_lens=torch.tensor([21, 5]))
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        kk.decode_attention_quant(q, k, v, num_splits=0)


# ------------------------------------------------------------------------------------------- edge values (issue 13)
def _same(got: kq.QuantizedTensor, ref: kq.QuantizedTensor) -> None:
    """Bit for bit under the interpreter (NaN equal to NaN)."""
    assert torch.equal(got.packed, ref.packed)
    torch.testing.assert_close(got.scale, ref.scale, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.zero, ref.zero, rtol=0, atol=0, equal_nan=True)


def _overflow_cases():
    x = torch.zeros(1, 2, 6, 8)
    x[0, 1, 5, 3] = 1e6  # a 4-bit step of 66667 > 65504, in a trailing partial group
    yield "range", x, 4, None
    x = torch.zeros(1, 1, 4, 8)
    x[0, 0, 2, 1] = -7e4  # a zero point below -65504
    yield "zero", x, 8, None
    calib = torch.randn(1, 64, 8, generator=torch.Generator().manual_seed(1))
    calib[..., 2] = 0.5  # a constant calibration channel: std floored at 1e-4
    x = _x((1, 1, 16, 8), seed=2)
    x[..., 2] = 0.5
    x[0, 0, 11, 2] = -9.5  # normalises to -1e5
    yield "kvarn", x, 4, kq.ChannelStats.of(calib)


@pytest.mark.parametrize("case,x,bits,stats", list(_overflow_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_fp16_overflow_raises_the_same_error_in_kernel_and_reference(case, x, bits, stats):
    with pytest.raises(ValueError, match="does not fit in fp16") as ref:
        kk.quantize_pack_ref(x, bits, 4, stats)
    with pytest.raises(ValueError, match="does not fit in fp16") as got:
        kk.quantize_pack(x, bits, 4, stats)
    assert str(got.value) == str(ref.value)
    assert "(0, 1, 1, 0)" in str(ref.value) if case == "range" else True


def test_range_1e6_at_8_bits_matches_reference_and_error_bound(poison):
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(2, 3, 21, 16, generator=gen) * 1e6
    x[..., ::8, 0] = 0.0  # every group holds a 0, so its zero point fits fp16 too
    got, ref = kk.quantize_pack(x, 8, 8), kk.quantize_pack_ref(x, 8, 8)
    _same(got, ref)
    y = kk.dequantize_unpack(got)
    assert torch.isfinite(y).all()
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs() + 1)
    assert bool(((x - y).abs() <= got.steps() / 2 + slack).all())


NONFINITE = [(v, pos) for v in (float("nan"), float("inf"), float("-inf"))
             for pos in ((0, 0, 0, 0), (1, 1, 9, 40), (0, 1, 12, 63))]  # first; mid group, high nibble; partial group


@pytest.mark.parametrize("value,pos", NONFINITE)
@pytest.mark.parametrize("norm", [False, True])
def test_nonfinite_inputs_agree_with_reference(value, pos, norm, poison):
    x = _x((2, 2, 13, 64), seed=11)
    stats = kq.ChannelStats.of(x) if norm else None
    x[pos] = value
    got, ref = kk.quantize_pack(x, 4, 4, stats), kk.quantize_pack_ref(x, 4, 4, stats)
    _same(got, ref)
    grp = (pos[0], pos[1], pos[2] // 4, 0)
    assert torch.isnan(got.scale[grp]) and int(torch.isnan(got.scale).sum()) == 1
    y, y_ref = kk.dequantize_unpack(got), kk.dequantize_unpack_ref(got)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    rows = slice(pos[2] // 4 * 4, pos[2] // 4 * 4 + 4)
    assert bool(torch.isnan(y[pos[0], pos[1], rows]).all())
    y[pos[0], pos[1], rows] = 0.0
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("where", ["k_inside", "v_inside", "k_past_len", "v_past_len", "q"])
def test_decode_attention_nonfinite_agrees_with_reference(where, poison):
    b, hq, hkv, t, d = 2, 4, 2, 40, 64
    k, v = _x((b, hkv, t, d), seed=21), _x((b, hkv, t, d), seed=22)
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(23))
    lens = torch.tensor([40, 17], dtype=torch.int32)
    target = {"k_inside": (k, (1, 0, 5, 3)), "v_inside": (v, (1, 0, 5, 3)), "k_past_len": (k, (1, 1, 30, 0)),
              "v_past_len": (v, (1, 1, 30, 0)), "q": (q, (0, 3, 7))}[where]
    target[0][target[1]] = float("nan")
    kq_, vq_ = kk.quantize_pack(k, 8, 8), kk.quantize_pack(v, 8, 8)
    ref = kk.decode_attention_quant_ref(q, kq_, vq_, lens)
    for splits in (1, 2):
        got = kk.decode_attention_quant(q, kq_, vq_, lens, num_splits=splits)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    nan_rows = torch.isnan(ref).all(-1)
    expected = torch.zeros(b, hq, dtype=torch.bool)
    if where in ("k_inside", "v_inside"):
        expected[1, :2] = True  # the query heads of KV head 0 in sequence 1
    elif where == "q":
        expected[0, 3] = True
    assert torch.equal(nan_rows, expected) and bool(torch.isfinite(ref[~expected]).all())


def _tampered():
    def make():
        k = kk.quantize_pack(_x((2, 2, 20, 64), seed=1), 4, 8)
        v = kk.quantize_pack(_x((2, 2, 20, 64), seed=2), 4, 8)
        return k, v

    def packed_shape(k, v):
        k.packed = k.packed[..., :16]
    def wrong_bits(k, v):
        k.bits = 8
    def both_wrong_bits(k, v):
        k.bits = v.bits = 2
    def short_scale(k, v):
        k.scale = k.scale[:, :, :2]
    def zero_dtype(k, v):
        v.zero = v.zero.float()
    def packed_dtype(k, v):
        v.packed = v.packed.to(torch.int16)
    def group_size(k, v):
        k.group_size = 4
    def token_group(k, v):
        k.granularity = "token"
    def stats_channels(k, v):
        v.stats = kq.ChannelStats(torch.zeros(2, 32), torch.ones(2, 32))
    def stats_heads(k, v):
        k.stats = kq.ChannelStats(torch.zeros(3, 64), torch.ones(3, 64))
    def shape_tokens(k, v):
        k.shape = (2, 2, 21, 64)
    def mismatched_kv(k, v):
        v.packed, v.scale, v.zero, v.shape = v.packed[:, :, :16], v.scale[:, :, :2], v.zero[:, :, :2], (2, 2, 16, 64)
    def stats_type(k, v):
        k.stats = (torch.zeros(64), torch.ones(64))
    def scale_device(k, v):  # the meta device stands in for a second device on a CPU-only machine
        k.scale = k.scale.to("meta")
    def cache_device(k, v):
        v.packed, v.scale, v.zero = (t.to("meta") for t in (v.packed, v.scale, v.zero))

    cases = [
        (packed_shape, ValueError, r"k.packed has shape \(2, 2, 20, 16\) but k.shape=\(2, 2, 20, 64\), bits=4"),
        (wrong_bits, ValueError, r"k.packed has shape \(2, 2, 20, 32\).*bits=8.*need \(2, 2, 20, 64\)"),
        (both_wrong_bits, ValueError, r"k.packed has shape .*bits=2"),
        (short_scale, ValueError, r"k.scale has shape \(2, 2, 2, 1\).*need \(2, 2, 3, 1\)"),
        (zero_dtype, TypeError, r"v.zero must have dtype torch.float16, got torch.float32"),
        (packed_dtype, TypeError, r"v.packed must have dtype torch.uint8"),
        (group_size, ValueError, r"k.scale has shape \(2, 2, 3, 1\).*group_size=4.*need \(2, 2, 5, 1\)"),
        (token_group, ValueError, r"k.group_size must be 1 for granularity 'token', got 8"),
        (stats_channels, ValueError, r"v.stats have 32 channels but v.shape has head_dim 64"),
        (stats_heads, ValueError, r"k.stats of shape \(3, 64\) do not broadcast"),
        (shape_tokens, ValueError, r"k.packed has shape \(2, 2, 20, 32\) but k.shape=\(2, 2, 21, 64\)"),
        (mismatched_kv, ValueError, r"k and v must both be quantized"),
        (stats_type, TypeError, r"k.stats must be a ChannelStats or None"),
        (scale_device, ValueError, r"k.scale is on meta but k.packed on cpu"),
        (cache_device, ValueError, r"v.packed is on meta but the other inputs are on cpu"),
    ]
    return make, cases


@pytest.mark.parametrize("i", range(len(_tampered()[1])))
def test_tampered_quantized_tensors_are_refused_before_launch(i):
    make, cases = _tampered()
    tamper, exc, msg = cases[i]
    q = torch.randn(2, 4, 64)
    k, v = make()
    tamper(k, v)
    for fn in (kk.decode_attention_quant, kk.decode_attention_quant_ref):
        with pytest.raises(exc, match=msg):
            fn(q, k, v)
    if tamper.__name__ not in ("mismatched_kv", "both_wrong_bits", "cache_device"):
        qt = k if msg.startswith("k") else v
        name_msg = re.sub(r"\b[kv]\.", "qt.", msg)
        for fn in (kk.dequantize_unpack, kk.dequantize_unpack_ref):
            with pytest.raises(exc, match=name_msg):
                fn(qt)


def test_decode_attention_validates_sm_scale_and_empty_sizes(poison):
    k = kk.quantize_pack(_x((1, 1, 9, 64), seed=1), 8, 4)
    v = kk.quantize_pack(_x((1, 1, 9, 64), seed=2), 8, 4)
    q = torch.randn(1, 2, 64)
    for bad in (0, -1.0, float("nan"), float("inf"), "0.1", True, [0.1]):
        for fn in (kk.decode_attention_quant, kk.decode_attention_quant_ref):
            with pytest.raises(ValueError, match="sm_scale must be a finite positive number"):
                fn(q, k, v, sm_scale=bad)
    got = kk.decode_attention_quant(q, k, v, sm_scale=0.3)
    torch.testing.assert_close(got, kk.decode_attention_quant_ref(q, k, v, sm_scale=0.3), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k and v hold no tokens"):
        empty = kq.QuantizedTensor(torch.zeros(1, 1, 0, 64, dtype=torch.uint8), torch.zeros(1, 1, 0, 1, dtype=torch.float16),
                                   torch.zeros(1, 1, 0, 1, dtype=torch.float16), None, 8, 4, "group", (1, 1, 0, 64),
                                   torch.float32)
        kk.decode_attention_quant(q, empty, empty)
    none = kk.decode_attention_quant(torch.zeros(0, 2, 64), *(kq.QuantizedTensor(
        torch.zeros(0, 1, 3, 64, dtype=torch.uint8), torch.zeros(0, 1, 1, 1, dtype=torch.float16),
        torch.zeros(0, 1, 1, 1, dtype=torch.float16), None, 8, 4, "group", (0, 1, 3, 64), torch.float32),) * 2)
    assert none.shape == (0, 2, 64)


# ------------------------------------------------------------------------------------------- launch limits
def test_large_group_size_is_walked_in_chunks(poison):
    """A group longer than one block (here 2^21 tokens allowed, 700 used) is looped over, not refused."""
    x = _x((2, 700, 16), seed=8)
    for g in (700, 2 ** 21):
        _same(kk.quantize_pack(x, 4, g), kk.quantize_pack_ref(x, 4, g))


def test_launch_limits_are_refused_with_the_limit():
    with pytest.raises(ValueError, match=r"head_dim 4194304 at 4 bits needs a block of 1 x 2097152 .* "
                                         r"limit of 1048576 elements"):
        kk.quantize_pack(torch.zeros(1, 1, 2 ** 22), 4, 1)
    q = torch.zeros(1, 2 ** 16 * 2, 16)  # 131072 query heads on one KV head: a 131072 x 16 block

    def qt(b, h, t, d, bits=8):
        return kq.QuantizedTensor(torch.zeros(1, 1, 1, 1, dtype=torch.uint8).expand(b, h, t, d * bits // 8),
                                  torch.zeros(1, 1, 1, 1, dtype=torch.float16).expand(b, h, t, 1),
                                  torch.zeros(1, 1, 1, 1, dtype=torch.float16).expand(b, h, t, 1),
                                  None, bits, 1, "token", (b, h, t, d), torch.float32)
    with pytest.raises(ValueError, match=r"131072 query heads per KV head needs a block of 131072 x 16"):
        kk.decode_attention_quant(q, qt(1, 1, 4, 16), qt(1, 1, 4, 16))
    many = qt(1, 65536, 1, 16)  # expanded: no memory behind it, refused before anything is copied
    with pytest.raises(ValueError, match=r"n_kv_heads \(grid axis 1\) needs 65536 programs.*limit of 65535"):
        kk.decode_attention_quant(torch.zeros(1, 65536, 16), many, many)
    small = qt(1, 1, 4, 16)
    with pytest.raises(ValueError, match=r"num_splits \(grid axis 2\) needs 70000 programs.*limit of 65535"):
        kk.decode_attention_quant(torch.zeros(1, 1, 16), small, small, num_splits=70000)
    long = qt(1, 1, 2 ** 27, 16)  # 2^31 elements in one row: beyond int32 offsets
    with pytest.raises(ValueError, match=r"k has 134217728 tokens x 16 channels.*int32 offsets"):
        kk.decode_attention_quant(torch.zeros(1, 1, 16), long, long)


# ------------------------------------------------------------------------------------------- memory layout
def test_strided_and_expanded_inputs(poison):
    base = _x((3, 40, 2, 64), seed=31)
    views = {
        "transposed": base.transpose(1, 2),  # (3, 2, 40, 64), not contiguous
        "sliced": _x((2, 2, 40, 128), seed=32)[..., ::2],
        "expanded": _x((1, 2, 40, 64), seed=33).expand(3, 2, 40, 64),
    }
    stats = kq.ChannelStats(torch.randn(64, 2).t().half(), (torch.rand(64, 2) + 0.5).t().half())  # strided fp16
    assert not stats.mean.is_contiguous()
    for name, x in views.items():
        got, ref = kk.quantize_pack(x, 4, 16, stats), kk.quantize_pack_ref(x.contiguous(), 4, 16, stats)
        _same(got, ref)
        # strided buffers inside the QuantizedTensor: make them non-contiguous views of the same values
        got.packed = got.packed.transpose(0, 1).contiguous().transpose(0, 1)
        got.scale = got.scale.transpose(0, 1).contiguous().transpose(0, 1)
        assert not got.packed.is_contiguous()
        torch.testing.assert_close(kk.dequantize_unpack(got), kk.dequantize_unpack_ref(ref), rtol=0, atol=0)
    k = kk.quantize_pack(views["transposed"], 4, 16, stats)
    v = kk.quantize_pack(views["expanded"], 4, 16, stats)
    q = torch.randn(4, 3, 64).transpose(0, 1)  # (3, 4, 64) strided
    for lens in (torch.tensor([25], dtype=torch.int32).expand(3),  # stride 0
                 torch.tensor([40, 0, 7, 0, 33, 0])[::2]):        # int64, stride 2
        ref = kk.decode_attention_quant_ref(q, k, v, lens)
        got = kk.decode_attention_quant(q, k, v, lens, num_splits=2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- property-based
_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _quant_inputs(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    per = 8 // bits
    d = per * draw(st.integers(1, 24))
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    t = draw(st.integers(1, 33))
    group = draw(st.sampled_from([1, 3, 8, 16, 64]))
    dtype = draw(_DTYPES)
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "constant", "huge", "tiny", "nan", "inf"]))
    x = torch.randn(*lead, t, d, generator=gen)
    if kind == "constant":
        x = torch.full_like(x, float(torch.randn(1, generator=gen)) * 100)
    elif kind == "huge":
        x = x * 3e4  # ranges near fp16's limit: 2 bits may overflow (both sides must raise alike)
    elif kind == "tiny":
        x = 1.0 + x * 1e-6
    elif kind in ("nan", "inf"):
        i = int(torch.randint(0, x.numel(), (1,), generator=gen))
        x.view(-1)[i] = float("nan") if kind == "nan" else -float("inf")
    x = x.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if layout == "transposed" and x.dim() >= 3:
        x = x.transpose(0, -2).contiguous().transpose(0, -2)
    elif layout == "sliced":
        x = torch.cat([x, x], dim=-1)[..., :d] if d > 1 else x
    norm = draw(st.booleans()) and kind not in ("nan", "inf")
    stats = None
    if norm:
        stats = kq.ChannelStats(torch.randn(d, generator=gen), torch.rand(d, generator=gen) + 0.1)
    return x, bits, group, stats


@_SETTINGS
@given(_quant_inputs())
def test_property_quantize_and_dequantize_match_reference(args):
    x, bits, group, stats = args
    try:
        ref = kk.quantize_pack_ref(x, bits, group, stats)
    except ValueError as e:  # fp16 overflow: the kernel must refuse with the same message
        with pytest.raises(ValueError) as got:
            kk.quantize_pack(x, bits, group, stats)
        assert str(got.value) == str(e)
        return
    got = kk.quantize_pack(x, bits, group, stats)
    _same(got, ref)
    y, y_ref = kk.dequantize_unpack(got), kk.dequantize_unpack_ref(ref)
    if x.dtype == torch.bfloat16:
        torch.testing.assert_close(y, y_ref, rtol=tolerance(torch.bfloat16)[0], atol=tolerance(torch.bfloat16)[1],
                                   equal_nan=True)
    else:
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(y).any()) == (not bool(torch.isfinite(x).all()))


@st.composite
def _decode_inputs(draw):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    t = draw(st.integers(1, 100))
    d = 2 * draw(st.integers(4, 40))
    bits = draw(st.sampled_from([4, 8]))
    group = draw(st.sampled_from([1, 4, 16, 128]))
    dtype = draw(_DTYPES)
    seed = draw(st.integers(0, 2 ** 16))
    lens = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    norm = draw(st.booleans())
    splits = draw(st.integers(1, 4))
    return b, hq, hkv, t, d, bits, group, dtype, seed, lens, norm, splits


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_decode_inputs())
def test_property_decode_attention_matches_reference(args):
    b, hq, hkv, t, d, bits, group, dtype, seed, lens, norm, splits = args
    k, v = _x((b, hkv, t, d), seed=seed), _x((b, hkv, t, d), seed=seed + 1)
    # The reference quantizer builds the cache (quantize_pack is checked above, and is slow per token under
    # the interpreter); normalize=True measures statistics per sequence, shape (B, Hkv, D).
    kq_, vq_ = (kq.quantize(x, bits=bits, group_size=group, normalize=norm) for x in (k, v))
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    ref = kk.decode_attention_quant_ref(q, kq_, vq_, seq_lens)
    got = kk.decode_attention_quant(q, kq_, vq_, seq_lens, num_splits=splits)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol * 10 if dtype == torch.float32 else atol)


_BAD_ARGS = [
    ("bits", st.sampled_from([0, 1, 3, 5, 16, True, 4.0, "4"]), ValueError, "bits must be one of"),
    ("group_size", st.one_of(st.integers(-5, 0), st.sampled_from([2.0, True, "8"])), ValueError,
     "group_size must be a positive int"),
    ("sm_scale", st.one_of(st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf"), "1", False])),
     ValueError, "sm_scale must be a finite positive number"),
    ("num_splits", st.one_of(st.integers(-3, 0), st.sampled_from([1.5, True, "2"])), ValueError,
     "num_splits must be a positive int"),
    ("seq_lens", st.lists(st.integers(-3, 30), min_size=2, max_size=2).filter(lambda l: min(l) < 1 or max(l) > 9),
     ValueError, r"seq_lens must lie in \[1, 9\]"),
]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_property_bad_arguments_raise_the_documented_error(data):
    name, strategy, exc, msg = data.draw(st.sampled_from(_BAD_ARGS))
    value = data.draw(strategy)
    x = _x((2, 1, 9, 16), seed=0)
    if name in ("bits", "group_size"):
        kwargs = {"bits": 4, "group_size": 4, name: value}
        for fn in (kk.quantize_pack, kk.quantize_pack_ref):
            with pytest.raises(exc, match=msg):
                fn(x, **kwargs)
        return
    k, v = kk.quantize_pack(x, 8, 4), kk.quantize_pack(x, 8, 4)
    q = torch.randn(2, 2, 16)
    kwargs = {"seq_lens": torch.tensor(value)} if name == "seq_lens" else {name: value}
    fns = (kk.decode_attention_quant,) if name == "num_splits" else (kk.decode_attention_quant,
                                                                      kk.decode_attention_quant_ref)
    for fn in fns:
        with pytest.raises(exc, match=msg):
            fn(q, k, v, **kwargs)


def test_decode_ref_fp_errors():
    k = torch.zeros(2, 2, 5, 16)
    with pytest.raises(ValueError, match="q must be 3-D"):
        kk.decode_attention_ref_fp(torch.zeros(2, 16), k, k)
    with pytest.raises(ValueError, match="must both be"):
        kk.decode_attention_ref_fp(torch.zeros(2, 4, 16), k, k[:, :, :3])
    with pytest.raises(ValueError, match="n_heads 3 must be a positive multiple"):
        kk.decode_attention_ref_fp(torch.zeros(2, 3, 16), k, k)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 5\]"):
        kk.decode_attention_ref_fp(torch.zeros(2, 4, 16), k, k, torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="seq_lens must be an int32 or int64 tensor"):
        kk.decode_attention_ref_fp(torch.zeros(2, 4, 16), k, k, [5, 5])
