"""What the attention kernels share outside Triton: the limits (head dims, grid axes, int32 offsets), the
GPU's compute capability, and the argument checks every wrapper and reference runs.
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, triton


LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): log(x) == log2(x) * LN2
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
# Launch limits, checked before any launch (see _check_launch_limits). CUDA allows at most 65535 programs on
# grid axes 1 and 2; axis 0 goes to 2^31 - 1. The kernels put (batch x heads) on axis 1, so a larger batch is
# launched in chunks of the batch (the wrappers loop), and more heads than that are refused.
GRID_AXIS_LIMIT = 65535
# The merge kernel holds all the splits of one row in one (BLOCK_S, BLOCK_D) fp32 tile: 256 x 128 values is
# 128 KiB per program, already past what registers hold (Triton refuses any tile over 2^20 elements).
MAX_NUM_SPLITS = 256
# The decode kernel holds the queries of one K/V head's group in one (BLOCK_G, BLOCK_D) tile that feeds
# tl.dot; beyond 128 rows the operand tiles no longer fit in shared memory on current GPUs.
MAX_DECODE_GROUP = 128
# Offsets inside one (batch, head) slice are 32-bit in the kernels (batch and head offsets are 64-bit).
MAX_INT32_OFFSET = 2**31 - 1
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# Autotuning: a few configurations per GPU generation, exactly one under the interpreter.
# ----------------------------------------------------------------------------------------------------------------
def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if runtime.HAS_CUDA else (0, 0)


def _bucket(n: int) -> int:
    """Autotuning key for a length: retune per power of two, not for every new length a decoder produces."""
    return triton.next_power_of_2(max(int(n), 1))


# ----------------------------------------------------------------------------------------------------------------
# Argument checks shared by the wrappers and the references.
# ----------------------------------------------------------------------------------------------------------------
def _check_tensor(name, t, ndim, dims):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(t.shape)}")


def _check_float_dtype(name, t, like=None, allow_float64=False):
    if like is None:
        if allow_float64 and t.dtype == torch.float64:
            return
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    elif t.dtype != like.dtype:
        raise TypeError(f"{name} must have the same dtype as q ({like.dtype}), got {t.dtype}")


def _check_device(name, t, q, need_kernel_device):
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
    if need_kernel_device and name == "q":
        if t.device.type == "meta":
            raise ValueError("q must hold data; got a tensor on the meta device")
        if HAS_TRITON and not runtime.INTERPRETED and t.device.type != "cuda":
            raise ValueError(f"q must be on a CUDA device for the compiled Triton kernels, got {t.device}")


def _check_last_dim_contiguous(name, t):
    # The kernels take any strides for batch, head and position (views such as transpose(1, 2) are fine) but
    # read the head dimension as one contiguous run.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head) dimension, got strides {t.stride()}")


def _check_head_dim(d):
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={d} is not supported: it must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}")


def _check_scale(sm_scale):
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")
    # The kernels receive sm_scale * log2(e) as a float32 argument: a scale that overflows to inf or
    # underflows to 0 (or a subnormal) there would silently give NaN or uniform attention.
    fp32 = torch.finfo(torch.float32)
    if not fp32.tiny <= float(sm_scale) * LOG2E <= fp32.max:
        raise ValueError(f"sm_scale must be a finite positive number whose product with log2(e) is a normal "
                         f"float32 (between {fp32.tiny / LOG2E:.3g} and {fp32.max / LOG2E:.3g}), got {sm_scale}")


def _check_offsets(name, t, inner_dims):
    # Positions and head-dim lanes inside one (batch, head) slice are indexed with 32-bit offsets.
    span = sum((n - 1) * st for n, st in zip(t.shape[-inner_dims:], t.stride()[-inner_dims:]))
    if span > MAX_INT32_OFFSET:
        raise ValueError(f"{name} spans {span} elements inside one (batch, head) slice (shape {tuple(t.shape)}, "
                         f"strides {t.stride()}); the kernels index it with 32-bit offsets, at most "
                         f"{MAX_INT32_OFFSET}")


def _check_heads_on_grid(name, heads):
    if heads > GRID_AXIS_LIMIT:
        raise ValueError(f"{name}={heads} heads exceed the launch limit of {GRID_AXIS_LIMIT} programs on grid "
                         f"axis 1, which holds batch x heads (the batch is launched in chunks, the heads cannot be)")


def _batch_chunks(batch, heads):
    """Batch ranges ``[b0, b1)`` small enough that ``(b1 - b0) * heads`` programs fit on grid axis 1.

    CUDA refuses a grid with more than 65535 programs on axis 1, where the kernels put (batch x heads): a
    larger batch is launched as several grids over slices of the batch (views: no copy).
    """
    step = max(1, GRID_AXIS_LIMIT // heads)
    return [(b0, min(batch, b0 + step)) for b0 in range(0, batch, step)]


def _default_scale(d, sm_scale):
    return 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)


def _check_out(name, out, shape, like):
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise ValueError(f"{name} must be on the same device as q ({like.device}), got {out.device}")
    _check_last_dim_contiguous(name, out)
    _check_offsets(name, out, out.dim() - 2)  # (Tq, D), (Tq,) or (D,) inside one (batch, head)
    # The kernels write through out's strides. An expanded view (stride 0 over a dimension of size > 1) maps
    # several output elements to one memory location: the writes would overwrite each other.
    if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
        raise ValueError(f"{name} must not be an expanded view (its elements overlap in memory), got strides "
                         f"{out.stride()} for shape {tuple(out.shape)}")


def _check_kv_match_q(q, k, v) -> tuple[int, int]:
    """k and v of one shape (B, Hkv, Tk, D), with q's batch size and head dim; returns (Hkv, Tk)."""
    B, D = q.shape[0], q.shape[-1]
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)}, got {tuple(v.shape)}")
    Bk, Hkv, Tk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k must have the same batch size as q ({B}), got {Bk}")
    if Dk != D:
        raise ValueError(f"k must have the same head dim as q ({D}), got {Dk}")
    return Hkv, Tk


def _check_attention_args(q, k, v, causal, sm_scale, out, lse_out, need_kernel_device=True, allow_float64=False):
    _check_tensor("q", q, 4, "(B, Hq, Tq, D)")
    _check_tensor("k", k, 4, "(B, Hkv, Tk, D)")
    _check_tensor("v", v, 4, "(B, Hkv, Tk, D)")
    _check_float_dtype("q", q, allow_float64=allow_float64)
    _check_float_dtype("k", k, like=q)
    _check_float_dtype("v", v, like=q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_device(name, t, q, need_kernel_device)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_scale(sm_scale)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = _check_kv_match_q(q, k, v)
    if min(B, Hq, Tq, D) < 1 or min(Hkv, Tk) < 1:
        raise ValueError(f"q and k must be non-empty, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"q's heads Hq={Hq} must be a multiple of k's heads Hkv={Hkv} (grouped-query attention)")
    _check_head_dim(D)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_last_dim_contiguous(name, t)
    if need_kernel_device:  # launch limits: only the kernels have them, not the references
        _check_heads_on_grid("Hq", Hq)
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_offsets(name, t, 2)
    _check_out("out", out, q.shape, q)
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have the same dtype as q ({q.dtype}), got {out.dtype}")
    _check_out("lse_out", lse_out, (B, Hq, Tq), q)
    if lse_out is not None and lse_out.dtype != torch.float32:
        raise TypeError(f"lse_out must be float32, got {lse_out.dtype}")


def _check_grad_out(dout, q):
    _check_tensor("dout", dout, 4, "(B, Hq, Tq, D)")
    if tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"dout must have the shape of q {tuple(q.shape)}, got {tuple(dout.shape)}")
    if dout.dtype != q.dtype:
        raise TypeError(f"dout must have the same dtype as q ({q.dtype}), got {dout.dtype}")
    if dout.device != q.device:
        raise ValueError(f"dout must be on the same device as q ({q.device}), got {dout.device}")


def _check_decode_args(q, k_cache, v_cache, seq_lens, sm_scale, num_splits, out, need_kernel_device=True,
                       allow_float64=False):
    _check_tensor("q", q, 3, "(B, Hq, D)")
    _check_tensor("k_cache", k_cache, 4, "(B, Hkv, Tmax, D)")
    _check_tensor("v_cache", v_cache, 4, "(B, Hkv, Tmax, D)")
    _check_tensor("seq_lens", seq_lens, 1, "(B,)")
    _check_float_dtype("q", q, allow_float64=allow_float64)
    _check_float_dtype("k_cache", k_cache, like=q)
    _check_float_dtype("v_cache", v_cache, like=q)
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        _check_device(name, t, q, need_kernel_device)
    _check_scale(sm_scale)
    B, Hq, D = q.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have the same shape as k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    Bk, Hkv, Tmax, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"k_cache must have the same batch size as q ({B}), got {Bk}")
    if Dk != D:
        raise ValueError(f"k_cache must have the same head dim as q ({D}), got {Dk}")
    if min(B, Hq, D, Hkv, Tmax) < 1:
        raise ValueError(f"q and k_cache must be non-empty, got q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"q's heads Hq={Hq} must be a multiple of k_cache's heads Hkv={Hkv} (grouped-query attention)")
    _check_head_dim(D)
    if need_kernel_device and Hq // Hkv > MAX_DECODE_GROUP:
        raise ValueError(f"decode_attention handles at most {MAX_DECODE_GROUP} query heads per K/V head "
                         f"(Hq // Hkv), got Hq={Hq}, Hkv={Hkv}: one program holds a whole group in one tile")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_last_dim_contiguous(name, t)
    if need_kernel_device:
        _check_offsets("k_cache", k_cache, 2)
        _check_offsets("v_cache", v_cache, 2)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must have one length per sequence, shape ({B},), got {tuple(seq_lens.shape)}")
    lo, hi = int(seq_lens.min()), int(seq_lens.max())  # one host sync; cheap next to a decode step
    if lo < 1 or hi > Tmax:
        raise ValueError(f"seq_lens must lie in [1, Tmax={Tmax}], got values from {lo} to {hi}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= Tmax:
            raise ValueError(f"num_splits must lie in [1, Tmax={Tmax}], got {num_splits}")
        if num_splits > MAX_NUM_SPLITS:
            raise ValueError(f"num_splits={num_splits} exceeds the merge kernel's limit of {MAX_NUM_SPLITS} "
                             f"splits (it holds all the splits of a row in one tile)")
    _check_out("out", out, q.shape, q)
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have the same dtype as q ({q.dtype}), got {out.dtype}")


def _kernel_operand(t, dtype):
    """``t`` as the kernels read it: in ``dtype`` and packed (contiguous), copying only if it is not already.

    The kernels receive a raw pointer; an index or length tensor is read at ``ptr + i``, so it must be packed.
    ``t.to(dtype)`` is not enough: when the dtype already matches it returns ``t`` itself, and a sliced
    (``x[::2]``) or expanded (``x.expand(n)``, stride 0) view would then be read as the wrong elements.
    Float operands (q, k, v) do not go through here: the kernels take their strides, so views are read as
    they are, without a copy (only the head dimension must be contiguous; see ``_check_last_dim_contiguous``).
    """
    return t.to(dtype).contiguous()


def _launch_flags(dtype):
    # bf16 tl.dot is broken in the interpreter, so upcast there; fp32 inputs ask for true fp32 dots ("ieee")
    # rather than TF32, so that fp32 really means fp32 on a GPU too.
    upcast = runtime.INTERPRETED and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return upcast, precision


def _default_num_splits(batch_heads: int, tmax: int, device: torch.device) -> int:
    if runtime.INTERPRETED:
        # The interpreter runs programs one by one: splitting buys no parallelism, only exercises the merge.
        return max(1, min(4, tmax // 64))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # Enough programs for about two waves over the SMs, but no split shorter than 128 keys.
    return max(1, min(triton.cdiv(2 * sms, batch_heads), triton.cdiv(tmax, 128), 64))
