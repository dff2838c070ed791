"""Checks for the exercises of the KV-cache chapter.

Each check calls the student's function on several seeded random configurations and compares it with
:mod:`labsrc.kvmath`; it prints ``passed``, what is wrong (with a hint), or ``not solved yet`` when the
function still raises ``NotImplementedError``. Expected answers are computed here, never printed.
"""
from __future__ import annotations

import torch

from labsrc import kvmath
from labsrc.exercises.core import Result, as_number, check_function, exercise, randint




def _gqa_inputs(gen: torch.Generator) -> tuple:
    n_kv_heads = [1, 2, 4, 8][randint(gen, 0, 3)]
    n_heads = n_kv_heads * randint(gen, 1, 8)
    return (randint(gen, 1, 96), n_heads, n_kv_heads, [64, 96, 128, 256][randint(gen, 0, 3)],
            randint(gen, 1, 200_000), randint(gen, 1, 16), [1, 2, 4][randint(gen, 0, 2)])


def _gqa_reference(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return kvmath.gqa_cache_bytes(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)


@exercise
def check_gqa_bytes(fn) -> Result:
    """Check ``fn(n_layers, n_heads, n_kv_heads, head_dim, seq_len, batch, dtype_bytes) -> bytes`` of a GQA cache."""
    return check_function("KV-cache bytes of a GQA model", as_number(fn), _gqa_reference, _gqa_inputs,
                          trials=8, seed=11, rtol=1e-12, atol=0.5,
                          hint="K and V are both cached, and only the K/V heads are, not the query heads.")


def _crossover_inputs(gen: torch.Generator) -> tuple:
    n_kv_heads = [1, 2, 4, 8][randint(gen, 0, 3)]
    return (float(randint(gen, 1, 400)) * 1e9, [0.5, 1, 2][randint(gen, 0, 2)], randint(gen, 16, 128),
            n_kv_heads, [64, 128][randint(gen, 0, 1)], [1, 2][randint(gen, 0, 1)], randint(gen, 1, 64))


def _crossover_reference(n_params, weight_bytes_per_param, n_layers, n_kv_heads, head_dim, kv_dtype_bytes, batch):
    per_token = kvmath.kv_bytes_per_token(n_layers, n_kv_heads, head_dim, kv_dtype_bytes)
    return kvmath.kv_equals_weights_context(n_params * weight_bytes_per_param, per_token, batch)


@exercise
def check_kv_equals_weights(fn) -> Result:
    """Check ``fn(n_params, weight_bytes_per_param, n_layers, n_kv_heads, head_dim, kv_dtype_bytes, batch)``:
    the context length (tokens per sequence, a float) at which the batch's KV cache weighs as much as the weights."""
    return check_function("context at which the KV cache equals the weights", as_number(fn), _crossover_reference,
                          _crossover_inputs, trials=8, seed=12, rtol=1e-6,
                          hint="Divide the weights' bytes by what one token of context adds for the whole batch.")


def _waste_inputs(gen: torch.Generator) -> tuple:
    max_len = [512, 1000, 2048, 4096][randint(gen, 0, 3)]
    n = randint(gen, 1, 300)
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    return lengths, max_len


def _waste_reference(lengths, max_len):
    return 1.0 - kvmath.reservation_utilisation(lengths.numpy(), max_len)


@exercise
def check_reservation_waste(fn) -> Result:
    """Check ``fn(lengths, max_len) -> fraction`` of reserved slots left empty when each request reserves
    ``max_len`` slots and uses ``lengths[i]`` of them (``lengths`` is a 1-D int64 tensor)."""
    return check_function("fraction wasted by max-length reservation", as_number(fn), _waste_reference,
                          _waste_inputs, trials=8, seed=13, rtol=1e-6, atol=1e-9,
                          hint="Wasted = reserved - used, as a fraction of reserved; it lies between 0 and 1.")


def _mla_inputs(gen: torch.Generator) -> tuple:
    return (randint(gen, 1, 96), [128, 256, 512][randint(gen, 0, 2)], [32, 64][randint(gen, 0, 1)],
            randint(gen, 1, 200_000), [1, 2][randint(gen, 0, 1)])


def _mla_reference(n_layers, kv_lora_rank, qk_rope_head_dim, seq_len, dtype_bytes):
    return kvmath.mla_cache_bytes(n_layers, kv_lora_rank, qk_rope_head_dim, seq_len, 1, dtype_bytes)


@exercise
def check_mla_bytes(fn) -> Result:
    """Check ``fn(n_layers, kv_lora_rank, qk_rope_head_dim, seq_len, dtype_bytes) -> bytes`` of an MLA cache (batch 1)."""
    return check_function("KV-cache bytes of an MLA model", as_number(fn), _mla_reference, _mla_inputs,
                          trials=8, seed=14, rtol=1e-12, atol=0.5,
                          hint="One latent serves both K and V; the RoPE key is shared by all heads.")
