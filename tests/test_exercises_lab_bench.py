"""The lab-bench chapter's exercise checks: a right answer passes, a wrong one fails, a stub is 'not solved yet'."""
import pytest
import torch

from labsrc.exercises import lab_bench as ex
from exercise_contract import (  # noqa: F401 (collected here, run over this module's CASES)
    test_hidden_cases_pass_right_and_raise_on_wrong_and_stub_in_any_mode, test_right_answer_passes,
    test_strict_mode_passes_right_and_raises_on_wrong_and_stub, test_stub_is_not_solved_yet,
    test_wrong_answer_fails_with_hint)


def stub(*args):
    raise NotImplementedError


def params_ignoring_gqa(cfg):
    # Wrong on purpose: k and v projections counted with all query heads.
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    return vocab * h * (1 if cfg["tie_word_embeddings"] else 2) + layers * per_layer + h


def wilson_lower(k, n, z=1.959963984540054):
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * torch.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return torch.where(k == 0, 0.0, centre - half)


def probe_size(p_true, threshold, power):
    """By simulation, as a student would: 4,000 probes of n samples at each n, counted as the table counts."""
    gen = torch.Generator().manual_seed(0)
    n = 10
    while True:
        k = torch.binomial(torch.full((4000,), float(n)), torch.full((4000,), p_true), generator=gen)
        rate = float((wilson_lower(k.double(), n) > threshold).double().mean())
        if rate >= power:
            return n, rate
        n += 10


def probe_size_ignoring_chance(p_true, threshold, power):
    # Wrong on purpose: the n at which a score of exactly p_true passes, as if the probe had no sampling noise.
    n = 10
    while wilson_lower(torch.tensor(p_true * n, dtype=torch.float64), n) <= threshold:
        n += 10
    return n, 1.0


def bucket_perplexity_as_shown(nll, bucket):
    """The buggy function the exercise shows: it drops a shorter last bucket and averages exp(loss)."""
    out = []
    for s in range(0, nll.shape[1] - bucket + 1, bucket):
        out.append(nll[:, s:s + bucket].exp().mean())
    return torch.stack(out)


def bucket_perplexity_keeps_mean_of_exp(nll, bucket):
    return torch.stack([nll[:, s:s + bucket].exp().mean() for s in range(0, nll.shape[1], bucket)])


def bucket_perplexity_drops_last(nll, bucket):
    return torch.stack([nll[:, s:s + bucket].mean() for s in range(0, nll.shape[1] - bucket + 1, bucket)]).exp()


def pareto_all_points(points):
    return list(range(len(points)))


# Right answers written as a student would (the reference functions themselves are refused).
def parameter_count(cfg):
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg["intermediate_size"] + 2 * h
    return cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2) + layers * per_layer + h


def bucket_perplexity(nll, bucket):
    return torch.stack([nll[:, s:s + bucket].mean() for s in range(0, nll.shape[1], bucket)]).exp()


def pareto_front(points):
    return [i for i, (x, y) in enumerate(points)
            if not any(x2 <= x and y2 >= y and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)]


def keys_needed(threshold):
    n = 1
    while n / (n + 1.959963984540054 ** 2) < threshold:
        n += 1
    return n


def keys_needed_normal_interval(threshold):
    # Wrong on purpose: the normal (Wald) interval of 1.0 has zero width, so one key "clears" any threshold.
    return 1


CASES = [
    (ex.check_parameter_count, parameter_count, params_ignoring_gqa),
    (ex.check_probe_size, probe_size, probe_size_ignoring_chance),
    (ex.check_bucket_perplexity, bucket_perplexity, bucket_perplexity_as_shown),
    (ex.check_pareto_front, pareto_front, pareto_all_points),
    (ex.check_keys_needed, keys_needed, keys_needed_normal_interval),
]


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


@pytest.mark.parametrize("check,right,wrong", CASES, ids=lambda c: getattr(c, "__name__", "fn"))
def test_each_check_judges_right_wrong_and_unsolved(check, right, wrong):
    assert check(right).status == "passed"
    assert check(wrong).status == "failed"
    assert check(stub).status == "not solved yet"


def test_keys_needed_reference_is_the_smallest_n_whose_wilson_interval_clears():
    from labsrc.claims import Estimate
    for t in (0.5, 0.8, 0.856, 0.9, 0.95, 0.99):
        n = ex.keys_needed_ref(t)
        assert Estimate.accuracy(n, n).lo >= t
        assert n == 1 or Estimate.accuracy(n - 1, n - 1).lo < t
    assert ex.keys_needed_ref(0.856) == 23   # a perfect 20 of 20 cannot clear RULER's threshold


def _via_tasks(nll, bucket):
    from labsrc import tasks
    return tasks.perplexity_by_position(nll, bucket)


def _via_alias(points):
    return _ALIAS(points)


_ALIAS = ex._pareto_ref


def _via_estimate(threshold):
    from labsrc.claims import Estimate
    n = 1
    while Estimate.accuracy(n, n).lo < threshold:
        n += 1
    return n


def _via_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM
    return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**cfg)).parameters())


@pytest.mark.parametrize("check,answer", [
    (ex.check_parameter_count, ex._llama_reference), (ex.check_parameter_count, _via_model),
    (ex.check_bucket_perplexity, ex.bucket_perplexity_ref), (ex.check_bucket_perplexity, _via_tasks),
    (ex.check_pareto_front, ex._pareto_ref), (ex.check_pareto_front, _via_alias),
    (ex.check_keys_needed, ex.keys_needed_ref), (ex.check_keys_needed, _via_estimate),
], ids=lambda x: getattr(x, "__name__", "fn"))
def test_calling_the_library_function_is_refused(check, answer, capsys):
    result = check(answer)
    assert result.status == "failed" and "compute it yourself" in result.message
    assert "compute it yourself" in capsys.readouterr().out


def test_pass_probability_is_the_binomial_sum_over_the_probe_tables_rule():
    """The exact truth the probe-size check uses: Wilson's lower end as labsrc.claims computes it, a pass when it
    lies above the threshold, summed over the binomial distribution of right answers."""
    import math
    from labsrc.claims import wilson
    for n, p, t in ((20, 0.95, 0.856), (57, 0.9, 0.8), (130, 0.97, 0.856)):
        exact = sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1) if wilson(k, n)[0] > t)
        assert abs(ex.pass_probability_ref(n, p, t) - exact) < 1e-12


def _exact_pass_probability(n, p_true, threshold):
    """The test's own exact pass probability (the checker's is refused inside an answer)."""
    from labsrc import claims
    k = torch.arange(n + 1)
    pmf = torch.distributions.Binomial(n, torch.tensor(p_true, dtype=torch.float64)).log_prob(k.double()).exp()
    return float(sum(p for j, p in zip(range(n + 1), pmf.tolist()) if claims.wilson(j, n)[0] > threshold))


def test_probe_size_says_which_part_fails_but_not_which_way():
    def too_small(p_true, threshold, power):
        n, _ = probe_size(p_true, threshold, power)
        return n - 10 if n > 10 else n, _exact_pass_probability(max(10, n - 10), p_true, threshold)

    def larger_than_needed(p_true, threshold, power):
        n, _ = probe_size(p_true, threshold, power)
        return 2 * n + 50, _exact_pass_probability(2 * n + 50, p_true, threshold)

    def rate_not_measured(p_true, threshold, power):
        return probe_size(p_true, threshold, power)[0], 1.0

    said = {f.__name__: ex.check_probe_size(f).message for f in (too_small, larger_than_needed, rate_not_measured)}
    assert all("Hint:" in m for m in said.values())
    assert "not the smallest" in said["larger_than_needed"]
    assert "pass rate" in said["rate_not_measured"]
    assert said["too_small"].split("Hint:")[0].endswith(said["larger_than_needed"].split("Hint:")[0][-80:]), \
        "a probe too small and one too large read the same: no direction for a binary search"
    assert not any(w in m for m in said.values() for w in ("too small", "too large", "off by"))


def test_probe_size_refuses_the_checkers_exact_probability():
    def search(p_true, threshold, power):
        n = 10
        while ex.pass_probability_ref(n, p_true, threshold) < power:
            n += 10
        return n, ex.pass_probability_ref(n, p_true, threshold)

    result = ex.check_probe_size(search)
    assert result.status == "failed" and "pass_probability_ref" in result.message
    assert "not a positive multiple" in ex.check_probe_size(lambda *a: (15, 0.9)).message
    assert "expected a pair" in ex.check_probe_size(lambda *a: 40).message


def test_bucket_check_fails_the_shown_function_without_naming_its_bugs():
    for buggy in (bucket_perplexity_keeps_mean_of_exp, bucket_perplexity_drops_last):
        message = ex.check_bucket_perplexity(buggy).message
        assert "trial" in message and "per-token" not in message and "last one holding" not in message
