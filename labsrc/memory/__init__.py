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

The package holds one concept per file (every name above is importable from here):

* :mod:`labsrc.memory.knn`: The memory: a kNN store of past keys and values (exact or approximate index), the
  joint softmax over local and retrieved keys, and how well an index recalls the true top k.
* :mod:`labsrc.memory.retrieval`: Retrieval of past keys and values inside ``lab-target``: the attention of
  chosen layers also reads the memory, through an attention function registered with ``transformers``.
* :mod:`labsrc.memory.rag`: Retrieval-augmented generation: chunking the context, two retrievers (BM25 and
  dense), and the prompt of retrieved chunks; truncation as the baseline.
* :mod:`labsrc.memory.compare`: The comparison: every way of reaching a context longer than the model's
  (truncate, YaRN, evict, retrieve KV, RAG) run on the same probes.
* :mod:`labsrc.memory.stored`: The stored comparison (``python -m labsrc.memory``: too slow for the chapter's
  CPU profile), its file and its summary.
"""
from __future__ import annotations

from labsrc.kernels.memory import knn_memory_attention, knn_memory_attention_ref
from labsrc.memory.knn import (INDEXES, KVMemory, NAME, RULES, _clustered, _exact_topk, _matrix, _nonneg_int,
                               _positive_int, index_benchmark, joint_softmax_attention, recall_at_k, topk_merge)
from labsrc.memory.retrieval import (RetrievalContext, RetrievalStats, _ACTIVE, _LayerState, _REGISTERED,
                                     _lab_memory_forward, _rotate, register, retrieval_logits)
from labsrc.memory.rag import (BM25Retriever, DenseRetriever, _WORD, _shifted, _words, chunk_spans, question_ids,
                               rag_sample, truncate_sample)
from labsrc.memory.compare import (CHEAP, METHODS, _answer_right, _evict_logits, compare_methods,
                                   comparison_documents, comparison_plan, planned_n, run_method)
from labsrc.memory.stored import RESULTS, load_results, main, results_path, summarize

__all__ = [
    "INDEXES", "KVMemory", "topk_merge", "recall_at_k", "index_benchmark", "knn_memory_attention",
    "knn_memory_attention_ref", "joint_softmax_attention", "RULES", "RetrievalContext", "retrieval_logits",
    "chunk_spans", "BM25Retriever", "DenseRetriever", "question_ids", "rag_sample", "truncate_sample", "METHODS",
    "CHEAP", "comparison_plan", "comparison_documents", "planned_n", "run_method", "compare_methods", "NAME",
    "load_results", "summarize", "results_path", "main",
]

