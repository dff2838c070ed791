"""Triton kernels of the quantized KV cache: quantize-and-pack, unpack-dequantize, and decode attention on codes.

The format is the one of :mod:`labsrc.kv_quant` with ``granularity="group"`` (KVarN; ``group_size=1`` is the
per-token baseline): a tensor ``(..., T, D)`` becomes

* ``packed``: uint8 ``(..., T, D*bits/8)``, planar layout (byte ``j`` holds channel ``j + k*D*bits/8`` in bits
  ``[k*bits, (k+1)*bits)``), so INT4 keeps channel ``j`` in the low nibble and ``j + D/2`` in the high one;
* ``scale``, ``zero``: fp16 ``(..., G, 1)``, one pair per ``group_size`` tokens (``G = ceil(T/g)``);
* optional per-channel statistics ``mean``, ``std`` (fp16, broadcast over the leading dimensions).

Kernels (each with a PyTorch ``*_ref`` beside it):

* :func:`quantize_pack` -- one program per (row, group): normalise, min/max, fp16 step and zero point
  (rounded in the safe direction, :func:`labsrc.kv_quant.scale_zero`), round and pack. Produces the same
  codes and parameters as :func:`labsrc.kv_quant.quantize` (checked bit for bit under the interpreter).
* :func:`dequantize_unpack` -- the inverse: ``sigma_j * (q * s_g + z_g) + mu_j``.
* :func:`decode_attention_quant` -- one query token per sequence against the packed cache, GQA and per-sequence
  lengths, dequantising in registers. Because one step is shared by all channels of a group, the key side
  folds into the query: ``q . k_t = s_g (q*sigma) . codes_t + z_g sum(q*sigma) + q . mu``, and ``q . mu`` is
  the same for every token, so softmax ignores it. The value side accumulates ``sum_t p_t s_t codes_t`` and
  ``sum_t p_t z_t`` and applies ``sigma, mu`` once at the end. One program serves all query heads of a KV
  head (GQA), so each code is read and unpacked once; the products run on fp16 tensor cores (codes are exact
  in fp16; the fp32 factors are split into hi + lo fp16 parts, about 22 bits), and the sequence is split over
  several programs (flash-decoding) whose partial results are merged with their log-sum-exp.

Supported: bits 2/4/8 for (de)quantization, 4/8 for decode attention; inputs fp32/fp16/bf16. The only
``tl.dot`` is on fp16 operands, which the interpreter computes correctly, so bf16 inputs need no upcasting.

Edge cases, as in the reference (:mod:`labsrc.kv_quant`, "Two edge cases"):

* a group holding NaN or +-inf gets NaN step and zero point and code 0, so it dequantizes to NaN (the kernel
  takes the group's range over its finite values only to keep the codes defined, then marks the group);
* a finite group whose fp16 step or zero point would overflow (range beyond fp16's 65504) raises the same
  ``ValueError`` as the reference. The kernel marks such a group with an infinite step; the wrapper looks
  for one after the launch and lets the reference produce the message, so both say the same thing;
* decode attention reads only the first ``seq_lens[b]`` tokens: a NaN group beyond them does not matter,
  one within them makes that sequence's output NaN for the query heads of its KV head.

Wrappers validate every argument and every field of a :class:`~labsrc.kv_quant.QuantizedTensor`
(:meth:`~labsrc.kv_quant.QuantizedTensor.validate`) before a launch, copy strided or expanded inputs to
contiguous buffers in the dtype the kernel reads, and refuse sizes beyond Triton's launch limits (a block of
at most 2^20 elements, grid axes 1 and 2 at most 65535 programs) with a message stating the limit.
"""
from __future__ import annotations

import math
import numbers

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.kv_quant.codes import SUPPORTED_BITS, _check_bits, _check_group_size
from labsrc.kernels.kv_quant.tensor import ChannelStats, QuantizedTensor, quantize

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DECODE_BITS = (4, 8)
KERNEL_BITS = (2, 4, 8)  # whole codes per byte; INT3 (eight codes in three bytes) has the PyTorch path only


def _check_kernel_bits(bits) -> int:
    """``bits`` if the packing kernels read it (2, 4 or 8), else a ValueError pointing at the PyTorch path."""
    _check_bits(bits)
    if bits not in KERNEL_BITS:
        raise ValueError(f"bits must be one of {KERNEL_BITS} for the packed kernels, got {bits!r}; {bits}-bit "
                         "caches run on labsrc.kv_quant's PyTorch path (quantize, KVarNCache)")
    return bits
MAX_BLOCK_NUMEL = 1048576  # Triton's largest tensor (tl.arange and every block): 2^20 elements
MAX_GRID_0 = 2 ** 31 - 1  # programs along grid axis 0
MAX_GRID_12 = 65535  # programs along grid axes 1 and 2
MAX_ROW_ELEMENTS = 2 ** 31 - 1  # offsets within one (T, D) row are int32 in the kernels

# GPU: 64 tokens per decode block keeps a 64 x 64-byte tile of codes per program in registers; the
# interpreter runs programs one after another in NumPy, where bigger blocks and fewer splits are faster.
_DECODE_BLOCK_T = 64 if runtime.HAS_CUDA else 128
_DEQ_BLOCK_T = 64 if runtime.HAS_CUDA else 256
_PACK_BLOCK_T = 128 if runtime.HAS_CUDA else 512  # tokens per chunk when quantize_pack walks a group
# Eight warps for the three kernels on a GPU: their (tokens x packed columns) tiles spilled registers with
# Triton's default four at D = 128 (124-3728 bytes on sm_80, `python -m labsrc.gpucheck --compile-only`).
_WARPS = 8


# ----------------------------------------------------------------------------------------------- validation
def _check_tensor(x, name: str, dtypes=SUPPORTED_DTYPES) -> torch.Tensor:
    """``x`` checked for type and dtype, returned contiguous (a strided or expanded view is copied once)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {', '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    return x.contiguous()


def _check_block(what: str, rows: int, cols: int) -> None:
    """Refuse a ``rows x cols`` block beyond Triton's largest tensor (the sizes are powers of two)."""
    if rows * cols > MAX_BLOCK_NUMEL:
        raise ValueError(f"{what} needs a block of {rows} x {cols} = {rows * cols} elements, beyond Triton's "
                         f"limit of {MAX_BLOCK_NUMEL} elements per block")


def _check_grid(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise ValueError(f"{what} needs {n} programs on one grid axis, beyond Triton's limit of {limit}")


def _check_row(name: str, t: int, d: int) -> None:
    if t * d > MAX_ROW_ELEMENTS:
        raise ValueError(f"{name} has {t} tokens x {d} channels = {t * d} elements per row, beyond the "
                         f"kernels' int32 offsets (at most {MAX_ROW_ELEMENTS})")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def _stats_rows(stats: ChannelStats | None, lead: tuple, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stats broadcast to one fp32 row per leading index, ``(N, D)``; identity stats when ``None``."""
    n = math.prod(lead)
    if stats is None:
        return (torch.zeros(n, d, dtype=torch.float32, device=device),
                torch.ones(n, d, dtype=torch.float32, device=device))
    if not isinstance(stats, ChannelStats):
        raise TypeError(f"stats must be a ChannelStats, got {type(stats).__name__}")
    if stats.mean.shape[-1] != d:
        raise ValueError(f"stats have {stats.mean.shape[-1]} channels but head_dim is {d}")
    try:
        mean = stats.mean.float().expand(*lead, d).reshape(n, d).contiguous()
        std = stats.std.float().expand(*lead, d).reshape(n, d).contiguous()
    except RuntimeError:
        raise ValueError(f"stats of shape {tuple(stats.mean.shape)} do not broadcast to leading shape {lead}") from None
    _check_device("stats", mean, device)
    return mean, std


# ----------------------------------------------------------------------------------------------- quantize-and-pack
@triton.jit
def _quantize_pack_kernel(
    x_ptr, mean_ptr, std_ptr, out_ptr, scale_ptr, zero_ptr, T, D, DP, G,
    BITS: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_DP: tl.constexpr,
):
    # One program per (row, group) on a 1-D grid (axis 0 allows 2^31 - 1 programs, axes
    # 1-2 only 65535); a group longer than BLOCK_T tokens is walked in chunks, so any
    # group size launches.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // G
    grp = pid % G
    t_first = grp * GROUP
    # tokens in this group (a trailing group may be short)
    n_t = tl.minimum(T - t_first, GROUP)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_c = offs_c < DP
    base = x_ptr + row * T * D
    # Pass 1: the group's range over all channels (each of the PACK channel slices in
    # turn), over finite inputs only, and a count of non-finite ones (NaN would be
    # dropped by min/max: count it instead).
    lo = tl.full([BLOCK_T, BLOCK_DP], float("inf"), tl.float32)
    hi = tl.full([BLOCK_T, BLOCK_DP], float("-inf"), tl.float32)
    n_bad = tl.zeros([BLOCK_T, BLOCK_DP], tl.int32)
    for t0 in range(0, n_t, BLOCK_T):
        offs_t = t_first + t0 + tl.arange(0, BLOCK_T)
        mask = ((t0 + tl.arange(0, BLOCK_T)) < n_t)[:, None] & mask_c[None, :]
        for k in tl.static_range(PACK):
            ch = k * DP + offs_c
            mu = tl.load(mean_ptr + row * D + ch, mask=mask_c, other=0.0)
            sd = tl.load(std_ptr + row * D + ch, mask=mask_c, other=1.0)
            x = tl.load(
                base + offs_t[:, None] * D + ch[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            finite = tl.abs(x) < float("inf")  # false for NaN and +-inf
            n_bad += tl.where(mask & ~finite, 1, 0)
            xn = tl.div_rn(x - mu[None, :], sd[None, :])
            lo = tl.minimum(lo, tl.where(mask & finite, xn, float("inf")))
            hi = tl.maximum(hi, tl.where(mask & finite, xn, float("-inf")))
    xmin = tl.min(tl.min(lo, axis=1), axis=0)
    xmax = tl.max(tl.max(hi, axis=1), axis=0)
    bad = tl.sum(tl.sum(n_bad, axis=1), axis=0) > 0
    # The same safe fp16 rounding as labsrc.kv_quant.scale_zero: zero point down, step
    # up.
    z16 = (xmin - tl.abs(xmin) * 0.0009765625 - 5.960464477539063e-08).to(tl.float16)
    z = z16.to(tl.float32)
    s = tl.div_rn(xmax - z, (2 ** BITS - 1) * 1.0)
    s16 = (s + s * 0.0009765625 + 5.960464477539063e-08).to(tl.float16)
    s = s16.to(tl.float32)
    # A non-finite group stores NaN; a finite group whose s or z overflowed fp16 stores
    # s = inf, a mark the wrapper looks for (and raises on) after the launch.
    fits = (tl.abs(s) < float("inf")) & (tl.abs(z) < float("inf"))
    tl.store(
        scale_ptr + pid,
        tl.where(bad, float("nan"), tl.where(fits, s, float("inf"))).to(tl.float16),
    )
    tl.store(zero_ptr + pid, tl.where(bad, float("nan"), z).to(tl.float16))
    # Pass 2: codes, packed PACK per byte (code 0 throughout a non-finite group).
    for t0 in range(0, n_t, BLOCK_T):
        offs_t = t_first + t0 + tl.arange(0, BLOCK_T)
        mask = ((t0 + tl.arange(0, BLOCK_T)) < n_t)[:, None] & mask_c[None, :]
        packed = tl.zeros([BLOCK_T, BLOCK_DP], tl.int32)
        for k in tl.static_range(PACK):
            ch = k * DP + offs_c
            mu = tl.load(mean_ptr + row * D + ch, mask=mask_c, other=0.0)
            sd = tl.load(std_ptr + row * D + ch, mask=mask_c, other=1.0)
            x = tl.load(
                base + offs_t[:, None] * D + ch[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            xn = tl.div_rn(x - mu[None, :], sd[None, :])
            v = tl.div_rn(xn - z, s)
            v = tl.where(bad | ~fits, 0.0, v)  # keep the float -> int cast defined
            q = tl.minimum(
                tl.maximum(tl.floor(v + 0.5), 0.0), (2**BITS - 1) * 1.0
            ).to(tl.int32)
            packed = packed | (q << (k * BITS))
        tl.store(
            out_ptr + row * T * DP + offs_t[:, None] * DP + offs_c[None, :],
            packed.to(tl.uint8),
            mask=mask,
        )


def quantize_pack(x: torch.Tensor, bits: int = 4, group_size: int = 128,
                  stats: ChannelStats | None = None) -> QuantizedTensor:
    """Quantize ``x`` ``(..., T, D)`` with one fp16 step and zero point per ``group_size`` tokens and pack the codes.

    ``stats`` (a :class:`~labsrc.kv_quant.ChannelStats`, e.g. calibrated) switches on KVarN's normalisation.
    Returns the same :class:`~labsrc.kv_quant.QuantizedTensor` as :func:`quantize_pack_ref`. ``D`` must be a
    multiple of ``8 // bits``. ``x`` may be any strided view (it is copied to a contiguous buffer). A group
    holding NaN or +-inf dequantizes to NaN; a group whose range does not fit fp16's step or zero point
    raises the reference's ``ValueError`` (module docstring).
    """
    x = _check_tensor(x, "x")
    _check_kernel_bits(bits)
    group_size = _check_group_size(group_size)
    if x.dim() < 2 or x.shape[-2] == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape (..., tokens, head_dim) with tokens > 0 and head_dim > 0, "
                         f"got {tuple(x.shape)}")
    pack = 8 // bits
    t, d = x.shape[-2], x.shape[-1]
    if d % pack:
        raise ValueError(f"x has head_dim {d}, which must be a multiple of {pack} to pack {bits}-bit codes")
    lead = tuple(x.shape[:-2])
    n = math.prod(lead)
    dp = d // pack
    n_groups = -(-t // group_size)
    block_dp = triton.next_power_of_2(dp)
    _check_block(f"x with head_dim {d} at {bits} bits", 1, block_dp)
    block_t = min(triton.next_power_of_2(group_size), _PACK_BLOCK_T, MAX_BLOCK_NUMEL // block_dp)
    _check_grid(f"x of shape {tuple(x.shape)} with group_size {group_size} (rows x groups)", n * n_groups,
                MAX_GRID_0)
    _check_row("x", t, d)
    if not HAS_TRITON:  # no Triton on this machine (it has Linux wheels only): the reference quantizes
        return quantize_pack_ref(x, bits, group_size, stats)
    mean, std = _stats_rows(stats, lead, d, x.device)
    if stats is not None:
        # Use exactly the fp16-rounded statistics that are stored (ChannelStats keeps them in fp16).
        mean, std = mean.to(torch.float16).float(), std.to(torch.float16).float()
    packed = torch.empty(*lead, t, dp, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*lead, n_groups, 1, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if n > 0:
        _quantize_pack_kernel[(n * n_groups,)](
            x, mean, std, packed, scale, zero, t, d, dp, n_groups, BITS=bits, PACK=pack, GROUP=group_size,
            BLOCK_T=block_t, BLOCK_DP=block_dp, num_warps=_WARPS)
        if bool(torch.isinf(scale).any()):
            # A finite group whose fp16 step or zero point overflowed: the reference names it.
            quantize_pack_ref(x, bits, group_size, stats)
            raise ValueError("x: a quantization group's step or zero point does not fit in fp16 (max 65504)")
    st = None if stats is None else stats.to(x.device)
    return QuantizedTensor(packed, scale, zero, st, bits, group_size, "group", tuple(x.shape), x.dtype,
                           stats_shared=stats is not None)


def quantize_pack_ref(x: torch.Tensor, bits: int = 4, group_size: int = 128,
                      stats: ChannelStats | None = None) -> QuantizedTensor:
    """PyTorch reference of :func:`quantize_pack`: :func:`labsrc.kv_quant.quantize` with ``granularity="group"``
    (the kernel's widths only: for INT3 call :func:`labsrc.kv_quant.quantize` itself)."""
    _check_kernel_bits(bits)
    return quantize(x, bits=bits, group_size=group_size, normalize=stats is not None, stats=stats,
                    granularity="group")


# ----------------------------------------------------------------------------------------------- unpack-dequantize
@triton.jit
def _dequantize_kernel(
    p_ptr, scale_ptr, zero_ptr, mean_ptr, std_ptr, out_ptr, T, D, DP, G, NBLK,
    BITS: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_DP: tl.constexpr,
):
    # One program per (row, block of BLOCK_T tokens), on a 1-D grid of rows x NBLK
    # programs.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NBLK
    offs_t = (pid % NBLK) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < T
    mask_c = offs_c < DP
    mask = mask_t[:, None] & mask_c[None, :]
    byte = tl.load(
        p_ptr + row * T * DP + offs_t[:, None] * DP + offs_c[None, :],
        mask=mask,
        other=0,
    ).to(tl.int32)
    s = tl.load(scale_ptr + row * G + offs_t // GROUP, mask=mask_t, other=0.0).to(
        tl.float32
    )
    z = tl.load(zero_ptr + row * G + offs_t // GROUP, mask=mask_t, other=0.0).to(
        tl.float32
    )
    for k in tl.static_range(PACK):
        ch = k * DP + offs_c
        q = ((byte >> (k * BITS)) & (2 ** BITS - 1)).to(tl.float32)
        mu = tl.load(mean_ptr + row * D + ch, mask=mask_c, other=0.0)
        sd = tl.load(std_ptr + row * D + ch, mask=mask_c, other=1.0)
        x = q * s[:, None] + z[:, None]
        x = x * sd[None, :] + mu[None, :]
        tl.store(
            out_ptr + row * T * D + offs_t[:, None] * D + ch[None, :],
            x.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


def _check_quantized(qt, name: str, device=None) -> None:
    """Validate ``qt`` for the kernels: every field against the others (:meth:`QuantizedTensor.validate`),
    a granularity the kernels read, and the device."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"{name} must be a labsrc.kv_quant.QuantizedTensor, got {type(qt).__name__}")
    if qt.granularity not in ("group", "token"):
        raise ValueError(f"{name} has granularity {qt.granularity!r}; the kernels support 'group' and 'token'")
    qt.validate(name)
    _check_kernel_bits(qt.bits)
    if device is not None:
        _check_device(f"{name}.packed", qt.packed, device)


def _buffers(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``packed``, ``scale``, ``zero`` as contiguous buffers (their dtypes are checked by validate())."""
    return qt.packed.contiguous(), qt.scale.contiguous(), qt.zero.contiguous()


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")


def dequantize_unpack(qt: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpack and dequantize a ``"group"``/``"token"`` :class:`~labsrc.kv_quant.QuantizedTensor` to ``(..., T, D)``.

    Every field of ``qt`` is checked against the others first (``packed`` of shape ``(..., T, D*bits/8)``,
    ``scale``/``zero`` of shape ``(..., ceil(T/g), 1)``, statistics, devices), with an error naming the field.
    """
    _check_quantized(qt, "qt")
    out_dtype = qt.dtype if out_dtype is None else out_dtype
    _check_out_dtype(out_dtype)
    *lead, t, d = qt.shape
    lead = tuple(lead)
    pack = 8 // qt.bits
    dp = d // pack
    n = math.prod(lead)
    n_groups = qt.scale.shape[-2]
    device = qt.packed.device
    block_dp = triton.next_power_of_2(dp)
    _check_block(f"qt with head_dim {d} at {qt.bits} bits", 1, block_dp)
    block_t = min(_DEQ_BLOCK_T, MAX_BLOCK_NUMEL // block_dp)
    n_blocks = triton.cdiv(t, block_t)
    _check_grid(f"qt of shape {tuple(qt.shape)} (rows x token blocks)", n * n_blocks, MAX_GRID_0)
    _check_row("qt", t, d)
    if not HAS_TRITON:  # no Triton on this machine: the reference dequantizes
        return dequantize_unpack_ref(qt, out_dtype)
    mean, std = _stats_rows(qt.stats, lead, d, device)
    packed, scale, zero = _buffers(qt)
    out = torch.empty(*lead, t, d, dtype=out_dtype, device=device)
    if n > 0 and t > 0:
        _dequantize_kernel[(n * n_blocks,)](
            packed, scale, zero, mean, std, out, t, d, dp, n_groups, n_blocks, BITS=qt.bits, PACK=pack,
            GROUP=qt.group_size, BLOCK_T=block_t, BLOCK_DP=block_dp, num_warps=_WARPS)
    return out


def dequantize_unpack_ref(qt: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`dequantize_unpack`: ``qt.dequantize()`` (which validates ``qt`` too)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a labsrc.kv_quant.QuantizedTensor, got {type(qt).__name__}")
    if out_dtype is not None:
        _check_out_dtype(out_dtype)
    qt.validate("qt")
    x = qt.dequantize()
    return x if out_dtype is None else x.float().to(out_dtype)


# ----------------------------------------------------------------------------------------------- decode attention
@triton.jit
def _split_f16(x):
    """Rows of x (fp32, [M, K]) as ``scale * (hi + lo)`` with hi, lo fp16 and ``scale`` the row's largest
    magnitude: two fp16 tensor-core products then carry ~22 bits of x, and dividing by the row maximum keeps
    hi and lo out of fp16's overflow and subnormal ranges."""
    scale = tl.max(tl.abs(x), axis=1)
    scale = tl.where(scale > 0, scale, 1.0)
    xn = x / scale[:, None]
    hi = xn.to(tl.float16)
    lo = (xn - hi.to(tl.float32)).to(tl.float16)
    return hi, lo, scale


@triton.jit
def _decode_kernel(
    q_ptr, kp_ptr, ks_ptr, kz_ptr, kstd_ptr, vp_ptr, vs_ptr, vz_ptr, lens_ptr, o_ptr,
    m_ptr, l_ptr, Hq, Hkv, T, D, DP, G, sm_scale, tokens_per_split, BITS: tl.constexpr,
    PACK: tl.constexpr, GROUP: tl.constexpr, QPK: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_DP: tl.constexpr,
):
    # One program per (sequence, KV head, split): the QPK query heads sharing the KV
    # head are the rows of the matrix products, so every code is read and unpacked once
    # for all of them.
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    kv_row = (b * Hkv + hk).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < QPK
    q_rows = (b * Hq + hk * QPK + offs_h).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_c = offs_c < DP
    mask_hc = mask_h[:, None] & mask_c[None, :]
    levels: tl.constexpr = 2 ** BITS - 1
    # Key normalisation folds into the query: q' = q * sigma_k (the q . mu_k term is
    # constant over tokens).
    q0 = tl.load(
        q_ptr + q_rows[:, None] * D + offs_c[None, :], mask=mask_hc, other=0.0
    ).to(tl.float32)
    q0 = q0 * tl.load(kstd_ptr + kv_row * D + offs_c, mask=mask_c, other=0.0)[None, :]
    qsum = tl.sum(q0, axis=1)
    q0h, q0l, q0s = _split_f16(q0)
    if PACK == 2:
        q1 = tl.load(
            q_ptr + q_rows[:, None] * D + DP + offs_c[None, :], mask=mask_hc, other=0.0
        ).to(tl.float32)
        q1 = (
            q1
            * tl.load(kstd_ptr + kv_row * D + DP + offs_c, mask=mask_c, other=0.0)[
                None, :
            ]
        )
        qsum += tl.sum(q1, axis=1)
        q1h, q1l, q1s = _split_f16(q1)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_DP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_DP], tl.float32)
    zacc = tl.zeros([BLOCK_H], tl.float32)
    kbase = kp_ptr + kv_row * T * DP
    vbase = vp_ptr + kv_row * T * DP
    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < end
        mask = mask_t[:, None] & mask_c[None, :]
        grp = offs_t // GROUP
        kb = tl.load(
            kbase + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0
        ).to(tl.int32)
        ks = tl.load(ks_ptr + kv_row * G + grp, mask=mask_t, other=0.0).to(tl.float32)
        kz = tl.load(kz_ptr + kv_row * G + grp, mask=mask_t, other=0.0).to(tl.float32)
        # Codes (0..255) are exact in fp16; products accumulate in fp32.
        c0 = tl.trans((kb & levels).to(tl.float16))
        dot = (tl.dot(q0h, c0) + tl.dot(q0l, c0)) * q0s[:, None]
        if PACK == 2:
            c1 = tl.trans(((kb >> BITS) & levels).to(tl.float16))
            dot += (tl.dot(q1h, c1) + tl.dot(q1l, c1)) * q1s[:, None]
        score = (ks[None, :] * dot + kz[None, :] * qsum[:, None]) * sm_scale
        score = tl.where(mask_t[None, :], score, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(score, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new[:, None])
        p = tl.where(mask_t[None, :], p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vb = tl.load(
            vbase + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0
        ).to(tl.int32)
        vs = tl.load(vs_ptr + kv_row * G + grp, mask=mask_t, other=0.0).to(tl.float32)
        vz = tl.load(vz_ptr + kv_row * G + grp, mask=mask_t, other=0.0).to(tl.float32)
        psh, psl, pss = _split_f16(p * vs[None, :])
        v0 = (vb & levels).to(tl.float16)
        acc0 = (
            acc0 * alpha[:, None] + (tl.dot(psh, v0) + tl.dot(psl, v0)) * pss[:, None]
        )
        if PACK == 2:
            v1 = ((vb >> BITS) & levels).to(tl.float16)
            acc1 = (
                acc1 * alpha[:, None]
                + (tl.dot(psh, v1) + tl.dot(psl, v1)) * pss[:, None]
            )
        zacc = zacc * alpha + tl.sum(p * vz[None, :], axis=1)
        m_i = m_new
    # Partial results of this split (un-normalised, before the value statistics); merged
    # on the host.
    part = q_rows * n_splits + split
    tl.store(
        o_ptr + part[:, None] * D + offs_c[None, :], acc0 + zacc[:, None], mask=mask_hc
    )
    if PACK == 2:
        tl.store(
            o_ptr + part[:, None] * D + DP + offs_c[None, :],
            acc1 + zacc[:, None],
            mask=mask_hc,
        )
    tl.store(m_ptr + part, m_i, mask=mask_h)
    tl.store(l_ptr + part, l_i, mask=mask_h)


def _check_decode(q, k, v, seq_lens, sm_scale):
    """Shared by the kernel and the reference: validated ``q`` (contiguous), int32 contiguous lengths and
    the softmax scale."""
    q = _check_tensor(q, "q")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [batch, n_heads, head_dim], got shape {tuple(q.shape)}")
    _check_quantized(k, "k", q.device)
    _check_quantized(v, "v", q.device)
    if len(k.shape) != 4 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must both be quantized [batch, n_kv_heads, tokens, head_dim] tensors, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.bits != v.bits or k.bits not in DECODE_BITS:
        raise ValueError(f"decode attention supports bits in {DECODE_BITS} (the same for k and v), got {k.bits}/{v.bits}")
    if k.group_size != v.group_size:
        raise ValueError(f"k and v must share group_size, got {k.group_size} and {v.group_size}")
    b, hq, d = q.shape
    kb, hkv, t, kd = k.shape
    if kb != b or kd != d:
        raise ValueError(f"q shape {tuple(q.shape)} does not match the cache shape {tuple(k.shape)} (batch, head_dim)")
    if hkv == 0 or hq == 0 or hq % hkv:
        raise ValueError(f"n_heads {hq} must be a positive multiple of n_kv_heads {hkv}")
    if t == 0:
        raise ValueError(f"k and v hold no tokens (shape {tuple(k.shape)}); decode attention needs at least one")
    if sm_scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) \
            or not math.isfinite(float(sm_scale)) or float(sm_scale) <= 0:
        raise ValueError(f"sm_scale must be a finite positive number (or None for 1/sqrt(head_dim)), got {sm_scale!r}")
    else:
        scale = float(sm_scale)
    if seq_lens is None:
        return q, torch.full((b,), t, dtype=torch.int32, device=q.device), scale
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError("seq_lens must be an int32 or int64 tensor")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must have shape ({b},), got {tuple(seq_lens.shape)}")
    _check_device("seq_lens", seq_lens, q.device)
    if b > 0 and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > t):
        raise ValueError(f"seq_lens must lie in [1, {t}] (the cache holds {t} tokens)")
    # .to() returns a strided or expanded view unchanged when the dtype already matches: copy it.
    return q, seq_lens.to(torch.int32).contiguous(), scale


def decode_attention_quant(
    q: torch.Tensor, k: QuantizedTensor, v: QuantizedTensor,
    seq_lens: torch.Tensor | None = None, sm_scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over a packed INT4/INT8 cache, without dequantising it in memory.

    ``q``: ``[B, Hq, D]``; ``k``, ``v``: :class:`~labsrc.kv_quant.QuantizedTensor` of shape ``[B, Hkv, T, D]``
    (``"group"`` or ``"token"`` granularity, e.g. from :func:`quantize_pack`, with or without statistics);
    ``seq_lens``: ``[B]`` valid tokens per sequence (default ``T``). ``Hq`` must be a multiple of ``Hkv``
    (GQA). ``sm_scale``: a finite positive number (default ``1/sqrt(D)``). ``num_splits`` splits each
    sequence over that many programs (default: enough to fill a GPU; at most 65535, Triton's limit on a grid
    axis). Returns ``[B, Hq, D]`` in ``q``'s dtype, equal to :func:`decode_attention_quant_ref`. Every field
    of ``k`` and ``v`` is validated before the launch; tokens past ``seq_lens`` are never read.
    """
    q, lens, scale = _check_decode(q, k, v, seq_lens, sm_scale)
    b, hq, d = q.shape
    _, hkv, t, _ = k.shape
    pack = 8 // k.bits
    dp = d // pack
    n_groups = k.scale.shape[-2]
    if num_splits is None:
        # Enough programs for ~2 waves on a 132-SM GPU; one split per sequence in the
        # interpreter.
        num_splits = (
            1
            if not runtime.HAS_CUDA
            else max(1, min(triton.cdiv(t, 256), triton.cdiv(264, max(1, b * hkv))))
        )
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    qpk = hq // hkv
    block_h = max(16, triton.next_power_of_2(qpk))
    block_dp = max(16, triton.next_power_of_2(dp))
    _check_block(
        f"decode attention with {qpk} query heads per KV head", block_h, block_dp
    )
    _check_block(f"decode attention with head_dim {d}", _DECODE_BLOCK_T, block_dp)
    _check_grid("decode attention's batch (grid axis 0)", b, MAX_GRID_0)
    _check_grid("decode attention's n_kv_heads (grid axis 1)", hkv, MAX_GRID_12)
    _check_grid("num_splits (grid axis 2)", num_splits, MAX_GRID_12)
    _check_row("k", t, d)
    if b == 0:
        return torch.zeros(0, hq, d, dtype=q.dtype, device=q.device)
    if not HAS_TRITON:
        # no Triton on this machine: the reference attends over the dequantized cache
        return decode_attention_quant_ref(q, k, v, lens, sm_scale)
    per_split = (
        triton.cdiv(triton.cdiv(t, num_splits), _DECODE_BLOCK_T) * _DECODE_BLOCK_T
    )
    (kp, ks, kz), (vp, vs, vz) = _buffers(k), _buffers(v)
    _, kstd = _stats_rows(k.stats, (b, hkv), d, q.device)
    vmean, vstd = _stats_rows(v.stats, (b, hkv), d, q.device)
    o = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    _decode_kernel[(b, hkv, num_splits)](
        q,
        kp,
        ks,
        kz,
        kstd,
        vp,
        vs,
        vz,
        lens,
        o,
        m,
        l_,
        hq,
        hkv,
        t,
        d,
        dp,
        n_groups,
        scale,
        per_split,
        BITS=k.bits,
        PACK=pack,
        GROUP=k.group_size,
        QPK=qpk,
        BLOCK_H=block_h,
        BLOCK_T=_DECODE_BLOCK_T,
        BLOCK_DP=block_dp,
        num_warps=_WARPS,
    )
    # Merge the splits (log-sum-exp), normalise, then apply the value statistics sigma_j
    # * (.) + mu_j.
    m_max = m.amax(dim=2, keepdim=True)
    w = torch.exp(m - m_max)  # empty splits have m = -inf and weigh 0
    out = (o * w.unsqueeze(-1)).sum(2) / (l_ * w).sum(2, keepdim=True)
    group = hq // hkv
    out = out * vstd.view(b, hkv, 1, d).expand(b, hkv, group, d).reshape(b, hq, d) \
        + vmean.view(b, hkv, 1, d).expand(b, hkv, group, d).reshape(b, hq, d)
    return out.to(q.dtype)


def decode_attention_quant_ref(q: torch.Tensor, k: QuantizedTensor, v: QuantizedTensor,
                               seq_lens: torch.Tensor | None = None, sm_scale: float | None = None) -> torch.Tensor:
    """PyTorch reference: dequantise the whole cache, then ordinary masked softmax attention (fp32).

    Tokens past ``seq_lens`` are masked out of the scores and zeroed in V, so (as in the kernel) what they
    hold, NaN included, cannot reach the output.
    """
    q, lens, scale = _check_decode(q, k, v, seq_lens, sm_scale)
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    kf = k.dequantize().float().repeat_interleave(hq // hkv, dim=1)
    vf = v.dequantize().float().repeat_interleave(hq // hkv, dim=1)
    valid = torch.arange(t, device=q.device)[None, :] < lens[:, None].long()
    vf = vf.masked_fill(~valid[:, None, :, None], 0.0)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), kf) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", scores.softmax(-1), vf).to(q.dtype)


def decode_attention_ref_fp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Unquantized decode attention baseline with ``torch.nn.functional.scaled_dot_product_attention``.

    ``q``: ``[B, Hq, D]``, ``k``, ``v``: ``[B, Hkv, T, D]`` (GQA via ``enable_gqa``); ``seq_lens``: ``[B]``
    integers in ``[1, T]``.
    """
    for name, x, dims in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        _check_tensor(x, name)
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    b, hq, d = q.shape
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B, Hkv, T, D] for q {tuple(q.shape)}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"n_heads {hq} must be a positive multiple of n_kv_heads {k.shape[1]}")
    t = k.shape[2]
    mask = None
    if seq_lens is not None:
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in (torch.int32, torch.int64):
            raise TypeError("seq_lens must be an int32 or int64 tensor")
        if seq_lens.shape != (b,):
            raise ValueError(f"seq_lens must have shape ({b},), got {tuple(seq_lens.shape)}")
        if b > 0 and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > t):
            raise ValueError(f"seq_lens must lie in [1, {t}] (the cache holds {t} tokens)")
        mask = (torch.arange(t, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]).view(b, 1, 1, t)
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
    return out.squeeze(2)


__all__ = ["SUPPORTED_BITS", "DECODE_BITS", "quantize_pack", "quantize_pack_ref", "dequantize_unpack",
           "dequantize_unpack_ref", "decode_attention_quant", "decode_attention_quant_ref", "decode_attention_ref_fp"]
