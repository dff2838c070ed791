"""Checks for the exercises of the lab-bench chapter.

Each check calls the student's function on seeded random inputs and compares it with a reference computed
here (or with a real ``transformers`` model); it prints ``passed``, what is wrong (with a hint), or
``not solved yet``. Expected answers are never printed.
"""
from __future__ import annotations

import torch

import math

from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, HIDDEN_TRIALS, PASSED, Result, _call, _report,
                                   _with_hint, check_function, exercise, hidden, randint, refuse_library)


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
                          explain=_explain_parameters,
                          hint="re-read 'The models' and print the named parameters of a small model built from "
                               "the failing configuration: the difference above says in which part your count "
                               "is off.")


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
        return (f"the pass rate you measured at n={n} is off by more than {PROBE_TOLERANCE} from the probability "
                f"that n samples pass: is each simulated probe judged as the probe table judges it?")
    if exact < power - PROBE_TOLERANCE:
        return f"at n={n} the probe passes less often than {power:.0%} of the time: n is too small."
    for m in range(PROBE_STEP, n, PROBE_STEP):
        if pass_probability_ref(m, p_true, threshold) >= power + PROBE_TOLERANCE:
            return f"a probe of {m} samples already passes at least {power:.0%} of the time: n is not the smallest."
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
    trials = 3 * (HIDDEN_TRIALS if hidden() else 1)
    gen = torch.Generator().manual_seed(21 + (HIDDEN_SEED_OFFSET if hidden() else 0))
    for trial in range(trials):
        case = _probe_inputs(gen)
        got, unsolved = _call(fn, *case)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        problem = _probe_problem(got, *case)
        if problem:
            what = f"trial {trial + 1} (p_true={case[0]}, threshold={case[1]}, power={case[2]})"
            return _report(Result(name, FAILED, _with_hint(f"{what}: {problem}", hint)))
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
                          explain=_explain_buckets,
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

    name, trials, seed = "Pareto front", 10, 0
    if hidden():
        trials, seed = trials * HIDDEN_TRIALS, seed + HIDDEN_SEED_OFFSET
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
            return _report(Result(name, FAILED, _with_hint(
                f"trial {trial + 1} with points {points}: {_explain_pareto(got, points)}",
                "re-read Exercise 4's task on which point beats which, and check the point named above "
                "against it by hand.")))
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
                          explain=_explain_keys,
                          hint="re-read the Wilson interval in 'Which probes `lab-target` passes, and why' and "
                               "evaluate its lower end for your n and for n - 1.")


# ------------------------------------------------------------------------- what a failed trial looks like
def _explain_parameters(got, expected, cfg) -> str:
    """Say in units of the configuration's sizes how far a wrong parameter count is from the real model's."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return ""
    diff, h, vocab = int(got) - int(expected), cfg["hidden_size"], cfg["vocab_size"]
    sign = "more" if diff > 0 else "fewer"
    units = [(vocab * h, "vocab_size x hidden_size"), (h * cfg["intermediate_size"], "hidden_size x intermediate_size"),
             (h * h, "hidden_size x hidden_size"), (h, "hidden_size")]
    for unit, said in units:
        if diff and diff % unit == 0:
            return (f"Your count has {abs(diff) // unit} x ({said}) {sign} parameters than the model "
                    f"(tie_word_embeddings={cfg['tie_word_embeddings']}).")
    return f"Your count has {abs(diff)} {sign} parameters than the model."


def _explain_buckets(got, expected, nll, bucket) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return (f"{nll.shape[1]} positions in buckets of {bucket} make {expected.numel()} buckets, the last one "
                f"holding {nll.shape[1] - bucket * (expected.numel() - 1)} positions.")
    ok = torch.isclose(got.double(), expected.double(), rtol=1e-5, atol=1e-6)
    if bool(ok[:-1].all()) and not bool(ok[-1]):
        return "only the last, shorter bucket is wrong."
    per_token = torch.stack([nll[..., s:s + bucket].exp().mean() for s in range(0, nll.shape[-1], bucket)])
    if torch.allclose(got.double(), per_token.double(), rtol=1e-5, atol=1e-6):
        return ("each of your values averages the per-token perplexities of its bucket, which is not the "
                "perplexity of the bucket.")
    return ""


def _explain_pareto(got, points) -> str:
    try:
        got = sorted(int(i) for i in got)
    except (TypeError, ValueError):
        return f"{got!r} is not a list of indices into points."
    front = _pareto_ref(points)
    missing = [i for i in front if i not in got]
    extra = [i for i in got if i not in front]
    if missing:
        return f"point {missing[0]} {points[missing[0]]} is beaten by no other point, but your answer leaves it out."
    if extra:
        return f"point {extra[0]} {points[extra[0]]} is beaten by another point, but your answer keeps it."
    return "the indices repeat or are out of range."


def _wilson_lower(n: int) -> float:
    """The 95% Wilson interval's lower end for n right out of n (the value the chapter's table prints)."""
    from labsrc import claims

    return claims.wilson(n, n)[0]


def _explain_keys(got, expected, threshold) -> str:
    if not isinstance(got, int) or isinstance(got, bool) or got < 1:
        return "the answer is a whole number of keys, at least 1."
    if _wilson_lower(got) < threshold:
        return f"with {got} keys all right the interval's lower end is still below {threshold}."
    return f"{got - 1} keys all right already clear {threshold}: yours is not the fewest."


# The reference solutions themselves (passed in directly) are refused too.
_REFERENCES = (bucket_perplexity_ref, _pareto_ref, _llama_reference, keys_needed_ref)
