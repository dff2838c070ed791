"""Triton KV-quantization kernels against their PyTorch references.

Under the interpreter the kernels compute with the same IEEE fp32 operations as the references (``div_rn``,
half-up rounding, the same fp16 rounding of steps), so codes, steps and zero points are compared bit for bit.
bf16 outputs are compared at bf16 tolerance: the interpreter's fp32 -> bf16 cast may round differently from
torch's by one bf16 ulp. Decode attention's ``tl.dot`` runs on fp16 operands (exact integer codes, hi/lo
splits of fp32 factors) whatever the input dtype, so bf16 inputs need no upcasting under the interpreter.
"""
from __future__ import annotations


import pytest
import torch

import labsrc  # noqa: F401
from labsrc import kvquant as kq
from labsrc import runtime
from labsrc.exercises.core import tolerance
from labsrc.kernels import kvquant as kk


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
    with pytest.raises(ValueError, match="x must be contiguous"):
        kk.quantize_pack(x.transpose(0, 1))
    with pytest.raises(ValueError, match="bits must be one of"):
        kk.quantize_pack(x, bits=3)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        kk.quantize_pack(x, group_size=0)
    with pytest.raises(ValueError, match="tokens > 0"):
        kk.quantize_pack(torch.zeros(2, 0, 64))
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
    with pytest.raises(TypeError, match="qt must be a labsrc.kvquant.QuantizedTensor"):
        kk.dequantize_unpack(x)
    with pytest.raises(ValueError, match="granularity 'channel'"):
        kk.dequantize_unpack(kq.quantize(x, granularity="channel", group_size=4))
    with pytest.raises(TypeError, match="out_dtype must be"):
        kk.dequantize_unpack(kq.quantize(x), out_dtype=torch.int8)
    bad = kq.quantize(x, group_size=4)
    bad.scale = bad.scale.float()
    with pytest.raises(TypeError, match="uint8 codes and fp16 scale/zero"):
        kk.dequantize_unpack(bad)


def test_decode_attention_errors():
    k = kk.quantize_pack(_x((2, 2, 20, 64), seed=1), 4, 8)
    v = kk.quantize_pack(_x((2, 2, 20, 64), seed=2), 4, 8)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match=r"q must be 3-D"):
        kk.decode_attention_quant(q[0], k, v)
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        kk.decode_attention_quant(q.long(), k, v)
    with pytest.raises(TypeError, match="k must be a labsrc.kvquant.QuantizedTensor"):
        kk.decode_attention_quant(q, k.dequantize(), v)
    with pytest.raises(ValueError, match="decode attention supports bits"):
        kk.decode_attention_quant(q, kk.quantize_pack(_x((2, 2, 20, 64), seed=1), 2, 8),
                                  kk.quantize_pack(_x((2, 2, 20, 64), seed=2), 2, 8))
    with pytest.raises(ValueError, match="does not match the cache shape"):
        kk.decode_attention_quant(torch.randn(2, 4, 80), k, v)
    with pytest.raises(ValueError, match="n_heads 3 must be a multiple of n_kv_heads 2"):
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
