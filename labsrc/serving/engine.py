"""The engine: a paged KV cache plugged into a ``transformers`` Llama, driven by the scheduler.

One step of :class:`Engine`:

1. the scheduler picks the tokens to run (:mod:`labsrc.serving.scheduler`);
2. the engine packs them into one flat batch -- every sequence's tokens side by side, with their positions and
   their *slot mapping* (the pool slot each new K/V goes to, from the block table);
3. one forward of the model, in which every attention layer (the ``"lab_paged"`` attention implementation
   registered here) writes the new K/V into its layer's pool through the slot mapping with chapter 1's
   :func:`~labsrc.kernels.kv_cache.kv_store`, then attends: all single-token queries together through
   :func:`~labsrc.kernels.serving.paged_decode_attention`, each prefill chunk through
   :func:`~labsrc.kernels.serving.paged_prefill_attention`;
4. sample a token for every sequence whose step reached its last token; finish on EOS, ``max_tokens`` or
   the model's context length.

The pools: one per layer for K and for V, each ``(num_blocks, block_size, n_kv_heads, head_dim)``.
``kernels="torch"`` runs the same steps in PyTorch (the default on a CPU, where Triton is interpreted): the
decodes of a step are attended *together*, one gather of every sequence's keys through a padded index and
one masked attention call per layer (:func:`batched_decode_attention`), instead of a Python-level call per
sequence.

A step that fails leaves the engine as it was before the step (nothing is marked computed until the forward
has returned); a failure in one sequence's sampling finishes that sequence alone, with ``finish_reason
"error"``, and the others go on.
"""
from __future__ import annotations

import collections
import time

import torch

import labsrc  # noqa: F401  (interpreter switch before triton loads)
from labsrc import runtime
from labsrc.kernels import kv_cache as _kv
from labsrc.kernels import serving as _pa
from labsrc.models import config_head_dim
from labsrc.sampling import sample_token
from labsrc.serving.blocks import BlockManager, slot_mapping
from labsrc.serving.scheduler import SamplingParams, Scheduled, Scheduler, Sequence

__all__ = ["Engine", "SamplingParams", "NAME"]

NAME = "lab_paged"


class _Batch:
    """What the attention layers need for one step, handed to them through the model's ``**kwargs``."""

    def __init__(self, engine: "Engine", scheduled: list[Scheduled]):
        dev = engine.device
        bs = engine.block_size
        self.engine = engine
        slots, self.decode, self.prefill = [], [], []
        at = 0
        for item in scheduled:
            table = engine.blocks.block_table(item.seq.seq_id)
            kv = item.start - item.seq.dropped  # where the chunk goes in the cache (positions stay item.start..)
            slots += slot_mapping(table, kv, kv + item.n, bs)
            entry = (at, item.n, kv + item.n, table, item.seq.seq_id)  # (first row, rows, keys, table, id)
            (self.decode if item.n == 1 else self.prefill).append(entry)
            at += item.n
        self.slots = torch.tensor(slots, dtype=torch.int64, device=dev)
        if self.decode:
            width = max(len(e[3]) for e in self.decode)
            self.decode_rows = torch.tensor([e[0] for e in self.decode], device=dev)
            self.decode_tables = torch.tensor([e[3] + [0] * (width - len(e[3])) for e in self.decode],
                                              dtype=torch.int32, device=dev)
            self.decode_lens = torch.tensor([e[2] for e in self.decode], dtype=torch.int32, device=dev)
            if engine.kernels == "torch":
                # The same for every layer, so built once per step: the pool slot of every cached key of every
                # decoding sequence, padded to the longest (padding reads slot 0 and is masked out).
                longest = max(e[2] for e in self.decode)
                pos = torch.arange(longest, device=dev)
                tables = self.decode_tables.long()
                self.decode_mask = pos[None, :] < self.decode_lens.long()[:, None]  # (B, L)
                self.decode_slots = torch.where(
                    self.decode_mask, tables.gather(1, (pos // bs).clamp(max=width - 1).expand(len(tables), -1))
                    * bs + pos % bs, 0)  # (B, L)


def batched_decode_attention(q, k_pool, v_pool, slots, mask, scaling):
    """Every decoding sequence of a step at once: ``q (B, Hq, D)`` against the keys at ``slots (B, L)`` of the
    flattened pools, ``mask (B, L)`` marking the real ones; returns ``(B, Hq, D)``.

    The same result as :func:`~labsrc.kernels.serving.paged_decode_attention_ref` (a loop over the
    sequences), as one gather and one attention call: on a CPU each call costs more in Python and dispatch
    than in arithmetic for a small model, so the per-sequence loop, not the FLOPs, set the engine's speed."""
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    k = k_pool.view(-1, hkv, d)[slots].transpose(1, 2)  # (B, Hkv, L, D)
    v = v_pool.view(-1, hkv, d)[slots].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None],
                                                           scale=scaling, enable_gqa=True)
    return out[:, :, 0]


def prefill_attention(q, k_pool, v_pool, table, ctx, sm_scale=None):
    """One prefill chunk on the PyTorch path: ``q (Hq, Tq, D)`` against the sequence's first ``ctx`` keys,
    causal and bottom-right aligned (query ``i`` sees keys ``j <= i + ctx - Tq``), in one fused attention call;
    the same result as :func:`~labsrc.kernels.serving.paged_prefill_attention_ref`."""
    k, v = _pa.gather_kv(k_pool, v_pool, table, ctx)  # (Hkv, ctx, D)
    tq = q.shape[1]
    mask = None if tq == ctx else \
        torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - tq, ctx, device=q.device)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                            is_causal=mask is None, scale=sm_scale,
                                                            enable_gqa=True)[0]


def paged_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None,
    lab_paged_batch=None, **kwargs,
):
    """The ``"lab_paged"`` attention: store the step's new K/V in the layer's pool, then attend through the
    block tables. ``query (1, Hq, N, D)``, ``key``/``value`` ``(1, Hkv, N, D)`` hold the N tokens of the
    step, every sequence's side by side; returns ``(1, N, Hq, D)``."""
    batch = lab_paged_batch
    if batch is None:
        raise ValueError(
            "the lab_paged attention runs inside labsrc.serving.Engine only "
            "(no batch context)"
        )
    eng = batch.engine
    k_pool, v_pool = eng.k_pools[module.layer_idx], eng.v_pools[module.layer_idx]
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)  # (N, Hkv, D)
    store = _kv.kv_store if eng.kernels == "triton" else _kv.kv_store_ref
    if eng.kernels == "triton":
        store(
            k_pool.view(-1, hkv, d),
            v_pool.view(-1, hkv, d),
            k_new,
            v_new,
            batch.slots,
            validate_slots=False,
        )
    else:
        store(
            k_pool.view(-1, hkv, d), v_pool.view(-1, hkv, d), k_new, v_new, batch.slots
        )
    q = query[0]  # (Hq, N, D)
    # (N, Hq, D)
    out = torch.empty(
        q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device
    )
    if batch.decode:
        q_dec = q[:, batch.decode_rows].transpose(0, 1)  # (B, Hq, D)
        if eng.kernels == "triton":
            out[batch.decode_rows] = _pa.paged_decode_attention(
                q_dec,
                k_pool,
                v_pool,
                batch.decode_tables,
                batch.decode_lens,
                sm_scale=scaling,
            )
        else:
            out[batch.decode_rows] = batched_decode_attention(
                q_dec.contiguous(),
                k_pool,
                v_pool,
                batch.decode_slots,
                batch.decode_mask,
                scaling,
            )
    pre = _pa.paged_prefill_attention if eng.kernels == "triton" else prefill_attention
    for at, n, ctx, table, seq_id in batch.prefill:
        tab = torch.tensor(table, dtype=torch.int32, device=q.device)
        out[at : at + n] = pre(
            q[:, at : at + n], k_pool, v_pool, tab, ctx, sm_scale=scaling
        ).transpose(0, 1)
        if eng.record_queries:
            # the chunk's last queries, for eviction scores (Engine.evict_blocks)
            eng.recorded[(seq_id, module.layer_idx)] = (
                q[:, at + max(0, n - eng.record_queries) : at + n].clone(),
                ctx,
                scaling,
            )
    return out[None], None


BLOCK_POLICIES = ("value", "attention", "recency", "random")  # what Engine.evict_blocks can drop blocks by


def _no_mask(*args, **kwargs):
    """The mask builder for ``"lab_paged"``: none. Which keys a query sees is in the block tables and lengths."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)


register()


def _is_decode(s: Scheduled) -> bool:
    return s.n == 1 and s.samples and s.start >= len(s.seq.prompt)


def _sample(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """One token from one row of logits, by the lab's one sampling rule (:func:`labsrc.sampling.sample_token`:
    argmax at ``temperature=0``, the exact limit for tiny temperatures, transformers' top-p nucleus)."""
    return sample_token(logits, params.temperature, params.top_p, generator)


def _logprob(logits: torch.Tensor, token: int, k: int) -> tuple[float, dict[int, float]]:
    """``token``'s log-probability under the raw logits, and the ``k`` most likely tokens' (float32)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, k) if k else None
    return float(lp[token]), ({} if top is None else dict(zip(top.indices.tolist(), top.values.tolist())))


class Engine:
    """A paged-KV serving engine for the lab's (Llama) models.

    Args:
        model_name_or_model: a shipped name (``"lab-target"``), a checkpoint folder, or a loaded model.
        num_blocks, block_size: the pool per layer.
        max_num_batched_tokens: the token budget per step (decodes plus prefill chunks).
        max_num_seqs: the most sequences running at once.
        tokenizer: needed for text prompts when a model object is given (a name loads its own).
        enable_prefix_caching: reuse computed blocks of equal prefixes.
        policy: ``"continuous"`` (iteration-level batching) or ``"static"`` (a new batch only when the last
            one is done).
        kernels: ``"triton"`` (the lab's kernels; interpreted on a CPU, hundreds of times slower) or ``"torch"``
            (PyTorch, with batched decode attention). Default: ``"triton"`` for a model on a GPU, ``"torch"``
            for a model on the CPU, whatever else the machine has (the kernels run where the model's tensors are).
        step_log_size: how many of the latest steps :attr:`step_log` keeps (one small dict each, for the timeline
            plot); ``num_steps`` counts them all. A served engine runs for days: the log must not grow with it.
    """

    def __init__(self, model_name_or_model, num_blocks: int, block_size: int, max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 16, tokenizer=None, enable_prefix_caching: bool = True,
                 policy: str = "continuous", kernels: str | None = None, step_log_size: int = 10_000):
        if isinstance(model_name_or_model, str):
            from labsrc.models import load
            model, tok = load(model_name_or_model)
            tokenizer = tokenizer or tok
        else:
            model = model_name_or_model
        self.device = next(model.parameters()).device
        if kernels is None:
            kernels = "triton" if self.device.type == "cuda" else "torch"
        if kernels not in ("triton", "torch"):
            raise ValueError(f"kernels must be 'triton' or 'torch', got {kernels!r}")
        if kernels == "triton" and self.device.type != "cuda" and not runtime.INTERPRETED:
            raise ValueError(f"kernels='triton' needs the model on a CUDA device (it is on {self.device}) or "
                             "Triton's interpreter (TRITON_INTERPRET=1); use kernels='torch'")
        if isinstance(step_log_size, bool) or not isinstance(step_log_size, int) or step_log_size < 1:
            raise ValueError(f"step_log_size must be a positive int, got {step_log_size!r}")
        cfg = model.config
        self.model, self.tokenizer, self.kernels = model, tokenizer, kernels
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_batched_tokens, max_num_seqs, policy)
        dtype = next(model.parameters()).dtype
        hkv = cfg.num_key_value_heads
        shape = (num_blocks, block_size, hkv, config_head_dim(cfg))
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.max_len = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        self._next_id = 0
        self.record_queries = 0  # > 0: keep each prefill chunk's last queries per layer (eviction scores)
        self.recorded: dict = {}
        self.seqs: dict[int, Sequence] = {}
        # one row per step, the latest step_log_size of them: the batch composition, for the timeline plot
        self.step_log: collections.deque[dict] = collections.deque(maxlen=step_log_size)
        self.num_steps = 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K and V pools over all layers."""
        return sum(p.numel() * p.element_size() for p in self.k_pools + self.v_pools)

    def encode(self, prompt) -> list[int]:
        """A prompt as token ids: text through the tokenizer, or a list of ints checked against the vocabulary
        (``TypeError`` for anything else, a tensor or an array included: pass ``.tolist()``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= (or a shipped model name)")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple)):
            hint = " (pass prompt.tolist())" if hasattr(prompt, "tolist") else ""
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}{hint}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            bad = next(t for t in prompt if isinstance(t, bool) or not isinstance(t, int))
            raise TypeError(f"prompt token ids must be ints, got {type(bad).__name__}")
        ids = list(prompt)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        return ids

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request that can never run: an empty prompt, one that fills the model's
        context, or one that may need more blocks than the whole pool. It reads only the engine's fixed sizes,
        so a server may call it from any thread, before the request reaches the engine's."""
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_len}")
        total = min(len(ids) + params.max_tokens, self.max_len)
        need = -(-total // self.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"the request may reach {total} tokens, {need} blocks, but the pool has "
                             f"{self.blocks.num_blocks}: it could never finish")

    def add_request(self, prompt, params: SamplingParams | None = None, arrival: float | None = None) -> int:
        """Queue a request (token ids or text); returns its id. Raises ``ValueError`` for a prompt that can
        never run (:meth:`check_request`) and ``TypeError`` for a prompt that is neither text nor token ids."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        self.check_request(ids, params)
        seq = Sequence(self._next_id, ids, params, arrival=time.perf_counter() if arrival is None else arrival)
        if params.temperature > 0:
            seq.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else seq.seq_id)
        self._next_id += 1
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def block_scores(self, request_id: int, alpha: float = 1.0, beta: float = 0.5, gamma: float = 0.3):
        """Chapter 6's value-aware score of every cached token, averaged per block: ``(n_blocks,)``.

        Per layer and K/V head, :func:`labsrc.evict.value_aware_scores` of the recorded last queries' attention
        (``record_queries`` must be set before the prefill) over the cached keys; each layer's scores are
        normalised to sum 1 and summed over layers and heads, and a block scores the mean of its tokens."""
        from labsrc.evict import value_aware_scores

        seq = self.seqs[request_id]
        table = self.blocks.block_table(request_id)
        n = seq.num_computed - seq.dropped
        total = torch.zeros(n)
        for layer in range(len(self.k_pools)):
            if (request_id, layer) not in self.recorded:
                raise ValueError("no recorded queries: set engine.record_queries = W before the prefill")
            q, ctx, scale = self.recorded[(request_id, layer)]
            k, v = _pa.gather_kv(self.k_pools[layer], self.v_pools[layer], torch.tensor(table), ctx)
            hkv, group = k.shape[0], q.shape[0] // k.shape[0]
            w = q.shape[1]
            scores = torch.einsum("hwd,hnd->hwn", q.float(), k.float().repeat_interleave(group, 0)) * scale
            visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - w, ctx)[:, None]  # causal, bottom-right
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            layer_scores = sum(value_aware_scores(probs[h * group:(h + 1) * group], v[h].float(), alpha, beta,
                                                  gamma) for h in range(hkv))
            total[:ctx] += (layer_scores / layer_scores.sum()).cpu()[:n]
        bs = self.block_size
        return torch.stack([total[i * bs:(i + 1) * bs].mean() for i in range(-(-n // bs))])

    def evict_blocks(self, request_id: int, n_blocks: int, policy: str = "value", protect: int = 1,
                     generator=None) -> list[int]:
        """Drop ``n_blocks`` whole blocks from a running request's cache and free them to the pool (10.3.10).

        The policies (:data:`BLOCK_POLICIES`): ``"value"`` drops the blocks with the lowest
        :meth:`block_scores` (chapter 6's value-aware score); ``"attention"`` the lowest by attention alone
        (the same scores with the value-norm and recency exponents at 0: H2O's accumulated attention over the
        recorded queries); ``"recency"`` the oldest blocks after the protected ones, so that the first blocks
        and the most recent stay (StreamingLLM's sinks and window, in pages); ``"random"`` random ones (the
        baseline). The first ``protect`` blocks (the start of the prompt: instructions, attention sinks) and
        the last block (being written) are never dropped. Positions do not change: later tokens keep their
        true positions, only the cache holds fewer keys. Returns the freed block ids."""
        seq = self.seqs[request_id]
        n_table = len(self.blocks.block_table(request_id))
        candidates = list(range(protect, n_table - 1))
        if not 0 <= n_blocks <= len(candidates):
            raise ValueError(f"n_blocks must lie in [0, {len(candidates)}] (blocks that may be dropped), got "
                             f"{n_blocks}")
        if policy in ("value", "attention"):
            scores = (self.block_scores(request_id) if policy == "value"
                      else self.block_scores(request_id, beta=0.0, gamma=0.0))
            order = sorted(candidates, key=lambda i: float(scores[i]))
        elif policy == "recency":
            order = candidates  # oldest first
        elif policy == "random":
            perm = torch.randperm(len(candidates), generator=generator).tolist()
            order = [candidates[i] for i in perm]
        else:
            raise ValueError(f"policy must be one of {BLOCK_POLICIES}, got {policy!r}")
        victims = order[:n_blocks]
        freed = self.blocks.drop_blocks(request_id, victims)
        seq.dropped += len(victims) * self.block_size
        return freed

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: int) -> None:
        """Stop a request now, waiting or running (``finish_reason "abort"``): its batch slot and its blocks are
        free for the others at once. Aborting a finished request does nothing."""
        self.scheduler.finish(self.seqs[request_id], "abort")

    def reset(self) -> None:
        """Drop every request (their blocks go back to the pool); the pools and the prefix cache stay."""
        for seq in self.scheduler.running:
            self.blocks.free(seq.seq_id)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.seqs.clear()

    @torch.inference_mode()
    def step(self) -> list[tuple[int, int, bool]]:
        """Run one step; return ``(request id, new token, finished)`` for every token sampled in it (the token
        is ``None`` for a sequence whose sampling failed: it is finished with ``finish_reason "error"``)."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        for src, dst in self.blocks.take_copies():  # copy-on-write owed by forks
            for pool in self.k_pools + self.v_pools:
                pool[dst].copy_(pool[src])
        if not scheduled:
            return []
        batch = _Batch(self, scheduled)
        ids = torch.tensor([t for s in scheduled for t in s.seq.tokens[s.start:s.start + s.n]], device=self.device)
        pos = torch.tensor([p for s in scheduled for p in range(s.start, s.start + s.n)], device=self.device)
        # The rows whose logits are needed: each sampling sequence's last token, and every row of a prompt
        # chunk whose request asked for prompt log-probabilities.
        keep, rows, at = [], [], 0
        for s in scheduled:
            want = s.seq.params.prompt_logprobs and s.start < len(s.seq.prompt)
            first = len(keep)
            if want:
                keep += range(at, at + s.n)
            elif s.samples:
                keep.append(at + s.n - 1)
            rows.append((first, len(keep), want))
            at += s.n
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation(NAME)
        try:
            # Nothing is marked computed before the forward returns: if it raises, the next step runs the
            # same tokens again (their slots are already held), and the state stays consistent.
            logits = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                                logits_to_keep=torch.tensor(keep or [0], device=self.device),
                                lab_paged_batch=batch).logits[0]
        finally:
            self.model.set_attn_implementation(prev)
        greedy = logits.argmax(-1).tolist()  # one call for every greedy row
        now = time.perf_counter()
        results = []
        for s, (first, last, want) in zip(scheduled, rows):
            seq = s.seq
            seq.num_computed = s.start + s.n
            self.blocks.mark_computed(seq.seq_id, seq.num_computed - seq.dropped)
            if want:  # row j (position start + j) predicts prompt token start + j + 1
                for j, p in enumerate(range(s.start + 1, min(s.start + s.n + 1, len(seq.prompt)))):
                    seq.prompt_logprobs[p] = _logprob(logits[first + j], seq.prompt[p], seq.params.logprobs or 0)
            if not s.samples:
                continue
            row = last - 1
            try:  # one sequence's failure is its own: it finishes with "error", the others go on
                token = greedy[row] if seq.params.temperature == 0 else \
                    _sample(logits[row].float(), seq.params, seq.generator)
                if seq.params.logprobs is not None:
                    seq.logprobs.append(_logprob(logits[row], token, seq.params.logprobs))
            except Exception as err:  # noqa: BLE001
                seq.error = f"{type(err).__name__}: {err}"
                self.scheduler.finish(seq, "error")
                results.append((seq.seq_id, None, True))
                continue
            seq.output.append(token)
            seq.token_times.append(now)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = None
            if token in self.eos and not seq.params.ignore_eos:
                reason = "stop"
            elif len(seq.output) >= seq.params.max_tokens:
                reason = "length"
            elif len(seq.tokens) >= self.max_len:
                reason = "context"
            if reason:
                self.scheduler.finish(seq, reason)
            results.append((seq.seq_id, token, reason is not None))
        self.step_log.append(dict(
            prefill_tokens=sum(s.n for s in scheduled if not _is_decode(s)),
            decode_seqs=sum(1 for s in scheduled if _is_decode(s)),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=self.blocks.num_free_blocks,
            # slots that hold a token vs slots in the blocks the running sequences hold
            tokens_held=sum(self.blocks.num_tokens(q.seq_id) for q in self.scheduler.running),
            slots_held=self.block_size * len({b for q in self.scheduler.running
                                             for b in self.blocks.block_table(q.seq_id)}),
            seconds=now - t0))
        self.num_steps += 1
        return results

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[dict]:
        """Run every prompt to the end; one dict per prompt, in prompt order, with ``token_ids`` and ``text``.

        ``prompts``: one prompt (a str or a list of token ids) or a list of them; ``params``: one
        :class:`SamplingParams` for all, or a list with one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            hint = " (pass prompts.tolist())" if hasattr(prompts, "tolist") else ""
            raise TypeError(f"prompts must be a str, a list of token ids, or a list of those; got "
                            f"{type(prompts).__name__}{hint}")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries but there are {len(prompts)} prompts: "
                                 "give one SamplingParams per prompt, or one for all")
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:  # all or nothing: the prompts queued before the bad one leave with it
                self.abort(rid)
                del self.seqs[rid]
            raise
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="requests", leave=False)
        while self.has_unfinished():
            for _, _, done in self.step():
                if done and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [self.result(i) for i in ids]

    def result(self, request_id: int) -> dict:
        seq = self.seqs[request_id]
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True) if self.tokenizer is not None else None
        return dict(token_ids=list(seq.output), text=text, finish_reason=seq.finish_reason,
                    prompt_tokens=len(seq.prompt), preemptions=seq.num_preemptions, error=seq.error,
                    logprobs=list(seq.logprobs),
                    prompt_logprobs=[seq.prompt_logprobs.get(p) for p in range(len(seq.prompt))])
