"""The lab's corpus and tokenizer: Jane Austen's six novels (public domain), a fixed train/validation split,
and a byte-level BPE tokenizer of 4,096 tokens trained on the training split. See ``README.md`` here."""
from __future__ import annotations

import functools
import lzma
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"
SPLITS = ("train", "validation")
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")


@functools.lru_cache(maxsize=2)
def load_text(split: str) -> str:
    """The corpus text of ``split`` ("train" or "validation"): paragraphs separated by blank lines."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    with lzma.open(DATA_DIR / f"austen_{split}.txt.xz", "rt", encoding="utf-8") as f:
        return f.read()


def train_tokenizer(path: Path = TOKENIZER_PATH, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train the byte-level BPE tokenizer on the training split and save it as ``tokenizer.json``.

    Digits are split one per token so that a passkey such as ``40917`` is always five tokens, whatever digits
    it has: the retrieval probes then measure copying, not the luck of how BPE merged a number.
    Training is deterministic (one thread, fixed corpus order).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(load_text("train").split("\n\n"), trainer=trainer)
    tok.save(str(path))
    return Path(path)


def load_tokenizer(path: Path | str = TOKENIZER_PATH):
    """The lab tokenizer as a ``transformers.PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}; build it with labsrc.data.train_tokenizer()")
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>",
        unk_token=None, model_max_length=1 << 20,
    )
