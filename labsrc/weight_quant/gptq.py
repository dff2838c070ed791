"""GPTQ: quantize a weight column by column, correcting the columns not yet quantized with the inverse
Hessian of the layer's inputs.
"""
from __future__ import annotations

import torch

from labsrc.kernels.weight_quant.rtn import (QuantizedWeight, _assemble, _check_bits, _check_group_size, _check_int,
                                     _check_weight, _params)


# ----------------------------------------------------------------------------------------------- GPTQ
def hessian(x: torch.Tensor) -> torch.Tensor:
    """``H = 2 X^T X / n`` of activations ``x (..., K)`` (``n`` rows): the Hessian of ``||W X - W_hat X||^2 / n``
    with respect to each row of ``W_hat``. Computed in float64, returned as float32 ``(K, K)``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating torch.Tensor, got {type(x).__name__}")
    x = x.reshape(-1, x.shape[-1]).double()
    if x.shape[0] == 0:
        raise ValueError("x has no rows: a Hessian needs at least one activation vector")
    return (2 * x.T @ x / x.shape[0]).float()


def gptq_quantize(
    w: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int | None = 128,
    block_size: int = 128, damp: float = 0.01, act_order: bool = False,
    symmetric: bool = True,
) -> QuantizedWeight:
    """GPTQ (Frantar et al., 2023): quantize ``w (N, K)`` column by column, spreading each column's error over
    the columns not yet quantized so that ``||W X - W_hat X||^2`` stays small.

    With ``Hinv = H^-1`` (after damping ``H += damp * mean(diag H) * I``), quantizing column ``j`` to ``q_j``
    and updating the rest by ``W[:, j+1:] -= (w_j - q_j) / Hinv[j, j] * Hinv[j, j+1:]`` is the optimal
    (OBS) compensation; the successive inverses needed are the rows of the upper Cholesky factor of
    ``H^-1``, so the whole pass uses one Cholesky factorisation. Updates are applied inside a block of
    ``block_size`` columns at once and to the columns after it lazily, as one matrix product per block.

    Columns whose ``H[j, j] = 0`` (no calibration input reaches them) are set to 0 and their diagonal to 1.
    ``group_size`` steps are found on the up-to-date columns when the pass reaches a group's first column;
    with ``act_order`` (columns in order of decreasing ``H[j, j]``) the steps are those of the contiguous
    groups of the original weight ("static groups"), so the storage format does not change.
    """
    w = _check_weight(w)
    bits = _check_bits(bits)
    n, k = w.shape
    if bits == 4 and k % 2:
        raise ValueError(f"w has in_features K = {k}; 4-bit packing needs an even K")
    if not isinstance(H, torch.Tensor) or not H.is_floating_point():
        raise TypeError(f"H must be a floating torch.Tensor, got {type(H).__name__}")
    if tuple(H.shape) != (k, k):
        raise ValueError(
            f"H must be ({k}, {k}) for a weight with K = {k} columns, got {tuple(H.shape)}"
        )
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H holds NaN or inf")
    g = _check_group_size(group_size, k)
    block_size = _check_int(block_size, "block_size")
    if not isinstance(damp, (int, float)) or isinstance(damp, bool) or not damp >= 0:
        raise ValueError(f"damp must be a non-negative number, got {damp!r}")
    W = w.clone().double()
    H = H.clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    groups = -(-k // g)
    scales = torch.zeros(n, groups, dtype=torch.float32)
    zeros = torch.zeros(n, groups, dtype=torch.float32)
    perm = torch.arange(k)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        for j in range(groups):
            # static groups: steps from the original (dead-zeroed) weight
            scales[:, j], zeros[:, j] = _params(
                W[:, j * g : (j + 1) * g], bits, symmetric
            )
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2]  # a view: in-block updates land in W
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            grp = col // g
            if not act_order and (i1 + i) % g == 0:
                scales[:, grp], zeros[:, grp] = _params(
                    W[:, i1 + i : i1 + i + g], bits, symmetric
                )
            s, z = scales[:, grp].double(), zeros[:, grp].double()
            wc = W1[:, i]
            q = (torch.clamp(torch.round(wc / s) + z, 0, 2 ** bits - 1))
            Q[:, i1 + i] = q
            err = (wc - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    codes = torch.empty_like(Q)
    codes[:, perm] = Q
    return _assemble(codes, scales, zeros, bits, g, symmetric)
