"""The draft's KV cache from the target's: the draft reads a projection of the target's (quantized) cache
instead of computing its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labsrc.speculative.common import _forward, _new_cache


# ------------------------------------------------------------------------------------------- draft KV from the target
def _rope_tables(model, n: int):
    from labsrc.rope import rope_cos_sin
    rotary = model.model.rotary_emb
    return rope_cos_sin(rotary.inv_freq, n, getattr(rotary, "attention_scaling", 1.0))


def _kv_layout(config) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)``: the shape of one position's keys (and values) in a model's cache."""
    from labsrc.models import config_head_dim
    return config.num_hidden_layers, config.num_key_value_heads, config_head_dim(config)


def cache_features(model, cache) -> torch.Tensor:
    """Every layer's cached keys (rotation by position undone) and values, one row per position: ``(T, F)``
    with ``F = layers x 2 x kv_heads x head_dim`` (the first sequence of the batch). Keys are stored rotated
    by their position (RoPE); undoing the rotation leaves what a position-independent linear map can relate
    across models."""
    from labsrc.rope import apply_rope_ref

    n = cache.get_seq_length()
    if n == 0:
        layers, heads, dim = _kv_layout(model.config)
        return torch.zeros(0, layers * 2 * heads * dim)
    cos, sin = _rope_tables(model, n)
    cols = []
    for layer in cache.layers[: model.config.num_hidden_layers]:
        k = layer.keys[:1, :, :n].float()
        _, k = apply_rope_ref(k, k, cos, -sin)                      # rotate back by -position
        for x in (k, layer.values[:1, :, :n].float()):             # (1, H, T, D) -> (T, H * D)
            cols.append(x[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(cols, dim=1)


@dataclass
class KVProjection:
    """A linear map from the target's KV cache to the draft's (10.4.5): ``draft features = [target features,
    1] @ weight``, fitted by :func:`fit_kv_projection`. :meth:`draft_cache` turns a target cache into a
    draft cache for the same positions without running the draft."""
    weight: torch.Tensor           # (F_target + 1, F_draft)
    r2: float                      # fraction of the draft features' variance explained on the fitting data
    n_positions: int               # positions fitted on

    @torch.no_grad()
    def draft_cache(self, target, draft, target_cache):
        """A ``DynamicCache`` for ``draft`` holding every position of ``target_cache``, projected."""
        from labsrc.rope import apply_rope_ref

        x = cache_features(target, target_cache)
        if x.shape[1] + 1 != self.weight.shape[0]:
            raise ValueError(f"target_cache has {x.shape[1]} features per position but the projection was "
                             f"fitted on {self.weight.shape[0] - 1}: another target?")
        y = torch.cat([x, x.new_ones(len(x), 1)], 1).double() @ self.weight.double()
        layers, heads, dim = _kv_layout(draft.config)
        if y.shape[1] != layers * 2 * heads * dim:
            raise ValueError("the projection was fitted for a draft of another shape")
        n = len(y)
        cos, sin = _rope_tables(draft, n)
        dtype = next(draft.parameters()).dtype
        cache = _new_cache(draft)
        for i, block in enumerate(y.float().split(2 * heads * dim, dim=1)):      # one block per layer
            k, v = (t.reshape(n, heads, dim).transpose(0, 1)[None]                # (1, H, T, D)
                    for t in block.split(heads * dim, dim=1))
            _, k = apply_rope_ref(k, k, cos, sin)                     # rotate to each position again
            cache.update(k.to(dtype), v.to(dtype), i)
        return cache


@torch.no_grad()
def fit_kv_projection(target, draft, sequences, ridge: float = 1e-3) -> KVProjection:
    """Fit :class:`KVProjection` by ridge regression on ``sequences`` (token id tensors): run both models over
    each, then solve ``min ||[X, 1] W - Y||^2 + ridge * trace(X^T X) / F * ||W||^2`` in float64, ``X`` the
    target's :func:`cache_features`, ``Y`` the draft's, one row per position."""
    if not sequences:
        raise ValueError("sequences must hold at least one token sequence")
    if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not ridge >= 0:
        raise ValueError(f"ridge must be a number >= 0, got {ridge!r}")
    xs, ys = [], []
    for ids in sequences:
        ids = ids.reshape(1, -1).to(next(target.parameters()).device)
        tc, dc = _new_cache(target), _new_cache(draft)
        _forward(target, ids, tc)
        _forward(draft, ids, dc)
        xs.append(cache_features(target, tc))
        ys.append(cache_features(draft, dc))
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    x1 = torch.cat([x, x.new_ones(len(x), 1)], 1)
    gram = x1.T @ x1                                                   # its top-left block is X^T X
    reg = ridge * torch.trace(gram[:-1, :-1]) / x.shape[1]
    gram[:-1, :-1] += reg * torch.eye(x.shape[1], dtype=x.dtype)     # the bias is not shrunk
    w = torch.linalg.solve(gram, x1.T @ y)
    resid = y - x1 @ w
    r2 = 1 - float(resid.pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    return KVProjection(weight=w.float(), r2=r2, n_positions=len(x))
