"""Speculative decoding (labsrc/speculative/): the rejection rule against chi-square tests at fixed seeds,
the theory against brute force, and generation against transformers' greedy and assisted generation."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labsrc import speculative as spec


def _rand_dist(g, *shape, sharp=1.0):
    return torch.softmax(sharp * torch.randn(*shape, generator=g, dtype=torch.float64), -1)


# ----------------------------------------------------------------------------- acceptance theory
def test_acceptance_is_one_minus_tv_and_sum_of_min():
    g = torch.Generator().manual_seed(0)
    p, q = _rand_dist(g, 5, 11), _rand_dist(g, 5, 11)
    a = spec.acceptance_rate(p, q)
    assert torch.allclose(a, 1 - spec.total_variation(p, q))
    assert torch.allclose(a, torch.stack([sum(min(x, y) for x, y in zip(pr, qr)) for pr, qr in zip(p, q)]))
    assert torch.allclose(spec.acceptance_rate(p, p), torch.ones(5, dtype=torch.float64))


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 30), st.floats(0.1, 5.0), st.integers(0, 10_000))
def test_pinsker_bound_holds_in_both_directions(v, sharp, seed):
    g = torch.Generator().manual_seed(seed)
    p, q = _rand_dist(g, v, sharp=sharp), _rand_dist(g, v, sharp=sharp)
    a = spec.acceptance_rate(p, q)
    assert a >= spec.pinsker_lower_bound(p, q) - 1e-12
    assert a >= spec.pinsker_lower_bound(q, p) - 1e-12


def test_one_minus_kl_without_the_square_root_is_not_a_bound():
    # Close distributions: TV ~ sqrt(KL / 2) exceeds KL, so alpha >= 1 - KL fails; Pinsker's form holds.
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.55, 0.45], dtype=torch.float64)
    a = spec.acceptance_rate(p, q)
    kl = spec.kl_divergence(p, q)
    assert a < 1 - kl
    assert a >= spec.pinsker_lower_bound(p, q)


def test_expected_tokens_and_speedup_against_series_and_brute_force():
    for alpha in (0.0, 0.3, 0.71, 0.9, 1.0):
        for k in (1, 4, 8):
            series = sum(alpha ** i for i in range(k + 1))
            assert math.isclose(spec.expected_tokens_per_step(alpha, k), series, rel_tol=1e-12)
            assert math.isclose(spec.speedup(alpha, k, 0.1), series / (0.1 * k + 1), rel_tol=1e-12)
    assert spec.expected_tokens_per_step(1.0, 4) == 5.0      # k + 1, not k
    for alpha, c in ((0.5, 0.05), (0.8, 0.02), (0.9, 0.2), (0.99, 0.0)):
        best = max(range(1, 33), key=lambda k: spec.speedup(alpha, k, c))
        assert spec.optimal_k(alpha, c) == best
    assert spec.optimal_k(0.999, 0.0, k_max=7) == 7           # k_max is inclusive


def test_adaptive_window_rule():
    assert [spec.adaptive_window(a) for a in (0.0, 0.25, 0.3, 0.55, 0.8, 0.89, 1.0)] == [2, 2, 3, 5, 8, 8, 8]


@pytest.mark.parametrize("fn,args,match", [
    (spec.expected_tokens_per_step, (1.2, 4), "alpha"),
    (spec.expected_tokens_per_step, (0.5, 0), "k must be >= 1"),
    (spec.speedup, (0.5, 4, -0.1), "c must be"),
    (spec.optimal_k, (0.5, 0.1, 0), "k_max"),
])
def test_theory_errors(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


# ----------------------------------------------------------------------------- verify
def test_first_emitted_token_has_the_target_distribution_chi_square():
    g = torch.Generator().manual_seed(1)
    V, k, B = 6, 3, 40_000
    p = _rand_dist(g, k + 1, V, sharp=1.5)
    q = _rand_dist(g, k, V, sharp=1.5)
    x = torch.multinomial(q, B, replacement=True, generator=g).T            # (B, k) drafts from q
    out, n = spec.verify_batch(x, q.expand(B, k, V), p.expand(B, k + 1, V), generator=g)
    counts = torch.bincount(out[:, 0], minlength=V)
    _, _, pval = spec.chi_square_test(counts, p[0])
    assert pval > 1e-3
    # second token, given the first was accepted, follows p_1
    second = out[n >= 1, 1]
    _, _, pval2 = spec.chi_square_test(torch.bincount(second, minlength=V), p[1])
    assert pval2 > 1e-3
    # a draft far from p is caught: the first drafted tokens alone do not follow p
    _, _, pval_q = spec.chi_square_test(torch.bincount(x[:, 0], minlength=V), p[0])
    assert pval_q < 1e-6


def test_accepted_count_follows_truncated_geometric():
    g = torch.Generator().manual_seed(2)
    V, k, B = 5, 4, 30_000
    p1, q1 = _rand_dist(g, V), _rand_dist(g, V)
    alpha = float(spec.acceptance_rate(p1, q1))
    p, q = p1.expand(k + 1, V), q1.expand(k, V)
    x = torch.multinomial(q1, B * k, replacement=True, generator=g).view(B, k)
    _, n = spec.verify_batch(x, q.expand(B, k, V), p.expand(B, k + 1, V), generator=g)
    theory = torch.tensor([alpha ** j * (1 - alpha) for j in range(k)] + [alpha ** k], dtype=torch.float64)
    _, _, pval = spec.chi_square_test(torch.bincount(n, minlength=k + 1), theory)
    assert pval > 1e-3
    assert abs(float(n.double().mean() + 1) - spec.expected_tokens_per_step(alpha, k)) < 0.05


def test_verify_single_matches_rule_and_lengths():
    g = torch.Generator().manual_seed(3)
    V, k = 7, 4
    p, q = _rand_dist(g, k + 1, V), _rand_dist(g, k, V)
    x = torch.multinomial(q, 1, generator=g)[:, 0]
    tokens, n = spec.verify(x, q, p, generator=g)
    assert tokens.shape == (n + 1,) and torch.equal(tokens[:n], x[:n])
    # identical draft and target: everything accepted, a bonus token follows
    tokens, n = spec.verify(x, p[:k], p, generator=g)
    assert n == k and tokens.shape == (k + 1,)


def test_greedy_verify_is_argmax_match():
    V, k = 9, 5
    g = torch.Generator().manual_seed(4)
    p, q = _rand_dist(g, k + 1, V), _rand_dist(g, k, V)
    arg = p.argmax(-1)
    x = arg[:k].clone()
    x[3] = (x[3] + 1) % V
    tokens, n = spec.verify(x, q, p, greedy=True)
    assert n == 3 and tokens.tolist() == arg[:4].tolist()
    tokens, n = spec.verify(arg[:k], q, p, greedy=True)
    assert n == k and tokens.tolist() == arg.tolist()


def test_verify_batch_different_lengths_padding():
    V = 4
    p = torch.eye(V, dtype=torch.float64)[[0, 1, 2]]                   # deterministic target 0, 1, 2
    q = torch.full((2, V), 1 / V, dtype=torch.float64)
    x = torch.tensor([[0, 1], [3, 1]])
    out, n = spec.verify_batch(x, q.expand(2, 2, V), p.expand(2, 3, V), generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [2, 0]
    assert out.tolist() == [[0, 1, 2], [0, -1, -1]]


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert torch.allclose(spec.residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(spec.residual_distribution(p, p), p)


@pytest.mark.parametrize("case,match", [
    ("not_dist", "not a distribution"),
    ("negative", "negative"),
    ("zero_q", "probability 0"),
    ("shape_t", "target_probs must have shape"),
    ("shape_q", "draft_probs must have shape"),
    ("range", "draft_tokens must be in"),
    ("float_tokens", "integer tensor"),
    ("nan", "non-finite"),
])
def test_verify_errors(case, match):
    V, k = 5, 3
    p = torch.full((k + 1, V), 1 / V)
    q = torch.full((k, V), 1 / V)
    x = torch.tensor([0, 1, 2])
    if case == "not_dist":
        p = p * 2
    elif case == "negative":
        q = q.clone(); q[0, 0] = -0.1; q[0, 1] += 0.1
    elif case == "zero_q":
        q = q.clone(); q[1, 1] = 0.0; q[1, 0] += 1 / V
    elif case == "shape_t":
        p = p[:k]
    elif case == "shape_q":
        q = torch.full((k + 1, V), 1 / V)
    elif case == "range":
        x = torch.tensor([0, 1, 5])
    elif case == "float_tokens":
        x = x.float()
    elif case == "nan":
        p = p.clone(); p[0, 0] = float("nan")
    err = TypeError if case == "float_tokens" else ValueError
    with pytest.raises(err, match=match):
        spec.verify(x, q, p)


def test_chi_square_test_p_values():
    # the chi-square survival function at known points (dof 1 and 4)
    _, dof, pv = spec.chi_square_test([60, 40], [0.5, 0.5])
    assert dof == 1 and abs(pv - 0.0455) < 1e-3
    _, dof, pv = spec.chi_square_test([20, 20, 20, 20, 20], [0.2] * 5)
    assert dof == 4 and pv == pytest.approx(1.0)


def test_warp_logits_top_p_matches_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g)
    for t, tp in ((1.0, 0.9), (0.7, 0.5), (1.3, 1.0)):
        ours = spec.warp_logits(logits, t, tp)
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if tp < 1:
            scores = TopPLogitsWarper(tp)(None, scores)
        theirs = torch.softmax(scores.double(), -1)
        assert torch.allclose(ours, theirs, atol=1e-9)


# ----------------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def lab_pair():
    from labsrc.models import load
    target, _ = load("lab-target")
    draft, _ = load("lab-draft")
    return target, draft


def _prompt_and_greedy(target, g, max_len, new_tokens=16):
    """A random prompt of 1..max_len tokens and the target's greedy continuation (the reference output)."""
    n = int(torch.randint(1, max_len + 1, (1,), generator=g))
    ids = torch.randint(2, target.config.vocab_size, (1, n), generator=g)
    return ids, target.generate(ids, max_new_tokens=new_tokens, do_sample=False)


def test_greedy_identity_with_target_generate(lab_pair):
    target, draft = lab_pair
    g = torch.Generator().manual_seed(6)
    for k in range(1, 9):
        ids, ref = _prompt_and_greedy(target, g, max_len=11)
        out, stats = spec.speculative_generate(target, draft, ids, 16, k=k)
        assert torch.equal(out, ref), k
        assert stats.new_tokens == 16 and stats.target_calls == len(stats.steps) <= 16
        assert all(s.accepted <= s.k for s in stats.steps)


def test_greedy_identity_adaptive_and_against_assisted_generation(lab_pair):
    target, draft = lab_pair
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        ids = torch.randint(2, target.config.vocab_size, (1, 9), generator=g)
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        hf = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
        out, stats = spec.speculative_generate(target, draft, ids, 20, window="adaptive")
        assert torch.equal(hf, ref) and torch.equal(out, ref)
        assert all(2 <= s.k <= 8 or s.k == 20 - sum(t.emitted for t in stats.steps[:i]) - 1
                   for i, s in enumerate(stats.steps))


def _tiny_llama(seed, vocab=8):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)      # peaked enough that draft and target differ visibly
    return model


def test_sampled_output_has_target_joint_distribution_chi_square():
    V, prompt = 6, torch.tensor([[1, 2, 3]])
    target, draft = _tiny_llama(0, V), _tiny_llama(1, V)
    with torch.no_grad():
        p1 = spec.warp_logits(target(prompt).logits[0, -1], 0.8)
        nxt = torch.cat([prompt.expand(V, 3), torch.arange(V)[:, None]], 1)
        p2 = spec.warp_logits(target(nxt).logits[:, -1], 0.8)
        q1 = spec.warp_logits(draft(prompt).logits[0, -1], 0.8)
    joint = (p1[:, None] * p2).flatten()
    assert float(spec.acceptance_rate(p1, q1)) < 0.95            # the draft really differs
    g = torch.Generator().manual_seed(8)
    counts = torch.zeros(V * V)
    n = 1000
    for _ in range(n):
        out, _ = spec.speculative_generate(target, draft, prompt, 2, k=2, do_sample=True, temperature=0.8,
                                           generator=g, stop_at_eos=False)
        counts[out[0, 3] * V + out[0, 4]] += 1
    _, _, pval = spec.chi_square_test(counts, joint)
    assert pval > 1e-3


def test_generate_errors(lab_pair):
    target, draft = lab_pair
    ids = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="window"):
        spec.speculative_generate(target, draft, ids, 4, window="dynamic")
    with pytest.raises(ValueError, match="k must be"):
        spec.speculative_generate(target, draft, ids, 4, k=0)
    with pytest.raises(TypeError, match="input_ids"):
        spec.speculative_generate(target, draft, ids.float(), 4)
    # temperature 0 is greedy under the shared sampling rule (test_sampling_at_a_tiny_temperature_is_greedy);
    # a negative or infinite one is refused
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            spec.speculative_generate(target, draft, ids, 4, do_sample=True, temperature=bad)


# ----------------------------------------------------------------------------- trees and self-speculation
def _tiny_llama_d16(seed, vocab=32, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


def test_tree_verify_of_a_chain_equals_a_causal_forward_with_the_kernel():
    from transformers import DynamicCache
    target = _tiny_llama_d16(0)
    prefix = torch.tensor([[3, 5, 7, 9]])
    chain = torch.tensor([11, 2, 4, 6])
    with torch.no_grad():
        full = target(torch.cat([prefix, chain[None]], 1)).logits[0, 4:]
        cache = DynamicCache(config=target.config)
        target(prefix, cache=cache, use_cache=True)
        tree = spec.tree_verify_logits(target, cache, chain, [-1, 0, 1, 2], 4)
    torch.testing.assert_close(tree, full, rtol=1e-4, atol=1e-4)
    # branches: node 2 is a sibling of node 1, so its logits equal those of a chain without node 1
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(prefix, cache=cache, use_cache=True)
        tree = spec.tree_verify_logits(target, cache, torch.tensor([11, 2, 4]), [-1, 0, 0], 4)
        alt = target(torch.cat([prefix, torch.tensor([[11, 4]])], 1)).logits[0, -1]
    torch.testing.assert_close(tree[2], alt, rtol=1e-4, atol=1e-4)


def test_tree_speculation_is_greedy_identical():
    target, draft = _tiny_llama_d16(0), _tiny_llama_d16(1, layers=1)
    ids = torch.tensor([[1, 2, 3]])
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    for b, use_kernel in ((1, False), (3, False), (2, True)):
        out, stats = spec.tree_speculative_generate(target, draft, ids, 10, k=3, branches=b, use_kernel=use_kernel,
                                                    stop_at_eos=False)
        assert torch.equal(out, ref), (b, use_kernel)
        assert stats.new_tokens == 10


def test_early_exit_draft_shares_the_body_and_is_greedy_identical(lab_pair):
    target, _ = lab_pair
    draft = spec.early_exit_draft(target, head=None)
    assert draft.model.layers[0] is target.model.layers[0] and len(draft.model.layers) == 3
    ids = torch.tensor([[5, 17, 300, 41]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    out, _ = spec.speculative_generate(target, draft, ids, 12, k=3)
    assert torch.equal(out, ref)
    # its logits are the exit head applied to the target's hidden state after 3 layers
    with torch.no_grad():
        h3 = target(ids, output_hidden_states=True).hidden_states[3]
        torch.testing.assert_close(draft(ids).logits, draft.lm_head(draft.model.norm(h3)))
    with pytest.raises(ValueError, match="layer"):
        spec.early_exit_draft(target, layer=6)


def test_acceptance_by_position_counts_reached_and_accepted():
    st = spec.SpecStats(steps=[
        spec.StepStats(k=3, drafted=3, accepted=1, emitted=2, draft_seconds=0, target_seconds=0,
                       accepted_mask=(True, False, False)),
        spec.StepStats(k=3, drafted=3, accepted=3, emitted=4, draft_seconds=0, target_seconds=0,
                       accepted_mask=(True, True, True)),
        spec.StepStats(k=2, drafted=2, accepted=0, emitted=1, draft_seconds=0, target_seconds=0,
                       accepted_mask=(False, False)),
    ])
    assert spec.acceptance_by_position(st, 3) == ([2, 1, 1], [3, 2, 1])


def test_plain_decode_and_shipped_exit_head(lab_pair):
    target, draft = lab_pair
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    out, times = spec.plain_decode(target, ids, 6)
    assert torch.equal(out, target.generate(ids, max_new_tokens=6, do_sample=False)) and len(times) == 6
    trained = spec.early_exit_draft(target)                  # the shipped head loads
    untrained = spec.early_exit_draft(target, head=None)
    assert not torch.equal(trained.lm_head.weight, untrained.lm_head.weight)
    a = spec.alpha_along(target, draft, torch.arange(2, 40))
    assert a.shape == (38,) and bool(((a >= 0) & (a <= 1 + 1e-9)).all())
    # several drafts with one target pass: the same numbers as one alpha_along per draft, and the
    # target's entropy, which is 0 where its next token is certain and at most log V
    many, entropy = spec.alpha_along_drafts(target, {"draft": draft, "exit": trained}, torch.arange(2, 40))
    torch.testing.assert_close(many["draft"], a, rtol=0, atol=1e-6)
    torch.testing.assert_close(many["exit"], spec.alpha_along(target, trained, torch.arange(2, 40)),
                               rtol=0, atol=1e-6)
    vocab = target.config.vocab_size
    assert entropy.shape == (38,) and bool(((entropy >= -1e-6) & (entropy <= math.log(vocab) + 1e-4)).all())


def test_draft_opd_keeps_greedy_output_and_leaves_the_draft_untouched():
    target, draft = _tiny_llama_d16(0), _tiny_llama_d16(1, layers=1)
    before = {n: p.clone() for n, p in draft.state_dict().items()}
    ids = torch.tensor([3, 1, 4, 1, 5])
    ref = target.generate(ids[None], max_new_tokens=12, do_sample=False)
    for update in (False, True):
        out, stats = spec.draft_opd_generate(target, draft, ids, 12, k=3, update=update, lr=1e-2)
        assert torch.equal(out, ref) and stats.new_tokens == 12
    assert all(torch.equal(p, before[n]) for n, p in draft.state_dict().items())


def test_adaptive_windows_follow_the_rule_except_where_the_budget_cuts(lab_pair):
    target, draft = lab_pair
    _, stats = spec.speculative_generate(target, draft, torch.tensor([[4, 9, 33, 70]]), 30, window="adaptive")
    assert stats.steps[-1].cut or stats.steps[-1].k >= 2
    assert all(2 <= s.k <= 8 for s in stats.steps if not s.cut)


# ----------------------------------------------------------------------------- self-speculation with one cache
def test_run_layers_in_two_halves_equals_the_full_forward():
    model = _tiny_llama_d16(11, vocab=32, layers=3)
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
        cache = spec._new_cache(model)
        model(ids[:, :5], cache=cache, use_cache=True)           # five positions cached in every layer
        low = spec.run_layers(model, model.model.embed_tokens(ids[:, 5:]), cache, 0, 1)
        assert cache.get_seq_length(0) == 9 and cache.get_seq_length(1) == 5   # layer 0 ran ahead
        high = spec.run_layers(model, low, cache, 1, 3)
    torch.testing.assert_close(low, ref[1][:, 5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.norm(high), ref[3][:, 5:], rtol=1e-5, atol=1e-5)
    assert all(cache.get_seq_length(i) == 9 for i in range(3))


def test_self_speculation_reuses_the_first_half_and_is_greedy_identical(lab_pair):
    target, _ = lab_pair
    g = torch.Generator().manual_seed(12)
    for k in range(1, 9):
        ids, ref = _prompt_and_greedy(target, g, max_len=19)
        with spec.count_layer_tokens(target) as shared:
            out, st = spec.self_speculative_generate(target, ids, 16, k=k)
        assert torch.equal(out, ref), k
        # one cache: every layer processed each position once, the prompt plus every verified window
        assert shared == [ids.shape[1] - 1 + sum(s.k + 1 for s in st.steps)] * 6
        assert st.draft_cache_bytes == 0 and st.target_cache_bytes > 0
        with spec.count_layer_tokens(target) as separate:
            out2, st2 = spec.speculative_generate(target, spec.early_exit_draft(target), ids, 16, k=k)
        assert torch.equal(out2, ref) and st2.accepted == st.accepted
        # a separate draft cache: the lower half runs again for the draft, the upper half does the same work
        assert separate[3:] == shared[3:] and all(a > b for a, b in zip(separate[:3], shared[:3]))
        assert st2.draft_cache_bytes > 0


def test_self_speculation_adaptive_and_untrained_head(lab_pair):
    target, _ = lab_pair
    ids = torch.tensor([[5, 17, 300, 41, 9, 9]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    for head, layer in (("shipped", None), (None, 2), (None, 5)):
        out, st = spec.self_speculative_generate(target, ids, 20, layer=layer, head=head, window="adaptive")
        assert torch.equal(out, ref), (head, layer)
    out, st = spec.self_speculative_generate(target, ids, 1, k=4)      # no room to draft: one verification
    assert torch.equal(out, ref[:, :7]) and st.drafted == 0 and st.target_calls == 1
    with pytest.raises(ValueError, match="layer"):
        spec.self_speculative_generate(target, ids, 4, layer=6)
    with pytest.raises(ValueError, match="window"):
        spec.self_speculative_generate(target, ids, 4, window="dynamic")


def _joint_chi_square(run, target, V, temperature=0.8, n=1000):
    """p-value of the joint law of two sampled tokens after the prompt [1, 2, 3] against the target's."""
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        p1 = spec.warp_logits(target(prompt).logits[0, -1], temperature)
        nxt = torch.cat([prompt.expand(V, 3), torch.arange(V)[:, None]], 1)
        p2 = spec.warp_logits(target(nxt).logits[:, -1], temperature)
    g = torch.Generator().manual_seed(9)
    counts = torch.zeros(V * V)
    for _ in range(n):
        out = run(prompt, g)
        counts[out[0, 3] * V + out[0, 4]] += 1
    return spec.chi_square_test(counts, (p1[:, None] * p2).flatten())[2]


def test_self_speculation_sampled_output_has_target_joint_distribution():
    V = 6
    target = _tiny_llama_d16(3, vocab=V, layers=2)
    exit_draft = spec.early_exit_draft(target, layer=1, head=None)
    with torch.no_grad():
        prompt = torch.tensor([[1, 2, 3]])
        p1 = spec.warp_logits(target(prompt).logits[0, -1], 0.8)
        q1 = spec.warp_logits(exit_draft(prompt).logits[0, -1], 0.8)
    assert float(spec.acceptance_rate(p1, q1)) < 0.95            # the exit really differs
    pval = _joint_chi_square(lambda ids, g: spec.self_speculative_generate(
        target, ids, 2, k=2, layer=1, head=None, do_sample=True, temperature=0.8, generator=g,
        stop_at_eos=False)[0], target, V)
    assert pval > 1e-3


# ----------------------------------------------------------------------------- a quantized draft cache
def test_quantized_draft_cache_keeps_greedy_output_and_stores_less(lab_pair):
    from labsrc.kv_quant import KVarNCache
    target, draft = lab_pair
    g = torch.Generator().manual_seed(13)
    for k, window in ((4, "fixed"), (8, "fixed"), (4, "adaptive")):
        ids = torch.randint(2, target.config.vocab_size, (1, 40), generator=g)
        ref = target.generate(ids, max_new_tokens=16, do_sample=False)
        _, full = spec.speculative_generate(target, draft, ids, 16, k=k, window=window)
        out, st = spec.speculative_generate(target, draft, ids, 16, k=k, window=window,
                                            draft_cache=lambda m: KVarNCache.per_token(m.config, bits=2, window=8))
        assert torch.equal(out, ref), (k, window)
        assert 0 < st.draft_cache_bytes < full.draft_cache_bytes / 4      # 2-bit codes beside fp32 keys
        assert st.target_cache_bytes == full.target_cache_bytes


def test_quantized_draft_cache_sampled_output_has_target_joint_distribution():
    from labsrc.kv_quant import KVarNCache
    V = 6
    target, draft = _tiny_llama(0, V), _tiny_llama(1, V)
    pval = _joint_chi_square(lambda ids, g: spec.speculative_generate(
        target, draft, ids, 2, k=2, do_sample=True, temperature=0.8, generator=g, stop_at_eos=False,
        draft_cache=lambda m: KVarNCache.per_token(m.config, bits=2, window=1))[0], target, V)
    assert pval > 1e-3


def test_quantized_draft_cache_errors(lab_pair):
    from labsrc.kv_quant import KVarNCache
    target, draft = lab_pair
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="window >= 3"):
        spec.speculative_generate(target, draft, ids, 8, k=4,
                                  draft_cache=lambda m: KVarNCache.per_token(m.config, bits=4, window=2))
    with pytest.raises(ValueError, match="window >= 7"):
        spec.speculative_generate(target, draft, ids, 8, window="adaptive",
                                  draft_cache=lambda m: KVarNCache.per_token(m.config, bits=4, window=4))
    with pytest.raises(TypeError, match="draft_cache"):
        spec.speculative_generate(target, draft, ids, 8, draft_cache="int4")
    with pytest.raises(TypeError, match="draft_cache"):
        spec.speculative_generate(target, draft, ids, 8, draft_cache=lambda m: None)


def test_alpha_with_draft_cache_moves_by_at_most_the_total_variation(lab_pair):
    from labsrc.kv_quant import KVarNCache
    target, draft = lab_pair
    ids = torch.randint(2, target.config.vocab_size, (60,), generator=torch.Generator().manual_seed(14))
    # a full-precision cache changes nothing (decoding one token at a time = one forward, to rounding)
    a_fp, a_full, tv_fp = spec.alpha_with_draft_cache(target, draft, ids, spec._new_cache, n_decode=20)
    torch.testing.assert_close(a_fp, a_full, rtol=0, atol=1e-4)
    assert float(tv_fp.max()) < 1e-4 and a_fp.shape == (20,)
    torch.testing.assert_close(a_full, spec.alpha_along(target, draft, ids)[-20:], rtol=0, atol=1e-5)
    for bits in (4, 2):
        a_q, a_full, tv = spec.alpha_with_draft_cache(
            target, draft, ids, lambda m: KVarNCache.per_token(m.config, bits=bits, window=4), n_decode=20)
        assert float(tv.mean()) > 1e-4                                   # the cache really moved the draft
        assert bool(((a_q - a_full).abs() <= tv + 1e-6).all())           # and the acceptance moved less
    with pytest.raises(ValueError, match="n_decode"):
        spec.alpha_with_draft_cache(target, draft, ids, spec._new_cache, n_decode=60)
    with pytest.raises(TypeError, match="draft_cache"):
        spec.alpha_with_draft_cache(target, draft, ids, "int4")


# ----------------------------------------------------------------------------- the draft's cache projected from the target's
def test_kv_projection_of_a_model_onto_itself_recovers_its_cache(lab_pair):
    target, _ = lab_pair
    g = torch.Generator().manual_seed(15)
    fit = [torch.randint(2, target.config.vocab_size, (120,), generator=g) for _ in range(12)]
    proj = spec.fit_kv_projection(target, target, fit, ridge=1e-9)
    assert proj.r2 > 0.9999 and proj.n_positions == 12 * 120
    ids = torch.randint(2, target.config.vocab_size, (1, 77), generator=g)
    tc = spec._new_cache(target)
    spec._forward(target, ids, tc)
    pc = proj.draft_cache(target, target, tc)
    assert pc.get_seq_length() == 77
    for a, b in zip(tc.layers, pc.layers):        # keys re-rotated to their positions, values as they were
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=2e-2)
        torch.testing.assert_close(b.values, a.values, rtol=0, atol=2e-2)


def test_cache_features_undo_the_rotation():
    model = _tiny_llama_d16(16, vocab=32, layers=2)
    ids = torch.randint(0, 32, (1, 11), generator=torch.Generator().manual_seed(3))
    cache = spec._new_cache(model)
    spec._forward(model, ids, cache)
    feats = spec.cache_features(model, cache)
    assert feats.shape == (11, 2 * 2 * 1 * 16)
    # the un-rotated key of layer 0 is k_proj of the normalised embedding, whatever the position
    with torch.no_grad():
        attn = model.model.layers[0]
        h = attn.input_layernorm(model.model.embed_tokens(ids))
        k = attn.self_attn.k_proj(h)[0]
    torch.testing.assert_close(feats[:, :16], k, rtol=1e-5, atol=1e-5)


def test_kv_projection_keeps_greedy_output_and_nearly_keeps_alpha(lab_pair):
    target, draft = lab_pair
    g = torch.Generator().manual_seed(17)
    fit = [torch.randint(2, target.config.vocab_size, (150,), generator=g) for _ in range(16)]
    proj = spec.fit_kv_projection(target, draft, fit)
    assert 0.3 < proj.r2 < 1.0
    ids = torch.randint(2, target.config.vocab_size, (1, 60), generator=g)
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    with spec.count_layer_tokens(draft) as counts:
        out, st = spec.speculative_generate(target, draft, ids, 16, k=4, kv_projection=proj)
    assert torch.equal(out, ref)
    assert counts[0] <= sum(s.k + 1 for s in st.steps) < 59     # the prompt never went through the draft
    a_p, a_full, _ = spec.alpha_with_draft_cache(target, draft, ids[0], n_decode=20, kv_projection=proj)
    a_c, _, _ = spec.alpha_with_draft_cache(target, draft, ids[0], n_decode=20)
    assert abs(float(a_p.mean()) - float(a_c.mean())) < 0.1
    # the controls: the draft reading no prefix, or another text's, is not the draft reading this one
    a_none, a_same, _ = spec.alpha_with_draft_cache(target, draft, ids[0], n_decode=20,
                                                    draft_prefix=torch.zeros(0, dtype=torch.long))
    torch.testing.assert_close(a_same, a_full)
    assert not torch.allclose(a_none, a_c)
    a_own, _, _ = spec.alpha_with_draft_cache(target, draft, ids[0], n_decode=20, draft_prefix=ids[0, :40])
    torch.testing.assert_close(a_own, a_c)                 # its own prefix, passed explicitly: the same
    with pytest.raises(ValueError, match="not both"):
        spec.alpha_with_draft_cache(target, draft, ids[0], kv_projection=proj, draft_prefix=ids[0, :4])
    with pytest.raises(ValueError, match="not both"):
        spec.speculative_generate(target, draft, ids, 4, kv_projection=proj, draft_cache=spec._new_cache)
    with pytest.raises(TypeError, match="kv_projection"):
        spec.speculative_generate(target, draft, ids, 4, kv_projection="linear")
    dc = spec._new_cache(draft)
    spec._forward(draft, ids, dc)
    with pytest.raises(ValueError, match="another target"):
        proj.draft_cache(draft, draft, dc)
    assert proj.draft_cache(target, draft, spec._new_cache(target)).get_seq_length() == 0
    with pytest.raises(ValueError, match="sequences"):
        spec.fit_kv_projection(target, draft, [])


def test_sampling_at_a_tiny_temperature_is_greedy(lab_pair):
    """speculative_generate(do_sample=True) at temperature 1e-300 (and at 0, greedy by the shared rule) gives
    the target's greedy tokens; it used to die in torch.multinomial on NaN probabilities."""
    target, draft = lab_pair
    g = torch.Generator().manual_seed(11)
    ids, ref = _prompt_and_greedy(target, g, max_len=9, new_tokens=10)
    for t in (1e-300, 0.0):
        out, _ = spec.speculative_generate(target, draft, ids, 10, k=3, do_sample=True, temperature=t,
                                           generator=torch.Generator().manual_seed(0))
        assert torch.equal(out, ref), t


# ----------------------------------------------------------------------------- prompt lookup
def test_lookup_draft_takes_the_most_recent_match_then_shorter_ngrams():
    # "1 2" occurs at 0 and at 4: the most recent earlier one (4) wins, and what followed it is proposed
    assert spec.lookup_draft([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3, ngram=2) == [5, 6, 1]
    assert spec.lookup_draft([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 8, ngram=2) == [5, 6, 1, 2]   # up to the end
    # no earlier "9 2": with min_ngram=1 the 1-gram "2" matches instead (the default, 2, drafts nothing)
    assert spec.lookup_draft([1, 2, 3, 4, 9, 2], 2, ngram=2) == []
    assert spec.lookup_draft([1, 2, 3, 4, 9, 2], 2, ngram=2, min_ngram=1) == [3, 4]
    # the 3-gram matches and beats the more recent 1-gram match
    assert spec.lookup_draft([7, 8, 9, 1, 5, 9, 7, 8, 9], 2, ngram=3) == [1, 5]
    assert spec.lookup_draft([1, 2, 3], 4, ngram=3) == []          # nothing repeats: no draft
    assert spec.lookup_draft(torch.tensor([4]), 4) == []            # a single token has no earlier context
    with pytest.raises(ValueError, match="k must be"):
        spec.lookup_draft([1, 2, 1], 0)
    with pytest.raises(ValueError, match="ngram must be"):
        spec.lookup_draft([1, 2, 1], 2, ngram=0)
    with pytest.raises(ValueError, match="context must be"):
        spec.lookup_draft(torch.tensor([[1, 2, 1]]), 2)


def test_one_hot_draft_residual_is_the_target_without_the_drafted_token():
    p = torch.tensor([0.1, 0.5, 0.3, 0.1])
    q = torch.nn.functional.one_hot(torch.tensor(1), 4).float()
    assert torch.allclose(spec.residual_distribution(p, q), torch.tensor([0.2, 0.0, 0.6, 0.2]))
    # accepted with probability p(x): 0.5 here, over seeded draws
    g, n = torch.Generator().manual_seed(11), 4000
    out, acc = spec.verify_batch(torch.ones(n, 1, dtype=torch.long), q.expand(n, 1, 4), p.expand(n, 2, 4),
                                 generator=g)
    assert abs(acc.float().mean() - 0.5) < 4 * math.sqrt(0.25 / n)
    # and the first emitted token has the target's distribution
    assert spec.chi_square_test(torch.bincount(out[:, 0], minlength=4), p)[2] > 1e-3


def _pl_prompts(vocab):
    """Prompts for prompt lookup: two that repeat a span (drafts exist from the first cycle) and two whose
    tokens are all distinct (the first cycle finds no match and is a plain target step)."""
    g = torch.Generator().manual_seed(12)
    span = torch.randperm(vocab, generator=g)[:7] + 0
    rep = [torch.cat([span, span[:3]]), torch.cat([span[:5], span[2:], span[:2]])]
    plain = [torch.randperm(vocab, generator=g)[:n] for n in (3, 9)]
    return [(p[None], True) for p in rep] + [(p[None], False) for p in plain]


def test_prompt_lookup_is_greedy_identical_to_generate_and_to_transformers_prompt_lookup():
    target = _tiny_llama_d16(13, vocab=32, layers=2)
    accepted = 0
    for ids, repeats in _pl_prompts(32):
        ref = target.generate(ids, max_new_tokens=16, do_sample=False)
        hf = target.generate(ids, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4,
                             max_matching_ngram_size=2)
        for k, ngram, min_ngram in ((2, 1, 1), (8, 3, 1), (8, 3, 2), (4, 2, 2)):
            out, stats = spec.prompt_lookup_generate(target, ids, 16, k=k, ngram=ngram, min_ngram=min_ngram)
            assert torch.equal(out, ref) and torch.equal(hf, ref), (ids, k)
            assert stats.new_tokens == 16 and stats.draft_calls == 0
            assert stats.target_calls == len(stats.steps) <= 16
            assert all(s.accepted <= s.drafted <= s.k for s in stats.steps)
            assert (stats.steps[0].drafted > 0) == repeats       # no repeat in the prompt: a plain step
            accepted += stats.accepted
    assert accepted > 0                                            # drafts were accepted, not only tried


def test_prompt_lookup_sampled_output_has_target_joint_distribution():
    V = 4
    target = _tiny_llama_d16(14, vocab=V, layers=1)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])   # "1 2" repeats: the first cycle drafts [3, 1]
    with torch.no_grad():
        p1 = spec.warp_logits(target(prompt).logits[0, -1], 0.8)
        two = torch.cat([prompt.expand(V, 5), torch.arange(V)[:, None]], 1)
        p2 = spec.warp_logits(target(two).logits[:, -1], 0.8)
        three = torch.cat([two.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3 = spec.warp_logits(target(three).logits[:, -1], 0.8)
    joint = (p1[:, None, None] * p2.view(V, V)[:, :, None] * p3.view(V, V, V)).flatten()
    g = torch.Generator().manual_seed(15)
    counts, n, acc, rej = torch.zeros(V ** 3), 1000, 0, 0
    for _ in range(n):
        out, st = spec.prompt_lookup_generate(target, prompt, 3, k=2, ngram=2, do_sample=True,
                                              temperature=0.8, generator=g, stop_at_eos=False)
        a, b, c = out[0, 5:].tolist()
        counts[(a * V + b) * V + c] += 1
        acc += st.accepted
        rej += st.drafted - st.accepted
    assert acc > 50 and rej > 50                   # both branches of the rule were exercised
    assert spec.chi_square_test(counts, joint)[2] > 1e-3


def test_prompt_lookup_errors():
    target = _tiny_llama_d16(13, vocab=32, layers=1)
    ids = torch.tensor([[5, 6, 5]])
    with pytest.raises(ValueError, match="k must be"):
        spec.prompt_lookup_generate(target, ids, 4, k=0)
    with pytest.raises(ValueError, match="ngram must be"):
        spec.prompt_lookup_generate(target, ids, 4, ngram=0)
    with pytest.raises(TypeError, match="ngram must be"):
        spec.prompt_lookup_generate(target, ids, 4, ngram=2.0)
    with pytest.raises(TypeError, match="input_ids"):
        spec.prompt_lookup_generate(target, ids.float(), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.prompt_lookup_generate(target, ids, -1)
    with pytest.raises(ValueError, match="temperature"):
        spec.prompt_lookup_generate(target, ids, 4, do_sample=True, temperature=-1.0)
    with pytest.raises(ValueError, match="min_ngram must be >= 1"):
        spec.prompt_lookup_generate(target, ids, 4, min_ngram=0)
    with pytest.raises(TypeError, match="min_ngram must be"):
        spec.prompt_lookup_generate(target, ids, 4, min_ngram=1.5)
    with pytest.raises(ValueError, match="min_ngram must be <= ngram"):
        spec.prompt_lookup_generate(target, ids, 4, ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="window must be"):
        spec.prompt_lookup_generate(target, ids, 4, window="auto")
    with pytest.raises(ValueError, match="min_ngram must be <= ngram"):
        spec.lookup_draft([5, 6, 5], 4, ngram=1, min_ngram=2)


def test_lookup_draft_min_ngram_refuses_short_matches():
    ctx = [7, 1, 2, 9, 4, 1, 2, 3, 8, 9]          # the last token, 9, occurs once before: a 1-token match
    assert spec.lookup_draft(ctx, 3, ngram=3, min_ngram=1) == [4, 1, 2]
    assert spec.lookup_draft(ctx, 3, ngram=3, min_ngram=2) == []
    ctx2 = [5, 1, 2, 6, 0, 1, 2]                  # "1 2" repeats: a 2-token match, no 3-token one
    assert spec.lookup_draft(ctx2, 2, ngram=3, min_ngram=2) == [6, 0]
    assert spec.lookup_draft(ctx2, 2, ngram=3, min_ngram=3) == []
    ctx3 = [4, 1, 2, 3, 7, 5, 1, 2, 3]            # the full 3-gram matches at its most recent occurrence
    assert spec.lookup_draft(ctx3, 2, ngram=3, min_ngram=3) == [7, 5]


def test_prompt_lookup_min_ngram_drafts_nothing_from_one_token_match_and_stays_exact():
    target = _tiny_llama_d16(13, vocab=32, layers=2)
    ids = torch.tensor([[3, 11, 20, 8, 11]])   # only the last token, 11, repeats
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    _, st1 = spec.prompt_lookup_generate(target, ids, 12, k=4, ngram=3, min_ngram=1)
    assert st1.steps[0].drafted > 0            # the default of transformers: a 1-token match drafts
    for window in ("fixed", "adaptive"):
        out, st2 = spec.prompt_lookup_generate(target, ids, 12, k=4, ngram=3, min_ngram=2, window=window)
        assert st2.steps[0].drafted == 0       # min_ngram=2: the first cycle is a plain target step
        assert torch.equal(out, ref)
        assert all(s.drafted <= s.k <= 4 for s in st2.steps)


def test_prompt_lookup_on_lab_target_quoting_and_prose(lab_pair):
    from labsrc.models import load
    target, _ = lab_pair
    _, tok = load("lab-target")
    for task in ("passage", "prose"):
        for ids in spec.task_prompts(tok, task, 2, 96, seed=16):
            ids = ids[None]
            ref = target.generate(ids, max_new_tokens=24, do_sample=False)
            hf = target.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=8,
                                 max_matching_ngram_size=3)
            out, stats = spec.prompt_lookup_generate(target, ids, 24, k=8, ngram=3)
            assert torch.equal(out, ref) and torch.equal(hf, ref), task
            assert stats.target_calls <= 24
