"""Retrieval of past keys and values inside ``lab-target``: the attention of chosen layers also reads the
memory, through an attention function registered with ``transformers``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labsrc.memory.knn import INDEXES, KVMemory, NAME, RULES, _nonneg_int, _positive_int


# ----------------------------------------------------------------------------------------------------------
# Retrieval of past KV inside lab-target
# ----------------------------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (..., n, D)`` by RoPE angle ``positions (n,)`` (any sign; a pure rotation, no scaling)."""
    freqs = positions.to("cpu", torch.float64)[:, None] * inv_freq.to("cpu", torch.float64)[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.device, x.dtype), emb.sin().to(x.device, x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@dataclass
class _LayerState:
    k: torch.Tensor            # (Hkv, n, D) local keys, post-RoPE at their own positions
    v: torch.Tensor            # (Hkv, n, D)
    pos: torch.Tensor          # (n,) positions of the local tokens
    sink_k: torch.Tensor       # (Hkv, s, D) sink keys in search form
    sink_v: torch.Tensor
    memories: list             # one KVMemory per KV head, keys in search form
    retrieved: int = 0         # rows retrieved so far (all heads and queries)


@dataclass
class RetrievalStats:
    """What a retrieval run held and read: tokens in the memory, the local window, the sinks, and rows
    attended per query (local + sinks + retrieved, averaged over the queries of the run)."""

    memory_tokens: int = 0
    local_tokens: int = 0
    sink_tokens: int = 0
    attended: list = field(default_factory=list)


_ACTIVE: list = []   # the RetrievalContext whose forward is running (a stack; innermost last)


class RetrievalContext:
    """Retrieval of past KV for one document through a Llama-style ``transformers`` model.

    Use :func:`retrieval_logits`, which reads a document through it. Args: ``window`` local tokens kept
    before each chunk; ``top_k`` rows retrieved per query head and query; ``sinks`` first tokens kept
    always (attention sinks, {cite}`xiao2023streamingllm`); ``rule`` the positions of retrieved keys (see the
    module docstring); ``delta`` their distance under ``"clamped"`` (``window`` by default); ``index`` the
    :class:`KVMemory` index. Batch size 1.
    """

    def __init__(self, model, *, window: int, top_k: int, sinks: int = 4, rule: str = "clamped",
                 index: str = "exact", delta: int | None = None):
        self.model = model
        self.window = _positive_int("window", window)
        self.top_k = _nonneg_int("top_k", top_k)
        self.sinks = _nonneg_int("sinks", sinks)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if index not in INDEXES:
            raise ValueError(f"index must be one of {INDEXES}, got {index!r}")
        self.rule, self.index = rule, index
        self.delta = self.window if delta is None else _nonneg_int("delta", delta)
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().float().cpu()
        self.layers: dict[int, _LayerState] = {}
        self.positions: torch.Tensor | None = None
        self.stats = RetrievalStats()

    def _state(self, layer: int, hkv: int, d: int, device, dtype) -> _LayerState:
        if layer not in self.layers:
            z = torch.zeros(hkv, 0, d, device=device, dtype=dtype)
            self.layers[layer] = _LayerState(z, z, torch.zeros(0, dtype=torch.long), z, z,
                                             [KVMemory(d, self.index) for _ in range(hkv)])
        return self.layers[layer]

    def _search_form(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Keys as stored for search: post-RoPE (original) or rotated back to position 0 (clamped)."""
        return k if self.rule == "original" else _rotate(k, -pos, self.inv_freq)

    def attend(self, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        """One layer's attention for one chunk: ``query (1, Hq, C, D)``, ``key``/``value (1, Hkv, C, D)``
        (post-RoPE at ``self.positions``); returns ``(1, C, Hq, D)`` as ``transformers`` expects."""
        if query.shape[0] != 1:
            raise ValueError(f"retrieval decoding reads one document at a time (batch 1), got batch "
                             f"{query.shape[0]}")
        _, hq, c, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        dtype = torch.float32
        st = self._state(layer, hkv, d, query.device, dtype)
        pos = self.positions
        q = query[0].to(dtype).reshape(hkv, g, c, d)
        k_loc = torch.cat([st.k, key[0].to(dtype)], 1)
        v_loc = torch.cat([st.v, value[0].to(dtype)], 1)
        n_prev = st.k.shape[1]
        s_loc = torch.einsum("hgcd,hnd->hgcn", q, k_loc) * scaling
        i = torch.arange(c, device=query.device)[:, None]
        j = torch.arange(k_loc.shape[1], device=query.device)[None, :]
        s_loc = s_loc.masked_fill(j > i + n_prev, float("-inf"))
        scores = [s_loc]
        qs = q if self.rule == "original" else _rotate(q, self.delta - pos, self.inv_freq)
        if st.sink_k.shape[1]:
            scores.append(torch.einsum("hgcd,hsd->hgcs", qs, st.sink_k) * scaling)
        if self.top_k and len(st.memories[0]):
            rs, rv = [], []
            for h, mem in enumerate(st.memories):
                s, ids = mem.search_ids(qs[h].reshape(g * c, d), self.top_k)
                safe = ids.clamp(min=0)
                rs.append(s.reshape(g, c, -1))
                rv.append(mem.values[safe].reshape(g, c, -1, d))
            scores.append(torch.stack(rs).to(query.device) * scaling)
            retrieved_v = torch.stack(rv).to(query.device)                     # (hkv, g, c, k, d)
            st.retrieved += int(scores[-1][..., 0].numel() * scores[-1].shape[-1])
        s_all = torch.cat(scores, -1)
        probs = torch.softmax(s_all, -1)                      # every row sees itself: never all -inf
        # one softmax over [local | sinks | retrieved]; each part's values weighted by its slice
        n_loc, n_sink = k_loc.shape[1], st.sink_k.shape[1]
        out = torch.einsum("hgcn,hnd->hgcd", probs[..., :n_loc], v_loc)
        if n_sink:
            out = out + torch.einsum("hgcs,hsd->hgcd", probs[..., n_loc:n_loc + n_sink], st.sink_v)
        if s_all.shape[-1] > n_loc + n_sink:
            out = out + torch.einsum("hgck,hgckd->hgcd", probs[..., n_loc + n_sink:], retrieved_v)
        if layer == 0:
            visible = torch.isfinite(s_all[0, 0]).sum(-1).float()
            self.stats.attended.extend(visible.tolist())
        # the chunk becomes local; what leaves the window goes to the sinks or to the memory
        st.k, st.v, st.pos = k_loc, v_loc, torch.cat([st.pos, pos])
        over = st.k.shape[1] - self.window
        if over > 0:
            old_k, old_v, old_pos = st.k[:, :over], st.v[:, :over], st.pos[:over]
            st.k, st.v, st.pos = st.k[:, over:], st.v[:, over:], st.pos[over:]
            form = self._search_form(old_k, old_pos)
            is_sink = (old_pos < self.sinks).to(old_k.device)
            if bool(is_sink.any()):
                st.sink_k = torch.cat([st.sink_k, form[:, is_sink]], 1)
                st.sink_v = torch.cat([st.sink_v, old_v[:, is_sink]], 1)
            rest = ~is_sink
            if bool(rest.any()):
                for h, mem in enumerate(st.memories):
                    mem.add(form[h, rest], old_v[h, rest])
        if layer == 0:
            self.stats.memory_tokens = len(st.memories[0])
            self.stats.local_tokens = st.k.shape[1]
            self.stats.sink_tokens = st.sink_k.shape[1]
        return out.reshape(hq, c, d).transpose(0, 1)[None].to(query.dtype)

    def __enter__(self):
        register()
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(NAME)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self.model.set_attn_implementation(self._previous)
        return False


def _lab_memory_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The ``"lab_memory"`` attention function: hands the layer to the active :class:`RetrievalContext`."""
    if not _ACTIVE:
        raise RuntimeError("the lab_memory attention runs inside a RetrievalContext (use retrieval_logits)")
    if dropout:
        raise ValueError(f"lab_memory has no dropout; got dropout={dropout} (call model.eval())")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _ACTIVE[-1].attend(module.layer_idx, query, key, value, scale), None


_REGISTERED = False


def register() -> None:
    """Register ``"lab_memory"`` with ``transformers``' attention interface (idempotent). The mask
    builder is ``sdpa_mask``; the function ignores the mask and applies its own causal rule (batch 1)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _lab_memory_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _REGISTERED = True


@torch.no_grad()
def retrieval_logits(model, ids, *, window: int, chunk: int, top_k: int, sinks: int = 4,
                     rule: str = "clamped", index: str = "exact", delta: int | None = None):
    """Read ``ids`` (``(1, L)`` or a list) in chunks of ``chunk`` tokens with retrieval of past KV.

    Returns ``(logits (1, L, vocab), context)``; the context holds the memories and :class:`RetrievalStats`.
    """
    ids = torch.as_tensor(ids).reshape(1, -1)
    chunk = _positive_int("chunk", chunk)
    device = next(model.parameters()).device
    ids = ids.to(device)
    out = []
    with RetrievalContext(model, window=window, top_k=top_k, sinks=sinks, rule=rule, index=index,
                          delta=delta) as ctx:
        for c0 in range(0, ids.shape[1], chunk):
            c1 = min(ids.shape[1], c0 + chunk)
            ctx.positions = torch.arange(c0, c1)
            out.append(model(input_ids=ids[:, c0:c1], position_ids=ctx.positions[None].to(device),
                             use_cache=False).logits)
    return torch.cat(out, 1), ctx
