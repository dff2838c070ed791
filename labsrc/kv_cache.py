"""Arithmetic of the KV cache: how many bytes it holds, and what that costs at decode time.

Every figure in the KV-cache chapter comes from these functions, so that the book never types a number it
did not compute. The cache of a decoder-only transformer keeps, for every layer and every token already
seen, the keys and values the attention of later tokens will read. Its size is

    2 (K and V) x layers x KV heads x head_dim x tokens x batch x bytes per element

and the variants only change one factor:

* MHA keeps one K/V head per query head, MQA one K/V head in all, GQA one per group of query heads;
* MLA (DeepSeek-V2/V3) keeps one compressed latent of ``kv_lora_rank`` numbers per token and layer, shared
  by K and V, plus a small decoupled RoPE key of ``qk_rope_head_dim`` numbers shared by all heads;
* MLKV shares one K/V cache between groups of adjacent layers;
* quantised caches store ``bits``-bit integers plus a scale (and zero point) per group of elements.

Sizes must be positive integers; a bad argument raises :class:`ValueError` naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

GiB = 1024 ** 3
GB = 10 ** 9

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
"""Bytes per element of the cache dtypes the chapter talks about (int4 without its scales)."""


# ----------------------------------------------------------------------------------------------------------
# validation
def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _positive_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def _nonnegative_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return value


def _nonnegative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _exact(value: float) -> int | float:
    """Bytes as an int when the count is whole (it always is for whole-byte dtypes), else a float."""
    return int(value) if float(value).is_integer() else value


# ----------------------------------------------------------------------------------------------------------
# MHA / MQA / GQA
def kv_heads(n_heads: int, grouping: str = "gqa", n_kv_heads: int | None = None) -> int:
    """Number of K/V heads the cache holds per layer.

    ``grouping`` is ``"mha"`` (one K/V head per query head), ``"mqa"`` (a single K/V head) or ``"gqa"``
    (``n_kv_heads`` K/V heads, each shared by ``n_heads // n_kv_heads`` query heads; ``n_kv_heads`` must
    divide ``n_heads``).
    """
    n_heads = _positive_int("n_heads", n_heads)
    if grouping == "mha":
        return n_heads
    if grouping == "mqa":
        return 1
    if grouping == "gqa":
        if n_kv_heads is None:
            raise ValueError("n_kv_heads is required for grouping='gqa'")
        n_kv_heads = _positive_int("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        return n_kv_heads
    raise ValueError(f"grouping must be 'mha', 'mqa' or 'gqa', got {grouping!r}")


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float = 2) -> int | float:
    """Bytes one token adds to the cache of one sequence: ``2 * n_layers * n_kv_heads * head_dim * dtype_bytes``."""
    return kv_cache_bytes(n_layers, n_kv_heads, head_dim, 1, 1, dtype_bytes)


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1,
                   dtype_bytes: float = 2) -> int | float:
    """Bytes of a standard (MHA/MQA/GQA) KV cache.

    ``2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes`` -- the 2 counts K and V.
    Pass ``n_kv_heads = n_heads`` for MHA, 1 for MQA, the number of groups for GQA (see :func:`kv_heads`).

    >>> kv_cache_bytes(80, 64, 128, 128 * 1024) / GiB     # the source's 70B example, MHA, FP16
    320.0
    """
    n_layers = _positive_int("n_layers", n_layers)
    n_kv_heads = _positive_int("n_kv_heads", n_kv_heads)
    head_dim = _positive_int("head_dim", head_dim)
    seq_len = _positive_int("seq_len", seq_len)
    batch = _positive_int("batch", batch)
    dtype_bytes = _positive_number("dtype_bytes", dtype_bytes)
    return _exact(2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes)


def gqa_cache_bytes(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1,
                    dtype_bytes: float = 2) -> int | float:
    """:func:`kv_cache_bytes` for a GQA model described by its query heads and K/V heads (which must divide)."""
    return kv_cache_bytes(n_layers, kv_heads(n_heads, "gqa", n_kv_heads), head_dim, seq_len, batch, dtype_bytes)


# ----------------------------------------------------------------------------------------------------------
# MLA and MLKV
def mla_cache_bytes(n_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, seq_len: int, batch: int = 1,
                    dtype_bytes: float = 2) -> int | float:
    """Bytes of a Multi-head Latent Attention cache (DeepSeek-V2/V3).

    Per layer and token MLA caches the compressed latent ``c_KV`` (``kv_lora_rank`` numbers, from which both
    K and V are re-expanded, so there is no factor 2) and one decoupled RoPE key ``k_R`` of
    ``qk_rope_head_dim`` numbers shared by every head: ``n_layers * (kv_lora_rank + qk_rope_head_dim)``
    numbers per token.
    """
    n_layers = _positive_int("n_layers", n_layers)
    kv_lora_rank = _positive_int("kv_lora_rank", kv_lora_rank)
    qk_rope_head_dim = _positive_int("qk_rope_head_dim", qk_rope_head_dim)
    seq_len = _positive_int("seq_len", seq_len)
    batch = _positive_int("batch", batch)
    dtype_bytes = _positive_number("dtype_bytes", dtype_bytes)
    return _exact(n_layers * (kv_lora_rank + qk_rope_head_dim) * seq_len * batch * dtype_bytes)


def mla_equivalent_kv_heads(kv_lora_rank: int, qk_rope_head_dim: int, head_dim: int) -> float:
    """How many GQA K/V heads of size ``head_dim`` cost the same as one MLA latent: ``(r + r_rope) / (2 head_dim)``.

    For DeepSeek-V2 (512 + 64, head_dim 128) this is 2.25, the figure the DeepSeek-V2 paper quotes.
    """
    kv_lora_rank = _positive_int("kv_lora_rank", kv_lora_rank)
    qk_rope_head_dim = _positive_int("qk_rope_head_dim", qk_rope_head_dim)
    head_dim = _positive_int("head_dim", head_dim)
    return (kv_lora_rank + qk_rope_head_dim) / (2 * head_dim)


def mlkv_cache_bytes(n_layers: int, layers_per_kv: int, n_kv_heads: int, head_dim: int, seq_len: int,
                     batch: int = 1, dtype_bytes: float = 2) -> int | float:
    """Bytes of a Multi-Layer KV (MLKV) cache: groups of ``layers_per_kv`` adjacent layers share one K/V cache.

    The cache then has ``ceil(n_layers / layers_per_kv)`` layers' worth of K/V (the last group may be
    smaller). ``layers_per_kv = 1`` is the ordinary cache; 2 halves it when ``n_layers`` is even.
    """
    n_layers = _positive_int("n_layers", n_layers)
    layers_per_kv = _positive_int("layers_per_kv", layers_per_kv)
    if layers_per_kv > n_layers:
        raise ValueError(f"layers_per_kv ({layers_per_kv}) cannot exceed n_layers ({n_layers})")
    return kv_cache_bytes(math.ceil(n_layers / layers_per_kv), n_kv_heads, head_dim, seq_len, batch, dtype_bytes)


# ----------------------------------------------------------------------------------------------------------
# quantised caches
def quantized_kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1, *,
                             bits: int = 8, group_size: int = 32, scale_bytes: int = 2,
                             zero_point: bool = True) -> int | float:
    """Bytes of an integer-quantised K/V cache with one scale (and zero point) per group of elements.

    Each of the ``2 * n_layers * n_kv_heads * head_dim * seq_len * batch`` elements takes ``bits / 8``
    bytes; each group of ``group_size`` consecutive elements along ``head_dim`` adds a ``scale_bytes`` scale
    and, for asymmetric quantisation (``zero_point=True``), a zero point of the same width.
    ``group_size`` must divide ``head_dim``; ``bits`` is 2, 4 or 8.
    """
    bits = _check_bits(bits)
    head_dim = _positive_int("head_dim", head_dim)
    group_size = _check_group_size(group_size, head_dim, "head_dim")
    scale_bytes = _positive_int("scale_bytes", scale_bytes)
    zero_point = _bool("zero_point", zero_point)
    elements = kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch, dtype_bytes=1)
    return _quantized_bytes(elements, bits, group_size, scale_bytes, zero_point)


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 (an int), got {bits!r}")
    return int(bits)


def _check_group_size(group_size, row: int, row_name: str) -> int:
    """The one rule for quantisation groups, shared by :func:`quantized_kv_cache_bytes` and
    :func:`calculator`: a positive integer that divides the row the groups run along (``head_dim``, or an
    MLA latent), so that no group straddles two heads and every group holds ``group_size`` numbers."""
    group_size = _positive_int("group_size", group_size)
    if row % group_size:
        raise ValueError(f"group_size ({group_size}) must divide {row_name} ({row})")
    return group_size


def _quantized_bytes(elements: int, bits: int, group_size: int, scale_bytes: int, zero_point: bool) -> int | float:
    """``elements`` numbers of ``bits`` bits plus one scale (and zero point) of ``scale_bytes`` per group."""
    per_group_meta = scale_bytes * (2 if zero_point else 1)
    return _exact(elements * bits / 8 + elements // group_size * per_group_meta)


# ----------------------------------------------------------------------------------------------------------
# model presets (data, with sources)
@dataclass(frozen=True)
class ModelPreset:
    """The shape of a published model, as far as the KV cache and the weights' bytes are concerned.

    ``n_params`` counts every weight (what must sit in memory); ``n_active_params`` those one token reads
    (equal for dense models, smaller for mixture-of-experts). ``attention`` is ``"mha"``, ``"gqa"`` or
    ``"mla"``; MLA presets also give ``kv_lora_rank`` and ``qk_rope_head_dim``.
    """

    name: str
    n_params: float
    n_active_params: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    attention: str
    source: str
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    def kv_bytes_per_token(self, dtype_bytes: float = 2, grouping: str | None = None) -> int | float:
        """Cache bytes per token of one sequence; ``grouping`` ("mha"/"mqa"/"gqa") overrides a non-MLA model's own."""
        return self.kv_cache_bytes(1, 1, dtype_bytes, grouping)

    def kv_cache_bytes(self, seq_len: int, batch: int = 1, dtype_bytes: float = 2,
                       grouping: str | None = None) -> int | float:
        """Cache bytes for ``batch`` sequences of ``seq_len`` tokens."""
        if self.attention == "mla" and grouping in (None, "mla"):
            return mla_cache_bytes(self.n_layers, self.kv_lora_rank, self.qk_rope_head_dim, seq_len, batch,
                                   dtype_bytes)
        grouping = grouping or self.attention
        return kv_cache_bytes(self.n_layers, kv_heads(self.n_heads, grouping, self.n_kv_heads), self.head_dim,
                              seq_len, batch, dtype_bytes)

    def weight_bytes(self, dtype_bytes: float = 2, active: bool = False) -> float:
        """Bytes of the weights (all of them, or only those one token reads when ``active``)."""
        dtype_bytes = _positive_number("dtype_bytes", dtype_bytes)
        return (self.n_active_params if _bool("active", active) else self.n_params) * dtype_bytes


PRESETS: dict[str, ModelPreset] = {
    "source-70B-MHA": ModelPreset(
        "source-70B-MHA", 70e9, 70e9, n_layers=80, n_heads=64, n_kv_heads=64, head_dim=128, attention="mha",
        source="The source text's example in 10.1.1: a 70B model, 80 layers, 64 heads, d=128, no K/V sharing"),
    "Llama-3-8B": ModelPreset(
        "Llama-3-8B", 8.03e9, 8.03e9, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, attention="gqa",
        source="Meta Llama 3 8B config.json (32 layers, 32 heads, 8 KV heads, hidden 4096); Dubey et al. 2024"),
    "Llama-3-70B": ModelPreset(
        "Llama-3-70B", 70.6e9, 70.6e9, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, attention="gqa",
        source="Meta Llama 3 70B config.json (80 layers, 64 heads, 8 KV heads, hidden 8192); Dubey et al. 2024"),
    "DeepSeek-V2": ModelPreset(
        "DeepSeek-V2", 236e9, 21e9, n_layers=60, n_heads=128, n_kv_heads=128, head_dim=128, attention="mla",
        kv_lora_rank=512, qk_rope_head_dim=64,
        source="DeepSeek-V2 config.json (60 layers, 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, "
               "qk_nope_head_dim 128); DeepSeek-AI 2024"),
    "DeepSeek-V3": ModelPreset(
        "DeepSeek-V3", 671e9, 37e9, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128, attention="mla",
        kv_lora_rank=512, qk_rope_head_dim=64,
        source="DeepSeek-V3 config.json (61 layers, 128 heads, kv_lora_rank 512, qk_rope_head_dim 64); "
               "DeepSeek-AI 2024"),
}
"""Model presets used by the chapter. For MLA models ``n_kv_heads``/``head_dim`` describe the MHA the
latent replaces (128 heads of 128 dims), which is what ``grouping="mha"`` computes."""


# ----------------------------------------------------------------------------------------------------------
# the memory wall
def decode_time_floor(weight_bytes: float, kv_bytes: float, hbm_bytes_per_s: float) -> float:
    """Lower bound on the seconds one decode step takes: every weight and every cached K/V is read once.

    ``(weight_bytes + kv_bytes) / hbm_bytes_per_s``; compute, kernel launches and the activations are
    ignored, so a real step is slower. ``kv_bytes`` is the cache of the whole batch.
    """
    weight_bytes = _positive_number("weight_bytes", weight_bytes)
    kv_bytes = _nonnegative_number("kv_bytes", kv_bytes)
    hbm_bytes_per_s = _positive_number("hbm_bytes_per_s", hbm_bytes_per_s)
    return (weight_bytes + kv_bytes) / hbm_bytes_per_s


def tokens_per_s_ceiling(weight_bytes: float, kv_bytes_per_token: float, context, hbm_bytes_per_s: float,
                         batch: int = 1):
    """Upper bound on decoded tokens per second (summed over a batch) at each context length in ``context``.

    One step produces ``batch`` tokens and reads the weights once plus ``batch * context`` tokens of cache.
    ``context`` may be a number or an array; the result has the same shape.
    """
    batch = _positive_int("batch", batch)
    kv_bytes_per_token = _positive_number("kv_bytes_per_token", kv_bytes_per_token)
    if isinstance(context, (bool, np.bool_)) or (isinstance(context, np.ndarray) and context.dtype == bool):
        raise ValueError(f"context must be a non-negative number or array of them, got {context!r}")
    try:
        context = np.asarray(context, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"context must be a non-negative number or array of them, got {context!r}") from None
    if not np.isfinite(context).all() or (context < 0).any():
        raise ValueError("context must be non-negative and finite (no NaN or inf)")
    step = (_positive_number("weight_bytes", weight_bytes) + batch * context * kv_bytes_per_token) \
        / _positive_number("hbm_bytes_per_s", hbm_bytes_per_s)
    out = batch / step
    return float(out) if out.ndim == 0 else out


def kv_equals_weights_context(weight_bytes: float, kv_bytes_per_token: float, batch: int = 1) -> float:
    """Context length (tokens per sequence) at which the batch's KV cache is as large as the weights."""
    return _positive_number("weight_bytes", weight_bytes) / (
        _positive_number("kv_bytes_per_token", kv_bytes_per_token) * _positive_int("batch", batch))


def sequences_that_fit(memory_bytes: float, kv_bytes_per_sequence: float, weight_bytes: float = 0) -> int:
    """How many whole sequences' caches fit in ``memory_bytes`` after ``weight_bytes`` of weights (0 if none)."""
    memory_bytes = _positive_number("memory_bytes", memory_bytes)
    kv_bytes_per_sequence = _positive_number("kv_bytes_per_sequence", kv_bytes_per_sequence)
    weight_bytes = _nonnegative_number("weight_bytes", weight_bytes)
    free = memory_bytes - weight_bytes
    return max(0, int(free // kv_bytes_per_sequence))


# ----------------------------------------------------------------------------------------------------------
# FLOPs of generation with and without the cache
def forward_flops(n_matmul_params: int, n_layers: int, attn_width: int, n_query: int, context_end: int, *,
                  lm_head_params: int = 0, full_square: bool = False) -> int:
    """FLOPs (2 per multiply-add) of a forward pass over ``n_query`` new tokens ending at position ``context_end``.

    * the layers' matmuls cost ``2 * n_matmul_params`` per new token (every Linear weight of the layers);
    * the LM head costs ``2 * lm_head_params`` once: to pick the next token only the last position's
      logits are needed (what ``transformers``' ``generate`` computes);
    * attention costs, per layer, ``2 * attn_width`` for ``q . k`` and again for ``p . v`` per
      (query, key) pair, with ``attn_width = n_heads * head_dim``. With causal masking query ``i``
      (1-based position) needs ``i`` keys; an eager implementation computes all ``n_query x context_end``
      scores and masks afterwards, which ``full_square=True`` counts instead.

    Norms, softmax, RoPE and the embedding lookup are ignored (they are not matmuls).
    """
    n_matmul_params = _positive_int("n_matmul_params", n_matmul_params)
    n_layers = _positive_int("n_layers", n_layers)
    attn_width = _positive_int("attn_width", attn_width)
    n_query = _positive_int("n_query", n_query)
    context_end = _positive_int("context_end", context_end)
    lm_head_params = _nonnegative_int("lm_head_params", lm_head_params)
    full_square = _bool("full_square", full_square)
    if n_query > context_end:
        raise ValueError(f"n_query ({n_query}) cannot exceed context_end ({context_end})")
    if full_square:
        pairs = n_query * context_end
    else:
        first = context_end - n_query + 1
        pairs = (first + context_end) * n_query // 2      # sum of visible keys over the new queries
    return 2 * n_matmul_params * n_query + 2 * int(lm_head_params) + 4 * n_layers * attn_width * pairs


def generation_flops(n_matmul_params: int, n_layers: int, attn_width: int, prompt_len: int, n_new: int,
                     use_cache: bool, *, lm_head_params: int = 0, full_square: bool = False) -> int:
    """FLOPs to greedily generate ``n_new`` tokens after a ``prompt_len``-token prompt.

    With the cache: one prefill over the prompt, then one single-token step per further token. Without it,
    every step re-runs the forward pass over the whole sequence so far. Arguments as in
    :func:`forward_flops`.
    """
    prompt_len = _positive_int("prompt_len", prompt_len)
    n_new = _positive_int("n_new", n_new)
    use_cache = _bool("use_cache", use_cache)
    kw = dict(lm_head_params=lm_head_params, full_square=full_square)
    total = forward_flops(n_matmul_params, n_layers, attn_width, prompt_len, prompt_len, **kw)
    for step in range(1, n_new):
        end = prompt_len + step
        total += forward_flops(n_matmul_params, n_layers, attn_width, 1 if use_cache else end, end, **kw)
    return total


# ----------------------------------------------------------------------------------------------------------
# fragmentation
def sample_request_lengths(n_requests: int, max_len: int, seed: int = 0, median: float = 300.0,
                           sigma: float = 1.0) -> np.ndarray:
    """A seeded mix of request lengths (prompt + output tokens): log-normal, clipped to ``[1, max_len]``.

    The defaults (median 300 tokens, a factor e spread) are an assumption in the range of chat traces,
    not a measurement; the chapter shows how the utilisation changes with them.
    """
    n_requests = _positive_int("n_requests", n_requests)
    max_len = _positive_int("max_len", max_len)
    _positive_number("median", median)
    _positive_number("sigma", sigma)
    seed = _nonnegative_int("seed", seed)
    rng = np.random.default_rng(seed)
    lengths = np.rint(rng.lognormal(math.log(median), sigma, size=n_requests)).astype(np.int64)
    return np.clip(lengths, 1, max_len)


def _lengths(lengths: Iterable[int]) -> np.ndarray:
    arr = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("lengths must be a non-empty 1-D sequence of integers")
    if (arr <= 0).any():
        raise ValueError("lengths must all be positive")
    return arr.astype(np.int64)


def reservation_utilisation(lengths: Sequence[int], max_len: int) -> float:
    """Fraction of reserved cache slots that hold a token when every request reserves ``max_len`` slots."""
    arr = _lengths(lengths)
    max_len = _positive_int("max_len", max_len)
    if (arr > max_len).any():
        raise ValueError(f"a length exceeds max_len ({max_len})")
    return float(arr.sum() / (arr.size * max_len))


def paged_utilisation(lengths: Sequence[int], block_size: int) -> float:
    """Fraction of allocated slots in use when caches grow in blocks of ``block_size`` tokens (PagedAttention)."""
    arr = _lengths(lengths)
    block_size = _positive_int("block_size", block_size)
    allocated = (-(-arr // block_size)) * block_size
    return float(arr.sum() / allocated.sum())


# ----------------------------------------------------------------------------------------------------------
# the calculator behind the chapter's widget and table
CALCULATOR_DTYPES = ("bf16", "fp8", "int8", "int4")


def calculator(preset: ModelPreset | str, seq_len: int, batch: int = 1, dtype: str = "bf16",
               grouping: str | None = None, group_size: int = 32,
               memories_gb: Sequence[float] = (80, 141)) -> dict:
    """Everything the chapter's calculator shows for one setting, as a dict.

    ``dtype`` is the cache's: ``"bf16"``, ``"fp8"``, or ``"int8"``/``"int4"`` with an fp16 scale and zero
    point per ``group_size`` numbers (a KIVI-style asymmetric cache; ``group_size`` must divide ``head_dim``,
    or the latent row of an MLA model, exactly as :func:`quantized_kv_cache_bytes` requires).
    ``preset`` is a :class:`ModelPreset` or a name in :data:`PRESETS`; ``memories_gb`` positive card sizes.
    Raises ``ValueError`` naming any bad argument. ``grouping`` overrides the model's
    own K/V sharing (``"mha"``, ``"gqa"``, ``"mqa"``; MLA models keep their latent unless one is given).
    Weights are counted in bf16. ``fit_<N>GB`` is how many sequences fit on an N-GB card next to the
    weights, ``kv_only_fit_<N>GB`` how many would if the card held only the cache (weights sharded away).
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    if not isinstance(preset, ModelPreset):
        raise ValueError(f"preset must be a ModelPreset or one of the names in PRESETS, got {type(preset).__name__}")
    if not isinstance(dtype, str) or dtype not in CALCULATOR_DTYPES:
        raise ValueError(f"dtype must be one of {CALCULATOR_DTYPES}, got {dtype!r}")
    if isinstance(memories_gb, (str, bytes)) or not hasattr(memories_gb, "__iter__"):
        raise ValueError(f"memories_gb must be a sequence of card sizes in GB, got {memories_gb!r}")
    memories_gb = [_positive_number("memories_gb", memory) for memory in memories_gb]
    elements = preset.kv_cache_bytes(seq_len, batch, dtype_bytes=1, grouping=grouping)
    if dtype in ("bf16", "fp8"):
        group_size = _positive_int("group_size", group_size)   # unused, but a bad value is still refused
        kv = _exact(elements * DTYPE_BYTES[dtype])
    else:
        # The groups run along each head's vector, as in quantized_kv_cache_bytes (the same check and
        # formula); an MLA cache has one latent row per token and layer instead of heads.
        if preset.attention == "mla" and grouping in (None, "mla"):
            row, row_name = preset.kv_lora_rank + preset.qk_rope_head_dim, "the MLA latent row (kv_lora_rank + qk_rope_head_dim)"
        else:
            row, row_name = preset.head_dim, "head_dim"
        group_size = _check_group_size(group_size, row, row_name)
        kv = _quantized_bytes(elements, 8 if dtype == "int8" else 4, group_size, scale_bytes=2, zero_point=True)
    weights = preset.weight_bytes(2)
    row = dict(model=preset.name, attention=grouping or preset.attention, seq_len=int(seq_len), batch=int(batch),
               dtype=dtype, kv_bytes=kv, kv_gib=kv / GiB, weight_gb=weights / GB)
    per_sequence = kv / batch
    for memory in memories_gb:
        row[f"fit_{memory:g}GB"] = sequences_that_fit(memory * GB, per_sequence, weights)
        row[f"kv_only_fit_{memory:g}GB"] = sequences_that_fit(memory * GB, per_sequence)
    return row
