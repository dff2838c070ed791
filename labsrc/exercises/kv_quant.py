"""Checks for the exercises of the KV-cache quantization chapter.

Each check calls the student's function on seeded random inputs and compares it with the answer computed
here (from :mod:`labsrc.kvquant` or from the definition); it prints ``passed``, what is wrong with a hint,
or ``not solved yet`` while the function still raises ``NotImplementedError``. Answers are never printed.

* :func:`check_scale_zero` -- ``fn(group, bits) -> (scale, zero)`` of one quantization group.
* :func:`check_mse_ratio` -- ``fn(channel_var, per_channel_steps) -> float``, the predicted MSE ratio.
* :func:`check_cache_bytes` -- ``fn(n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size) -> bytes``.
"""
from __future__ import annotations

import torch

from labsrc import kvquant
from labsrc.exercises.core import Result, as_number, check_function, exercise, randint




# ------------------------------------------------------------------------------------------- scale and zero
def _pair_as_tensor(fn):
    """The student's ``(scale, zero)`` as a float64 tensor of two numbers; anything else is passed through
    so that the check reports what it got."""
    def wrapped(*args):
        got = fn(*args)
        try:
            s, z = got
            return torch.tensor([float(s), float(z)], dtype=torch.float64)
        except (TypeError, ValueError):
            return got
    return wrapped


def _group_inputs(gen: torch.Generator) -> tuple:
    g, d = randint(gen, 1, 64), [8, 16, 64][randint(gen, 0, 2)]
    shift, spread = float(torch.randn(1, generator=gen)) * 3, float(torch.rand(1, generator=gen)) * 4 + 0.1
    group = torch.randn(g, d, generator=gen, dtype=torch.float64) * spread + shift
    return group, [2, 4, 8][randint(gen, 0, 2)]


def _scale_zero_reference(group, bits):
    lo, hi = group.min(), group.max()
    return torch.stack([(hi - lo) / (2 ** bits - 1), lo]).to(torch.float64)


@exercise
def check_scale_zero(fn) -> Result:
    """Check ``fn(group, bits) -> (scale, zero)``: the step and the (real-valued) zero point of one group.

    Convention of the chapter: ``z`` is the value code 0 stands for, ``x_hat = q * s + z`` with ``q`` in
    ``[0, 2**bits - 1]``, and the grid spans exactly the group's range (no fp16 rounding here).
    """
    return check_function("step and zero point of a group", _pair_as_tensor(fn), _scale_zero_reference,
                          _group_inputs, trials=8, seed=21, rtol=1e-9, atol=1e-12,
                          hint="One step and one zero point cover the whole group (all its tokens and channels); "
                               "b bits give 2**b levels, hence 2**b - 1 steps between the smallest and largest value.")


# ------------------------------------------------------------------------------------------- MSE ratio
def _ratio_inputs(gen: torch.Generator) -> tuple:
    d = randint(gen, 2, 128)
    var = torch.exp(torch.randn(d, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen)) * 2)
    return var, bool(randint(gen, 0, 3) == 0)  # mostly shared steps, sometimes per-channel steps


@exercise
def check_mse_ratio(fn) -> Result:
    """Check ``fn(channel_var, per_channel_steps) -> float``: predicted MSE without / with normalisation."""
    return check_function("predicted gain of variance normalisation", as_number(fn),
                          lambda v, per: kvquant.predicted_mse_ratio(v, per_channel_steps=per), _ratio_inputs,
                          trials=10, seed=22, rtol=1e-9,
                          hint="With one shared step the widest channel sets the step for every channel; after "
                               "normalisation dequantising multiplies channel j's error by its sigma_j. "
                               "With a step per channel, compare the two errors channel by channel.")


# ------------------------------------------------------------------------------------------- bytes
def _bytes_inputs(gen: torch.Generator) -> tuple:
    return (randint(gen, 1, 40_000), randint(gen, 1, 80), [1, 2, 4, 8][randint(gen, 0, 3)],
            [64, 80, 128][randint(gen, 0, 2)], [2, 4, 8][randint(gen, 0, 2)], [32, 64, 128][randint(gen, 0, 2)])


def _bytes_reference(n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size):
    return kvquant.kv_bytes(n_tokens, n_layers, n_kv_heads, head_dim, bits=bits, group_size=group_size,
                            granularity="group", stats=True)


@exercise
def check_cache_bytes(fn) -> Result:
    """Check ``fn(n_tokens, n_layers, n_kv_heads, head_dim, bits, group_size) -> bytes`` of a KVarN cache.

    One sequence; K and V in every layer and KV head: packed codes, an fp16 step and fp16 zero point per
    group of ``group_size`` tokens (a trailing partial group is a group), and fp16 mean and std per channel.
    """
    return check_function("bytes of a KVarN cache", as_number(fn), _bytes_reference, _bytes_inputs,
                          trials=10, seed=23, rtol=1e-12, atol=0.5,
                          hint="Count per layer, per KV head, for K and for V: codes (bits/8 bytes each), "
                               "2 + 2 bytes per group (ceil(n / g) groups) and 2 + 2 bytes per channel for "
                               "the statistics.")
