"""Checks for the exercises of the lab-bench chapter.

Each check calls the student's function on seeded random inputs and compares it with a reference computed
here (or with a real ``transformers`` model); it prints ``passed``, what is wrong (with a hint), or
``not solved yet``. Expected answers are never printed.
"""
from __future__ import annotations

import torch

import math

from labsrc.exercises.core import (PASSED, Refused, Result, _call, _report, check_function, exercise, fail,
                                   guarded, randint, refusal, refuse_library, seed_for, trials_for)


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
                          forbidden=(transformers, torch.Tensor.numel, *_REFERENCES), owner="the lab",
                          hint="re-read 'The models' and count each kind of weight of the failing configuration "
                               "by hand, the embeddings and the head included.")


# -------------------------------------------------------------------------- 2. how many samples a probe needs
PROBE_STEP = 10
"""Probe sizes the experiment searches: multiples of ten samples."""
PROBE_TOLERANCE = 0.03
"""How far a simulated pass rate may be from the exact one (3 standard errors of 2,000 simulated probes, and
the margin by which a probe size may miss the target or a smaller one may reach it)."""


def _wilson_lower_ends(k: torch.Tensor, n: int) -> torch.Tensor:
    """The 95% Wilson interval's lower end for each count in ``k`` out of ``n`` (float64), as in labsrc.claims."""
    p, z2 = k.double() / n, Z95 ** 2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * torch.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return torch.where(k == 0, torch.zeros_like(p), (centre - half).clamp_min(0.0))


def pass_probability_ref(n: int, p_true: float, threshold: float) -> float:
    """The exact probability that a probe of ``n`` samples of a model whose accuracy is ``p_true`` *passes*: its
    whole 95% Wilson interval lies above ``threshold`` (a sum over the binomial distribution of right answers)."""
    k = torch.arange(n + 1)
    log_pmf = torch.distributions.Binomial(n, torch.tensor(p_true, dtype=torch.float64)).log_prob(k.double())
    return float((log_pmf.exp() * (_wilson_lower_ends(k, n) > threshold)).sum())


def _probe_inputs(gen: torch.Generator) -> tuple:
    p_true = [0.9, 0.92, 0.95, 0.97, 0.99][randint(gen, 0, 4)]
    threshold = [0.8, 0.856][randint(gen, 0, 1)]
    return p_true, threshold, [0.5, 0.8, 0.9][randint(gen, 0, 2)]


def _probe_problem(got, p_true: float, threshold: float, power: float) -> str | None:
    """What is wrong with the answer ``(n, pass_rate)`` for one case, or None."""
    try:
        n, rate = got
        n, rate = int(n), float(rate)
        if n != got[0]:
            raise ValueError
    except (TypeError, ValueError):
        return f"expected a pair (n, measured pass rate), got {got!r}."
    if n < PROBE_STEP or n % PROBE_STEP:
        return f"n={n} is not a positive multiple of {PROBE_STEP}."
    exact = pass_probability_ref(n, p_true, threshold)
    if abs(rate - exact) > PROBE_TOLERANCE:
        return ("the pass rate returned with n is not within the tolerance of the probability that a probe of n "
                "samples passes: is each simulated probe judged as the probe table judges it?")
    smaller = any(pass_probability_ref(m, p_true, threshold) >= power + PROBE_TOLERANCE
                  for m in range(PROBE_STEP, n, PROBE_STEP))
    if exact < power - PROBE_TOLERANCE or smaller:
        # one message for both ways of missing: saying which would allow a binary search on n
        return "n is not the smallest multiple of ten samples whose probe passes with the required probability."
    return None


@exercise
def check_probe_size(fn) -> Result:
    """``fn(p_true, threshold, power) -> (n, pass_rate)``: the smallest multiple of ten samples for which a probe
    of a model whose accuracy is ``p_true`` *passes* (its whole 95% Wilson interval above ``threshold``) with
    probability at least ``power``, and the pass rate the student measured at that n by simulation.

    The truth is the exact pass probability (a sum over the binomial distribution); a simulated rate, and the
    choice of n near the target, may be off by ``PROBE_TOLERANCE``."""
    name = "how many samples a probe needs"
    hint = ("re-read 'Which probes `lab-target` passes, and why' for when a probe passes, then simulate many probes "
            "of n samples each for the failing case and count how many pass.")
    trials = trials_for(3)
    gen = torch.Generator().manual_seed(seed_for(21))
    # the checker's exact pass probability (pass_probability_ref) is refused inside the answer: a search with it
    # would replace the simulation the exercise asks for
    answer = guarded(fn, (pass_probability_ref, _wilson_lower_ends))
    for trial in range(trials):
        case = _probe_inputs(gen)
        try:
            got, unsolved = _call(answer, *case)
        except Refused as refused:
            return refusal(name, refused.names, hint, owner="the lab")
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        problem = _probe_problem(got, *case)
        if problem:
            what = f"trial {trial + 1} of {trials}, p_true={case[0]}, threshold={case[1]}, power={case[2]}"
            return fail(name, what, problem, hint)
    return _report(Result(name, PASSED, f"the right probe size, and a measured pass rate that agrees, on {trials} "
                                        "cases."))


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
                          forbidden=(tasks, *_REFERENCES), owner="the lab",
                          hint="re-read the task of the exercise, then work the sizes of the failing trial "
                               "by hand: which buckets there are, and what the perplexity of one bucket is, pooled "
                               "over every window.")


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

    name, trials, seed = "Pareto front", trials_for(10), seed_for(0)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        points, = _pareto_inputs(gen)
        got, unsolved = _call(fn, points)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        try:
            right = sorted(got) == _pareto_ref(points)
        except TypeError:
            right = False
        if not right:
            # the whole set is judged: naming the point that is missing or extra would let a search find it
            return fail(name, f"trial {trial + 1} of {trials}, points {points}",
                        "the indices returned are not exactly the points that no other point beats.",
                        "re-read Exercise 4's task on which point beats which, and check every point of this "
                        "trial against it by hand.")
    return _report(Result(name, PASSED, f"agrees with the reference on {trials} random inputs."))


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
                          forbidden=(claims, *_REFERENCES), owner="the lab",
                          hint="re-read the Wilson interval in 'Which probes `lab-target` passes, and why' and "
                               "work the interval of the failing threshold by hand.")


# The reference solutions themselves (passed in directly) are refused too.
_REFERENCES = (bucket_perplexity_ref, _pareto_ref, _llama_reference, keys_needed_ref)
