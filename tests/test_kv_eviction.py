"""Tests of labsrc.kv_eviction: scores, the budget correction, the policies, the paged pool and the cache."""
import math

import pytest
import torch

import labsrc  # noqa: F401  (sets the runtime up before anything else)
from labsrc import kv_eviction as ev
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def random_attention(g, t, n, seed=0):
    """Causal softmax rows of the last t of n positions, for g heads: (g, t, n)."""
    logits = torch.randn(g, t, n, generator=gen(seed)) * 2
    qpos = n - t + torch.arange(t)
    future = torch.arange(n)[None, :] > qpos[:, None]
    return torch.softmax(logits.masked_fill(future, -math.inf), -1)


def random_stats(n=23, g=3, t=9, d=5, seed=0, window=None):
    attn = random_attention(g, t, n, seed)
    values = torch.randn(n, d, generator=gen(seed + 1))
    return ev.TokenStats.from_attention(attn, values, window=window)


# ---------------------------------------------------------------- value-aware score

def test_value_aware_scores_match_the_formula_by_hand():
    attn = random_attention(2, 4, 7, seed=3)
    values = torch.randn(7, 3, generator=gen(4))
    alpha, beta, gamma, lam = 1.0, 0.5, 0.3, 0.5
    got = ev.value_aware_scores(attn, values, alpha, beta, gamma, lam)
    n = 7
    for i in range(n):
        a = sum(float(attn[h, t, i]) for h in range(2) for t in range(4))
        v = math.sqrt(sum(float(values[i, j]) ** 2 for j in range(3)))
        r = math.exp(-lam * (n - i) / n)
        assert got[i].item() == pytest.approx(a ** alpha * v ** beta * r ** gamma, rel=1e-5)
    per_head = attn.sum(1).max(0).values
    mx = ev.value_aware_scores(attn, values, head_reduce="max")
    torch.testing.assert_close(mx, per_head * values.norm(dim=-1) ** 0.5 * ev.recency(7, 0.5) ** 0.3)


def test_recency_and_the_ablation_switches():
    r = ev.recency(10, 0.5)
    assert r[0].item() == pytest.approx(math.exp(-0.5)) and r[-1].item() == pytest.approx(math.exp(-0.05))
    attn = random_attention(1, 3, 6)
    values = torch.randn(6, 4, generator=gen(2))
    only_v = ev.value_aware_scores(attn, values, alpha=0, beta=1, gamma=0)
    torch.testing.assert_close(only_v, values.norm(dim=-1))
    only_a = ev.value_aware_scores(attn, values, alpha=1, beta=0, gamma=0)
    torch.testing.assert_close(only_a, attn.sum((0, 1)))


@pytest.mark.parametrize("attn, values, kw, message", [
    (torch.rand(3, 4), torch.rand(4, 2), {}, "attn must be a 3-D tensor"),
    (torch.rand(1, 3, 4), torch.rand(4), {}, "values must be a 2-D tensor"),
    (torch.rand(1, 3, 4), torch.rand(5, 2), {}, "attn has N=4 keys but values has 5 rows"),
    (torch.rand(1, 3, 0), torch.rand(0, 2), {}, "at least one token"),
    (torch.rand(1, 3, 4), torch.rand(4, 2), {"lam": -1.0}, "lam must be non-negative"),
    (torch.rand(1, 3, 4), torch.rand(4, 2), {"head_reduce": "mean"}, "head_reduce must be"),
])
def test_value_aware_scores_errors(attn, values, kw, message):
    with pytest.raises(ValueError, match=message):
        ev.value_aware_scores(attn, values, **kw)


def test_value_norm_cv():
    v = torch.randn(2, 50, 8, generator=gen(0))
    norms = v.norm(dim=-1)
    torch.testing.assert_close(ev.value_norm_cv(v), norms.std(-1) / norms.mean(-1))
    with pytest.raises(ValueError, match="N >= 2"):
        ev.value_norm_cv(torch.randn(1, 8))


# ---------------------------------------------------------------- budget correction

def test_inclusion_probabilities_redistribute_the_capped_mass():
    s = torch.tensor([50.0, 1.0, 2.0, 3.0, 0.5, 20.0, 1.5])
    k = 3
    p = ev.inclusion_probabilities(s, k)
    assert p.sum().item() == pytest.approx(k) and (p <= 1).all() and (p >= 0).all()
    naive = torch.clamp(k * s.double() / s.sum(), max=1)
    assert naive.sum() < k - 0.5, "the source's formula loses the capped mass"
    assert (p >= naive - 1e-12).all()
    free = p < 1
    ratio = p[free] / s[free].double()
    torch.testing.assert_close(ratio, ratio[0].expand_as(ratio))
    assert p[0] == 1 and p[5] == 1


def test_inclusion_probabilities_with_few_positive_scores():
    p = ev.inclusion_probabilities(torch.tensor([0.0, 3.0, 0.0, 0.0, 1.0]), 3)
    torch.testing.assert_close(p, torch.tensor([1 / 3, 1, 1 / 3, 1 / 3, 1], dtype=torch.float64))


@pytest.mark.parametrize("scores, budget, message", [
    (torch.rand(5), 6, "budget=6 is larger than the number of tokens N=5"),
    (torch.rand(5), 0, "budget must be positive"),
    (torch.rand(5), -2, "budget must be positive"),
    (torch.rand(5), 2.0, "budget must be an int"),
    (torch.rand(2, 3), 2, "non-empty 1-D tensor"),
    (torch.tensor([1.0, float("nan")]), 1, "finite"),
    (torch.tensor([1.0, -1.0]), 1, "non-negative"),
    ([1.0, 2.0], 1, "must be a torch.Tensor"),
])
def test_keep_functions_reject_bad_inputs(scores, budget, message):
    for fn in (ev.inclusion_probabilities, ev.stochastic_keep, ev.bernoulli_keep, ev.topk_keep):
        with pytest.raises(ValueError, match=message):
            fn(scores, budget)


def test_systematic_indices_is_exact_and_checks_its_inputs():
    p = torch.tensor([0.5, 0.5, 1.0, 0.25, 0.75])
    for u in (0.0, 0.3, 0.5, 0.99):
        idx = ev.systematic_indices(p, u)
        assert idx.numel() == 3 and 2 in idx.tolist()
    assert ev.systematic_indices(p, 0.3).tolist() == [0, 2, 4]   # points 0.3, 1.3, 2.3 -> [0,.5), [1,2), [2.25,3)
    with pytest.raises(ValueError, match=r"u must lie in \[0, 1\)"):
        ev.systematic_indices(p, 1.0)
    with pytest.raises(ValueError, match="p must sum to an integer"):
        ev.systematic_indices(torch.tensor([0.5, 0.2]), 0.1)
    with pytest.raises(ValueError, match="p must be a 1-D tensor"):
        ev.systematic_indices(torch.ones(2, 2), 0.1)


def test_stochastic_keep_exact_budget_and_same_seed_same_choice():
    s = torch.rand(31, generator=gen(5)) ** 3
    for seed in range(20):
        a = ev.stochastic_keep(s, 9, gen(seed))
        assert a.numel() == 9 and a.unique().numel() == 9 and torch.equal(a, torch.sort(a).values)
        assert torch.equal(a, ev.stochastic_keep(s, 9, gen(seed)))
        b = ev.bernoulli_keep(s, 9, gen(seed))
        assert b.numel() == 9 and b.unique().numel() == 9
    assert not all(torch.equal(ev.stochastic_keep(s, 9, gen(0)), ev.stochastic_keep(s, 9, gen(k))) for k in range(1, 6))
    assert ev.stochastic_keep(s, 31, gen(0)).tolist() == list(range(31))


def test_stochastic_keep_retention_frequencies_follow_p():
    # Each index's count over independent draws is Binomial(draws, p_i) exactly, whatever the dependence
    # between indices inside one draw. With 12 indices and a 5-sigma bound (plus one count for the
    # normal approximation), the chance of a false failure is below 12 * 6e-7.
    s = torch.tensor([9.0, 0.2, 1.0, 3.0, 0.5, 2.0, 0.05, 4.0, 1.5, 0.8, 6.0, 0.1])
    k, draws = 5, 3000
    p = ev.inclusion_probabilities(s, k)
    freq = ev.retention_frequencies(ev.stochastic_keep, s, k, draws, seed=1234)
    counts = freq * draws
    bound = 5 * torch.sqrt(p * (1 - p) / draws) + 1.0 / draws
    assert ((freq - p).abs() <= bound).all(), (freq, p)
    assert counts[0] == draws, "an index with p = 1 must always be kept"
    naive = torch.clamp(k * s.double() / s.sum(), max=1)
    assert ((freq - naive).abs() > bound).any(), "the uncorrected probabilities should be detectably off"


def test_bernoulli_keep_is_only_approximately_p():
    # The source's recipe: the count is exact but the correction shifts the inclusion probabilities.
    s = torch.tensor([9.0, 0.2, 1.0, 3.0, 0.5, 2.0, 0.05, 4.0, 1.5, 0.8, 6.0, 0.1])
    freq = ev.retention_frequencies(ev.bernoulli_keep, s, 5, 1500, seed=7)
    assert freq.sum().item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="draws must be a positive int"):
        ev.retention_frequencies(ev.stochastic_keep, s, 5, 0)


def test_topk_keep_breaks_ties_towards_newer_tokens():
    assert ev.topk_keep(torch.tensor([1.0, 3.0, 1.0, 2.0, 1.0]), 3).tolist() == [1, 3, 4]


# ---------------------------------------------------------------- policies

ALL_POLICIES = [ev.FIFO(), ev.LRU(), ev.LRU(threshold=0.05), ev.H2O(), ev.H2O(recent=2), ev.StreamingLLM(sinks=3),
                ev.Scissorhands(history=6), ev.ValueAware(window=5), ev.ValueAware(stochastic=False, recent=2)]


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=repr)
@pytest.mark.parametrize("budget, protect", [(12, 0), (12, 5), (7, 3)])
def test_every_policy_keeps_exactly_its_budget_and_the_protected_prefix(policy, budget, protect):
    for seed in range(3):
        stats = random_stats(seed=seed, window=policy.window or None)
        keep = policy.select(stats, budget, protect, gen(seed))
        assert keep.numel() == budget and keep.unique().numel() == budget
        assert torch.equal(keep, torch.sort(keep).values)
        kept = set(stats.positions[keep].tolist())
        assert set(range(protect)) <= kept
        if isinstance(policy, ev.StreamingLLM):
            assert set(range(policy.sinks)) <= kept
            assert set(range(23 - (budget - len(set(range(max(protect, policy.sinks)))) ), 23)) <= kept


def test_policies_pick_what_they_promise():
    stats = random_stats(n=20, g=2, t=20, seed=7)
    assert ev.FIFO().select(stats, 5).tolist() == list(range(15, 20))
    assert ev.StreamingLLM(sinks=2).select(stats, 5).tolist() == [0, 1, 17, 18, 19]
    h2o = ev.H2O(recent=2).select(stats, 6)
    assert {18, 19} <= set(h2o.tolist())
    heavy = torch.topk(stats.acc[:18], 4).indices
    assert set(heavy.tolist()) <= set(h2o.tolist())
    lru = ev.LRU().select(stats, 6)
    dropped = torch.ones(20, dtype=torch.bool)
    dropped[lru] = False
    assert stats.last_used[lru].min() >= stats.last_used[dropped].max()


def test_h2o_keeps_a_heavy_hitter_that_fifo_drops():
    n = 12
    attn = torch.full((1, n, n), 0.0)
    for t in range(n):
        attn[0, t, : t + 1] = 0.1 / (t + 1)
        attn[0, t, 0] += 0.9
    stats = ev.TokenStats.from_attention(attn, torch.ones(n, 2))
    assert 0 in ev.H2O(recent=2).select(stats, 4).tolist()
    assert 0 not in ev.FIFO().select(stats, 4).tolist()


def test_value_aware_prefers_large_values_among_equal_attention():
    n = 10
    attn = torch.full((1, 4, n), 1.0 / n)
    values = torch.ones(n, 3)
    values[2] *= 30
    stats = ev.TokenStats.from_attention(attn, values)
    assert 2 in ev.ValueAware(stochastic=False).select(stats, 2).tolist()
    assert 2 not in ev.ValueAware(stochastic=False, beta=0.0).select(stats, 2).tolist()


def test_value_aware_keeps_the_newest_tokens_that_its_score_cannot_see():
    # The newest tokens have had no query yet, so A_i = 0: the source's rule (recent=0) drops them whatever
    # R_i says; the default keeps min(8, budget // 4) of them.
    n, t = 40, 6
    attn = torch.zeros(1, t, n)
    attn[0, :, : n - t] = torch.softmax(torch.randn(t, n - t, generator=gen(5)), -1)
    stats = ev.TokenStats.from_attention(attn, torch.ones(n, 3))
    assert ev.ValueAware(stochastic=False, recent=0).score(stats)[-t:].max() < 1e-9
    for budget in (12, 20, 32):
        newest = set(range(n - min(8, budget // 4), n))
        kept = set(ev.ValueAware(stochastic=False).select(stats, budget).tolist())
        assert newest <= kept
        assert not set(range(n - t, n)) & set(ev.ValueAware(stochastic=False, recent=0).select(stats, budget).tolist())
        drawn = set(ev.ValueAware(recent=3).select(stats, budget, generator=gen(budget)).tolist())
        assert set(range(n - 3, n)) <= drawn


def test_value_aware_with_only_attention_over_a_long_window_is_h2o():
    # alpha=1, beta=gamma=0 and a window holding every query: A_i is the attention accumulated since arrival,
    # H2O's statistic; with the same recent window and top-K the two policies must choose the same tokens.
    stats = random_stats(n=31, g=4, t=31, seed=7)
    va = ev.ValueAware(beta=0.0, gamma=0.0, window=10_000, stochastic=False, recent=6)
    torch.testing.assert_close(va.score(stats), stats.acc, rtol=1e-5, atol=1e-6)
    for budget in (9, 15, 24):
        assert torch.equal(va.select(stats, budget), ev.H2O(recent=6).select(stats, budget))


def test_policy_errors():
    stats = random_stats()
    with pytest.raises(ValueError, match="budget=24 is larger than the number of tokens N=23"):
        ev.FIFO().select(stats, 24)
    with pytest.raises(ValueError, match="budget must be positive"):
        ev.FIFO().select(stats, 0)
    with pytest.raises(ValueError, match="protect must be a non-negative int"):
        ev.FIFO().select(stats, 4, protect=-1)
    with pytest.raises(ValueError, match="budget=3 is smaller than the 5 tokens streamingllm must keep"):
        ev.StreamingLLM(sinks=5).select(stats, 3)
    with pytest.raises(ValueError, match="budget=4 is smaller than the 6 tokens h2o must keep"):
        ev.H2O(recent=6).select(stats, 4)
    with pytest.raises(ValueError, match="threshold must lie in"):
        ev.LRU(threshold=1.5)
    with pytest.raises(ValueError, match="history must be a positive int"):
        ev.Scissorhands(history=0)
    with pytest.raises(ValueError, match="window must be a positive int"):
        ev.ValueAware(window=0)
    with pytest.raises(ValueError, match="head_reduce must be"):
        ev.ValueAware(head_reduce="min")
    with pytest.raises(ValueError, match="lam must be non-negative"):
        ev.ValueAware(lam=-1)
    with pytest.raises(ValueError, match="recent must be a non-negative int"):
        ev.H2O(recent=-1)
    with pytest.raises(ValueError, match="sinks must be a non-negative int"):
        ev.StreamingLLM(sinks=1.5)
    with pytest.raises(ValueError, match="unknown policy 'lfu'"):
        ev.make_policy("lfu")
    with pytest.raises(ValueError, match="attn must be"):
        ev.TokenStats.from_attention(torch.rand(2, 3), torch.rand(3, 2))
    assert isinstance(ev.make_policy("h2o", recent=3), ev.H2O)


# ---------------------------------------------------------------- subset loss and the best subset

def test_subset_loss_and_optimal_subset():
    g = gen(11)
    q, k, v = torch.randn(3, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(9, 2, generator=g)
    assert ev.subset_loss(q, k, v, range(9)).item() == pytest.approx(0.0, abs=1e-12)
    best, loss = ev.optimal_subset(q, k, v, 4)
    assert best.numel() == 4
    assert loss == pytest.approx(ev.subset_loss(q, k, v, best).item())
    import itertools
    brute = min(ev.subset_loss(q, k, v, list(c)).item() for c in itertools.combinations(range(9), 4))
    assert loss == pytest.approx(brute)
    stats = ev.TokenStats.from_attention(torch.softmax(q @ k.T / 2, -1)[None], v)
    for policy in (ev.FIFO(), ev.H2O(recent=1), ev.ValueAware(stochastic=False)):
        assert ev.subset_loss(q, k, v, policy.select(stats, 4)).item() >= loss - 1e-12
    best_p, loss_p = ev.optimal_subset(q, k, v, 4, protect=2)
    assert {0, 1} <= set(best_p.tolist()) and loss_p >= loss - 1e-12


def test_subset_errors():
    q, k, v = torch.randn(2, 4), torch.randn(6, 4), torch.randn(6, 3)
    with pytest.raises(ValueError, match="q must be a 2-D tensor"):
        ev.subset_loss(q[0], k, v, [0])
    with pytest.raises(ValueError, match="q has dimension 4 but k has 3"):
        ev.subset_loss(q, k[:, :3], v, [0])
    with pytest.raises(ValueError, match="k has 6 tokens but v has 5"):
        ev.subset_loss(q, k, v[:5], [0])
    with pytest.raises(ValueError, match="distinct indices"):
        ev.subset_loss(q, k, v, [0, 0])
    with pytest.raises(ValueError, match="budget=7 is larger"):
        ev.optimal_subset(q, k, v, 7)
    with pytest.raises(ValueError, match="protect must lie in"):
        ev.optimal_subset(q, k, v, 2, protect=3)
    with pytest.raises(ValueError, match="exceed max_subsets=10"):
        ev.optimal_subset(q, k, v, 3, max_subsets=10)


# ---------------------------------------------------------------- paged pool

def test_paged_pool_protects_prefix_and_reuses_marked_pages_lazily():
    pool = ev.PagedEvictionPool(num_pages=6, page_size=4, protect=5)
    slots = pool.append("a", 22)                       # 6 pages: the last one holds 2 tokens
    assert slots[0] == (0, 0) and slots[5] == (1, 1) and len(pool.pages("a")) == 6
    assert pool.evictable("a").tolist() == [False, False, True, True, True, False]
    with pytest.raises(MemoryError, match="no free or marked page"):
        pool.append("a", 3)
    assert pool.lengths["a"] == 22, "a failed append must append nothing"
    pool.append("a", 2)
    scores = torch.arange(24, dtype=torch.float32)
    marked = pool.evict("a", scores, 2, stochastic=False)
    assert marked == [2, 3]                            # the lowest-scoring evictable pages
    assert pool.pages("a") == [0, 1, 4, 5] and pool.n_free == 2
    assert pool.restore(2) and pool.pages("a") == [0, 1, 2, 4, 5]
    assert pool.page_positions("a")[2] == range(8, 12)
    assert pool.evict("a", torch.arange(24.0), 1, stochastic=False) == [2]
    pool.append("a", 1)                                 # needs a new page: reuses the oldest mark, page 3
    assert pool.reused == 1 and not pool.restore(3) and pool.pages("a")[-1] == 3
    assert pool.restore(2), "page 2 was marked later and is still intact"

    pool.release("a")
    assert pool.n_free == 6 and pool.pages("a") == []


def test_paged_pool_stochastic_eviction_never_touches_protected_pages():
    for seed in range(10):
        pool = ev.PagedEvictionPool(num_pages=10, page_size=16, protect=20)
        pool.append(0, 150)
        marked = pool.evict(0, torch.rand(150, generator=gen(seed)), 4, generator=gen(seed))
        assert len(marked) == 4 and not {0, 1, 9} & set(marked)


def test_paged_pool_errors():
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        ev.PagedEvictionPool(0)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        ev.PagedEvictionPool(4, page_size=0)
    with pytest.raises(ValueError, match="protect must be a non-negative int"):
        ev.PagedEvictionPool(4, protect=-1)
    pool = ev.PagedEvictionPool(4, page_size=2)
    with pytest.raises(ValueError, match="n_tokens must be a positive int"):
        pool.append(0, 0)
    pool.append(0, 5)
    with pytest.raises(ValueError, match="one score per appended token"):
        pool.evict(0, torch.rand(4), 1)
    with pytest.raises(ValueError, match=r"n_pages must be an int in \[1, 2\]"):
        pool.evict(0, torch.rand(5), 3)


# ---------------------------------------------------------------- the transformers cache

@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1, 97, (1, 21), generator=gen(3))


@pytest.fixture(scope="module")
def reference(model, prompt):
    return model.generate(prompt, max_new_tokens=8, do_sample=False, cache=DynamicCache())


@pytest.mark.parametrize("policy", [ev.FIFO(), ev.LRU(), ev.H2O(), ev.StreamingLLM(), ev.Scissorhands(),
                                    ev.ValueAware()], ids=lambda p: p.name)
def test_large_budget_generates_exactly_like_dynamic_cache(model, prompt, reference, policy):
    with ev.EvictingCache(policy, budget=40, model=model, generator=gen(0)) as cache:
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, cache=cache)
    assert torch.equal(out, reference)
    assert cache.get_seq_length() == 28 and cache.evictions == 0


@pytest.mark.parametrize("policy", [ev.H2O(), ev.ValueAware(), ev.ValueAware(stochastic=False, head_reduce="max")],
                         ids=repr)
@pytest.mark.parametrize("shared", [False, True])
def test_small_budget_generate_keeps_budget_protect_and_positions(model, prompt, policy, shared):
    with ev.EvictingCache(policy, budget=10, protect=3, model=model, shared=shared, record=True,
                          generator=gen(1)) as cache:
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, cache=cache)
    assert out.shape == (1, 29) and cache.get_seq_length() == 28
    for layer in cache.layers:
        assert layer.keys.shape[-2] == 10
        pos = layer.kept_positions()
        assert pos.shape == ((1, 10) if shared else (2, 10))
        assert (pos[:, :3] == torch.arange(3)).all()
        assert (pos.diff(dim=1) > 0).all()
    surv = ev.survival_matrix(cache, 0)
    assert surv.shape == (cache.layers[0].log.__len__(), 28) and (surv.sum(1) == 10).all()
    assert surv[:, :3].all()


def test_fifo_cache_matches_a_full_forward_with_the_same_visibility(model):
    # FIFO keeps the same positions in every layer, so a single full forward whose mask lets query t see
    # exactly what the evicting cache kept reproduces the cached computation: this pins the rotary
    # positions and the mask offsets, not just the shapes.
    ids = torch.randint(1, 97, (1, 30), generator=gen(8))
    prefill, budget = 12, 7
    cache = ev.EvictingCache(ev.FIFO(), budget=budget)
    nll = ev.token_nll(model, ids, cache, prefill)
    n = ids.shape[1]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for t in range(prefill, n):
        mask[t, : t - budget] = False
    logits = model(ids, attention_mask=mask[None, None]).logits[0, prefill - 1:-1]
    expected = torch.nn.functional.cross_entropy(logits, ids[0, prefill:], reduction="none")
    torch.testing.assert_close(nll, expected, rtol=1e-4, atol=1e-4)
    full = ev.token_nll(model, ids, ev.EvictingCache(ev.FIFO(), budget=64), prefill)
    plain = torch.nn.functional.cross_entropy(model(ids).logits[0, prefill - 1:-1], ids[0, prefill:], reduction="none")
    torch.testing.assert_close(full, plain, rtol=1e-4, atol=1e-4)


def test_hooked_queries_reproduce_the_models_attention(model):
    ids = torch.randint(1, 97, (1, 13), generator=gen(9))
    model.config._attn_implementation = "eager"
    try:
        with ev.EvictingCache(ev.H2O(), budget=64, model=model) as cache:
            attns = model(ids, cache=cache, use_cache=True, output_attentions=True).attentions
    finally:
        model.config._attn_implementation = "sdpa"
    for layer, a in zip(cache.layers, attns):
        per_kv = a[0].reshape(2, 2, 13, 13).sum((1, 2))            # (kv heads, keys)
        torch.testing.assert_close(layer.acc, per_kv.float(), rtol=1e-4, atol=1e-5)
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    for (q, k, v), a in zip(ev.record_qkv(model, ids), attns):
        assert q.shape == (4, 13, 16) and k.shape == v.shape == (2, 13, 16)
        logits = (q @ k.repeat_interleave(2, 0).transpose(1, 2) / 4.0).masked_fill(~causal, -math.inf)
        torch.testing.assert_close(torch.softmax(logits, -1), a[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="input_ids must be"):
        ev.record_qkv(model, ids[0])


def test_cache_errors(model):
    with pytest.raises(ValueError, match="policy must be an EvictionPolicy"):
        ev.EvictingCache("h2o", budget=4)
    with pytest.raises(ValueError, match="budget must be a positive int"):
        ev.EvictingCache(ev.FIFO(), budget=0)
    with pytest.raises(ValueError, match="protect=5 exceeds budget=4"):
        ev.EvictingCache(ev.FIFO(), budget=4, protect=5)
    with pytest.raises(ValueError, match="slack must be a non-negative int"):
        ev.EvictingCache(ev.FIFO(), budget=4, slack=-1)
    with pytest.raises(ValueError, match="policy h2o reads attention, so EvictingCache needs model="):
        ev.EvictingCache(ev.H2O(), budget=4)
    with pytest.raises(ValueError, match="no attention module"):
        ev.EvictingCache(ev.H2O(), budget=4, model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.ones(2, 3, dtype=torch.long), cache=ev.EvictingCache(ev.FIFO(), budget=4), use_cache=True)
    cache = ev.EvictingCache(ev.FIFO(), budget=4, record=False)
    with pytest.raises(ValueError, match="record=True"):
        ev.survival_matrix(cache)
    with pytest.raises(ValueError, match=r"prefill must be an int in \[1, 4\]"):
        ev.token_nll(model, torch.ones(1, 5, dtype=torch.long), cache, 5)
    with pytest.raises(ValueError, match="input_ids must be"):
        ev.token_nll(model, torch.ones(5, dtype=torch.long), cache, 2)


def test_detach_removes_the_hooks(model):
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    cache = ev.EvictingCache(ev.H2O(), budget=8, model=model)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == before + 4
    cache.detach()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == before


def test_generate_evicting_and_budget_for(model, prompt):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert ev.budget_for(21, 0.5) == 10 and ev.budget_for(21, 0.75) == 5 and ev.budget_for(8, 0.9, protect=4) == 5
    new, cache = ev.generate_evicting(model, prompt, ev.ValueAware(), budget=ev.budget_for(21, 0.75), protect=2,
                                      max_new_tokens=5, seed=3, record=True)
    again, cache2 = ev.generate_evicting(model, prompt, ev.ValueAware(), budget=5, protect=2, max_new_tokens=5,
                                         seed=3, record=True)
    assert new.shape == (1, 5) and torch.equal(new, again)
    assert torch.equal(cache.kept_positions(1), cache2.kept_positions(1)), "same seed, same choices"
    others = [ev.generate_evicting(model, prompt, ev.ValueAware(), budget=5, protect=2, max_new_tokens=5,
                                   seed=seed)[1].kept_positions(1) for seed in (4, 5, 6)]
    assert any(not torch.equal(o, cache.kept_positions(1)) for o in others), "other seeds, other choices"
    assert cache.steps == 5 and cache.evictions == 2 * 5 and cache.timings["select"] > 0
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    with pytest.raises(ValueError, match=r"evict_rate must lie in \[0, 1\)"):
        ev.budget_for(10, 1.0)
    with pytest.raises(ValueError, match="n_tokens must be a positive int"):
        ev.budget_for(0, 0.5)


def test_answer_accuracy_full_cache_and_errors(model, prompt):
    from labsrc.tasks import Sample
    ids = prompt[0].tolist()
    full = model.generate(prompt, max_new_tokens=3, do_sample=False)[0, 21:].tolist()
    right = Sample("toy", ids + full, [(21, 24)])
    wrong = Sample("toy", ids + [(t + 1) % 97 for t in full], [(21, 24)])
    assert ev.answer_accuracy(model, [right, wrong], None, None) == 0.5
    assert ev.answer_accuracy(model, [right], ev.FIFO(), 0.0) == 1.0
    with pytest.raises(ValueError, match="give both policy and evict_rate, or neither"):
        ev.answer_accuracy(model, [right], ev.FIFO(), None)


# The eviction goal on the lab model (value-aware keeps >= 90% of the full cache's pass keys at 50% eviction)
# is measured by chapter 6's stored curve (python -m labsrc.sweeps.kv_eviction), n = 100 per point at 0.9 of the
# trained context. On the 1,024-token lab-target it is not met (0.58 against the full cache's 0.99), so the
# eight-sample check that asserted it at 256 tokens is gone rather than moved to a setting where it passes.


# --------------------------------------------------------------------------------------------------
# Validation promises: each of these used to return a wrong count, NaN, or raise an error that did
# not name the argument (ZeroDivisionError, IndexError, RuntimeError, bare TypeError).
# --------------------------------------------------------------------------------------------------
NAN = float("nan")


@pytest.mark.parametrize("p, u, message", [
    (torch.tensor([1.5, 0.5]), 0.3, r"p must hold probabilities in \[0, 1\]"),   # used to keep 1 item, not 2
    (torch.tensor([-0.5, 0.5, 1.0]), 0.3, r"p must hold probabilities in \[0, 1\]"),
    (torch.tensor([NAN, 0.5, 0.5]), 0.3, r"p must hold probabilities in \[0, 1\] \(no NaN\)"),
    (torch.tensor([float("inf"), 0.5]), 0.3, r"p must hold probabilities"),
    (torch.zeros(0), 0.3, "p must be a 1-D tensor with at least one item"),          # IndexError before
    ([0.5, 0.5], 0.3, "p must be a 1-D tensor"),
    (torch.tensor([True, False]), 0.3, "p must hold real probabilities"),
    (torch.tensor([0.5, 0.5]), False, r"u must lie in \[0, 1\)"),                     # RuntimeError before
    (torch.tensor([0.5, 0.5]), "a", r"u must lie in \[0, 1\)"),
    (torch.tensor([0.5, 0.5]), NAN, r"u must lie in \[0, 1\)"),
    (torch.tensor([0.5, 0.5]), -0.1, r"u must lie in \[0, 1\)"),
])
def test_systematic_indices_refuses_what_is_not_a_probability(p, u, message):
    with pytest.raises(ValueError, match=message):
        ev.systematic_indices(p, u)


def test_systematic_indices_with_nothing_to_keep_returns_no_index():
    """All-zero p (K = 0) used to raise ZeroDivisionError while removing the float drift."""
    assert ev.systematic_indices(torch.zeros(4), 0.5).tolist() == []
    assert ev.systematic_indices(torch.zeros(4), torch.tensor(0.25)).tolist() == []


@pytest.mark.parametrize("call, message", [
    (lambda: ev.recency(4, NAN), "lam must be a finite number"),
    (lambda: ev.recency(4, -1.0), "lam must be non-negative"),
    (lambda: ev.recency(-1), "n must be a positive int"),
    (lambda: ev.recency(2.0), "n must be a positive int"),
    (lambda: ev.value_aware_scores(torch.rand(1, 2, 3), torch.rand(3, 2), alpha=NAN), "alpha must be a finite"),
    (lambda: ev.value_aware_scores(torch.rand(1, 2, 3), torch.rand(3, 2), beta=True), "beta must be a finite"),
    (lambda: ev.value_aware_scores(torch.rand(1, 2, 3), torch.rand(3, 2), gamma="1"), "gamma must be a finite"),
    (lambda: ev.value_aware_scores(torch.rand(1, 2, 3), torch.rand(3, 2), lam=NAN), "lam must be a finite"),
    (lambda: ev.ValueAware(lam=NAN), "lam must be a finite number"),
    (lambda: ev.ValueAware(alpha=float("inf")), "alpha must be a finite number"),
    (lambda: ev.ValueAware(stochastic="yes"), "stochastic must be a bool"),
    (lambda: ev.LRU("a"), r"threshold must lie in \[0, 1\) or be None"),
    (lambda: ev.LRU(True), r"threshold must lie in \[0, 1\) or be None"),
    (lambda: ev.budget_for(10, "0.5"), r"evict_rate must lie in \[0, 1\)"),
    (lambda: ev.budget_for(10, False), r"evict_rate must lie in \[0, 1\)"),
    (lambda: ev.subset_loss(torch.rand(2, 4), torch.rand(5, 4), torch.rand(5, 3), [0.5, 1.7]),
     "keep must hold integer indices"),                                        # truncated to [0, 1] before
    (lambda: ev.optimal_subset(torch.rand(2, 4), torch.rand(5, 4), torch.rand(5, 3), 3, 1.5),
     r"protect must lie in \[0, budget=3\]"),
    (lambda: ev.optimal_subset(torch.rand(2, 4), torch.rand(5, 4), torch.rand(5, 3), 3, 0, max_subsets=0.5),
     "max_subsets must be a positive int"),
    (lambda: ev.value_norm_cv(torch.zeros(3, 4)), "values must not be all zero"),   # NaN before
    (lambda: ev.value_norm_cv(torch.tensor([[1.0, NAN], [1.0, 2.0]])), "values must be finite"),
    (lambda: ev.retention_frequencies("stochastic_keep", torch.rand(4), 2), "keep_fn must be callable"),
    (lambda: ev.retention_frequencies(ev.stochastic_keep, torch.rand(4), 2, seed=-1), "seed must be a non-negative"),
])
def test_public_functions_raise_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------------------------------
# Property-based tests of the samplers
# --------------------------------------------------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=30, deadline=None)
_SCORES = st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), min_size=1, max_size=40)


@_SETTINGS
@given(scores=_SCORES, frac=st.floats(0, 1), seed=st.integers(0, 2 ** 31))
def test_property_stochastic_keep_keeps_exactly_budget_never_a_zero_probability_item(scores, frac, seed):
    s = torch.tensor(scores, dtype=torch.float64)
    budget = max(1, round(frac * len(scores)))
    p = ev.inclusion_probabilities(s, budget)
    assert float(p.min()) >= 0 and float(p.max()) <= 1
    assert float(p.sum()) == pytest.approx(budget, abs=1e-9)
    kept = ev.stochastic_keep(s, budget, torch.Generator().manual_seed(seed))
    assert kept.numel() == budget and kept.unique().numel() == budget
    assert torch.equal(kept, torch.sort(kept).values)
    assert bool((p[kept] > 0).all()), "an item with probability 0 was kept"
    assert bool(torch.isin(torch.nonzero(p == 1).flatten(), kept).all()), "an item with probability 1 was dropped"


@_SETTINGS
@given(scores=_SCORES, frac=st.floats(0, 1), u=st.floats(0, 1, exclude_max=True))
def test_property_systematic_indices_keeps_exactly_k(scores, frac, u):
    s = torch.tensor(scores, dtype=torch.float64)
    budget = max(1, round(frac * len(scores)))
    p = ev.inclusion_probabilities(s, budget)
    idx = ev.systematic_indices(p, u)
    assert idx.numel() == budget and idx.unique().numel() == budget
    assert bool((p[idx] > 0).all()) and bool(torch.isin(torch.nonzero(p == 1).flatten(), idx).all())


@_SETTINGS
@given(n=st.integers(1, 20), at=st.integers(0, 19),
       bad=st.one_of(st.just(NAN), st.just(float("inf")), st.just(-float("inf")), st.floats(-10, -1e-9),
                     st.floats(1 + 1e-9, 10)))
def test_property_systematic_indices_refuses_bad_probabilities(n, at, bad):
    # float64: in float32 a "bad" 1 + 1e-9 rounds to exactly 1.0, a valid probability
    p = torch.full((n,), 0.5, dtype=torch.float64)
    p[at % n] = bad
    with pytest.raises(ValueError, match=r"p must hold probabilities in \[0, 1\]"):
        ev.systematic_indices(p, 0.5)


@_SETTINGS
@given(bad=st.one_of(st.just(NAN), st.just(float("inf")), st.floats(-10, -1e-9), st.floats(1, 10), st.booleans(),
                     st.text(max_size=2), st.none()))
def test_property_systematic_indices_refuses_bad_u(bad):
    with pytest.raises(ValueError, match=r"u must lie in \[0, 1\)"):
        ev.systematic_indices(torch.tensor([0.5, 0.5]), bad)


@_SETTINGS
@given(name=st.sampled_from(["alpha", "beta", "gamma", "lam"]),
       bad=st.one_of(st.just(NAN), st.just(float("inf")), st.just(-float("inf")), st.booleans(), st.text(max_size=2),
                     st.none()))
def test_property_value_aware_refuses_bad_exponents(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        ev.value_aware_scores(torch.rand(2, 3, 5), torch.rand(5, 4), **{name: bad})
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        ev.ValueAware(**{name: bad})


def test_systematic_indices_tiny_u_keeps_exactly_k():
    """Found by the property test: u = 4e-249 vanished in K - u (rounded to K), so the last item collected
    a point past the end and K + 1 items were kept."""
    for u in (4.3678048689438146e-249, 1e-300, 5e-324):
        assert ev.systematic_indices(torch.tensor([0.5, 0.5]), u).tolist() == [0]
        assert ev.systematic_indices(torch.tensor([0.25, 1.0, 0.75, 0.0, 1.0]), u).numel() == 3


@pytest.mark.parametrize("u", [0.0, 5e-324, 1e-300, 1e-17, 0.5, 1 - 1e-16])
def test_systematic_indices_keeps_k_when_an_edge_is_an_integer(u):
    """A capped p_i = 1 puts a cumulative edge exactly on an integer; with a vanishing u the floor-based count
    kept K - 1 items ([0] here, for K = 2). Every item of probability 1 must be kept, and exactly K in all."""
    p = torch.tensor([1.0, 0.4, 0.4, 0.2])
    got = ev.systematic_indices(p, u).tolist()
    assert len(got) == 2 and 0 in got
    q = torch.tensor([0.3, 1.0, 0.7, 1.0, 0.0, 1.0])
    got = ev.systematic_indices(q, u).tolist()
    assert len(got) == 4 and {1, 3, 5} <= set(got) and 4 not in got


def test_page_scores_refuses_a_non_tensor():
    pool = ev.PagedEvictionPool(num_pages=4, page_size=4)
    pool.append("a", 5)
    with pytest.raises(ValueError, match="token_scores must be a torch.Tensor"):
        pool.page_scores("a", [0.0] * 5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=0), "window must be None or a positive int"),
    (dict(window=2.5), "window must be None or a positive int"),
    (dict(window=True), "window must be None or a positive int"),
    (dict(threshold=float("nan")), "threshold must be a finite number"),
    (dict(threshold=-0.1), "threshold must be non-negative"),
    (dict(positions=torch.arange(3.0)), r"positions must be an integer tensor of shape \(4,\)"),
    (dict(positions=torch.arange(5)), r"positions must be an integer tensor of shape \(4,\)"),
])
def test_token_stats_from_attention_checks_its_arguments(kwargs, message):
    attn = torch.softmax(torch.randn(2, 3, 4, generator=gen(0)), -1)
    with pytest.raises(ValueError, match=message):
        ev.TokenStats.from_attention(attn, torch.ones(4, 2), **kwargs)
    with pytest.raises(ValueError, match="attn must be a torch.Tensor"):
        ev.TokenStats.from_attention(attn.tolist(), torch.ones(4, 2))
    with pytest.raises(ValueError, match="at least one query and one key"):
        ev.TokenStats.from_attention(torch.ones(2, 0, 4), torch.ones(4, 2))
