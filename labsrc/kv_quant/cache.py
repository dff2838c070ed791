"""A ``transformers`` cache that stores the keys and values quantized (KVarN and the plain groupings), with
the newest tokens kept in full precision.
"""
from __future__ import annotations

import operator
from typing import Callable, Iterable, Sequence

import torch

from labsrc.kernels.kv_quant.codes import _check_bits, _check_granularity, _check_group_size
from labsrc.kernels.kv_quant.tensor import ChannelStats, KVStats, QuantizedTensor, quantize


# ----------------------------------------------------------------------------------------------- the cache
try:  # transformers is a dependency of the lab, but keep the quantizer importable without it
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError:  # pragma: no cover
    Cache, DynamicLayer = object, object


class KVarNLayer(DynamicLayer):
    """One layer of :class:`KVarNCache`: quantizes whole groups of old tokens, keeps recent ones in full precision.

    ``update()`` appends the new K/V rows to a full-precision tail; whenever the tail holds more than
    ``window`` tokens plus a whole flush unit (``group_size`` tokens, or 1 token when neither K nor V groups
    tokens), the oldest whole units are quantized (kept as :class:`QuantizedTensor`). It returns the full K/V:
    dequantized old tokens followed by the tail.

    The dequantized copy (``self.keys``/``self.values``) is a working buffer of this PyTorch simulation, so
    attention runs on exactly what a fused kernel would compute on the fly; :attr:`nbytes` counts only what a
    real quantized cache stores (codes, steps, zero points, statistics, the full-precision tail).
    """

    def __init__(self, bits: int = 4, group_size: int = 128, key_granularity: str = "group",
                 value_granularity: str = "group", normalize: bool = True, stats: KVStats | None = None,
                 window: int = 0, enabled: bool = True, quantize_partial: bool = False):
        super().__init__()
        self.bits = _check_bits(bits)
        self.group_size = _check_group_size(group_size)
        self.key_granularity = _check_granularity(key_granularity)
        self.value_granularity = _check_granularity(value_granularity)
        if stats is not None and not isinstance(stats, KVStats):
            raise TypeError(f"stats must be a KVStats (one layer of calibrate()), got {type(stats).__name__}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        if stats is not None and not normalize:
            raise ValueError("stats were given but normalize=False")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be a non-negative int, got {window!r}")
        self.normalize, self.stats, self.window, self.enabled = normalize, stats, window, enabled
        self.quantize_partial = bool(quantize_partial)
        self._partial: tuple[QuantizedTensor, QuantizedTensor] | None = None
        both_token = key_granularity == "token" and value_granularity == "token"
        self.unit = 1 if both_token else group_size
        self.cumulative_length = 0
        self.n_quantized = 0
        self.qkeys: list[QuantizedTensor] = []
        self.qvalues: list[QuantizedTensor] = []

    def _q(self, x: torch.Tensor, granularity: str, stats: ChannelStats | None) -> QuantizedTensor:
        return quantize(x, bits=self.bits, group_size=self.group_size, normalize=self.normalize, stats=stats,
                        granularity=granularity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        if not self.enabled:
            return self.keys, self.values
        tail = self.cumulative_length - self.n_quantized
        n_flush = (tail - self.window) // self.unit * self.unit if tail - self.window >= self.unit else 0
        if n_flush > 0:
            a, b = self.n_quantized, self.n_quantized + n_flush
            ks, vs = (self.stats.k, self.stats.v) if self.stats is not None else (None, None)
            qk = self._q(self.keys[..., a:b, :], self.key_granularity, ks)
            qv = self._q(self.values[..., a:b, :], self.value_granularity, vs)
            self.qkeys.append(qk)
            self.qvalues.append(qv)
            # Rebuild instead of writing in place: the returned tensors of earlier steps must stay valid.
            self.keys = torch.cat([self.keys[..., :a, :], qk.dequantize(), self.keys[..., b:, :]], dim=-2)
            self.values = torch.cat([self.values[..., :a, :], qv.dequantize(), self.values[..., b:, :]], dim=-2)
            self.n_quantized = b
        return self._serve()

    def _serve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V attention reads: the stored rows, with the incomplete group quantized if ``quantize_partial``."""
        self._partial = None
        end = self.cumulative_length - self.window
        if self.quantize_partial and end > self.n_quantized:
            # The incomplete group is served quantized (as a store that quantizes on write would) but its
            # full-precision rows are kept, so that it is quantized once more, whole, when it fills up.
            a = self.n_quantized
            ks, vs = (self.stats.k, self.stats.v) if self.stats is not None else (None, None)
            qk = self._q(self.keys[..., a:end, :], self.key_granularity, ks)
            qv = self._q(self.values[..., a:end, :], self.value_granularity, vs)
            self._partial = (qk, qv)
            keys = torch.cat([self.keys[..., :a, :], qk.dequantize(), self.keys[..., end:, :]], dim=-2)
            values = torch.cat([self.values[..., :a, :], qv.dequantize(), self.values[..., end:, :]], dim=-2)
            return keys, values
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.n_quantized = 0
        self.qkeys, self.qvalues = [], []
        self._partial = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (transformers' convention: a count <= 0).

        Only tokens still in the full-precision tail can be removed: a quantized group is not split, and its
        codes were computed with the removed tokens' range. The tail always holds the newest ``window``
        tokens, so a cache with ``window >= n`` can always roll back ``n`` tokens, which is how speculative
        decoding uses it (rejected drafts never reach the quantized store).
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove must be an int <= 0 (minus the number of tokens to drop), "
                             f"got {tokens_to_remove!r}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        tail = self.cumulative_length - self.n_quantized
        if n > tail:
            raise ValueError(f"cannot remove the newest {n} tokens: only {tail} are still in full precision "
                             f"(the older ones are quantized in whole groups); build the cache with "
                             f"window >= {n} to roll back {n} tokens")
        self.keys = self.keys[..., :-n, :]
        self.values = self.values[..., :-n, :]
        self.cumulative_length -= n
        self._serve()   # recompute the served partial group, if any, for the shorter tail

    def _map_batch(self, f: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis operation to every stored tensor (codes, steps, per-sequence stats, the tail)."""
        if not self.is_initialized or self.cumulative_length == 0:
            return
        self.keys, self.values = f(self.keys), f(self.values)
        partial = list(self._partial) if self._partial is not None else []
        for qt in self.qkeys + self.qvalues + partial:
            qt.packed, qt.scale, qt.zero = f(qt.packed), f(qt.scale), f(qt.zero)
            if qt.stats is not None and not qt.stats_shared:  # measured per sequence: (B, H, D)
                qt.stats = ChannelStats(f(qt.stats.mean), f(qt.stats.std))
            qt.shape = (qt.packed.shape[0],) + tuple(qt.shape[1:])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def nbytes_breakdown(self) -> dict:
        """Stored bytes of this layer by part: codes, scales, zeros, stats, fp_tail."""
        out = {"codes": 0, "scales": 0, "zeros": 0, "stats": 0, "fp_tail": 0}
        partial = list(self._partial) if self._partial is not None else []
        for qt in self.qkeys + self.qvalues + partial:
            for key, val in qt.nbytes_breakdown().items():
                out[key] += val
        if self.stats is not None and (self.n_quantized > 0 or self._partial is not None):
            out["stats"] += self.stats.nbytes
        if self.is_initialized:
            tail = self.cumulative_length - self.n_quantized
            if self._partial is not None:
                tail -= self._partial[0].shape[-2]
            per_token = self.keys[..., :1, :].numel() * self.keys.element_size()
            out["fp_tail"] = 2 * tail * per_token
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())


class KVarNCache(Cache):
    """A ``transformers`` cache whose layers store K and V quantized; use as
    ``model.generate(..., cache=cache)`` (transformers 5.24 name; ``past_key_values=cache`` still works, with a
    deprecation warning).

    Arguments (all layers alike):

    * ``config``: the model's config (for the number of layers).
    * ``bits`` (2/3/4/8), ``group_size`` (tokens per quantization group, and the unit in which tokens move from
      the full-precision tail to the quantized store).
    * ``key_granularity``/``value_granularity``: ``"group"``, ``"token"`` or ``"channel"`` (see the module).
    * ``normalize`` and ``stats``: KVarN normalisation with calibrated statistics (``calibrate(...)``, one
      :class:`KVStats` per layer); ``normalize=True, stats=None`` normalises each flushed chunk with its own
      statistics (stored with it).
    * ``window``: the most recent ``window`` tokens stay in full precision (KIVI's residual); up to ``window``
      newest tokens can be removed again with ``crop`` (speculative decoding's rollback).
    * ``quantize_partial``: also serve the trailing incomplete group quantized (otherwise its tokens stay in
      full precision until the group fills up, as in KIVI). Use it to compare groupings fairly at lengths
      that are not a multiple of ``group_size``.
    * ``quantize_layers``: indices of the layers to quantize (default: all); the others keep full precision,
      which isolates one layer's error to watch it propagate.

    Presets: :meth:`kvarn`, :meth:`per_token`, :meth:`kivi`. :attr:`nbytes` is the true stored size.
    """

    def __init__(self, config, bits: int = 4, group_size: int = 128, key_granularity: str = "group",
                 value_granularity: str = "group", normalize: bool = True, stats: Sequence[KVStats] | None = None,
                 window: int = 0, quantize_layers: Iterable[int] | None = None, quantize_partial: bool = False):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = int(cfg.num_hidden_layers)
        if stats is not None:
            stats = list(stats)
            if len(stats) != n_layers:
                raise ValueError(f"stats has {len(stats)} layers but the model has {n_layers}")
            from labsrc.models import config_head_dim
            want = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, config_head_dim(cfg))
            for i, st in enumerate(stats):
                if not isinstance(st, KVStats):
                    raise TypeError(f"stats[{i}] must be a KVStats, got {type(st).__name__}")
                if tuple(st.k.mean.shape) != want or tuple(st.v.mean.shape) != want:
                    raise ValueError(f"stats[{i}] have shape {tuple(st.k.mean.shape)}, expected (n_kv_heads, head_dim) = {want}")
        if quantize_layers is None:
            chosen = set(range(n_layers))
        else:
            try:  # ints, numpy or 0-d tensor integers; not floats, bools or strings
                if isinstance(quantize_layers, (str, bytes)) or \
                        any(isinstance(i, bool) for i in quantize_layers):
                    raise TypeError
                chosen = {operator.index(i) for i in quantize_layers}
            except TypeError:
                raise ValueError(f"quantize_layers must be an iterable of layer indices (ints), "
                                 f"got {quantize_layers!r}") from None
        if any(i < 0 or i >= n_layers for i in chosen):
            raise ValueError(f"quantize_layers must be in [0, {n_layers}), got {sorted(chosen)}")
        layers = [KVarNLayer(bits, group_size, key_granularity, value_granularity, normalize,
                             None if stats is None else stats[i], window, enabled=i in chosen,
                             quantize_partial=quantize_partial)
                  for i in range(n_layers)]
        super().__init__(layers=layers)

    @classmethod
    def kvarn(cls, config, stats: Sequence[KVStats] | None, bits: int = 4, group_size: int = 128, window: int = 0,
              **kw) -> "KVarNCache":
        """KVarN: calibrated per-channel normalisation, then one step per ``group_size`` tokens."""
        return cls(config, bits, group_size, "group", "group", True, stats, window, **kw)

    @classmethod
    def per_token(cls, config, bits: int = 4, window: int = 0, **kw) -> "KVarNCache":
        """The baseline: one step per token for K and V, no normalisation."""
        return cls(config, bits, 1, "token", "token", False, None, window, **kw)

    @classmethod
    def kivi(cls, config, bits: int = 4, group_size: int = 32, window: int = 32, **kw) -> "KVarNCache":
        """KIVI: keys per channel (per ``group_size`` tokens), values per token, recent ``window`` tokens in full."""
        return cls(config, bits, group_size, "channel", "token", False, None, window, **kw)

    def nbytes_breakdown(self) -> dict:
        out: dict = {}
        for layer in self.layers:
            for key, val in layer.nbytes_breakdown().items():
                out[key] = out.get(key, 0) + val
        return out

    @property
    def nbytes(self) -> int:
        """True stored bytes over all layers (quantized parts + statistics + full-precision tail)."""
        return sum(self.nbytes_breakdown().values())


# ----------------------------------------------------------------------------------------------- experiments
CacheFactory = Callable[[], "Cache | None"]
