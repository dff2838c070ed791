"""The OpenAI completions request as the server accepts it, and the limits it enforces at the door.

Every field OpenAI's ``/v1/completions`` defines that the engine implements is here, checked before the request
reaches the engine (so that nothing a client sends can make an engine step fail); any other field -- unknown,
or an OpenAI field the engine does not implement (``best_of``, ``logit_bias``, the penalties, ``suffix``) -- is
refused with 400 instead of being accepted and ignored. Types are strict: ``"5"`` is not a number and ``true``
is not 1.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from labsrc.serving.scheduler import MAX_SEED

__all__ = ["CompletionRequest", "MAX_N", "MAX_STOP", "MAX_LOGPROBS", "MAX_CHOICES"]

MAX_N = 16  # completions per prompt
MAX_CHOICES = 64  # prompts x n in one request
MAX_STOP = 4  # stop strings (OpenAI's limit)
MAX_LOGPROBS = 5  # top alternatives per token (OpenAI's limit on completions)

_Stop = Annotated[str, Field(min_length=1, max_length=256)]


class CompletionRequest(BaseModel):
    """OpenAI's completions request, the fields the engine implements (plus vLLM's ``ignore_eos``).

    ``prompt`` is a string, a list of token ids, or a list of either (a batch: choice ``i * n + j`` is the
    ``j``-th completion of prompt ``i``). ``n`` completions per prompt; with a ``seed``, completion ``j``
    samples with ``seed + j``. ``stop``: up to 4 strings; the text is cut before the first one generated, and
    ``finish_reason`` is ``"stop"``. ``echo``: the prompt's text comes first in each choice's text (and its
    tokens in ``logprobs``, the first with ``null``). ``logprobs=k``: each token's log-probability and the
    ``k`` most likely alternatives (OpenAI's object: ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``).
    """
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOP)] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    ignore_eos: bool = False

    def prompts(self) -> list:
        """The prompt as a list of prompts (each a string or a list of token ids)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
