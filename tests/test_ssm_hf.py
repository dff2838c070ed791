"""The lab's ssd kernel inside transformers' Mamba2ForCausalLM: logits and greedy generation as the PyTorch path."""
import logging

import pytest
import torch

import labsrc  # noqa: F401
from labsrc import ssm_hf
from labsrc.kernels import ssm as kssm
from transformers import Mamba2Config, Mamba2ForCausalLM
from transformers.models.mamba2 import modeling_mamba2

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture
def tiny_mamba():
    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=96, hidden_size=48, num_hidden_layers=2, state_size=16, head_dim=16, expand=2,
                       num_heads=6, n_groups=2, chunk_size=16, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=1, pad_token_id=2)
    model = Mamba2ForCausalLM(cfg).eval()
    yield model
    ssm_hf.unregister()


def test_register_swaps_and_restores_the_module_functions():
    before = modeling_mamba2.mamba2_chunk_scan, modeling_mamba2.mamba2_selective_state_update
    with ssm_hf.lab_ssd():
        assert ssm_hf.is_registered()
        assert modeling_mamba2.mamba2_chunk_scan is ssm_hf.lab_mamba2_chunk_scan
        assert modeling_mamba2.mamba2_selective_state_update is ssm_hf.lab_mamba2_state_update
        ssm_hf.register()  # idempotent
    assert (modeling_mamba2.mamba2_chunk_scan, modeling_mamba2.mamba2_selective_state_update) == before
    assert not ssm_hf.is_registered()


def test_logits_match_the_pytorch_path_and_the_kernel_runs(tiny_mamba, monkeypatch):
    ids = torch.randint(3, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_mamba(input_ids=ids).logits
    calls = []
    real = kssm.ssd
    monkeypatch.setattr(kssm, "ssd", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with ssm_hf.lab_ssd(), torch.no_grad():
        got = tiny_mamba(input_ids=ids).logits
    assert len(calls) == 2 and calls[0] == (2, 37, 6, 16), "each layer's scan ran on the kernel"
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_greedy_generation_is_identical_and_decode_uses_the_kernel(tiny_mamba, monkeypatch):
    ids = torch.randint(3, 96, (1, 21), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=2)
    ref = tiny_mamba.generate(ids, **kw)
    steps = []
    real = kssm.ssd
    monkeypatch.setattr(kssm, "ssd", lambda *a, **k: steps.append(a[0].shape[1]) or real(*a, **k))
    with ssm_hf.lab_ssd():
        got = tiny_mamba.generate(ids, **kw)
    assert torch.equal(got, ref)
    assert steps.count(1) >= 2 * 6, "every decode step of both layers ran on the kernel with l = 1"


def test_training_falls_back_and_packed_sequences_are_refused(tiny_mamba):
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    tiny_mamba.train()
    with ssm_hf.lab_ssd():
        loss = tiny_mamba(input_ids=ids, labels=ids).loss
        loss.backward()  # the kernel has no backward: the PyTorch path ran
    assert tiny_mamba.lm_head.weight.grad is not None
    x = torch.randn(1, 4, 2, 3)
    with pytest.raises(ValueError, match="packed sequences"):
        ssm_hf.lab_mamba2_chunk_scan(x, torch.rand(1, 4, 2), -torch.rand(2), torch.randn(1, 4, 1, 16),
                                     torch.randn(1, 4, 1, 16), 16, seq_idx=torch.zeros(1, 4, dtype=torch.int32))
