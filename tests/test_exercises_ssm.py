"""The state-space chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the stub is
"not solved yet", hidden cases raise), refuse answers that call the labsrc.ssm function that would do them, name
what a wrong prediction or a wrong fix gets wrong, and the kernel exercise (the scan's gradient, a reverse scan)
catches a kernel that runs forward, drops its carry, multiplies by the wrong factor or writes past the row, and
says it is skipped without Triton."""
import labsrc  # noqa: F401

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime, ssm
from labsrc.exercises import ssm as ex
from labsrc.kernels._triton import tl, triton


def zoh_right(a, b, dt):
    Ab = torch.exp(dt * a)
    return Ab, (Ab - 1) / a * b


def zoh_wrong_euler(a, b, dt):          # forward Euler, not the exact hold
    return 1 + dt * a, dt * b


def cache_right(config, batch):
    conv_dim = config.num_heads * config.head_dim + 2 * config.n_groups * config.state_size
    per_layer = config.num_heads * config.head_dim * config.state_size + conv_dim * config.conv_kernel
    return batch * config.num_hidden_layers * per_layer * 4


def cache_wrong_one_group(config, batch):   # the convolution window over x only, not over B and C too
    per_layer = config.num_heads * config.head_dim * (config.state_size + config.conv_kernel)
    return batch * config.num_hidden_layers * per_layer * 4


def cache_wrong_no_batch(config, batch):    # one sequence whatever the batch
    return cache_right(config, 1)


def reset_right(S, x, a, B):
    # what each position's write decays by until the chunk's end: the sum of the log-decays after it,
    # summed from the end so that a huge one never swallows the small ones
    after = torch.flip(torch.cumsum(torch.flip(a, [0]), 0), [0])
    to_end = torch.cat([after[1:], after.new_zeros(1)])
    return torch.exp(after[0]) * S + (x * torch.exp(to_end)[:, None]).T @ B


def reset_prefix_difference(S, x, a, B):     # the exercise's earlier version: a difference of prefix sums
    c = torch.cumsum(a, 0)
    to_end = torch.exp(c[-1] - c)
    return torch.exp(c[-1]) * S + (x * to_end[:, None]).T @ B


def reset_buggy(S, x, a, B):                 # the function the exercise gives: a write decays by its own a too
    after = torch.flip(torch.cumsum(torch.flip(a, [0]), 0), [0])
    return torch.exp(after[0]) * S + (x * torch.exp(after)[:, None]).T @ B


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def grad_right(a_ptr, g_ptr, d_ptr, L, BLOCK_L: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        j = start + offs                 # lane j: position L - 1 - j, the row read from its end
        t = L - 1 - j
        mask = j < L
        a = tl.load(a_ptr + row * L + t + 1, mask=mask & (j > 0), other=0.0)
        g = tl.load(g_ptr + row * L + t, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, g), 0, _combine)
        d = A * carry + B
        tl.store(d_ptr + row * L + t, d, mask=mask)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, d, 0.0), axis=0)


@triton.jit
def grad_unshifted(a_ptr, g_ptr, d_ptr, L, BLOCK_L: tl.constexpr):   # multiplies by a_t, not a_{t+1}
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        j = start + offs
        t = L - 1 - j
        mask = j < L
        a = tl.load(a_ptr + row * L + t, mask=mask, other=1.0)
        g = tl.load(g_ptr + row * L + t, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, g), 0, _combine)
        d = A * carry + B
        tl.store(d_ptr + row * L + t, d, mask=mask)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, d, 0.0), axis=0)


@triton.jit
def grad_forward(a_ptr, g_ptr, d_ptr, L, BLOCK_L: tl.constexpr):     # the chapter's forward scan of (a, g)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        idx = start + offs
        mask = idx < L
        a = tl.load(a_ptr + row * L + idx, mask=mask, other=1.0)
        g = tl.load(g_ptr + row * L + idx, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, g), 0, _combine)
        d = A * carry + B
        tl.store(d_ptr + row * L + idx, d, mask=mask)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, d, 0.0), axis=0)


@triton.jit
def grad_no_carry(a_ptr, g_ptr, d_ptr, L, BLOCK_L: tl.constexpr):    # every block starts from d = 0
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    for start in range(0, L, BLOCK_L):
        j = start + offs
        t = L - 1 - j
        mask = j < L
        a = tl.load(a_ptr + row * L + t + 1, mask=mask & (j > 0), other=0.0)
        g = tl.load(g_ptr + row * L + t, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, g), 0, _combine)
        tl.store(d_ptr + row * L + t, B, mask=mask)


@triton.jit
def grad_unmasked_store(a_ptr, g_ptr, d_ptr, L, BLOCK_L: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    carry = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for start in range(0, L, BLOCK_L):
        j = start + offs
        t = L - 1 - j
        mask = j < L
        a = tl.load(a_ptr + row * L + t + 1, mask=mask & (j > 0), other=0.0)
        g = tl.load(g_ptr + row * L + t, mask=mask, other=0.0)
        A, B = tl.associative_scan((a, g), 0, _combine)
        d = A * carry + B
        tl.store(d_ptr + row * L + t, d)
        carry = tl.sum(tl.where(offs == BLOCK_L - 1, d, 0.0), axis=0)


needs_triton = pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")

CASES = [
    (ex.check_zoh_diagonal, zoh_right, zoh_wrong_euler),
    (ex.check_mamba_cache_bytes, cache_right, cache_wrong_one_group),
    (ex.check_mamba_cache_bytes, cache_right, cache_wrong_no_batch),
    (ex.check_chunk_state_reset, reset_right, reset_buggy),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_scan_grad_kernel, grad_right, grad_unshifted),
              (ex.check_scan_grad_kernel, grad_right, grad_no_carry)]


def test_the_reference_gradient_is_the_reverse_recurrence():
    gen = torch.Generator().manual_seed(0)
    a, g = torch.rand(3, 9, generator=gen, dtype=torch.float64), torch.randn(3, 9, generator=gen, dtype=torch.float64)
    d = torch.zeros_like(g)
    d[:, -1] = g[:, -1]
    for t in range(7, -1, -1):
        d[:, t] = g[:, t] + a[:, t + 1] * d[:, t + 1]
    torch.testing.assert_close(ex.scan_grad_reference(a, g), d)


def test_cache_check_names_the_case_not_the_field_or_the_direction(lenient, capsys):
    for wrong in (cache_wrong_no_batch, cache_wrong_one_group):
        result = ex.check_mamba_cache_bytes(wrong)
        assert result.status == "failed" and "Doubling" not in result.message and "too" not in result.message
        assert "n_groups" in result.case, "the failing configuration is named"


def test_cache_check_refuses_building_the_model(lenient, capsys):
    """Issue 44's bypass: build the transformers model from the configuration and measure its cache."""
    def measure(config, batch):
        import transformers

        from labsrc import ledger
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**vars(config))).eval()
        with torch.no_grad():
            out = model(input_ids=torch.zeros(batch, 3, dtype=torch.long), use_cache=True)
        return ledger.cache_bytes(out["cache_params"])

    result = ex.check_mamba_cache_bytes(measure)
    assert result.status == "failed" and "transformers" in result.message


def test_reset_check_fails_the_handed_out_and_the_earlier_bug_without_naming_them(lenient, capsys):
    for wrong in (reset_buggy, reset_prefix_difference):
        result = ex.check_chunk_state_reset(wrong)
        assert result.status == "failed" and "trial" in result.case and "own" not in result.message


@needs_triton
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_scan_grad_kernel(grad_unmasked_store)
    assert result.status == "failed" and "outside the output" in result.message


@needs_triton
def test_kernel_check_fails_a_missing_carry_without_naming_it(lenient, capsys):
    result = ex.check_scan_grad_kernel(grad_no_carry)
    assert result.status == "failed" and "block boundary" not in result.message


@needs_triton
def test_kernel_check_fails_the_forward_scan_and_the_unshifted_factor_without_naming_them(lenient, capsys):
    assert "the other way" not in ex.check_scan_grad_kernel(grad_forward).message
    assert "own a" not in ex.check_scan_grad_kernel(grad_unshifted).message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_scan_grad_kernel, grad_right, monkeypatch, capsys)


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_zoh_diagonal, lambda a, b, dt: ssm.discretize(a, b, dt, "zoh"), "discretize"),
    (ex.check_mamba_cache_bytes, lambda config, batch: ssm.ssm_state_bytes(
        config.num_hidden_layers, config.num_heads, config.head_dim, config.state_size, batch=batch),
     "labsrc.ssm"),
    (ex.check_chunk_state_reset, lambda S, x, a, B: ssm.ssd_recurrent(
        x[None, :, None], torch.ones_like(a)[None, :, None], a[:1] * 0 - 1, B[None, :, None],
        B[None, :, None] * 0, initial_state=S[None, None])[1][0, 0], "ssd_recurrent"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message


def test_messages_do_not_leak_the_answer(lenient, capsys):
    ex.check_chunk_state_reset(reset_buggy)
    out = capsys.readouterr().out
    args = ex._reset_inputs(torch.Generator().manual_seed(76), "near reset")
    assert f"{float(reset_right(*args)[0, 0]):.4f}" not in out
