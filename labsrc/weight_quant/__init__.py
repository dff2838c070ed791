"""Weight quantization from scratch: round-to-nearest INT8/INT4, LLM.int8()'s outlier split, GPTQ, AWQ, MXFP4
and MXFP4 quantization-aware training (source sections 10.6.1, 10.6.2 and 10.6.5).

Everything here is plain PyTorch; the Triton GEMMs that read the packed weights live in
:mod:`labsrc.kernels.weight_quant`.

Conventions
-----------
Weights are ``nn.Linear``'s ``(out_features, in_features) = (N, K)`` and a layer computes ``y = x @ W.T``.
Groups run along the input dimension ``K``: group ``j`` of row ``n`` is ``W[n, j*g:(j+1)*g]`` (a trailing
partial group when ``g`` does not divide ``K``, as in lab-target's 320- and 864-wide layers); per output
channel is one group of ``K``.

Uniform integer quantization (10.6.1's ``W_int = round(W / scale + zero_point)``) with ``b`` bits and
``L = 2**b - 1``::

    asymmetric:  s = (max(w, 0) - min(w, 0)) / L     z = round(-min(w, 0) / s)
    symmetric:   s = max|w| / (2**(b-1) - 1)         z = 2**(b-1)
    q = clamp(round(w / s) + z, 0, L)                w_hat = (q - z) * s

Codes are unsigned in both cases, so one dequantization rule ``(q - z) * s`` serves every kernel; the
symmetric zero point is the constant ``2**(b-1)`` (the format implies it, so it is not counted in
:attr:`QuantizedWeight.nbytes`). The grid always contains 0 (``min(w, 0)``, ``max(w, 0)``), so a zero weight
(or a column GPTQ zeroes because no activation reaches it) dequantizes to exactly 0. Steps are stored in fp16,
rounded up (so the grid still spans the group and every error stays within half a step, ``|w - w_hat| <=
s/2``), and codes are computed with the stored step; a group whose step overflows fp16 raises a
``ValueError``; an all-zero group gets step 1. ``round`` is PyTorch's round-half-to-even.

Storage: a 4-bit ``qweight`` is packed two codes per byte along ``K`` with chapter 5's planar layout
(:func:`labsrc.kv_quant.pack_codes`: byte ``j`` holds input column ``j`` in its low nibble and column
``j + K/2`` in its high nibble), other bit widths keep one code per byte. :attr:`QuantizedWeight.nbytes`
counts what a packed deployment stores: ``N*K*b/8`` bytes of codes, two bytes per step, and for asymmetric
weights one byte per zero point.

MXFP4 (OCP Microscaling v1.0)
-----------------------------
A block of 32 consecutive elements along ``K`` shares one E8M0 scale ``X = 2**(e - 127)`` (``e`` the stored
byte; 255 is NaN); each element is an E2M1 number (sign, two exponent bits, one mantissa bit: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6). The spec's conversion (section 6.3) takes
``shared_exp = floor(log2(max|V|)) - emax_elem`` with ``emax_elem = 2`` for E2M1, rounds ``V / X`` to the
nearest E2M1 value (ties to even) and clamps to +-6. torchao's default, ``ScaleCalculationMode.FLOOR``, is
this rule, read off the fp32 exponent bits of ``max|V|``; we follow it bit for bit, including its edges:

* the exponent is clamped to E8M0's range: a block whose ``max|V|`` is below ``2**-125`` (zeros, fp32
  subnormals) stores ``e = 0`` (``X = 2**-127``), yet torchao divides by ``2**-126`` (it clamps the divisor to
  the smallest normal fp32 to dodge subnormal arithmetic), so such a block dequantizes to half its value;
* a block holding NaN stores ``e = 255`` and dequantizes to NaN; its codes carry no meaning, but they are
  torchao's too: every element is divided by ``2**128 = inf`` as torchao divides it (finite elements give
  +-0, NaN and inf give NaN), and a NaN gets the code torchao's bit arithmetic gives it
  (:func:`e2m1_encode`); +-inf in a finite block gives ``e = 253`` and code +-6.

Codes are packed two per byte with the *even* element in the low nibble (torchao's ``pack_uint4``), which
differs from the planar INT4 layout above: bit-identity with torchao's packed bytes is part of the contract.

Fake quantization for QAT uses the straight-through estimator: the forward pass sees the MXFP4 round trip
of the weight, the backward pass treats the round trip as the identity (:func:`fake_quant_mxfp4`).

The package holds one concept per file (every name above is importable from here):

* :mod:`labsrc.kernels.weight_quant.rtn`: Round-to-nearest: the packed INT4/INT8 weight format (``QuantizedWeight``:
  codes, scales, zero points per group), quantizing and dequantizing it, and the output error a quantized layer
  makes.
* :mod:`labsrc.weight_quant.outliers`: LLM.int8()'s outlier decomposition: the outlier input columns in 16 bits,
  the rest as absmax INT8.
* :mod:`labsrc.weight_quant.gptq`: GPTQ: quantize a weight column by column, correcting the columns not yet
  quantized with the inverse Hessian of the layer's inputs.
* :mod:`labsrc.weight_quant.awq`: AWQ: search per-input-channel scales from the activations' magnitudes that
  protect the salient weights.
* :mod:`labsrc.kernels.weight_quant.mxfp4`: MXFP4: E2M1 codes in blocks of 32 sharing a power-of-two scale, their
  packing, and the straight-through fake quantization that quantization-aware training uses.
* :mod:`labsrc.weight_quant.model`: Quantizing a whole model: its linear layers, calibration inputs, the
  quantized layer modules (AWQ, INT8 with outliers, MXFP4 through torchao), QAT, and what a quantized model is
  measured by (bytes, loss, outliers).
* :mod:`labsrc.weight_quant.experiment`: Chapter 12's stored run (``python -m labsrc.weight_quant``): every
  configuration on the lab's model, its loss, bytes and probe accuracy.
"""
from __future__ import annotations

from labsrc.kernels.weight_quant.rtn import (FP16_MAX, QuantizedWeight, SUPPORTED_BITS, _assemble, _check_acts,
                                     _check_bits, _check_group_size, _check_int, _check_weight, _codes, _expand,
                                     _fp16_up, _params, dequantize, layer_output_error, pack_int4, quantize_rtn,
                                     unpack_int4)
from labsrc.weight_quant.outliers import absmax_int8, int8_matmul_outlier, outlier_columns
from labsrc.weight_quant.gptq import gptq_quantize, hessian
from labsrc.weight_quant.awq import apply_awq, awq_search_scales
from labsrc.kernels.weight_quant.mxfp4 import (E2M1_VALUES, MX_BLOCK, _E2M1_EMAX, _F32_MIN_NORMAL, _STE, _pack_even_low,
                                       _unpack_even_low, e2m1_encode, fake_quant_mxfp4, mxfp4_dequantize,
                                       mxfp4_quantize)
from labsrc.weight_quant.model import (AWQLinear, Int8OutlierLinear, LINEAR_NAMES, _set_module,
                                       activation_outliers, calibration_ids, collect_linear_inputs, int8_model,
                                       linear_layers, model_weight_bytes, qat_mxfp4, quantize_model, torchao_mx,
                                       window_nll)
from labsrc.weight_quant.experiment import (ONE_ANSWER_PROBES, PROBES, RESULTS_PATH, main, probe_context,
                                            probe_sets, run_experiment, score_probes)

__all__ = [
    "QuantizedWeight", "quantize_rtn", "dequantize", "pack_int4", "unpack_int4", "hessian", "gptq_quantize",
    "awq_search_scales", "apply_awq", "absmax_int8", "int8_matmul_outlier", "outlier_columns",
    "mxfp4_quantize", "mxfp4_dequantize", "E2M1_VALUES", "e2m1_encode", "fake_quant_mxfp4",
    "layer_output_error", "LINEAR_NAMES", "linear_layers", "collect_linear_inputs", "quantize_model",
    "model_weight_bytes", "calibration_ids",
]

