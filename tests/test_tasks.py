"""The probes: deterministic from a seed, exact lengths, answers that can be checked from the text itself."""
from __future__ import annotations

import math
import random
import re

import pytest
import torch

from labsrc import tasks
from labsrc.data import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _sample(tok, task, seed, context_len=300, **kw):
    return tasks.make_sample(task, tok, context_len, random.Random(seed), **kw)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_generators_are_deterministic_and_exact_length(tok, task):
    for context_len in (257, 300):
        a, b = _sample(tok, task, 7, context_len), _sample(tok, task, 7, context_len)
        assert a.ids == b.ids and a.spans == b.spans
        assert len(a.ids) == context_len
        assert a.ids[0] == tok.bos_token_id
        assert _sample(tok, task, 8, context_len).ids != a.ids  # another seed, another sample


def test_passkey_answer_is_the_key_stated_at_its_depth(tok):
    for depth in (0.0, 0.5, 1.0):
        s = tasks.passkey_sample(tok, 400, depth, random.Random(3))
        key = s.meta["key"]
        assert tok.decode(s.answer_ids) == f" {key}"
        prompt = tok.decode(s.prompt_ids)
        assert prompt.count(f"The pass key is {key}.") == 1
        assert prompt.endswith("What is the pass key? The pass key is")
        where = prompt.index(f"The pass key is {key}.") / len(prompt)
        assert abs(where - depth) < 0.25, (depth, where)


def test_passkey_decoys_are_other_numbers_and_leave_the_key_alone(tok):
    plain = tasks.passkey_sample(tok, 400, 0.4, random.Random(11))
    again = tasks.passkey_sample(tok, 400, 0.4, random.Random(11), n_decoys=0)
    assert again.ids == plain.ids  # the probe (no decoys) is the same sample it always was
    for seed in range(20):
        s = tasks.passkey_sample(tok, 400, 0.4, random.Random(seed), split="train", n_decoys=3)
        assert len(s.ids) == 400 and s.meta["n_decoys"] == 3
        key = s.meta["key"]
        assert tok.decode(s.answer_ids) == f" {key}"
        prompt = tok.decode(s.prompt_ids)
        assert prompt.count(f"The pass key is {key}.") == 1
        assert len(s.meta["decoys"]) == 3
        for decoy in s.meta["decoys"]:
            assert re.search(r"\d", decoy) and decoy.strip() in prompt
        # three decoys put at least three numbers other than the key into the prose
        assert len([n for n in re.findall(r"\d+", prompt) if n != key]) >= 3


def test_needle_answer_matches_its_key_among_distractors(tok):
    s = tasks.needle_sample(tok, 500, 0.3, random.Random(5), n_distractors=4)
    text = tok.decode(s.prompt_ids)
    found = dict(re.findall(r"The special magic number for (\w+) is (\d+)\.", text))
    assert len(found) == 5
    assert found[s.meta["key"]] == s.meta["value"] == tok.decode(s.answer_ids).strip()


def test_mqar_answers_follow_the_listed_pairs(tok):
    s = tasks.mqar_sample(tok, 400, random.Random(2), n_pairs=6)
    text = tok.decode(s.ids)
    listed = dict(re.findall(r"(\w+): (\d{3})", text.split("\n\n")[0]))
    assert listed == s.meta["pairs"]
    queried = text.split("Recall the pairs.")[1]
    assert len(s.spans) == 6
    for (a, e), (k, v) in zip(s.spans, re.findall(r" (\w+): (\d{3}),", queried)):
        assert tok.decode(s.ids[a:e]).strip() == v == listed[k]


def test_variable_tracking_answer_follows_the_chain(tok):
    for hops in (0, 1, 3):
        s = tasks.variable_tracking_sample(tok, 600, random.Random(hops), n_hops=hops)
        text = tok.decode(s.prompt_ids)
        assign = dict(re.findall(r"VAR (\w{3}) = (VAR \w{3}|\d+)\.", text))
        assert len(assign) == 2 * (hops + 1)
        value, steps = f"VAR {s.meta['variable']}", 0
        while value.startswith("VAR "):
            value, steps = assign[value[4:]], steps + 1
        assert steps == hops + 1
        assert value == s.meta["value"] == tok.decode(s.answer_ids).strip()


class _Oracle(torch.nn.Module):
    """A fake LM that knows the sequences it is scored on and predicts each next token (or a wrong one)."""

    def __init__(self, samples, vocab, wrong=False):
        super().__init__()
        self.config = object()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.table = {tuple(s.ids): s.ids for s in samples}
        self.vocab, self.wrong = vocab, wrong

    def forward(self, input_ids):
        out = torch.zeros(*input_ids.shape, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            nxt = row[1:] + [0]
            for t, n in enumerate(nxt):
                out[b, t, (n + 1) % self.vocab if self.wrong else n] = 1.0
        return type("Out", (), {"logits": out})


def test_score_counts_an_answer_right_only_when_every_token_is_right(tok):
    rng = random.Random(0)
    samples = [tasks.passkey_sample(tok, 160, 0.5, rng) for _ in range(3)] + [tasks.mqar_sample(tok, 200, rng, 3)]
    assert tasks.accuracy(_Oracle(samples, len(tok)), samples, batch_size=2) == 1.0
    assert tasks.accuracy(_Oracle(samples, len(tok), wrong=True), samples) == 0.0


class _Uniform(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.config, self.vocab = object(), vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size(tok):
    res = tasks.perplexity_by_position(_Uniform(len(tok)), tok, context_len=65, bucket=16, n_windows=3)
    assert res["positions"] == [0, 16, 32, 48]
    assert all(math.isclose(p, len(tok), rel_tol=1e-5) for p in res["perplexity"])  # fp32 logits
    assert math.isclose(res["overall"], len(tok), rel_tol=1e-5)


def test_bad_arguments_raise_clear_errors(tok):
    with pytest.raises(ValueError, match="too short"):
        tasks.passkey_sample(tok, 20, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        tasks.passkey_sample(tok, 200, 1.5, random.Random(0))
    with pytest.raises(ValueError, match="context_len"):
        tasks.needle_sample(tok, 0, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_sample("sudoku", tok, 200, random.Random(0))
    with pytest.raises(ValueError, match="n_pairs"):
        tasks.mqar_sample(tok, 300, random.Random(0), n_pairs=0)
    with pytest.raises(ValueError, match="n_hops"):
        tasks.variable_tracking_sample(tok, 300, random.Random(0), n_hops=-1)
    with pytest.raises(ValueError, match="n_decoys"):
        tasks.passkey_sample(tok, 300, 0.5, random.Random(0), n_decoys=-1)
    with pytest.raises(ValueError, match="n_distractors"):
        tasks.needle_sample(tok, 300, 0.5, random.Random(0), n_distractors=99)
    with pytest.raises(TypeError, match="model must be"):
        tasks.passkey_accuracy("gpt", tok, 128, [0.5], n=1)
    with pytest.raises(ValueError, match="n must be"):
        tasks.passkey_accuracy(_Uniform(len(tok)), tok, 128, [0.5], n=0)
    with pytest.raises(ValueError, match="depths must not be empty"):
        tasks.passkey_accuracy(_Uniform(len(tok)), tok, 128, [], n=1)
    with pytest.raises(ValueError, match="bucket"):
        tasks.perplexity_by_position(_Uniform(len(tok)), tok, 64, bucket=0)


def test_copy_training_sample_repeats_its_words(tok):
    s = tasks.copy_sample(tok, None, random.Random(4), n_words=7)
    t = tasks.copy_sample(tok, 200, random.Random(4), n_words=7)
    for sample in (s, t):
        text = tok.decode(sample.ids[1:])
        words = sample.meta["words"]
        assert len(words.split()) == 7 and text.startswith(f"Copy these words: {words}.")
        assert tok.decode(sample.answer_ids) == f" {words}"
    assert len(t.ids) == 200 and len(s.ids) < 200


# --- property-based: any length, depth and seed gives a well-formed sample; any bad argument a clear error ----
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_PROPS
@given(task=st.sampled_from(tasks.TASKS), context_len=st.integers(200, 1500), seed=st.integers(0, 2**32))
def test_any_sample_is_exact_length_with_checkable_answers(tok, task, context_len, seed):
    s = _sample(tok, task, seed, context_len)
    assert len(s.ids) == context_len and s.ids[0] == tok.bos_token_id
    assert s.spans and all(0 < a < b <= context_len for a, b in s.spans)
    assert s.spans == sorted(s.spans), "answers in the order they come"
    assert s.prompt_ids + s.answer_ids == s.ids[: s.spans[0][1]]


@_PROPS
@given(context_len=st.integers(120, 1200), depth=st.floats(0, 1), seed=st.integers(0, 2**32),
       n_decoys=st.integers(0, 3))
def test_passkey_key_sits_where_asked_and_is_the_answer(tok, context_len, depth, seed, n_decoys):
    s = tasks.passkey_sample(tok, context_len, depth, random.Random(seed), n_decoys=n_decoys)
    key = s.meta["key"]
    assert tok.decode(s.answer_ids) == f" {key}"
    needle = tasks._enc(tok, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    starts = [i for i in range(len(s.prompt_ids)) if s.prompt_ids[i:i + len(needle)] == needle]
    assert len(starts) == 1, "the key is stated exactly once"
    # Its position in the filler: within a decoy's length of depth x (filler length).
    head = len(tasks._enc(tok, "There is a pass key hidden in this text. Find it and remember it.\n\n")) + 1
    fill = context_len - len(s.ids[s.spans[0][0]:]) - len(tasks._enc(tok, "\n\nWhat is the pass key? The pass key is")) \
        - head - len(needle) - sum(len(tasks._enc(tok, d)) for d in s.meta["decoys"])
    before_decoys = sum(len(tasks._enc(tok, d)) for d in s.meta["decoys"])
    assert abs((starts[0] - head) - depth * fill) <= before_decoys + 1


@pytest.mark.parametrize("bad", [float("nan"), -0.01, 1.01, float("inf"), "0.5", None])
def test_bad_depth_names_the_argument(tok, bad):
    with pytest.raises(ValueError, match="depth must be a number in"):
        tasks.passkey_sample(tok, 300, bad, random.Random(0))
    with pytest.raises(ValueError, match="depth must be a number in"):
        tasks.needle_sample(tok, 300, bad, random.Random(0))


@_PROPS
@given(bad=st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=3)))
def test_bad_context_len_names_the_argument(tok, bad):
    with pytest.raises(ValueError, match="context_len must be a positive int"):
        tasks.passkey_sample(tok, bad, 0.5, random.Random(0))


def test_a_context_longer_than_the_corpus_is_refused_clearly(tok):
    too_long = len(tasks.corpus_ids(tok, "validation")) + 1000
    with pytest.raises(ValueError, match="context_len=.* needs more filler than the 'validation' split holds"):
        tasks.passkey_sample(tok, too_long, 0.5, random.Random(0))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_copy_word_count_names_the_argument(tok, bad):
    with pytest.raises(ValueError, match="n_words must be a positive int"):
        tasks.copy_sample(tok, None, random.Random(0), n_words=bad)


def test_probe_and_training_keys_and_values_are_disjoint_classes():
    assert not set(tasks.KEYS) & set(tasks.TRAIN_KEYS) and len(set(tasks.TRAIN_KEYS)) == len(tasks.TRAIN_KEYS)
    assert tasks.keys_for("validation") == tasks.KEYS and tasks.keys_for("train") == tasks.TRAIN_KEYS
    for n in range(1, 7):  # every length a generator draws has values of both classes
        rng = random.Random(n)
        for split in tasks.SPLITS:
            v = tasks._digits(rng, n, split)
            assert len(v) == n and tasks.value_split(v) == split
    share = sum(tasks.value_split(str(v)) == "train" for v in range(10000, 100000)) / 90000
    assert 0.45 < share < 0.55, "the hash splits the values about in half"
    with pytest.raises(ValueError, match="split must be one of"):
        tasks.passkey_sample(load_tokenizer(), 200, 0.5, random.Random(0), split="test")


def test_passage_sample_quotes_validation_prose_and_scores_every_token():
    tok = load_tokenizer()
    s = tasks.passage_sample(tok, 400, 0.3, random.Random(2), n_tokens=50)
    assert len(s.ids) == 400 and len(s.spans) == 50 and all(e - a == 1 for a, e in s.spans)
    answer = s.ids[s.spans[0][0]:s.spans[-1][1]]
    quote = s.ids[:s.spans[0][0]]
    first = next(i for i in range(len(quote)) if quote[i:i + 50] == answer)  # quoted earlier, whole
    assert 0.15 < first / 400 < 0.45, "at its depth"
    text = tasks.corpus_ids(tok, "validation")
    assert (text.unfold(0, 50, 1) == torch.tensor(answer)).all(1).any(), "a window of the validation text"
    assert tok.decode(s.ids[s.spans[0][0] - 12:s.spans[0][0]]).endswith('word for word: "')
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="n_tokens must be a positive int"):
            tasks.passage_sample(tok, 400, 0.3, random.Random(0), n_tokens=bad)
    with pytest.raises(ValueError, match="too short"):
        tasks.passage_sample(tok, 100, 0.3, random.Random(0), n_tokens=80)


def test_probe_samples_of_fewer_draws_are_a_prefix_and_cover_the_depths():
    tok = load_tokenizer()
    d = tasks.probe_depths(100)
    assert d[:20] == tasks.probe_depths(20) and all(0 <= x < 1 for x in d)
    assert sorted(min(int(x * 5), 4) for x in d[:20]).count(0) >= 3, "every fifth of the depths in 20 draws"
    for task in ("passkey", "needle", "passage", "mqar", "variable_tracking"):
        a = tasks.probe_samples(task, tok, 300, n=6)
        b = tasks.probe_samples(task, tok, 300, n=3)
        assert [s.ids for s in a[:3]] == [s.ids for s in b], task
    with pytest.raises(ValueError, match="task must be"):
        tasks.probe_samples("copy", tok, 300)  # a training aid, not a probe


def test_passage_copy_accuracy_counts_tokens():
    tok = load_tokenizer()

    class Oracle(torch.nn.Module):  # predicts each next token of the one sample it is given: copies perfectly
        config = type("C", (), {})()

        def __init__(self, wrong_every=0):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.wrong_every = wrong_every

        def forward(self, input_ids):
            nxt = torch.roll(input_ids, -1, 1)
            if self.wrong_every:
                nxt[:, ::self.wrong_every] = (nxt[:, ::self.wrong_every] + 1) % len(tok)
            return type("O", (), {"logits": torch.nn.functional.one_hot(nxt, len(tok)).float()})()

    assert tasks.passage_copy_accuracy(Oracle(), tok, 300, n=3, n_tokens=40) == 1.0
    got = tasks.passage_copy_accuracy(Oracle(wrong_every=4), tok, 300, n=3, n_tokens=40)
    assert 0.7 < got < 0.8, got  # a quarter of the positions wrong: about a quarter of the tokens
