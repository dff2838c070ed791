"""The architecture frontier, from scratch: differential attention, Mixture-of-Depths routing, cross-layer KV
sharing and INT8 query/key attention, plus the small recall models that compare them.

* :func:`lambda_init`, :func:`reparam_lambda`, :func:`diff_attention` (two calls of chapter 3's
  :func:`labsrc.kernels.flash_attention.flash_attention`), :func:`diff_head_norm` -- the DIFF Transformer's layer
  {cite}`ye2024diff`; the fused kernel and the direct reference are in :mod:`labsrc.kernels.frontier`.
* :func:`mod_route` -- Mixture-of-Depths' top-``capacity`` router {cite}`raposo2024mod`;
  :func:`mod_flops_fraction` -- the block FLOPs it keeps.
* :func:`shared_kv_bytes` -- cross-layer KV (MLKV {cite}`zuhri2024mlkv`), counted with :mod:`labsrc.kv_cache`.
* :func:`int8_qk_attention`, :func:`relative_error` -- attention with Q and K in INT8 after per-channel
  smoothing (SmoothQuant {cite}`xiao2022smoothquant`, SageAttention's mean-subtracted keys
  {cite}`zhang2025sageattention`), against fp32.
* Mixers and blocks registered with chapter 8's harness (:mod:`labsrc.recall`): ``diff`` (differential
  attention), ``xkv`` (adjacent layers share one K/V), and the block kind ``mod`` (a routed softmax block).

* :func:`tiny_moe`, :func:`expert_prefetch` -- speculative expert routing: a small Mixtral-class MoE
  (``transformers``' own classes) and the prediction of each layer's experts from the hidden state before it,
  by that layer's router (:func:`prefetch_hit_rate`), against prefetching the most frequent experts.

``python -m labsrc.frontier`` trains the comparison (standard, DIFF, MoD at capacity 0.5, cross-layer KV; the
same data, steps and width) and writes ``labsrc/data/frontier_mqar.json``; ``--task passkey`` trains the same
four on :class:`labsrc.recall.PassKeyData` and writes ``labsrc/data/frontier_passkey.json``;
``python -m labsrc.frontier --moe``
trains the small MoE and writes ``labsrc/data/frontier_moe.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import numbers
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from labsrc import kv_cache, recall
from labsrc.models import config_head_dim
from labsrc.kernels.flash_attention import flash_attention
from labsrc.kernels.frontier import _check_args as _check_diff_args
from labsrc.kernels.frontier import diff_attention_fused, diff_attention_ref

__all__ = ["lambda_init", "reparam_lambda", "diff_attention", "diff_attention_ref", "diff_attention_fused",
           "diff_head_norm", "mod_route", "mod_capacity_count", "mod_flops_fraction", "shared_kv_bytes",
           "smooth_qk", "int8_qk_attention", "relative_error", "DiffMixer", "SharedKVMixer", "MoDBlock",
           "variant_flops_per_token", "prefetch_hit_rate", "most_frequent_experts", "tiny_moe",
           "routing_and_predictions", "expert_prefetch", "head_importance", "pruned_heads", "least_important", "mixtral_expert_bytes", "GRID", "DEFAULT_OUT", "MOE_OUT", "PASSKEY_OUT",
           "main"]

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "frontier_mqar.json"
MOE_OUT = Path(__file__).resolve().parent / "data" / "frontier_moe.json"
PASSKEY_OUT = Path(__file__).resolve().parent / "data" / "frontier_passkey.json"
PCIE5_X16_BYTES_PER_S = 64e9   # PCIe 5.0 x16, one direction: 32 GT/s x 16 lanes, 128b/130b coding (~63 GB/s)
_FP32 = 4


# ------------------------------------------------------------------------------------ differential attention
def lambda_init(layer: int) -> float:
    """The DIFF Transformer's initial lambda for layer ``layer`` (1-based): ``0.8 - 0.6 exp(-0.3 (l - 1))``."""
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 1:
        raise ValueError(f"layer must be an int >= 1 (layers are counted from 1), got {layer!r}")
    return 0.8 - 0.6 * math.exp(-0.3 * (int(layer) - 1))


def reparam_lambda(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                   lam_init: float) -> torch.Tensor:
    """``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` over the last axis (one lambda per head when
    the vectors are ``(H, D)``). The two exponentials let lambda move either way from ``lambda_init`` while
    every learned vector stays unconstrained."""
    for name, t in (("lq1", lq1), ("lk1", lk1), ("lq2", lq2), ("lk2", lk2)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor")
        if t.shape != lq1.shape:
            raise ValueError(f"{name} must have the shape of lq1 {tuple(lq1.shape)}, got {tuple(t.shape)}")
    return torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + lam_init


def diff_attention(q1, k1, q2, k2, v, lam, sm_scale=None):
    """Causal differential attention on two calls of chapter 3's ``flash_attention``:
    ``softmax(q1 k1^T s) v - lam[h] softmax(q2 k2^T s) v``, layout ``(B, H, T, D)``; ``lam`` a float or
    ``(H,)``. ``flash_attention`` takes values as wide as the queries, so ``v`` must have ``q1``'s head dim
    here (the fused kernel and the reference take any ``Dv``). Differentiable through flash_attention's
    backward."""
    _check_diff_args(q1, k1, q2, k2, v, lam, sm_scale, None, allow_float64=False)
    if v.shape[-1] != q1.shape[-1]:
        raise ValueError(f"v must have q1's head dim {q1.shape[-1]} for flash_attention, got {v.shape[-1]}; "
                         f"use diff_attention_fused or diff_attention_ref for wider values")
    a1 = flash_attention(q1, k1, v, causal=True, sm_scale=sm_scale)
    a2 = flash_attention(q2, k2, v, causal=True, sm_scale=sm_scale)
    H = q1.shape[1]
    lv = lam.to(a1.dtype) if isinstance(lam, torch.Tensor) else torch.full((H,), float(lam), dtype=a1.dtype,
                                                                             device=a1.device)
    return a1 - lv[None, :, None, None] * a2


def diff_head_norm(o: torch.Tensor, lam_init: float, weight: torch.Tensor | None = None,
                   eps: float = 1e-5) -> torch.Tensor:
    """The DIFF layer's per-head normalisation and scale: each head's output ``(B, H, T, Dv)`` is
    RMS-normalised on its own (the paper's "GroupNorm", one group per head, written as an RMSNorm in its code),
    times an optional ``(Dv,)`` weight, times ``(1 - lambda_init)`` so that the layer starts at the scale of
    ordinary attention."""
    if not isinstance(o, torch.Tensor) or o.dim() != 4:
        raise ValueError("o must be a (B, H, T, Dv) tensor")
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y * (1 - lam_init)


# --------------------------------------------------------------------------------------- Mixture-of-Depths
def mod_capacity_count(T: int, capacity: float) -> int:
    """Tokens a routed block processes out of ``T``: ``round(capacity * T)`` (halves round up), at least 1."""
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Real) or not 0 < capacity <= 1:
        raise ValueError(f"capacity must be a number in (0, 1], got {capacity!r}")
    return max(1, int(math.floor(capacity * T + 0.5)))


def mod_route(scores: torch.Tensor, capacity: float) -> torch.Tensor:
    """Mixture-of-Depths' router: the positions of the top ``round(capacity * T)`` scores of each row of
    ``scores (B, T)`` (at least one), in increasing position order (the order the block processes them in).
    Ties go to the earlier position. This is top-k over the whole sequence, so whether token ``t`` is routed
    depends on later tokens' scores: fine for training, not causal for decoding (see :class:`MoDBlock`)."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError("scores must be a floating-point (B, T) tensor")
    k = mod_capacity_count(scores.shape[1], capacity)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices   # stable: earlier wins ties
    return order[:, :k].sort(dim=1).values


def mod_flops_fraction(capacity: float, T: int) -> float:
    """Fraction of a routed block's FLOPs kept at ``capacity``: the matmuls scale with the routed tokens
    ``k``, causal attention with the pairs among them, ``k (k + 1) / 2`` against ``T (T + 1) / 2``; this
    returns the matmul share (the attention share is ``(k / T)^2`` and smaller)."""
    return mod_capacity_count(T, capacity) / T


# --------------------------------------------------------------------------------------- cross-layer KV
def shared_kv_bytes(n_layers: int, layers_per_kv: int, n_kv_heads: int, head_dim: int, seq_len: int,
                    batch: int = 1, dtype_bytes: float = 2):
    """KV-cache bytes when groups of ``layers_per_kv`` adjacent layers share one K/V: chapter 1's
    :func:`labsrc.kv_cache.mlkv_cache_bytes`, and the fraction of the ordinary cache it keeps."""
    shared = kv_cache.mlkv_cache_bytes(n_layers, layers_per_kv, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)
    full = kv_cache.kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)
    return shared, shared / full


# ------------------------------------------------------------------------------------ INT8 Q/K attention
def smooth_qk(q: torch.Tensor, k: torch.Tensor, alpha: float = 0.5):
    """Per-channel smoothing before quantising (``q``, ``k``: ``(..., T, D)``). Keys lose their mean over
    tokens (SageAttention: ``q . mean(k)`` is the same for every key of a row, so the softmax does not
    change); then channel ``c`` of the keys is divided by ``s_c = max|k_c|^alpha / max|q_c|^(1 - alpha)``
    and the queries multiplied by it (SmoothQuant's migration: ``q k^T`` is unchanged in exact arithmetic,
    and an outlier channel no longer sets the whole row's INT8 step)."""
    k = k - k.mean(-2, keepdim=True)
    qa = q.abs().amax(-2, keepdim=True).clamp_min(1e-6)
    ka = k.abs().amax(-2, keepdim=True).clamp_min(1e-6)
    s = ka.pow(alpha) / qa.pow(1 - alpha)
    return q * s, k / s


def _int8_rows(x):
    """Symmetric absmax INT8 per row (per token) of ``x (..., T, D)``: codes and scales (fp32)."""
    m = x.abs().amax(-1, keepdim=True)
    scale = torch.where(m > 0, m / 127, torch.ones_like(m))
    return torch.round(x / scale).clamp(-127, 127), scale


def int8_qk_attention(q, k, v, causal: bool = True, smooth: bool = True, sm_scale=None):
    """Attention whose scores come from INT8 queries and keys: ``q``, ``k`` (optionally smoothed, see
    :func:`smooth_qk`) are quantised per token to INT8, ``q k^T`` is the integer dot product times the two
    scales, and the softmax and ``p v`` stay fp32. Layout ``(..., T, D)`` (``(B, H, T, D)`` or
    ``(H, T, D)``); grouped K/V heads must be expanded by the caller. Returns fp32."""
    q, k, v = q.float(), k.float(), v.float()
    scale = 1 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if smooth:
        q, k = smooth_qk(q, k)
    qc, qs = _int8_rows(q)
    kc, ks = _int8_rows(k)
    s = (qc @ kc.transpose(-1, -2)) * qs * ks.transpose(-1, -2) * scale   # integer products are exact in fp32
    if causal:
        T, Tk = s.shape[-2], s.shape[-1]
        mask = torch.ones(T, Tk, dtype=torch.bool, device=s.device).triu(Tk - T + 1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius), the output error the chapter reports."""
    return float((approx.double() - exact.double()).norm() / exact.double().norm())


# ---------------------------------------------------------------------------- variants for chapter 8's harness
@recall.register_mixer("diff")
class DiffMixer(nn.Module):
    """Differential attention as a recall mixer, with the paper's shapes: ``d_model // (2 head_dim)`` heads,
    each with two ``head_dim`` query/key halves and ``2 head_dim``-wide values, so its projections have the
    parameters of the ``softmax`` mixer; re-parameterised lambda, per-head RMSNorm and the
    ``(1 - lambda_init)`` scale. ``lambda_init`` depends on the layer, which :meth:`bind` tells it.
    Trains through PyTorch's attention (fast on a CPU); the fused kernel is the inference path."""

    def __init__(self, d_model, head_dim, state_size=None):
        super().__init__()
        if d_model % (2 * head_dim):
            raise ValueError(f"d_model={d_model} must be a multiple of 2 * head_dim={2 * head_dim}")
        self.h, self.p = d_model // (2 * head_dim), head_dim
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.lam = nn.Parameter(torch.randn(4, self.h, head_dim) * 0.1)   # lq1, lk1, lq2, lk2
        self.norm_weight = nn.Parameter(torch.ones(2 * head_dim))
        self.lam_init = lambda_init(1)

    def bind(self, shared: dict, index: int) -> None:
        self.lam_init = lambda_init(index + 1)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q = q.view(B, T, self.h, 2, self.p).permute(3, 0, 2, 1, 4)          # (2, B, h, T, p)
        k = k.view(B, T, self.h, 2, self.p).permute(3, 0, 2, 1, 4)
        v = v.view(B, T, self.h, 2 * self.p).transpose(1, 2)                # (B, h, T, 2p)
        lam = reparam_lambda(*self.lam, self.lam_init)                       # (h,)
        a1 = F.scaled_dot_product_attention(q[0], k[0], v, is_causal=True)
        a2 = F.scaled_dot_product_attention(q[1], k[1], v, is_causal=True)
        o = diff_head_norm(a1 - lam[None, :, None, None] * a2, self.lam_init, self.norm_weight)
        return self.out(o.transpose(1, 2).reshape(B, T, d))

    def memory_bytes(self, T: int) -> int:
        return 2 * self.h * 2 * self.p * T * _FP32        # keys (two halves) and values: 2 * d_model per token


@recall.register_mixer("xkv")
class SharedKVMixer(nn.Module):
    """Causal softmax attention where adjacent layers share one K/V (MLKV with groups of two): an even layer
    (0, 2, ...) projects its own keys and values and leaves them for the next layer, which projects only its
    queries. The cache holds one layer's K/V per pair."""

    def __init__(self, d_model, head_dim, state_size=None):
        super().__init__()
        if d_model % head_dim:
            raise ValueError(f"d_model={d_model} must be a multiple of head_dim={head_dim}")
        self.h, self.p = d_model // head_dim, head_dim
        self.d = d_model
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.shared: dict = {}
        self.owner = True

    def bind(self, shared: dict, index: int) -> None:
        self.shared, self.owner = shared, index % 2 == 0
        if not self.owner:
            self.kv = None                                  # a reader has no K/V projection at all

    def forward(self, x):
        B, T, d = x.shape
        q = self.q(x).view(B, T, self.h, self.p).transpose(1, 2)
        if self.owner:
            k, v = (t.view(B, T, self.h, self.p).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
            self.shared["kv"] = (k, v)
        else:
            if "kv" not in self.shared:
                raise RuntimeError("a reader xkv layer needs an xkv layer before it (the K/V owner)")
            k, v = self.shared["kv"]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, T, d))

    def memory_bytes(self, T: int) -> int:
        return 2 * self.h * self.p * T * _FP32 if self.owner else 0


@recall.register_block("mod")
class MoDBlock(recall._Block):
    """A Mixture-of-Depths block around the ``softmax`` block: a linear router scores every token; the top
    ``capacity * T`` (:func:`mod_route`) run the block (their own causal attention among themselves, the
    MLP) and add ``sigmoid(score) * (block(x) - x)`` (the sigmoid keeps the router on the gradient path and
    starts the scale at 1/2); the others pass through on the residual unchanged.

    Top-k over the sequence is not causal. As in the paper, a small predictor (an MLP on the detached input)
    learns, with a binary cross-entropy auxiliary loss, whether a token is in the top-k. ``causal_route``
    (set on the model by :func:`set_mod_routing`) decides evaluation: ``False`` routes by top-k (looks
    ahead), ``True`` routes each token by the predictor alone (``logit > 0``), as decoding must."""

    capacity = 0.5

    def __init__(self, name, d_model, head_dim, state_size):
        super().__init__("softmax", d_model, head_dim, state_size)
        self.router = nn.Linear(d_model, 1)
        self.predictor = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Linear(d_model, 1))
        self.causal_route = False
        self.aux_loss = torch.zeros(())
        self.routed_fraction = 1.0

    def _apply_rows(self, x, idx, scores):
        xs = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
        delta = super().forward(xs) - xs
        w = torch.sigmoid(scores.gather(1, idx))[..., None]
        return x.scatter_add(1, idx[..., None].expand(-1, -1, x.shape[-1]), w * delta)

    def forward(self, x):
        scores = self.router(x).squeeze(-1)                                  # (B, T)
        pred = self.predictor(x.detach()).squeeze(-1)
        if not self.causal_route or self.training:
            idx = mod_route(scores, self.capacity)
            target = torch.zeros_like(scores).scatter(1, idx, 1.0)
            self.aux_loss = F.binary_cross_entropy_with_logits(pred, target)
            self.routed_fraction = idx.shape[1] / x.shape[1]
            return self._apply_rows(x, idx, scores)
        rows, routed = [], 0
        for b in range(x.shape[0]):                                          # a variable count per row
            idx = torch.nonzero(pred[b] > 0).flatten()[None]
            routed += idx.shape[1]
            rows.append(self._apply_rows(x[b:b + 1], idx, scores[b:b + 1]) if idx.shape[1] else x[b:b + 1])
        self.routed_fraction = routed / x.numel() * x.shape[-1]
        return torch.cat(rows)

    def memory_bytes(self, T: int) -> int:
        return int(2 * self.mixer.h * self.mixer.p * mod_capacity_count(T, self.capacity) * _FP32)


def set_mod_routing(model: recall.RecallModel, causal: bool) -> None:
    """Evaluate the MoD blocks of ``model`` with top-k routing (``causal=False``) or the causal predictor."""
    for block in model.blocks:
        if isinstance(block, MoDBlock):
            block.causal_route = causal


def variant_flops_per_token(variant: str, d_model: int, T: int, n_layers: int = 2,
                            capacity: float = 0.5) -> float:
    """Matmul and attention FLOPs per token of one forward over ``T`` tokens (:func:`labsrc.kv_cache.forward_flops`
    per layer, averaged over the tokens; the head, embedding, norms and the convolution are left out):
    attention projections ``4 d^2`` (``softmax``, ``diff``), ``3 d^2`` for an ``xkv`` reader, the MLP
    ``4 d^2``; DIFF computes two score maps of half the width each (the same ``q.k`` work) and ``p.v`` twice
    over the full width; a MoD block does its matmuls for ``round(capacity T)`` tokens and attention among them.
    """
    total = 0
    for layer in range(n_layers):
        proj = 4 * d_model * d_model
        if variant == "xkv" and layer % 2 == 1:
            proj = 2 * d_model * d_model
        params = proj + 4 * d_model * d_model
        if variant == "mod":
            k = mod_capacity_count(T, capacity)
            total += kv_cache.forward_flops(params, 1, d_model, k, k)
        elif variant == "diff":
            # q.k: two maps of width d/2 each = one of width d; p.v: two maps over the full width d
            total += kv_cache.forward_flops(params, 1, d_model, T, T)
            total += 2 * d_model * (T * (T + 1) // 2)
        else:
            total += kv_cache.forward_flops(params, 1, d_model, T, T)
    return total / T


# what labsrc.recall.code_version fingerprints beside each kind's own class
# (objects, not import paths: under ``python -m labsrc.frontier`` this module is ``__main__``)
DiffMixer.code_deps = (lambda_init, reparam_lambda, diff_head_norm)
MoDBlock.code_deps = (recall.SoftmaxMixer, mod_route, mod_capacity_count, set_mod_routing)


# ------------------------------------------------------------------------------- speculative expert routing
def prefetch_hit_rate(predicted: torch.Tensor, actual: torch.Tensor) -> tuple[int, int]:
    """``(hits, slots)``: how many of the experts each token actually uses (``actual (N, k)``) are among the
    ``predicted (N, m)`` ones prefetched for it; ``slots = N * k``. Duplicate ids count once."""
    if predicted.dim() != 2 or actual.dim() != 2 or predicted.shape[0] != actual.shape[0]:
        raise ValueError("predicted and actual must be (N, m) and (N, k) expert ids for the same N tokens")
    hits = (actual[:, :, None] == predicted[:, None, :]).any(-1)
    return int(hits.sum()), actual.numel()


def most_frequent_experts(actual: torch.Tensor, n_experts: int, m: int) -> torch.Tensor:
    """The ``m`` experts chosen most often in ``actual (N, k)`` (ties to the lower id): the baseline that
    prefetches the same experts for every token."""
    counts = torch.bincount(actual.flatten(), minlength=n_experts)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:m]


def tiny_moe(vocab: int, hidden: int = 64, layers: int = 4, experts: int = 8, top_k: int = 2, seed: int = 0):
    """A small ``MixtralForCausalLM`` (transformers' class, random init): ``experts`` SwiGLU experts per layer,
    top-``top_k`` routing, router logits returned, the load-balancing auxiliary loss on."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=1024,
                        output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=True)
    return MixtralForCausalLM(cfg)


@torch.no_grad()
def routing_and_predictions(model, ids: torch.Tensor):
    """For every layer ``l >= 1``: the experts it uses per token (top-k of its router) and the experts its
    router picks from the hidden state *before* layer ``l`` (the output of layer ``l - 1``, through layer
    ``l``'s post-attention norm): ``[(actual (N, k), predicted (N, k)), ...]``, one pair per layer from 1.
    The prediction is available as soon as layer ``l - 1`` finishes, so the weights can be fetched while
    layer ``l``'s attention runs."""
    out = model(ids, output_hidden_states=True)
    k = model.config.num_experts_per_tok
    pairs = []
    for layer in range(1, model.config.num_hidden_layers):
        block = model.model.layers[layer]
        actual = out.router_logits[layer].topk(k, -1).indices
        h = block.post_attention_layernorm(out.hidden_states[layer]).reshape(-1, model.config.hidden_size)
        predicted = F.linear(h, block.mlp.gate.weight).topk(k, -1).indices
        pairs.append((actual, predicted))
    return pairs


def expert_prefetch(steps: int = 300, batch: int = 8, seq_len: int = 128, eval_windows: int = 16,
                    seed: int = 0, log: list | None = None, progress: bool = False) -> dict:
    """Train :func:`tiny_moe` briefly on the lab corpus, then measure on validation windows how often the
    next layer's router, applied to the current hidden state, names the experts the layer will use, against
    prefetching the layer's most frequent experts (counted on training windows). JSON-able. ``progress`` shows a
    bar over the training steps (the command line; the chapter's page stays quiet)."""
    from tqdm.auto import tqdm

    from labsrc.claims import wilson
    from labsrc.models import load
    from labsrc import weight_quant as wq

    _, tok = load("lab-target")
    model = tiny_moe(len(tok), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    train_ids = wq.calibration_ids(tok, steps * batch, seq_len, split="train", seed=seed)
    t0 = time.perf_counter()
    model.train()
    for step in tqdm(range(steps), desc="MoE training", unit="step", disable=not progress):
        ids = train_ids[step * batch:(step + 1) * batch]
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log.append({"step": step, "loss": round(loss.item(), 3), "seconds": round(time.perf_counter() - t0, 1)})
    model.eval()
    E, k = model.config.num_local_experts, model.config.num_experts_per_tok
    freq_pairs = routing_and_predictions(model, train_ids[:eval_windows])
    eval_ids = wq.calibration_ids(tok, eval_windows, seq_len, split="validation", seed=seed + 1)
    layers = []
    for layer, ((actual, predicted), (train_actual, _)) in enumerate(zip(routing_and_predictions(model, eval_ids),
                                                                          freq_pairs), start=1):
        hits, slots = prefetch_hit_rate(predicted, actual)
        base = most_frequent_experts(train_actual, E, k)
        bhits, _ = prefetch_hit_rate(base.expand(actual.shape[0], -1), actual)
        layers.append({"layer": layer, "hits": hits, "slots": slots, "hit_rate": hits / slots,
                       "wilson95": list(wilson(hits, slots)), "baseline_hits": bhits,
                       "baseline_hit_rate": bhits / slots, "baseline_wilson95": list(wilson(bhits, slots)),
                       "chance": k / E})
    return {"model": {"hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                      "experts": E, "top_k": k, "params": sum(p.numel() for p in model.parameters())},
            "train": {"steps": steps, "batch": batch, "seq_len": seq_len, "seed": seed, "log": log or []},
            "eval": {"windows": eval_windows, "tokens": eval_windows * seq_len}, "layers": layers}


def mixtral_expert_bytes(hidden: int = 4096, intermediate: int = 14336, dtype_bytes: int = 2) -> int:
    """Bytes of one SwiGLU expert (three ``hidden x intermediate`` matrices), Mixtral 8x7B's by default."""
    return 3 * hidden * intermediate * dtype_bytes


# ------------------------------------------------------------------------------------------- head pruning
def _head_slices(model):
    cfg = model.config
    return cfg.num_attention_heads, config_head_dim(cfg)


@torch.no_grad()
def head_importance(model, windows: torch.Tensor) -> torch.Tensor:
    """``(layers, heads)``: the mean L2 norm of each query head's attention output (the input of ``o_proj``,
    one ``head_dim`` slice per head) over the tokens of ``windows``, a cheap importance score (Michel et al.
    use the gradient of the loss with respect to a head mask instead)."""
    H, hd = _head_slices(model)
    scores = []
    handles = []
    for layer in model.model.layers:
        def grab(mod, inp, store=scores):
            x = inp[0].reshape(-1, H, hd)
            store.append(x.norm(dim=-1).mean(0))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(grab))
    try:
        model(input_ids=windows)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(scores)


class pruned_heads:
    """Context manager: the query heads in ``mask (layers, heads)`` (True = pruned) contribute nothing (their
    slice of ``o_proj``'s input is zeroed), with no compensation or fine-tuning."""

    def __init__(self, model, mask: torch.Tensor):
        self.model, self.mask, self.handles = model, mask.bool(), []

    def __enter__(self):
        H, hd = _head_slices(self.model)
        for layer, keep_mask in zip(self.model.model.layers, ~self.mask):
            keep = keep_mask.repeat_interleave(hd).float()

            def zero(mod, inp, keep=keep):
                return (inp[0] * keep.to(inp[0].dtype),)
            self.handles.append(layer.self_attn.o_proj.register_forward_pre_hook(zero))
        return self.model

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def least_important(importance: torch.Tensor, fraction: float) -> torch.Tensor:
    """A mask of the ``round(fraction * heads)`` least important heads *of each layer* (ties to the lower
    index), so every layer keeps some attention."""
    L, H = importance.shape
    n = int(math.floor(fraction * H + 0.5))
    mask = torch.zeros(L, H, dtype=torch.bool)
    if n:
        order = torch.sort(importance, dim=1, stable=True).indices[:, :n]
        mask.scatter_(1, order, True)
    return mask


# --------------------------------------------------------------------------------------- the comparison
GRID = {"standard": ("softmax", "softmax"), "diff": ("diff", "diff"), "mod": ("mod", "mod"),
        "xkv": ("xkv", "xkv")}


def _extra(name: str):
    """Chapter 15's fields for a variant's rows (:func:`labsrc.recall.sweep`): FLOPs per token, and for MoD a
    second score with the causal predictor routing (what decoding could do) and the routed fractions."""
    def fields(model, data):
        from labsrc.claims import wilson

        row = {"flops_per_token": variant_flops_per_token(name, model.embed.embedding_dim, data.context_len)}
        if name == "mod":
            row["routed_fraction"] = [b.routed_fraction for b in model.blocks]
            set_mod_routing(model, True)
            right, total = recall.evaluate(model, data)
            set_mod_routing(model, False)
            row.update({"causal_right": right, "causal_total": total, "causal_accuracy": right / total,
                        "causal_wilson95": list(wilson(right, total)),
                        "causal_routed_fraction": [b.routed_fraction for b in model.blocks]})
        return row
    return fields


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["mqar", "passkey"], default="mqar")
    p.add_argument("--out", type=Path, default=None, help="default: frontier_mqar.json / frontier_passkey.json")
    p.add_argument("--models", nargs="+", default=list(GRID), choices=list(GRID))
    recall.add_task_args(p, widths=(32, 64))   # DIFF needs a width that is a multiple of 32
    p.add_argument("--moe", action="store_true", help="train the small MoE and measure expert prefetch instead")
    p.add_argument("--moe-steps", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.moe:
        log: list = []
        result = expert_prefetch(steps=args.moe_steps, log=log, progress=True)
        result["train"]["torch"] = torch.__version__
        MOE_OUT.write_text(json.dumps(result, indent=1))
        for row in result["layers"]:
            print(f"layer {row['layer']}: hit rate {row['hit_rate']:.3f} {row['wilson95']}, most frequent "
                  f"{row['baseline_hit_rate']:.3f}, chance {row['chance']:.3f}", flush=True)
        return 0
    # the same data, model, training loop and scoring as chapter 8's grid (labsrc.recall.sweep)
    data, task = recall.make_data(args.task, args)
    grid = {name: GRID[name] for name in args.models}
    command = recall.command_line("labsrc.frontier", p, args, omit_defaults=("out", "moe_steps"))
    header = recall.stored_header(command, [m for ms in grid.values() for m in ms], args.task, task, args)
    out = args.out or (PASSKEY_OUT if args.task == "passkey" else DEFAULT_OUT)
    with recall.progress_echo(len(args.widths) * len(args.seeds) * len(grid)) as echo:
        recall.sweep(grid, data, args.widths, args.seeds, args.steps, args.batch, args.max_seconds, extra=_extra,
                     header=header, out=out, echo=echo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
