"""The quantized KV cache's kernels, with the format they read beside them (flash-linear-attention's layout:
the plain PyTorch reference beside the fast op).

* :mod:`labsrc.kernels.kv_quant.codes`: the integer codes, scale and zero point, packing into bytes and words;
* :mod:`labsrc.kernels.kv_quant.tensor`: ``QuantizedTensor``, the groupings and KVarN's statistics, and the
  reference quantizer (:mod:`labsrc.kv_quant` builds chapter 5's caches on them);
* :mod:`labsrc.kernels.kv_quant.packed`: the Triton kernels on the packed cache (quantize-and-pack,
  dequantize, decode attention) and their wrappers.

Every name of the kernels' file is importable from here, as it was from ``labsrc.kernels.kvquant``.
"""
from __future__ import annotations

from labsrc.kernels.kv_quant.packed import (SUPPORTED_DTYPES, DECODE_BITS, KERNEL_BITS, _check_kernel_bits,
                                            MAX_BLOCK_NUMEL, MAX_GRID_0, MAX_GRID_12, MAX_ROW_ELEMENTS,
                                            _DECODE_BLOCK_T, _DEQ_BLOCK_T, _PACK_BLOCK_T, _WARPS, _check_tensor,
                                            _check_block, _check_grid, _check_row, _check_device, _stats_rows,
                                            _quantize_pack_kernel, quantize_pack, quantize_pack_ref,
                                            _dequantize_kernel, _check_quantized, _buffers, _check_out_dtype,
                                            dequantize_unpack, dequantize_unpack_ref, _split_f16, _decode_kernel,
                                            _check_decode, decode_attention_quant, decode_attention_quant_ref,
                                            decode_attention_ref_fp)

__all__ = ["SUPPORTED_BITS", "DECODE_BITS", "quantize_pack", "quantize_pack_ref", "dequantize_unpack",
           "dequantize_unpack_ref", "decode_attention_quant", "decode_attention_quant_ref", "decode_attention_ref_fp"]
