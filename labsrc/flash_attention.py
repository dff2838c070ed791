"""The lab's Triton attention kernels as a Hugging Face ``transformers`` attention implementation.

Importing this module registers the name ``"lab_triton"``, so any model whose attention goes through
``transformers.AttentionInterface`` (Llama, Qwen2, Mistral, ...) can run on the lab's kernels::

    import labsrc.flash_attention  # registers "lab_triton"
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="lab_triton")
    # or, on a model already loaded: model.set_attn_implementation("lab_triton")

Why not a name with "flash" in it: transformers 5.x treats any implementation name containing "flash" as a
FlashAttention package to import (``is_flash_attention_requested``) and fails to load it, so the lab's name
avoids that word.

What runs where:

* a prompt or a chunk of several tokens (``Tq > 1``) goes to :func:`labsrc.kernels.flash_attention.flash_attention`,
  causal with the bottom-right alignment that a chunk after a cached prefix needs;
* one new token (``Tq == 1``, every decode step) goes to :func:`labsrc.kernels.flash_attention.decode_attention`
  over the whole cache.

Training: ``flash_attention`` is differentiable (a Triton backward recomputes the probabilities from the saved
log-sum-exp), so fine-tuning a model with ``"lab_triton"`` trains its q/k/v projections as ``"sdpa"`` does.
``decode_attention`` is inference-only: a one-token forward that records a graph goes to ``flash_attention``
instead (one query sees all keys), and a one-token step with a "first n keys" mask that records a graph is
refused by ``decode_attention`` rather than silently cut off from the graph.

What it refuses, loudly: the kernels know three masks only: "causal", "nothing masked" and, for one query,
"the first n keys" (a decode step into a preallocated cache). A padding mask
(a batch of prompts of different lengths), a sliding window, a sink/bias term, soft-capping or dropout cannot be
expressed in them, so instead of silently attending to padding the function raises ``ValueError``. Batch-1
generation (and any batch without padding) never builds such a mask, and works.
"""
from __future__ import annotations

import torch

import labsrc  # noqa: F401  (interpreter switch before triton loads)
from labsrc.kernels.flash_attention import decode_attention, flash_attention

NAME = "lab_triton"

__all__ = ["NAME", "lab_triton_attention_forward", "register"]


def _bottom_right_causal(tq: int, tk: int, device) -> torch.Tensor:
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    return j <= i + (tk - tq)


def _visible(mask: torch.Tensor, tq: int, tk: int) -> torch.Tensor | None:
    """The boolean "may attend" view of a 4-D mask, or ``None`` if it is not a pure visible/blocked mask."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (tq, tk):
        return None
    if mask.dtype == torch.bool:
        return mask  # True = may attend (transformers' convention for sdpa masks)
    if mask.is_floating_point():
        # An additive mask: 0 where visible, a huge negative number where blocked. Anything else is a bias.
        visible = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        return visible if bool((visible | blocked).all()) else None
    return None


def _mask_kind(visible: torch.Tensor, tq: int, tk: int) -> str | None:
    """``"full"`` (nothing masked), ``"causal"`` (bottom-right causal in every batch row and head), or ``None``."""
    if bool(visible.all()):
        return "full"
    if bool((visible == _bottom_right_causal(tq, tk, visible.device)).all()):
        return "causal"
    return None


def _prefix_lengths(visible: torch.Tensor, batch: int) -> torch.Tensor | None:
    """For one query per sequence: if each row sees exactly its first n >= 1 keys, those lengths, else ``None``.

    This is the mask of a decode step into a preallocated (static) cache, whose slots past the current length
    are empty -- exactly what ``decode_attention``'s ``seq_lens`` expresses.
    """
    if visible.shape[1] != 1:  # a per-head mask is not a per-sequence length
        return None
    rows = visible[:, 0, 0, :].expand(batch, -1)  # (B, Tk)
    lengths = rows.sum(-1)
    prefix = torch.arange(rows.shape[-1], device=rows.device)[None, :] < lengths[:, None]
    if bool((lengths < 1).any()) or not bool((rows == prefix).all()):
        return None
    return lengths.to(torch.int32)


def lab_triton_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """Attention for ``transformers`` models on the lab's Triton kernels (the ``"lab_triton"`` implementation).

    Args follow ``transformers``' attention-function contract: ``query (B, Hq, Tq, D)``, ``key``/``value``
    ``(B, Hkv, Tk, D)`` (grouped-query heads are *not* repeated; the kernels index them), the mask built by the
    model (``None`` when no mask is needed), ``dropout``, ``scaling`` (the softmax scale), ``is_causal``.

    Returns:
        ``(attn_output (B, Tq, Hq, D), None)``: no attention weights, the kernels never form them.

    Raises:
        ValueError: for a mask the kernels cannot express (e.g. padding), dropout, a sliding window, soft-capping,
            sinks or a position bias.
    """
    if dropout:
        raise ValueError(f"lab_triton has no dropout; got dropout={dropout} (set the config's "
                         "attention_dropout to 0, or call model.eval())")
    if sliding_window is not None:
        raise ValueError(f"lab_triton does not support sliding-window attention; got sliding_window={sliding_window}")
    if softcap is not None:
        raise ValueError(f"lab_triton does not support logit soft-capping; got softcap={softcap}")
    for extra in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(extra) is not None:
            raise ValueError(f"lab_triton does not support the attention argument {extra!r}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    batch, tq, tk = query.shape[0], query.shape[2], key.shape[2]
    seq_lens = None  # decode only: valid keys per sequence (all of them unless a mask says otherwise)

    if attention_mask is not None:
        visible = _visible(attention_mask, tq, tk)
        kind = None if visible is None else _mask_kind(visible, tq, tk)
        if kind is None and visible is not None and tq == 1:
            lengths = _prefix_lengths(visible, batch)
            if lengths is not None:
                kind, seq_lens = "prefix", lengths
        if kind is None:
            raise ValueError(
                "lab_triton cannot apply this attention mask: its kernels implement only causal (bottom-right) "
                "or unmasked attention (and, for one query, the first n keys), and this mask masks other "
                "positions (padding in a batch of unequal "
                f"prompts, or a custom pattern; mask shape {tuple(attention_mask.shape)}). Run one sequence at "
                "a time or a batch without padding, or use attn_implementation='sdpa'."
            )
        causal = kind == "causal"
    elif causal and 1 < tq < tk:
        # With no mask, transformers only leaves keys beyond the queries in one case: a first prefill into a
        # preallocated (static) cache, whose slots past Tq are still empty. Its causal mask is then aligned
        # top-left (query i sees keys <= i), exactly as transformers' sdpa path treats it: drop the empty slots.
        # (A chunk after a real cached prefix always arrives with an explicit mask, classified above.)
        key, value = key[:, :, :tq], value[:, :, :tq]
        tk = tq

    records_graph = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if tq == 1 and records_graph and seq_lens is None:
        # A one-token forward that is being differentiated: decode_attention has no backward, flash_attention
        # has one, and with one query "causal" means every key.
        out = flash_attention(query, key, value, causal=False, sm_scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if tq == 1:
        # One new token sees every (valid) key, causal or not: flash-decoding over the cache.
        if seq_lens is None:
            seq_lens = torch.full((batch,), tk, dtype=torch.int32, device=query.device)
        out = decode_attention(query[:, :, 0], key, value, seq_lens, sm_scale=scaling)
        return out[:, None], None  # (B, 1, Hq, D)
    out = flash_attention(query, key, value, causal=causal, sm_scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Register the kernels with ``transformers`` under ``name`` (done once on import of this module).

    Two registrations are needed: the attention function itself, and a mask builder. The mask builder is
    transformers' own ``sdpa_mask``, which returns ``None`` whenever plain causal attention suffices (no
    padding) and a boolean mask otherwise -- so padding reaches :func:`lab_triton_attention_forward` and is
    refused there instead of being dropped (with no mask builder registered, transformers would pass no mask
    at all and padding would be silently ignored).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, lab_triton_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


register()
