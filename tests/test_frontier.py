"""The frontier chapter's from-scratch pieces: differential attention (against the direct formula, lambda = 0
gives ordinary attention), the lambda schedule and re-parameterisation, Mixture-of-Depths routing (exact
capacity, tie-breaking, causality of the predictor route), cross-layer KV bytes against kvmath and against the
tensors a model keeps, INT8 Q/K attention, and the registered recall variants."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labsrc  # noqa: F401
from labsrc import frontier as fr
from labsrc import kv_cache, recall
from labsrc.kernels.flash_attention import flash_attention


def qkv(B, H, T, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(5)]


def test_lambda_init_schedule():
    assert fr.lambda_init(1) == pytest.approx(0.2)
    assert fr.lambda_init(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert fr.lambda_init(100) == pytest.approx(0.8, abs=1e-9)
    vals = [fr.lambda_init(layer) for layer in range(1, 30)]
    assert all(a < b for a, b in zip(vals, vals[1:]))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="layer"):
            fr.lambda_init(bad)


def test_reparam_lambda():
    z = torch.zeros(3, 8)
    assert torch.allclose(fr.reparam_lambda(z, z, z, z, 0.35), torch.full((3,), 0.35))
    a = torch.full((2, 4), 0.5)
    want = math.exp(4 * 0.25) - math.exp(0.0) + 0.2
    assert torch.allclose(fr.reparam_lambda(a, a, z[:2, :4], z[:2, :4], 0.2), torch.full((2,), want))
    with pytest.raises(ValueError, match="lk1"):
        fr.reparam_lambda(a, z, a, a, 0.2)


def test_diff_attention_on_flash_attention_equals_the_formula():
    q1, k1, q2, k2, v = qkv(2, 3, 21, 16, 0)
    lam = torch.tensor([0.2, 0.5, 0.9])
    got = fr.diff_attention(q1, k1, q2, k2, v, lam)
    want = fr.diff_attention_ref(q1, k1, q2, k2, v, lam)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # lambda = 0 is ordinary causal attention (chapter 3's kernel and PyTorch's SDPA)
    zero = fr.diff_attention(q1, k1, q2, k2, v, 0.0)
    torch.testing.assert_close(zero, flash_attention(q1, k1, v, causal=True), rtol=0, atol=0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q1, k1, v, is_causal=True)
    torch.testing.assert_close(zero, sdpa, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head dim"):
        fr.diff_attention(q1, k1, q2, k2, torch.randn(2, 3, 21, 32), lam)


def test_diff_attention_is_differentiable():
    q1, k1, q2, k2, v = (t.requires_grad_() for t in qkv(1, 2, 9, 16, 1))
    fr.diff_attention(q1, k1, q2, k2, v, 0.4).square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q1, k1, q2, k2, v))


def test_common_mode_noise_cancels():
    """Two maps that share the same noise and differ only on the needle: the difference keeps the needle's
    weight and removes the shared part (the mechanism the chapter shows)."""
    T, D = 12, 16
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(1, 1, T, D, generator=g)
    q = torch.randn(1, 1, T, D, generator=g)
    _, a1, a2 = fr.diff_attention_ref(q, noise, q, noise, noise, 1.0, return_maps=True)
    assert torch.allclose(a1 - a2, torch.zeros_like(a1))


def test_diff_head_norm():
    o = torch.randn(2, 3, 5, 32) * 7
    y = fr.diff_head_norm(o, 0.2)
    rms = y.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.full_like(rms, 0.8), atol=1e-4)


def test_mod_capacity_count():
    assert fr.mod_capacity_count(10, 0.5) == 5
    assert fr.mod_capacity_count(5, 0.5) == 3          # 2.5 rounds up
    assert fr.mod_capacity_count(7, 0.125) == 1        # 0.875 rounds to 1
    assert fr.mod_capacity_count(3, 0.01) == 1         # at least one
    assert fr.mod_capacity_count(9, 1.0) == 9
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="capacity"):
            fr.mod_capacity_count(8, bad)
    with pytest.raises(ValueError, match="T must"):
        fr.mod_capacity_count(0, 0.5)


def test_mod_route_top_scores_ties_and_order():
    s = torch.tensor([[0.1, 0.9, 0.5, 0.9, 0.2, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    idx = fr.mod_route(s, 0.5)
    assert idx.tolist() == [[1, 2, 3], [0, 1, 2]]      # ties go to the earlier position; sorted by position
    assert fr.mod_route(s, 0.34).tolist() == [[1, 3], [0, 1]]
    with pytest.raises(ValueError, match="scores"):
        fr.mod_route(torch.ones(6), 0.5)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 30), cap=st.floats(0.01, 1.0), seed=st.integers(0, 10**6))
def test_property_mod_route_against_brute_force(B, T, cap, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 4, (B, T), generator=g).float()      # small integers: many ties
    idx = fr.mod_route(s, cap)
    k = max(1, math.floor(cap * T + 0.5))
    assert idx.shape == (B, k)
    for row, got in zip(s.tolist(), idx.tolist()):
        want = sorted(sorted(range(T), key=lambda t: (-row[t], t))[:k])
        assert got == want


def test_mod_flops_fraction():
    assert fr.mod_flops_fraction(0.5, 72) == 0.5
    assert fr.mod_flops_fraction(0.125, 8) == 0.125


def test_shared_kv_bytes_against_kvmath_and_a_model():
    shared, frac = fr.shared_kv_bytes(32, 2, 8, 128, 4096)
    assert shared == kv_cache.kv_cache_bytes(16, 8, 128, 4096) and frac == 0.5
    assert fr.shared_kv_bytes(3, 2, 1, 16, 10)[1] == pytest.approx(2 / 3)
    # measured: the tensors an xkv pair keeps are the bytes kvmath counts for one layer's K/V (fp32)
    model = recall.RecallModel(50, 32, ("xkv", "xkv", "xkv", "xkv"), head_dim=16)
    ids = torch.randint(0, 50, (1, 24))
    with torch.no_grad():
        model.hidden(ids)
    k, v = model.blocks[0].mixer.shared["kv"]
    kept = (k.numel() + v.numel()) * k.element_size()
    assert kept * 2 == kv_cache.mlkv_cache_bytes(4, 2, 2, 16, 24, dtype_bytes=4)   # two owners in 4 layers
    assert model.memory_bytes(24) == kv_cache.mlkv_cache_bytes(4, 2, 2, 16, 24, dtype_bytes=4)
    assert model.blocks[1].mixer.kv is None and model.blocks[1].mixer.memory_bytes(24) == 0


def test_int8_qk_attention_error_and_smoothing():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 64, 32, generator=g) for _ in range(3))
    k = k + 4.0                                   # a large common offset on every key channel
    k[..., 5] *= 20                               # and an outlier channel
    exact = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(32)).masked_fill(
        torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf), -1) @ v
    smooth = fr.relative_error(fr.int8_qk_attention(q, k, v), exact)
    plain = fr.relative_error(fr.int8_qk_attention(q, k, v, smooth=False), exact)
    assert smooth < 0.02 and smooth < plain
    # smoothing leaves q k^T unchanged up to a per-row constant (so the softmax is unchanged)
    qs, ks = fr.smooth_qk(q, k)
    diff = q @ k.transpose(-1, -2) - qs @ ks.transpose(-1, -2)
    assert torch.allclose(diff - diff[..., :1], torch.zeros_like(diff), atol=1e-3)


def test_diff_mixer_parameters_and_causality():
    soft = recall.MIXERS["softmax"](32, 16)
    diff = recall.MIXERS["diff"](32, 16)
    n = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
    assert n(diff) - n(soft) == diff.lam.numel() + diff.norm_weight.numel()   # same projections
    model = recall.RecallModel(40, 32, ("diff", "diff"), head_dim=16)
    assert model.blocks[1].mixer.lam_init == pytest.approx(fr.lambda_init(2))
    ids = torch.randint(0, 40, (2, 15))
    ids2 = ids.clone()
    ids2[:, 10:] = (ids2[:, 10:] + 1) % 40
    with torch.no_grad():
        assert torch.allclose(model.hidden(ids)[:, :10], model.hidden(ids2)[:, :10], atol=1e-5)


def test_mod_block_routes_and_predictor_route_is_causal():
    torch.manual_seed(0)
    model = recall.RecallModel(40, 32, ("mod", "softmax"), head_dim=16)
    ids = torch.randint(0, 40, (3, 16))
    model.train()
    model.hidden(ids)
    assert model.blocks[0].routed_fraction == 0.5 and model.aux_loss() > 0
    model.eval()
    fr.set_mod_routing(model, True)
    ids2 = ids.clone()
    ids2[:, 9:] = (ids2[:, 9:] + 1) % 40
    with torch.no_grad():
        assert torch.allclose(model.hidden(ids)[:, :9], model.hidden(ids2)[:, :9], atol=1e-5)
    assert model.memory_bytes(16) < recall.RecallModel(40, 32, ("softmax", "softmax")).memory_bytes(16)


def test_variant_flops():
    std = fr.variant_flops_per_token("standard", 32, 72)
    assert fr.variant_flops_per_token("mod", 32, 72) < 0.5 * std
    assert fr.variant_flops_per_token("xkv", 32, 72) < std < fr.variant_flops_per_token("diff", 32, 72)


def test_prefetch_hit_rate_and_most_frequent_baseline():
    actual = torch.tensor([[0, 1], [2, 3], [1, 0], [1, 2]])
    predicted = torch.tensor([[1, 5], [3, 2], [7, 6], [1, 1]])
    assert fr.prefetch_hit_rate(predicted, actual) == (1 + 2 + 0 + 1, 8)
    assert fr.most_frequent_experts(actual, 8, 2).tolist() == [1, 0]     # 1 three times; 0 and 2 tie: lower id
    with pytest.raises(ValueError, match="same N"):
        fr.prefetch_hit_rate(predicted[:3], actual)


def test_routing_reads_the_routers_transformers_runs():
    """The experts `routing_and_predictions` reports as used are the top-k of the router on the very input
    Mixtral's forward gives it (captured with a hook); the prediction uses the same router weights."""
    model = fr.tiny_moe(60, hidden=32, layers=3, experts=4, top_k=2).eval()
    seen = {}
    gate = model.model.layers[2].mlp.gate

    def grab(mod, inp, out):      # returns None: the output is left as it is
        seen["x"] = inp[0].detach()

    handle = gate.register_forward_hook(grab)
    ids = torch.randint(0, 60, (2, 11))
    pairs = fr.routing_and_predictions(model, ids)
    handle.remove()
    assert len(pairs) == 2 and all(a.shape == p.shape == (22, 2) for a, p in pairs)
    want = torch.nn.functional.linear(seen["x"].reshape(-1, 32), gate.weight).topk(2, -1).indices
    assert torch.equal(pairs[1][0], want)
    assert fr.mixtral_expert_bytes() == 3 * 4096 * 14336 * 2


def test_least_important_mask():
    imp = torch.tensor([[0.3, 0.1, 0.2, 0.1], [1.0, 2.0, 3.0, 4.0]])
    mask = fr.least_important(imp, 0.5)
    assert mask.tolist() == [[False, True, False, True], [True, True, False, False]]
    assert not fr.least_important(imp, 0.1).any()


def test_pruned_heads_zero_exactly_the_masked_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        base = model(ids).logits
        with fr.pruned_heads(model, torch.zeros(2, 4, dtype=torch.bool)):
            same = model(ids).logits
        seen = []
        hook = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(i[0]) and None)
        mask = torch.tensor([[False] * 4, [True, False, True, False]])
        with fr.pruned_heads(model, mask):
            pruned = model(ids).logits
        hook.remove()
        after = model(ids).logits
    assert torch.equal(base, same) and torch.equal(base, after)          # no mask: unchanged; hooks removed
    x = seen[0].reshape(1, 9, 4, 8)
    assert x[:, :, [0, 2]].abs().max() == 0 and x[:, :, [1, 3]].abs().max() > 0
    assert not torch.equal(base, pruned)
    imp = fr.head_importance(model, ids)
    assert imp.shape == (2, 4) and (imp > 0).all()


def test_main_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "frontier.json"
    assert fr.main(["--out", str(out), "--steps", "3", "--n-train", "40", "--n-eval", "6", "--batch", "4",
                    "--widths", "32", "--seeds", "0"]) == 0
    import json

    runs = {r["model"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"standard", "diff", "mod", "xkv"}
    assert runs["xkv"]["memory_bytes"] == runs["standard"]["memory_bytes"] // 2
    assert "causal_accuracy" in runs["mod"] and runs["mod"]["routed_fraction"] == [0.5, 0.5]
    for r in runs.values():
        lo, hi = r["wilson95"]
        assert lo <= r["accuracy"] <= hi and r["total"] > 0


def test_main_trains_the_same_variants_on_the_pass_key(tmp_path):
    import json

    out = tmp_path / "passkey.json"
    assert fr.main(["--task", "passkey", "--out", str(out), "--steps", "3", "--n-train", "40", "--n-eval", "6",
                    "--batch", "4", "--context-len", "24", "--widths", "32", "--seeds", "0"]) == 0
    result = json.loads(out.read_text())
    assert result["task"]["chance"] == 10 ** -4 and result["task"]["context_len"] == 24
    runs = {r["model"]: r for r in result["runs"]}
    assert set(runs) == {"standard", "diff", "mod", "xkv"}
    for r in runs.values():
        lo, hi = r["wilson95"]
        assert lo <= r["accuracy"] <= hi and r["total"] == 6       # one key per sample
