"""The comparison: every way of reaching a context longer than the model's (truncate, YaRN, evict, retrieve
KV, RAG) run on the same probes.
"""
from __future__ import annotations

import random
import time
from numbers import Integral

import torch

from labsrc.memory.knn import _positive_int
from labsrc.memory.rag import BM25Retriever, DenseRetriever, rag_sample, truncate_sample
from labsrc.memory.retrieval import retrieval_logits


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
