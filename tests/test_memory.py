"""labsrc.memory: the kNN memory against brute force, FAISS recall, the gated mix against a direct formula,
retrieval of past KV equal to full attention when the memory holds everything, chunking and RAG."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labsrc  # noqa: F401
from labsrc import memory as M
from labsrc import tasks


# ------------------------------------------------------------------------------------------- KVMemory
def brute_force(keys, queries, k):
    """Every (score, -index) pair sorted: best score first, lower index first among ties."""
    out_s, out_i = [], []
    for q in queries:
        s = (keys @ q).tolist()
        order = sorted(range(len(s)), key=lambda j: (-s[j], j))[:k]
        out_s.append([s[j] for j in order])
        out_i.append(order)
    return torch.tensor(out_s), torch.tensor(out_i)


def test_exact_search_equals_brute_force_with_ties_and_returns_rows():
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-2, 3, (57, 6), generator=g).float()    # small integers: many exact ties
    values = torch.randn(57, 5, generator=g)
    queries = torch.randint(-2, 3, (9, 6), generator=g).float()
    mem = M.KVMemory(6, dim_v=5)
    mem.add(keys[:30], values[:30])
    mem.add(keys[30:], values[30:])
    scores, ids = mem.search_ids(queries, 7)
    want_s, want_i = brute_force(keys, queries, 7)
    assert torch.equal(ids, want_i) and torch.allclose(scores, want_s)
    s, k, v, valid = mem.search(queries, 7)
    assert torch.equal(k, keys[want_i]) and torch.equal(v, values[want_i]) and torch.allclose(s, want_s)
    assert bool(valid.all()), "the exact index finds every row it is asked for"


def test_k_larger_than_memory_returns_every_row_and_empty_memory_is_an_error():
    mem = M.KVMemory(4)
    with pytest.raises(ValueError, match="empty"):
        mem.search(torch.randn(2, 4), 3)
    mem.add(torch.randn(5, 4), torch.randn(5, 4))
    s, k, v, valid = mem.search(torch.randn(2, 4), 50)
    assert s.shape == (2, 5) and k.shape == (2, 5, 4) and v.shape == (2, 5, 4)
    assert bool((s[:, :-1] >= s[:, 1:]).all()), "best first"


@pytest.mark.parametrize("bad, match", [
    (dict(dim=0), "dim"), (dict(dim=4, index="lsh"), "index"), (dict(dim=4, nprobe=0), "nprobe")])
def test_constructor_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        M.KVMemory(**bad)


def test_add_and_search_errors_name_the_argument():
    mem = M.KVMemory(4)
    with pytest.raises(ValueError, match="keys"):
        mem.add(torch.randn(3, 5), torch.randn(3, 4))
    with pytest.raises(ValueError, match="same number of rows"):
        mem.add(torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(TypeError, match="values"):
        mem.add(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        mem.add(torch.full((1, 4), float("nan")), torch.zeros(1, 4))
    mem.add(torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="top_k"):
        mem.search(torch.randn(1, 4), 0)
    with pytest.raises(ValueError, match="queries"):
        mem.search(torch.randn(1, 3), 1)


@pytest.mark.parametrize("index", ["faiss-flat", "faiss-ivf", "faiss-hnsw"])
def test_faiss_indexes_report_their_recall(index):
    rows = M.index_benchmark([600, 2000], dim=16, n_queries=32, top_k=8, indexes=("exact", index), repeats=1)
    for r in rows:
        assert 0.0 <= r["recall"] <= 1.0 and r["ms_per_query"] > 0
    approx = [r for r in rows if r["index"] == index]
    if index == "faiss-flat":   # brute force in FAISS: the same rows (float32 sums may reorder near-ties)
        assert all(r["recall"] > 0.99 for r in approx)
    else:
        assert all(r["recall"] > 0.5 for r in approx), approx


def test_faiss_memory_grows_and_retrains():
    g = torch.Generator().manual_seed(1)
    mem = M.KVMemory(8, "faiss-ivf", nprobe=64)
    exact = M.KVMemory(8)
    for n in (40, 50, 200):
        x = torch.randn(n, 8, generator=g)
        mem.add(x, x)
        exact.add(x, x)
        q = torch.randn(5, 8, generator=g)
        _, ids = mem.search_ids(q, 4)
        _, want = exact.search_ids(q, 4)
        assert M.recall_at_k(ids, want) == 1.0       # probing every cell is exact
    assert mem._trained_at == 290


def test_topk_merge_equals_search_over_the_union():
    g = torch.Generator().manual_seed(2)
    keys = torch.randint(-2, 3, (40, 5), generator=g).float()
    q = torch.randint(-2, 3, (6, 5), generator=g).float()
    a, b = M.KVMemory(5), M.KVMemory(5)
    a.add(keys[:25], keys[:25])
    b.add(keys[25:], keys[25:])
    sa, ia = a.search_ids(q, 6)
    sb, ib = b.search_ids(q, 6)
    s, i = M.topk_merge(sa, ia, sb, ib + 25, 6)
    want_s, want_i = brute_force(keys, q, 6)
    assert torch.equal(i, want_i) and torch.allclose(s, want_s)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 30), m=st.integers(1, 4), k=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_exact_search_property(n, m, k, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-1, 2, (n, 3), generator=g).float()
    q = torch.randint(-1, 2, (m, 3), generator=g).float()
    mem = M.KVMemory(3)
    mem.add(keys, keys)
    s, i = mem.search_ids(q, k)
    ws, wi = brute_force(keys, q, k)
    assert torch.equal(i, wi) and torch.allclose(s, ws)


# ----------------------------------------------------------------------------------- the gated mix
def test_knn_memory_attention_equals_the_direct_formula():
    """Against the paper's formula written out with loops: two softmaxes, g = sigmoid(b)."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, T, Tk, K, D = 1, 4, 2, 5, 7, 3, 16
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    kl, vl = (torch.randn(B, Hkv, Tk, D, generator=g, dtype=torch.float64) for _ in range(2))
    mk, mv = (torch.randn(B, H, T, K, D, generator=g, dtype=torch.float64) for _ in range(2))
    gate = torch.randn(H, generator=g, dtype=torch.float64)
    got = M.knn_memory_attention_ref(q, kl, vl, mk, mv, gate)
    for h in range(H):
        gh = 1 / (1 + torch.exp(-gate[h]))
        for t in range(T):
            visible = t + Tk - T + 1
            s = kl[0, h // 2, :visible] @ q[0, h, t] / D ** 0.5
            local = torch.softmax(s, 0) @ vl[0, h // 2, :visible]
            mem = torch.softmax(mk[0, h, t] @ q[0, h, t] / D ** 0.5, 0) @ mv[0, h, t]
            torch.testing.assert_close(got[0, h, t], gh * mem + (1 - gh) * local)


def test_gate_limits_and_joint_softmax_differ():
    """b -> -inf is local attention alone, b -> +inf memory attention alone; the source's joint softmax over
    [local; retrieved] is a third thing, equal to the gated mix only for one gate value per query."""
    from labsrc.kernels.flash_attention import flash_attention_ref

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 16, generator=g, dtype=torch.float64)
    kl, vl = (torch.randn(1, 2, 3, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mk, mv = (torch.randn(1, 2, 3, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out, mem, local = M.knn_memory_attention_ref(q, kl, vl, mk, mv, torch.full((2,), -50.0,
                                                 dtype=torch.float64), return_parts=True)
    torch.testing.assert_close(out, flash_attention_ref(q, kl, vl, causal=True))
    out_hi = M.knn_memory_attention_ref(q, kl, vl, mk, mv, torch.full((2,), 50.0, dtype=torch.float64))
    torch.testing.assert_close(out_hi, mem)
    joint = M.joint_softmax_attention(q, kl, vl, mk, mv)
    half = M.knn_memory_attention_ref(q, kl, vl, mk, mv, torch.zeros(2, dtype=torch.float64))
    assert (joint - half).abs().max() > 1e-3


def _drop_padding(mk, mv, valid, t):
    """The rows of query ``t`` that the search really found (what an attention over them must read)."""
    return mk[0, 0, t][valid[t]], mv[0, 0, t][valid[t]]


def test_padded_search_rows_take_no_weight():
    """An IVF index with one row per cell and nprobe=1 finds one row per query, not top_k: the other slots
    are padding. The attention must read only the found rows (the memory output used to shrink, the zero
    rows taking their softmax share), in the reference, the kernel and the joint softmax alike."""
    from labsrc.kernels.memory import knn_memory_attention

    g = torch.Generator().manual_seed(7)
    D, T = 16, 5
    keys = torch.randn(12, D, generator=g)
    mem = M.KVMemory(D, "faiss-ivf", nlist=12, nprobe=1)
    mem.add(keys, torch.randn(12, D, generator=g) + 3.0)     # values far from 0: a zero row would show
    q = torch.randn(1, 1, T, D, generator=g)
    scores, mk, mv, valid = mem.search(q[0, 0], 4)
    assert (~valid).any() and valid[:, 0].all(), "the index found fewer rows than asked for"
    assert bool((scores[~valid] == float("-inf")).all())
    mk, mv, valid = mk[None, None], mv[None, None], valid[None, None]
    kl, vl = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
    gate = torch.tensor([30.0])                               # sigmoid(30) = 1: the memory half alone
    ref = M.knn_memory_attention_ref(q, kl, vl, mk, mv, gate, mem_valid=valid)
    with torch.no_grad():
        ker = knn_memory_attention(q, kl, vl, mk, mv, gate, mem_valid=valid)
    for t in range(T):
        k_t, v_t = _drop_padding(mk, mv, valid[0, 0], t)
        want = torch.softmax(k_t @ q[0, 0, t] / D ** 0.5, 0) @ v_t
        torch.testing.assert_close(ref[0, 0, t], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ker[0, 0, t], want, rtol=1e-5, atol=1e-5)
    unmasked = M.knn_memory_attention_ref(q, kl, vl, mk, mv, gate)
    assert (unmasked - ref).abs().max() > 0.5, "without the mask the padding is weighted (the old defect)"
    # the joint softmax reads the same rows
    joint = M.joint_softmax_attention(q, kl, vl, mk, mv, mem_valid=valid)
    joint_found = [M.joint_softmax_attention(q[:, :, t:t + 1], kl[:, :, :t + 1], vl[:, :, :t + 1],
                                             mk[:, :, t:t + 1, valid[0, 0, t]], mv[:, :, t:t + 1, valid[0, 0, t]])
                   for t in range(T)]
    torch.testing.assert_close(joint, torch.cat(joint_found, 2), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- retrieval of past KV
@pytest.fixture(scope="module")
def lab():
    from labsrc.models import load
    return load("lab-target")


def test_retrieval_equals_full_attention_when_memory_holds_everything(lab):
    model, tok = lab
    s = tasks.passkey_sample(tok, 150, 0.3, random.Random(0))
    full = model(input_ids=torch.tensor([s.ids])).logits
    impl = model.config._attn_implementation
    got, ctx = M.retrieval_logits(model, s.ids, window=24, chunk=16, top_k=10**6, sinks=4, rule="original")
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    assert ctx.stats.memory_tokens == 150 - 24 - 4, "the memory held the past"
    assert model.config._attn_implementation == impl, "the attention implementation is restored"
    # the FAISS flat index is brute force too: the same logits
    got_f, _ = M.retrieval_logits(model, s.ids, window=24, chunk=16, top_k=10**6, sinks=4, rule="original",
                                  index="faiss-flat")
    torch.testing.assert_close(got_f, full, rtol=1e-4, atol=1e-4)
    # top-k that does not cover the memory, or clamped positions, is another computation
    part, _ = M.retrieval_logits(model, s.ids, window=24, chunk=16, top_k=2, rule="original")
    assert (part - full).abs().max() > 1e-3


def test_clamped_rule_search_scores_are_the_attention_logits(lab):
    """Under "clamped", the inner product the index ranks by is q at distance delta times the key."""
    model, _ = lab
    inv = model.model.rotary_emb.inv_freq.float()
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(40, generator=g), torch.randn(40, generator=g)
    p, j, delta = torch.tensor([900]), torch.tensor([3]), 96
    q_post, k_post = M._rotate(q, p, inv), M._rotate(k, j, inv)
    search = (M._rotate(q_post, delta - p, inv) * M._rotate(k_post, -j, inv)).sum()
    at_delta = (M._rotate(q, torch.tensor([delta]), inv) * k).sum()   # key at 0, query at distance delta
    torch.testing.assert_close(search, at_delta, rtol=1e-5, atol=1e-5)


def test_retrieval_argument_errors(lab):
    model, _ = lab
    with pytest.raises(ValueError, match="rule"):
        M.RetrievalContext(model, window=8, top_k=2, rule="nearest")
    with pytest.raises(ValueError, match="window"):
        M.RetrievalContext(model, window=0, top_k=2)
    with pytest.raises(RuntimeError, match="RetrievalContext"):
        M._lab_memory_forward(None, None, None, None, None)


# ------------------------------------------------------------------------------------- chunking, RAG
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 300), size=st.integers(1, 64), data=st.data())
def test_chunk_spans_cover_and_never_split_a_short_fact(n, size, data):
    overlap = data.draw(st.integers(0, size - 1))
    spans = M.chunk_spans(n, size, overlap)
    covered = set()
    for s, e in spans:
        assert 0 <= s < e <= n and e - s <= size
        covered.update(range(s, e))
    assert covered == set(range(n))
    if n:
        a = data.draw(st.integers(0, n - 1))
        b = min(n, a + overlap + 1)
        assert any(s <= a and b <= e for s, e in spans), (a, b, spans)


def test_chunk_spans_errors():
    with pytest.raises(ValueError, match="overlap"):
        M.chunk_spans(10, 4, 4)
    with pytest.raises(ValueError, match="size"):
        M.chunk_spans(10, 0, 0)


def test_rag_and_truncation_build_valid_samples(lab):
    model, tok = lab
    s = tasks.passkey_sample(tok, 1024, 0.2, random.Random(1))
    t = M.truncate_sample(s)
    assert len(t.ids) == 512 and t.ids[0] == tok.bos_token_id and t.answer_ids == s.answer_ids
    r, info = M.rag_sample(s, tok, model, M.BM25Retriever())
    assert len(r.ids) <= 512 and r.answer_ids == s.answer_ids
    assert info["fact_retrieved"], "BM25 finds the pass-key sentence: the question shares its words"
    assert r.ids[r.spans[0][0] - len(M.question_ids(s, tok)):r.spans[0][0]] == M.question_ids(s, tok)


def test_run_method_rejects_unknown_method(lab):
    model, tok = lab
    s = tasks.passkey_sample(tok, 300, 0.5, random.Random(2))
    with pytest.raises(ValueError, match="method"):
        M.run_method("magic", model, tok, s)
    r = M.run_method("truncate", model, tok, s)
    assert r["kv_tokens_held"] == 300 and isinstance(r["right"], bool)


def test_run_method_fills_the_models_trained_window(lab):
    """Truncation and RAG default to lab-target's trained context, not a constant."""
    from labsrc.models.train import trained_context

    model, tok = lab
    window = trained_context(model)
    s = tasks.passkey_sample(tok, window + 300, 0.9, random.Random(3))
    r = M.run_method("truncate", model, tok, s)
    assert r["kv_tokens_held"] == window, "truncation keeps BOS and the last trained - 1 tokens"
    r = M.run_method("rag-bm25", model, tok, s)
    assert window - 64 < r["kv_tokens_held"] <= window, "RAG fills the trained window, chunk by chunk"
    with pytest.raises(ValueError, match="trained"):
        M.run_method("truncate", model, tok, s, trained=0)


def test_compare_methods_shares_documents_and_gives_cheap_methods_more(lab):
    model, tok = lab
    labels = [label for label, _, _ in M.comparison_plan((4,))]
    keep = ("full", "truncate")
    got = []
    rows = M.compare_methods(model, tok, [300], [1], n_cheap=3, top_ks=(4,),
                             skip=[(300, l) for l in labels if l not in keep],
                             progress=lambda length, label, cell: got.append((label, len(cell))))
    assert got == [("full", 1), ("truncate", 3)], "skipped cells are not run; cheap methods get n_cheap"
    by = {(r["label"], r["doc"]): r for r in rows}
    assert by[("full", 0)]["depth"] == by[("truncate", 0)]["depth"], "the first n documents are shared"
    assert len({by[("truncate", i)]["depth"] for i in range(3)}) == 3, "depths are drawn, not repeated"
    docs = M.comparison_documents(tok, 300, 3)
    assert [d.meta["depth"] for d in docs] == [by[("truncate", i)]["depth"] for i in range(3)]
    assert M.comparison_documents(tok, 300, 1)[0].ids == docs[0].ids, "a shorter list is a prefix"
    with pytest.raises(ValueError, match="one int per length"):
        M.compare_methods(model, tok, [300, 400], [1], top_ks=(4,))
    with pytest.raises(ValueError, match="n_cheap"):
        M.compare_methods(model, tok, [300], 1, n_cheap=0, top_ks=(4,))


def test_stored_comparison_is_complete_and_summarizes():
    """The chapter's CPU profile plots the stored run: every length and method with its planned n, on the
    settings the CPU profile names now."""
    import labsrc

    stored = M.load_results("cpu")
    assert stored["complete"] and stored["command"].startswith("python -m labsrc.memory")
    S = labsrc.sizes("memory", "cpu")
    assert stored["lengths"] == list(S.compare_lengths) and stored["n"] == list(S.compare_n)
    assert stored["n_cheap"] == S.compare_n_cheap and stored["top_ks"] == list(S.top_ks)
    summary = M.summarize(stored["rows"])
    labels = {r["label"] for r in stored["rows"]}
    assert labels == {label for label, _, _ in M.comparison_plan(S.top_ks)}
    for length, n in zip(stored["lengths"], stored["n"]):
        for label in labels:
            cell = summary[(length, label)]
            assert cell["n"] == M.planned_n(label, n, stored["n_cheap"]), (length, label)
            assert 0 <= cell["k"] <= cell["n"] and cell["sec"] > 0
