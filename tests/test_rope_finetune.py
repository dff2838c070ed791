"""labsrc.rope_finetune: the RoPE swap matches labsrc.rope and transformers, and a short fine-tune lowers the loss."""
import logging
import random

import pytest
import torch

import labsrc  # noqa: F401  (sets the interpreter switch before anything imports triton)
from labsrc import rope
from labsrc.data import load_tokenizer
from labsrc.rope_finetune import finetune, set_rope
from labsrc.models.train import CONFIGS, make_batch, model_config

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def tiny_model(tokenizer, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config(CONFIGS["tiny"], tokenizer)).eval()


@pytest.mark.parametrize("method,factor", [("default", None), ("linear", 4.0), ("ntk", 3.0), ("dynamic", 1.0),
                                           ("dynamic", 2.0), ("yarn", 4.0), ("yarn", 2.5)])
def test_set_rope_gives_the_library_frequencies(tokenizer, method, factor):
    model = tiny_model(tokenizer)
    trained = model.config.lab_trained_context
    head_dim = model.config.head_dim
    seq_len = 3 * trained + 5
    set_rope(model, "linear", 8.0)  # a previous swap must not leak into the next one
    set_rope(model, method, factor)
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(seq_len)[None])
    inv, scale = rope.rope_frequencies(head_dim, 10000.0, method, factor=factor, original_max_position=trained,
                                       max_position=trained, seq_len=seq_len)
    cos_ref, sin_ref = rope.rope_cos_sin(inv, seq_len, scale)
    torch.testing.assert_close(cos[0], cos_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[0], sin_ref, rtol=1e-6, atol=1e-6)


def test_set_rope_back_to_default_restores_outputs(tokenizer):
    model = tiny_model(tokenizer)
    ids = torch.randint(5, 200, (1, 40))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        set_rope(model, "yarn", 4.0)
        changed = model(input_ids=ids).logits
        set_rope(model, "default")
        after = model(input_ids=ids).logits
    assert not torch.allclose(before, changed)
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_set_rope_errors(tokenizer):
    model = tiny_model(tokenizer)
    with pytest.raises(ValueError, match="method must be one of"):
        set_rope(model, "alibi", 2.0)
    with pytest.raises(ValueError, match="needs factor >= 1"):
        set_rope(model, "linear")
    with pytest.raises(ValueError, match="needs factor >= 1"):
        set_rope(model, "yarn", 0.5)


def held_out_loss(model, tokenizer, seq_len):
    cfg = CONFIGS["tiny"]
    from dataclasses import replace
    ids, _ = make_batch(replace(cfg, seq_len=seq_len, batch_size=4), tokenizer,
                        random.Random(12345))
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_finetune_lowers_the_loss(tokenizer):
    model = tiny_model(tokenizer)
    set_rope(model, "yarn", 2.0)
    before = held_out_loss(model, tokenizer, 256)
    losses = finetune(model, tokenizer, 256, 12, lr=3e-3, batch_size=2, seed=0)
    after = held_out_loss(model, tokenizer, 256)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert not model.training
    assert after < before - 0.5, (before, after)


def test_finetune_is_deterministic_and_validates(tokenizer):
    runs = []
    for _ in range(2):
        model = tiny_model(tokenizer)
        runs.append(finetune(model, tokenizer, 128, 2, lr=1e-3, seed=3))
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="steps must be a positive int"):
        finetune(model, tokenizer, 128, 0)
    with pytest.raises(ValueError, match="seq_len must be an int >= 128"):
        finetune(model, tokenizer, 64, 2)
