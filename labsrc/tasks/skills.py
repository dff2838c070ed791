"""The general in-context tasks: the skills of :mod:`labsrc.tasks`, asked in many phrasings, over large pools of
keys and values, with a held-out part of each for the eval card.

The first probes (:mod:`labsrc.tasks`) each had one wording and a handful of keys, and the model trained on
them used its context only inside those wordings. Each generator here takes a ``split``: ``"train"`` (what the
training mix of :mod:`labsrc.models.train` draws) or ``"heldout"`` (what the eval card and the chapters
draw), and the split decides the prose (training or validation text), the keys and values
(:mod:`.pools`) and the phrasing families (:mod:`.phrasings`); no held-out key, value or family reaches a
training row (``tests/test_skills.py`` checks the generators and a sample of training rows).

The tasks:

* :func:`passkey` -- one value (2 to 9 digits, a word, a made-up word) hidden in a haystack;
* :func:`needle` -- keyed facts with distractors; the question may name a key that is absent (answer
  :data:`~.phrasings.ABSENT`);
* :func:`mqar` -- Zoology's multi-query associative recall over random keys, queried in the list's own form;
* :func:`variable_tracking` -- chains of 0 to 4 assignments with distractor chains; the asked chain ends
  before or after the others as often;
* :func:`passage` -- a quoted passage asked back word for word;
* :func:`induction` -- a sequence of random tokens that simply recurs later, with no instruction (the
  induction-head setting of Olsson et al.);
* :func:`recurrence` -- a prose passage that recurs later, with no instruction (text that quotes itself);
* :func:`word_list` -- a list of words to copy (a training aid).

Every generator returns a :class:`labsrc.tasks.Sample` whose ``spans`` are the answers (scored as greedy
decoding would, teacher-forced, by :func:`labsrc.tasks.score`). ``meta["ignore"]`` lists spans that training
leaves out of the loss (random tokens nobody could predict), ``meta["copy"]`` marks the long copies.
"""
from __future__ import annotations

import functools
import random

from labsrc.tasks import Sample, _check_common, _enc, corpus_ids
from labsrc.tasks import pools
from labsrc.tasks.phrasings import ABSENT, MQAR_QUERY_HEADS, RULER_FILLER, families

FILLERS = ("prose", "ruler", "words")
TASKS = ("passkey", "needle", "mqar", "variable_tracking", "passage", "induction", "recurrence", "word_list")


# ----------------------------------------------------------------------------------------------- layout
def _corpus_split(split: str) -> str:
    return "train" if split == pools.TRAIN else "validation"


def filler(tokenizer, split: str, n: int, rng: random.Random, kind: str = "prose") -> list[int]:
    """``n`` tokens of haystack: the split's ``"prose"``, RULER's repeated sentences (``"ruler"``), or pool
    ``"words"`` strung together."""
    if n <= 0:
        return []
    if kind == "prose":
        ids = corpus_ids(tokenizer, _corpus_split(split))
        start = rng.randrange(0, len(ids) - n)
        return ids[start:start + n].tolist()
    if kind == "ruler":
        unit = _enc(tokenizer, RULER_FILLER)
        return (unit * (n // len(unit) + 1))[:n]
    if kind == "words":
        out = []
        while len(out) < n:
            out += _enc(tokenizer, " " + rng.choice(pools.words(split)) + ("." if rng.random() < 0.15 else ""))
        return out[:n]
    raise ValueError(f"filler kind must be one of {FILLERS}, got {kind!r}")


def _layout(tokenizer, task, split, rng, context_len, head, inserts, depths, tail, meta, fill="prose") -> Sample:
    """BOS + head + haystack (``inserts`` at ``depths``) + ``tail`` pieces ``(ids, is_answer)``, exactly
    ``context_len`` tokens."""
    bos = [tokenizer.bos_token_id]
    tail_ids = [t for ids, _ in tail for t in ids]
    fixed = 1 + len(head) + sum(map(len, inserts)) + len(tail_ids)
    n_fill = context_len - fixed
    if n_fill < 0:
        raise ValueError(f"context_len={context_len} is too short for this {task} sample (needs {fixed})")
    hay = filler(tokenizer, split, n_fill, rng, fill)
    body, prev = [], 0
    for cut, ins in sorted(zip((round(d * n_fill) for d in depths), inserts), key=lambda x: x[0]):
        body += hay[prev:cut] + ins
        prev = cut
    ids = bos + head + body + hay[prev:]
    spans = []
    for piece, is_answer in tail:
        if is_answer:
            spans.append((len(ids), len(ids) + len(piece)))
        ids = ids + piece
    return Sample(task, ids, spans, {"split": split, "filler": fill, **meta})


def _pick(rng, seq, name=None):
    if name is None:
        return rng.choice(seq)
    for f in seq:
        if f.name == name:
            return f
    raise ValueError(f"no family {name!r} among {[f.name for f in seq]}")


def _head(tokenizer, rng, fam, p: float) -> list[int]:
    return _enc(tokenizer, rng.choice(fam.heads) + "\n\n") if fam.heads and rng.random() < p else []


def _distinct(rng, draw, n, taken=()):
    out, seen = [], set(taken)
    while len(out) < n:
        x = draw()
        # no key inside another ("ring" in "spring"): the question must name one key unambiguously
        if x not in seen and not any(x in y or y in x for y in seen):
            out.append(x)
            seen.add(x)
    return out


# ----------------------------------------------------------------------------------------------- retrieval
def passkey(tokenizer, context_len: int, depth: float, rng: random.Random, split: str = pools.HELDOUT,
            family: str | None = None, question_family: str | None = None, kind: str | None = None,
            digits: tuple[int, int] = (3, 9), fill: str = "prose", p_head: float = 0.5) -> Sample:
    """One value stated once at ``depth`` of ``context_len`` tokens and asked for at the end. The statement and
    the question come from independently drawn families of ``split`` (or the ones named)."""
    _check_common(context_len, depth)
    pools.check_split(split)
    fams = families("passkey", split)
    fam, qfam = _pick(rng, fams, family), _pick(rng, fams, question_family)
    v = pools.value(rng, split, kind, digits)
    statement = _enc(tokenizer, " " + rng.choice(fam.statements).format(v=v) + " ")
    question = _enc(tokenizer, "\n\n" + rng.choice(qfam.questions))
    return _layout(tokenizer, "passkey", split, rng, context_len, _head(tokenizer, rng, fam, p_head), [statement],
                   [depth], [(question, False), (_enc(tokenizer, " " + v), True)],
                   {"value": v, "depth": depth, "family": fam.name, "question_family": qfam.name}, fill)


def needle(tokenizer, context_len: int, depth: float, rng: random.Random, split: str = pools.HELDOUT,
           n_distractors: int = 3, absent: bool = False, family: str | None = None,
           question_family: str | None = None, kind: str | None = None, fill: str = "prose",
           p_head: float = 0.5) -> Sample:
    """Keyed facts in a haystack: the asked one at ``depth`` (or, with ``absent``, none: the answer is then
    :data:`~.phrasings.ABSENT`) and ``n_distractors`` facts about other keys at random depths, each stated in
    a family of ``split`` (the asked one in ``family`` if named); the question comes from its own family."""
    _check_common(context_len, depth)
    pools.check_split(split)
    if not isinstance(n_distractors, int) or isinstance(n_distractors, bool) or not 0 <= n_distractors <= 32:
        raise ValueError(f"n_distractors must be an int in [0, 32], got {n_distractors!r}")
    fams = families("needle", split)
    fam, qfam = _pick(rng, fams, family), _pick(rng, fams, question_family)
    keys = _distinct(rng, lambda: pools.key(rng, split), n_distractors + 1)
    values = _distinct(rng, lambda: pools.value(rng, split, kind, (2, 7)), n_distractors + 1)
    stated = list(zip(keys, values))[1:] if absent else list(zip(keys, values))
    inserts = [_enc(tokenizer, " " + rng.choice((fam if i == 0 and not absent else rng.choice(fams)).statements)
                    .format(k=k, v=v) + " ") for i, (k, v) in enumerate(stated)]
    depths = ([] if absent else [depth]) + [rng.random() for _ in range(len(stated) - (0 if absent else 1))]
    answer = ABSENT if absent else values[0]
    question = _enc(tokenizer, "\n\n" + rng.choice(qfam.questions).format(k=keys[0]))
    return _layout(tokenizer, "needle", split, rng, context_len, _head(tokenizer, rng, fam, p_head), inserts,
                   depths, [(question, False), (_enc(tokenizer, " " + answer), True)],
                   {"key": keys[0], "value": answer, "depth": depth, "absent": absent, "family": fam.name,
                    "stated": dict(stated),
                    "question_family": qfam.name, "n_distractors": n_distractors}, fill)


def mqar(tokenizer, context_len: int, rng: random.Random, split: str = pools.HELDOUT, n_pairs: int = 8,
         n_queries: int | None = None, family: str | None = None, kind: str | None = None,
         fill: str = "prose") -> Sample:
    """Zoology's MQAR: ``n_pairs`` pairs of random keys (corpus and made-up words) and values listed at the
    start, haystack, then ``n_queries`` of the keys in random order, each in the list's own form and answered
    by its value."""
    _check_common(context_len)
    pools.check_split(split)
    if not isinstance(n_pairs, int) or isinstance(n_pairs, bool) or not 1 <= n_pairs <= 64:
        raise ValueError(f"n_pairs must be an int in [1, 64], got {n_pairs!r}")
    n_queries = n_pairs if n_queries is None else n_queries
    if not isinstance(n_queries, int) or not 1 <= n_queries <= n_pairs:
        raise ValueError(f"n_queries must be an int in [1, n_pairs], got {n_queries!r}")
    fam = _pick(rng, families("mqar", split), family)
    fmt, sep = fam.statements[0], fam.questions[0]
    kind = kind or rng.choice(("number", "number", "word", "pseudo"))
    keys = _distinct(rng, lambda: pools.key(rng, split), n_pairs)
    values = [pools.value(rng, split, kind, (2, 4)) for _ in keys]
    pre, post = fmt.split("{v}")
    table = sep.join(fmt.format(k=k, v=v) for k, v in zip(keys, values))
    head = _enc(tokenizer, rng.choice(fam.heads) + " " + table + ".\n\n")
    qhead = rng.choice(MQAR_QUERY_HEADS[split])
    tail = [(_enc(tokenizer, "\n\n" + qhead), False)]
    for j, i in enumerate(rng.sample(range(n_pairs), n_queries)):
        tail.append((_enc(tokenizer, ("" if j == 0 and not qhead else sep if j else " ")
                                     + pre.format(k=keys[i]).rstrip(" ")), False))
        tail.append((_enc(tokenizer, " " + values[i]), True))
        if post:
            tail.append((_enc(tokenizer, post), False))
    return _layout(tokenizer, "mqar", split, rng, context_len, head, [], [], tail,
                   {"pairs": dict(zip(keys, values)), "family": fam.name}, fill)


def variable_tracking(tokenizer, context_len: int, rng: random.Random, split: str = pools.HELDOUT,
                      n_hops: int = 2, n_chains: int = 2, asked_last: bool | None = None,
                      family: str | None = None, question_family: str | None = None, style: str | None = None,
                      fill: str = "prose") -> Sample:
    """RULER's variable tracking, balanced: ``n_chains`` chains of ``n_hops`` hops (``a = value``, then
    ``b = a`` ...) spread through the haystack; the question asks for the last variable of one chain, whose
    last assignment comes after every other chain's (``asked_last=True``) or before one of them (``False``;
    ``None`` draws it), so that "the latest value" is right only half the time."""
    _check_common(context_len)
    pools.check_split(split)
    if not isinstance(n_hops, int) or isinstance(n_hops, bool) or not 0 <= n_hops <= 8:
        raise ValueError(f"n_hops must be an int in [0, 8], got {n_hops!r}")
    if not isinstance(n_chains, int) or isinstance(n_chains, bool) or not 1 <= n_chains <= 6:
        raise ValueError(f"n_chains must be an int in [1, 6], got {n_chains!r}")
    fams = families("variable_tracking", split)
    fam, qfam = _pick(rng, fams, family), _pick(rng, fams, question_family)
    style = style or rng.choice(("caps", "word"))
    names = _distinct(rng, lambda: pools.variable(rng, split, style), n_chains * (n_hops + 1))
    chains = [names[c * (n_hops + 1):(c + 1) * (n_hops + 1)] for c in range(n_chains)]
    values = _distinct(rng, lambda: pools.value(rng, split, None, (2, 6)), n_chains)
    positions = [sorted(rng.random() for _ in range(n_hops + 1)) for _ in range(n_chains)]
    order = sorted(range(n_chains), key=lambda c: positions[c][-1])  # chains by their last assignment
    if asked_last is None:
        asked_last = rng.random() < 0.5
    asked = order[-1] if asked_last or n_chains == 1 else rng.choice(order[:-1])
    inserts, depths = [], []
    first, later = fam.statements
    for c, chain in enumerate(chains):
        for j, name in enumerate(chain):
            text = first.format(a=name, v=values[c]) if j == 0 else later.format(a=chain[j - 1], b=name)
            inserts.append(_enc(tokenizer, " " + text + " "))
            depths.append(positions[c][j])
    target = chains[asked][-1]
    question = _enc(tokenizer, "\n\n" + rng.choice(qfam.questions).format(a=target))
    return _layout(tokenizer, "variable_tracking", split, rng, context_len, _head(tokenizer, rng, fam, 0.5),
                   inserts, depths, [(question, False), (_enc(tokenizer, " " + values[asked]), True)],
                   {"variable": target, "value": values[asked], "n_hops": n_hops, "n_chains": n_chains,
                    "asked_last": asked_last or n_chains == 1, "asked_chain": asked,
                    "chain_last_depths": [p[-1] for p in positions], "family": fam.name,
                    "question_family": qfam.name}, fill)


# ----------------------------------------------------------------------------------------------- copying
def passage(tokenizer, context_len: int, depth: float, rng: random.Random, split: str = pools.HELDOUT,
            n_tokens: int = 100, family: str | None = None, question_family: str | None = None,
            fill: str = "prose") -> Sample:
    """A prose passage of ``n_tokens`` tokens quoted at ``depth``, then asked back word for word; every token of
    the repeat is its own answer span (the score is the share of tokens copied)."""
    _check_common(context_len, depth)
    pools.check_split(split)
    fams = families("passage", split)
    fam, qfam = _pick(rng, fams, family), _pick(rng, fams, question_family)
    text = filler(tokenizer, split, n_tokens, rng, "prose")
    pre, post = rng.choice(fam.statements).split("{v}")
    quote = _enc(tokenizer, pre) + text + _enc(tokenizer, post)
    question = _enc(tokenizer, "\n\n" + rng.choice(qfam.questions))
    s = _layout(tokenizer, "passage", split, rng, context_len, _head(tokenizer, rng, fam, 0.5), [quote], [depth],
                [(question, False), (text, True)],
                {"depth": depth, "n_tokens": n_tokens, "family": fam.name, "question_family": qfam.name,
                 "copy": True}, fill)
    (a, e), = s.spans
    s.spans = [(t, t + 1) for t in range(a, e)]
    return s


@functools.lru_cache(maxsize=4)
def frequent_tokens(tokenizer, n: int = 1000) -> tuple[int, ...]:
    """The ``n`` most frequent tokens of the training prose (no special tokens)."""
    import torch

    ids = corpus_ids(tokenizer, "train")
    counts = torch.bincount(ids, minlength=len(tokenizer))
    counts[list(tokenizer.all_special_ids)] = -1
    return tuple(counts.argsort(descending=True)[:n].tolist())


def random_tokens(tokenizer, n: int, rng: random.Random, vocab: str = "uniform") -> list[int]:
    """``n`` random tokens: ``"uniform"`` over the vocabulary (special tokens excluded) or ``"frequent"``,
    over the 1,000 most frequent tokens of the prose."""
    if vocab == "uniform":
        special = set(tokenizer.all_special_ids)
        out = []
        while len(out) < n:
            t = rng.randrange(len(tokenizer))
            if t not in special:
                out.append(t)
        return out
    if vocab == "frequent":
        pool = frequent_tokens(tokenizer)
        return [rng.choice(pool) for _ in range(n)]
    raise ValueError(f"vocab must be 'uniform' or 'frequent', got {vocab!r}")


def _recur(tokenizer, task, split, rng, context_len, seq, gap, meta, fill, skip):
    """Prose, ``seq``, ``gap`` tokens of haystack, ``seq`` again, prose to ``context_len``; the repeat's
    tokens after the first ``skip`` are answers (nothing announces the repeat, so its first tokens cannot be
    predicted)."""
    n = len(seq)
    rest = context_len - 1 - 2 * n - gap
    if rest < 0:
        raise ValueError(f"context_len={context_len} is too short for {n} tokens twice with a gap of {gap}")
    before = rng.randint(0, rest)
    ids = ([tokenizer.bos_token_id] + filler(tokenizer, split, before, rng, fill) + seq
           + filler(tokenizer, split, gap, rng, fill) + seq)
    start = len(ids) - n
    ids += filler(tokenizer, split, context_len - len(ids), rng, fill)
    return Sample(task, ids, [(t, t + 1) for t in range(start + skip, start + n)],
                  {"split": split, "filler": fill, "gap": gap, "n_tokens": n, "first": (start - gap - n, start - gap),
                   "repeat": (start, start + n), "copy": True, **meta})


def induction(tokenizer, context_len: int, rng: random.Random, n_tokens: int = 50, gap: int = 0,
              vocab: str = "uniform", split: str = pools.HELDOUT, fill: str = "prose") -> Sample:
    """``n_tokens`` random tokens that recur after ``gap`` tokens of haystack, with no instruction: every token
    of the repeat but the first is an answer (a model with an induction head copies them). The first
    occurrence is ``meta["ignore"]``: training does not ask anyone to predict random tokens."""
    _check_common(context_len)
    pools.check_split(split)
    seq = random_tokens(tokenizer, n_tokens, rng, vocab)
    s = _recur(tokenizer, "induction", split, rng, context_len, seq, gap, {"vocab": vocab}, fill, 1)
    s.meta["ignore"] = [s.meta["first"]]
    return s


def recurrence(tokenizer, context_len: int, rng: random.Random, n_tokens: int = 64, gap: int = 0,
               split: str = pools.HELDOUT, fill: str = "prose", skip: int = 2) -> Sample:
    """A prose passage of ``n_tokens`` that recurs after ``gap`` tokens, with no instruction (text that quotes
    itself); the repeat's tokens after the first ``skip`` are answers."""
    _check_common(context_len)
    pools.check_split(split)
    seq = filler(tokenizer, split, n_tokens, rng, "prose")
    return _recur(tokenizer, "recurrence", split, rng, context_len, seq, gap, {}, fill, skip)


def word_list(tokenizer, context_len: int, rng: random.Random, split: str = pools.HELDOUT, n_words: int = 8,
              fill: str = "prose") -> Sample:
    """A list of pool words, haystack, and the list asked back (a training aid for copying)."""
    _check_common(context_len)
    words = " ".join(pools.key(rng, split) for _ in range(n_words))
    head = _enc(tokenizer, f"Copy these words: {words}.\n\n")
    tail = [(_enc(tokenizer, "\n\nThe words were"), False), (_enc(tokenizer, " " + words), True)]
    return _layout(tokenizer, "word_list", split, rng, context_len, head, [], [], tail,
                   {"words": words, "copy": True}, fill)


# ----------------------------------------------------------------------------------------------- training
def training_sample(task: str, tokenizer, room: int, rng: random.Random, min_len: int = 80,
                    max_hops: int = 4) -> Sample:
    """One training sample of ``task`` of at most ``room`` tokens, every difficulty drawn: the training split's
    keys, values, phrasings and prose, several fillers, lengths up to the room."""
    split = pools.TRAIN
    fill = rng.choices(FILLERS, (0.75, 0.15, 0.10))[0]
    drawn = rng.randint(min(min_len, room), room)

    def fit(need: int) -> int:  # the drawn length, at least what the sample needs, at most the room
        return min(room, max(drawn, need))

    try:
        if task == "passkey":
            return passkey(tokenizer, fit(60), rng.random(), rng, split, fill=fill)
        if task == "needle":
            k = rng.randint(0, max(0, min(6, (room - 60) // 30)))
            return needle(tokenizer, fit(60 + 30 * k), rng.random(), rng, split, n_distractors=k,
                          absent=rng.random() < 0.15, fill=fill)
        if task == "mqar":
            k = rng.randint(2, max(2, min(16, (room - 40) // 20)))
            return mqar(tokenizer, fit(40 + 20 * k), rng, split, n_pairs=k, fill=fill)
        if task == "variable_tracking":
            c = rng.randint(2, 3)
            h = rng.randint(0, max(0, min(max_hops, (room - 60) // (16 * c) - 1)))
            return variable_tracking(tokenizer, fit(60 + 16 * c * (h + 1)), rng, split, n_hops=h, n_chains=c,
                                     fill=fill)
        if task == "passage":
            n = rng.randint(8, max(8, min(160, (room - 50) // 2)))
            return passage(tokenizer, fit(50 + 2 * n), rng.random(), rng, split, n_tokens=n, fill=fill)
        if task == "induction":
            n = rng.randint(8, max(8, min(80, (room - 2) // 2)))
            gap = rng.randint(0, max(0, min(800, room - 1 - 2 * n)))
            return induction(tokenizer, fit(1 + 2 * n + gap), rng, n, gap, rng.choice(("uniform", "frequent")),
                             split, fill)
        if task == "recurrence":
            n = rng.randint(16, max(16, min(160, (room - 2) // 2)))
            gap = rng.randint(0, max(0, min(800, room - 1 - 2 * n)))
            return recurrence(tokenizer, fit(1 + 2 * n + gap), rng, n, gap, split, fill)
        if task == "word_list":
            return word_list(tokenizer, fit(80), rng, split, rng.randint(4, 12), fill)
    except ValueError:  # a draw of long keys overran the estimate: a short pass key always fits
        return passkey(tokenizer, room, rng.random(), rng, split, kind="number", digits=(3, 5), p_head=0.0)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
