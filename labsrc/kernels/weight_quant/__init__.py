"""The weight-quantized GEMMs, with the formats they read beside them (flash-linear-attention's layout: the
plain PyTorch reference beside the fast op).

* :mod:`labsrc.kernels.weight_quant.rtn`: ``QuantizedWeight`` (packed INT4/INT8 codes, scales, zero points)
  and round-to-nearest quantizing and dequantizing;
* :mod:`labsrc.kernels.weight_quant.mxfp4`: MXFP4's E2M1 codes in blocks of 32 with a shared scale;
* :mod:`labsrc.kernels.weight_quant.matmul`: the Triton GEMMs that dequantize in registers (W4A16, MXFP4)
  and their wrappers.

Every name of the kernels' file is importable from here, as it was from ``labsrc.kernels.weight_quant``;
:mod:`labsrc.weight_quant` builds chapter 12's methods on the formats.
"""
from __future__ import annotations

from labsrc.kernels.weight_quant.matmul import (_DTYPES, MAX_GRID_0, MAX_GRID_1, _index, _check_x,
                                                _check_same_device, _check_int4_args, _check_mxfp4_args,
                                                int4_matmul_ref, mxfp4_matmul_ref, _configs, _bucket, _flags,
                                                _int4_matmul_kernel, _e2m1, _mxfp4_matmul_kernel, _new_output,
                                                _launch, _min_block_n, _check_grid, int4_matmul, mxfp4_matmul)

__all__ = ["int4_matmul", "int4_matmul_ref", "mxfp4_matmul", "mxfp4_matmul_ref"]
