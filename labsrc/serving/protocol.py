"""The OpenAI completions request as the server accepts it, and the limits it enforces at the door.

Every field OpenAI's ``/v1/completions`` defines that the engine implements is here, checked before the request
reaches the engine (so that nothing a client sends can make an engine step fail). OpenAI's fields that the
engine does not implement (``best_of``, ``logit_bias``, the penalties, ``suffix``, ``stream_options``) are
accepted with a value that asks for nothing (``best_of: 1``, ``logit_bias: {}`` or all-zero biases, a
penalty of 0, ``suffix: ""``, ``null``; ``user`` is only a label) and refused with 400 naming the field for
any other value, never accepted and ignored; an unknown field is refused too. ``null`` for an optional field
is its default, as in OpenAI's API. Types are strict: ``"5"`` is not a number and ``true`` is not 1.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
    samples with ``seed + j`` (wrapping past 2**63 - 1, :meth:`choice_seed`). ``stop``: up to 4 strings; the
    text is cut before the first one generated, and ``finish_reason`` is ``"stop"``. ``echo``: the prompt's
    text comes first in each choice's text (and its tokens in ``logprobs``, the first with ``null``).
    ``logprobs=k``: each token's log-probability and the ``k`` most likely alternatives with the chosen token
    (OpenAI's object: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``;
    :mod:`labsrc.serving.logprobs`).

    The no-op fields (see the module docstring) are kept only to be checked: nothing reads them.
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
    # OpenAI's fields the engine does not implement: accepted only with a value that asks for nothing
    best_of: int | None = None
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    stream_options: dict | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        # OpenAI's API (and clients that send every field) give null for "not set": the field's default
        if isinstance(data, dict):
            defaulted = {"max_tokens", "temperature", "top_p", "n", "echo", "stream", "ignore_eos"}
            return {k: v for k, v in data.items() if not (v is None and k in defaulted)}
        return data

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        n = info.data.get("n", 1)
        if v is not None and not v == n == 1:
            raise ValueError(f"best_of={v} is not implemented (n={n}): only best_of 1 with n 1, which asks for "
                             "nothing, is accepted")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        if v not in (None, 0):
            raise ValueError(f"{info.field_name}={v} is not implemented: only 0 (no penalty) is accepted")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v and any(b != 0 for b in v.values()):
            raise ValueError("logit_bias is not implemented: only {} or biases of 0 are accepted")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not implemented: only null or \"\" is accepted")
        return v

    @field_validator("stream_options")
    @classmethod
    def _no_stream_options(cls, v):
        if v and any(v.values()):
            raise ValueError(f"stream_options {v} is not implemented: only null, {{}} or false options are "
                             "accepted")
        return v

    def choice_seed(self, j: int) -> int | None:
        """The seed of completion ``j`` of each prompt: ``seed + j``, wrapping past ``2**63 - 1`` to 0, so that
        the ``n`` completions of any seed get ``n`` different seeds (clamping gave them all the same one)."""
        return None if self.seed is None else (self.seed + j) % (MAX_SEED + 1)

    def prompts(self) -> list:
        """The prompt as a list of prompts (each a string or a list of token ids)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
