"""FlashAttention forward and flash-decoding, written in Triton, with plain PyTorch references beside them.

Two kernels for the two phases of inference:

* :func:`flash_attention` is the *prefill* kernel: many queries against many keys. It never materialises the
  ``Tq x Tk`` score matrix. Each program owns a block of queries, streams the keys and values past them
  block by block, and keeps a running ("online") softmax: the row maximum ``m``, the row sum ``l`` and the
  un-normalised output ``acc`` (FlashAttention-2 {cite}`dao2023flashattention2`, online softmax
  {cite}`milakov2018online`).
* :func:`decode_attention` is the *decode* kernel: one new query per sequence against a long KV cache. One
  query gives too little work to fill a GPU if a program must walk the whole cache, so the cache is split
  into ``num_splits`` chunks that run in parallel, each writing a partial output and its log-sum-exp; a
  second kernel merges them (flash-decoding {cite}`dao2023flashdecoding`).
* :func:`flash_attention_backward` is the *training* half: FlashAttention-2's backward, which recomputes the
  probabilities tile by tile from the saved log-sum-exp instead of storing them (``O(T)`` memory, not
  ``O(T^2)``). :func:`flash_attention` calls it through autograd whenever q, k or v requires grad, so a model
  fine-tuned on these kernels trains its attention projections. ``decode_attention`` is inference-only and
  refuses inputs that require grad while a graph is being recorded.

Both handle grouped-query attention (GQA, {cite}`ainslie2023gqa`): ``Hq`` query heads share ``Hkv`` key/value
heads, ``Hq % Hkv == 0``, and query head ``h`` reads key/value head ``h // (Hq // Hkv)``. The repeated K/V
are never built: the kernels compute the right K/V head from the query head.

Conventions shared by the kernels and their references:

* ``causal=True`` with ``Tq != Tk`` aligns the mask **bottom-right**: query ``i`` sees keys
  ``j <= i + (Tk - Tq)``. The last query is the newest token and sees every key, which is what chunked
  prefill (a chunk of new queries after a cached prefix) and decode need. (PyTorch's
  ``scaled_dot_product_attention(is_causal=True)`` aligns top-left instead; the two agree when ``Tq == Tk``.)
* A causal query row that sees **no** key (``i < Tq - Tk``, only possible when ``Tq > Tk``) has output
  **0** and log-sum-exp **-inf**: the softmax over an empty set is defined as contributing nothing.
* One rule for every online-softmax update and merge (the forward's key blocks, decode's splits and their
  merge, the backward's recomputed probabilities): a set of scores that are all -inf -- an empty split, a
  fully masked block, keys whose scores are -inf -- contributes nothing; a row with no finite score at all
  has output 0 and log-sum-exp -inf, exactly as the references compute it. See ``_online_softmax_step``.
* Inputs are fp32, fp16 or bf16; scores, softmax statistics and the output accumulator are fp32; the
  output has the input dtype and the log-sum-exp (natural log) is fp32.
* Head dims from 16 to 128, including non-powers of two (48, 80, 96): tiles are padded to the next power
  of two and the padded lanes are masked to zero, which leaves every dot product unchanged.

Every tensor a kernel reads is either taken through its strides (q, k, v, out: any batch/head/position strides,
expanded views included, with a contiguous head dimension) or packed into the dtype the kernel expects first
(index and length tensors such as ``seq_lens``, the saved log-sum-exp). Arguments beyond what Triton can launch
(grid axis limits, tile sizes, 32-bit offsets, a scale that is not a normal float32) are refused up front with the
limit in the message, or, for a batch too large for one grid, launched in chunks.

Under the Triton interpreter (no GPU) ``tl.dot`` on bf16 operands returns garbage, so when interpreted the
kernels upcast bf16 tiles to fp32 right after loading them (the ``UPCAST`` constexpr). Compiled on a GPU the
bf16 tiles go to the tensor cores as they are.
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["flash_attention", "flash_attention_ref", "flash_attention_backward", "flash_attention_backward_ref",
           "decode_attention", "decode_attention_ref"]

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
# Plain PyTorch references: the definition the kernels are tested against.
# ----------------------------------------------------------------------------------------------------------------
def flash_attention_ref(q, k, v, causal=False, sm_scale=None, return_lse=False):
    """Attention written the obvious way: build the full score matrix, mask it, softmax it.

    Args:
        q: queries ``(B, Hq, Tq, D)``.
        k, v: keys and values ``(B, Hkv, Tk, D)`` with ``Hq % Hkv == 0`` (grouped-query attention).
        causal: mask so that query ``i`` sees keys ``j <= i + (Tk - Tq)`` (bottom-right aligned).
        sm_scale: the factor applied to ``q @ k^T``; ``1 / sqrt(D)`` by default.
        return_lse: also return the log-sum-exp of each row of scaled scores, ``(B, Hq, Tq)`` in fp32.

    Returns:
        The output ``(B, Hq, Tq, D)`` in ``q.dtype`` (and the log-sum-exp). The arithmetic is fp32 (fp64 for
        fp64 inputs, which only the reference accepts: tests use it as ground truth); a row that sees no key
        (causal with ``Tq > Tk``) gives output 0 and log-sum-exp ``-inf``.
    """
    _check_attention_args(q, k, v, causal, sm_scale, None, None, need_kernel_device=False, allow_float64=True)
    scale = _default_scale(q.shape[-1], sm_scale)
    group = q.shape[1] // k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    # The reference may repeat K/V: it is the definition, not the fast path.
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    if causal:
        tq, tk = q.shape[2], k.shape[2]
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (tk - tq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no visible key
    # exp(s - lse) is the softmax; for an empty row use 0 instead of exp(-inf - -inf) = nan.
    finite = torch.isfinite(lse)
    probs = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    out = (probs @ vf).to(q.dtype)
    return (out, lse) if return_lse else out


def flash_attention_backward_ref(dout, q, k, v, causal=False, sm_scale=None, return_bounds=False):
    """The gradients of attention written out by hand: the formulas the backward kernels implement.

    With ``S = q k^T * scale``, ``P = softmax(S)`` (masked keys and rows that see no key give ``P = 0``),
    ``O = P v`` and the incoming gradient ``dO``:

    * ``dV = P^T dO``
    * ``dP = dO V^T``
    * ``dS = P * (dP - delta)`` with ``delta_i = sum_j P_ij dP_ij = rowsum(dO_i * O_i)`` (the softmax
      Jacobian applied row by row)
    * ``dQ = dS K * scale`` and ``dK = dS^T Q * scale``

    With grouped-query attention a K/V head serves ``Hq // Hkv`` query heads, so its ``dK`` and ``dV`` are the
    sums over those heads.

    Args:
        dout: the gradient of the output ``(B, Hq, Tq, D)``.
        q, k, v, causal, sm_scale: as for :func:`flash_attention_ref`.
        return_bounds: also return, for each gradient, the sum of the magnitudes of the terms it adds up
            (same shapes, in the compute dtype). Each gradient is a long sum whose terms cancel (with a single
            key dq is exactly 0), so its rounding error is relative to this bound, not to the result: tests
            and the bench compare gradients as ``|got - truth| <= atol + rtol * (bound + |truth|)``. The
            bounds are ``scale * (P (|dO| |V|^T + delta')) |K|`` for dq, the transposed form with ``|Q|`` for
            dk, and ``P^T |dO|`` for dv, where ``delta'_i = sum_d |dO_id O_id|`` bounds delta's own error
            (a cancelling sum, computed from O rounded to the input dtype, as FlashAttention does).

    Returns:
        ``(dq, dk, dv)`` in the dtypes of ``q, k, v``, computed in fp32 (fp64 for fp64 inputs); with
        ``return_bounds``, ``((dq, dk, dv), (bound_dq, bound_dk, bound_dv))``.
    """
    _check_attention_args(q, k, v, causal, sm_scale, None, None, need_kernel_device=False, allow_float64=True)
    _check_grad_out(dout, q)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = _default_scale(D, sm_scale)
    group = Hq // Hkv
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, dof = q.to(compute), k.to(compute), v.to(compute), dout.to(compute)
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (Tk - Tq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    out = probs @ vf
    dv = probs.transpose(-1, -2) @ dof  # (B, Hq, Tk, D): one term per query head
    dp = dof @ vf.transpose(-1, -2)
    delta = (dof * out).sum(-1, keepdim=True)
    ds = probs * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    # Grouped-query attention: sum the per-query-head terms of each K/V head.
    dk = dk.view(B, Hkv, group, Tk, D).sum(2)
    dv = dv.view(B, Hkv, group, Tk, D).sum(2)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if not return_bounds:
        return grads
    terms = probs * (dof.abs() @ vf.abs().transpose(-1, -2) + (dof * out).abs().sum(-1, keepdim=True))
    bounds = ((terms @ kf.abs()) * scale,
              ((terms.transpose(-1, -2) @ qf.abs()) * scale).view(B, Hkv, group, Tk, D).sum(2),
              (probs.transpose(-1, -2) @ dof.abs()).view(B, Hkv, group, Tk, D).sum(2))
    return grads, bounds


def decode_attention_ref(q, k_cache, v_cache, seq_lens, sm_scale=None):
    """One query per sequence against the first ``seq_lens[b]`` cached keys of sequence ``b``.

    Args:
        q: the new queries ``(B, Hq, D)``.
        k_cache, v_cache: ``(B, Hkv, Tmax, D)``; only the first ``seq_lens[b]`` positions of row ``b`` count.
        seq_lens: ``(B,)`` integer lengths in ``[1, Tmax]``.
        sm_scale: the factor applied to ``q @ k^T``; ``1 / sqrt(D)`` by default.

    Returns:
        ``(B, Hq, D)`` in ``q.dtype``, computed one sequence at a time in fp32 (fp64 for fp64 inputs).
    """
    _check_decode_args(q, k_cache, v_cache, seq_lens, sm_scale, None, None, need_kernel_device=False,
                       allow_float64=True)
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        qb = q[b : b + 1, :, None, :]
        outs.append(flash_attention_ref(qb, k_cache[b : b + 1, :, :n], v_cache[b : b + 1, :, :n], sm_scale=sm_scale))
    return torch.cat(outs)[:, :, 0, :]


# ----------------------------------------------------------------------------------------------------------------
# Autotuning: a few configurations per GPU generation, exactly one under the interpreter.
# ----------------------------------------------------------------------------------------------------------------
def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if runtime.HAS_CUDA else (0, 0)


def _flash_configs() -> list:
    if runtime.INTERPRETED:
        # The interpreter runs every program one after another in NumPy: fewer, bigger
        # tiles are faster, and one configuration means no benchmarking. 64 x 64 still
        # leaves several query blocks and a full/diagonal split at the test lengths
        # (129, 257), so the block-skipping paths are exercised.
        return [
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)
        ]
    # Only shapes that compile without register spills at D = 128 on their architecture
    # (`python -m labsrc.gpucheck --compile-only`). Each thread holds its share of q,
    # the fp32 accumulator (BLOCK_M x D), the scores and their bf16 copy: a 128-query
    # block needs 8 warps (at 4 warps every 128-row shape spilled, 100-2900 bytes), and
    # 128 x 128 spilled even at 8 warps (180-760 bytes). 64 x 128 at 4 warps spilled too
    # (1-1.7 KB), and on Ampere 64 x 64 at 4 warps with only 2 stages (64 bytes).
    # Hopper: deeper software pipelines (228 KB of shared memory per SM)
    if _capability()[0] >= 9:
        shapes = [
            (128, 64, 8, 3),
            (128, 64, 8, 4),
            (128, 32, 8, 3),
            (64, 64, 4, 4),
            (64, 64, 8, 3),
            (64, 32, 4, 3),
        ]
    # Ampere and older: 164 KB (A100) or 100 KB (consumer) of shared memory, shallower
    # pipelines
    else:
        shapes = [
            (128, 64, 8, 4),
            (128, 32, 8, 3),
            (64, 128, 8, 3),
            (64, 64, 4, 3),
            (64, 64, 8, 3),
            (64, 32, 4, 4),
        ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


def merge_warps(block_s: int, block_d: int) -> int:
    """Warps for the split-merge kernel: its (BLOCK_S, BLOCK_D) fp32 tile lives in registers, and at 256 splits
    x 128 dims (32K values) four warps would need 256 per thread and spill (``python -m labsrc.gpucheck
    --compile-only`` showed 120 bytes on sm_80); eight warps hold it without spilling."""
    return 8 if block_s * block_d > 8192 else 4


def _decode_configs() -> list:
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)]
    stages = (3, 4) if _capability()[0] >= 9 else (2, 3)
    # BLOCK_N = 128 is left out: with D = 128 it spilled registers on sm_90 at every warp count and stage
    # depth (48-104 bytes) and on sm_80 with 8 warps (24 bytes; `python -m labsrc.gpucheck --compile-only`),
    # while 32 or 64 keys per step compile without spills and keep enough loads in flight to stream the cache.
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n in (32, 64) for w in (4, 8) for s in stages]


def _bwd_shapes(dkdv: bool) -> list:
    """(BLOCK_M, BLOCK_N, warps, stages) of the backward kernels on this GPU.

    The backward holds more tiles per program than the forward (q, dO, k, v and two fp32 accumulators), so its
    tiles are smaller. Each list keeps only the shapes that compile without register spills at D = 128
    (``python -m labsrc.gpucheck --compile-only``, with the alignment hints a launch gives). dK/dV (a block
    of BLOCK_N keys, stepping over queries BLOCK_M at a time) spilled in every pipelined shape with 64 or
    more queries per step (100-2000 bytes; 128 x 64 also overflowed shared memory with 3 stages), and with
    4 warps at 32 x 64: it runs 32 queries per step with 8 warps, or 64 x 64 without software pipelining.
    dQ holds one accumulator fewer: 32-64 x 64 compile cleanly on both architectures, and on Hopper
    128 x 64 with 8 warps as well (on Ampere it spilled 24-44 bytes).
    """
    hopper = _capability()[0] >= 9
    if dkdv:
        return [(32, 64, 8, 3), (32, 64, 8, 2), (64, 64, 8, 1)]
    return [(32, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3)] + ([(128, 64, 8, 3)] if hopper else [])


def _bwd_dkdv_configs() -> list:
    return _bwd_configs(dkdv=True)


def _bwd_dq_configs() -> list:
    return _bwd_configs(dkdv=False)


def _bwd_configs(dkdv: bool) -> list:
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
    shapes = _bwd_shapes(dkdv)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _bucket(n: int) -> int:
    """Autotuning key for a length: retune per power of two, not for every new length a decoder produces."""
    return triton.next_power_of_2(max(int(n), 1))


# ----------------------------------------------------------------------------------------------------------------
# The FlashAttention forward kernel.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _online_softmax_step(m_i, l_i, s):
    """One step of the online softmax: fold a tile of scores ``s`` (log2 units) into the
    row state ``(m, l)``.

    Returns ``(m_new, l_new, alpha, p)``: the new row maximum and row sum, the factor
    ``alpha`` that rescales whatever was accumulated under the old maximum, and ``p =
    exp2(s - m_new)``.

    The one rule shared by every online-softmax update and merge in this module: **a set
    of scores that are all -inf (an empty split, a fully masked block, keys whose scores
    are -inf) contributes nothing**. While a row has seen only -inf, ``m`` stays -inf;
    subtracting 0 instead of -inf avoids ``(-inf) - (-inf) = nan``, so ``p`` and
    ``alpha`` come out as ``exp2(-inf) = 0`` and the state stays ``acc = 0, l = 0``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, alpha, p


@triton.jit
def _softmax_finish(acc, l_i, m_i):
    """Normalise the accumulated ``acc`` by the row sum and form the row's log-sum-exp
    (log2 units).

    A row that saw no key (``l = 0``) gets output 0 and log-sum-exp -inf: dividing by 1
    instead of 0 keeps ``acc = 0``, and -inf is what makes the row weigh nothing in a
    later merge (``exp2(-inf) = 0``).
    """
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
    return out, lse2


@triton.jit
def _attend_blocks(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n0, d_mask, lo,
    hi, Tk, diag, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Fold key blocks ``[lo, hi)`` into the running softmax state ``(acc, l_i, m_i)``
    of one query block.

    ``MASKED=False`` is the fast path for blocks that lie entirely inside the sequence
    and below the causal diagonal: no comparison is needed per score. ``MASKED=True``
    handles the diagonal block(s) and the ragged last block. Scores are kept in base 2
    (already multiplied by log2(e)), so each exponential is one ``exp2`` -- the hardware
    instruction -- instead of ``exp`` = ``exp2`` after a multiply.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASKED:
            kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        # Padded head-dim lanes and keys past the end load as 0: they add nothing to q.k
        # and p.v.
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # (BLOCK_M, BLOCK_N), fp32, log2 units
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            visible = offs_n[None, :] < Tk
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
        # Online softmax: a new, larger maximum rescales everything accumulated so far
        # by exp2(m_old - m_new); a row that has seen only -inf so far stays at acc = 0,
        # l = 0 (see _online_softmax_step).
        m_new, l_i, alpha, p = _online_softmax_step(m_i, l_i, s)
        # P goes to the tensor cores in the input precision (as in FlashAttention); the
        # sum stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        # The pointers arrive pointing at key `lo` and advance with the loop: no index
        # multiply per block.
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.autotune(
    configs=_flash_configs(),
    key=["TQ_BUCKET", "TK_BUCKET", "BLOCK_D", "CAUSAL", "PRECISION"],
)
@triton.jit
def _flash_attention_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    Hq,
    Tq,
    Tk,
    D,
    GROUP,
    qk_scale,
    TQ_BUCKET,
    TK_BUCKET,  # used only as autotuning keys
    CAUSAL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one block of BLOCK_M queries of one (batch, query head). Axis 0
    # walks the query blocks so that programs launched together share the same K/V head
    # and hit the same lines in L2.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # Batch and head offsets in 64 bits: b * stride_qb passes 2^31 elements for a few
    # GiB of K/V cache.
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    # grouped-query attention: pick the shared K/V head, never copy it
    hkv = hq // GROUP

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # head dims like 48, 80, 96 are padded up to BLOCK_D, a power of two
    d_mask = offs_d < D

    q_ptrs = (
        Q
        + b * stride_qb
        + hq * stride_qh
        + offs_m[:, None] * stride_qm
        + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < Tq) & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Bottom-right causal alignment: query i sees keys j <= i + diag.
    diag = Tk - Tq
    if CAUSAL:
        # Causal block skipping: keys past the last row's diagonal are never loaded at
        # all...
        hi = tl.minimum(Tk, start_m + BLOCK_M + diag)
        # ...and keys up to the first row's diagonal are visible to every row, so they
        # need no mask.
        full_end = (
            tl.maximum(tl.minimum(start_m + diag + 1, Tk), 0) // BLOCK_N * BLOCK_N
        )
    else:
        hi = Tk
        full_end = Tk // BLOCK_N * BLOCK_N

    # running row maximum (log2 units)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m)
    # running sum of p @ v, not yet divided by l
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = (
        K
        + b * stride_kb
        + hkv * stride_kh
        + offs_n0[:, None] * stride_kn
        + offs_d[None, :]
    )
    v_base = (
        V
        + b * stride_vb
        + hkv * stride_vh
        + offs_n0[:, None] * stride_vn
        + offs_d[None, :]
    )
    acc, l_i, m_i = _attend_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n0,
        d_mask,
        0,
        full_end,
        Tk,
        diag,
        qk_scale,
        BLOCK_N,
        False,
        CAUSAL,
        UPCAST,
        PRECISION,
    )
    acc, l_i, m_i = _attend_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_base + full_end * stride_kn,
        v_base + full_end * stride_vn,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n0,
        d_mask,
        full_end,
        hi,
        Tk,
        diag,
        qk_scale,
        BLOCK_N,
        True,
        CAUSAL,
        UPCAST,
        PRECISION,
    )

    # Normalise once at the end (FlashAttention-2), not after every block. A row that
    # saw no key has l = 0 and acc = 0: the defined output 0 and log-sum-exp -inf.
    out, lse2 = _softmax_finish(acc, l_i, m_i)
    o_ptrs = (
        O
        + b * stride_ob
        + hq * stride_oh
        + offs_m[:, None] * stride_om
        + offs_d[None, :]
    )
    tl.store(
        o_ptrs,
        out.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < Tq) & d_mask[None, :],
    )
    if WRITE_LSE:
        # log(sum exp(s)) = (m + log2(l)) * ln 2, with s in natural units; -inf for an
        # empty row.
        tl.store(
            LSE + b * stride_lb + hq * stride_lh + offs_m,
            lse2 * 0.6931471805599453,
            mask=offs_m < Tq,
        )


# ----------------------------------------------------------------------------------------------------------------
# The FlashAttention backward kernels (FlashAttention-2's algorithm): recompute P, never store it.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_deltab, stride_deltah,
    Hq, Tq, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the term the softmax Jacobian subtracts from every dP_ij
    # of row i. One program per block of rows; computed once here instead of once per key block later.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * stride_deltab + h * stride_deltah + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _recompute_p(q, k, lse2, offs_m, offs_n, Tq, Tk, diag, qk_scale,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """The probabilities ``P = exp(S - lse)`` of one (query block, key block) tile, recomputed from q, k and
    the forward's log-sum-exp, in log2 units: ``exp2(q k^T * scale * log2(e) - lse * log2(e))``.

    ``lse2`` is +inf for a row that saw no key (its lse is -inf), so that its P is exp2(-inf) = 0: the same
    rule as the forward (an empty row contributes nothing, and gets gradient 0). Masked keys, keys past Tk
    and rows past Tq are set to 0 explicitly, whatever their scores are.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    visible = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
    return tl.where(visible, p, 0.0)


@triton.autotune(
    configs=_bwd_dkdv_configs(),
    key=["TQ_BUCKET", "TK_BUCKET", "BLOCK_D", "CAUSAL", "PRECISION"],
)
@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_lb,
    stride_lh,  # shared by LSE and DELTA, both packed (B, Hq, Tq) fp32
    Hkv,
    Tq,
    Tk,
    D,
    GROUP,
    qk_scale,
    sm_scale,
    TQ_BUCKET,
    TK_BUCKET,  # used only as autotuning keys
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one block of BLOCK_N keys of one (batch, K/V head). Its K and V
    # tiles stay in registers while the program walks the query blocks that can see
    # them, for every query head of the GQA group, accumulating dV = P^T dO and dK =
    # dS^T Q in fp32. Summing the group inside the program gives GQA's dK/dV without an
    # Hq-sized buffer and without atomics: the result is deterministic.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
    k = tl.load(
        K
        + b * stride_kb
        + hkv * stride_kh
        + offs_n[:, None] * stride_kn
        + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + b * stride_vb
        + hkv * stride_vh
        + offs_n[:, None] * stride_vn
        + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    diag = Tk - Tq  # bottom-right causal alignment: query i sees keys j <= i + diag
    if CAUSAL:
        # Queries before start_n - diag see none of these keys: start at the block
        # holding the first that does.
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    for g in range(0, GROUP):
        hq = hkv * GROUP + g
        q_base = Q + b * stride_qb + hq * stride_qh + offs_d[None, :]
        do_base = DO + b * stride_dob + hq * stride_doh + offs_d[None, :]
        row_base = b * stride_lb + hq * stride_lh
        for start_m in range(lo, Tq, BLOCK_M):
            offs_m = start_m + offs_m0
            m_mask = offs_m < Tq
            qd_mask = m_mask[:, None] & d_mask[None, :]
            q = tl.load(q_base + offs_m[:, None] * stride_qm, mask=qd_mask, other=0.0)
            do = tl.load(
                do_base + offs_m[:, None] * stride_dom, mask=qd_mask, other=0.0
            )
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + row_base + offs_m, mask=m_mask, other=float("-inf"))
            delta = tl.load(DELTA + row_base + offs_m, mask=m_mask, other=0.0)
            lse2 = tl.where(
                lse == float("-inf"), float("inf"), lse * 1.4426950408889634
            )
            p = _recompute_p(
                q, k, lse2, offs_m, offs_n, Tq, Tk, diag, qk_scale, CAUSAL, PRECISION
            )
            # dV += P^T dO, with P in the input precision for the tensor cores (as in
            # the forward).
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PRECISION)
    # S = q k^T * scale, so dK carries the scale once, applied at the end
    dk = dk * sm_scale
    tl.store(
        DK
        + b * stride_dkb
        + hkv * stride_dkh
        + offs_n[:, None] * stride_dkn
        + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV
        + b * stride_dvb
        + hkv * stride_dvh
        + offs_n[:, None] * stride_dvn
        + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.autotune(configs=_bwd_dq_configs(), key=["TQ_BUCKET", "TK_BUCKET", "BLOCK_D", "CAUSAL", "PRECISION"])
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_lb, stride_lh,
    Hq, Tq, Tk, D, GROUP, qk_scale, sm_scale,
    TQ_BUCKET, TK_BUCKET,  # used only as autotuning keys
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program = one block of BLOCK_M queries of one (batch, query head), walking the key blocks it can see
    # exactly as the forward does and accumulating dQ = dS K. A separate kernel (rather than atomic adds from
    # the dK/dV kernel) recomputes P once more but is deterministic and needs no fp32 dQ buffer.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    hkv = hq // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m_mask = offs_m < Tq
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask,
                other=0.0)
    do = tl.load(DO + b * stride_dob + hq * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=qd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row_base = b * stride_lb + hq * stride_lh
    lse = tl.load(LSE + row_base + offs_m, mask=m_mask, other=float("-inf"))
    delta = tl.load(DELTA + row_base + offs_m, mask=m_mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diag = Tk - Tq
    if CAUSAL:
        hi = tl.minimum(Tk, start_m + BLOCK_M + diag)  # keys past the last row's diagonal: never loaded
    else:
        hi = Tk
    k_base = K + b * stride_kb + hkv * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hkv * stride_vh + offs_d[None, :]
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < Tk) & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = _recompute_p(q, k, lse2, offs_m, offs_n, Tq, Tk, diag, qk_scale, CAUSAL, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + hq * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qd_mask)


# ----------------------------------------------------------------------------------------------------------------
# Flash-decoding: split-K over the cache, then a log-sum-exp merge.
# ----------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_decode_configs(),
    key=["TMAX_BUCKET", "BLOCK_G", "BLOCK_D", "NUM_SPLITS", "PRECISION"],
)
@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    SEQ_LENS,
    MID_O,
    MID_LSE,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    Hkv,
    D,
    GROUP,
    NUM_SPLITS,
    qk_scale,
    TMAX_BUCKET,  # used only as an autotuning key
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one split of the cache of one (batch, K/V head), for ALL the query
    # heads that share that K/V head. Each K/V tile is loaded once and used GROUP times:
    # decode is memory-bound, so this divides the traffic per query head by GROUP -- the
    # whole point of GQA at inference time.
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    # 64-bit batch/head offsets, as in the flash kernel
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)

    # Each sequence splits its own length evenly, so ragged batches give every program
    # similar work.
    seq_len = tl.load(SEQ_LENS + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    # may be <= start: an empty split (short sequence)
    end = tl.minimum(start + split_len, seq_len)

    # query heads of this group, padded to >= 16 rows for tl.dot
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = hkv * GROUP + offs_g

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hkv * stride_vh + offs_d[None, :]
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # (BLOCK_G, BLOCK_N), log2 units
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every block inside the loop holds at least one real key, but its scores may
        # still all be -inf (keys of -inf, or an overflow in fp32): the same guarded
        # step as flash_attention, never a bare exp2(m - m).
        m_new, l_i, alpha, p = _online_softmax_step(m_i, l_i, s)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # Store the split's *normalised* output and its log-sum-exp (log2 units); an empty
    # split (no key, or only -inf scores) stores 0 and -inf, which the merge weighs by
    # exp2(-inf) = 0.
    out, lse = _softmax_finish(acc, l_i, m_i)
    mo_ptrs = (
        MID_O
        + b * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    tl.store(mo_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(MID_LSE + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    MID_O, MID_LSE, O,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    Hq, D, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (batch, query head). Split s holds o_s = softmax-weighted mean
    # over its keys and
    # lse_s = log2 sum exp2(scores); the full softmax weighs each split by its share of
    # the total mass:
    # o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s (for
    # stability).
    # The same rule as every online-softmax step here: a split with lse -inf (no key, or
    # only -inf scores)
    # weighs exp2(-inf) = 0; if every split is empty the row has no key at all and its
    # output is 0.
    pid = tl.program_id(0)
    b = (pid // Hq).to(tl.int64)
    h = (pid % Hq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    lse = tl.load(
        MID_LSE + b * stride_mlb + h * stride_mlh + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    # -inf when every split is empty (e.g. all of a sequence's scores are -inf)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)
    o = tl.load(
        MID_O
        + b * stride_mob
        + h * stride_moh
        + offs_s[:, None] * stride_mos
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        O + b * stride_ob + h * stride_oh + offs_d,
        out.to(O.dtype.element_ty),
        mask=d_mask,
    )


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


# ----------------------------------------------------------------------------------------------------------------
# Wrappers.
# ----------------------------------------------------------------------------------------------------------------
def flash_attention(q, k, v, causal=False, sm_scale=None, return_lse=False, out=None, lse_out=None):
    """FlashAttention: ``softmax(q k^T * sm_scale) v`` without building the score matrix, differentiable.

    Args:
        q: queries ``(B, Hq, Tq, D)``, float32/float16/bfloat16, 16 <= D <= 128, at most 65535 heads
            (``GRID_AXIS_LIMIT``; a batch with more than 65535 (batch x head) programs is launched in chunks).
        k, v: keys and values ``(B, Hkv, Tk, D)`` of q's dtype; ``Hq`` must be a multiple of ``Hkv`` (GQA).
            Any strides are accepted (expanded views included) as long as the last (head) dimension is
            contiguous and one (batch, head) slice spans fewer than 2^31 elements.
        causal: query ``i`` sees keys ``j <= i + (Tk - Tq)`` (bottom-right aligned, see the module docstring).
            A row that sees no key (``Tq > Tk``) gives output 0 and log-sum-exp ``-inf``.
        sm_scale: factor on the scores, ``1/sqrt(D)`` by default; a finite positive number whose product with
            log2(e) is a normal float32 (the kernels receive it as one).
        return_lse: also return the natural-log log-sum-exp of each row, ``(B, Hq, Tq)`` float32.
        out, lse_out: optional tensors to write into (same shapes; ``out`` in q's dtype). Tests pass
            NaN-filled buffers here to prove the kernel writes every element. Not accepted when the call
            records a graph (see below): autograd must own the output it differentiates.

    Returns:
        ``out`` ``(B, Hq, Tq, D)`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Autograd: when gradients are enabled and any of q, k, v requires grad, the call goes through a
    ``torch.autograd.Function`` that saves q, k, v, the output and the log-sum-exp (``O(T)`` extra memory,
    not the ``O(T^2)`` probabilities) and whose backward is :func:`flash_attention_backward`. Otherwise (no
    input requires grad, or under ``torch.no_grad()``) the plain forward runs and nothing is saved. ``lse``
    is returned without a gradient (it is marked non-differentiable).
    """
    _check_attention_args(q, k, v, causal, sm_scale, out, lse_out)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        if out is not None or lse_out is not None:
            raise ValueError("out and lse_out cannot be used when q, k or v require grad: autograd needs to own "
                             "the output it differentiates (drop out=/lse_out=, or call under torch.no_grad())")
        result, lse = _FlashAttentionFunction.apply(q, k, v, causal, sm_scale)
        return (result, lse) if return_lse else result
    write_lse = return_lse or lse_out is not None
    out, lse_out = _flash_forward(q, k, v, causal, sm_scale, out, lse_out, write_lse)
    return (out, lse_out) if return_lse else out


def _flash_forward(q, k, v, causal, sm_scale, out, lse_out, write_lse):
    """Launch the forward kernel on checked arguments; allocates ``out`` (and ``lse_out`` if it is written)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if write_lse and lse_out is None:
        lse_out = torch.empty((B, Hq, Tq), device=q.device, dtype=torch.float32)
    if not HAS_TRITON:  # no Triton on this machine (it has Linux wheels only): the reference computes
        ref, lse = flash_attention_ref(q, k, v, causal, sm_scale, return_lse=True)
        out.copy_(ref)
        if write_lse:
            lse_out.copy_(lse)
        return out, lse_out
    lse_arg = lse_out if write_lse else out  # a placeholder pointer: the kernel never touches it then
    upcast, precision = _launch_flags(q.dtype)
    qk_scale = _default_scale(D, sm_scale) * LOG2E  # fold log2(e) in once, so the kernel uses exp2 only

    for b0, b1 in _batch_chunks(B, Hq):  # one launch unless B * Hq > 65535 (grid axis 1)
        def grid(meta, nb=b1 - b0):
            return (triton.cdiv(Tq, meta["BLOCK_M"]), nb * Hq)

        _flash_attention_kernel[grid](
            q[b0:b1], k[b0:b1], v[b0:b1], out[b0:b1], lse_arg[b0:b1],
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse_out.stride(0) if write_lse else 0, lse_out.stride(1) if write_lse else 0,
            Hq, Tq, Tk, D, Hq // Hkv, qk_scale,
            _bucket(Tq), _bucket(Tk),
            CAUSAL=causal, WRITE_LSE=write_lse, UPCAST=upcast, PRECISION=precision,
            BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return out, lse_out


def flash_attention_backward(dout, q, k, v, out, lse, causal=False, sm_scale=None):
    """The FlashAttention-2 backward pass: ``(dq, dk, dv)`` from the forward's output and log-sum-exp.

    The forward never stores the ``Tq x Tk`` probabilities; the backward recomputes each tile of them from q,
    k and the saved log-sum-exp, ``P = exp(S - lse)``, so memory stays ``O(T)``. Three kernels:

    1. ``delta_i = rowsum(dO_i * O_i)`` (one small pass over the rows);
    2. one program per key block of each (batch, K/V head), looping over the query heads of its GQA group and
       the query blocks that see the keys: ``dV = sum P^T dO`` and ``dK = sum dS^T Q * scale`` with
       ``dS = P * (dO V^T - delta)``, accumulated in fp32 and written once (no atomics, deterministic);
    3. one program per query block of each (batch, query head): ``dQ = sum dS K * scale``.

    Rows that see no key (causal with ``Tq > Tk``) have lse -inf, get ``P = 0`` and therefore contribute
    nothing and receive ``dq = 0``. Usually called by autograd through :func:`flash_attention`; public so that
    the chapter and the tests can call it directly.

    Args:
        dout: gradient of the output ``(B, Hq, Tq, D)``, q's dtype; any strides (a non-contiguous head
            dimension, e.g. the stride-0 gradient of ``out.sum()``, is copied).
        q, k, v, causal, sm_scale: the forward's arguments (same checks as :func:`flash_attention`).
        out: the forward's output ``(B, Hq, Tq, D)``; lse: its log-sum-exp ``(B, Hq, Tq)`` float32.

    Returns:
        ``(dq, dk, dv)``, contiguous, in the dtypes and shapes of q, k, v.
    """
    _check_attention_args(q, k, v, causal, sm_scale, None, None)
    _check_grad_out(dout, q)
    _check_out("out", out, q.shape, q)
    if out.dtype != q.dtype:
        raise TypeError(f"out must have the same dtype as q ({q.dtype}), got {out.dtype}")
    _check_tensor("lse", lse, 3, "(B, Hq, Tq)")
    if tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 of shape {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
    return _flash_backward(dout, q, k, v, out, lse, causal, sm_scale, need_dq=True, need_dkdv=True)


def _flash_backward(dout, q, k, v, out, lse, causal, sm_scale, need_dq, need_dkdv):
    """Launch the three backward kernels on checked arguments (skipping dq or dk/dv when not needed)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    if not HAS_TRITON:  # no Triton on this machine: the hand-written backward reference computes
        return flash_attention_backward_ref(dout, q, k, v, causal, sm_scale)
    # The kernels read the head dimension as one contiguous run. The incoming gradient is whatever autograd
    # hands over: the gradient of out.sum() is an expanded scalar (all strides 0), so copy such a dout.
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    _check_offsets("dout", dout, 2)
    lse = _kernel_operand(lse, torch.float32)  # packed: LSE and DELTA share one (B, Hq, Tq) layout
    delta = torch.empty_like(lse)
    upcast, precision = _launch_flags(q.dtype)
    scale = _default_scale(D, sm_scale)
    block_d = max(16, triton.next_power_of_2(D))
    # No zero-fill: every element of dq, dk, dv is written by a kernel (the tests poison these buffers).
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if need_dq else None
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if need_dkdv else None
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if need_dkdv else None

    for b0, b1 in _batch_chunks(B, Hq):  # grid axis 1 holds batch x heads: at most 65535 programs
        nb = b1 - b0
        qs, ks, vs, dos = q[b0:b1], k[b0:b1], v[b0:b1], dout[b0:b1]
        _bwd_preprocess_kernel[(triton.cdiv(Tq, 64), nb * Hq)](
            out[b0:b1], dos, delta[b0:b1],
            out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            delta.stride(0), delta.stride(1),
            Hq, Tq, D,
            BLOCK_M=64, BLOCK_D=block_d,
        )
        common = dict(CAUSAL=causal, UPCAST=upcast, PRECISION=precision, BLOCK_D=block_d)
        if need_dkdv:
            def grid_kv(meta, nb=nb):
                return (triton.cdiv(Tk, meta["BLOCK_N"]), nb * Hkv)

            _bwd_dkdv_kernel[grid_kv](
                qs, ks, vs, dos, lse[b0:b1], delta[b0:b1], dk[b0:b1], dv[b0:b1],
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                dout.stride(0), dout.stride(1), dout.stride(2),
                dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2),
                lse.stride(0), lse.stride(1),
                Hkv, Tq, Tk, D, group, scale * LOG2E, scale,
                _bucket(Tq), _bucket(Tk), **common,
            )
        if need_dq:
            def grid_q(meta, nb=nb):
                return (triton.cdiv(Tq, meta["BLOCK_M"]), nb * Hq)

            _bwd_dq_kernel[grid_q](
                qs, ks, vs, dos, lse[b0:b1], delta[b0:b1], dq[b0:b1],
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                dout.stride(0), dout.stride(1), dout.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2),
                lse.stride(0), lse.stride(1),
                Hq, Tq, Tk, D, group, scale * LOG2E, scale,
                _bucket(Tq), _bucket(Tk), **common,
            )
    return dq, dk, dv


class _FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward kernel saves what the backward kernels recompute P from.

    Saved: q, k, v (views, not copies), the output and the fp32 log-sum-exp -- ``O(B * Hq * Tq * D)``, never
    the ``Tq x Tk`` probabilities. The log-sum-exp output is marked non-differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out, lse = _flash_forward(q, k, v, causal, sm_scale, None, None, write_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = _flash_backward(dout, q, k, v, out, lse, ctx.causal, ctx.sm_scale,
                                     need_dq=need_q, need_dkdv=need_k or need_v)
        return dq, (dk if need_k else None), (dv if need_v else None), None, None


def _default_num_splits(batch_heads: int, tmax: int, device: torch.device) -> int:
    if runtime.INTERPRETED:
        # The interpreter runs programs one by one: splitting buys no parallelism, only exercises the merge.
        return max(1, min(4, tmax // 64))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # Enough programs for about two waves over the SMs, but no split shorter than 128 keys.
    return max(1, min(triton.cdiv(2 * sms, batch_heads), triton.cdiv(tmax, 128), 64))


def decode_attention(q, k_cache, v_cache, seq_lens, sm_scale=None, num_splits=None, out=None):
    """Flash-decoding: one new query per sequence against its first ``seq_lens[b]`` cached keys.

    A first kernel splits each sequence's cached length into ``num_splits`` chunks; each program handles one
    chunk of one (sequence, K/V head) for all ``Hq // Hkv`` query heads that share it, and writes a partial
    output with its log-sum-exp. A second kernel merges the chunks exactly.

    Args:
        q: ``(B, Hq, D)`` queries, float32/float16/bfloat16, 16 <= D <= 128.
        k_cache, v_cache: ``(B, Hkv, Tmax, D)`` of q's dtype, last dimension contiguous; ``Hq % Hkv == 0``
            with at most 128 query heads per K/V head (``MAX_DECODE_GROUP``). Any other strides, expanded
            views included, are read as they are.
        seq_lens: ``(B,)`` int32/int64 valid lengths in ``[1, Tmax]``; positions past them are ignored. Any
            layout (a slice, an expanded view): it is packed into int32 before the kernel reads it.
        sm_scale: factor on the scores, ``1/sqrt(D)`` by default; a finite positive number whose product with
            log2(e) is a normal float32 (the kernels receive it as one).
        num_splits: chunks per sequence in ``[1, min(Tmax, 256)]`` (256 = ``MAX_NUM_SPLITS``, the most the
            merge kernel holds in one tile); by default enough to fill the device. Splits longer than a
            sequence's length are empty and weigh nothing in the merge.
        out: optional ``(B, Hq, D)`` tensor of q's dtype to write into.

    Returns:
        ``(B, Hq, D)`` in q's dtype, equal to attention over each sequence's first ``seq_lens[b]`` keys.

    Raises:
        ValueError: when gradients are enabled and an input requires grad. Decoding is inference; rather than
            return a result silently cut off from the graph, the call refuses (use :func:`flash_attention`
            with ``Tq = 1`` to differentiate a single query).
    """
    _check_decode_args(q, k_cache, v_cache, seq_lens, sm_scale, num_splits, out)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("decode_attention is inference-only (it has no backward pass), but q, k_cache or "
                         "v_cache requires grad: run it under torch.no_grad() or torch.inference_mode(), or use "
                         "flash_attention, which is differentiable")
    B, Hq, D = q.shape
    Hkv, Tmax = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    if not HAS_TRITON:  # no Triton on this machine: the reference attends
        ref = decode_attention_ref(q, k_cache, v_cache, seq_lens, sm_scale)
        return ref if out is None else out.copy_(ref)
    splits = int(num_splits) if num_splits is not None else _default_num_splits(B * Hkv, Tmax, q.device)
    if out is None:
        out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    mid_o = torch.empty((B, Hq, splits, D), device=q.device, dtype=torch.float32)
    mid_lse = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)
    # `.to(torch.int32)` alone returns the tensor itself when it is already int32, strided or expanded view
    # included, and the kernel reads `SEQ_LENS + b` as if it were packed: make it packed.
    lens = _kernel_operand(seq_lens, torch.int32)
    upcast, precision = _launch_flags(q.dtype)
    block_d = max(16, triton.next_power_of_2(D))
    _decode_split_kernel[(B * Hkv, splits)](
        q, k_cache, v_cache, lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        Hkv, D, group, splits, _default_scale(D, sm_scale) * LOG2E,
        _bucket(Tmax),
        UPCAST=upcast, PRECISION=precision,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
    )
    _decode_merge_kernel[(B * Hq,)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        Hq, D, splits,
        BLOCK_S=(block_s := max(2, triton.next_power_of_2(splits))), BLOCK_D=block_d,  # (>= 2: no size-1 tiles)
        num_warps=merge_warps(block_s, block_d),
    )
    return out
