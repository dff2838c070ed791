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

The package holds one concept per file (every name above is importable from here):

* :mod:`labsrc.kernels.flash_attention.common`: What the attention kernels share outside Triton: the limits
  (head dims, grid axes, int32 offsets), the GPU's compute capability, and the argument checks every wrapper and
  reference runs.
* :mod:`labsrc.kernels.flash_attention.naive`: The plain PyTorch references the kernels are tested against:
  attention, its backward, and decoding against a cache. They refuse what the kernels refuse (the checks of
  :mod:`.common`), but take float64 and any device.
* :mod:`labsrc.kernels.flash_attention.softmax`: The online softmax, in Triton: one step over a block of keys,
  the final division, and the loop over blocks that the lab's attention kernels (this family's, paged, tree,
  kNN-memory, differential) share.
* :mod:`labsrc.kernels.flash_attention.backward`: The FlashAttention-2 backward in Triton: the row sums of dO *
  O, then dK and dV per key block and dQ per query block, each recomputing the probabilities from the saved log-
  sum-exp.
* :mod:`labsrc.kernels.flash_attention.forward`: The FlashAttention forward in Triton (one program per query
  block and head, the keys streamed through an online softmax), its autotune configs and its wrapper, with the
  autograd function that pairs it with the backward.
* :mod:`labsrc.kernels.flash_attention.decode`: Flash-decoding in Triton: the cache split among programs, each a
  partial softmax, then merged by their log-sum-exps.
"""
from __future__ import annotations

from labsrc.kernels.flash_attention.common import (GRID_AXIS_LIMIT, LN2, LOG2E, MAX_DECODE_GROUP, MAX_HEAD_DIM,
                                                   MAX_INT32_OFFSET, MAX_NUM_SPLITS, MIN_HEAD_DIM, _DTYPES,
                                                   _batch_chunks, _bucket, _capability, _check_attention_args,
                                                   _check_decode_args, _check_device, _check_float_dtype,
                                                   _check_grad_out, _check_head_dim, _check_heads_on_grid,
                                                   _check_kv_match_q, _check_last_dim_contiguous, _check_offsets,
                                                   _check_out, _check_scale, _check_tensor, _default_num_splits,
                                                   _default_scale, _kernel_operand, _launch_flags)
from labsrc.kernels.flash_attention.naive import (decode_attention_ref, flash_attention_backward_ref,
                                                  flash_attention_ref)
from labsrc.kernels.flash_attention.softmax import (_attend_blocks, _online_softmax_step, _softmax_finish)
from labsrc.kernels.flash_attention.backward import (_bwd_configs, _bwd_dkdv_configs, _bwd_dkdv_kernel,
                                                     _bwd_dq_configs, _bwd_dq_kernel, _bwd_preprocess_kernel,
                                                     _bwd_shapes, _flash_backward, _recompute_p,
                                                     flash_attention_backward)
from labsrc.kernels.flash_attention.forward import (_FlashAttentionFunction, _flash_attention_kernel,
                                                    _flash_configs, _flash_forward, flash_attention)
from labsrc.kernels.flash_attention.decode import (_decode_configs, _decode_merge_kernel, _decode_split_kernel,
                                                   decode_attention, merge_warps)

__all__ = ["flash_attention", "flash_attention_ref", "flash_attention_backward", "flash_attention_backward_ref",
           "decode_attention", "decode_attention_ref"]

