"""KV-cache quantization from scratch: uniform asymmetric quantization, KIVI-style grouping and KVarN.

Everything here is plain PyTorch; the Triton versions of the hot paths live in :mod:`labsrc.kernels.kv_quant`.

Uniform asymmetric quantization (our convention)
------------------------------------------------
A set of values ``x`` (a *quantization group*) with ``b`` bits gets one step (scale) ``s`` and one zero point
``z``. Unlike the integer zero points of some libraries, our ``z`` is a real number in the units of ``x``: the
value that the integer code 0 stands for (just below the group's minimum). With ``L = 2**b - 1`` levels::

    z = min(x)   (rounded *down* to fp16)          s = (max(x) - z) / L   (rounded *up* to fp16)
    q = clamp(floor((x - z) / s + 1/2), 0, L)      x_hat = q * s + z

``s`` and ``z`` are stored in fp16 (two bytes each, as the source text counts them). They are rounded in the
safe direction, so the grid ``[z, z + L*s]`` still covers ``[min, max]`` and every element's error stays
within half a step, ``|x - x_hat| <= s/2`` (:func:`scale_zero`). Rounding is half-up (``floor(v + 1/2)``),
which is what the Triton kernels do too, so kernel and reference produce the same codes.

Two edge cases, handled alike here and in the kernels (:mod:`labsrc.kernels.kv_quant`):

* *A range fp16 cannot hold.* fp16's largest value is 65504, so a group whose zero point lies below -65504
  or whose step exceeds 65504 (a range above ``65504 * L``: about 2e5 at 2 bits, 1e6 at 4 bits, 1.7e7 at 8
  bits) has no fp16 ``(s, z)``. Storing ``inf`` would turn the whole group into NaN when dequantized, so
  quantizing such a group raises a ``ValueError`` that names the group and its range. We keep fp16 storage
  rather than switching to fp32 metadata so that the byte counts (:attr:`QuantizedTensor.nbytes`,
  :func:`kv_bytes`, the source's :func:`kvarn_bytes_source`) stay both honest and the ones the source text
  compares: two bytes per step and zero point is what is truly stored. With KVarN the range is the one
  *after* normalisation: a channel that was almost constant during calibration (its std is floored at
  ``1e-4``) turns a modest later deviation into a huge normalised value; the error says so.
* *NaN or infinite inputs.* A group holding a NaN, ``+inf`` or ``-inf`` gets NaN as its step and zero point
  and code 0 for every element, so the whole group dequantizes to NaN (the non-finite value is not silently
  replaced by a finite one, and its neighbours are not trusted either: their grid was meant to include it).

Grouping (``granularity``)
--------------------------
For a cache tensor of shape ``(..., tokens, head_dim)``:

* ``"token"``: one ``(s, z)`` per token, shared by its ``head_dim`` channels (the common baseline).
* ``"group"``: one ``(s, z)`` per group of ``g`` consecutive tokens, shared by all channels of the group
  (KVarN's group quantization; ``g = 1`` is the same as ``"token"``).
* ``"channel"``: one ``(s, z)`` per channel per group of ``g`` tokens (KIVI's key quantization).

A trailing partial group (tokens not a multiple of ``g``) is its own, shorter group.

KVarN (source sections 10.3.2-10.3.4)
-------------------------------------
Before quantizing, every channel ``j`` is normalised with calibrated statistics ``mu_j, sigma_j``:
``x~ = (x - mu_j) / sigma_j``; the normalised tensor is group-quantized, and dequantisation is::

    x_hat[i, j] = sigma_j * (q[i, j] * s_g + z_g) + mu_j

The source writes ``sigma_j * round((x~ - z_g)/s_g) * s_g + z_g * sigma_j`` and drops the ``+ mu_j``: without
it a channel with a non-zero mean is reconstructed around zero, so the mean must be added back (or never
subtracted). Statistics are stored in fp16 too, mean and std per channel (per KV head).

Packed layout
-------------
Codes are packed along ``head_dim`` in a *planar* layout: with ``P = 8 // b`` codes per byte and
``Dp = head_dim // P`` bytes per token, byte ``j`` holds channel ``j + k*Dp`` in bits ``[k*b, (k+1)*b)`` for
``k = 0..P-1``. (INT4: channel ``j`` in the low nibble, channel ``j + head_dim/2`` in the high nibble.) This
lets a kernel unpack a whole half of a row with one shift and mask, without interleaving.

Three bits do not divide a byte, so INT3 packs eight codes into three bytes (a 24-bit word) in the same planar
way: with ``Dw = head_dim // 8`` words per token, word ``j`` holds channel ``j + k*Dw`` in bits
``[3k, 3k+3)`` for ``k = 0..7``, and the word's low, middle and high bytes are stored as three planes of
``Dw`` bytes each (bytes ``j``, ``Dw + j``, ``2*Dw + j``). ``head_dim`` must then be a multiple of 8, and a
token costs exactly ``3 * head_dim / 8`` bytes. The Triton kernels (:mod:`labsrc.kernels.kv_quant`) read
2, 4 and 8 bits only; INT3 runs on this module's PyTorch path.

Recipes for the chapter's experiments (``cfg = model.config``, ``stats = calibrate(model, calib_ids)``)
----------------------------------------------------------------------------------------------------
* VarRatio per layer: ``[var_ratio(k).mean() for k, v in collect_kv(model, ids)]`` (per KV head before the
  mean; the same for ``v``).
* MSE with/without normalisation: ``quantization_mse(k, bits=4, group_size=128, normalize=False)`` against
  ``quantization_mse(k, bits=4, group_size=128, stats=stats[l].k)``; compare the ratio with
  ``predicted_mse_ratio(channel_variance(k).mean(dim=(0, 1)))`` (the source's "VarAvg" claim is wrong there).
* Perplexity vs length: ``token_nll(model, ids, cache).mean().exp()`` with ``cache`` one of ``None`` (FP),
  ``KVarNCache.per_token(cfg, 4)``, ``KVarNCache.kivi(cfg, 4, group_size=32, window=32)``,
  ``KVarNCache.kvarn(cfg, stats, 4, group_size=128)`` (a fresh cache per forward pass).
* Layer-wise error: ``hidden_state_errors(model, ids, cache)``; one layer only with
  ``KVarNCache(..., quantize_layers=[l])``.
* Table 10-4 ablation: per-token INT4 ``KVarNCache.per_token(cfg, 4)``; + normalisation
  ``KVarNCache(cfg, 4, 1, "token", "token", True, stats)``; group g=128 / 64 ``KVarNCache.kvarn(cfg, stats, 4, g)``;
  calibration size: ``calibrate`` on 1x and 2x the samples.
* Memory vs formula: ``cache.nbytes`` / ``cache.nbytes_breakdown()`` against ``kv_bytes(...)`` and the
  source's ``kvarn_bytes_source(...)``.
* Probe accuracy per cache: ``probe_accuracy(model, samples, lambda: KVarNCache.kvarn(cfg, stats))``.

The package holds one concept per file (every name above is importable from here):

* :mod:`labsrc.kernels.kv_quant.codes`: The integer codes of a quantized cache: the supported widths, a scale and zero
  point per group, rounding to codes, and packing several codes into a byte or a 32-bit word and back.
* :mod:`labsrc.kernels.kv_quant.tensor`: A quantized tensor: its groups (per token, per channel, per group of channels),
  KVarN's per-channel normalising statistics, and quantizing and dequantizing whole tensors.
* :mod:`labsrc.kv_quant.analysis`: What quantization costs, computed: the channel variances and their spread,
  the error of a grouping and the error the variance ratio predicts, and the bytes of a quantized cache.
* :mod:`labsrc.kv_quant.calibrate`: Calibration: the model's keys and values on calibration text, and KVarN's
  per-channel statistics from them.
* :mod:`labsrc.kv_quant.cache`: A ``transformers`` cache that stores the keys and values quantized (KVarN and
  the plain groupings), with the newest tokens kept in full precision.
* :mod:`labsrc.kv_quant.measure`: Measuring a quantized cache on the lab's model: the next-token loss, the
  hidden states' error and the probes' accuracy.
"""
from __future__ import annotations

from labsrc.kernels.kv_quant.codes import (FP16_MAX, GRANULARITIES, STORE_BYTES, SUPPORTED_BITS, _MIN_STD, _check_bits,
                                   _check_granularity, _check_group_size, _check_int, _check_x, _overflow_error,
                                   _scale_zero, pack_codes, pack_unit, packed_width, quantize_codes, scale_zero,
                                   unpack_codes)
from labsrc.kernels.kv_quant.tensor import (ChannelStats, KVStats, QuantizedTensor, _expand, _groups, _resolve_stats,
                                    fake_quantize, quantize, quantize_per_channel, quantize_per_token)
from labsrc.kv_quant.analysis import (channel_variance, group_range, kv_bytes, kvarn_bytes_source, mse,
                                      predicted_mse_ratio, quantization_mse, relative_mse, var_ratio)
from labsrc.kv_quant.calibrate import _as_id_batches, _text_config, calibrate, collect_kv
from labsrc.kv_quant.cache import CacheFactory, KVarNCache, KVarNLayer
from labsrc.kv_quant.measure import hidden_state_errors, probe_accuracy, token_nll
