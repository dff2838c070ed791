"""The chapter's serving experiments as functions: request traces, replaying them through an engine on a step
clock, and the memory arithmetic of reservation against paging.

A trace's arrivals are counted in engine *steps* (a Poisson process with ``rate`` requests per step), so that
a replay is deterministic: the same trace gives the same schedule, steps and tokens on any machine, and only
the seconds depend on the hardware. Seconds are measured too, and reported beside the steps.
"""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from labsrc.serving.scheduler import SamplingParams

__all__ = ["poisson_trace", "replay", "concurrent_fit", "allocated_slots", "blocks_to_keep", "prefill_for_eviction",
           "evict_and_answer", "paged_eviction_matches"]


def poisson_trace(n: int, rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0,
                  vocab: int = 4096, prefixes: list[list[int]] | None = None) -> list[dict]:
    """``n`` requests: arrival step (Poisson, ``rate`` per step), random prompt ids of a length drawn uniformly in
    ``prompt_range`` (after one of ``prefixes``, drawn at random, when given), and ``max_tokens`` drawn in
    ``output_range`` (EOS ignored, so that every request produces exactly that many tokens)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, size=n) if rate > 0 else np.zeros(n)
    arrivals = np.floor(np.cumsum(gaps)).astype(int) if rate > 0 else np.zeros(n, dtype=int)
    trace = []
    for i in range(n):
        prompt = rng.integers(5, vocab, size=int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
        if prefixes:
            prompt = list(prefixes[int(rng.integers(len(prefixes)))]) + prompt
        trace.append(dict(arrival=int(arrivals[i]), prompt=prompt,
                          max_tokens=int(rng.integers(output_range[0], output_range[1] + 1))))
    return trace


def replay(engine, trace: list[dict]) -> dict:
    """Run a trace through ``engine``: a request joins the queue at the first step at or after its arrival.

    Returns the outputs (token ids per request, in trace order), ``steps``, ``seconds``, ``output_tokens``,
    per-request time to first token in steps and seconds (``ttft_steps``, ``ttft_s``), ``prefill_tokens``
    (tokens actually run through prefill, recomputation included), ``preemptions`` and the engine's step log.
    """
    order = sorted(range(len(trace)), key=lambda i: trace[i]["arrival"])
    ids: dict[int, int] = {}
    joined_step: dict[int, int] = {}
    joined_time: dict[int, float] = {}
    first_step: dict[int, int] = {}
    step, nxt = 0, 0
    log = []  # this trace's steps (engine.step_log keeps only the latest ones, and not only this trace's)
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished():
        while nxt < len(order) and trace[order[nxt]]["arrival"] <= step:
            i = order[nxt]
            params = SamplingParams(max_tokens=trace[i]["max_tokens"], ignore_eos=True)
            ids[i] = engine.add_request(trace[i]["prompt"], params)
            joined_step[i], joined_time[i] = step, time.perf_counter()
            nxt += 1
        before = engine.num_steps
        for rid, _, _ in engine.step():
            i = next(k for k, v in ids.items() if v == rid)
            first_step.setdefault(i, step + 1 - joined_step[i])
        if engine.num_steps > before:  # a step with nothing scheduled logs nothing
            log.append(engine.step_log[-1])
        step += 1
    seconds = time.perf_counter() - t0
    outs = [engine.seqs[ids[i]].output for i in range(len(trace))]
    return dict(
        outputs=[list(o) for o in outs], steps=step, seconds=seconds, output_tokens=sum(len(o) for o in outs),
        ttft_steps=[first_step[i] for i in range(len(trace))],
        ttft_s=[engine.seqs[ids[i]].first_token_time - joined_time[i] for i in range(len(trace))],
        prefill_tokens=sum(r["prefill_tokens"] for r in log),
        preemptions=sum(engine.seqs[ids[i]].num_preemptions for i in range(len(trace))), log=log)


def allocated_slots(lengths, block_size: int) -> int:
    """Slots a paged cache allocates for sequences of these lengths: ``sum ceil(n / block_size) * block_size``."""
    return int(sum(math.ceil(n / block_size) * block_size for n in lengths))


def concurrent_fit(lengths, pool_tokens: int, *, reserve: int | None = None, block_size: int | None = None) -> int:
    """How many of the requests, taken in order, fit at once in a cache of ``pool_tokens`` slots: each reserving
    ``reserve`` slots, or each holding ``ceil(n / block_size)`` blocks of its final length ``n``."""
    if (reserve is None) == (block_size is None):
        raise ValueError("give exactly one of reserve= and block_size=")
    used = 0
    for k, n in enumerate(lengths):
        used += reserve if reserve is not None else math.ceil(n / block_size) * block_size
        if used > pool_tokens:
            return k
    return len(lengths)


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` on one prompt alone, EOS ignored: what the engine must reproduce."""
    import copy

    device = next(model.parameters()).device
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # run past EOS, as the engine does with ignore_eos
    config.pad_token_id = 1
    config.do_sample = False
    config.max_new_tokens = max_tokens
    out = model.generate(torch.tensor([prompt], device=device), generation_config=config)
    return out[0, len(prompt):].tolist()


def blocks_to_keep(n_tokens: int, kept: float, block_size: int, protect: int = 1) -> int:
    """How many of a prompt's ``ceil(n_tokens / block_size)`` blocks to keep so that the tokens they hold come
    closest to chapter 6's token budget for the same share, :func:`labsrc.evict.budget_for` ``(n_tokens,
    1 - kept)``: the last block (partly filled, never dropped) holds ``n_tokens`` mod ``block_size`` tokens
    (or a full block), every other block ``block_size``. At least the ``protect`` first blocks and the last
    stay, so the two budgets are equal within half a block."""
    from labsrc.evict import budget_for

    if not 0.0 < kept < 1.0:
        raise ValueError(f"kept must lie in (0, 1), got {kept!r}")
    n_blocks = -(-n_tokens // block_size)
    last = n_tokens - (n_blocks - 1) * block_size
    budget = budget_for(n_tokens, 1.0 - kept)
    return min(n_blocks, max(protect + 1, 1 + round((budget - last) / block_size)))


def prefill_for_eviction(model, sample, block_size: int = 16, window: int = 8, kernels: str = "torch",
                         tokenizer=None):
    """An engine holding one probe sample's prompt, prefilled in one chunk (its last ``window`` queries of every
    layer recorded, for the block scores), with the first answer token sampled from the full cache, as chapter
    6's evicting cache does: ``(engine, request id)``, the state :func:`evict_and_answer` drops blocks from. The
    prefill is the same whatever is evicted afterwards, so one serves every policy and budget."""
    from labsrc.serving.engine import Engine

    prompt, answer = list(sample.prompt_ids), list(sample.answer_ids)
    engine = Engine(model, num_blocks=-(-(len(prompt) + len(answer)) // block_size) + 1, block_size=block_size,
                    max_num_batched_tokens=len(prompt), max_num_seqs=1, tokenizer=tokenizer, kernels=kernels)
    engine.record_queries = window
    rid = engine.add_request(prompt, SamplingParams(max_tokens=len(answer), ignore_eos=True))
    engine.step()  # the whole prompt: its cache, and the first answer token
    return engine, rid


def evict_and_answer(prefilled, sample, policy: str | None, kept: float | None, seed: int = 0) -> bool:
    """Does greedy decoding reproduce ``sample``'s answer exactly after whole blocks are dropped?

    Works on a copy of ``prefilled`` (from :func:`prefill_for_eviction`; the model and tokenizer are shared,
    the pools, tables and queues copied), so the prefilled engine stays as it was.
    :meth:`~labsrc.serving.engine.Engine.evict_blocks` drops all but :func:`blocks_to_keep` ``(prompt length,
    kept)`` blocks by ``policy`` (the first block and the last always stay; random choices seeded by ``seed``)
    and the rest of the answer is decoded from what is left. ``policy=None`` with ``kept=None`` is the full
    cache."""
    if (policy is None) != (kept is None):
        raise ValueError("give both policy and kept, or neither (the full cache)")
    template, rid = prefilled
    engine = copy.deepcopy(template, {id(template.model): template.model, id(template.tokenizer): template.tokenizer})
    if policy is not None:
        n_table = len(engine.blocks.block_table(rid))
        drop = n_table - blocks_to_keep(len(sample.prompt_ids), kept, engine.block_size)
        engine.evict_blocks(rid, drop, policy=policy, generator=torch.Generator().manual_seed(seed))
    while engine.has_unfinished():
        engine.step()
    return engine.seqs[rid].output == list(sample.answer_ids)


def paged_eviction_matches(model, samples, policy: str | None, kept: float | None, seed: int = 0,
                           block_size: int = 16, window: int = 8, kernels: str = "torch", tokenizer=None,
                           prefilled=None) -> list[bool]:
    """For each probe sample (:class:`labsrc.tasks.Sample`): does greedy decoding through the paged engine
    reproduce its answer exactly, when whole blocks of its prompt are dropped after the prefill
    (:func:`prefill_for_eviction`, then :func:`evict_and_answer`)? ``policy=None`` with ``kept=None`` is the
    full cache. Sample j's random choices use seed ``seed + j``. ``prefilled``, if given, holds each sample's
    prefilled engine (a sweep prefills once and scores every policy and budget from it)."""
    if (policy is None) != (kept is None):
        raise ValueError("give both policy and kept, or neither (the full cache)")
    samples = list(samples)
    if prefilled is None:
        prefilled = [prefill_for_eviction(model, s, block_size, window, kernels, tokenizer) for s in samples]
    if len(prefilled) != len(samples):
        raise ValueError(f"prefilled holds {len(prefilled)} engines for {len(samples)} samples")
    return [evict_and_answer(pre, s, policy, kept, seed + j) for j, (pre, s) in enumerate(zip(prefilled, samples))]
