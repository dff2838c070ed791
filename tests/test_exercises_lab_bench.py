"""The lab-bench chapter's exercise checks: a right answer passes, a wrong one fails, a stub is 'not solved yet'."""
import pytest
import torch

from labsrc.exercises import lab_bench as ex


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


CASES = [
    (ex.check_parameter_count, lambda cfg: ex._llama_reference(cfg), params_ignoring_gqa),
    (ex.check_effective_context_length, ex.effective_context_length_ref, ecl_ignoring_order),
    (ex.check_bucket_perplexity, ex.bucket_perplexity_ref, bucket_perplexity_of_means_wrong),
    (ex.check_pareto_front, ex._pareto_ref, pareto_all_points),
]


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)


@pytest.mark.parametrize("check,right,wrong", CASES, ids=lambda c: getattr(c, "__name__", "fn"))
def test_each_check_judges_right_wrong_and_unsolved(check, right, wrong):
    assert check(right).status == "passed"
    assert check(wrong).status == "failed"
    assert check(stub).status == "not solved yet"
