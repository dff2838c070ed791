"""Rotary position embedding applied to queries and keys, in Triton, with its PyTorch reference beside it.

:func:`apply_rope` rotates ``q (B, Hq, T, D)`` and ``k (B, Hkv, T, D)`` with the cos/sin tables of
:func:`labsrc.rope.rope_cos_sin`, in Llama's "rotate half" layout: coordinates ``i`` and ``i + D/2`` form
pair ``i``, and

    out[..., :D/2] = x1 * cos[:D/2] - x2 * sin[:D/2]
    out[..., D/2:] = x2 * cos[D/2:] + x1 * sin[D/2:]

which is ``x * cos + rotate_half(x) * sin``, the formula of ``transformers``' ``apply_rotary_pos_emb``.
Token ``t`` of sequence ``b`` uses table row ``positions[b, t]`` (or ``positions[t]``; ``t`` by default), so a
decode step at position 4711 passes ``positions=torch.tensor([4711])`` and nothing else changes.

One program handles one token ``(b, t)``: it reads its position, loads that row of cos and sin once, and
rotates every head of ``q`` (first launch) or ``k`` (second launch) at that token, a ``BLOCK_H x D/2`` tile
at a time. The kernel does one multiply-add per element loaded, so it is bound by memory bandwidth: its
figure of merit is GB/s (see ``labsrc/bench/rope.py``). Arithmetic is fp32 whatever the storage dtype
(fp32, fp16, bf16); the outputs have the dtype of ``q``/``k``.

The outputs are **new tensors** by default. ``out_q``/``out_k`` let the caller give the output buffers; they
may be ``q``/``k`` themselves for an in-place rotation, which is safe because each program reads all of its
token's elements before it writes them and no two programs touch the same token.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["apply_rope", "apply_rope_ref"]


# -------------------------------------------------------------------- the reference, in plain PyTorch
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension: the 90-degree turn of every pair ``(x_i, x_{i+D/2})``.

    The last dimension must be even and positive (an odd one has no pairs to turn)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"x must be a tensor with a last dimension of pairs, got {type(x).__name__}")
    if x.shape[-1] < 2 or x.shape[-1] % 2:
        raise ValueError(f"the last dimension of x must be even and >= 2, got {x.shape[-1]}")
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_rope_inputs(q, k, cos, sin, positions=None, check_positions: bool = True) -> None:
    """The checks :func:`apply_rope_ref` and the kernel :func:`labsrc.kernels.rope.apply_rope` share.

    Raises ``TypeError`` for a non-tensor or a wrong dtype and ``ValueError`` for wrong shapes, a head dim
    ``D`` that is odd or 0, or positions outside the tables (that range check syncs with the device; it is
    skipped when ``check_positions`` is False). Dtype limits of the kernel and devices are checked there.
    """
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if positions is not None and not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if not isinstance(check_positions, bool):
        raise TypeError(f"check_positions must be a bool, got {type(check_positions).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, Hq, T, D), got shape {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k must be 4-D (B, Hkv, T, D), got shape {tuple(k.shape)}")
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} must share B, T and D with q {tuple(q.shape)} (heads may differ)")
    if D % 2 or D == 0:
        raise ValueError(f"the head dim D of q and k must be even and positive (pairs i and i + D/2 rotate "
                         f"together), got {D}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != D:
            raise ValueError(f"{name} must be a table (max_pos, D={D}), got shape {tuple(table.shape)}")
        if not table.is_floating_point():
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {table.dtype}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin {tuple(sin.shape)} and cos {tuple(cos.shape)} must have the same shape")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin has dtype {sin.dtype} but cos has {cos.dtype}; they must match")
    if positions is not None:
        if positions.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
        if positions.shape not in ((T,), (B, T)):
            raise ValueError(f"positions must have shape (T,) = ({T},) or (B, T) = ({B}, {T}), "
                             f"got {tuple(positions.shape)}")
        if check_positions and positions.numel():
            # A host sync, but an out-of-table index would read garbage memory (kernel) or wrap around
            # to the end of the table (negative indices in PyTorch) silently.
            low, high = int(positions.min()), int(positions.max())
            if low < 0 or high >= cos.shape[0]:
                raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the rows of the cos/sin tables), "
                                 f"got values in [{low}, {high}]")
    elif T > cos.shape[0]:
        raise ValueError(f"the cos/sin tables have {cos.shape[0]} rows but the default positions arange(T) "
                         f"need T = {T}")


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries ``(B, Hq, T, D)`` and keys ``(B, Hkv, T, D)`` in plain PyTorch (the kernel's reference).

    ``cos``/``sin`` are tables ``(max_pos, D)`` (from :func:`rope_cos_sin`); row ``positions[b, t]`` (or
    ``positions[t]``; default ``t``) rotates token ``t``, so decoding at an offset just passes the offset
    positions. Computes ``x * cos + rotate_half(x) * sin`` in float32 (float64 for float64 inputs) and
    returns new tensors in the input dtype. Refuses what the kernel refuses (:func:`check_rope_inputs`),
    except that it also takes float64 and any device.
    """
    check_rope_inputs(q, k, cos, sin, positions)
    if positions is None:
        positions = torch.arange(q.shape[2], device=q.device)
    # rows (T, D) or (B, T, D), broadcast over the head axis
    cos_p, sin_p = cos[positions], sin[positions]
    compute = torch.promote_types(q.dtype, torch.float32)
    cos_p = cos_p.to(compute).unsqueeze(-3)
    sin_p = sin_p.to(compute).unsqueeze(-3)

    def rotate(x):
        xf = x.to(compute)
        return (xf * cos_p + rotate_half(xf) * sin_p).to(x.dtype)

    return rotate(q), rotate(k)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE_ELEMENTS = 2048  # BLOCK_H * BLOCK_D per half: two 8 KB fp32 tiles in registers per loop step


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
                 T, H,
                 stride_xb, stride_xh, stride_xt,
                 stride_ob, stride_oh, stride_ot,
                 stride_pb, stride_pt, stride_cos, stride_sin,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    # int64 so that b * stride never overflows on large batches
    b = (token // T).to(tl.int64)
    t = (token % T).to(tl.int64)
    p = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    # The two halves of the table row are loaded separately: for tables from
    # rope_cos_sin they are equal, but apply_rotary_pos_emb accepts any table, and so
    # does this kernel.
    cos1 = tl.load(cos_ptr + p * stride_cos + d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + p * stride_cos + HALF + d, mask=d_mask, other=0.0).to(
        tl.float32
    )
    sin1 = tl.load(sin_ptr + p * stride_sin + d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + p * stride_sin + HALF + d, mask=d_mask, other=0.0).to(
        tl.float32
    )

    x_row = x_ptr + b * stride_xb + t * stride_xt
    o_row = out_ptr + b * stride_ob + t * stride_ot
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < H)[:, None] & d_mask[None, :]
        x_ptrs = x_row + h[:, None].to(tl.int64) * stride_xh + d[None, :]
        o_ptrs = o_row + h[:, None].to(tl.int64) * stride_oh + d[None, :]
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos1[None, :] - x2 * sin1[None, :]
        y2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        tl.store(o_ptrs, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptrs + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


# Triton's launch limits: one program per token on grid axis 0 (at most 2^31 - 1 programs), and a tile of
# BLOCK_D = next_power_of_2(D / 2) columns, which may not exceed Triton's largest tensor (2^20 elements).
_MAX_GRID_AXIS_0 = 2 ** 31 - 1
_MAX_BLOCK = tl.TRITON_MAX_TENSOR_NUMEL


def _check_args(q, k, cos, sin, positions, out_q, out_k, check_positions):
    """What the kernel needs beyond the reference's checks (:func:`labsrc.rope.check_rope_inputs`): its
    dtypes, launchable sizes, one device, and output buffers it can write."""
    check_rope_inputs(q, k, cos, sin, positions, check_positions)
    B, _, T, D = q.shape
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {table.dtype}")
    if B * T > _MAX_GRID_AXIS_0:
        raise ValueError(f"q has B * T = {B * T} tokens but one launch handles at most {_MAX_GRID_AXIS_0} "
                         f"(one program per token on Triton's grid axis 0); rotate in chunks")
    if triton.next_power_of_2(D // 2) > _MAX_BLOCK:
        raise ValueError(f"the head dim D = {D} of q and k is too large for the kernel: a tile of "
                         f"next_power_of_2(D/2) = {triton.next_power_of_2(D // 2)} columns exceeds Triton's "
                         f"limit of {_MAX_BLOCK} elements")

    device = q.device
    tensors = [("k", k), ("cos", cos), ("sin", sin)]
    if positions is not None:
        tensors.append(("positions", positions))
    for name, expected, out in (("out_q", q, out_q), ("out_k", k, out_k)):
        if out is None:
            continue
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != expected.shape or out.dtype != expected.dtype:
            raise ValueError(f"{name} must have the shape {tuple(expected.shape)} and dtype {expected.dtype} of "
                             f"{name[4:]}, got {tuple(out.shape)} {out.dtype}")
        # An output is written in place, so it cannot be copied into a better layout: refuse what the kernel
        # cannot write, a last dimension with a stride (it addresses columns as base + d) or elements that
        # share memory (an expand()-ed view: two programs would race on one address).
        if out.stride(3) != 1 and out.shape[3] > 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {out.stride()}")
        if out.numel() and any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
            raise ValueError(f"{name} must not be an expanded view (a stride of 0 makes elements share memory), "
                             f"got strides {out.stride()} for shape {tuple(out.shape)}")
        tensors.append((name, out))
    for name, x in tensors:
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}; put all tensors on one device")
    if HAS_TRITON and device.type != "cuda" and not runtime.INTERPRETED:
        raise ValueError(f"tensors are on {device}; compiled Triton kernels need CUDA tensors "
                         f"(without a GPU, import labsrc first so that the interpreter is used)")


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is dense (the kernel reads columns at base + d and takes every
    other stride as an argument), else a contiguous copy: a sliced, transposed or expanded last dimension
    would otherwise be read as if it were dense, i.e. the wrong elements."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _launch(x, out, positions, cos, sin):
    B, H, T, D = x.shape
    half = D // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(H), _TILE_ELEMENTS // block_d))
    # positions are read through their strides (a stride of 0 for the batch axis of a
    # (T,) tensor), so a sliced, transposed or expand()-ed positions tensor needs no
    # copy; its int32/int64 values are widened to int64 in the kernel.
    stride_pb, stride_pt = (
        (0, positions.stride(0)) if positions.dim() == 1 else positions.stride()
    )
    _rope_kernel[(B * T,)](
        x, out, positions, cos, sin, T, H,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        stride_pb, stride_pt, cos.stride(0), sin.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None = None, *, out_q: torch.Tensor | None = None,
               out_k: torch.Tensor | None = None,
               check_positions: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their positions (Triton); equal to :func:`apply_rope_ref`.

    Args:
        q: queries ``(B, Hq, T, D)``, float32/float16/bfloat16, ``D`` even and positive. Any strides: a
            ``(B, T, H, D)`` tensor transposed to ``(B, H, T, D)`` is read without a copy; a last dimension
            that is not dense (sliced, transposed, expanded) is copied first.
        k: keys ``(B, Hkv, T, D)``, same dtype, ``B``, ``T``, ``D`` as ``q``; ``Hkv`` may differ (GQA).
        cos, sin: tables ``(max_pos, D)`` from :func:`labsrc.rope.rope_cos_sin` (float32/float16/bfloat16);
            any strides (a table whose rows are not dense is copied first).
        positions: int32/int64 ``(T,)`` or ``(B, T)``: the table row of each token; ``arange(T)`` by default.
            Checked to lie inside the table unless ``check_positions=False``.
        out_q, out_k: optional output buffers of the shape and dtype of ``q``/``k``; ``out_q=q`` rotates in
            place. By default new tensors are returned and the inputs are left untouched. Written in place,
            so they need a dense last dimension and no expanded (stride 0) axis.
        check_positions: check that every position indexes a row of the tables. The check costs a
            device-to-host sync per call; an engine that computes positions itself may switch it off (an
            out-of-range position then reads memory outside the table).

    Returns:
        ``(q_rotated, k_rotated)`` in the dtype of ``q``, computed in float32: new contiguous tensors, or
        ``out_q``/``out_k`` when given.

    Raises ``TypeError`` for wrong types or dtypes and ``ValueError`` for wrong shapes (an odd or zero
    ``D`` included), devices, output strides, positions outside the table, or sizes Triton cannot launch
    (more than 2^31 - 1 tokens, a ``D/2`` tile above 2^20 elements), naming the argument.
    """
    _check_args(q, k, cos, sin, positions, out_q, out_k, check_positions)
    B, _, T, _ = q.shape
    if positions is None:
        positions = torch.arange(T, device=q.device)
    out_q = torch.empty_like(q, memory_format=torch.contiguous_format) if out_q is None else out_q
    out_k = torch.empty_like(k, memory_format=torch.contiguous_format) if out_k is None else out_k
    if not HAS_TRITON:  # no Triton on this machine (it has Linux wheels only): the reference rotates
        ref_q, ref_k = apply_rope_ref(q, k, cos, sin, positions)
        return out_q.copy_(ref_q), out_k.copy_(ref_k)
    if B * T == 0:
        return out_q, out_k
    # Inputs are only read, so a view the kernel cannot address is copied (q and k keep any other strides).
    # A copy made here also keeps an in-place call (out_q=q) correct: the kernel reads the copy, writes q.
    q, k, cos, sin = (_unit_last_stride(x) for x in (q, k, cos, sin))
    for x, out in ((q, out_q), (k, out_k)):
        if x.shape[1]:
            _launch(x, out, positions, cos, sin)
    return out_q, out_k
