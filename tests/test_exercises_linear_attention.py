"""The linear-attention chapter's exercise checks keep the contract (right passes, wrong fails with a hint, the
stub is "not solved yet", hidden cases raise), refuse answers that call the labsrc function that would do them,
name the case and where it first goes wrong (never the simplification under which an answer is right), and the kernel exercise catches
a missing mask and says it is skipped without Triton."""
import labsrc  # noqa: F401

import math

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


def read_right(beta1, beta2, g, key_norm):
    r2 = key_norm ** 2
    # first write: the state predicts beta1 r2 a for k; the decay scales it; the second write
    # moves the prediction a fraction beta2 r2 of the way to b
    first = math.exp(g) * beta1 * r2
    return first * (1 - beta2 * r2), beta2 * r2


def read_wrong_unit_key(beta1, beta2, g, key_norm):   # forgets that |k| enters the write and the read
    return math.exp(g) * beta1 * (1 - beta2), beta2


def read_wrong_decay(beta1, beta2, g, key_norm):      # decays the first write after the second one's error
    r2 = key_norm ** 2
    return math.exp(g) * beta1 * r2 - beta2 * r2 * beta1 * r2, beta2 * r2


def chunked_right(q, k, v, g, chunk):
    S = q.new_zeros(q.shape[1], v.shape[1])
    out = []
    for s in range(0, q.shape[0], chunk):
        qc, kc, vc, gc = q[s:s + chunk], k[s:s + chunk], v[s:s + chunk], g[s:s + chunk]
        gamma = torch.cumsum(gc, 0)
        n = gamma.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        decay = torch.exp(torch.where(causal, gamma[:, None] - gamma[None, :], -math.inf))
        out.append((qc * torch.exp(gamma)[:, None]) @ S + ((qc @ kc.T) * decay) @ vc)
        S = torch.exp(gamma[-1]) * S + (kc * torch.exp(gamma[-1] - gamma)[:, None]).T @ vc
    return torch.cat(out)


def chunked_buggy(q, k, v, g, chunk):       # the exercise's function: the state decayed to the token before
    S = q.new_zeros(q.shape[1], v.shape[1])
    out = []
    for s in range(0, q.shape[0], chunk):
        qc, kc, vc, gc = q[s:s + chunk], k[s:s + chunk], v[s:s + chunk], g[s:s + chunk]
        gamma = torch.cumsum(gc, 0)
        n = gamma.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        decay = torch.exp(torch.where(causal, gamma[:, None] - gamma[None, :], -math.inf))
        out.append((qc * torch.exp(gamma - gc)[:, None]) @ S + ((qc @ kc.T) * decay) @ vc)
        S = torch.exp(gamma[-1]) * S + (kc * torch.exp(gamma[-1] - gamma)[:, None]).T @ vc
    return torch.cat(out)


def features_right(q, k, v, bound):
    """Average the error over several projections of one's own, and add features until it meets the bound."""
    exact = la.softmax_attention(q, k, v, causal=False)
    gen = torch.Generator().manual_seed(0)

    def error(m):
        return sum(float((la.favor_attention(q, k, v, la.orthogonal_projection(m, q.shape[-1], gen, dtype=q.dtype),
                                             "positive") - exact).abs().mean()) for _ in range(16)) / 16
    m = 2
    while error(m) > bound:
        m = max(m + 1, int(m * 1.2))
    return m


def features_wrong_one_projection(q, k, v, bound):   # a single draw per m: its luck decides
    exact = la.softmax_attention(q, k, v, causal=False)
    m = 2
    while float((la.favor_attention(q, k, v, la.orthogonal_projection(m, q.shape[-1], torch.Generator().manual_seed(m),
                                                                        dtype=q.dtype), "positive")
                 - exact).abs().mean()) > bound:
        m += 1
    return m


def features_wrong_generous(q, k, v, bound):         # far more than needed
    return 8 * features_right(q, k, v, bound)


def test_the_features_check_wants_the_budget_not_just_any_that_meets_the_bound(lenient, capsys):
    assert ex.check_features_needed(features_wrong_generous).status == "failed"


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
    (ex.check_read_after_two_writes, read_right, read_wrong_unit_key),
    (ex.check_read_after_two_writes, read_right, read_wrong_decay),
    (ex.check_chunked_attention, chunked_right, chunked_buggy),
    (ex.check_features_needed, features_right, features_wrong_one_projection),
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


def read_calls_library(beta1, beta2, g, key_norm):
    return ex.read_measurement(beta1, beta2, g, key_norm)


def chunked_calls_library(q, k, v, g, chunk):
    o, _ = la.gated_delta_rule_chunked(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                                       torch.zeros_like(g)[None, :, None], scale=1.0, chunk_size=chunk)
    return o[0, :, 0]


@pytest.mark.parametrize("check,answer,called", [
    (ex.check_read_after_two_writes, read_calls_library, "read_measurement"),
    (ex.check_chunked_attention, chunked_calls_library, "gated_delta_rule_chunked"),
])
def test_checks_refuse_a_call_to_the_library_function(check, answer, called, lenient, capsys):
    result = check(answer)
    assert result.status == "failed" and called in result.message and "Hint:" in result.message


def test_the_measured_read_is_the_closed_form_on_a_grid():
    """The recurrence the read is checked against has one closed form (so the exercise has one answer)."""
    for beta1 in (0.0, 0.3, 1.0):
        for beta2 in (0.0, 0.5, 1.0):
            for g in (0.0, -0.7):
                for norm in (1.0, 0.5, 1.7):
                    got = ex.read_measurement(beta1, beta2, g, norm)
                    assert all(math.isclose(x, y, abs_tol=1e-12) for x, y in zip(got, read_right(beta1, beta2, g, norm)))


def test_read_check_names_the_case_and_the_coefficient(lenient, capsys):
    result = ex.check_read_after_two_writes(read_wrong_unit_key)
    assert result.status == "failed" and "key_norm" in result.message and "coef_a" in result.message
    assert "unit key" not in result.message.split("Hint")[0]


def test_chunked_check_names_the_first_wrong_token_not_the_bug(lenient, capsys):
    result = ex.check_chunked_attention(chunked_buggy)
    assert result.status == "failed" and "first wrong token" in result.message
    assert "decay" not in result.message.split("Hint")[0]
