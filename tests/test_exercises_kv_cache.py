"""Each KV-cache exercise check passes a right answer, fails a wrong one (and raises in strict mode), and
reports "not solved yet" for the student-build stub."""
import labsrc  # noqa: F401

import pytest
import torch

from labsrc.exercises import ExerciseFailed
from labsrc.exercises import kv_cache as ex


def right_gqa(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes


def wrong_gqa_uses_query_heads(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * n_layers * n_heads * head_dim * seq_len * batch * dtype_bytes


def right_crossover(n_params, weight_bytes_per_param, n_layers, n_kv_heads, head_dim, kv_dtype_bytes, batch):
    return n_params * weight_bytes_per_param / (2 * n_layers * n_kv_heads * head_dim * kv_dtype_bytes * batch)


def wrong_crossover_forgets_batch(n_params, weight_bytes_per_param, n_layers, n_kv_heads, head_dim, kv_dtype_bytes, batch):
    return n_params * weight_bytes_per_param / (2 * n_layers * n_kv_heads * head_dim * kv_dtype_bytes)


def right_waste(lengths, max_len):
    return 1 - lengths.sum() / (len(lengths) * max_len)   # a 0-d tensor: the check accepts it


def wrong_waste_is_utilisation(lengths, max_len):
    return float(lengths.sum() / (len(lengths) * max_len))


def right_mla(n_layers, kv_lora_rank, qk_rope_head_dim, seq_len, dtype_bytes):
    return n_layers * (kv_lora_rank + qk_rope_head_dim) * seq_len * dtype_bytes


def wrong_mla_doubles_for_k_and_v(n_layers, kv_lora_rank, qk_rope_head_dim, seq_len, dtype_bytes):
    return 2 * n_layers * (kv_lora_rank + qk_rope_head_dim) * seq_len * dtype_bytes


def stub(*args):
    raise NotImplementedError


CASES = [
    (ex.check_gqa_bytes, right_gqa, wrong_gqa_uses_query_heads),
    (ex.check_kv_equals_weights, right_crossover, wrong_crossover_forgets_batch),
    (ex.check_reservation_waste, right_waste, wrong_waste_is_utilisation),
    (ex.check_mla_bytes, right_mla, wrong_mla_doubles_for_k_and_v),
]


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


@pytest.mark.parametrize("check,right,wrong", CASES)
def test_right_answer_passes(check, right, wrong, lenient, capsys):
    assert check(right).status == "passed"
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("check,right,wrong", CASES)
def test_wrong_answer_fails_with_hint(check, right, wrong, lenient, capsys):
    result = check(wrong)
    assert result.status == "failed" and "Hint:" in result.message
    assert "failed" in capsys.readouterr().out


@pytest.mark.parametrize("check,right,wrong", CASES)
def test_stub_is_not_solved_yet(check, right, wrong, lenient, capsys):
    assert check(stub).status == "not solved yet"
    assert "not solved yet" in capsys.readouterr().out


@pytest.mark.parametrize("check,right,wrong", CASES)
def test_strict_mode_raises_on_wrong_and_stub(check, right, wrong, monkeypatch):
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    assert check(right).passed
    with pytest.raises(ExerciseFailed):
        check(wrong)
    with pytest.raises(ExerciseFailed):
        check(stub)


def test_failure_message_does_not_reveal_the_answer(lenient):
    result = ex.check_gqa_bytes(wrong_gqa_uses_query_heads)
    # the message names the failing inputs and the wrong value, never the expected one
    args = ex._gqa_inputs(torch.Generator().manual_seed(11))
    assert str(right_gqa(*args)) not in result.message
