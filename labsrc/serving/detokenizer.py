"""Incremental detokenization for streaming: text that is only ever appended to, never corrected.

A byte-level BPE token is a few *bytes*, not characters: "é" or "中" or an emoji spans two to four tokens, and
decoding the tokens seen so far ends in U+FFFD (the replacement character) while a character is incomplete.
Streaming the difference between successive decodes would send that U+FFFD, and the character would never be
sent whole. :class:`IncrementalDetokenizer` does what vLLM's incremental detokenizer does: it decodes all the
tokens so far, and releases text only up to the last complete character, holding back a trailing U+FFFD until
the next token completes it (or the sequence ends, when whatever is left is released as the non-streamed text
has it).

Stop strings are found here too (the OpenAI ``stop`` field): the text is cut before the first occurrence of any
of them, and while streaming the last ``len(longest stop) - 1`` characters are held back, since they might be
the start of a stop string that the next token completes.

One rule makes the stream equal the whole completion: only the *settled* text is searched and released, i.e.
the decode without its trailing U+FFFD (:func:`settled`). Those placeholders stand for a character still
arriving (the next token may turn them into "”" or "。"), so they are neither counted in the held-back window
(counting one would release the first character of a stop string whose last character is multi-byte) nor
searched (a stop string containing U+FFFD would fire inside every unfinished character). Everything before them
never changes as tokens arrive: a byte-level decode replaces invalid bytes by U+FFFD as it meets them, so only
the unfinished end can still change. When the sequence ends, :meth:`~IncrementalDetokenizer.flush` searches the
final text, placeholders and all, as the non-streamed completion does.
"""
from __future__ import annotations

__all__ = ["IncrementalDetokenizer", "settled"]

_REPLACEMENT = "\ufffd"


def settled(text: str) -> str:
    """``text`` without its trailing U+FFFD: the part of a decode that more tokens cannot change. (A genuine
    U+FFFD at the very end is held back too, until a later character or the end of the sequence settles it.)"""
    return text.rstrip(_REPLACEMENT)


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas (see the module docstring).

    Args:
        tokenizer: a ``transformers`` tokenizer.
        stop: strings that end the completion; the text is cut before the first one found.

    Call :meth:`add` with each new token; it returns the text that is now safe to send. After a stop string is
    found, :attr:`stopped` is true and every later :meth:`add` returns ``""``. Call :meth:`flush` when the
    sequence ends for the rest.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far (cut at a stop string once one is found)
        self.sent = 0  # characters of self.text already released
        self.stopped = False
        self.num_tokens_kept = 0  # tokens up to the one that completed the stop string (all, if none)

    def _decode(self) -> str:
        # clean_up_tokenization_spaces=False: the clean-up rewrites " ." as "." and so could change text that
        # was already sent when the next token arrives
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Take one token; return the newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        self.num_tokens_kept = len(self.ids)
        self.text = self._decode()
        ready = len(settled(self.text))  # characters that can no longer change
        if self._cut(ready):
            return self._release(len(self.text))
        return self._release(ready - self.hold)

    def flush(self) -> str:
        """The sequence ended: its text is final (an incomplete final character stays U+FFFD, exactly as the
        whole completion decodes), so the rest of it is searched for a stop string and released."""
        if not self.stopped:
            self._cut(len(self.text))
        return self._release(len(self.text))

    def _cut(self, upto: int) -> bool:
        """Search ``text[:upto]`` for a stop string; if one is found, cut the text before it and stop. Only the
        last ``hold`` characters already released, and what came after them, can hold a stop string not yet
        found (an earlier one would have lain wholly in text searched before)."""
        if not self.stop:
            return False
        start = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, start, upto) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        self.stopped = True
        return True

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out
