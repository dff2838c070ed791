"""Checks for the exercises of the lab-bench chapter.

Each check calls the student's function on seeded random inputs and compares it with a reference computed
here (or with a real ``transformers`` model); it prints ``passed``, what is wrong (with a hint), or
``not solved yet``. Expected answers are never printed.
"""
from __future__ import annotations

import torch

import math

from labsrc.exercises.core import Result, check_function, exercise, randint, refuse_library


# ---------------------------------------------------------------------------------- the library-call guard
def _refuse_library(name: str, fn, forbidden: tuple):
    """A failed result if ``fn`` is or calls the library code it is asked to write (or one of this module's
    reference solutions), else None: see :func:`labsrc.exercises.core.refuse_library`."""
    return refuse_library(name, fn, forbidden + _REFERENCES,
                          "compute it yourself (plain Python and torch are enough).", owner="the lab")


# -------------------------------------------------------------------------- 1. parameters of a Llama model
def _llama_inputs(gen: torch.Generator) -> tuple:
    n_kv = [1, 2, 4][randint(gen, 0, 2)]
    n_heads = n_kv * randint(gen, 1, 4)
    head_dim = [8, 16, 24][randint(gen, 0, 2)]
    return dict(vocab_size=randint(gen, 50, 300), hidden_size=n_heads * head_dim,
                intermediate_size=randint(gen, 16, 200), num_hidden_layers=randint(gen, 1, 4),
                num_attention_heads=n_heads, num_key_value_heads=n_kv,
                tie_word_embeddings=bool(randint(gen, 0, 1))),


def _llama_reference(cfg: dict) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**cfg))
    return sum(p.numel() for p in model.parameters())


@exercise
def check_parameter_count(fn) -> Result:
    """``fn(cfg: dict) -> int``: the parameters of a ``LlamaForCausalLM`` built from ``cfg`` (compared with a
    real model on random configurations, tied and untied embeddings, several GQA ratios)."""
    import transformers

    refused = _refuse_library("parameter count of a Llama model", fn,
                              (transformers, transformers.LlamaForCausalLM, transformers.LlamaModel,
                               transformers.AutoModelForCausalLM, transformers.AutoModel,
                               transformers.PreTrainedModel.num_parameters, torch.Tensor.numel))
    if refused is not None:
        return refused
    return check_function("parameter count of a Llama model", fn, _llama_reference, _llama_inputs, trials=6,
                          hint="count embeddings, q/k/v/o (k and v have num_key_value_heads heads), the three "
                               "SwiGLU matrices, two RMSNorm weights per layer, the final norm, and the LM head "
                               "unless it is tied to the embeddings; Llama's linear layers have no biases.")


# -------------------------------------------------------------------------- 2. effective context length
def effective_context_length_ref(lengths, accuracy, threshold):
    best = 0
    for length, acc in sorted(zip(lengths, accuracy)):
        if acc < threshold:
            break
        best = length
    return best


def _ecl_inputs(gen: torch.Generator) -> tuple:
    n = randint(gen, 3, 8)
    lengths = sorted(set(int(x) for x in torch.randint(16, 4096, (n,), generator=gen)))
    acc = [round(float(a), 2) for a in torch.rand(len(lengths), generator=gen) * 0.4 + 0.6]
    order = torch.randperm(len(lengths), generator=gen).tolist()  # unsorted input on purpose
    return [lengths[i] for i in order], [acc[i] for i in order], [0.8, 0.85, 0.9][randint(gen, 0, 2)]


@exercise
def check_effective_context_length(fn) -> Result:
    """``fn(lengths, accuracy, threshold) -> int``: RULER's effective context length."""
    refused = _refuse_library("effective context length", fn, (effective_context_length_ref,))
    if refused is not None:
        return refused
    return check_function("effective context length", fn, effective_context_length_ref, _ecl_inputs, trials=8,
                          hint="sort by length first; it is the longest length such that every length up to and "
                               "including it meets the threshold (0 if the shortest already fails).")


# -------------------------------------------------------------------------- 3. perplexity by position bucket
def bucket_perplexity_ref(nll: torch.Tensor, bucket: int) -> torch.Tensor:
    n = nll.shape[-1]
    means = [nll[..., s:s + bucket].mean() for s in range(0, n, bucket)]
    return torch.stack(means).exp()


def _bucket_inputs(gen: torch.Generator) -> tuple:
    rows, n = randint(gen, 1, 5), randint(gen, 5, 97)
    return torch.rand(rows, n, generator=gen, dtype=torch.float64) * 8, randint(gen, 1, 20)


@exercise
def check_bucket_perplexity(fn) -> Result:
    """``fn(nll, bucket) -> tensor``: perplexity per position bucket of a ``(windows, positions)`` loss table."""
    from labsrc import tasks

    refused = _refuse_library("perplexity by position bucket", fn, (tasks, tasks.perplexity_by_position))
    if refused is not None:
        return refused
    return check_function("perplexity by position bucket", fn, bucket_perplexity_ref, _bucket_inputs, trials=6,
                          hint="average the loss over windows *and* over the positions of a bucket, then take "
                               "exp; the last bucket may be shorter than the others.")


def _pareto_ref(points):
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def _pareto_inputs(gen: torch.Generator) -> tuple:
    n = randint(gen, 2, 12)
    xs = torch.randint(1, 9, (n,), generator=gen).tolist()
    ys = torch.randint(0, 6, (n,), generator=gen).tolist()
    return (list(zip(map(float, xs), [y / 5 for y in ys])),)


@exercise
def check_pareto_front(fn) -> Result:
    """``fn(points) -> list of indices``: the points no other point beats (less bytes *and* more accuracy)."""
    from labsrc import ledger

    refused = _refuse_library("Pareto front", fn, (ledger, ledger.Ledger.pareto))
    if refused is not None:
        return refused

    def agrees(points):
        got = fn(points)
        return float(sorted(got) == _pareto_ref(points))
    return check_function("Pareto front", agrees, lambda points: 1.0, _pareto_inputs, trials=10,
                          hint="a point is dominated when another has x <= and y >= with at least one strict; "
                               "return the indices of the others in increasing order (ties both stay).")


# -------------------------------------------------------------------------- 5. how many keys a verdict needs
Z95 = 1.959963984540054  # the two-sided 95% normal quantile, as in labsrc.claims


def keys_needed_ref(threshold: float) -> int:
    """Smallest n such that n right out of n has a 95% Wilson interval whose lower end is >= threshold.

    With k = n the Wilson lower end is n / (n + z^2), so n >= z^2 t / (1 - t).
    """
    n = max(1, math.ceil(Z95 ** 2 * threshold / (1 - threshold) - 1e-9))
    while n / (n + Z95 ** 2) < threshold:   # guard the rounding of the closed form
        n += 1
    while n > 1 and (n - 1) / (n - 1 + Z95 ** 2) >= threshold:
        n -= 1
    return n


def _keys_inputs(gen: torch.Generator) -> tuple:
    return (round(0.5 + 0.49 * float(torch.rand((), generator=gen, dtype=torch.float64)), 4),)


@exercise
def check_keys_needed(fn) -> Result:
    """``fn(threshold) -> int``: the fewest keys, all answered right, whose 95% Wilson interval lies wholly at
    or above ``threshold`` (checked on random thresholds in [0.5, 0.99])."""
    from labsrc import claims

    refused = _refuse_library("keys needed for a clear pass", fn, (claims, claims.Estimate, claims.wilson))
    if refused is not None:
        return refused
    return check_function("keys needed for a clear pass", fn, keys_needed_ref, _keys_inputs, trials=8,
                          hint="set k = n in the Wilson interval's lower end and simplify; then find the "
                               "smallest whole n that clears the threshold (check n - 1 fails).")


# The reference solutions themselves (passed in directly) are refused too.
_REFERENCES = (effective_context_length_ref, bucket_perplexity_ref, _pareto_ref, _llama_reference, keys_needed_ref)
