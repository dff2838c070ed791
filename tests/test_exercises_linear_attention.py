"""The linear-attention chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the
stub is "not solved yet", hidden cases raise), refuse answers that call the labsrc function they ask for, and
the kernel exercise catches a missing mask and says it is skipped without Triton."""
import labsrc  # noqa: F401

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import linear_attention as la, runtime
from labsrc.exercises import linear_attention as ex
from labsrc.kernels._triton import tl, triton


def costs_right(T, d, dv):
    return 2 * T * T * (d + dv), 4 * T * d * dv


def costs_wrong(T, d, dv):          # forgets that phi(Q) (phi(K)^T V) is two products
    return 2 * T * T * (d + dv), 2 * T * d * dv


def delta_right(S, k, v, beta, g):
    S = torch.exp(torch.tensor(g, dtype=S.dtype)) * S
    return S + beta * torch.outer(k, v - S.T @ k)


def delta_wrong(S, k, v, beta, g):  # predicts with the state before the decay
    return torch.exp(torch.tensor(g, dtype=S.dtype)) * S + beta * torch.outer(k, v - S.T @ k)


def chunk_right(q, k, v, gamma, S):
    n = q.shape[0]
    out = torch.zeros(n, v.shape[1], dtype=q.dtype)
    for i in range(n):
        out[i] = torch.exp(gamma[i]) * (q[i] @ S)
        for j in range(i + 1):
            out[i] += (q[i] @ k[j]) * torch.exp(gamma[i] - gamma[j]) * v[j]
    return out


def chunk_wrong(q, k, v, gamma, S):   # no causal mask inside the chunk
    decay = torch.exp(gamma[:, None] - gamma[None, :])
    return (q * gamma.exp()[:, None]) @ S + ((q @ k.T) * decay) @ v


def features_right(q, k, v, make_proj, candidates, bound):
    ref = la.softmax_attention(q, k, v, causal=False)
    for m in candidates:
        err = (la.favor_attention(q, k, v, make_proj(m), "positive") - ref).abs().mean()
        if err < bound:
            return m
    return None


def features_wrong(q, k, v, make_proj, candidates, bound):   # trigonometric features instead
    ref = la.softmax_attention(q, k, v, causal=False)
    for m in candidates:
        if (la.favor_attention(q, k, v, make_proj(m), "trig") - ref).abs().mean() < bound:
            return m
    return None


@triton.jit
def kernel_right(q_ptr, k_ptr, v_ptr, o_ptr, T, K, V, decay, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    ok, ov = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    mk, mv = ok < K, ov < V
    S = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + (i * T + t) * K + ok, mask=mk, other=0.0)
        k = tl.load(k_ptr + (i * T + t) * K + ok, mask=mk, other=0.0)
        v = tl.load(v_ptr + (i * T + t) * V + ov, mask=mv, other=0.0)
        S = decay * S + k[:, None] * v[None, :]
        tl.store(o_ptr + (i * T + t) * V + ov, tl.sum(q[:, None] * S, 0), mask=mv)


@triton.jit
def kernel_no_decay(q_ptr, k_ptr, v_ptr, o_ptr, T, K, V, decay, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    ok, ov = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    mk, mv = ok < K, ov < V
    S = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + (i * T + t) * K + ok, mask=mk, other=0.0)
        k = tl.load(k_ptr + (i * T + t) * K + ok, mask=mk, other=0.0)
        v = tl.load(v_ptr + (i * T + t) * V + ov, mask=mv, other=0.0)
        S = S + k[:, None] * v[None, :]
        tl.store(o_ptr + (i * T + t) * V + ov, tl.sum(q[:, None] * S, 0), mask=mv)


@triton.jit
def kernel_no_store_mask(q_ptr, k_ptr, v_ptr, o_ptr, T, K, V, decay, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    ok, ov = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    mk, mv = ok < K, ov < V
    S = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + (i * T + t) * K + ok, mask=mk, other=0.0)
        k = tl.load(k_ptr + (i * T + t) * K + ok, mask=mk, other=0.0)
        v = tl.load(v_ptr + (i * T + t) * V + ov, mask=mv, other=0.0)
        S = decay * S + k[:, None] * v[None, :]
        tl.store(o_ptr + (i * T + t) * V + ov, tl.sum(q[:, None] * S, 0))


CASES = [
    (ex.check_association_costs, costs_right, costs_wrong),
    (ex.check_delta_step, delta_right, delta_wrong),
    (ex.check_chunk_output, chunk_right, chunk_wrong),
    (ex.check_features_needed, features_right, features_wrong),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_recurrent_kernel, kernel_right, kernel_no_decay),
              (ex.check_recurrent_kernel, kernel_right, kernel_no_store_mask)]


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="the kernel exercise needs Triton")
def test_kernel_check_names_a_write_outside_the_output(lenient, capsys):
    result = ex.check_recurrent_kernel(kernel_no_store_mask)
    assert result.status == "failed" and "outside the output" in result.message


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_recurrent_kernel, kernel_right, monkeypatch, capsys)


def delta_calls_library(S, k, v, beta, g):
    return ex.delta_step_reference(S, k, v, beta, g)


def chunk_calls_library(q, k, v, gamma, S):
    g = torch.diff(gamma, prepend=gamma.new_zeros(1))
    o, _ = la.lightning_attention(q[None, :, None], k[None, :, None], v[None, :, None], None, 64, 1.0,
                                  S[None, None], False)
    return o[0, :, 0] + 0 * g.sum()


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_delta_step, delta_calls_library, "gated_delta_rule_recurrent"),
    (ex.check_chunk_output, chunk_calls_library, "lightning_attention"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message
