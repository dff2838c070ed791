"""A ``transformers`` cache that evicts: each layer keeps its budget of tokens by a policy, as the model
decodes.
"""
from __future__ import annotations

import math
import sys
import time
import weakref

from transformers.cache_utils import Cache, CacheLayerMixin
import torch

from labsrc.kv_eviction.policies import EvictionPolicy, TokenStats
from labsrc.kv_eviction.scores import _nonneg_int


# --------------------------------------------------------------------------------------------------
# A transformers Cache that evicts
# --------------------------------------------------------------------------------------------------

class EvictingLayer(CacheLayerMixin):
    """One layer of :class:`EvictingCache`: keys/values ``(1, H_kv, kept, d)`` plus the statistics.

    ``update()`` appends the new tokens, folds the attention of the new queries (when the policy needs
    it) into the statistics, returns every key the current queries may attend (kept + new), and then
    shrinks the stored cache to the budget. ``get_seq_length()`` reports the tokens *seen*, so generate()
    keeps assigning the right rotary positions, and ``get_mask_sizes()`` offsets the mask by the evicted
    count so that new tokens stay causal among themselves and every kept token stays visible.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: "EvictingCache", layer_idx: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.seen = 0
        self.positions = None       # (S, kept) where S = H_kv, or 1 when one choice is shared by the layer
        self.acc = None
        self.last_used = None
        self.attn = None            # (S, G, T, kept)
        self.pending_query = None   # (1, H_q, q_len, d) post-RoPE, set by the q_proj hook
        self.scaling = None
        self.log: list[tuple[int, torch.Tensor]] = []

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        b, h, _, d = key_states.shape
        s = 1 if self._cache.shared else h
        self.keys = key_states.new_zeros((b, h, 0, d))
        self.values = value_states.new_zeros((b, h, 0, value_states.shape[-1]))
        self.positions = torch.zeros((s, 0), dtype=torch.long, device=self.device)
        self.acc = torch.zeros((s, 0), device=self.device)
        self.last_used = torch.zeros((s, 0), dtype=torch.long, device=self.device)
        self.attn = None
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = 0 if self.keys is None else self.keys.shape[-2]
        return kept + query_length, self.seen - kept

    def kept_positions(self) -> torch.Tensor:
        """``(S, kept)`` original positions of the cached tokens (S = KV heads, or 1 when shared)."""
        return self.positions

    def _query_probs(self, keys, q_len, new_pos):
        """Softmax of the pending queries over ``keys`` with the causal rule on original positions:
        ``(S, G, q_len, N)``."""
        q = self.pending_query
        if q is None:
            raise ValueError(f"policy {self._cache.policy.name} needs the model's queries: build the cache "
                             f"with EvictingCache(policy, budget, model=model)")
        if q.shape[-2] != q_len:
            raise ValueError(f"layer {self.layer_idx}: the hooked query has {q.shape[-2]} positions but the "
                             f"cache received {q_len} keys")
        self.pending_query = None
        h_kv, d = keys.shape[1], keys.shape[-1]
        h_q = q.shape[1]
        g = h_q // h_kv
        qg = q[0].float().reshape(h_kv, g, q_len, d)
        logits = torch.einsum("hgqd,hnd->hgqn", qg, keys[0].float()) * self.scaling
        kpos = self.full_positions                                  # (S, N)
        if kpos.shape[0] == 1 and h_kv > 1:
            kpos = kpos.expand(h_kv, -1)
        future = kpos[:, None, None, :] > new_pos[None, None, :, None]
        probs = torch.softmax(logits.masked_fill(future, -math.inf), dim=-1)
        if self._cache.shared:
            probs = probs.reshape(1, h_q, q_len, -1)
        return probs

    def update(self, key_states, value_states, *args, **kwargs):
        cache = self._cache
        if key_states.shape[0] != 1:
            raise ValueError(f"EvictingCache holds one sequence (batch size 1), got batch size {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t0 = time.perf_counter()
        q_len = key_states.shape[-2]
        s = self.positions.shape[0]
        new_pos = torch.arange(self.seen, self.seen + q_len, device=self.device)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.full_positions = torch.cat([self.positions, new_pos.expand(s, q_len)], 1)
        self.acc = torch.cat([self.acc, self.acc.new_zeros((s, q_len))], 1)
        self.last_used = torch.cat([self.last_used, new_pos.expand(s, q_len)], 1)
        policy = cache.policy
        if policy.needs_attention:
            probs = self._query_probs(keys, q_len, new_pos)          # (S, G, q, N)
            self.acc += probs.sum((1, 2))
            mean = probs.mean(1)                                       # (S, q, N)
            if policy.threshold is None:
                visible = (self.full_positions[:, None, :] <= new_pos[None, :, None]).sum(-1, keepdim=True)
                hit = mean > 1.0 / visible.float()
            else:
                hit = mean > policy.threshold
            qpos = new_pos[None, :, None].expand_as(hit)
            last = torch.where(hit, qpos, torch.full_like(qpos, -1)).max(1).values
            self.last_used = torch.maximum(self.last_used, last)
            if policy.window > 0:
                if self.attn is None:
                    self.attn = probs.new_zeros(probs.shape[:2] + (0, probs.shape[-1] - q_len))
                old = torch.nn.functional.pad(self.attn, (0, q_len))
                self.attn = torch.cat([old, probs], 2)[:, :, -policy.window:, :]
        self.seen += q_len
        if self.layer_idx == 0:
            cache.steps += 1
        cache.timings["stats"] += time.perf_counter() - t0
        full_keys, full_values = keys, values
        kept = keys.shape[-2]
        if kept > cache.budget + cache.slack:
            t1 = time.perf_counter()
            keys, values = self._evict(keys, values)
            cache.timings["select"] += time.perf_counter() - t1
            cache.evictions += 1
        else:
            self.positions = self.full_positions
        self.keys, self.values = keys, values
        return full_keys, full_values

    def _stats(self, i, values) -> TokenStats:
        if self._cache.shared:
            vals = values[0].permute(1, 0, 2).reshape(values.shape[2], -1)    # all heads' values side by side
        else:
            vals = values[0, i]
        attn = self.attn[i] if self.attn is not None else vals.new_zeros((1, 0, vals.shape[0]))
        return TokenStats(positions=self.full_positions[i], values=vals, attn=attn, acc=self.acc[i],
                          last_used=self.last_used[i], seen=self.seen)

    def _evict(self, keys, values):
        cache = self._cache
        s = self.full_positions.shape[0]
        idx = torch.stack([cache.policy.select(self._stats(i, values), cache.budget, cache.protect,
                                               cache.generator) for i in range(s)])       # (S, budget)
        h = keys.shape[1]
        gather_idx = idx.expand(h, -1) if s == 1 else idx
        gi = gather_idx[None, :, :, None]
        keys = keys.gather(2, gi.expand(-1, -1, -1, keys.shape[-1]))
        values = values.gather(2, gi.expand(-1, -1, -1, values.shape[-1]))
        self.positions = self.full_positions.gather(1, idx)
        self.acc = self.acc.gather(1, idx)
        self.last_used = self.last_used.gather(1, idx)
        if self.attn is not None:
            gidx = idx[:, None, None, :].expand(-1, self.attn.shape[1], self.attn.shape[2], -1)
            self.attn = self.attn.gather(3, gidx)
        if cache.record:
            self.log.append((self.seen, self.positions.clone()))
        return keys, values

    def reset(self):
        self.keys = self.values = None
        self.is_initialized = False
        self.seen = 0
        self.log = []


class EvictingCache(Cache):
    """A ``transformers`` cache that keeps at most ``budget`` tokens per layer, chosen by ``policy``.

    Usage::

        cache = EvictingCache(H2O(), budget=64, protect=8, model=model)
        out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)
        cache.detach()                 # remove the query hooks (or use ``with EvictingCache(...) as cache``)

    Args:
        policy: an :class:`EvictionPolicy`.
        budget: tokens kept per layer (per KV head unless ``shared``).
        protect: the first ``protect`` positions (a system prompt) are never evicted.
        model: the model; required when the policy reads attention (hooks capture its post-RoPE queries).
        shared: one choice per layer for all KV heads (scored with all query heads) instead of one per KV head.
        slack: evict only when the cache exceeds ``budget + slack`` (amortised eviction), down to ``budget``.
        record: keep ``layer.log``: (tokens seen, kept positions) after each eviction, for survival plots.
        generator: the torch generator for stochastic policies (same seed, same choices).

    Batch size 1 only. Each forward attends to the kept tokens plus the new ones; the stored cache is then
    cut back to the budget. ``timings`` holds the seconds spent on statistics and on selection (all
    layers), ``steps`` the forward passes seen and ``evictions`` the layer-evictions performed, so the
    scoring overhead per step is ``sum(timings.values()) / steps``.
    """

    def __init__(self, policy: EvictionPolicy, budget: int, protect: int = 0, model=None, shared: bool = False,
                 slack: int = 0, record: bool = False, generator: torch.Generator | None = None):
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {type(policy).__name__}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive int, got {budget!r}")
        _nonneg_int("protect", protect)
        _nonneg_int("slack", slack)
        if protect > budget:
            raise ValueError(f"protect={protect} exceeds budget={budget}: the protected prefix must fit")
        self.policy, self.budget, self.protect = policy, budget, protect
        self.shared, self.slack, self.record = bool(shared), slack, bool(record)
        self.generator = generator
        self.timings = {"stats": 0.0, "select": 0.0}
        self.evictions = 0
        self.steps = 0
        self._hooks = []
        super().__init__(layers=[])
        if model is not None:
            self.attach(model)
        elif policy.needs_attention:
            raise ValueError(f"policy {policy.name} reads attention, so EvictingCache needs model=")

    def _layer(self, idx: int) -> EvictingLayer:
        while len(self.layers) <= idx:
            self.layers.append(EvictingLayer(self, len(self.layers)))
        return self.layers[idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._layer(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attach(self, model) -> "EvictingCache":
        """Hook every attention module of ``model`` (modules with ``q_proj`` and ``layer_idx``) so the
        cache receives the post-RoPE queries of each forward."""
        ref = weakref.ref(self)
        found = 0
        for module in model.modules():
            if not (hasattr(module, "q_proj") and hasattr(module, "layer_idx") and hasattr(module, "head_dim")):
                continue
            found += 1
            rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
            if rope is None:
                raise ValueError(f"{type(module).__name__}: no apply_rotary_pos_emb in its module")
            state = {}

            def pre_hook(mod, args, kwargs, state=state):
                pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
                state["pe"] = pe

            def q_hook(lin, args, out, mod=module, state=state, rope=rope):
                cache = ref()
                if cache is None or state.get("pe") is None:
                    return
                b, q_len = out.shape[:2]
                q = out.view(b, q_len, -1, mod.head_dim)
                if hasattr(mod, "q_norm"):
                    q = mod.q_norm(q)
                q = q.transpose(1, 2)
                cos, sin = state["pe"]
                q, _ = rope(q, q, cos, sin)
                layer = cache._layer(mod.layer_idx)
                layer.pending_query = q.detach()
                layer.scaling = getattr(mod, "scaling", mod.head_dim ** -0.5)

            self._hooks.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._hooks.append(module.q_proj.register_forward_hook(q_hook))
        if found == 0:
            raise ValueError("model has no attention module with q_proj and layer_idx to hook")
        return self

    def detach(self) -> None:
        """Remove the hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()
        return False

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        """``(S, kept)`` original positions currently cached in layer ``layer_idx``."""
        return self.layers[layer_idx].positions
