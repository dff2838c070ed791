"""The scheduler: iteration-level (continuous) batching with a token budget, chunked prefill and preemption.

Every engine step the scheduler decides which sequences run and how many of their tokens. It follows vLLM's
v1 scheduler in spirit ({cite}`kwon2023paged`, continuous batching {cite}`yu2022orca`): one token
budget per step (``max_num_batched_tokens``) shared by decodes and prefill chunks, so a long prompt is
split into chunks that run alongside the decodes of other sequences (*chunked prefill*) instead of
stalling them.

1. The running sequences first, in arrival order. A sequence still in its prompt takes the next chunk the
   budget allows; a decoding sequence takes one token. Before that token is written its slot is appended
   (:meth:`BlockManager.append_slot`); when no block is free the *latest admitted* running sequence is
   preempted -- its blocks freed, its progress dropped, and it goes back to the front of the queue, to be
   recomputed from its prompt and the tokens it already produced (*recompute* preemption; *swapping* would
   instead copy its blocks to CPU memory and back, which saves the recompute at the price of the transfers and
   a CPU pool).
2. Then waiting sequences, first come first served: the head of the queue is admitted when its blocks fit
   (:meth:`BlockManager.can_allocate`, cached prefix blocks included) and fewer than ``max_num_seqs`` run; if
   it does not fit, nobody behind it is admitted (no overtaking).

``policy="static"`` is the baseline it replaces: a batch is admitted only when the previous one has completely
finished, and runs until its longest member is done.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from labsrc.sampling import check_sampling
from labsrc.serving.blocks import BlockManager

__all__ = ["Sequence", "Scheduled", "Scheduler", "SamplingParams"]


MAX_SEED = 2 ** 63 - 1  # torch.Generator.manual_seed takes a 64-bit integer
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI allows 5 on completions, vLLM 20)


@dataclass
class SamplingParams:
    """How to pick each next token: ``temperature=0`` is greedy; ``top_p`` keeps the smallest set of tokens
    whose probability reaches it; ``seed`` makes sampling reproducible per request.

    ``logprobs=k`` records, for every generated token, its log-probability under the model (the raw logits'
    log-softmax, before temperature and top-p, as vLLM reports it) and the ``k`` most likely alternatives
    (``k = 0``: the token's own only); ``prompt_logprobs=True`` records the same for every prompt token after
    the first (the request then computes its whole prompt, no prefix-cache hits, since a cached block has no
    logits). Every field is checked here, so a request that reaches the engine cannot make a step fail."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        try:  # the one rule for what can be sampled (labsrc.sampling), so the engine never meets a NaN
            check_sampling(self.temperature, self.top_p)
        except TypeError as e:  # every bad field of a request is one kind of error here
            raise ValueError(str(e)) from None
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63 - 1], got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.prompt_logprobs, bool):
            raise ValueError(f"prompt_logprobs must be a bool, got {self.prompt_logprobs!r}")


@dataclass
class Sequence:
    """One request: its prompt, what it has produced, and how far its K/V is computed."""
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V has been computed (positions 0 .. num_computed - 1)
    dropped: int = 0  # tokens evicted from the cache in whole blocks: the cache holds tokens - dropped
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    generator: object = None
    error: str | None = None  # why the sequence failed (finish_reason "error"); the others go on
    logprobs: list = field(default_factory=list)  # per output token: (logprob, {token: logprob} of the top k)
    prompt_logprobs: dict = field(default_factory=dict)  # prompt position p >= 1 -> (logprob, top k)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Scheduled:
    """A sequence's share of one step: tokens ``start .. start + n - 1`` are computed."""
    seq: Sequence
    start: int
    n: int
    samples: bool = field(init=False)  # the step ends at the sequence's last token: its logits give a new one

    def __post_init__(self):
        self.samples = self.start + self.n == len(self.seq.tokens)


class Scheduler:
    """Decide, step by step, which tokens of which sequences run (see the module docstring)."""

    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "continuous"):
        for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.dropped = 0  # recomputation rebuilds the whole cache
        seq.status = "waiting"
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def admits(self, seq: Sequence) -> bool:
        """The admission test: room in the batch, and blocks for every token the sequence holds."""
        return len(self.running) < self.max_num_seqs and \
            self.blocks.can_allocate(seq.tokens, use_cache=not seq.params.prompt_logprobs)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # 1 after a sampled token, else 0
            missing = len(seq.tokens) - seq.dropped - self.blocks.num_tokens(seq.seq_id)
            if missing:
                while not self.blocks.can_append(seq.seq_id):
                    victim = self.running.pop()  # the latest admitted goes first
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status == "waiting":
                    break  # it preempted itself: everything after it is gone too
                self.blocks.append_slot(seq.seq_id, seq.tokens[-1])
            n = min(len(seq.tokens) - seq.num_computed, budget)
            out.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
            i += 1
        if self.policy == "static" and self.running:
            return out
        while self.waiting and budget > 0 and self.admits(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.num_computed = self.blocks.allocate(
                seq.seq_id, seq.tokens, use_cache=not seq.params.prompt_logprobs
            )
            seq.status = "running"
            self.running.append(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            out.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running or waiting sequence (``reason``: stop, length, context, abort, error); its blocks go
        back to the pool. Finishing a finished sequence does nothing."""
        if seq.status == "finished":
            return
        if seq.status == "running":
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = "finished", reason
