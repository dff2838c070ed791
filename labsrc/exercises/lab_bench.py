"""Checks for the exercises of the lab-bench chapter.

Each check calls the student's function on seeded random inputs and compares it with a reference computed
here (or with a real ``transformers`` model); it prints ``passed``, what is wrong (with a hint), or
``not solved yet``. Expected answers are never printed.
"""
from __future__ import annotations

import torch

from labsrc.exercises.core import Result, check_function, exercise, randint



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
    def agrees(points):
        got = fn(points)
        return float(sorted(got) == _pareto_ref(points))
    return check_function("Pareto front", agrees, lambda points: 1.0, _pareto_inputs, trials=10,
                          hint="a point is dominated when another has x <= and y >= with at least one strict; "
                               "return the indices of the others in increasing order (ties both stay).")
