"""Each KV-cache exercise check passes a right answer, fails a wrong one (and raises in strict mode), and
reports "not solved yet" for the student-build stub."""
import labsrc  # noqa: F401

import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
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


CASES = [
    (ex.check_gqa_bytes, right_gqa, wrong_gqa_uses_query_heads),
    (ex.check_kv_equals_weights, right_crossover, wrong_crossover_forgets_batch),
    (ex.check_reservation_waste, right_waste, wrong_waste_is_utilisation),
    (ex.check_mla_bytes, right_mla, wrong_mla_doubles_for_k_and_v),
]


def test_failure_message_does_not_reveal_the_answer(lenient):
    result = ex.check_gqa_bytes(wrong_gqa_uses_query_heads)
    # the message names the failing inputs and the wrong value, never the expected one
    args = ex._gqa_inputs(torch.Generator().manual_seed(11))
    assert str(right_gqa(*args)) not in result.message
