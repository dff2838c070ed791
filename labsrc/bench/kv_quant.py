"""Bench entries ``kvquant_pack`` and ``kvquant_decode``: the quantized KV cache's two hot paths.

``kvquant_pack`` quantizes and packs K rows (KVarN: normalise, one fp16 step and zero point per group of
tokens, INT4/INT8 codes). It is bandwidth-bound: it reads the fp16/bf16 rows and the statistics and writes
the codes, steps and zero points; GB/s counts exactly those bytes. Baseline: the PyTorch reference.

``kvquant_decode`` is one decode step (one query per sequence, GQA) over a packed INT4 (and INT8) cache,
against bf16 ``scaled_dot_product_attention`` over an unquantized cache of the same length. Decode attention
reads the whole cache once, so the INT4 cache moves about a quarter of the bytes; the GPU goal is INT4
decode at least 3x faster than bf16 SDPA at 32K tokens. GB/s counts the bytes the quantized kernel reads
(codes + steps + zero points + query + statistics).
"""
from __future__ import annotations

import torch

from labsrc.bench import Case, register
from labsrc import kv_quant as kq
from labsrc import runtime
from labsrc.kernels.kv_quant import decode_attention_quant, decode_attention_quant_ref, quantize_pack, \
    quantize_pack_ref

# Llama-3-8B-like heads: 32 query heads, 8 KV heads, head_dim 128; group of 128 tokens.
_PACK_GPU = [(8, 8, 4096, 128, 128)]                # (batch, kv heads, tokens, head_dim, group)
_PACK_TINY = [(1, 2, 77, 64, 32)]
_DECODE_GPU = [(1, 32, 8, 32768, 128), (8, 32, 8, 32768, 128), (1, 32, 8, 4096, 128)]  # (B, Hq, Hkv, T, D)
_DECODE_TINY = [(2, 4, 2, 67, 64)]


def _stats(hkv: int, d: int, device) -> kq.ChannelStats:
    gen = torch.Generator().manual_seed(d)
    return kq.ChannelStats(torch.randn(hkv, d, generator=gen).to(device),
                           (torch.rand(hkv, d, generator=gen) + 0.5).to(device))


def _pack_case(b, hkv, t, d, group, bits, dtype) -> Case:
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(b, hkv, t, d, generator=gen).to(device=device, dtype=dtype)
    stats = _stats(hkv, d, device)

    def check():
        got, ref = quantize_pack(x, bits, group, stats), quantize_pack_ref(x, bits, group, stats)
        # On a GPU a fused multiply-add may move a value across a rounding boundary: allow one code step on a
        # tiny fraction of elements there; under the interpreter the codes must match exactly.
        codes_g, codes_r = got.codes.int(), ref.codes.int()
        diff = (codes_g - codes_r).abs()
        exact = runtime.INTERPRETED
        if (exact and not torch.equal(got.packed, ref.packed)) or int(diff.max()) > 1 \
                or float((diff > 0).float().mean()) > 1e-4:
            raise AssertionError(f"quantize_pack differs from quantize_pack_ref at {b=} {hkv=} {t=} {d=} {bits=}")
        if not torch.allclose(got.scale.float(), ref.scale.float(), rtol=1e-3, atol=0):
            raise AssertionError("quantize_pack steps differ from the reference")

    n_groups = -(-t // group)
    bytes_moved = (x.numel() * x.element_size() + b * hkv * t * d * bits // 8 + 2 * 2 * b * hkv * n_groups
                   + stats.nbytes)
    label = f"B={b} Hkv={hkv} T={t} D={d} g={group} INT{bits} {str(dtype).removeprefix('torch.')}"
    return Case(label, kernel=lambda: quantize_pack(x, bits, group, stats),
                baseline=lambda: quantize_pack_ref(x, bits, group, stats), check=check,
                bytes_moved=bytes_moved, baseline_name="torch reference")


def _decode_case(b, hq, hkv, t, d, bits, dtype) -> Case:
    device = runtime.DEVICE
    gen = torch.Generator().manual_seed(t + bits)
    k = torch.randn(b, hkv, t, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(b, hq, d, generator=gen).to(device=device, dtype=dtype)
    kq_ = quantize_pack(k, bits, 128, _stats(hkv, d, device))
    vq_ = quantize_pack(v, bits, 128, _stats(hkv, d, device))
    lens = torch.full((b,), t, dtype=torch.int32, device=device)
    sdpa_dtype = torch.bfloat16 if runtime.HAS_CUDA else dtype
    kb, vb, qb = k.to(sdpa_dtype), v.to(sdpa_dtype), q.to(sdpa_dtype)

    def baseline():
        torch.nn.functional.scaled_dot_product_attention(qb.unsqueeze(2), kb, vb, enable_gqa=True)

    def check():
        got = decode_attention_quant(q, kq_, vq_, lens)
        ref = decode_attention_quant_ref(q, kq_, vq_, lens)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        if not torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol):
            raise AssertionError(f"decode_attention_quant differs from its reference at {b=} {hq=} {t=} INT{bits}: "
                                 f"max diff {(got.float() - ref.float()).abs().max().item():.3g}")

    bytes_moved = kq_.nbytes + vq_.nbytes + q.numel() * q.element_size() * 2
    label = f"B={b} Hq={hq} Hkv={hkv} T={t} D={d} INT{bits} vs {str(sdpa_dtype).removeprefix('torch.')} SDPA"
    return Case(label, kernel=lambda: decode_attention_quant(q, kq_, vq_, lens), baseline=baseline, check=check,
                bytes_moved=bytes_moved, baseline_name="SDPA (unquantized)",
                extra={"cache_MB_quant": (kq_.nbytes + vq_.nbytes) / 1e6,
                       "cache_MB_fp": 2 * k.numel() * kb.element_size() / 1e6})


@register("kvquant_pack")
def pack_entry(size: str) -> list[Case]:
    shapes = _PACK_GPU if size == "gpu" else _PACK_TINY
    dtypes = (torch.float16, torch.bfloat16) if size == "gpu" else (torch.float32,)
    return [_pack_case(*s, bits, dt) for s in shapes for bits in (4, 8) for dt in dtypes]


@register("kvquant_decode")
def decode_entry(size: str) -> list[Case]:
    shapes = _DECODE_GPU if size == "gpu" else _DECODE_TINY
    dtype = torch.bfloat16 if size == "gpu" else torch.float32
    return [_decode_case(*s, bits, dtype) for s in shapes for bits in (4, 8)]
