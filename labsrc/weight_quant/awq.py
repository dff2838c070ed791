"""AWQ: search per-input-channel scales from the activations' magnitudes that protect the salient weights.
"""
from __future__ import annotations

import torch

from labsrc.kernels.weight_quant.rtn import (QuantizedWeight, _check_acts, _check_bits, _check_int, _check_weight,
                                     dequantize, quantize_rtn)


# ----------------------------------------------------------------------------------------------- AWQ
def awq_search_scales(
    w: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int | None = 128,
    grid: int = 20, symmetric: bool = True,
) -> torch.Tensor:
    """AWQ (Lin et al., 2024): one positive scale per input channel, ``s = mean|x|^alpha`` (normalised so that
    ``max(s) * min(s) = 1``), with ``alpha`` in ``{0, 1/grid, ..., (grid-1)/grid}`` chosen to minimise the
    output error ``||x W^T - (x diag(s)^-1) Q(W diag(s))^T||^2`` on the calibration activations ``x (..., K)``.

    ``alpha = 0`` is plain RTN (``s = 1``), so on ``x`` the chosen scales never do worse than RTN. A channel
    that no activation reaches gets ``mean|x|`` floored at ``1e-4`` before the power.
    """
    w = _check_weight(w)
    x2 = _check_acts(x, w.shape[1]).float()
    bits = _check_bits(bits)
    grid = _check_int(grid, "grid")
    if x2.shape[0] == 0:
        raise ValueError("x has no rows: AWQ needs calibration activations")
    mean = x2.abs().mean(0).clamp_min(1e-4).double()
    ref = x2 @ w.float().T
    best, best_s = None, torch.ones(w.shape[1])
    for i in range(grid):
        s = mean ** (i / grid)
        s = (s / torch.sqrt(s.max() * s.min())).float()
        w_hat = dequantize(quantize_rtn(w.float() * s, bits, group_size, symmetric)) / s
        err = float(((ref - x2 @ w_hat.T).double() ** 2).sum())
        if best is None or err < best:
            best, best_s = err, s
    return best_s


def apply_awq(w: torch.Tensor, s: torch.Tensor, bits: int = 4, group_size: int | None = 128,
              symmetric: bool = True) -> QuantizedWeight:
    """Quantize ``W diag(s)`` (RTN); the layer then computes ``(x / s) @ dequantize(qw).T``. In a deployed
    model ``1/s`` is folded into the operation before the layer (an RMSNorm's weight or the previous linear),
    so the division costs nothing; in full precision ``(x diag(s)^-1)(W diag(s))^T = x W^T`` exactly."""
    w = _check_weight(w)
    if not isinstance(s, torch.Tensor) or s.shape != (w.shape[1],) or not bool((s > 0).all()):
        raise ValueError(f"s must be a positive tensor of shape ({w.shape[1]},), one scale per input channel")
    return quantize_rtn((w.float() * s.float()), bits, group_size, symmetric)
