"""Each KV-cache exercise check passes a right answer, fails a wrong one (and raises in strict mode), and
reports "not solved yet" for the student-build stub."""
import labsrc  # noqa: F401

import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc.exercises import ExerciseFailed
from labsrc.exercises import kv_cache as ex
from labsrc.kernels._triton import HAS_TRITON, tl, triton

import pytest


def right_gqa(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes


def wrong_gqa_uses_query_heads(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * n_layers * n_heads * head_dim * seq_len * batch * dtype_bytes


def right_v3_crossover():
    weights = 671e9 * 2                       # every expert is resident, bf16
    per_token = 61 * (512 + 64) * 2           # one latent and one RoPE key per layer, bf16, no factor 2
    return weights / per_token


def wrong_v3_crossover_active_weights_only():
    return 37e9 * 2 / (61 * (512 + 64) * 2)


def right_waste(lengths, max_len):
    return 1 - lengths.sum() / (len(lengths) * max_len)   # a 0-d tensor: the check accepts it


def wrong_waste_is_utilisation(lengths, max_len):
    return float(lengths.sum() / (len(lengths) * max_len))


def right_mla_heads(kv_lora_rank, qk_rope_head_dim, head_dim):
    return (kv_lora_rank + qk_rope_head_dim) / (2 * head_dim)


def wrong_mla_heads_forgets_that_a_head_stores_k_and_v(kv_lora_rank, qk_rope_head_dim, head_dim):
    return (kv_lora_rank + qk_rope_head_dim) / head_dim


@triton.jit
def right_store_kernel(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    src = row.to(tl.int64) * row_size + offs
    dst = slot * row_size + offs
    tl.store(k_cache + dst, tl.load(k_new + src, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v_new + src, mask=mask), mask=mask)


@triton.jit
def wrong_store_kernel_ignores_slots(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    src = row.to(tl.int64) * row_size + offs
    tl.store(k_cache + src, tl.load(k_new + src, mask=mask), mask=mask)
    tl.store(v_cache + src, tl.load(v_new + src, mask=mask), mask=mask)


@triton.jit
def wrong_store_kernel_unmasked(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    src = row.to(tl.int64) * row_size + offs
    tl.store(k_cache + slot * row_size + offs, tl.load(k_new + src))
    tl.store(v_cache + slot * row_size + offs, tl.load(v_new + src))


@triton.jit
def stub_store_kernel(k_cache, v_cache, k_new, v_new, slots, row_size, BLOCK: tl.constexpr):
    """What the student build holds: nbgrader replaces the solution by a raise inside the kernel."""
    row = tl.program_id(0)  # noqa: F841
    raise NotImplementedError()


KERNEL_CASES = [(ex.check_kv_store_kernel, right_store_kernel, wrong_store_kernel_ignores_slots)] if HAS_TRITON else []

CASES = KERNEL_CASES + [
    (ex.check_gqa_bytes, right_gqa, wrong_gqa_uses_query_heads),
    (ex.check_v3_crossover, right_v3_crossover, wrong_v3_crossover_active_weights_only),
    (ex.check_reservation_waste, right_waste, wrong_waste_is_utilisation),
    (ex.check_mla_equivalent_heads, right_mla_heads, wrong_mla_heads_forgets_that_a_head_stores_k_and_v),
]


def test_checks_refuse_a_call_to_the_kvmath_function_they_ask_for(lenient, monkeypatch):
    """Each answer below is right (it returns the library's value) but asks kvmath for it: all fail, in strict
    mode they raise."""
    from labsrc import kvmath

    def gqa_by_library(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
        return kvmath.gqa_cache_bytes(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)

    def v3_by_library():
        v3 = kvmath.PRESETS["DeepSeek-V3"]
        return kvmath.kv_equals_weights_context(v3.weight_bytes(2), v3.kv_bytes_per_token(2))

    def waste_by_library(lengths, max_len):
        return 1 - kvmath.reservation_utilisation(lengths.numpy(), max_len)

    from labsrc.kvmath import mla_equivalent_kv_heads   # imported by name: the call is still seen

    def mla_heads_by_library(kv_lora_rank, qk_rope_head_dim, head_dim):
        return (lambda: mla_equivalent_kv_heads(kv_lora_rank, qk_rope_head_dim, head_dim))()

    cases = [(ex.check_gqa_bytes, gqa_by_library), (ex.check_v3_crossover, v3_by_library),
             (ex.check_reservation_waste, waste_by_library),
             (ex.check_mla_equivalent_heads, mla_heads_by_library)]
    for check, answer in cases:
        result = check(answer)
        assert result.status == "failed" and "derive the answer yourself" in result.message, check.__name__
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    for check, answer in cases:
        with pytest.raises(ExerciseFailed):
            check(answer)


def test_v3_failure_message_does_not_reveal_the_answer(lenient):
    result = ex.check_v3_crossover(wrong_v3_crossover_active_weights_only)
    assert result.status == "failed"
    expected = right_v3_crossover()
    assert f"{expected:.0f}" not in result.message and f"{expected:,.0f}" not in result.message
    assert f"{expected:.3g}" not in result.message


def test_failure_message_does_not_reveal_the_answer(lenient):
    result = ex.check_gqa_bytes(wrong_gqa_uses_query_heads)
    # the message names the failing inputs and the wrong value, never the expected one
    args = ex._gqa_inputs(torch.Generator().manual_seed(11))
    assert str(right_gqa(*args)) not in result.message


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


@needs_triton
def test_kernel_without_mask_fails(lenient):
    """Every random store has a row size that BLOCK does not divide, so the unmasked last block shows."""
    assert ex.check_kv_store_kernel(wrong_store_kernel_unmasked).status == "failed"


@needs_triton
def test_kernel_stub_inside_jit_is_not_solved(lenient, monkeypatch):
    """The release notebook's kernel raises NotImplementedError inside @triton.jit (the interpreter wraps it)."""
    assert ex.check_kv_store_kernel(stub_store_kernel).status == "not solved yet"
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed, match="not solved yet"):
        ex.check_kv_store_kernel(stub_store_kernel)


@needs_triton
def test_kernel_check_refuses_the_library_kernel(lenient):
    from labsrc.kernels.kv_store import _kv_store_kernel
    result = ex.check_kv_store_kernel(_kv_store_kernel)
    assert result.status == "failed" and "itself" in result.message


@needs_triton
def test_kernel_check_refuses_a_plain_function(lenient):
    result = ex.check_kv_store_kernel(lambda *args: None)
    assert result.status == "failed" and "@triton.jit" in result.message


def test_kernel_check_is_skipped_without_triton(monkeypatch, capsys):
    monkeypatch.setattr(ex, "HAS_TRITON", False)     # this module reads the flag at import
    assert_kernel_check_skips_without_triton(ex.check_kv_store_kernel, right_store_kernel, monkeypatch, capsys)
