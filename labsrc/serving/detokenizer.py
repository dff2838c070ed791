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
"""
from __future__ import annotations

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


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
        if self.stop:
            start = max(0, self.sent - self.hold)  # a stop string may begin in the held-back tail
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                return self._release(len(self.text))
        safe = len(self.text.rstrip(_REPLACEMENT))  # an incomplete character decodes to a trailing U+FFFD
        return self._release(min(safe, len(self.text) - self.hold))

    def flush(self) -> str:
        """The sequence ended: release everything not yet sent (an incomplete final character stays U+FFFD,
        exactly as the whole completion decodes)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out
