"""The "lab_triton" transformers attention implementation (labsrc.flash_attention) against transformers' own SDPA.

A small random-init Llama (fp32, grouped-query 4:2, head_dim 32) keeps the Triton interpreter fast on the CPU.
Greedy generation must give the same tokens as ``attn_implementation="sdpa"`` and logits within the fp32
tolerance; masks the kernels cannot express must raise instead of being ignored.
"""
import pytest
import torch

import labsrc
import labsrc.flash_attention as lab_attention
from labsrc.exercises import tolerance
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

NAME = lab_attention.NAME
RTOL, ATOL = tolerance(torch.float32)



@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval().to(labsrc.DEVICE)


@pytest.fixture
def calls(monkeypatch):
    """Record which kernel each attention call used (and decode's seq_lens), still running the real kernels."""
    seen = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen.append((name, args[3].tolist() if name == "decode" else tuple(args[0].shape)))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(lab_attention, "flash_attention", spy("flash", lab_attention.flash_attention))
    monkeypatch.setattr(lab_attention, "decode_attention", spy("decode", lab_attention.decode_attention))
    return seen


def _prompt(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, length), generator=gen).to(labsrc.DEVICE)


def _generate(model, impl, ids, n, **kwargs):
    model.set_attn_implementation(impl)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)


def test_registered_under_its_name():
    assert NAME in AttentionInterface().valid_keys()
    assert NAME in AttentionMaskInterface._global_mapping  # so padding reaches the attention function
    assert "flash" not in NAME  # transformers would try to import a FlashAttention package for such a name


def test_greedy_generation_is_token_identical_to_sdpa(model, calls):
    ids = _prompt(1, 19, seed=1)
    ref = _generate(model, "sdpa", ids, 64)
    got = _generate(model, NAME, ids, 64)
    assert torch.equal(got.sequences, ref.sequences)
    assert len(got.logits) == len(ref.logits) == 64
    for step, (a, b) in enumerate(zip(got.logits, ref.logits)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"logits at step {step}: {m}")
    layers = model.config.num_hidden_layers
    # Prefill went through flash_attention, each later token through decode_attention over the whole cache.
    assert calls[:layers] == [("flash", (1, 4, 19, 32))] * layers
    assert calls[layers:] == [("decode", [20 + t]) for t in range(63) for _ in range(layers)]


def test_batch_without_padding_matches_sdpa(model):
    ids = _prompt(2, 11, seed=2)
    ref = _generate(model, "sdpa", ids, 6)
    got = _generate(model, NAME, ids, 6)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_static_cache_uses_prefix_lengths(model, calls):
    # A preallocated cache hands the kernels its empty slots too: the prefill mask is dropped by transformers
    # (queries see keys <= i) and each decode step arrives with a "first n keys" mask, i.e. seq_lens.
    ids = _prompt(1, 13, seed=3)
    ref = _generate(model, "sdpa", ids, 8, cache_implementation="static")
    got = _generate(model, NAME, ids, 8, cache_implementation="static")
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    decode_lens = [lens for kind, lens in calls if kind == "decode"]
    assert decode_lens[:: model.config.num_hidden_layers] == [[14 + t] for t in range(7)]


def test_chunked_prefill_matches_one_shot_prefill(model):
    # Second chunk: 9 queries after 14 cached keys, a bottom-right causal mask built by transformers.
    ids = _prompt(1, 23, seed=4)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(ids).logits
    model.set_attn_implementation(NAME)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(ids[:, :14], cache=cache, use_cache=True).logits
        second = model(ids[:, 14:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=RTOL, atol=ATOL)


def test_padding_mask_is_refused_not_ignored(model):
    ids = _prompt(2, 10, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first prompt
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="lab_triton cannot apply this attention mask"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(tq=5, tk=5):
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, tq, 32, generator=gen)
    k, v = (torch.randn(1, 2, tk, 32, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout=0.1), "no dropout"),
    (dict(sliding_window=4), "sliding-window"),
    (dict(softcap=30.0), "soft-capping"),
    (dict(s_aux=torch.zeros(4)), "'s_aux'"),
    (dict(sinks=torch.zeros(4)), "'sinks'"),
    (dict(position_bias=torch.zeros(1, 4, 5, 5)), "'position_bias'"),
])
def test_unsupported_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lab_attention.lab_triton_attention_forward(_Module(), *_qkv(), None, **kwargs)


def test_additive_masks_are_classified_honestly():
    q, k, v = _qkv(5, 8)
    causal = torch.arange(8)[None, :] <= torch.arange(5)[:, None] + 3
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None]
    out, weights = lab_attention.lab_triton_attention_forward(_Module(), q, k, v, additive)
    assert weights is None and out.shape == (1, 5, 4, 32)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="cannot apply this attention mask"):  # a bias, not a mask
        lab_attention.lab_triton_attention_forward(_Module(), q, k, v, additive + 0.5)
    with pytest.raises(ValueError, match="cannot apply this attention mask"):  # a hole inside the keys
        holes = causal.clone()
        holes[:, 2] = False
        lab_attention.lab_triton_attention_forward(_Module(), q, k, v, holes[None, None])


# --- training through "lab_triton" ------------------------------------------------------------------------------
def _train_step(impl, ids, lr=0.1):
    """One SGD step of a fresh copy of the same tiny Llama: returns its gradients and updated weights."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         attention_dropout=0.0)
    model = LlamaForCausalLM(config).to(labsrc.DEVICE).train()
    model.set_attn_implementation(impl)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    optimizer.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, weights


@pytest.mark.parametrize("baseline", ["sdpa", "eager"])
def test_one_training_step_trains_qkv_like_the_baseline(baseline):
    # Before the backward existed, lab_triton's attention output had no graph: q/k/v projections got no
    # gradient at all and the step left them unchanged.
    ids = _prompt(2, 21, seed=7)
    loss_ref, grads_ref, weights_ref = _train_step(baseline, ids)
    loss, grads, weights = _train_step(NAME, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
    qkv = [n for n in grads if any(p in n for p in ("q_proj", "k_proj", "v_proj"))]
    assert len(qkv) == 3 * 2  # three projections in each of the two layers
    for name in grads:
        assert grads[name] is not None, f"{name} got no gradient through lab_triton"
        if name in qkv:
            assert grads[name].abs().max() > 0, f"{name} got a zero gradient"
        # Gradients are sums of many terms: compared at the fp32 rtol relative to the largest entry.
        scale = grads_ref[name].abs().max()
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=RTOL, atol=ATOL + RTOL * scale,
                                   msg=lambda m: f"gradient of {name} vs {baseline}: {m}")
        torch.testing.assert_close(weights[name], weights_ref[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} after one step vs {baseline}: {m}")


def test_one_token_forward_with_grad_goes_through_the_differentiable_kernel(calls):
    # decode_attention has no backward: a one-query forward that records a graph uses flash_attention.
    q, k, v = (t.requires_grad_() for t in _qkv(1, 7))
    out, _ = lab_attention.lab_triton_attention_forward(_Module(), q, k, v, None)
    out.sum().backward()
    assert calls == [("flash", (1, 4, 1, 32))]
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # A "first n keys" mask on one query needs decode_attention, which refuses to run while recording a graph.
    mask = (torch.arange(7) < 5)[None, None, None, :]
    with pytest.raises(ValueError, match="decode_attention is inference-only"):
        lab_attention.lab_triton_attention_forward(_Module(), q, k, v, mask)
