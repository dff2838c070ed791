"""Each FlashAttention exercise check passes a right answer, fails a wrong one (and raises in strict mode), and
reports "not solved yet" for the student-build stub."""
import labsrc  # noqa: F401

import math

import pytest
import torch

from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    lenient, test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)
from labsrc.exercises import flash_attention as ex


def right_merge(m1, l1, o1, m2, l2, o2):
    m = torch.maximum(m1, m2)
    a1, a2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    return (a1[:, None] * o1 + a2[:, None] * o2) / (a1 + a2)[:, None]


def wrong_merge_forgets_max(m1, l1, o1, m2, l2, o2):
    return (l1[:, None] * o1 + l2[:, None] * o2) / (l1 + l2)[:, None]


def right_naive(T, D, dtype_bytes):
    return dtype_bytes * (2 * T * D + T * T + 2 * T * T + T * T + T * D + T * D)


def wrong_naive_no_round_trip(T, D, dtype_bytes):
    return dtype_bytes * (4 * T * D + T * T)


def right_tiled_causal(T, D, block_m, dtype_bytes):
    keys = sum(min(i + block_m, T) for i in range(0, T, block_m))
    return dtype_bytes * D * (2 * T + 2 * keys)


def wrong_tiled_causal_full_blocks(T, D, block_m, dtype_bytes):
    keys = sum((i + 1) * block_m for i in range(math.ceil(T / block_m)))
    return dtype_bytes * D * (2 * T + 2 * keys)


def right_tile(k, start, block_n, block_d):
    T, D = k.shape
    offs_n = start + torch.arange(block_n)
    offs_d = torch.arange(block_d)
    mask = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    return ex.tl_load(k.flatten(), offs_n[:, None] * D + offs_d[None, :], mask, other=0.0)


def wrong_tile_no_column_mask(k, start, block_n, block_d):
    T, D = k.shape
    offs_n = start + torch.arange(block_n)
    offs_d = torch.arange(block_d)
    mask = offs_n[:, None] < T
    return ex.tl_load(k.flatten(), offs_n[:, None] * D + offs_d[None, :], mask, other=0.0)


CASES = [
    (ex.check_merge, right_merge, wrong_merge_forgets_max),
    (ex.check_naive_bytes, right_naive, wrong_naive_no_round_trip),
    (ex.check_tiled_causal_bytes, right_tiled_causal, wrong_tiled_causal_full_blocks),
    (ex.check_key_tile, right_tile, wrong_tile_no_column_mask),
]


def test_tl_load_masks_and_faults():
    flat = torch.arange(6.0)
    got = ex.tl_load(flat, torch.tensor([0, 5, 6, 7]), torch.tensor([True, True, False, False]), other=-1.0)
    assert got.tolist() == [0.0, 5.0, -1.0, -1.0]
    with pytest.raises(IndexError, match="outside the buffer"):
        ex.tl_load(flat, torch.tensor([6]), torch.tensor([True]))
