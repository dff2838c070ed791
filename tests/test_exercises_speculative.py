"""The speculative-decoding chapter's exercise checks keep the contract (right passes, wrong fails with a hint,
the stub is "not solved yet", hidden cases raise), refuse answers that call the library function they ask for,
and the kernel exercise catches a missing mask and says it is skipped without Triton."""
import labsrc  # noqa: F401

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    assert_kernel_check_skips_without_triton,
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc import runtime, speculative
from labsrc.exercises import speculative as ex
from labsrc.kernels._triton import tl, triton


def residual_right(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum()


def residual_wrong_unnormalised(p, q):
    return (p - q).clamp(min=0)


def tokens_right(alpha, k):
    return sum(alpha ** i for i in range(k + 1))


def tokens_wrong_no_bonus(alpha, k):          # counts only the accepted drafts
    return sum(alpha ** i for i in range(1, k + 1))


def mask_right(parents):
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            m[i] = m[par]
        m[i, i] = True
    return m


def mask_wrong_parent_only(parents):           # forgets the grandparents
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            m[i, par] = True
    return m


def keep_right(cached, k, n_accepted):
    return cached + 1 + n_accepted


def keep_wrong_no_rollback(cached, k, n_accepted):   # the bug: rejected drafts stay in the cache
    return cached + 1 + k


@triton.jit
def kernel_right(p_ptr, q_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=mask, other=0.0)
    q = tl.load(q_ptr + row * V + offs, mask=mask, other=0.0)
    r = tl.maximum(p - q, 0.0)
    s = tl.sum(r, 0)
    out = tl.where(s > 0, r / tl.where(s > 0, s, 1.0), p)
    tl.store(out_ptr + row * V + offs, out, mask=mask)


@triton.jit
def kernel_no_fallback(p_ptr, q_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=mask, other=0.0)
    q = tl.load(q_ptr + row * V + offs, mask=mask, other=0.0)
    r = tl.maximum(p - q, 0.0)
    tl.store(out_ptr + row * V + offs, r / tl.sum(r, 0), mask=mask)   # 0/0 where p == q


@triton.jit
def kernel_no_store_mask(p_ptr, q_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=mask, other=0.0)
    q = tl.load(q_ptr + row * V + offs, mask=mask, other=0.0)
    r = tl.maximum(p - q, 0.0)
    s = tl.sum(r, 0)
    tl.store(out_ptr + row * V + offs, tl.where(s > 0, r / tl.where(s > 0, s, 1.0), p))


# the wrong kernel without the p == q fallback divides 0 by 0 on purpose (the check must catch the NaN)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")

CASES = [
    (ex.check_spec_residual, residual_right, residual_wrong_unnormalised),
    (ex.check_spec_expected_tokens, tokens_right, tokens_wrong_no_bonus),
    (ex.check_spec_tree_mask, mask_right, mask_wrong_parent_only),
    (ex.check_spec_cache_keep, keep_right, keep_wrong_no_rollback),
]
if runtime.HAS_TRITON:
    CASES += [(ex.check_spec_residual_kernel, kernel_right, kernel_no_fallback),
              (ex.check_spec_residual_kernel, kernel_right, kernel_no_store_mask)]


def test_library_answers_are_refused(lenient, capsys):
    assert ex.check_spec_residual(speculative.residual_distribution).status == "failed"
    assert ex.check_spec_expected_tokens(lambda a, k: speculative.expected_tokens_per_step(a, k)).status == "failed"
    assert ex.check_spec_tree_mask(lambda par: speculative.tree_attention_mask(par)).status == "failed"
    assert "asks you to write" in capsys.readouterr().out


def test_kernel_check_says_skipped_without_triton(monkeypatch, capsys):
    assert_kernel_check_skips_without_triton(ex.check_spec_residual_kernel, kernel_right, monkeypatch, capsys)
