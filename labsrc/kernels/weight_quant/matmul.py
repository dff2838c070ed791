"""Triton GEMMs on quantized weights: W4A16 (``int4_matmul``) and MXFP4 (``mxfp4_matmul``), each with its PyTorch
reference beside it.

Both compute ``y = x @ W_hat.T`` for activations ``x (..., K)`` and a weight ``W (N, K)`` stored in 4 bits,
dequantizing **in registers**: a program loads a tile of packed bytes once, unpacks the two nibbles, applies
the group's step (and zero point) and feeds the tile to ``tl.dot``; the fp16 weight is never written to
HBM. At decode time (M = 1-16 rows of ``x``) a linear layer is a matrix-vector product whose time is the
time to read the weight, so reading 4 bits instead of 16 per weight is up to a 4x speed-up; the figure of
merit is GB/s of weight bytes against the HBM bandwidth (``labsrc/bench/weight_quant.py``).

Grid and tiles: program ``(pid_m, pid_n)`` computes the output tile ``y[pid_m*BLOCK_M : ..., pid_n*BLOCK_N :
...]`` and walks ``K`` in steps, accumulating in fp32.

* ``int4_matmul`` reads :class:`labsrc.weight_quant.QuantizedWeight`'s planar layout (chapter 5's): byte
  ``j`` of row ``n`` holds column ``j`` (low nibble) and column ``j + K/2`` (high nibble). One tile of
  ``BLOCK_K`` bytes therefore yields two weight tiles, columns ``[j0, j0+BLOCK_K)`` and
  ``[K/2 + j0, ...)``, multiplied with the matching two tiles of ``x``: two ``tl.dot`` per step, no
  interleaving. Each column reads the step and zero point of its group ``k // group_size`` (any group size,
  a trailing partial group included). ``w = (q - z) * s``.
* ``mxfp4_matmul`` reads torchao's/our MXFP4 layout: byte ``j`` holds elements ``2j`` (low) and ``2j + 1``
  (high), 32 elements per E8M0 scale. The tile of bytes yields the even and the odd columns; ``x`` is read
  at the even and at the odd columns to match. E2M1 is decoded arithmetically (``0.5 m`` for a zero
  exponent, ``(1 + 0.5 m) 2^(e-1)`` otherwise) and the scale is built from its bits (``e << 23`` as fp32;
  ``e = 0`` is the subnormal ``2^-127``, ``e = 255`` NaN).

Dtypes: ``x`` in fp32, fp16 or bf16; the output has ``x``'s dtype. fp16/bf16 weights tiles are rounded to
``x``'s dtype before ``tl.dot`` (tensor cores on a GPU); fp32 asks for true fp32 dots (``"ieee"``, not TF32).
Under the Triton interpreter bf16 ``tl.dot`` returns garbage, so there the bf16 tiles are upcast to fp32
(the ``UPCAST`` flag): interpreted results are then slightly *more* precise than the GPU's. With fp16
activations a dequantized weight must fit fp16 (``|w| <= 65504``; for MXFP4, scales up to ``2^13``): a larger
one becomes inf in the tile, as in any fp16 GEMM, where the reference (fp32 throughout) stays finite.

Non-finite values: a NaN or inf in ``x`` or an MXFP4 scale of 255 (NaN) makes the affected outputs NaN, as
in the reference. Row offsets are int64, so no size overflows 32-bit offsets.

These are inference kernels: an ``x`` that requires grad is refused (there is no backward).
"""
from __future__ import annotations

import operator

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton
from labsrc.kernels.weight_quant.mxfp4 import MX_BLOCK, mxfp4_dequantize
from labsrc.kernels.weight_quant.rtn import QuantizedWeight, dequantize

__all__ = ["int4_matmul", "int4_matmul_ref", "mxfp4_matmul", "mxfp4_matmul_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_GRID_0 = 2 ** 31 - 1
MAX_GRID_1 = 65535


# ----------------------------------------------------------------------------------------------- checks
def _index(value, name: str) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive int, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return n


def _check_x(x, k: int, allow_float64: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    allowed = _DTYPES + ((torch.float64,) if allow_float64 else ())
    if x.dtype not in allowed:
        raise TypeError(f"x must be float32, float16 or bfloat16{' (or float64)' if allow_float64 else ''}, "
                        f"got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., K) with K = {k} (the weight's in_features), got "
                         f"{tuple(x.shape)}")
    if x.requires_grad:
        raise ValueError("x requires grad, but these are inference kernels without a backward; call them "
                         "under torch.no_grad() or detach x")


def _check_same_device(x, named) -> None:
    for name, t in named:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; put all tensors on one device")
    if HAS_TRITON and not runtime.INTERPRETED and x.device.type != "cuda":
        raise ValueError(f"tensors are on {x.device}; compiled Triton kernels need CUDA tensors "
                         f"(without a GPU, import labsrc first so that the interpreter is used)")


def _check_int4_args(x, qweight, scales, zeros, group_size, allow_float64=False) -> tuple[int, int, int]:
    """Shared by the kernel's wrapper and the reference: returns ``(N, K, G)``."""
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if qweight.dtype != torch.uint8:
        raise TypeError(f"qweight must be uint8 (two 4-bit codes per byte), got {qweight.dtype}")
    if qweight.dim() != 2 or 0 in qweight.shape:
        raise ValueError(f"qweight must be a non-empty (N, K/2) matrix of packed codes, got {tuple(qweight.shape)}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    g = _index(group_size, "group_size")
    groups = -(-k // g)
    if scales.dtype != torch.float16:
        raise TypeError(f"scales must be float16, got {scales.dtype}")
    if zeros.dtype != torch.uint8:
        raise TypeError(f"zeros must be uint8, got {zeros.dtype}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, groups):
            raise ValueError(f"{name} must have shape (N, ceil(K / group_size)) = ({n}, {groups}) for qweight "
                             f"{tuple(qweight.shape)} and group_size {g}, got {tuple(t.shape)}")
    _check_x(x, k, allow_float64)
    return n, k, groups


def _check_mxfp4_args(x, codes, scales, allow_float64=False) -> tuple[int, int]:
    for name, t in (("codes", codes), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8 (two E2M1 codes per byte), got {codes.dtype}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"scales must be uint8 or float8_e8m0fnu (E8M0 exponents), got {scales.dtype}")
    if codes.dim() != 2 or 0 in codes.shape:
        raise ValueError(f"codes must be a non-empty (N, K/2) matrix, got {tuple(codes.shape)}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    if k % MX_BLOCK:
        raise ValueError(f"codes holds K = {k} columns per row; MXFP4 needs a multiple of {MX_BLOCK}")
    if tuple(scales.shape) != (n, k // MX_BLOCK):
        raise ValueError(f"scales must have shape (N, K/{MX_BLOCK}) = ({n}, {k // MX_BLOCK}) for codes "
                         f"{tuple(codes.shape)}, got {tuple(scales.shape)}")
    _check_x(x, k, allow_float64)
    return n, k


# ----------------------------------------------------------------------------------------------- references
def int4_matmul_ref(x, qweight, scales, zeros, group_size):
    """``x @ dequantize(W).T`` in fp32 (fp64 for fp64 ``x``), returned in ``x``'s dtype: the definition."""
    n, k, _ = _check_int4_args(x, qweight, scales, zeros, group_size, allow_float64=True)
    qw = QuantizedWeight(qweight, scales, zeros, 4, _index(group_size, "group_size"), (n, k))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize(qw).to(x.device, acc)
    return (x.to(acc) @ w.T).to(x.dtype)


def mxfp4_matmul_ref(x, codes, scales):
    """``x @ mxfp4_dequantize(codes, scales).T`` in fp32 (fp64 for fp64 ``x``), in ``x``'s dtype."""
    _check_mxfp4_args(x, codes, scales, allow_float64=True)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = mxfp4_dequantize(codes, scales).to(x.device, acc)
    return (x.to(acc) @ w.T).to(x.dtype)


# ----------------------------------------------------------------------------------------------- configs
def _configs() -> list:
    if runtime.INTERPRETED:
        # one configuration (no benchmarking); the interpreter runs programs one after another in NumPy
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # GPU: decode (M <= 16) wants narrow M tiles and many N tiles to fill the SMs while streaming the weight;
    # prefill wants square 64-128 tiles that reuse each dequantized weight tile across many rows.
    # The two 8192-weight decode tiles (16 x 128 x 64 and 16 x 64 x 128) run 8 warps: each thread holds its
    # share of the packed bytes, the dequantized low and high halves and their steps and zero points (all
    # BLOCK_N x BLOCK_K), and at 4 warps that spilled 50-650 bytes on sm_80 and sm_90 at every stage depth
    # (`python -m labsrc.gpucheck --compile-only`); at 8 warps both GEMMs compile without spills. The 16 x 64 x
    # 128 tile runs 2 stages: at 3, Triton 3.8 (the one CUDA torch pins) spilled 12 bytes of the MXFP4 GEMM on
    # sm_80, where Triton 3.9 did not; at 2 both versions compile both GEMMs without spills, on both architectures.
    shapes = [(16, 64, 64, 4, 4), (16, 128, 64, 8, 4), (16, 64, 128, 8, 2), (32, 64, 64, 4, 4),
              (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 128, 32, 8, 3), (128, 64, 64, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": nn, "BLOCK_K": kk}, num_warps=w, num_stages=s)
            for m, nn, kk, w, s in shapes]


def _bucket(m: int) -> int:
    return triton.next_power_of_2(max(int(m), 1))


def _flags(dtype):
    upcast = runtime.INTERPRETED and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return upcast, precision


# ----------------------------------------------------------------------------------------------- INT4 kernel
@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "GROUP"])
@triton.jit
def _int4_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, HALF, G, GROUP, M_BUCKET,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K       # (BLOCK_M, 1) row starts of x
    # (BLOCK_N, 1) row starts of the packed weight
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * HALF
    # (BLOCK_N, 1) row starts of steps / zero points
    p_rows = rn.to(tl.int64)[:, None] * G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, HALF, BLOCK_K):
        # byte columns = low-nibble weight columns
        j = j0 + tl.arange(0, BLOCK_K)
        j_ok = j < HALF
        w_mask = n_ok[:, None] & j_ok[None, :]
        x_mask = m_ok[:, None] & j_ok[None, :]
        byte = tl.load(q_rows + j[None, :], mask=w_mask, other=0).to(tl.int32)
        # low nibble: column j; high nibble: column j + K/2. Each column uses its
        # group's step and zero.
        g_lo = p_rows + (j // GROUP)[None, :]
        g_hi = p_rows + ((j + HALF) // GROUP)[None, :]
        s_lo = tl.load(s_ptr + g_lo, mask=w_mask, other=0.0).to(tl.float32)
        z_lo = tl.load(z_ptr + g_lo, mask=w_mask, other=0).to(tl.float32)
        s_hi = tl.load(s_ptr + g_hi, mask=w_mask, other=0.0).to(tl.float32)
        z_hi = tl.load(z_ptr + g_hi, mask=w_mask, other=0).to(tl.float32)
        # (BLOCK_N, BLOCK_K), dequantized in registers
        w_lo = ((byte & 15).to(tl.float32) - z_lo) * s_lo
        w_hi = ((byte >> 4).to(tl.float32) - z_hi) * s_hi
        x_lo = tl.load(x_rows + j[None, :], mask=x_mask, other=0.0)
        x_hi = tl.load(x_rows + (j + HALF)[None, :], mask=x_mask, other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is broken: compute in fp32 there
            x_lo = x_lo.to(tl.float32)
            x_hi = x_hi.to(tl.float32)
        acc = tl.dot(
            x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc, input_precision=PRECISION
        )
        acc = tl.dot(
            x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc, input_precision=PRECISION
        )
    out = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------- MXFP4 kernel
@triton.jit
def _e2m1(code):
    """E2M1 code (int32, 0..15) to its fp32 value: sign bit 3, exponent bits 2-1,
    mantissa bit 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    pow2 = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"])
@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr, c_ptr, s_ptr, out_ptr, M, N, K, HALF, NB, M_BUCKET, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    c_rows = c_ptr + rn.to(tl.int64)[:, None] * HALF
    s_rows = s_ptr + rn.to(tl.int64)[:, None] * NB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, HALF, BLOCK_K):
        # bytes: elements 2j (low nibble) and 2j + 1 (high)
        j = j0 + tl.arange(0, BLOCK_K)
        j_ok = j < HALF
        w_mask = n_ok[:, None] & j_ok[None, :]
        x_mask = m_ok[:, None] & j_ok[None, :]
        byte = tl.load(c_rows + j[None, :], mask=w_mask, other=0).to(tl.int32)
        # E8M0: the biased exponent e is the fp32 bit pattern e << 23 (e = 0: the
        # subnormal 2^-127)
        e = tl.load(s_rows + (j // 16)[None, :], mask=w_mask, other=127).to(tl.int32)
        bits = tl.where(e == 0, 0x400000, e << 23)
        scale = tl.where(e == 255, float("nan"), bits.to(tl.float32, bitcast=True))
        w_even = _e2m1(byte & 15) * scale
        w_odd = _e2m1(byte >> 4) * scale
        x_even = tl.load(x_rows + (2 * j)[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + (2 * j + 1)[None, :], mask=x_mask, other=0.0)
        if UPCAST:
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        acc = tl.dot(
            x_even, tl.trans(w_even.to(x_even.dtype)), acc, input_precision=PRECISION
        )
        acc = tl.dot(
            x_odd, tl.trans(w_odd.to(x_odd.dtype)), acc, input_precision=PRECISION
        )
    out = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------- wrappers
def _new_output(m: int, n: int, dtype, device) -> torch.Tensor:
    """The output buffer (uninitialised; the tests fill it with NaN to catch unwritten elements)."""
    return torch.empty(m, n, dtype=dtype, device=device)


def _launch(kernel, x2, n, args, extra):
    m = x2.shape[0]
    out = _new_output(m, n, x2.dtype, x2.device)
    if m == 0:
        return out
    upcast, precision = _flags(x2.dtype)

    def grid(meta):
        gm, gn = triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])
        if gm > MAX_GRID_0 or gn > MAX_GRID_1:
            raise ValueError(f"the launch needs a ({gm}, {gn}) grid, beyond Triton's limits ({MAX_GRID_0}, "
                             f"{MAX_GRID_1}); split x's rows or the weight's rows")
        return (gm, gn)

    kernel[grid](x2, *args, out, m, n, *extra, _bucket(m), UPCAST=upcast, PRECISION=precision)
    return out


def _min_block_n() -> int:
    return min(c.kwargs["BLOCK_N"] for c in _configs())


def _check_grid(n: int) -> None:
    if triton.cdiv(n, _min_block_n()) > MAX_GRID_1:
        raise ValueError(f"the weight has N = {n} rows: more than {MAX_GRID_1} programs on Triton's grid axis 1 "
                         f"(at {_min_block_n()} rows each); split the weight")


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """W4A16: ``x @ W_hat.T`` with the 4-bit weight dequantized inside the kernel; equal to
    :func:`int4_matmul_ref` (``x @ dequantize(qw).T``).

    Args:
        x: activations ``(..., K)``, float32/float16/bfloat16 (any strides: a non-contiguous ``x`` is copied);
            must not require grad. Any number of rows ``M >= 0`` (the decode case is ``M = 1..16``).
        qweight: uint8 ``(N, K/2)``, two codes per byte in the planar layout of
            :func:`labsrc.weight_quant.pack_int4`; ``scales``: fp16 ``(N, G)``; ``zeros``: uint8 ``(N, G)``;
            ``G = ceil(K / group_size)``. The fields of a 4-bit :class:`~labsrc.weight_quant.QuantizedWeight`.
        group_size: input columns per step (``K`` for per-channel).

    Returns ``(..., N)`` in ``x``'s dtype. Raises TypeError/ValueError naming the argument.
    """
    n, k, groups = _check_int4_args(x, qweight, scales, zeros, group_size)
    _check_same_device(x, (("qweight", qweight), ("scales", scales), ("zeros", zeros)))
    g = _index(group_size, "group_size")
    if not HAS_TRITON:
        return int4_matmul_ref(x, qweight, scales, zeros, g)
    _check_grid(n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    args = (qweight.contiguous(), scales.contiguous(), zeros.contiguous())
    out = _launch(_int4_matmul_kernel, x2, n, args, (k, k // 2, groups, g))
    return out.reshape(*lead, n)


def mxfp4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W_hat.T`` for an MXFP4 weight (``codes`` uint8 ``(N, K/2)``, even element in the low nibble;
    ``scales`` E8M0 ``(N, K/32)`` as uint8 or float8_e8m0fnu, from :func:`labsrc.kernels.weight_quant.mxfp4_quantize`
    or torchao), dequantized inside the kernel; equal to :func:`mxfp4_matmul_ref`.

    ``x``: ``(..., K)`` float32/float16/bfloat16, not requiring grad. Returns ``(..., N)`` in ``x``'s dtype.
    """
    n, k = _check_mxfp4_args(x, codes, scales)
    _check_same_device(x, (("codes", codes), ("scales", scales)))
    if not HAS_TRITON:
        return mxfp4_matmul_ref(x, codes, scales)
    _check_grid(n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    args = (codes.contiguous(), scales.view(torch.uint8).contiguous())
    out = _launch(_mxfp4_matmul_kernel, x2, n, args, (k, k // 2, k // MX_BLOCK))
    return out.reshape(*lead, n)

