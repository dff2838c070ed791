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


def right_decode_rate(weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s):
    batch = (hbm_bytes - weight_bytes) // (context * kv_bytes_per_token)   # whole sequences beside the weights
    if batch < 1:
        return 0.0
    return batch * hbm_bytes_per_s / (weight_bytes + batch * context * kv_bytes_per_token)


def wrong_decode_rate_fractional_batch(weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s):
    batch = max(0.0, (hbm_bytes - weight_bytes) / (context * kv_bytes_per_token))
    return batch * hbm_bytes_per_s / hbm_bytes


def wrong_decode_rate_batch_one(weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s):
    return hbm_bytes_per_s / (weight_bytes + context * kv_bytes_per_token)


def right_paged(mean_length, block_size):
    return mean_length / (mean_length + (block_size - 1) / 2)    # the last block is half empty on average


def wrong_paged_whole_block_wasted(mean_length, block_size):
    return mean_length / (mean_length + block_size)


def right_mla_heads(kv_lora_rank, qk_rope_head_dim, head_dim):
    return (kv_lora_rank + qk_rope_head_dim) / (2 * head_dim)


def wrong_mla_heads_forgets_that_a_head_stores_k_and_v(kv_lora_rank, qk_rope_head_dim, head_dim):
    return (kv_lora_rank + qk_rope_head_dim) / head_dim


@triton.jit
def right_store_kernel(k_cache, v_cache, k_new, v_new, slots, n_slots, head_dim, row_size,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    src = row.to(tl.int64) * row_size + offs
    dst = (offs // head_dim).to(tl.int64) * n_slots * head_dim + slot * head_dim + offs % head_dim
    tl.store(k_cache + dst, tl.load(k_new + src, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v_new + src, mask=mask), mask=mask)


@triton.jit
def wrong_store_kernel_token_major(k_cache, v_cache, k_new, v_new, slots, n_slots, head_dim, row_size,
                                   BLOCK: tl.constexpr):
    """The chapter's layout: the row lands contiguously at slot * row_size."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    src = row.to(tl.int64) * row_size + offs
    tl.store(k_cache + slot * row_size + offs, tl.load(k_new + src, mask=mask), mask=mask)
    tl.store(v_cache + slot * row_size + offs, tl.load(v_new + src, mask=mask), mask=mask)


@triton.jit
def wrong_store_kernel_unmasked(k_cache, v_cache, k_new, v_new, slots, n_slots, head_dim, row_size,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    src = row.to(tl.int64) * row_size + offs
    dst = (offs // head_dim).to(tl.int64) * n_slots * head_dim + slot * head_dim + offs % head_dim
    tl.store(k_cache + dst, tl.load(k_new + src))
    tl.store(v_cache + dst, tl.load(v_new + src))


@triton.jit
def stub_store_kernel(k_cache, v_cache, k_new, v_new, slots, n_slots, head_dim, row_size,
                      BLOCK: tl.constexpr):
    """What the student build holds: nbgrader replaces the solution by a raise inside the kernel."""
    row = tl.program_id(0)  # noqa: F841
    raise NotImplementedError()


KERNEL_CASES = [(ex.check_kv_store_kernel, right_store_kernel, wrong_store_kernel_token_major)] if HAS_TRITON else []

CASES = KERNEL_CASES + [
    (ex.check_gqa_bytes, right_gqa, wrong_gqa_uses_query_heads),
    (ex.check_decode_rate_ceiling, right_decode_rate, wrong_decode_rate_fractional_batch),
    (ex.check_paged_utilisation, right_paged, wrong_paged_whole_block_wasted),
    (ex.check_mla_equivalent_heads, right_mla_heads, wrong_mla_heads_forgets_that_a_head_stores_k_and_v),
]


def test_checks_refuse_a_call_to_the_kv_cache_function_they_ask_for(lenient, monkeypatch):
    """Each answer below is right (it returns the library's value) but asks kv_cache for it: all fail, in strict
    mode they raise."""
    from labsrc import kv_cache

    def gqa_by_library(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
        return kv_cache.gqa_cache_bytes(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)

    def rate_by_library(weight_bytes, kv_bytes_per_token, context, hbm_bytes, hbm_bytes_per_s):
        batch = (hbm_bytes - weight_bytes) // (context * kv_bytes_per_token)
        return 0.0 if batch < 1 else float(kv_cache.tokens_per_s_ceiling(
            weight_bytes, kv_bytes_per_token, context, hbm_bytes_per_s, batch=int(batch)))

    def paged_by_library(mean_length, block_size):
        return kv_cache.paged_utilisation([round(mean_length)], block_size)

    from labsrc.kv_cache import mla_equivalent_kv_heads   # imported by name: the call is still seen

    def mla_heads_by_library(kv_lora_rank, qk_rope_head_dim, head_dim):
        return (lambda: mla_equivalent_kv_heads(kv_lora_rank, qk_rope_head_dim, head_dim))()

    cases = [(ex.check_gqa_bytes, gqa_by_library), (ex.check_decode_rate_ceiling, rate_by_library),
             (ex.check_paged_utilisation, paged_by_library),
             (ex.check_mla_equivalent_heads, mla_heads_by_library)]
    for check, answer in cases:
        result = check(answer)
        assert result.status == "failed" and "the answer calls labsrc's own" in result.message, check.__name__
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    for check, answer in cases:
        with pytest.raises(ExerciseFailed):
            check(answer)


def test_decode_rate_hints_name_the_kind_of_trial(lenient):
    """A batch that is not a whole number of sequences, or a batch of one, fails on a trial the message names."""
    result = ex.check_decode_rate_ceiling(wrong_decode_rate_fractional_batch)
    assert result.status == "failed" and ("whole sequence" in result.message or "do not fit" in result.message)
    result = ex.check_decode_rate_ceiling(wrong_decode_rate_batch_one)
    assert result.status == "failed" and "Hint:" in result.message


def test_decode_rate_cases_cover_a_card_too_small_and_a_few_sequences():
    gen = torch.Generator().manual_seed(12)
    cases = [ex._rate_inputs(gen) for _ in range(40)]
    fits = [(m - w) // (n * k) for w, k, n, m, _ in cases]
    assert any(f < 1 for f in fits) and any(1 <= f < 20 for f in fits) and any(f >= 20 for f in fits)
    assert any(w > m for w, _, _, m, _ in cases)


def test_paged_prediction_is_compared_with_a_measurement_within_the_stated_tolerance(lenient, monkeypatch):
    """The truth is what serving the mixes in blocks measures: a prediction that equals the measurement passes,
    one a little more than the tolerance off fails."""
    from labsrc import kv_cache
    measured = []
    original = kv_cache.paged_utilisation

    def spy(lengths, block_size):
        measured.append(original(lengths, block_size))
        return measured[-1]

    monkeypatch.setattr(kv_cache, "paged_utilisation", spy)
    assert ex.check_paged_utilisation(right_paged).passed and len(measured) == 8
    assert ex.check_paged_utilisation(lambda m, b: 1.0).status == "failed"
    off = ex.PAGED_TOLERANCE * 1.5
    result = ex.check_paged_utilisation(lambda m, b: right_paged(m, b) + off)
    assert result.status == "failed" and "not within the tolerance" in result.message
    assert "Hint:" in result.message
    assert "above" not in result.message and "below" not in result.message, "pass or fail, no side and no gap"


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
def test_kernel_in_the_chapters_layout_fails_on_a_named_element(lenient):
    """The shown kernel's addressing, copied, writes the token-major layout: the message names the case and an
    element, not the slip (naming the layout would hand out the fix)."""
    result = ex.check_kv_store_kernel(wrong_store_kernel_token_major)
    assert result.status == "failed" and "[n_slots, n_kv_heads, head_dim]" not in result.message
    assert "slot" in result.message


@needs_triton
def test_kernel_stub_inside_jit_is_not_solved(lenient, monkeypatch):
    """The release notebook's kernel raises NotImplementedError inside @triton.jit (the interpreter wraps it)."""
    assert ex.check_kv_store_kernel(stub_store_kernel).status == "not solved yet"
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed, match="not solved yet"):
        ex.check_kv_store_kernel(stub_store_kernel)


@needs_triton
def test_kernel_check_refuses_the_library_kernel(lenient):
    from labsrc.kernels.kv_cache import _kv_store_kernel
    result = ex.check_kv_store_kernel(_kv_store_kernel)
    assert result.status == "failed" and "itself" in result.message


@needs_triton
def test_kernel_check_refuses_a_plain_function(lenient):
    result = ex.check_kv_store_kernel(lambda *args: None)
    assert result.status == "failed" and "@triton.jit" in result.message


def test_kernel_check_is_skipped_without_triton(monkeypatch, capsys):
    monkeypatch.setattr(ex, "HAS_TRITON", False)     # this module reads the flag at import
    assert_kernel_check_skips_without_triton(ex.check_kv_store_kernel, right_store_kernel, monkeypatch, capsys)
