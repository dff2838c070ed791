"""The one sampling rule (labsrc.sampling) that speculative decoding, the serving engine and the server share.

The defect it fixes: softmax(logits / T) for a tiny T overflowed to +-inf and gave NaN (warp_logits at T=1e-310),
and speculative_generate then died in torch.multinomial. The rule subtracts the maximum first, so every
temperature down to the smallest float gives a distribution, tending to greedy.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from labsrc import speculative as spec
from labsrc.sampling import check_sampling, sample_token, sampling_probs

TINY = [5e-324, 1e-320, 1e-310, 1e-300, 1e-200, 1e-30]


@settings(max_examples=60, deadline=None)
@given(V=st.integers(1, 40), rows=st.integers(1, 3), T=st.sampled_from(TINY),
       scale=st.sampled_from([1e-3, 1.0, 1e3, 1e30]), top_p=st.sampled_from([1.0, 0.9, 0.3]),
       seed=st.integers(0, 2**16))
def test_tiny_temperatures_give_the_greedy_limit(V, rows, T, scale, top_p, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g, dtype=torch.float64) * scale
    logits[:, 0] = logits.amax(-1)          # a tie at the maximum in every row: the mass is shared
    p = sampling_probs(logits, T, top_p)
    assert not torch.isnan(p).any()
    torch.testing.assert_close(p.sum(-1), torch.ones(rows, dtype=torch.float64))
    # the exact limit (gaps of a random float64 logit are >> T * 700): uniform over the tied maxima
    top = logits == logits.amax(-1, keepdim=True)
    want = top.double() / top.sum(-1, keepdim=True)
    if top_p < 1:       # the nucleus of a uniform-over-ties distribution may keep only some of the ties
        assert bool((p[~top] == 0).all()) and bool((p[top] > 0).any())
    else:
        torch.testing.assert_close(p, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("T", [0.05, 0.7, 1.0, 3.0, 1e6])
def test_ordinary_temperatures_are_the_softmax(T):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 33, generator=g) * 5
    torch.testing.assert_close(sampling_probs(logits, T), torch.softmax(logits.double() / T, -1))


def test_temperature_zero_is_greedy_and_inf_logits_are_the_maximum():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [1.0, float("inf"), 3.0, float("inf")]])
    assert torch.equal(sampling_probs(logits, 0.0), torch.tensor([[0.0, 1, 0, 0], [0, 1, 0, 0]], dtype=torch.float64))
    assert torch.equal(sampling_probs(logits[1], 0.5), torch.tensor([0, 0.5, 0, 0.5], dtype=torch.float64))
    assert sample_token(logits[0], 0.0) == 1
    g = torch.Generator().manual_seed(0)
    assert {sample_token(logits[0], 1e-300, generator=g) for _ in range(30)} == {1, 2}, "ties share the mass"


@pytest.mark.parametrize("temperature, top_p, err, match", [
    (-0.1, 1.0, ValueError, "temperature"), (math.inf, 1.0, ValueError, "temperature"),
    (math.nan, 1.0, ValueError, "temperature"), (True, 1.0, TypeError, "temperature"),
    ("1", 1.0, TypeError, "temperature"), (1.0, 0.0, ValueError, "top_p"), (1.0, 1.5, ValueError, "top_p"),
    (1.0, math.nan, ValueError, "top_p"), (1.0, None, TypeError, "top_p"),
])
def test_check_sampling_names_the_argument(temperature, top_p, err, match):
    with pytest.raises(err, match=match):
        check_sampling(temperature, top_p)
    with pytest.raises(err, match=match):
        sampling_probs(torch.zeros(3), temperature, top_p)


def test_logits_without_a_distribution_raise():
    with pytest.raises(ValueError, match="NaN"):
        sampling_probs(torch.tensor([0.0, float("nan")]), 1.0)
    with pytest.raises(ValueError, match="-inf everywhere"):
        sampling_probs(torch.full((2, 3), float("-inf")), 0.0)


def test_speculative_warp_logits_is_the_shared_rule():
    assert spec.warp_logits is sampling_probs
    p = spec.warp_logits(torch.tensor([0.0, 1.0, -2.0]), 1e-310)
    assert torch.equal(p, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
