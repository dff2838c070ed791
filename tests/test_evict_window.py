"""Why value-aware eviction plateaus on chapter 6's curve (issue 45, item 2): its score reads the attention of the
last W queries only (the source's rule, 10.3.9), so a token older than the window that only nearby queries read
scores near zero and is dropped even at light eviction, by the draw and by top-K alike; a window that covers
those queries keeps it. The lab's implementation follows the rule; this pins the behaviour the chapter explains."""
import torch

from labsrc import evict as ev


def local_attention(n: int, key: int) -> torch.Tensor:
    """(1, n, n) causal rows in which every query reads itself and the token before it and spreads a little over
    the rest of its past, except ``key``, which only the query right after it reads (most of that query's
    attention): the pattern of prose queries around a pass key that no later query has asked for yet."""
    a = torch.zeros(1, n, n)
    for t in range(n):
        a[0, t, t] = 0.5
        a[0, t, max(t - 1, 0)] += 0.3
        rest = [j for j in range(t - 1) if j != key]
        if rest:
            a[0, t, rest] += 0.2 / len(rest)
        else:
            a[0, t, t] += 0.2
    a[0, key + 1] = 0.0
    a[0, key + 1, key] = 0.9
    a[0, key + 1, key + 1] = 0.1
    return a


def kept_after(policy: ev.EvictionPolicy, stats: ev.TokenStats, budget: int) -> set:
    return set(policy.select(stats, budget, generator=torch.Generator().manual_seed(0)).tolist())


def test_a_token_read_only_before_the_window_is_dropped_at_light_eviction_by_draw_and_top_k():
    n, window, key = 64, 16, 10                  # the key is read by query 11, far before the window
    values = torch.ones(n, 4)
    attn = local_attention(n, key)
    # the statistics a cache keeps for a policy reading the last `window` queries
    stats = ev.TokenStats.from_attention(attn, values, window=window)
    budget = n - 4                               # light eviction: four tokens go
    for stochastic in (True, False):
        policy = ev.ValueAware(window=window, stochastic=stochastic, recent=0)
        assert key not in kept_after(policy, stats, budget), f"stochastic={stochastic}"
    # A window that covers the query right after the key keeps it (its score is no longer ~0).
    wide = ev.TokenStats.from_attention(attn, values, window=n)
    for stochastic in (True, False):
        policy = ev.ValueAware(window=n, stochastic=stochastic, recent=0)
        assert key in kept_after(policy, wide, budget), f"stochastic={stochastic}"
    # H2O's statistic counts every query since a token arrived: it keeps the key too.
    assert key in kept_after(ev.H2O(recent=0), stats, budget)


def test_the_window_score_of_a_token_older_than_the_window_is_what_the_window_pays_it():
    n, window, key = 64, 16, 10
    attn = local_attention(n, key)
    s = ev.value_aware_scores(attn[:, n - window:, :], torch.ones(n, 4))
    assert float(s[key]) == 0.0                   # no query of the window reads it
    assert float(s[n - 2]) > 0.0                  # a token inside the window is read
