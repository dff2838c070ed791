"""Tests of chapter 5's newer exercise checks: the INT4 unpack kernel exercise (a real ``@triton.jit`` kernel
launched under the interpreter) and the refusal of answers that call the library function they should write.

The contract cases of the older checks (scale/zero, MSE ratio, cache bytes) run in ``tests/test_kvquant.py``.
"""
import pytest
import torch

from labsrc import kvquant as kq
from labsrc import runtime
from labsrc.exercises import ExerciseFailed
from labsrc.exercises.core import library_use
from exercise_contract import assert_kernel_check_skips_without_triton
from labsrc.exercises import kv_quant as ex
from labsrc.kernels._triton import tl, triton

needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


@triton.jit
def right_kernel(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr, BLOCK_DP: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs_t // GROUP, mask=mask_t, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + offs_t // GROUP, mask=mask_t, other=0.0).to(tl.float32)
    lo = (byte & 15).to(tl.float32) * s[:, None] + z[:, None]
    hi = ((byte >> 4) & 15).to(tl.float32) * s[:, None] + z[:, None]
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], lo, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], hi, mask=mask)


@triton.jit
def wrong_kernel_swaps_nibbles(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr,
                               BLOCK_DP: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs_t // GROUP, mask=mask_t, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + offs_t // GROUP, mask=mask_t, other=0.0).to(tl.float32)
    lo = (byte & 15).to(tl.float32) * s[:, None] + z[:, None]
    hi = ((byte >> 4) & 15).to(tl.float32) * s[:, None] + z[:, None]
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], hi, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], lo, mask=mask)


@triton.jit
def wrong_kernel_skips_last_block(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr,
                                  BLOCK_DP: tl.constexpr):
    # Forgets the partial last block of tokens: those outputs stay NaN.
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DP)
    mask_t = offs_t < (T // BLOCK_T) * BLOCK_T
    mask = mask_t[:, None] & (offs_c < DP)[None, :]
    byte = tl.load(p_ptr + offs_t[:, None] * DP + offs_c[None, :], mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs_t // GROUP, mask=mask_t, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + offs_t // GROUP, mask=mask_t, other=0.0).to(tl.float32)
    lo = (byte & 15).to(tl.float32) * s[:, None] + z[:, None]
    hi = ((byte >> 4) & 15).to(tl.float32) * s[:, None] + z[:, None]
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + offs_c[None, :], lo, mask=mask)
    tl.store(out_ptr + offs_t[:, None] * 2 * DP + DP + offs_c[None, :], hi, mask=mask)


@triton.jit
def stub_kernel(p_ptr, scale_ptr, zero_ptr, out_ptr, T, DP, GROUP, BLOCK_T: tl.constexpr, BLOCK_DP: tl.constexpr):
    # YOUR CODE HERE (what nbgrader leaves in the student build)
    raise NotImplementedError()


@needs_triton
def test_unpack_kernel_right_passes_and_wrong_fails_with_hint(capsys):
    assert ex.check_unpack_kernel(right_kernel).passed
    assert "passed" in capsys.readouterr().out
    for wrong in (wrong_kernel_swaps_nibbles, wrong_kernel_skips_last_block):
        result = ex.check_unpack_kernel(wrong)
        assert result.status == "failed" and "Hint:" in result.message
    assert "never written" in ex.check_unpack_kernel(wrong_kernel_skips_last_block).message


@needs_triton
def test_unpack_kernel_stub_is_not_solved_and_hidden_raises(monkeypatch):
    assert ex.check_unpack_kernel(stub_kernel).status == "not solved yet"
    assert ex.check_unpack_kernel(right_kernel, hidden=True).passed
    for bad in (stub_kernel, wrong_kernel_swaps_nibbles):
        with pytest.raises(ExerciseFailed):
            ex.check_unpack_kernel(bad, hidden=True)
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed):
        ex.check_unpack_kernel(wrong_kernel_swaps_nibbles)


@needs_triton
def test_unpack_kernel_refuses_a_python_function_and_a_library_call():
    from labsrc.kernels import kvquant as kk

    def not_a_kernel(*args, **kwargs):
        return kk.dequantize_unpack(*args)

    result = ex.check_unpack_kernel(not_a_kernel)
    assert result.status == "failed" and "@triton.jit" in result.message
    assert library_use(not_a_kernel, (kk.dequantize_unpack,)) == ["dequantize_unpack"]


def test_unpack_kernel_is_skipped_with_a_message_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_unpack_kernel, stub_kernel, monkeypatch, capsys)


def test_checks_refuse_answers_that_call_the_library():
    def via_module(n, layers, heads, d, bits, g):
        return kq.kv_bytes(n, layers, heads, d, bits=bits, group_size=g)

    kv_bytes_alias = kq.kv_bytes

    def via_alias(n, layers, heads, d, bits, g):
        return kv_bytes_alias(n, layers, heads, d, bits=bits, group_size=g)

    def via_ratio(var, per):
        return kq.predicted_mse_ratio(var, per_channel_steps=per)

    def via_scale_zero(group, bits):
        return kq.scale_zero(group.min(), group.max(), bits)

    for check, answer in ((ex.check_cache_bytes, via_module), (ex.check_cache_bytes, via_alias),
                          (ex.check_mse_ratio, via_ratio), (ex.check_scale_zero, via_scale_zero)):
        result = check(answer)
        assert result.status == "failed" and "write it yourself" in result.message, check.__name__
        with pytest.raises(ExerciseFailed):
            check(answer, hidden=True)


def test_hints_do_not_give_the_answer():
    """The bytes hint names what to count, not the byte sizes of the formula."""
    def wrong(n, layers, heads, d, bits, g):
        return 1

    message = ex.check_cache_bytes(wrong).message
    assert "Hint:" in message
    assert "2 + 2" not in message and "ceil(n / g)" not in message and "bits/8" not in message


def test_a_students_own_function_of_the_same_name_is_not_refused():
    """A helper the student wrote and named like the library's function is their own work."""
    namespace = {}
    exec("def kv_bytes(n, layers, heads, d, bits, g):\n"
         "    return 2 * layers * heads * (-(-n * d * bits // 8) + -(-n // g) * 4 + 4 * d)\n"
         "def answer(n, layers, heads, d, bits, g):\n"
         "    return kv_bytes(n, layers, heads, d, bits, g)\n", namespace)
    assert library_use(namespace["answer"], (kq.kv_bytes,)) == []
    assert ex.check_cache_bytes(namespace["answer"]).passed
