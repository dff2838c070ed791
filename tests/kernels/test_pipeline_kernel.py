"""Tests of labsrc.kernels.pipeline.greedy_verify (the last pipeline stage's greedy verification) against its
PyTorch reference: seeded random windows, odd sizes, ties and NaN as torch.argmax, strided and expanded
views, every dtype, outputs that start poisoned (-1), every error message, and hypothesis properties."""
import labsrc  # noqa: F401  (before triton)

import pytest
import torch
from hypothesis import given, settings, strategies as st

from labsrc import runtime
from labsrc.kernels import pipeline as kv
from labsrc.kernels.pipeline import greedy_verify, greedy_verify_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE = runtime.DEVICE


def _window(B, N, V, dtype, seed, agree=0.7):
    """Logits and tokens where each token agrees with the target's argmax with probability ``agree``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, V, generator=gen).to(dtype)
    preds = logits.float().argmax(-1)
    first = torch.randint(0, V, (B,), generator=gen)
    expected = torch.cat([first[:, None], preds[:, :-1]], 1)
    noise = torch.randint(0, V, (B, N), generator=gen)
    keep = torch.rand(B, N, generator=gen) < agree
    tokens = torch.where(keep, expected, noise)
    return logits.to(DEVICE), tokens.to(DEVICE), first.to(DEVICE)


def _same(got, want):
    assert torch.equal(got[0].cpu(), want[0].cpu()), "preds differ"
    assert torch.equal(got[1].cpu(), want[1].cpu()), "accepted differs"
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,N,V", [(1, 1, 1), (1, 5, 4096), (3, 17, 1000), (2, 9, 33), (4, 3, 257), (1, 33, 50)])
def test_matches_reference(B, N, V, dtype):
    for seed in range(3):
        logits, tokens, first = _window(B, N, V, dtype, seed=seed + N + V)
        _same(greedy_verify(logits, tokens, first), greedy_verify_ref(logits, tokens, first))


def test_accepted_counts_leading_matches_by_hand():
    logits = torch.full((1, 4, 6), -1.0)
    for i, t in enumerate([2, 5, 0, 3]):            # the target wants 2, 5, 0, 3 after each token
        logits[0, i, t] = 1.0
    first = torch.tensor([4])
    cases = {(4, 2, 5, 0): 4, (4, 2, 5, 1): 3, (4, 2, 1, 0): 2, (4, 1, 5, 0): 1, (3, 2, 5, 0): 0}
    for toks, want in cases.items():
        preds, acc = greedy_verify(logits, torch.tensor([toks]), first)
        assert preds.tolist() == [[2, 5, 0, 3]] and acc.item() == want, toks


def test_ties_nan_and_minus_inf_rows_follow_torch_argmax():
    V = 37
    logits = torch.zeros(1, 5, V)
    logits[0, 0, [3, 9, 30]] = 2.0                  # tie: the first index
    logits[0, 1, [4, 20]] = float("nan")            # NaN: the first NaN
    logits[0, 1, 2] = float("inf")
    logits[0, 2] = float("-inf")                    # all -inf: index 0
    logits[0, 3, 36] = float("inf")
    logits[0, 4, [0, 36]] = 5.0
    tokens, first = torch.zeros(1, 5, dtype=torch.long), torch.tensor([0])
    got, want = greedy_verify(logits, tokens, first), greedy_verify_ref(logits, tokens, first)
    _same(got, want)
    assert want[0].tolist() == [[3, 4, 0, 36, 0]]


def test_vocab_larger_than_one_tile_keeps_the_first_maximum(monkeypatch):
    """With small tiles the kernel walks the vocab in blocks; a tie across blocks keeps the earlier one."""
    monkeypatch.setattr(kv, "_TILE_INTERPRETER", 64)
    monkeypatch.setattr(kv, "_TILE_GPU", 64)
    logits = torch.zeros(2, 3, 301)
    logits[0, :, [17, 200]] = 3.0
    logits[1, 0, 300] = 1.0
    logits[1, 1, [5, 150, 299]] = float("nan")
    tokens = torch.tensor([[1, 17, 17], [0, 300, 5]])
    first = torch.tensor([1, 0])
    _same(greedy_verify(logits, tokens, first), greedy_verify_ref(logits, tokens, first))


def test_strided_and_expanded_inputs():
    logits, tokens, first = _window(3, 7, 65, torch.float32, seed=5)
    wide = torch.randn(3, 7, 130, device=DEVICE)
    wide[..., ::2] = logits
    strided = wide[..., ::2]                        # a non-contiguous view of the same values
    tok_t = tokens.t().contiguous().t()             # transposed storage
    first_e = first[:1].expand(3)                   # one value seen three times
    _same(greedy_verify(strided, tok_t, first_e), greedy_verify_ref(logits, tokens, first[:1].expand(3)))
    _same(greedy_verify(logits.expand(2, 3, 7, 65)[1], tokens.to(torch.int32), first.to(torch.int32)),
          greedy_verify_ref(logits, tokens, first))


def test_does_not_change_its_inputs():
    logits, tokens, first = _window(2, 5, 40, torch.float16, seed=9)
    copies = [t.clone() for t in (logits, tokens, first)]
    greedy_verify(logits, tokens, first)
    assert all(torch.equal(a, b) for a, b in zip(copies, (logits, tokens, first)))


def test_empty_batch():
    preds, acc = greedy_verify(torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.long),
                               torch.zeros(0, dtype=torch.long))
    assert preds.shape == (0, 3) and acc.shape == (0,)


@pytest.mark.parametrize("fn", [greedy_verify, greedy_verify_ref])
@pytest.mark.parametrize("args,exc,words", [
    ((torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long)), ValueError,
     "logits must be 3-D"),
    (([[[0.0]]], torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)), TypeError,
     "logits must be a torch.Tensor"),
    ((torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.long),
      torch.zeros(1, dtype=torch.long)), TypeError, "logits has dtype"),
    ((torch.zeros(1, 0, 3), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long)), ValueError,
     "at least 1 row"),
    ((torch.zeros(1, 2, 3), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)), TypeError,
     "tokens must be int32 or int64"),
    ((torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, dtype=torch.long)), ValueError,
     "tokens must have shape"),
    ((torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1)), TypeError,
     "first must be int32 or int64"),
    ((torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long)), ValueError,
     "first must have shape"),
    ((torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), "0"), TypeError, "first must be a torch.Tensor"),
])
def test_errors_name_the_argument(fn, args, exc, words):
    with pytest.raises(exc, match=words):
        fn(*args)


def test_kernel_only_errors():
    ok_t, ok_f = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    with pytest.raises(TypeError, match="float64"):
        greedy_verify(torch.zeros(1, 2, 3, dtype=torch.float64), ok_t, ok_f)
    assert greedy_verify_ref(torch.zeros(1, 2, 3, dtype=torch.float64), ok_t, ok_f)[1].item() == 2
    big = torch.zeros(1, kv.MAX_WINDOW + 1, 1)
    with pytest.raises(ValueError, match="at most 1024 rows"):
        greedy_verify(big, torch.zeros(1, kv.MAX_WINDOW + 1, dtype=torch.long), ok_f)
    with pytest.raises(ValueError, match="vocab of"):
        greedy_verify(torch.zeros(1, 1, 1).expand(1, 1, kv.MAX_VOCAB + 1), ok_t[:, :1], ok_f)
    grad = torch.zeros(1, 2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        greedy_verify(grad, ok_t, ok_f)
    with torch.no_grad():
        greedy_verify(grad, ok_t, ok_f)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 3), N=st.integers(1, 20), V=st.integers(1, 300), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from(DTYPES), levels=st.integers(1, 4))
def test_property_random_windows_with_many_ties(B, N, V, seed, dtype, levels):
    """Logits drawn from a few integer levels tie often; tokens agree with the target most of the time."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (B, N, V), generator=gen).to(dtype)
    preds = logits.float().argmax(-1)
    first = torch.randint(0, V, (B,), generator=gen)
    tokens = torch.cat([first[:, None], preds[:, :-1]], 1)
    flip = torch.rand(B, N, generator=gen) < 0.2
    tokens = torch.where(flip, torch.randint(0, V, (B, N), generator=gen), tokens)
    got, want = greedy_verify(logits, tokens, first), greedy_verify_ref(logits, tokens, first)
    _same(got, want)
    assert (0 <= want[1]).all() and (want[1] <= N).all()


@settings(max_examples=15, deadline=None)
@given(shape=st.tuples(st.integers(-1, 3), st.integers(-1, 3), st.integers(-1, 3)),
       tok_dtype=st.sampled_from([torch.int64, torch.int32, torch.float32, torch.int16]))
def test_property_bad_arguments_raise_named_errors(shape, tok_dtype):
    B, N, V = shape
    if min(shape) < 0:
        return
    logits = torch.zeros(B, N, V)
    tokens = torch.zeros(B, max(N, 0), dtype=tok_dtype)
    first = torch.zeros(B, dtype=torch.long)
    bad = N < 1 or V < 1 or tok_dtype not in (torch.int32, torch.int64)
    if bad:
        with pytest.raises((ValueError, TypeError), match="logits|tokens"):
            greedy_verify(logits, tokens, first)
    else:
        _same(greedy_verify(logits, tokens, first), greedy_verify_ref(logits, tokens, first))
