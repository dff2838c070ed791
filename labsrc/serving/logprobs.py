"""OpenAI's ``logprobs`` object for a completion: each token as a string, its offset in the returned text, and
its most likely alternatives.

Three rules, one for each field that can go wrong:

* **Token strings are distinct** (:class:`TokenStrings`). A byte-level token that is part of a character
  (one byte of "中") decodes to U+FFFD, so the decoded strings of several alternatives collide as keys of
  ``top_logprobs`` and all but one are lost. Such a token is written as OpenAI writes it, ``"bytes:\\xe4\\xb8"``;
  any string two tokens would still share is written ``"token_id:<id>"`` (vLLM's form).
* **Offsets locate tokens in the returned text** (:func:`text_offsets`): token ``i``'s offset is the length
  of the settled decode of the tokens before it (:func:`~labsrc.serving.detokenizer.settled`: the decode
  without its trailing U+FFFD), i.e. where the character holding its first byte starts. A special token adds
  no text, so it sits where the next text begins; a token inside a multi-byte character sits at that
  character. The offsets never decrease and never pass the end of the text; prompt (with ``echo``) and
  generated tokens follow the same rule, the generated ones counted after the echoed prompt. (Where a U+FFFD
  stands for invalid bytes rather than an unfinished character, the token after it is placed on it.)
* **The chosen token is among the alternatives** (:func:`top_entries`): OpenAI documents up to ``logprobs + 1``
  entries, the ``logprobs`` most likely and the token sampled (or, for an echoed prompt, the prompt's token).
"""
from __future__ import annotations

import threading

from labsrc.serving.detokenizer import settled

__all__ = ["TokenStrings", "text_offsets", "top_entries", "token_bytes"]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the characters from U+0100 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token: int) -> bytes | None:
    """The bytes a token stands for, for a byte-level BPE token (GPT-2's alphabet) or a SentencePiece byte
    token (``<0xE4>``); ``None`` when its vocabulary entry is neither."""
    piece = tokenizer.convert_ids_to_tokens(int(token))
    if piece is None:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


class TokenStrings:
    """Every token id of ``tokenizer`` as a distinct string (see the module docstring), built once, on first
    use, for the whole vocabulary (a few thousand decodes for the lab's tokenizer); safe to share between
    threads."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._table: list[str] | None = None
        self._lock = threading.Lock()

    def _build(self) -> list[str]:
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        table = []
        for t in range(len(tok)):
            s = tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if "\ufffd" in s and t not in special:
                raw = token_bytes(tok, t)
                if raw is not None and "\ufffd" in raw.decode("utf-8", "replace"):
                    s = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            table.append(s)
        seen: dict[str, int] = {}
        for s in table:
            seen[s] = seen.get(s, 0) + 1
        return [s if seen[s] == 1 else f"token_id:{t}" for t, s in enumerate(table)]

    def table(self) -> list[str]:
        with self._lock:
            if self._table is None:
                self._table = self._build()
        return self._table

    def __getitem__(self, token: int) -> str:
        table = self.table()
        t = int(token)
        return table[t] if 0 <= t < len(table) else f"token_id:{t}"


def text_offsets(tokenizer, ids: list[int], first: int = 0, last: int | None = None, base: int = 0,
                 limit: int | None = None) -> list[int]:
    """Offsets of tokens ``first .. last - 1`` of ``ids`` in a text that holds ``decode(ids)`` from character
    ``base`` on, at most ``limit`` (the returned text's length, when a stop string cut it short)."""
    last = len(ids) if last is None else last
    out = []
    for i in range(first, last):
        before = tokenizer.decode(ids[:i], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        offset = base + len(settled(before))
        out.append(offset if limit is None else min(offset, limit))
    return out


def top_entries(strings: TokenStrings, token: int, logprob: float, top: dict[int, float]) -> dict[str, float]:
    """``top_logprobs`` for one position: the most likely tokens, then the chosen one if it is not among them."""
    out = {strings[k]: v for k, v in top.items()}
    out.setdefault(strings[token], logprob)
    return out
