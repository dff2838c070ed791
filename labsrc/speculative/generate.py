"""The speculative decoding loop shared by every drafter: draft a window, verify it with the target in one
forward, keep the accepted tokens and roll the caches back; the draft model drafter and the statistics.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from labsrc.sampling import check_sampling, sampling_probs
from labsrc.speculative.common import _eos_ids, _forward, _new_cache, _rollback, cache_nbytes
from labsrc.speculative.draft_cache import KVProjection
from labsrc.speculative.theory import _check_k, adaptive_window
from labsrc.speculative.verify import verify


class _AssistedGenerationNote(logging.Filter):
    """Drop one deprecation note that transformers' *own* assisted generation triggers.

    ``target.generate(..., assistant_model=draft)`` makes its candidate generator call the draft's ``generate``
    with a ``generation_config`` and generation arguments together, and transformers then logs that doing so
    "is deprecated". The caller did nothing wrong and cannot avoid it; the chapter compares against assisted
    generation, so the note would print on its page. Only this message is dropped.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing `generation_config` together with generation-related" not in record.getMessage()


logging.getLogger("transformers.generation.utils").addFilter(_AssistedGenerationNote())


@dataclass
class StepStats:
    """One draft-verify cycle: window, drafted and accepted tokens, tokens emitted, seconds spent."""
    k: int
    drafted: int
    accepted: int
    emitted: int
    draft_seconds: float
    target_seconds: float
    accepted_mask: tuple[bool, ...] = ()
    cut: bool = False              # the window was shortened by the token budget, not chosen by the rule


@dataclass
class SpecStats:
    """Per-step statistics of :func:`speculative_generate` and their totals."""
    steps: list[StepStats] = field(default_factory=list)
    target_calls: int = 0          # target forward passes after the prefill
    draft_calls: int = 0           # draft forward passes after the prefill
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    new_tokens: int = 0
    target_cache_bytes: int = 0    # peak stored bytes of the target's KV cache (after each verification)
    draft_cache_bytes: int = 0     # peak stored bytes of the draft's own KV cache; 0 when it shares the target's

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance(self) -> float:
        """Accepted / drafted (the per-token acceptance rate the windows saw)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_call(self) -> float:
        """New tokens per target call (1.0 for ordinary decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else float("nan")


class _TwoModels:
    """A separate draft model: each model keeps its own KV cache (``draft_cache(draft)`` builds the draft's)."""

    def __init__(self, target, draft, draft_cache=None, kv_projection=None):
        self.target, self.draft, self.kv_projection = target, draft, kv_projection
        self.tcache = _new_cache(target)
        self.dcache = _new_cache(draft) if draft_cache is None else draft_cache(draft)
        if not (hasattr(self.dcache, "get_seq_length") and hasattr(self.dcache, "crop")):
            raise TypeError(f"draft_cache(draft) must return a transformers Cache, got {type(self.dcache).__name__}")

    def prefill(self, ids):
        _forward(self.target, ids, self.tcache)
        if self.kv_projection is not None:    # the draft's prompt cache from the target's, without a draft run
            self.dcache = self.kv_projection.draft_cache(self.target, self.draft, self.tcache)
        else:
            _forward(self.draft, ids, self.dcache)

    def draft_length(self) -> int:
        return self.dcache.get_seq_length()

    def target_length(self) -> int:
        return self.tcache.get_seq_length()

    def draft_next(self, ids) -> torch.Tensor:
        return _forward(self.draft, ids, self.dcache)[-1]

    def score(self, feed) -> torch.Tensor:
        return _forward(self.target, feed, self.tcache)

    def rollback(self, length: int) -> None:
        _rollback(self.tcache, length)
        _rollback(self.dcache, min(self.dcache.get_seq_length(), length))

    def cache_bytes(self) -> tuple[int, int]:
        return cache_nbytes(self.tcache), cache_nbytes(self.dcache)


def _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a torch.long tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (T,) or (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _check_k(k)
    if window not in ("fixed", "adaptive"):
        raise ValueError(f"window must be 'fixed' or 'adaptive', got {window!r}")
    if do_sample:
        check_sampling(temperature, top_p)
    return input_ids


def speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                         do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None, window: str = "fixed",
                         stats: SpecStats | None = None, stop_at_eos: bool = True, draft_cache=None,
                         kv_projection: KVProjection | None = None) -> tuple[torch.Tensor, SpecStats]:
    """Generate with ``draft`` proposing and ``target`` verifying; returns ``(ids (1, T + n), stats)``.

    Both models keep a transformers KV cache; after each verification both are cut back to the accepted
    prefix (the rejected drafts' keys and values must not stay in the cache). ``do_sample=False`` gives the
    target's greedy output token for token (the same as ``target.generate(do_sample=False)``);
    ``do_sample=True`` samples from the target's distribution after ``temperature`` and ``top_p``
    (:func:`labsrc.sampling.sampling_probs`, the rule the serving engine uses: ``temperature=0`` is greedy, and
    a tiny temperature is its exact limit, never NaN).
    ``window="adaptive"`` re-chooses ``k`` each cycle from an EMA (rho = 0.9) of the acceptance,
    ``k = max(2, min(8, floor(alpha_hat * 10)))``, starting from ``alpha_hat = k / 10``. Generation stops at
    ``max_new_tokens`` or after the target's end-of-sequence token (``stop_at_eos``). Pass ``stats`` to
    collect into an existing :class:`SpecStats`. Batch size 1: ``input_ids`` is ``(T,)`` or ``(1, T)``.
    ``draft_cache``: a function ``draft -> Cache`` for the draft's KV cache, e.g. a quantized
    :class:`labsrc.kv_quant.KVarNCache` (10.4.5); it must be able to drop the newest ``k - 1`` tokens.
    ``kv_projection``: build the draft's cache of the prompt from the target's with a :class:`KVProjection`
    instead of running the draft over the prompt (10.4.5's draft KV sharing).
    """
    input_ids = _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p)
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft must share a vocabulary: {target.config.vocab_size} != "
                         f"{draft.config.vocab_size}")
    if draft_cache is not None and not callable(draft_cache):
        raise TypeError(f"draft_cache must be a function draft -> Cache, got {type(draft_cache).__name__}")
    if kv_projection is not None and not isinstance(kv_projection, KVProjection):
        raise TypeError(f"kv_projection must be a KVProjection, got {type(kv_projection).__name__}")
    if kv_projection is not None and draft_cache is not None:
        raise ValueError("give draft_cache or kv_projection, not both (a projected cache is a DynamicCache)")
    engine = _TwoModels(target, draft, draft_cache, kv_projection)
    _check_rollback_window(engine.dcache, (8 if window == "adaptive" else k) - 1)
    return _speculate(engine, target, input_ids, max_new_tokens, k, do_sample, temperature, top_p, generator,
                      window, stats, stop_at_eos)


def _check_rollback_window(cache, need: int) -> None:
    """A quantized draft cache must hold the newest ``need`` tokens in full precision: a rejection drops up to
    ``k - 1`` drafted tokens, and quantized groups cannot be split (:meth:`labsrc.kv_quant.KVarNLayer.crop`)."""
    from labsrc.kv_quant import KVarNLayer

    for layer in getattr(cache, "layers", []):
        if isinstance(layer, KVarNLayer) and layer.enabled and layer.window < need:
            raise ValueError(f"draft_cache keeps the newest {layer.window} tokens in full precision, but a "
                             f"rejection can roll back {need} drafted tokens; build it with window >= {need}")


def _speculate(
    engine, target, input_ids, max_new_tokens, k, do_sample, temperature, top_p,
    generator, window, stats, stop_at_eos,
) -> tuple[torch.Tensor, SpecStats]:
    """The draft-verify loop shared by :func:`speculative_generate`,
    :func:`self_speculative_generate` and :func:`prompt_lookup_generate`; ``engine`` owns
    the caches (``prefill``, ``draft_next``, ``score``, ``rollback``, ``cache_bytes``).
    An engine with a ``propose(seq, kk)`` method drafts deterministically instead of
    calling ``draft_next``: it returns up to ``kk`` tokens (possibly none), each verified
    as a draft with a one-hot ``q``."""
    stats = SpecStats() if stats is None else stats
    device = next(target.parameters()).device
    seq = input_ids.to(device)
    eos = _eos_ids(target) if stop_at_eos else set()
    alpha_hat = min(1.0, k / 10)
    t_start = time.perf_counter()

    def dist(logits):  # greedy is temperature 0 of the one sampling rule
        return sampling_probs(logits, temperature if do_sample else 0.0, top_p)

    t0 = time.perf_counter()
    if seq.shape[1] > 1:
        # prefill everything but the last token; the last is fed with the first window
        engine.prefill(seq[:, :-1])
    stats.prefill_seconds += time.perf_counter() - t0
    produced = 0
    while produced < max_new_tokens:
        rule_k = adaptive_window(alpha_hat) if window == "adaptive" else k
        # never draft past the budget: the target adds one
        kk = min(rule_k, max_new_tokens - produced - 1)
        # ---- draft up to kk tokens: one draft call each, or a deterministic proposal
        # (no model call)
        t0 = time.perf_counter()
        drafted, qs = [], []
        if hasattr(engine, "propose"):
            # a deterministic draft is a one-hot q: min(1, p/q) accepts x with
            # probability p(x), and the residual max(p - q, 0) is p with x removed,
            # renormalised; the verification below is unchanged
            drafted = engine.propose(seq, kk)
            one_hot = torch.nn.functional.one_hot
            vocab = target.config.vocab_size
            qs = [one_hot(torch.tensor(t, device=device), vocab).float()
                  for t in drafted]
        else:
            pending = seq[:, engine.draft_length():]
            for _ in range(kk):
                q = dist(engine.draft_next(pending))
                tok = (
                    torch.multinomial(q, 1, generator=generator)
                    if do_sample
                    else q.argmax(-1, keepdim=True)
                )
                drafted.append(int(tok))
                qs.append(q)
                pending = tok.view(1, 1).to(device)
            stats.draft_calls += kk
        t_draft = time.perf_counter() - t0
        # ---- one target call scores the last token and all drafts
        t0 = time.perf_counter()
        x = torch.tensor(drafted, dtype=torch.long, device=device)
        feed = torch.cat([seq[:, engine.target_length():], x[None]], dim=1)
        logits = engine.score(feed)[-(len(drafted) + 1):]
        stats.target_calls += 1
        p = dist(logits)
        q_all = torch.stack(qs) if qs else p.new_zeros((0, p.shape[-1]))
        out, n_acc = verify(x, q_all, p, generator=generator, greedy=not do_sample)
        t_target = time.perf_counter() - t0
        # the peak: the drafts are still cached
        t_bytes, d_bytes = engine.cache_bytes()
        stats.target_cache_bytes = max(stats.target_cache_bytes, t_bytes)
        stats.draft_cache_bytes = max(stats.draft_cache_bytes, d_bytes)
        emitted = out.tolist()
        # stop after an end-of-sequence token, as generate() does
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        seq = torch.cat(
            [seq, torch.tensor([emitted], dtype=torch.long, device=device)], dim=1
        )
        produced += len(emitted)
        # ---- roll the caches back to the accepted prefix: everything but the newest
        # token is cached
        engine.rollback(seq.shape[1] - 1)
        acc_mask = tuple(j < n_acc for j in range(len(drafted)))
        if drafted:
            alpha_hat = 0.9 * alpha_hat + 0.1 * (n_acc / len(drafted))
        stats.steps.append(
            StepStats(
                k=kk,
                drafted=len(drafted),
                accepted=n_acc,
                emitted=len(emitted),
                draft_seconds=t_draft,
                target_seconds=t_target,
                accepted_mask=acc_mask,
                cut=kk < rule_k,
            )
        )
        if emitted and emitted[-1] in eos:
            break
    stats.new_tokens += min(produced, max_new_tokens)
    stats.wall_seconds += time.perf_counter() - t_start
    return seq[:, : input_ids.shape[1] + max_new_tokens], stats
