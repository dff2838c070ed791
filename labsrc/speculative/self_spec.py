"""Self-speculation: the target's own first layers (with an early-exit head) draft for the whole model.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from labsrc.speculative.common import _forward, _new_cache, _rollback, cache_nbytes
from labsrc.speculative.generate import SpecStats, _check_generate_args, _speculate


@torch.no_grad()
def run_layers(model, hidden: torch.Tensor, cache, start: int, stop: int) -> torch.Tensor:
    """Run decoder layers ``start..stop-1`` of a Llama-style ``model`` on ``hidden (1, n, d)``, the positions
    right after what layer ``start`` has cached; each layer appends its keys and values to ``cache``.

    The causal mask and the rotary positions are sized against layer ``start``'s cache length, so the layers
    of one cache may hold different lengths (self-speculation's lower layers run ahead of the upper ones)."""
    from transformers.masking_utils import create_causal_mask

    body = model.model
    past = cache.get_seq_length(start)
    positions = torch.arange(past, past + hidden.shape[1], device=hidden.device)[None]
    mask = create_causal_mask(config=body.config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                              position_ids=positions, layer_idx=start)
    rotary = body.rotary_emb(hidden, position_ids=positions)
    for layer in body.layers[start:stop]:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                       cache=cache, use_cache=True)
    return hidden


class _SharedBody:
    """Self-speculation with one KV cache: the draft is the target's first ``layer`` layers plus an exit head.

    Drafting runs only the lower layers; they append to the target's own cache, so the lower layers run ahead
    of the upper ones by the drafted positions, and their outputs (the hidden states at layer ``layer``) are
    kept. Verification runs the lower layers only on the last drafted token (the one the draft sampled but did
    not feed) and the upper layers on every pending position, starting from the kept hidden states: the lower
    half's keys, values and activations are computed once per position, never twice.
    """

    def __init__(self, target, layer, head):
        exit_model = early_exit_draft(target, layer, head)
        self.target, self.layer = target, exit_model.config.num_hidden_layers
        self.n_layers = target.config.num_hidden_layers
        self.exit_norm, self.exit_head = exit_model.model.norm, exit_model.lm_head
        self.cache = _new_cache(target)
        # layer-``layer`` outputs of the positions the lower half ran ahead on (target_length..draft_length-1)
        self.hidden: torch.Tensor | None = None

    def prefill(self, ids):
        _forward(self.target, ids, self.cache)

    def draft_length(self) -> int:
        return self.cache.get_seq_length(0)

    def target_length(self) -> int:
        return self.cache.get_seq_length(self.n_layers - 1)

    @torch.no_grad()
    def _lower(self, ids) -> torch.Tensor:
        return run_layers(self.target, self.target.model.embed_tokens(ids), self.cache, 0, self.layer)

    @torch.no_grad()
    def draft_next(self, ids) -> torch.Tensor:
        h = self._lower(ids)
        self.hidden = h if self.hidden is None else torch.cat([self.hidden, h], dim=1)
        return self.exit_head(self.exit_norm(h[:, -1])).float()[0]

    @torch.no_grad()
    def score(self, feed) -> torch.Tensor:
        # feed = the positions the upper layers have not seen: the newest token and the
        # drafts
        # of those, the lower half ran
        done = 0 if self.hidden is None else self.hidden.shape[1]
        assert (
            self.target_length() + done == self.draft_length()
        ), "lower layers out of step"
        parts = [] if self.hidden is None else [self.hidden]
        if feed.shape[1] > done:
            # the last drafted token was sampled, never fed: run it
            parts.append(self._lower(feed[:, done:]))
        self.hidden = None
        h = torch.cat(parts, dim=1)   # layer-`layer` states of every pending position
        h = run_layers(self.target, h, self.cache, self.layer, self.n_layers)
        return self.target.lm_head(self.target.model.norm(h))[0].float()

    def rollback(self, length: int) -> None:
        self.hidden = None            # every layer has scored the same positions again: nothing is ahead
        _rollback(self.cache, length)

    def cache_bytes(self) -> tuple[int, int]:
        return cache_nbytes(self.cache), 0   # the draft has no cache of its own


def self_speculative_generate(target, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                              layer: int | None = None, head: dict | str | None = "shipped",
                              do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                              generator: torch.Generator | None = None, window: str = "fixed",
                              stats: SpecStats | None = None, stop_at_eos: bool = True
                              ) -> tuple[torch.Tensor, SpecStats]:
    """Self-speculation with one shared KV cache (CLaSp / LayerSkip): ``target``'s first ``layer`` layers and
    an early-exit head (:func:`early_exit_draft`'s ``layer`` and ``head``) draft, the full ``target`` verifies.

    Unlike ``speculative_generate(target, early_exit_draft(target), ...)``, which keeps a second cache for the
    draft and recomputes the lower layers in every verification, the draft writes its keys and values into
    the target's cache and verification starts at layer ``layer`` from the hidden states the draft already
    computed. Same arguments, output and statistics as :func:`speculative_generate`.
    """
    input_ids = _check_generate_args(input_ids, max_new_tokens, k, window, do_sample, temperature, top_p)
    return _speculate(_SharedBody(target, layer, head), target, input_ids, max_new_tokens, k, do_sample,
                      temperature, top_p, generator, window, stats, stop_at_eos)


@contextmanager
def count_layer_tokens(model):
    """Count the token positions each decoder layer of ``model`` processes inside the ``with`` block.

    Yields a list, one count per layer, filled in as the layers run (forward pre-hooks, removed on exit).
    A draft that shares the target's layers (:func:`early_exit_draft`) is counted too: this is how the
    chapter measures the lower-layer work that self-speculation with a shared cache saves.
    """
    counts = [0] * len(model.model.layers)
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            counts[i] += hidden.shape[0] * hidden.shape[1]
        hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


# ----------------------------------------------------------------------------------------------- self-speculation
EARLY_EXIT_DIR = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "early_exit"


def early_exit_draft(target, layer: int | None = None, head: dict | str | None = "shipped"):
    """A draft made of ``target``'s own first ``layer`` layers plus an early-exit head (CLaSp / LayerSkip style).

    Returns a ``LlamaForCausalLM`` whose embedding and decoder layers *are* the target's modules (shared, not
    copied: no extra weights, and its keys and values at those layers equal the target's), followed by its
    own final norm and ``lm_head``. ``head``: ``"shipped"`` loads the head trained by
    :func:`train_early_exit_head` (``labsrc/models/early_exit/<name>-L<layer>.safetensors``), a path loads that
    file, a dict is a state dict, ``None`` keeps the target's final norm and ``lm_head`` (untrained exit).
    ``layer`` defaults to half the target's layers.
    """
    import copy

    from transformers import LlamaForCausalLM

    n_layers = target.config.num_hidden_layers
    layer = n_layers // 2 if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer < n_layers:
        raise ValueError(f"layer must be an int in [1, {n_layers - 1}], got {layer!r}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layer
    cfg.tie_word_embeddings = False
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layer]
    with torch.device("meta"):
        draft = LlamaForCausalLM(cfg)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:layer])
    draft.model.rotary_emb = target.model.rotary_emb
    draft.model.norm = copy.deepcopy(target.model.norm)
    draft.lm_head = copy.deepcopy(target.lm_head)
    draft.generation_config = copy.deepcopy(target.generation_config)
    if head is not None:
        if isinstance(head, str):
            from safetensors.torch import load_file
            path = (EARLY_EXIT_DIR / f"{_model_name(target)}-L{layer}.safetensors") if head == "shipped" else head
            head = load_file(str(path))
        draft.model.norm.weight.data.copy_(head["norm.weight"].float())
        draft.lm_head.weight.data.copy_(head["lm_head.weight"].float())
    return draft.eval()


def _model_name(model) -> str:
    from pathlib import Path
    return Path(str(getattr(model.config, "_name_or_path", "model"))).name or "model"


def train_early_exit_head(target, tokenizer, layer: int | None = None, steps: int = 300, seq_len: int = 256,
                          batch_size: int = 4, lr: float = 2e-3, seed: int = 0, out: str | None = None,
                          log=None) -> dict:
    """Train the early-exit head (final norm + ``lm_head`` on layer ``layer``'s hidden state) by
    ``KL(p_target || p_exit)`` with the whole body frozen, on the lab's training mixture (prose and the
    retrieval tasks, :func:`labsrc.models.train.make_batch`). Writes the head as fp16 safetensors to ``out``
    and returns ``{"losses": [...], "seconds": s, "path": out}``."""
    import random

    from safetensors.torch import save_file

    from labsrc.models.train import TrainConfig, make_batch

    torch.manual_seed(seed)
    draft = early_exit_draft(target, layer, head=None)
    for prm in target.parameters():
        prm.requires_grad_(False)
    params = [draft.model.norm.weight, draft.lm_head.weight]
    for prm in params:
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch_size, short_steps=0, grow_steps=0)
    rng = random.Random(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        ids, _ = make_batch(cfg, tokenizer, rng)
        with torch.no_grad():   # one frozen forward gives both the teacher and the exit layer's hidden state
            res = target(input_ids=ids, output_hidden_states=True)
            logp_t = torch.log_softmax(res.logits.float(), -1)
            hidden = res.hidden_states[draft.config.num_hidden_layers]
        logq = torch.log_softmax(draft.lm_head(draft.model.norm(hidden)).float(), -1)
        loss = (logp_t.exp() * (logp_t - logq)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log is not None and (step % 25 == 0 or step == steps - 1):
            print(f"step {step:4d} KL {loss.item():.4f} {time.perf_counter() - t0:.0f}s", file=log, flush=True)
    for prm in params:
        prm.requires_grad_(False)
    head = {"norm.weight": draft.model.norm.weight.detach().half().contiguous(),
            "lm_head.weight": draft.lm_head.weight.detach().half().contiguous()}
    if out is not None:
        save_file(head, str(out))
    return {"losses": losses, "seconds": time.perf_counter() - t0, "path": out}
