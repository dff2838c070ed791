"""Paged attention: decode (and chunked prefill) over a KV cache stored in fixed-size blocks.

A paged KV cache (PagedAttention, {cite}`kwon2023paged`) keeps one pool per layer,
``(num_blocks, block_size, n_kv_heads, head_dim)``, and gives each sequence a *block table*: the ids of the
blocks that hold its tokens, in order. Token ``n`` of sequence ``b`` lives in block
``block_tables[b, n // block_size]`` at offset ``n % block_size``. The blocks of one sequence lie anywhere
in the pool, in any order, and several sequences may name the same block (a shared prefix).

* :func:`paged_decode_attention` is chapter 3's flash-decoding with one change: where that kernel read key
  ``n`` at ``K + n * stride``, this one first looks the block up in the table. Everything else is chapter 3's
  design: each sequence's length is split into ``num_splits`` chunks that run in parallel; one program takes
  one chunk of one (sequence, K/V head) for *all* the query heads of its GQA group; each writes a partial
  output and its log-sum-exp, and chapter 3's merge kernel (``_decode_merge_kernel``) combines them under the
  same rule: scores that are all -inf contribute nothing, and a row with no finite score gives 0.
* :func:`paged_prefill_attention` is the chunked-prefill path: a chunk of ``Tq`` new queries of one sequence
  attends to its ``context_len`` cached keys (the prefix and the chunk itself, already written through the
  slot mapping), causal and aligned bottom-right. It gathers the sequence's keys from its blocks and runs
  chapter 3's :func:`~labsrc.kernels.flash_attention.flash_attention`; a fused kernel would read the blocks in
  place, as the decode kernel does (the gather costs one copy of the sequence's K/V per chunk and layer).

Inputs are fp32, fp16 or bf16 (scores and accumulators in fp32); head dims 16 to 128. Under the Triton
interpreter bf16 tiles are upcast to fp32 after loading (``tl.dot`` on bf16 returns garbage there).
"""
from __future__ import annotations

import math

import torch

from labsrc import runtime
from labsrc.kernels import flash_attention as _att
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "paged_prefill_attention",
           "paged_prefill_attention_ref", "gather_kv"]

_INDEX_DTYPES = (torch.int32, torch.int64)
MAX_GRID_AXIS_0 = 2**31 - 1


def _decode_configs() -> list:
    if runtime.INTERPRETED:
        return [triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)]
    stages = (3, 4) if _att._capability()[0] >= 9 else (2, 3)
    # Gathering through the block table keeps page indices and pointers live beside the tiles: at D = 128, 64
    # keys with 4 warps and 128 keys with any warp count spilled registers on sm_80 or sm_90 (128-1196 bytes,
    # `python -m labsrc.gpucheck --compile-only`), so those are left out.
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n, w in ((32, 4), (32, 8), (64, 8)) for s in stages]


@triton.autotune(
    configs=_decode_configs(),
    key=["MAXLEN_BUCKET", "BLOCK_G", "BLOCK_D", "NUM_SPLITS", "PRECISION"],
)
@triton.jit
def _paged_decode_split_kernel(
    Q,
    K_POOL,
    V_POOL,
    BLOCK_TABLES,
    SEQ_LENS,
    MID_O,
    MID_LSE,
    stride_qb,
    stride_qh,
    stride_kblk,
    stride_ktok,
    stride_kh,
    stride_vblk,
    stride_vtok,
    stride_vh,
    stride_tb,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    Hkv,
    D,
    GROUP,
    NUM_SPLITS,
    PAGE,
    qk_scale,
    MAXLEN_BUCKET,  # used only as an autotuning key
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program = one split of one (sequence, K/V head), for all GROUP query heads
    # that share the K/V head: each K/V tile is loaded once and used GROUP times
    # (chapter 3's decode kernel, unchanged in that respect).
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)

    seq_len = tl.load(SEQ_LENS + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)  # may be <= start: an empty split

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
    table = BLOCK_TABLES + b * stride_tb
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0  # token positions in the sequence
        n_mask = offs_n < end
        # The one new step: token n lives in block table[n // PAGE] at offset n % PAGE.
        # The block ids are gathered per token, so a tile may span several blocks, in
        # any order, and PAGE need not divide BLOCK_N. Block ids are widened to 64 bits:
        # block * stride_kblk passes 2^31 in a large pool.
        blocks = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows_k = blocks * stride_kblk + (offs_n % PAGE) * stride_ktok + hkv * stride_kh
        rows_v = blocks * stride_vblk + (offs_n % PAGE) * stride_vtok + hkv * stride_vh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K_POOL + rows_k[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_POOL + rows_v[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # (BLOCK_G, BLOCK_N), log2 units
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Chapter 3's guarded online-softmax step: a tile of all -inf scores contributes
        # nothing.
        m_new, l_i, alpha, p = _att._online_softmax_step(m_i, l_i, s)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out, lse = _att._softmax_finish(acc, l_i, m_i)  # an empty split stores 0 and -inf
    mo_ptrs = (
        MID_O
        + b * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    tl.store(mo_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(MID_LSE + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


# ----------------------------------------------------------------------------------------------------------------
# Checks shared by the wrappers and the references.
# ----------------------------------------------------------------------------------------------------------------
def _check_index(name, t, ndim, dims, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s) {dims}, got shape {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}")


def _check_pools(q, k_pool, v_pool, need_kernel_device, allow_float64):
    _att._check_float_dtype("q", q, allow_float64=allow_float64)
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        _att._check_tensor(name, t, 4, "(num_blocks, block_size, Hkv, D)")
        _att._check_float_dtype(name, t, like=q)
        _att._check_device(name, t, q, need_kernel_device)
        _att._check_last_dim_contiguous(name, t)
    if tuple(v_pool.shape) != tuple(k_pool.shape):
        raise ValueError(f"v_pool must have the same shape as k_pool {tuple(k_pool.shape)}, got {tuple(v_pool.shape)}")
    num_blocks, page, hkv, d = k_pool.shape
    if min(num_blocks, page, hkv, d) < 1:
        raise ValueError(f"k_pool must be non-empty, got shape {tuple(k_pool.shape)}")
    return num_blocks, page, hkv, d


def _check_tables(block_tables, seq_lens, batch, num_blocks, page, device):
    _check_index("block_tables", block_tables, 2, "(B, max_blocks)", device)
    _check_index("seq_lens", seq_lens, 1, "(B,)", device)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have one row per sequence ({batch}), got {block_tables.shape[0]}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have one length per sequence, shape ({batch},), got {tuple(seq_lens.shape)}")
    lens = seq_lens.tolist()  # one host sync: the checks below need the values
    capacity = block_tables.shape[1] * page
    for b, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"seq_lens must be at least 1, got {n} for sequence {b}")
        if n > capacity:
            raise ValueError(f"sequence {b} has {n} tokens, longer than its block table holds "
                             f"({block_tables.shape[1]} blocks x block_size {page} = {capacity})")
    # Only the blocks a sequence uses are read; entries past them are padding and may hold anything.
    used = torch.arange(block_tables.shape[1], device=device)[None, :] < \
        ((seq_lens.to(torch.int64) + page - 1) // page)[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables names block ids in [{int(ids.min())}, {int(ids.max())}] but the pool has "
                         f"{num_blocks} blocks (ids 0..{num_blocks - 1})")
    return lens


def _check_decode(q, k_pool, v_pool, block_tables, seq_lens, sm_scale, num_splits, need_kernel_device=True,
                  allow_float64=False):
    _att._check_tensor("q", q, 3, "(B, Hq, D)")
    num_blocks, page, hkv, d = _check_pools(q, k_pool, v_pool, need_kernel_device, allow_float64)
    _att._check_device("q", q, q, need_kernel_device)
    _att._check_last_dim_contiguous("q", q)
    _att._check_scale(sm_scale)
    batch, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"k_pool must have the same head dim as q ({dq}), got {d}")
    if min(batch, hq) < 1:
        raise ValueError(f"q must be non-empty, got shape {tuple(q.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"q's heads Hq={hq} must be a multiple of k_pool's heads Hkv={hkv} (grouped-query attention)")
    _att._check_head_dim(d)
    if need_kernel_device and hq // hkv > _att.MAX_DECODE_GROUP:
        raise ValueError(f"paged_decode_attention handles at most {_att.MAX_DECODE_GROUP} query heads per K/V "
                         f"head (Hq // Hkv), got Hq={hq}, Hkv={hkv}")
    if need_kernel_device and batch * hkv > MAX_GRID_AXIS_0:
        raise ValueError(f"B * Hkv = {batch * hkv} programs exceed Triton's grid axis 0 limit {MAX_GRID_AXIS_0}")
    lens = _check_tables(block_tables, seq_lens, batch, num_blocks, page, q.device)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= _att.MAX_NUM_SPLITS:
            raise ValueError(f"num_splits must lie in [1, {_att.MAX_NUM_SPLITS}] (the merge kernel holds every "
                             f"split of a row in one tile), got {num_splits}")
    return lens


def gather_kv(k_pool, v_pool, block_table, n):
    """The first ``n`` keys and values of one sequence, gathered from its blocks: ``(Hkv, n, D)`` each."""
    page = k_pool.shape[1]
    blocks = block_table[: (n + page - 1) // page].long()
    k = k_pool[blocks].reshape(-1, *k_pool.shape[2:])[:n]
    v = v_pool[blocks].reshape(-1, *v_pool.shape[2:])[:n]
    return k.transpose(0, 1), v.transpose(0, 1)


# ----------------------------------------------------------------------------------------------------------------
# References and wrappers.
# ----------------------------------------------------------------------------------------------------------------
def paged_decode_attention_ref(q, k_pool, v_pool, block_tables, seq_lens, sm_scale=None):
    """The definition: gather each sequence's keys from its blocks, then dense attention over them.

    Refuses what :func:`paged_decode_attention` refuses; takes fp64 and any device. Returns ``(B, Hq, D)``.
    """
    lens = _check_decode(q, k_pool, v_pool, block_tables, seq_lens, sm_scale, None, need_kernel_device=False,
                         allow_float64=True)
    outs = []
    for b, n in enumerate(lens):
        k, v = gather_kv(k_pool, v_pool, block_tables[b], n)
        outs.append(_att.flash_attention_ref(q[b, :, None, :][None], k[None], v[None], sm_scale=sm_scale))
    return torch.cat(outs)[:, :, 0, :]


def _default_num_splits(batch_heads, max_len, device):
    if runtime.INTERPRETED:
        return max(1, min(4, max_len // 64))
    return _att._default_num_splits(batch_heads, max_len, device)


def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, sm_scale=None, num_splits=None, out=None):
    """One new query per sequence against its ``seq_lens[b]`` cached keys, read through its block table.

    Args:
        q: ``(B, Hq, D)`` queries, float32/float16/bfloat16, 16 <= D <= 128, head dim contiguous.
        k_pool, v_pool: ``(num_blocks, block_size, Hkv, D)`` of q's dtype (any strides but a contiguous head
            dim); ``Hq % Hkv == 0``, at most 128 query heads per K/V head.
        block_tables: ``(B, max_blocks)`` int32/int64: row ``b`` lists the blocks of sequence ``b`` in order;
            entries past ``ceil(seq_lens[b] / block_size)`` are ignored. Any layout (packed before the launch).
        seq_lens: ``(B,)`` int32/int64 lengths in ``[1, max_blocks * block_size]``.
        sm_scale: factor on the scores, ``1/sqrt(D)`` by default.
        num_splits: chunks per sequence (1 to 256); by default enough to fill the device.
        out: optional ``(B, Hq, D)`` tensor of q's dtype to write into (not an expanded view).

    Returns:
        ``(B, Hq, D)`` in q's dtype, equal to dense attention over each sequence's gathered keys.

    Raises:
        TypeError / ValueError naming the argument: wrong dtypes or shapes, mismatched heads, a block id out
        of the pool's range, a sequence longer than its block table, inputs that require grad (inference only).
    """
    lens = _check_decode(q, k_pool, v_pool, block_tables, seq_lens, sm_scale, num_splits)
    _att._check_out("out", out, q.shape, q)
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have the same dtype as q ({q.dtype}), got {out.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pool, v_pool)):
        raise ValueError("paged_decode_attention is inference-only (it has no backward pass), but q, k_pool or "
                         "v_pool requires grad: run it under torch.no_grad() or torch.inference_mode()")
    if not HAS_TRITON:
        ref = paged_decode_attention_ref(q, k_pool, v_pool, block_tables, seq_lens, sm_scale)
        return ref if out is None else out.copy_(ref)
    batch, hq, d = q.shape
    hkv, page = k_pool.shape[2], k_pool.shape[1]
    group = hq // hkv
    max_len = max(lens)
    splits = num_splits if num_splits is not None else _default_num_splits(batch * hkv, max_len, q.device)
    splits = min(splits, max_len)  # more splits than keys would only add empty ones
    if out is None:
        out = torch.empty((batch, hq, d), device=q.device, dtype=q.dtype)
    mid_o = torch.empty((batch, hq, splits, d), device=q.device, dtype=torch.float32)
    mid_lse = torch.empty((batch, hq, splits), device=q.device, dtype=torch.float32)
    tables = block_tables.to(torch.int32).contiguous()  # the kernel reads table + b * stride + i
    lens_t = seq_lens.to(torch.int32).contiguous()
    upcast, precision = _att._launch_flags(q.dtype)
    block_d = max(16, triton.next_power_of_2(d))
    _paged_decode_split_kernel[(batch * hkv, splits)](
        q, k_pool, v_pool, tables, lens_t, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        hkv, d, group, splits, page, _att._default_scale(d, sm_scale) * _att.LOG2E,
        _att._bucket(max_len),
        UPCAST=upcast, PRECISION=precision,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
    )
    _att._decode_merge_kernel[(batch * hq,)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        hq, d, splits,
        BLOCK_S=(block_s := max(2, triton.next_power_of_2(splits))), BLOCK_D=block_d,
        num_warps=_att.merge_warps(block_s, block_d),
    )
    return out


def _check_prefill(q, k_pool, v_pool, block_table, context_len, sm_scale, need_kernel_device=True,
                   allow_float64=False):
    _att._check_tensor("q", q, 3, "(Hq, Tq, D)")
    num_blocks, page, hkv, d = _check_pools(q, k_pool, v_pool, need_kernel_device, allow_float64)
    _att._check_scale(sm_scale)
    hq, tq, dq = q.shape
    if dq != d:
        raise ValueError(f"k_pool must have the same head dim as q ({dq}), got {d}")
    if hq % hkv != 0:
        raise ValueError(f"q's heads Hq={hq} must be a multiple of k_pool's heads Hkv={hkv} (grouped-query attention)")
    if isinstance(context_len, bool) or not isinstance(context_len, int):
        raise TypeError(f"context_len must be an int, got {type(context_len).__name__}")
    if context_len < tq:
        raise ValueError(f"context_len ({context_len}) must count the chunk's own {tq} queries, which are cached "
                         "before attention runs")
    # One sequence's table is 1-D; check the rank here, before the shared (B, max_blocks) checks see a 2-D
    # table of one row and let it through to a gather that fails deep inside.
    _check_index("block_table", block_table, 1, "(max_blocks,)", q.device)
    _check_tables(block_table[None], torch.tensor([context_len], device=q.device), 1, num_blocks, page, q.device)


def paged_prefill_attention_ref(q, k_pool, v_pool, block_table, context_len, sm_scale=None):
    """Chunked prefill, the definition: gather the sequence's ``context_len`` keys, causal attention
    (bottom-right: query ``i`` of the chunk sees keys ``j <= i + context_len - Tq``). ``q`` is ``(Hq, Tq, D)``,
    ``block_table`` ``(max_blocks,)``; returns ``(Hq, Tq, D)``."""
    _check_prefill(q, k_pool, v_pool, block_table, context_len, sm_scale, False, True)
    k, v = gather_kv(k_pool, v_pool, block_table, context_len)
    return _att.flash_attention_ref(q[None], k[None], v[None], causal=True, sm_scale=sm_scale)[0]


def paged_prefill_attention(q, k_pool, v_pool, block_table, context_len, sm_scale=None):
    """Chunked prefill over a paged cache: the gather of :func:`gather_kv`, then chapter 3's causal
    :func:`~labsrc.kernels.flash_attention.flash_attention` (bottom-right aligned). Arguments and checks as
    :func:`paged_prefill_attention_ref`; inference only."""
    _check_prefill(q, k_pool, v_pool, block_table, context_len, sm_scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pool, v_pool)):
        raise ValueError("paged_prefill_attention is inference-only, but q, k_pool or v_pool requires grad")
    k, v = gather_kv(k_pool, v_pool, block_table, context_len)
    return _att.flash_attention(q[None], k[None], v[None], causal=True, sm_scale=sm_scale)[0]
