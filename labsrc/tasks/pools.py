"""Where the keys and values of the general probes come from, and which of them training may see.

The first probes asked for 40 key words in five shapes of value, and the model learned those: asked for a
word it had never seen as a key, or for a 7-digit number, it failed. The general tasks (:mod:`.skills`) draw
from large pools instead, and every pool is split in two by a hash of the item's text, so that neither split
shares a visible trait (a first letter, a length) the model could learn:

* ``"train"``: what the training mix draws;
* ``"heldout"``: what the eval card and the chapters' probes draw; no training row ever holds one.

The pools:

* **corpus words** (:func:`words`): the lower-case words of 3 to 10 letters that occur at least 5 times in the
  training prose, without its 150 most frequent (function words make poor keys): about 5,000, a quarter held
  out. The first probes' :data:`labsrc.tasks.KEYS` are always held out and :data:`labsrc.tasks.TRAIN_KEYS`
  always trained on, so those probes stay unseen too.
* **made-up words** (:func:`pseudo_word`): two or three random syllables ("bokita", "zemrul"), two to four
  tokens each, a quarter held out; keys no prose could have taught.
* **numbers** (:func:`number`): 2 to 9 digits, split by :func:`labsrc.tasks.value_split` (``"validation"`` is
  the held-out class), the same rule as the first probes' values.
* **variable names** (:func:`variable`): three capitals as in RULER, or a made-up word.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import random
import re

from labsrc.data import load_text

TRAIN, HELDOUT = "train", "heldout"
SPLITS = (TRAIN, HELDOUT)
MOST_FREQUENT_DROPPED = 150
MIN_COUNT = 5


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def held_out(text: str) -> bool:
    """Whether ``text`` (a word, a made-up word) belongs to the held-out pool: one item in four, by the second
    byte of its MD5 (the first decides :func:`labsrc.tasks.value_split`, so the two rules are independent)."""
    return hashlib.md5(text.encode()).digest()[1] % 4 == 0


def _split_of(text: str) -> str:
    return HELDOUT if held_out(text) else TRAIN


@functools.lru_cache(maxsize=2)
def words(split: str) -> tuple[str, ...]:
    """The corpus words of ``split``, sorted (see the module's docstring for which words and why)."""
    from labsrc.tasks import KEYS, TRAIN_KEYS

    check_split(split)
    counts = collections.Counter(re.findall(r"[a-z]+", load_text("train")))
    common = {w for w, _ in counts.most_common(MOST_FREQUENT_DROPPED)}
    pool = {w for w, c in counts.items() if c >= MIN_COUNT and 3 <= len(w) <= 10 and w not in common}
    pool -= set(KEYS) | set(TRAIN_KEYS)
    chosen = {w for w in pool if _split_of(w) == split}
    chosen |= set(KEYS if split == HELDOUT else TRAIN_KEYS)
    return tuple(sorted(chosen))


_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "gr", "tr", "st", "sk")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "", "n", "r", "l", "m", "k", "s")


def pseudo_word(rng: random.Random, split: str) -> str:
    """A made-up word of two or three syllables belonging to ``split`` (four draws on average for held-out)."""
    check_split(split)
    while True:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                    for _ in range(rng.randint(2, 3)))
        if _split_of(w) == split:
            return w


def number(rng: random.Random, split: str, n_digits: int) -> str:
    """An ``n_digits``-digit number (no leading zero) of ``split``'s values (:func:`labsrc.tasks.value_split`)."""
    from labsrc.tasks import _digits

    check_split(split)
    if not isinstance(n_digits, int) or not 1 <= n_digits <= 12:
        raise ValueError(f"n_digits must be an int in [1, 12], got {n_digits!r}")
    return _digits(rng, n_digits, "train" if split == TRAIN else "validation")


def key(rng: random.Random, split: str) -> str:
    """A key: a corpus word (two times in three) or a made-up word."""
    return rng.choice(words(split)) if rng.random() < 2 / 3 else pseudo_word(rng, split)


VALUE_KINDS = ("number", "word", "pseudo")


def value(rng: random.Random, split: str, kind: str | None = None, digits: tuple[int, int] = (2, 9)) -> str:
    """A value of ``kind`` (``"number"`` of ``digits`` digits, a corpus ``"word"``, a made-up ``"pseudo"``
    word); ``None`` draws the kind, numbers half the time."""
    if kind is None:
        kind = "number" if rng.random() < 0.5 else rng.choice(VALUE_KINDS[1:])
    if kind == "number":
        return number(rng, split, rng.randint(*digits))
    if kind == "word":
        return rng.choice(words(split))
    if kind == "pseudo":
        return pseudo_word(rng, split)
    raise ValueError(f"kind must be one of {VALUE_KINDS} or None, got {kind!r}")


def variable(rng: random.Random, split: str, style: str) -> str:
    """A variable name: ``style`` ``"caps"`` (three capitals, RULER's) or ``"word"`` (a made-up word)."""
    from labsrc.tasks import _var_name

    if style == "caps":
        return _var_name(rng, "train" if split == TRAIN else "validation")
    if style == "word":
        return pseudo_word(rng, split)
    raise ValueError(f"style must be 'caps' or 'word', got {style!r}")


def belongs(item: str, split: str) -> bool:
    """Whether a key, value or name may appear in ``split``: the test that keeps the splits apart."""
    from labsrc.tasks import KEYS, TRAIN_KEYS, value_split

    check_split(split)
    if item.isdigit() or (len(item) == 3 and item.isupper()):
        return value_split(item) == ("train" if split == TRAIN else "validation")
    if item in KEYS:
        return split == HELDOUT
    if item in TRAIN_KEYS:
        return split == TRAIN
    return _split_of(item) == split
