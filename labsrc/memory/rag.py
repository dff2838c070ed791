"""Retrieval-augmented generation: chunking the context, two retrievers (BM25 and dense), and the prompt of
retrieved chunks; truncation as the baseline.
"""
from __future__ import annotations

import re

import torch

from labsrc.memory.knn import _nonneg_int, _positive_int


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
