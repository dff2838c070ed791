"""The lab's probes: synthetic long-context tasks with checkable answers, and perplexity by position.

Every probe is deterministic from a seed and is built from the *same* generators that train the lab models
(:mod:`labsrc.models.train` calls :func:`make_sample`), so the format a probe asks in is exactly the format the
model was taught. A :class:`Sample` is a token sequence with one or more *answer spans*: a probe counts a span
as right when greedy decoding from the text before it reproduces it exactly. Because greedy decoding picks the
arg-max at every step, "teacher-forced arg-max equals the answer at every answer position" is the same test,
and it needs one forward pass per sample instead of one per generated token.

Probes:

* :func:`perplexity_by_position` -- mean loss in buckets of token position over validation text;
* :func:`passkey_accuracy` -- a 5-digit pass key hidden at a given depth in Austen prose;
* :func:`needle_accuracy` -- needle-in-a-haystack with distractor needles (other keys, other numbers);
* :func:`mqar_accuracy` -- multi-query associative recall (Zoology's MQAR) over word -> number pairs;
* :func:`variable_tracking_accuracy` -- RULER-style multi-hop: follow ``VAR B = VAR A`` chains to a value;
* :func:`passage_copy_accuracy` -- a prose passage quoted earlier in the context, to be repeated word for word.

Training never sees a probe's answer. The generators take a ``split``: ``"validation"`` (every probe) or
``"train"`` (the training mix of :mod:`labsrc.models.train`), and the split decides three things apart.

* The prose: filler and quoted passages come from that split of the corpus.
* The key words: probes ask for the words of :data:`KEYS`, training for those of :data:`TRAIN_KEYS` (no word
  is in both).
* The values: a pass key, a magic number, an MQAR value, a variable's value or name belongs to one split by a
  hash of its text (:func:`value_split`), and each split draws only its own. A test checks every class.

The probes seed their own ``random.Random`` from a string that names the probe (``"needle-0-920-3"``); training
draws from one ``random.Random(cfg.seed)`` stream, so no probe's sequence of draws is replayed in training.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from labsrc.data import load_text

TASKS = ("passkey", "needle", "mqar", "variable_tracking", "passage")
SPLITS = ("train", "validation")

# Keys for the needle and MQAR tasks: short, common, single-word English nouns.
KEYS = (
    "apple", "river", "garden", "window", "letter", "candle", "horse", "mirror", "basket", "ribbon", "bridge",
    "castle", "violin", "harbour", "forest", "lantern", "meadow", "pocket", "saddle", "teacup", "thimble",
    "carriage", "bonnet", "orchard", "kettle", "chimney", "compass", "feather", "journal", "parcel", "shawl",
    "pebble", "lemon", "tulip", "falcon", "anchor", "button", "cottage", "pillow", "walnut",
)
# The training mix's keys: other nouns of the same kind, none of them in KEYS, so that a probe's question
# names a key the model never saw asked for in training (it has to match the key, not remember it).
TRAIN_KEYS = (
    "acorn", "badger", "barrel", "beacon", "bell", "blanket", "bottle", "bucket", "cabin", "canal", "canvas",
    "cellar", "cherry", "clock", "cloak", "copper", "cradle", "crown", "cushion", "dagger", "desk", "drum",
    "eagle", "engine", "fiddle", "flag", "fountain", "gate", "glove", "goblet", "hammer", "helmet", "hinge",
    "island", "jacket", "jewel", "kitten", "ladder", "ledger", "marble", "mitten", "needle", "novel", "oyster",
    "paddle", "palace", "pepper", "piano", "pigeon", "pistol", "planet", "plum", "pump", "quill", "rabbit",
    "rocket", "saucer", "scarf", "shovel", "silver", "spoon", "statue", "stove", "sugar", "table", "tiger",
    "timber", "towel", "tower", "trumpet", "tunnel", "umbrella", "valley", "velvet", "wagon", "whistle",
    "willow", "wizard", "yarn", "zebra",
)


@dataclass
class Sample:
    """One probe or training example.

    ``ids`` is the whole token sequence (starting with the BOS token); ``spans`` lists ``(start, end)`` index
    ranges of ``ids`` that are answers to check. ``prompt_ids``/``answer_ids`` are the text before the first
    answer and that answer, for decoders that generate.
    """

    task: str
    ids: list[int]
    spans: list[tuple[int, int]]
    meta: dict = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids[: self.spans[0][0]]

    @property
    def answer_ids(self) -> list[int]:
        s, e = self.spans[0]
        return self.ids[s:e]


# ----------------------------------------------------------------------------------------------- tokens
_FILLER_CACHE: dict = {}


def _tok_key(tokenizer) -> str:
    return hashlib.md5(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def corpus_ids(tokenizer, split: str) -> torch.Tensor:
    """The whole corpus ``split`` tokenized (cached): a 1-D int64 tensor."""
    key = (_tok_key(tokenizer), split)
    if key not in _FILLER_CACHE:
        paras = load_text(split).split("\n\n")
        enc = tokenizer(["\n\n" + p if i else p for i, p in enumerate(paras)], add_special_tokens=False)
        flat = [t for ids in enc["input_ids"] for t in ids]
        _FILLER_CACHE[key] = torch.tensor(flat, dtype=torch.long)
    return _FILLER_CACHE[key]


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _filler(tokenizer, split: str, n: int, rng: random.Random) -> list[int]:
    ids = corpus_ids(tokenizer, split)
    if n <= 0:
        return []
    if n >= len(ids):
        raise ValueError(f"context_len={n} tokens or more needs more filler than the {split!r} split holds "
                         f"({len(ids)} tokens)")
    start = rng.randrange(0, len(ids) - n)
    return ids[start:start + n].tolist()


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def value_split(text: str) -> str:
    """The split a value (a number, a variable name) belongs to: ``"train"`` or ``"validation"``, by the low
    bit of its MD5. A hash and not a range, so that neither split's values share a visible trait (a last digit,
    a size) that a model could learn in training and then miss in the probes."""
    return SPLITS[hashlib.md5(text.encode()).digest()[0] & 1]


def _draw(rng: random.Random, split: str, make) -> str:
    """Draw ``make(rng)`` until the value belongs to ``split`` (two draws on average)."""
    while value_split(value := make(rng)) != split:
        pass
    return value


def _digits(rng: random.Random, n: int, split: str = "validation") -> str:
    """An ``n``-digit number (no leading zero) of ``split``'s values."""
    return _draw(rng, split, lambda r: str(r.randrange(10 ** (n - 1), 10 ** n)))


def keys_for(split: str) -> tuple[str, ...]:
    """The key words of ``split``: :data:`KEYS` for the probes, :data:`TRAIN_KEYS` for training."""
    _check_split(split)
    return TRAIN_KEYS if split == "train" else KEYS


_NO_DEPTH = object()  # tasks without a depth; a depth of None is an error, not "unchecked"


def _check_common(context_len, depth=_NO_DEPTH):
    if not isinstance(context_len, int) or isinstance(context_len, bool) or context_len < 1:
        raise ValueError(f"context_len must be a positive int, got {context_len!r}")
    if depth is not _NO_DEPTH and (isinstance(depth, bool) or not isinstance(depth, (int, float))
                                   or not 0.0 <= depth <= 1.0):
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")


def _assemble(tokenizer, task, head, inserts, tail_parts, context_len, depths, split, rng, meta) -> Sample:
    """Lay out BOS + head + filler (with ``inserts`` at ``depths``) + tail so the total is ``context_len``.

    ``tail_parts`` is a list of ``(ids, is_answer)`` pieces that end the sample (question, answer, ...).
    """
    bos = [tokenizer.bos_token_id]
    tail = [t for ids, _ in tail_parts for t in ids]
    fixed = len(bos) + len(head) + sum(len(x) for x in inserts) + len(tail)
    n_fill = context_len - fixed
    if n_fill < 0:
        raise ValueError(f"context_len={context_len} is too short for a {task} sample (needs at least {fixed})")
    filler = _filler(tokenizer, split, n_fill, rng)
    cuts = [round(d * n_fill) for d in depths]
    body, prev = [], 0
    for cut, ins in sorted(zip(cuts, inserts), key=lambda x: x[0]):
        body += filler[prev:cut] + ins
        prev = cut
    body += filler[prev:]
    ids = bos + head + body
    spans = []
    for part, is_answer in tail_parts:
        if is_answer:
            spans.append((len(ids), len(ids) + len(part)))
        ids = ids + part
    assert len(ids) == context_len
    return Sample(task, ids, spans, meta)


# ----------------------------------------------------------------------------------------------- generators
# Numbers of the kinds that turn up in prose (headings, years, references, sums): the decoys a pass-key haystack
# can carry. Each is (template, (fewest, most) digits of each number in it).
DECOYS = (
    ("\n\nCHAPTER {}\n\n", (1, 2)), (" in the year {}", (4, 4)), (" (No. {}, Vol. II)", (1, 3)),
    (" {}-{}", (2, 4)), (" page {}", (1, 3)), (" {} pounds", (2, 5)), (" The number is {}.", (5, 5)),
    (" {} ", (1, 5)), (" the {}th", (2, 2)), (" No. {}", (5, 5)),
)


def _decoy(rng: random.Random, split: str) -> str:
    template, (lo, hi) = rng.choice(DECOYS)
    n = template.count("{}")
    return template.format(*(_digits(rng, rng.randint(lo, hi), split) for _ in range(n)))


def passkey_sample(tokenizer, context_len: int, depth: float, rng: random.Random, split="validation",
                   n_decoys: int = 0) -> Sample:
    """A 5-digit pass key stated once at ``depth`` (0 = start, 1 = end) of ``context_len`` tokens of prose.

    ``n_decoys`` other numbers (a chapter heading, a year, a page, a sum; see :data:`DECOYS`) go into the prose
    at random depths. The probe uses none; training uses a few, because the prose itself has numbers and the
    pass keys a model gets wrong are the ones whose haystack does ("CHAPTER 30" near the end turned the key
    50518 into 50338).
    """
    _check_common(context_len, depth)
    _check_split(split)
    if not isinstance(n_decoys, int) or isinstance(n_decoys, bool) or n_decoys < 0:
        raise ValueError(f"n_decoys must be a non-negative int, got {n_decoys!r}")
    key = _digits(rng, 5, split)
    head = _enc(tokenizer, "There is a pass key hidden in this text. Find it and remember it.\n\n")
    needle = _enc(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = _enc(tokenizer, "\n\nWhat is the pass key? The pass key is")
    answer = _enc(tokenizer, f" {key}")
    decoys = [_decoy(rng, split) for _ in range(n_decoys)]
    depths = [depth] + [rng.random() for _ in range(n_decoys)]
    return _assemble(tokenizer, "passkey", head, [needle] + [_enc(tokenizer, d) for d in decoys],
                     [(question, False), (answer, True)], context_len, depths, split, rng,
                     {"key": key, "depth": depth, "n_decoys": n_decoys, "decoys": decoys})


def needle_sample(tokenizer, context_len: int, depth: float, rng: random.Random, n_distractors: int = 3,
                  split="validation") -> Sample:
    """Needle in a haystack with distractors: several "special magic number for <key>" needles, one asked for.

    The asked-for needle sits at ``depth``; ``n_distractors`` needles with other keys and other numbers sit at
    random depths. Answering needs the right key, not just the last number seen.
    """
    _check_common(context_len, depth)
    _check_split(split)
    if not isinstance(n_distractors, int) or not 0 <= n_distractors < len(KEYS):
        raise ValueError(f"n_distractors must be an int in [0, {len(KEYS) - 1}], got {n_distractors!r}")
    keys = rng.sample(keys_for(split), n_distractors + 1)
    values = [_digits(rng, 6, split) for _ in keys]
    needles = [_enc(tokenizer, f" The special magic number for {k} is {v}. ") for k, v in zip(keys, values)]
    depths = [depth] + [rng.random() for _ in range(n_distractors)]
    head = _enc(tokenizer, "Some special magic numbers are hidden in this text. Remember them.\n\n")
    question = _enc(tokenizer, f"\n\nWhat is the special magic number for {keys[0]}? "
                               f"The special magic number for {keys[0]} is")
    answer = _enc(tokenizer, f" {values[0]}")
    return _assemble(tokenizer, "needle", head, needles, [(question, False), (answer, True)], context_len,
                     depths, split, rng, {"key": keys[0], "value": values[0], "depth": depth})


def mqar_sample(tokenizer, context_len: int, rng: random.Random, n_pairs: int = 8, n_queries: int | None = None,
                split="validation") -> Sample:
    """Multi-query associative recall: ``n_pairs`` "key: number" pairs, then queries for several of them.

    The pairs are listed right after the instruction, prose fills the middle, and the queries come at the
    end, each answered by its 3-digit number (every answer is a checked span). Zoology's MQAR uses random
    tokens; we use words and numbers so the text stays readable, and prose between so it is long-context.
    """
    _check_common(context_len)
    _check_split(split)
    if not isinstance(n_pairs, int) or not 1 <= n_pairs <= len(KEYS):
        raise ValueError(f"n_pairs must be an int in [1, {len(KEYS)}], got {n_pairs!r}")
    n_queries = n_pairs if n_queries is None else n_queries
    if not isinstance(n_queries, int) or not 1 <= n_queries <= n_pairs:
        raise ValueError(f"n_queries must be an int in [1, n_pairs], got {n_queries!r}")
    keys = rng.sample(keys_for(split), n_pairs)
    values = [_digits(rng, 3, split) for _ in keys]
    table = ", ".join(f"{k}: {v}" for k, v in zip(keys, values))
    head = _enc(tokenizer, f"Remember these pairs. {table}.\n\n")
    tail = [(_enc(tokenizer, "\n\nRecall the pairs."), False)]
    for i in rng.sample(range(n_pairs), n_queries):
        tail.append((_enc(tokenizer, f" {keys[i]}:"), False))
        tail.append((_enc(tokenizer, f" {values[i]}"), True))
        tail.append((_enc(tokenizer, ","), False))
    return _assemble(tokenizer, "mqar", head, [], tail, context_len, [], split, rng,
                     {"pairs": dict(zip(keys, values))})


def _var_name(rng: random.Random, split: str) -> str:
    return _draw(rng, split, lambda r: "".join(r.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3)))


def variable_tracking_sample(tokenizer, context_len: int, rng: random.Random, n_hops: int = 2,
                             split="validation") -> Sample:
    """RULER-style variable tracking: ``VAR A = 12345``, then ``VAR B = VAR A`` ... ``n_hops`` times, spread
    through prose, with a distractor chain of the same length ending in another number. The question asks
    for the value of the last variable of the first chain, so the model must follow every hop.
    """
    _check_common(context_len)
    _check_split(split)
    if not isinstance(n_hops, int) or not 0 <= n_hops <= 8:
        raise ValueError(f"n_hops must be an int in [0, 8], got {n_hops!r}")
    names = set()
    while len(names) < 2 * (n_hops + 1):
        names.add(_var_name(rng, split))
    names = sorted(names)
    rng.shuffle(names)
    chains = [names[: n_hops + 1], names[n_hops + 1:]]
    values = [_digits(rng, 5, split), _digits(rng, 5, split)]
    inserts, depths = [], []
    for chain, value in zip(chains, values):
        pos = sorted(rng.random() for _ in chain)
        for j, name in enumerate(chain):
            rhs = value if j == 0 else f"VAR {chain[j - 1]}"
            inserts.append(_enc(tokenizer, f" VAR {name} = {rhs}. "))
            depths.append(pos[j])
    head = _enc(tokenizer, "Some variables are assigned in this text. Keep track of them.\n\n")
    target = chains[0][-1]
    question = _enc(tokenizer, f"\n\nWhat is the value of VAR {target}? VAR {target} =")
    answer = _enc(tokenizer, f" {values[0]}")
    return _assemble(tokenizer, "variable_tracking", head, inserts, [(question, False), (answer, True)],
                     context_len, depths, split, rng, {"variable": target, "value": values[0], "n_hops": n_hops})


def copy_sample(tokenizer, context_len: int | None, rng: random.Random, n_words: int | None = None,
                split="validation") -> Sample:
    """A training aid, not a probe: a list of random words, prose, then the same list again to be copied.

    Every word of the second copy is predictable only by looking back, so this teaches the "find the earlier
    occurrence, copy what followed" circuit (an induction head) with many targets per sequence. Words from
    :data:`KEYS` rather than digits: with only ten digits the previous token alone does not say where to look.
    With ``context_len=None`` there is no prose between the two copies (the sample is as short as it can be).
    """
    n_words = rng.randint(6, 16) if n_words is None else n_words
    if not isinstance(n_words, int) or isinstance(n_words, bool) or n_words < 1:
        raise ValueError(f"n_words must be a positive int, got {n_words!r}")
    _check_split(split)
    words = " ".join(rng.choice(keys_for(split)) for _ in range(n_words))
    head = _enc(tokenizer, f"Copy these words: {words}.\n\n")
    question = _enc(tokenizer, "\n\nThe words were")
    answer = _enc(tokenizer, f" {words}")
    if context_len is None:
        context_len = 1 + len(head) + len(question) + len(answer)
    _check_common(context_len)
    return _assemble(tokenizer, "copy", head, [], [(question, False), (answer, True)], context_len, [],
                     split, rng, {"words": words})


def passage_sample(tokenizer, context_len: int, depth: float, rng: random.Random, n_tokens: int | None = None,
                   split="validation") -> Sample:
    """A prose passage of ``n_tokens`` tokens quoted at ``depth`` of the context, then asked for word for word
    (``None``: 100 tokens, or as many as leave a third of a shorter context to prose).

    The passage is a window of the split's prose (a probe's comes from the validation text, which no model
    trained on), so the model cannot recite it from memory: it has to find the quotation and copy it, token
    after token, which is what an induction head does. Every token of the repeat is one answer span, so the
    score is the fraction of the passage copied right (:func:`passage_copy_accuracy`).
    """
    _check_common(context_len, depth)
    _check_split(split)
    if n_tokens is None:
        n_tokens = max(1, min(100, (context_len - 60) // 3))
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    passage = _filler(tokenizer, split, n_tokens, rng)
    quote = _enc(tokenizer, ' Here is a passage to remember: "') + passage + _enc(tokenizer, '" ')
    head = _enc(tokenizer, "A passage is quoted in this text. Remember it word for word.\n\n")
    question = _enc(tokenizer, '\n\nRepeat the quoted passage word for word: "')
    sample = _assemble(tokenizer, "passage", head, [quote], [(question, False), (passage, True)], context_len,
                       [depth], split, rng, {"depth": depth, "n_tokens": n_tokens})
    (a, e), = sample.spans
    sample.spans = [(t, t + 1) for t in range(a, e)]  # one span a token: the score is a fraction of tokens
    return sample


def make_sample(task: str, tokenizer, context_len: int, rng: random.Random, split="validation", **kw) -> Sample:
    """Build one sample of ``task`` (one of :data:`TASKS`, or the training aid ``"copy"``); keyword arguments go
    to its generator."""
    gens = {"passkey": passkey_sample, "needle": needle_sample, "mqar": mqar_sample,
            "variable_tracking": variable_tracking_sample, "passage": passage_sample, "copy": copy_sample}
    if task not in gens:
        raise ValueError(f"unknown task {task!r}; tasks are {TASKS} (and 'copy', used in training)")
    if task in ("passkey", "needle", "passage"):
        kw.setdefault("depth", rng.random())
    return gens[task](tokenizer, context_len, rng=rng, split=split, **kw)


# ----------------------------------------------------------------------------------------------- scoring
def _check_model(model):
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")


@torch.no_grad()
def score(model, samples: Sequence[Sample], batch_size: int = 8) -> list[list[bool]]:
    """For each sample, whether each answer span is what greedy decoding would produce (one forward pass)."""
    _check_model(model)
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i:i + batch_size]
        lens = {len(s.ids) for s in chunk}
        if len(lens) != 1:  # group by length; probes build samples of one length at a time
            out.extend(score(model, [s], 1)[0] for s in chunk)
            continue
        ids = torch.tensor([s.ids for s in chunk], device=device)
        pred = model(input_ids=ids).logits.argmax(-1)
        for b, s in enumerate(chunk):
            out.append([bool((pred[b, a - 1:e - 1] == ids[b, a:e]).all()) for a, e in s.spans])
    return out


def accuracy(model, samples: Sequence[Sample], batch_size: int = 8) -> float:
    """Fraction of answer spans right, over all samples."""
    results = [r for rs in score(model, samples, batch_size) for r in rs]
    return sum(results) / len(results)


def _check_n_seed(n, seed):
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def passkey_grid(model, tokenizer, context_lens: Sequence[int], depths: Sequence[float], n: int = 10,
                 seed: int = 0, batch_size: int = 8, n_decoys: int = 0) -> torch.Tensor:
    """Pass-key accuracy over a grid: a ``(len(depths), len(context_lens))`` tensor of accuracies.

    ``n_decoys`` puts that many other numbers into each haystack (see :func:`passkey_sample`); the standard
    probe has none.
    """
    _check_n_seed(n, seed)
    grid = torch.zeros(len(depths), len(context_lens), dtype=torch.float64)  # 19/20 is 0.95, not 0.9499999
    for j, L in enumerate(context_lens):
        for i, d in enumerate(depths):
            rng = random.Random(f"passkey-{seed}-{L}-{d}" + (f"-decoys{n_decoys}" if n_decoys else ""))
            samples = [passkey_sample(tokenizer, L, d, rng, n_decoys=n_decoys) for _ in range(n)]
            grid[i, j] = accuracy(model, samples, batch_size)
    return grid


def passkey_accuracy(model, tokenizer, context_len: int, depths: Sequence[float], n: int, seed: int = 0) -> float:
    """Mean pass-key accuracy at ``context_len`` over ``depths`` (``n`` samples per depth, seeded)."""
    _check_common(context_len)
    if len(depths) == 0:
        raise ValueError("depths must not be empty")
    for d in depths:
        _check_common(context_len, d)
    return float(passkey_grid(model, tokenizer, [context_len], depths, n, seed).mean())


def probe_depths(n: int) -> list[float]:
    """Depths for ``n`` samples: ``i * 0.618...`` modulo 1 (the golden-ratio sequence), which fills [0, 1)
    evenly for every ``n``, so any prefix of the samples covers every depth."""
    return [(i * 0.6180339887498949) % 1.0 for i in range(n)]


def probe_samples(task: str, tokenizer, context_len: int, n: int = 20, seed: int = 0, **kw) -> list[Sample]:
    """The ``n`` samples a probe scores: ``task`` is ``"passkey"``, ``"needle"`` (``n_distractors``, default 3),
    ``"mqar"`` (``n_pairs``, default 8), ``"variable_tracking"`` (``n_hops``, default 2) or ``"passage"``
    (``n_tokens``, default 100), at ``context_len`` tokens, drawn from a generator seeded by the probe's own name.
    The pass key, the needle and the passage sit at :func:`probe_depths` (``meta["depth"]``), so the first ``m``
    samples of ``n`` are the ``m`` samples a probe of ``m`` draws, spread over every depth: a smaller probe is a
    prefix of a larger one."""
    _check_common(context_len)
    _check_n_seed(n, seed)
    depths = probe_depths(n)
    if task == "passkey":
        rng = random.Random(f"passkey-{seed}-{context_len}-probe")
        return [passkey_sample(tokenizer, context_len, d, rng, **kw) for d in depths]
    if task == "needle":
        k = kw.pop("n_distractors", 3)
        rng = random.Random(f"needle-{seed}-{context_len}-{k}")
        return [needle_sample(tokenizer, context_len, d, rng, k, **kw) for d in depths]
    if task == "mqar":
        k = kw.pop("n_pairs", 8)
        rng = random.Random(f"mqar-{seed}-{context_len}-{k}")
        return [mqar_sample(tokenizer, context_len, rng, k, **kw) for _ in range(n)]
    if task == "variable_tracking":
        k = kw.pop("n_hops", 2)
        rng = random.Random(f"vt-{seed}-{context_len}-{k}")
        return [variable_tracking_sample(tokenizer, context_len, rng, k, **kw) for _ in range(n)]
    if task == "passage":
        k = kw.pop("n_tokens", 100)
        rng = random.Random(f"passage-{seed}-{context_len}-{k}")
        return [passage_sample(tokenizer, context_len, d, rng, k, **kw) for d in depths]
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def needle_accuracy(model, tokenizer, context_len: int, n: int = 20, n_distractors: int = 3,
                    seed: int = 0) -> float:
    """Needle-with-distractors accuracy at ``context_len`` over ``n`` samples at :func:`probe_depths`."""
    return accuracy(model, probe_samples("needle", tokenizer, context_len, n, seed, n_distractors=n_distractors))


def mqar_accuracy(model, tokenizer, context_len: int, n: int = 20, n_pairs: int = 8, seed: int = 0) -> float:
    """MQAR accuracy (fraction of queries answered) at ``context_len`` with ``n_pairs`` pairs per sample."""
    return accuracy(model, probe_samples("mqar", tokenizer, context_len, n, seed, n_pairs=n_pairs))


def passage_copy_accuracy(model, tokenizer, context_len: int, n: int = 20, n_tokens: int = 100,
                          seed: int = 0) -> float:
    """Passage copying: the fraction of the ``n_tokens`` tokens of a quoted passage that greedy decoding
    repeats right (teacher-forced, so a slip costs its own token, not the rest), over ``n`` samples at
    :func:`probe_depths`."""
    return accuracy(model, probe_samples("passage", tokenizer, context_len, n, seed, n_tokens=n_tokens))


def variable_tracking_accuracy(model, tokenizer, context_len: int, n: int = 20, n_hops: int = 2,
                               seed: int = 0) -> float:
    """Variable-tracking accuracy at ``context_len`` with chains of ``n_hops`` hops."""
    return accuracy(model, probe_samples("variable_tracking", tokenizer, context_len, n, seed, n_hops=n_hops))


@torch.no_grad()
def perplexity_by_position(model, tokenizer, context_len: int = 512, bucket: int = 64, n_windows: int | None = None,
                           batch_size: int = 8) -> dict:
    """Loss by token position over non-overlapping validation windows of ``context_len`` tokens.

    Each window starts with the BOS token. Returns ``{"positions": bucket starts, "loss": mean loss per
    bucket, "perplexity": exp of those, "overall": perplexity over every predicted token}``. With
    ``n_windows=None`` it uses the whole validation split (the eval-card figure).
    """
    _check_model(model)
    _check_common(context_len)
    if not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"bucket must be a positive int, got {bucket!r}")
    ids = corpus_ids(tokenizer, "validation")
    span = context_len - 1
    total = len(ids) // span if n_windows is None else int(n_windows)
    if total < 1 or total * span > len(ids):
        raise ValueError(f"n_windows={n_windows!r} does not fit the validation split at context_len={context_len}")
    device = next(model.parameters()).device
    sums = torch.zeros(context_len - 1, dtype=torch.float64)
    for i in range(0, total, batch_size):
        rows = [torch.cat([torch.tensor([tokenizer.bos_token_id]), ids[w * span:(w + 1) * span]])
                for w in range(i, min(i + batch_size, total))]
        x = torch.stack(rows).to(device)
        logits = model(input_ids=x).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        sums += nll.double().sum(0).cpu()
    per_pos = sums / total
    starts = list(range(0, context_len - 1, bucket))
    loss = [float(per_pos[s:s + bucket].mean()) for s in starts]
    return {"positions": starts, "loss": loss, "perplexity": [math.exp(x) for x in loss],
            "overall": math.exp(float(per_pos.mean())), "n_windows": total}
