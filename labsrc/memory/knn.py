"""The memory: a kNN store of past keys and values (exact or approximate index), the joint softmax over local
and retrieved keys, and how well an index recalls the true top k.
"""
from __future__ import annotations

import math
import time
from numbers import Integral

import numpy as np
import torch

from labsrc.kernels.memory import knn_memory_attention_ref


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
