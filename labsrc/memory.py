"""Memory and retrieval: a kNN memory of past keys and values, attention over it, and RAG.

Three ways to let a model trained on short windows (lab-target: 1,024 tokens) use a longer document by
*retrieving* a little of it:

* :class:`KVMemory` -- one set of ``(key, value)`` rows searched by inner product, best first: exactly
  (``torch.topk``) or approximately with FAISS {cite}`douze2024faiss` (flat, IVF, HNSW), with
  :func:`index_benchmark` measuring recall@k and time against the exact index as the memory grows.
* :func:`knn_memory_attention` -- the Memorizing Transformer's layer {cite}`wu2022memorizing`: local causal
  attention and attention over the rows retrieved for each query, each with its own softmax, mixed by a
  per-head gate (the kernel and its reference live in :mod:`labsrc.kernels.memory`).
* :func:`retrieval_logits` -- training-free retrieval of past KV for lab-target, in the spirit of
  Unlimiformer {cite}`bertsch2023unlimiformer` and InfLLM {cite}`xiao2024infllm`: the document is read in
  chunks; keys and values that leave a local window go to one :class:`KVMemory` per layer and KV head; every
  query head attends, in **one** softmax, to its local window, a few "sink" tokens and its ``top_k``
  retrieved past keys. Registered with ``transformers`` as the attention implementation ``"lab_memory"``,
  the way :mod:`labsrc.flash_attention` registers the lab's kernels.
* RAG {cite}`lewis2020rag` -- :func:`chunk_spans` (overlapping chunks, so that a short fact is never split),
  :class:`BM25Retriever` (``rank_bm25``) and :class:`DenseRetriever` (mean-pooled hidden states of the lab
  model), and :func:`rag_sample`, which puts the retrieved chunks and the question into the trained window.

Positions of retrieved keys under RoPE (``rule``): with ``"original"`` a retrieved key keeps the position it
had, so the query sees it at its true distance -- exact (the equality test: memory holding everything and
``top_k`` covering it gives full attention), but a distance beyond the trained context is one the model
never saw. With ``"clamped"`` (InfLLM's choice) every retrieved or sink key is placed at the same distance
``delta`` (the local window length by default) from the query: the model only ever sees distances it was
trained on, at the price of losing the order of what it retrieves. Both are implemented by storing keys in
"search form": the post-RoPE key for ``"original"``; the key rotated back to position 0 for ``"clamped"``,
searched with the query rotated by ``delta - p``, so that the inner product the index ranks by *is* the
attention logit the key will get.

:func:`compare_methods` runs the chapter's comparison: truncation, YaRN (chapter 4), value-aware eviction
(chapter 6), retrieved past KV at several ``k``, and RAG (BM25 and dense), on pass keys, the one probe
lab-target solves inside its trained context (0.99 at 921 tokens on its eval card), so that a method's
failure beyond it is the method's and not the model's. ``python -m labsrc.memory`` stores it (:func:`main`).
"""
from __future__ import annotations

import contextlib
import math
import random
import re
import time
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np
import torch

from labsrc.kernels.memory import knn_memory_attention, knn_memory_attention_ref

__all__ = [
    "INDEXES", "KVMemory", "topk_merge", "recall_at_k", "index_benchmark", "knn_memory_attention",
    "knn_memory_attention_ref", "joint_softmax_attention", "RULES", "RetrievalContext", "retrieval_logits",
    "chunk_spans", "BM25Retriever", "DenseRetriever", "question_ids", "rag_sample", "truncate_sample", "METHODS",
    "CHEAP", "comparison_plan", "comparison_documents", "planned_n", "run_method", "compare_methods", "NAME",
    "load_results", "summarize", "results_path", "main",
]

INDEXES = ("exact", "faiss-flat", "faiss-ivf", "faiss-hnsw")
RULES = ("original", "clamped")
NAME = "lab_memory"


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _nonneg_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _matrix(name, x, dim=None) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, dim), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{name} must have {dim} columns, got {x.shape[1]}")
    x = x.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or infinite values; an inner-product index cannot rank them")
    return x


# ----------------------------------------------------------------------------------------------------------
# The memory
# ----------------------------------------------------------------------------------------------------------
def _exact_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row of ``scores`` by value, best first, ties broken by the lower index.

    ``torch.topk`` finds the k-th largest value; its choice and order among equal scores is unspecified, so
    the rows it leaves are fixed here: every score above the k-th value, then the equal ones with the
    lowest indices, sorted stably by score. The answer is then a function of the scores alone.

    One more value than asked for tells, row by row, whether a tie crosses the k-th place (the ``k+1``-th
    largest equals the k-th): only those rows pay for the full pass over their scores, which is most of the
    time retrieval decoding spends searching when done for every row.
    """
    m, n = scores.shape
    vals, ids = torch.topk(scores, min(k + 1, n), dim=1)                   # best first
    crossing = vals[:, k] == vals[:, k - 1] if n > k else torch.zeros(m, dtype=torch.bool)
    vals, ids = vals[:, :k], ids[:, :k]
    # rows with no tie across the k-th place: topk chose the right rows; order ties by index
    order = torch.argsort(ids, dim=1)
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    if bool(crossing.any()):
        rows = crossing.nonzero()[:, 0]
        sub = scores[rows]
        kth = vals[rows, -1:]                                               # (r, 1)
        above = sub > kth
        tie = sub == kth
        need = k - above.sum(1, keepdim=True)
        chosen = above | (tie & (tie.cumsum(1) <= need))
        sub_ids = chosen.nonzero()[:, 1].view(len(rows), k)                 # ascending index
        sub_vals = sub.gather(1, sub_ids)
        order = torch.sort(sub_vals, dim=1, descending=True, stable=True).indices
        vals[rows], ids[rows] = sub_vals.gather(1, order), sub_ids.gather(1, order)
    return vals, ids


class KVMemory:
    """One memory of ``(key, value)`` rows, searched by inner product (one memory per head).

    Args:
        dim: the key width; ``dim_v`` the value width (``dim`` by default).
        index: ``"exact"`` (brute force with ``torch.topk``), or FAISS {cite}`douze2024faiss`: ``"faiss-flat"``
            (brute force in FAISS), ``"faiss-ivf"`` (inverted lists: k-means into ``nlist`` cells, search
            ``nprobe`` of them; trained on the rows present and retrained whenever the memory has doubled
            since), ``"faiss-hnsw"`` (a navigable small-world graph with ``hnsw_m`` links per node,
            ``ef_search`` candidates per search).

    Rows are stored as float32 on the CPU (FAISS is a CPU library here). ``search`` returns the
    ``min(top_k, len(memory))`` best rows per query, best first; an approximate index may find fewer for a
    query (IVF when its probed cells hold fewer rows): those slots get score ``-inf``, id ``-1``, zero rows and
    ``valid = False``. Pass ``valid`` on as ``mem_valid`` to :func:`knn_memory_attention` (or
    :func:`joint_softmax_attention`): an attention that recomputes the scores from the keys would otherwise
    score a zero row 0 and weight it like a real one.
    """

    def __init__(self, dim: int, index: str = "exact", dim_v: int | None = None, *, nlist: int | None = None,
                 nprobe: int = 8, hnsw_m: int = 16, ef_search: int = 64):
        self.dim = _positive_int("dim", dim)
        self.dim_v = self.dim if dim_v is None else _positive_int("dim_v", dim_v)
        if index not in INDEXES:
            raise ValueError(f"index must be one of {INDEXES}, got {index!r}")
        self.index_kind = index
        self.nlist = None if nlist is None else _positive_int("nlist", nlist)
        self.nprobe = _positive_int("nprobe", nprobe)
        self.hnsw_m = _positive_int("hnsw_m", hnsw_m)
        self.ef_search = _positive_int("ef_search", ef_search)
        self.keys = torch.zeros(0, self.dim)
        self.values = torch.zeros(0, self.dim_v)
        self._index = None
        self._indexed = 0        # rows already in the FAISS index
        self._trained_at = 0     # rows the IVF quantizer was trained on

    def __len__(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows (keys + values, float32); an index adds its own structures."""
        return (self.keys.numel() + self.values.numel()) * 4

    def add(self, keys, values) -> None:
        """Append ``keys (N, dim)`` and ``values (N, dim_v)`` (any float dtype; stored as float32)."""
        keys = _matrix("keys", keys, self.dim)
        values = _matrix("values", values, self.dim_v)
        if keys.shape[0] != values.shape[0]:
            raise ValueError(f"keys and values must have the same number of rows, got {keys.shape[0]} and "
                             f"{values.shape[0]}")
        self.keys = torch.cat([self.keys, keys])
        self.values = torch.cat([self.values, values])

    # -- FAISS bookkeeping ---------------------------------------------------------------------------------
    def _sync_index(self):
        import faiss

        n = len(self)
        kind = self.index_kind
        if kind == "faiss-ivf" and (self._index is None or n >= 2 * self._trained_at):
            nlist = self.nlist or max(1, int(round(math.sqrt(n))))
            nlist = min(nlist, n)
            quantizer = faiss.IndexFlatIP(self.dim)
            index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.cp.min_points_per_centroid = 1       # small memories: no warning about few points
            index.train(self.keys.numpy())
            index.nprobe = min(self.nprobe, nlist)
            self._quantizer = quantizer                # the index refers to it: keep it alive
            self._index, self._indexed, self._trained_at = index, 0, n
        elif self._index is None:
            if kind == "faiss-flat":
                self._index = faiss.IndexFlatIP(self.dim)
            else:
                self._index = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
                self._index.hnsw.efSearch = self.ef_search
        if self._indexed < n:
            self._index.add(self.keys[self._indexed:].numpy())
            self._indexed = n

    def search_ids(self, queries, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores (M, k), ids (M, k))``, ``k = min(top_k, len(self))``, best first (id -1: not found)."""
        top_k = _positive_int("top_k", top_k)
        queries = _matrix("queries", queries, self.dim)
        if len(self) == 0:
            raise ValueError("the memory is empty: add() rows before searching it")
        k = min(top_k, len(self))
        if self.index_kind == "exact":
            return _exact_topk(queries @ self.keys.T, k)
        self._sync_index()
        scores, ids = self._index.search(queries.numpy(), k)
        ids = torch.from_numpy(ids).long()
        scores = torch.from_numpy(scores).float().masked_fill(ids < 0, float("-inf"))
        return scores, ids

    def search(self, queries, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores (M, k), keys (M, k, dim), values (M, k, dim_v), valid (M, k))`` by inner product, best
        first; ``valid`` is False where the index found no row (the row is zeros and its score ``-inf``)."""
        scores, ids = self.search_ids(queries, top_k)
        safe = ids.clamp(min=0)
        valid = ids >= 0
        found = valid[..., None]
        return scores, self.keys[safe] * found, self.values[safe] * found, valid


def joint_softmax_attention(q, k_local, v_local, mem_k, mem_v, sm_scale=None, mem_valid=None):
    """The source's formula: **one** softmax over the local keys (causal) and the retrieved rows together,
    ``softmax(q [K_local; K_retrieved]^T / sqrt(D)) [V_local; V_retrieved]``. This is what training-free
    retrieval of past KV (:func:`retrieval_logits`, Unlimiformer, InfLLM) computes; the Memorizing
    Transformer instead keeps two softmaxes and learns a gate (:func:`knn_memory_attention_ref`). Shapes
    and ``mem_valid`` (the retrieved rows that are real) as there; fp32 arithmetic (fp64 for fp64 inputs)."""
    knn_memory_attention_ref(q, k_local, v_local, mem_k, mem_v, q.new_zeros(q.shape[1]), sm_scale,
                             mem_valid=mem_valid)  # checks
    B, H, T, D = q.shape
    hkv, tk = k_local.shape[1], k_local.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(compute)
    kl = k_local.to(compute).repeat_interleave(H // hkv, dim=1)
    vl = v_local.to(compute).repeat_interleave(H // hkv, dim=1)
    s_loc = (qf @ kl.transpose(-1, -2)) * scale
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(tk, device=q.device)[None, :]
    s_loc = s_loc.masked_fill(j > i + (tk - T), float("-inf"))
    mk, mv = mem_k.to(compute), mem_v.to(compute)
    if mem_valid is not None:  # padded rows are never read (see knn_memory_attention_ref)
        mk, mv = (x.masked_fill(~mem_valid[..., None], 0.0) for x in (mk, mv))
    s_mem = torch.einsum("bhtd,bhtkd->bhtk", qf, mk) * scale
    if mem_valid is not None:
        s_mem = s_mem.masked_fill(~mem_valid, float("-inf"))
    p = torch.softmax(torch.cat([s_loc, s_mem], -1), -1)
    out = p[..., :tk] @ vl + torch.einsum("bhtk,bhtkd->bhtd", p[..., tk:], mv)
    return out.to(q.dtype)


def topk_merge(scores_a, ids_a, scores_b, ids_b, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial searches (each ``(M, ka)`` scores and ids, best first) into the best ``k`` of both.

    This is how a sharded memory (one index per page, per device or per chunk of a document) answers one
    query: each shard returns its own top rows and the merge keeps the best ``min(k, ka + kb)``, best first,
    a tie going to the lower id.
    """
    k = _positive_int("k", k)
    scores = torch.cat([scores_a, scores_b], 1)
    ids = torch.cat([ids_a, ids_b], 1)
    k = min(k, scores.shape[1])
    order = torch.argsort(ids, dim=1, stable=True)                # lower id first among equal scores
    scores, ids = scores.gather(1, order), ids.gather(1, order)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, order), ids.gather(1, order)


def recall_at_k(found_ids: torch.Tensor, true_ids: torch.Tensor) -> float:
    """Fraction of the exact top-k ids (``true_ids (M, k)``) that the approximate search found."""
    hits = sum(len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found_ids, true_ids))
    return hits / true_ids.numel()


def _clustered(n: int, dim: int, gen: torch.Generator, centers: torch.Tensor) -> torch.Tensor:
    which = torch.randint(0, centers.shape[0], (n,), generator=gen)
    return centers[which] + 0.5 * torch.randn(n, dim, generator=gen)


def index_benchmark(sizes, dim: int = 40, n_queries: int = 64, top_k: int = 16, seed: int = 0,
                    indexes=INDEXES, repeats: int = 3) -> list[dict]:
    """Recall@k and search time of every index against the exact one, as the memory grows.

    Keys are clustered (64 Gaussian clusters, as attention keys are), queries are drawn from the same
    clusters. Returns one dict per ``(size, index)``: ``n``, ``index``, ``recall`` (1.0 for exact),
    ``ms_per_query`` (best of ``repeats``, the first search after adding -- which builds a FAISS index --
    excluded), ``build_s`` (adding and the first search) and ``n_queries``.
    """
    gen = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(64, dim, generator=gen)
    rows = []
    for n in sizes:
        n = _positive_int("size", n)
        keys = _clustered(n, dim, gen, centers)
        queries = _clustered(n_queries, dim, gen, centers)
        truth = None
        for kind in indexes:
            mem = KVMemory(dim, kind)
            t0 = time.perf_counter()
            mem.add(keys, keys)
            _, ids = mem.search_ids(queries, top_k)
            build = time.perf_counter() - t0
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                _, ids = mem.search_ids(queries, top_k)
                best = min(best, time.perf_counter() - t0)
            if kind == "exact":
                truth = ids
            rows.append(dict(n=n, index=kind, recall=recall_at_k(ids, truth) if truth is not None else None,
                             ms_per_query=1e3 * best / n_queries, build_s=build, n_queries=n_queries))
    return rows


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


# ----------------------------------------------------------------------------------------------------------
# RAG: chunking, two retrievers, the prompt
# ----------------------------------------------------------------------------------------------------------
def chunk_spans(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """Spans ``[start, end)`` of ``size`` tokens covering ``n`` tokens, each overlapping the next by
    ``overlap``: starts ``0, size - overlap, ...``; the last span ends at ``n``. Any run of at most
    ``overlap + 1`` tokens then lies whole inside some span, so a fact that short is never split."""
    n, size = _nonneg_int("n", n), _positive_int("size", size)
    overlap = _nonneg_int("overlap", overlap)
    if overlap >= size:
        raise ValueError(f"overlap must be smaller than size ({size}), got {overlap}")
    if n <= size:
        return [(0, n)] if n else []
    step = size - overlap
    spans = [(s, s + size) for s in range(0, n - size, step)]
    spans.append((n - size, n))
    return spans


_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25Retriever:
    """BM25 {cite}`robertson2009bm25` over chunks of text (``rank_bm25.BM25Okapi``, lowercase word tokens)."""

    name = "BM25"

    def fit(self, model, tokenizer, chunks: list[list[int]]):
        from rank_bm25 import BM25Okapi

        self.bm25 = BM25Okapi([_words(tokenizer.decode(c)) or ["<empty>"] for c in chunks])
        return self

    def scores(self, model, tokenizer, query: list[int]) -> torch.Tensor:
        return torch.tensor(self.bm25.get_scores(_words(tokenizer.decode(query))), dtype=torch.float64)


class DenseRetriever:
    """Dense retrieval from the lab model itself: each chunk (and the question) is read on its own, from a
    BOS token, and represented by the mean of the hidden states of layer ``layer``; chunks rank by cosine
    similarity to the question. No retriever is trained: this asks how much a 9M-parameter language model's
    states know about "which passage answers this"."""

    name = "dense"

    def __init__(self, layer: int = 3):
        self.layer = _nonneg_int("layer", layer)

    @torch.no_grad()
    def _embed(self, model, tokenizer, pieces: list[list[int]]) -> torch.Tensor:
        device = next(model.parameters()).device
        out = []
        for p in pieces:
            ids = torch.tensor([[tokenizer.bos_token_id] + list(p)], device=device)
            h = model(input_ids=ids, output_hidden_states=True).hidden_states[self.layer][0, 1:]
            out.append(torch.nn.functional.normalize(h.float().mean(0), dim=0).cpu())
        return torch.stack(out)

    def fit(self, model, tokenizer, chunks):
        self.emb = self._embed(model, tokenizer, chunks)
        return self

    def scores(self, model, tokenizer, query):
        return (self.emb @ self._embed(model, tokenizer, [query])[0]).double()


def question_ids(sample, tokenizer) -> list[int]:
    """The question a pass-key or needle sample ends with (the tokens right before its answer)."""
    from labsrc.tasks import _enc

    if sample.task == "passkey":
        text = "\n\nWhat is the pass key? The pass key is"
    elif sample.task == "needle":
        key = sample.meta["key"]
        text = f"\n\nWhat is the special magic number for {key}? The special magic number for {key} is"
    else:
        raise ValueError(f"question_ids knows the pass-key and needle probes, got task {sample.task!r}")
    q = _enc(tokenizer, text)
    a0 = sample.spans[0][0]
    if sample.ids[a0 - len(q):a0] != q:
        raise ValueError("the sample does not end with its task's question")
    return q


def _shifted(sample, ids: list[int], answer_start: int):
    from labsrc.tasks import Sample

    a, e = sample.spans[0]
    return Sample(sample.task, ids, [(answer_start, answer_start + e - a)], dict(sample.meta))


def rag_sample(sample, tokenizer, model, retriever, *, budget: int = 512, size: int = 64, overlap: int = 32):
    """The RAG prompt for a probe sample: BOS, the best-ranked chunks of its document (in document order,
    overlapping chunks merged) as many as fit, the question, the answer. Returns ``(sample, info)`` with
    ``info`` the chosen spans and whether the answer's fact (the needle) lies inside one of them."""
    q = question_ids(sample, tokenizer)
    a0, a1 = sample.spans[0]
    doc = sample.ids[1:a0 - len(q)]
    spans = chunk_spans(len(doc), size, overlap)
    retriever.fit(model, tokenizer, [doc[s:e] for s, e in spans])
    ranking = torch.argsort(retriever.scores(model, tokenizer, q), descending=True, stable=True).tolist()
    room = budget - 1 - len(q) - (a1 - a0)
    chosen: list[tuple[int, int]] = []
    for r in ranking:
        trial = sorted(chosen + [spans[r]])
        merged = []
        for s, e in trial:
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        if sum(e - s for s, e in merged) > room:
            break
        chosen = merged
    body = [t for s, e in chosen for t in doc[s:e]]
    ids = [sample.ids[0]] + body + q + sample.ids[a0:a1]
    key = sample.meta.get("key", "")
    found = bool(key) and key in tokenizer.decode(body)
    return _shifted(sample, ids, 1 + len(body) + len(q)), {"spans": chosen, "fact_retrieved": found}


def truncate_sample(sample, budget: int = 512):
    """Keep BOS and the last ``budget - 1`` tokens (the question and answer always fit)."""
    a0, a1 = sample.spans[0]
    keep = sample.ids[max(1, a1 - (budget - 1)):a1]
    return _shifted(sample, [sample.ids[0]] + keep, 1 + len(keep) - (a1 - a0))


# ----------------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------------
METHODS = ("full", "truncate", "yarn", "evict", "retrieval", "rag-bm25", "rag-dense")


def _answer_right(logits: torch.Tensor, sample) -> bool:
    pred = logits[0].argmax(-1)
    ids = torch.tensor(sample.ids, device=pred.device)
    return all(bool((pred[a - 1:e - 1] == ids[a:e]).all()) for a, e in sample.spans)


@torch.no_grad()
def _evict_logits(model, sample, budget: int, chunk: int):
    from labsrc.kv_eviction import EvictingCache, ValueAware

    ids = torch.tensor([sample.ids], device=next(model.parameters()).device)
    out = []
    with EvictingCache(ValueAware(), budget, model=model, generator=torch.Generator().manual_seed(0)) as cache:
        for c0 in range(0, ids.shape[1], chunk):
            res = model(input_ids=ids[:, c0:c0 + chunk], cache=cache, use_cache=True)
            cache = res.cache if getattr(res, "cache", None) is not None else cache
            out.append(res.logits)
    return torch.cat(out, 1)


@torch.no_grad()
def run_method(method: str, model, tokenizer, sample, *, trained: int | None = None, window: int = 384,
               chunk: int = 128, top_k: int = 32, sinks: int = 4, rule: str = "clamped",
               index: str = "exact") -> dict:
    """Answer one probe sample with ``method`` (one of :data:`METHODS`); returns ``right``, ``seconds``,
    ``kv_tokens_held`` (tokens whose KV the method stores), ``kv_tokens_read`` (KV rows one query attends
    to at the end) and, for RAG, ``fact_retrieved``.

    ``trained`` is the window the bounded methods fill: truncation keeps BOS and the last ``trained - 1``
    tokens, eviction a cache of ``trained - chunk`` tokens (plus the chunk being read), RAG a prompt of at most
    ``trained`` tokens, YaRN stretches by ``len / trained``. By default it is the model's trained context
    (``config.lab_trained_context``: 1,024 for lab-target), so every method reads at most what the model
    was trained to read."""
    from labsrc.rope_finetune import set_rope
    from labsrc.models.train import trained_context
    from labsrc.tasks import score

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    trained = trained_context(model) if trained is None else _positive_int("trained", trained)
    n = len(sample.ids)
    t0 = time.perf_counter()
    extra = {}
    if method == "full":
        right = score(model, [sample])[0][0]
        held = read = n
    elif method == "truncate":
        s = truncate_sample(sample, trained)
        right = score(model, [s])[0][0]
        held = read = len(s.ids)
    elif method == "yarn":
        set_rope(model, "yarn", factor=max(1.0, n / trained))
        try:
            right = score(model, [sample])[0][0]
        finally:
            set_rope(model, "default")
        held = read = n
    elif method == "evict":
        budget = trained - chunk
        right = _answer_right(_evict_logits(model, sample, budget, chunk), sample)
        held = read = min(n, trained)
    elif method == "retrieval":
        logits, ctx = retrieval_logits(model, sample.ids, window=window, chunk=chunk, top_k=top_k, sinks=sinks,
                                       rule=rule, index=index)
        right = _answer_right(logits, sample)
        st = ctx.stats
        held = st.memory_tokens + st.local_tokens + st.sink_tokens
        read = int(st.attended[-1]) if st.attended else 0
    else:
        retriever = BM25Retriever() if method == "rag-bm25" else DenseRetriever()
        s, info = rag_sample(sample, tokenizer, model, retriever, budget=trained)
        right = score(model, [s])[0][0]
        held = read = len(s.ids)
        extra["fact_retrieved"] = info["fact_retrieved"]
    return dict(method=method, right=bool(right), seconds=time.perf_counter() - t0, tokens=n,
                kv_tokens_held=held, kv_tokens_read=read, **extra)


CHEAP = ("truncate", "rag-bm25")   # methods whose cost does not grow with the document (one trained window)


def comparison_plan(top_ks=(8, 32)) -> list[tuple[str, str, dict]]:
    """The comparison's methods as ``(label, method, keyword arguments of run_method)``, in table order."""
    plan = [(m, m, {}) for m in ("full", "truncate", "yarn", "evict")]
    plan += [(f"retrieval k={_positive_int('top_k', k)}", "retrieval", dict(top_k=k)) for k in top_ks]
    plan += [("rag-bm25", "rag-bm25", {}), ("rag-dense", "rag-dense", {})]
    return plan


def planned_n(label: str, n: int, n_cheap: int | None = None) -> int:
    """Documents a method gets at one length: ``n_cheap`` for the methods of :data:`CHEAP` (``n`` if None or
    smaller), ``n`` for the others."""
    return max(n, n_cheap or 0) if label in CHEAP else n


def comparison_documents(tokenizer, length: int, count: int, *, seed: int = 0, depths=None) -> list:
    """The first ``count`` pass-key documents of ``length`` tokens that :func:`compare_methods` reads (the same
    list whatever ``count``: a longer list extends a shorter one). Each key depth is drawn uniformly from
    ``[0, 1]`` by a generator seeded from ``seed`` and ``length``, or cycles through ``depths`` if given."""
    from labsrc.tasks import passkey_sample

    length, count = _positive_int("length", length), _positive_int("count", count)
    rng = random.Random(f"memory-{seed}-{length}")
    out = []
    for i in range(count):
        depth = depths[i % len(depths)] if depths is not None else rng.random()
        out.append(passkey_sample(tokenizer, length, depth, rng))
    return out


def compare_methods(model, tokenizer, lengths, n, *, n_cheap: int | None = None, depths=None, top_ks=(8, 32),
                    seed: int = 0, window: int = 384, chunk: int = 128, trained: int | None = None,
                    skip=(), progress=None) -> list[dict]:
    """Pass-key accuracy of every method at every length.

    ``n`` documents per length (an int, or one per length) go to every method, the same documents for each;
    the methods of :data:`CHEAP` (truncation and BM25 RAG, which read one trained window whatever the
    document's length) get ``n_cheap`` documents instead, the first ``n`` of them the shared ones. Each
    document's key depth is drawn uniformly from ``[0, 1]`` (or cycles through ``depths`` if given), so the
    first ``n`` documents are as random a sample as all ``n_cheap``: a Wilson interval fits both.
    ``skip`` holds ``(length, label)`` cells already measured (a resumed run); ``progress(length, label,
    rows)`` is called with each finished cell's rows. Returns one dict per (length, method label,
    document) with the fields of :func:`run_method` plus ``length``, ``label``, ``depth`` and ``doc`` (its
    index in :func:`comparison_documents`)."""
    lengths = list(lengths)
    ns = [n] * len(lengths) if isinstance(n, Integral) else list(n)
    if len(ns) != len(lengths):
        raise ValueError(f"n must be an int or one int per length ({len(lengths)}), got {n!r}")
    ns = [_positive_int("n", v) for v in ns]
    if n_cheap is not None:
        n_cheap = _positive_int("n_cheap", n_cheap)
    plan = comparison_plan(top_ks)
    skip = set(skip)
    rows = []
    for length, n_len in zip(lengths, ns):
        most = max(planned_n(label, n_len, n_cheap) for label, _, _ in plan)
        samples = comparison_documents(tokenizer, length, most, seed=seed, depths=depths)
        for label, method, kw in plan:
            if (length, label) in skip:
                continue
            cell = []
            for i, s in enumerate(samples[:planned_n(label, n_len, n_cheap)]):
                r = run_method(method, model, tokenizer, s, window=window, chunk=chunk, trained=trained, **kw)
                cell.append(dict(r, length=length, label=label, depth=s.meta["depth"], doc=i))
            rows += cell
            if progress:
                progress(length, label, cell)
    return rows


# ----------------------------------------------------------------------------------------------------------
# The stored comparison (too slow for the CPU profile of the chapter: this script writes it)
# ----------------------------------------------------------------------------------------------------------
RESULTS = __import__("pathlib").Path(__file__).resolve().parent / "data" / "results"


def results_path(profile: str) -> "__import__('pathlib').Path":
    """Where :func:`main` stores the comparison of ``profile`` (``cpu`` or ``gpu``)."""
    return RESULTS / f"memory_comparison_{profile}.json"


def load_results(profile: str = "cpu") -> dict:
    """The stored comparison written by :func:`main` for ``profile``."""
    import json

    path = results_path(profile)
    if not path.is_file():
        raise FileNotFoundError(f"no stored comparison at {path}; run `python -m labsrc.memory --profile {profile}`")
    return json.loads(path.read_text())


def summarize(rows: list[dict]) -> dict:
    """Per ``(length, label)``: ``k`` right of ``n``, mean seconds per token, KV tokens held and read (means)
    and, for RAG, how often the fact was in the retrieved chunks (``fact_k``)."""
    out: dict = {}
    for r in rows:
        cell = out.setdefault((r["length"], r["label"]), dict(k=0, n=0, sec=0.0, held=0.0, read=0.0, fact_k=0))
        cell["k"] += int(r["right"])
        cell["n"] += 1
        cell["sec"] += r["seconds"] / r["tokens"]
        cell["held"] += r["kv_tokens_held"]
        cell["read"] += r["kv_tokens_read"]
        cell["fact_k"] += int(r.get("fact_retrieved", False))
    for cell in out.values():
        for key in ("sec", "held", "read"):
            cell[key] /= cell["n"]
    return out


def main(argv=None) -> None:
    """``python -m labsrc.memory [--profile cpu|gpu] [--fresh]``: run :func:`compare_methods` at the profile's
    sizes (``labsrc.sizes("memory")``: ``compare_lengths``, ``compare_n`` (one per length),
    ``compare_n_cheap``, ``top_ks``, ``window``, ``chunk``) and write every row, with the run's stamp and the
    digest of the lab-target it used, to ``labsrc/data/results/memory_comparison_<profile>.json``.

    The file is rewritten after every (length, method) cell, so an interrupted run loses one cell at most:
    run the command again and it resumes, keeping the cells already stored when the file's settings and
    model digest are the ones it would use (``--fresh`` starts over).

    Why these sizes on the CPU (1,024-8,192 tokens; 20, 20, 10 and 10 documents per method, 100 for
    truncation and BM25 RAG): the run has to fit well under an hour on two cores shared with other jobs (the
    stored run took the time its ``seconds`` field records). Truncation and BM25 RAG read one trained window
    whatever the length (about half a second a document), so they get n = 100 everywhere. Every other method
    reads the whole document, and at 8,192 tokens one document costs seconds to a minute on a busy machine
    (retrieval searches every past key for every query, in every layer; eviction scores its cache at every
    chunk; full attention and YaRN are one long forward pass), so n falls with length there; the chapter's
    intervals show what that costs. One ``k`` (32) stands for retrieval; the GPU profile compares several."""
    import argparse
    import json
    import sys

    import labsrc
    from labsrc.models import load
    from labsrc.models.stored_runs import models_stamp

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--profile", default=labsrc.PROFILE, choices=("cpu", "gpu"))
    parser.add_argument("--fresh", action="store_true", help="ignore a stored partial run and start over")
    args = parser.parse_args(argv)
    S = labsrc.sizes("memory", args.profile)
    labsrc.seed_everything(0)
    model, tok = load("lab-target", device=labsrc.DEVICE)
    lengths = list(S.compare_lengths)
    ns = list(S.compare_n) if not isinstance(S.compare_n, Integral) else [S.compare_n] * len(lengths)
    settings = dict(profile=args.profile, lengths=lengths, n=ns, n_cheap=S.compare_n_cheap, cheap=list(CHEAP),
                    window=S.window, chunk=S.chunk, top_ks=list(S.top_ks), probe="passkey",
                    models=models_stamp("lab-target"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = labsrc.stamp(file=sys.stderr)
    path = results_path(args.profile)
    rows: list[dict] = []
    before = 0.0
    if path.is_file() and not args.fresh:
        old = json.loads(path.read_text())
        if {k: old.get(k) for k in settings} == settings and not old.get("complete"):
            rows, before = old["rows"], float(old["seconds"])
            print(f"resuming: {len(rows)} rows stored ({before:.0f} s)", file=sys.stderr)
    done = {(r["length"], r["label"]) for r in rows}
    t0 = time.perf_counter()
    cells = len(lengths) * len(comparison_plan(S.top_ks))

    def save(length, label, cell):
        rows.extend(cell)
        finished = len({(r["length"], r["label"]) for r in rows}) == cells
        out = dict(stamp=info, **settings, seconds=before + time.perf_counter() - t0, complete=finished,
                   command=f"python -m labsrc.memory --profile {args.profile}", rows=rows)
        path.write_text(json.dumps(out, indent=1))
        print(f"{before + time.perf_counter() - t0:7.1f}s  L={length} {label}: "
              f"{sum(r['right'] for r in cell)}/{len(cell)}", file=sys.stderr, flush=True)

    compare_methods(model, tok, lengths, ns, n_cheap=S.compare_n_cheap, top_ks=S.top_ks, window=S.window,
                    chunk=S.chunk, skip=done, progress=save)


if __name__ == "__main__":
    main()
