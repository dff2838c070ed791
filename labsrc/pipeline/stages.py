"""One pipeline stage: a contiguous slice of the target's layers with its own slice of the KV cache.

:func:`split_layers` decides which layers each of ``P`` stages holds; :class:`Stage` runs a window of tokens
through its slice. Stage 0 also holds the embeddings, the last stage the final norm and the LM head. The
layers are the target's own ``LlamaDecoderLayer`` modules (so the arithmetic is the model's), called with a
cache of this stage's layers only (:class:`StageCache`) and an explicit causal mask.
"""
from __future__ import annotations

import torch


def split_layers(n_layers: int, stages: int, weights=None) -> list[range]:
    """Contiguous layer ranges for ``stages`` stages.

    Without ``weights`` the ``n_layers`` layers are split as evenly as possible (the first
    ``n_layers % stages`` stages get one layer more). With ``weights`` (one cost per layer, e.g. measured
    seconds) the split minimises the largest stage's total cost (the pipeline's bottleneck), by dynamic
    programming over the cut points. Every stage gets at least one layer.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages!r}")
    if stages > n_layers:
        raise ValueError(f"stages ({stages}) must not exceed n_layers ({n_layers}): each stage needs a layer")
    if weights is None:
        base, extra = divmod(n_layers, stages)
        out, start = [], 0
        for s in range(stages):
            size = base + (1 if s < extra else 0)
            out.append(range(start, start + size))
            start += size
        return out
    w = [float(x) for x in weights]
    if len(w) != n_layers or any(not (x >= 0) or x == float("inf") for x in w):
        raise ValueError(f"weights must be {n_layers} finite non-negative numbers, got {weights!r}")
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[s][i]: the smallest bottleneck splitting layers [0, i) into s stages; cut[s][i] the last cut.
    best = [[inf] * (n_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n_layers + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], n_layers
    for s in range(stages, 0, -1):
        j = cut[s][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]


class StageCache:
    """The K/V of one sequence for this stage's layers only: ``update`` appends, ``crop`` rolls back.

    It offers the one method the Llama attention calls (``update``), so a stage's layers run against it as
    against a full ``DynamicCache`` while holding only this stage's slice.
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=-2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = key, value
        return self.keys[layer_idx], self.values[layer_idx]

    def length(self) -> int:
        return next(iter(self.keys.values())).shape[-2] if self.keys else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop what a rejected window wrote)."""
        for idx in self.keys:
            self.keys[idx] = self.keys[idx][..., :length, :]
            self.values[idx] = self.values[idx][..., :length, :]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())


class Stage:
    """Layers ``layers`` of ``model`` (a ``LlamaForCausalLM``), run on windows of one sequence at a time.

    ``first``: this stage embeds token ids; ``last``: it applies the final norm and the LM head and returns
    logits. Each sequence ``seq`` has its own :class:`StageCache`.
    """

    def __init__(self, model, layers: range, first: bool, last: bool):
        self.inner = model.model
        self.layers = [model.model.layers[i] for i in layers]
        self.first, self.last = first, last
        self.head = model.lm_head if last else None
        self.caches: dict[int, StageCache] = {}

    @torch.no_grad()
    def forward(self, seq: int, pos: int, x: torch.Tensor) -> torch.Tensor:
        """Run the window that starts at position ``pos`` of sequence ``seq``.

        ``x`` is the token ids ``(n,)`` on the first stage, else the hidden states ``(n, d)`` from the stage
        before. The cache is first cropped to ``pos`` (a window after a rejection overwrites what the
        rejected one left). Returns hidden states ``(n, d)``, or logits ``(n, vocab)`` on the last stage.
        """
        cache = self.caches.setdefault(seq, StageCache())
        if cache.length() > pos:
            cache.crop(pos)
        if cache.length() != pos:
            raise RuntimeError(f"stage cache of sequence {seq} holds {cache.length()} positions; a window at "
                               f"{pos} would leave a hole")
        device = next(self.layers[0].parameters()).device
        x = x.to(device)
        h = self.inner.embed_tokens(x[None]) if self.first else x[None]
        n = h.shape[1]
        position_ids = torch.arange(pos, pos + n, device=device)[None]
        cos_sin = self.inner.rotary_emb(h, position_ids=position_ids)
        # Query i (at position pos + i) sees keys 0 .. pos + i: True where attention is allowed.
        keys = torch.arange(pos + n, device=device)
        mask = (keys[None, :] <= position_ids[0][:, None])[None, None]
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, cache=cache,
                      position_embeddings=cos_sin)
        if self.last:
            return self.head(self.inner.norm(h))[0]
        return h[0]

    def trim(self, model) -> int:
        """Free what this stage does not run (other layers; the embeddings off stage 0; the norm and head
        off the last stage), so a rank holds only its slice. Returns the bytes of the parameters kept."""
        keep = {id(layer) for layer in self.layers}
        for i, layer in enumerate(model.model.layers):
            if id(layer) not in keep:
                model.model.layers[i] = torch.nn.Identity()
        if not self.first:
            model.model.embed_tokens = None
        if not self.last:
            model.model.norm, model.lm_head = None, None
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def drop(self, seq: int) -> None:
        self.caches.pop(seq, None)
