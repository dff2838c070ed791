"""LLM.int8()'s outlier decomposition: the outlier input columns in 16 bits, the rest as absmax INT8.
"""
from __future__ import annotations

import math

import torch

from labsrc.kernels.weight_quant.rtn import _check_acts, _check_weight


# ----------------------------------------------------------------------------------------------- outliers
def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """Indices of the input features (columns of ``x (..., K)``) where some ``|x| >= threshold``."""
    x = x.reshape(-1, x.shape[-1])
    return torch.nonzero(x.abs().amax(0) >= threshold).flatten()


def absmax_int8(x: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8: ``(codes int8, scale fp32)`` with ``scale = max|x| / 127`` over ``dim`` (kept,
    broadcastable), or over the whole tensor when ``dim`` is None; ``x ~ codes * scale``."""
    x = x.float()
    m = x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
    scale = torch.where(m > 0, m / 127, torch.ones_like(m))
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def int8_matmul_outlier(x: torch.Tensor, w: torch.Tensor, threshold: float = 6.0,
                        return_outliers: bool = False):
    """LLM.int8()'s ``x @ w.T``: the input features where any ``|x| >= threshold`` are multiplied in full
    precision; the rest with vector-wise INT8 (one absmax scale per row of ``x`` and one per row of ``w``),
    an exact integer product, then the outer product of the two scales.

    Returns ``y (..., N)`` in fp32 (and the outlier column indices when ``return_outliers``). The error of
    the INT8 part is at most ``(|x|_1 s_w + |w|_1 s_x) / 2`` per output plus second order terms, where
    ``s`` are the two steps; with ``threshold=inf`` this is plain vector-wise INT8, and with ``threshold=0``
    (every column an outlier) it is the fp32 matmul.
    """
    w = _check_weight(w)
    lead = x.shape[:-1]
    x2 = _check_acts(x, w.shape[1]).float()
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or math.isnan(threshold) \
            or threshold < 0:
        raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
    cols = (outlier_columns(x2, threshold) if x2.shape[0]
            else torch.empty(0, dtype=torch.long))
    keep = torch.ones(w.shape[1], dtype=torch.bool)
    keep[cols] = False
    y = x2[:, cols] @ w.float()[:, cols].T
    if bool(keep.any()):
        xq, sx = absmax_int8(x2[:, keep], dim=1)
        wq, sw = absmax_int8(w.float()[:, keep], dim=1)
        # The integer product, exact: every partial sum is an integer of magnitude at
        # most K * 127^2, which fp32 holds exactly below 2^24 (K < 1040) and fp64 below
        # 2^53; a float GEMM is far faster on a CPU than an int32 one and gives the same
        # integers an INT8 tensor core accumulates in int32.
        exact = torch.float32 if xq.shape[1] * 127 ** 2 < 2 ** 24 else torch.float64
        acc = (xq.to(exact) @ wq.to(exact).T).float()
        y = y + acc * sx * sw.T
    y = y.reshape(*lead, w.shape[0])
    return (y, cols) if return_outliers else y
