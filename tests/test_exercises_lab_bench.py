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


def ecl_ignoring_order(lengths, accuracy, threshold):
    # Wrong on purpose: the longest passing length, even after a failure.
    return max([n for n, a in zip(lengths, accuracy) if a >= threshold], default=0)


def bucket_perplexity_of_means_wrong(nll, bucket):
    # Wrong on purpose: mean of exponentials instead of exponential of the mean NLL.
    return torch.stack([nll[..., s:s + bucket].exp().mean() for s in range(0, nll.shape[-1], bucket)])


def pareto_all_points(points):
    return list(range(len(points)))


# Right answers written as a student would (the reference functions themselves are refused).
def parameter_count(cfg):
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg["intermediate_size"] + 2 * h
    return cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2) + layers * per_layer + h


def effective_context_length(lengths, accuracy, threshold):
    best = 0
    for length, acc in sorted(zip(lengths, accuracy)):
        if acc < threshold:
            break
        best = length
    return best


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
    (ex.check_effective_context_length, effective_context_length, ecl_ignoring_order),
    (ex.check_bucket_perplexity, bucket_perplexity, bucket_perplexity_of_means_wrong),
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
    (ex.check_effective_context_length, ex.effective_context_length_ref),
    (ex.check_bucket_perplexity, ex.bucket_perplexity_ref), (ex.check_bucket_perplexity, _via_tasks),
    (ex.check_pareto_front, ex._pareto_ref), (ex.check_pareto_front, _via_alias),
    (ex.check_keys_needed, ex.keys_needed_ref), (ex.check_keys_needed, _via_estimate),
], ids=lambda x: getattr(x, "__name__", "fn"))
def test_calling_the_library_function_is_refused(check, answer, capsys):
    result = check(answer)
    assert result.status == "failed" and "compute it yourself" in result.message
    assert "compute it yourself" in capsys.readouterr().out
