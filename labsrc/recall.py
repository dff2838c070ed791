"""Recall against state size: small models that differ only in their sequence mixer, trained briefly on the lab's
multi-query associative recall task (Zoology's MQAR, :func:`labsrc.tasks.mqar_sample`), and scored with 95%
Wilson intervals.

The pieces, reusable by any chapter that compares mixers:

* :data:`MIXERS` and :func:`register_mixer` -- a registry of sequence mixers, each an ``nn.Module`` built as
  ``factory(d_model, head_dim, state_size)`` that maps ``(B, T, d_model) -> (B, T, d_model)`` causally and
  says how many bytes it keeps for a sequence of ``T`` tokens (``memory_bytes(T)``: a KV cache grows with
  ``T``, a recurrent state does not). Registered here: ``softmax`` (causal attention), ``linear``
  (Katharopoulos's elu+1 linear attention), ``delta`` (Gated DeltaNet), ``mamba2`` (Mamba-2's SSD mixer,
  chapter 7's :func:`labsrc.ssm.ssd_chunked`). Chapter 15's :mod:`labsrc.frontier` registers ``diff``, ``xkv`` and the
  whole-block kind ``mod`` (:data:`BLOCKS`); a mixer with a ``bind(shared, layer_index)`` method is told its
  layer and given a dict shared by all layers, and a block's ``aux_loss`` is added to the training loss.
* :class:`RecallModel` -- embedding, ``len(mixers)`` blocks (RMSNorm, a short causal depthwise convolution
  shared by every mixer kind, the mixer, an MLP), a head that scores the answer positions only. A hybrid is a
  list of different mixers (``("linear", "softmax")``).
* :class:`MQARData` -- the task's samples over a compact vocabulary (the lab tokenizer's ids that occur in
  them), training from the corpus's train split, evaluation from its validation split.
* :class:`PassKeyData` -- a synthetic pass key (a ``k``-token key after a marker at a random depth in filler,
  asked for after a query marker) with the same interface, so the same models train on it.
* :func:`train` (AdamW, cosine schedule, loss on the answer tokens) and :func:`evaluate` (exact match of
  each answer span under greedy decoding, which teacher forcing computes in one pass).

* :func:`sweep` -- the one training path of every stored run (chapters 8 and 15): each variant of a grid at
  each width and each training seed through :func:`run`, one row per seed; :func:`across_seeds` summarises a
  variant by the mean over its seeds with a Student-t 95% interval (the spread a reader must see before a
  ranking); :func:`code_version` fingerprints the source that determines a run's result, stored with it.

``python -m labsrc.recall`` trains chapter 8's grid (every mixer at widths 16 and 32, three seeds, two pairs
per sample) and writes ``labsrc/data/recall_mqar.json``: the exact command, the code version, the task and
training settings and one row per (mixer, width, seed) with its loss log. Training is by a fixed number of
steps from the seed, so a rerun gives the same numbers on the same machine and library versions. The task's
compact vocabulary (hence the model's initial weights) depends on the task sizes, which is why every command
takes them from the same defaults (:func:`add_task_args`): chapter 8's 0.51 and chapter 15's 0.86 for the
same softmax model at width 32 came from two evaluation sizes (100 and 150 samples), so two vocabularies,
two initialisations and, with one seed each, two draws from a wide spread.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import random
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from labsrc import curves, linear_attention as la

__all__ = ["MIXERS", "register_mixer", "BLOCKS", "register_block", "RecallModel", "MQARData", "PassKeyData",
           "PassKeySample", "RecallConfig", "train", "evaluate", "run", "sweep", "progress_echo", "across_seeds",
           "code_version", "add_task_args", "make_data", "command_line", "main", "DEFAULT_OUT"]

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "recall_mqar.json"
MIXERS: dict[str, Callable[..., nn.Module]] = {}
BLOCKS: dict[str, Callable[..., nn.Module]] = {}    # a whole-block variant (Mixture-of-Depths, chapter 15)
_FP32 = 4


def register_mixer(name: str):
    """Decorator: register ``factory(d_model, head_dim, state_size) -> nn.Module`` as mixer ``name``."""
    def wrap(factory):
        if name in MIXERS:
            raise ValueError(f"mixer {name!r} registered twice")
        MIXERS[name] = factory
        return factory
    return wrap


def register_block(name: str):
    """Decorator: register ``cls(name, d_model, head_dim, state_size) -> nn.Module`` as a whole-block kind
    ``name`` (used in place of the ordinary block; it may set ``aux_loss``, which :func:`train` adds)."""
    def wrap(cls):
        if name in BLOCKS or name in MIXERS:
            raise ValueError(f"block {name!r} registered twice")
        BLOCKS[name] = cls
        return cls
    return wrap


class _Heads(nn.Module):
    """Shared plumbing: ``d_model`` split into ``d_model // head_dim`` heads."""

    def __init__(self, d_model: int, head_dim: int):
        super().__init__()
        if d_model % head_dim:
            raise ValueError(f"d_model={d_model} must be a multiple of head_dim={head_dim}")
        self.h, self.p = d_model // head_dim, head_dim
        self.out = nn.Linear(d_model, d_model, bias=False)

    def split(self, x):
        return x.view(*x.shape[:2], self.h, self.p)


@register_mixer("softmax")
class SoftmaxMixer(_Heads):
    """Causal softmax attention (no positional encoding: the block's short convolution gives local order)."""

    def __init__(self, d_model, head_dim, state_size=None):
        super().__init__(d_model, head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)

    def forward(self, x):
        q, k, v = (self.split(t).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(x.shape))

    def memory_bytes(self, T: int) -> int:
        return 2 * self.h * self.p * T * _FP32            # the KV cache after T tokens


@register_mixer("linear")
class LinearMixer(_Heads):
    """Katharopoulos et al.'s linear attention, ``phi = elu + 1``, normalised: a ``p x p`` state per head
    (plus the ``p``-vector normaliser)."""

    code_deps = ("labsrc.linear_attention:linear_attention",)     # what code_version fingerprints beside it

    def __init__(self, d_model, head_dim, state_size=None):
        super().__init__(d_model, head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)

    def forward(self, x):
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, -1))
        return self.out(la.linear_attention(q, k, v, "elu1", causal=True).reshape(x.shape))

    def memory_bytes(self, T: int) -> int:
        return self.h * (self.p * self.p + self.p) * _FP32


@register_mixer("delta")
class DeltaMixer(_Heads):
    """Gated DeltaNet: L2-normalised queries and keys, ``beta = sigmoid(.)``, ``g = logsigmoid(.)``, the chunked
    gated delta rule (:func:`labsrc.linear_attention.gated_delta_rule_chunked`), a ``p x p`` state per head."""

    code_deps = ("labsrc.linear_attention:gated_delta_rule_chunked",)

    def __init__(self, d_model, head_dim, state_size=None):
        super().__init__(d_model, head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.gates = nn.Linear(d_model, 2 * self.h)
        nn.init.constant_(self.gates.bias[self.h:], 3.0)   # start with little forgetting (alpha near 1)

    def forward(self, x):
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, -1))
        b, a = self.gates(x).chunk(2, -1)
        o, _ = la.gated_delta_rule_chunked(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, F.logsigmoid(a),
                                           torch.sigmoid(b), chunk_size=64)
        return self.out(o.reshape(x.shape))

    def memory_bytes(self, T: int) -> int:
        return self.h * self.p * self.p * _FP32


@register_mixer("mamba2")
class Mamba2Mixer(_Heads):
    """Mamba-2's mixer on chapter 7's SSD (:func:`labsrc.ssm.ssd_chunked`): ``x (b, l, h, p)``, ``dt =
    softplus(.)``, ``A = -exp(A_log)``, one group of ``B, C (b, l, 1, n)``, a skip ``D`` and a SiLU gate; a
    ``p x n`` state per head."""

    code_deps = ("labsrc.ssm:ssd_chunked",)

    def __init__(self, d_model, head_dim, state_size=16):
        super().__init__(d_model, head_dim)
        self.n = state_size
        self.proj = nn.Linear(d_model, 2 * d_model + 2 * state_size + self.h)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 8.0, self.h)))
        self.D = nn.Parameter(torch.ones(self.h))

    def forward(self, x):
        from labsrc.ssm import ssd_chunked

        d, n = x.shape[-1], self.n
        xs, z, B, C, dt = self.proj(x).split([d, d, n, n, self.h], -1)
        y, _ = ssd_chunked(self.split(xs), F.softplus(dt), -torch.exp(self.A_log), B[:, :, None], C[:, :, None],
                           self.D, chunk_size=64)
        return self.out(y.reshape(x.shape) * F.silu(z))

    def memory_bytes(self, T: int) -> int:
        return self.h * self.p * self.n * _FP32


class _Block(nn.Module):
    def __init__(self, mixer: str, d_model: int, head_dim: int, state_size: int, conv: int = 4):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"unknown mixer {mixer!r}; registered: {sorted(MIXERS) + sorted(BLOCKS)}")
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.conv = nn.Conv1d(d_model, d_model, conv, groups=d_model, padding=conv - 1)
        self.mixer = MIXERS[mixer](d_model, head_dim, state_size)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x):
        h = self.norm1(x)
        h = self.conv(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)     # causal: keep the first T
        x = x + self.mixer(h)
        return x + self.mlp(self.norm2(x))


class RecallModel(nn.Module):
    """A small language model whose blocks differ only in their sequence mixer (``mixers``, one per layer)."""

    def __init__(self, vocab: int, d_model: int, mixers: Sequence[str], head_dim: int = 16, state_size: int = 16):
        super().__init__()
        self.mixers = tuple(mixers)
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(BLOCKS.get(m, _Block)(m, d_model, head_dim, state_size) for m in self.mixers)
        shared: dict = {}       # what a mixer leaves for a later layer (cross-layer K/V, chapter 15)
        for i, block in enumerate(self.blocks):
            if hasattr(block.mixer, "bind"):
                block.mixer.bind(shared, i)
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def logits_at(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits predicting token ``t + 1`` at each ``(row, t)`` of ``positions (N, 2)``."""
        h = self.hidden(ids)
        return self.head(h[positions[:, 0], positions[:, 1]])

    def memory_bytes(self, T: int) -> int:
        """Bytes the mixers keep for one sequence of ``T`` tokens (KV caches and recurrent states, fp32)."""
        return sum((b if hasattr(b, "memory_bytes") else b.mixer).memory_bytes(T) for b in self.blocks)

    def aux_loss(self):
        """The blocks' auxiliary losses of the last forward (0 for ordinary blocks)."""
        return sum(getattr(b, "aux_loss", 0.0) for b in self.blocks)


# ------------------------------------------------------------------------------------------------- the data

class MQARData:
    """MQAR samples from :func:`labsrc.tasks.mqar_sample` (lab tokenizer), remapped to a compact vocabulary:
    the ids that occur in a pool of samples, in order of first appearance; any other id maps to 0. The
    vocabulary therefore depends on ``n_train`` and ``n_eval``, and with it the model's initial weights: runs
    compared with each other must share the task sizes (:func:`add_task_args`)."""

    code_deps = ("labsrc.tasks:mqar_sample", "labsrc.tasks:_assemble", "labsrc.tasks:_digits",
                 "labsrc.tasks:keys_for", "labsrc.tasks:_draw", "labsrc.tasks:value_split")

    def __init__(self, tokenizer, n_pairs: int, context_len: int, n_train: int, n_eval: int, seed: int = 0):
        from labsrc import tasks

        self.n_pairs, self.context_len = n_pairs, context_len
        rng = random.Random(f"recall-{seed}-{n_pairs}-{context_len}")
        self.train_samples = [tasks.mqar_sample(tokenizer, context_len, rng, n_pairs, split="train")
                              for _ in range(n_train)]
        # Held out as Zoology's MQAR holds out: new random pairs from the same keys and values. The "validation"
        # split would draw the lab probes' keys, which these models never see in training: a test of keys
        # never learnt, not of recall. (The filler prose between the pairs is never asked about.)
        self.eval_samples = [tasks.mqar_sample(tokenizer, context_len, rng, n_pairs, split="train")
                             for _ in range(n_eval)]
        ids = [0]
        seen = {None}
        for s in self.train_samples + self.eval_samples:
            for t in s.ids:
                if t not in seen:
                    seen.add(t)
                    ids.append(t)
        self.to_compact = {t: i for i, t in enumerate(ids)}
        self.vocab = len(ids)

    def tensors(self, samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids (N, T), positions (M, 2), targets (M,))``: every answer token, predicted from the one before."""
        ids = torch.tensor([[self.to_compact.get(t, 0) for t in s.ids] for s in samples])
        pos, tgt = [], []
        for row, s in enumerate(samples):
            for a, e in s.spans:
                for t in range(a, e):
                    pos.append((row, t - 1))
                    tgt.append(int(ids[row, t]))
        return ids, torch.tensor(pos), torch.tensor(tgt)


@dataclass(frozen=True)
class PassKeySample:
    """One pass-key sequence: token ``ids``, the answer ``spans`` (``[(start, end)]``, the key's copy after the
    query marker) and the ``depth`` (position of the key marker)."""
    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    depth: int


class PassKeyData:
    """A synthetic pass key in :class:`MQARData`'s token-level style, over its own small vocabulary: ``0``
    unused, ``1`` the key marker, ``2`` the query marker, ``3 .. 3 + n_symbols - 1`` the key symbols, then
    ``n_filler`` filler tokens. A sample of ``context_len`` tokens is random filler with the key marker and a
    ``key_len``-symbol key at a uniformly random depth, then the query marker and the key again: the answer
    span is those last ``key_len`` tokens (each predicted from the token before, as in MQAR), so a span is
    right by chance with probability ``n_symbols ** -key_len``. Training and evaluation samples come from
    separate seeded streams (a key may recur by chance; its depth and filler will not)."""

    KEY, QUERY = 1, 2

    def __init__(self, key_len: int = 4, context_len: int = 72, n_train: int = 1500, n_eval: int = 150,
                 seed: int = 0, n_symbols: int = 10, n_filler: int = 32):
        if key_len < 1 or n_symbols < 2 or n_filler < 1:
            raise ValueError("key_len >= 1, n_symbols >= 2 and n_filler >= 1 are required")
        if context_len < 2 * key_len + 2:
            raise ValueError(f"context_len must be >= 2 * key_len + 2 = {2 * key_len + 2}, got {context_len}")
        self.key_len, self.context_len = key_len, context_len
        self.n_symbols, self.n_filler = n_symbols, n_filler
        self.vocab = 3 + n_symbols + n_filler
        self.chance = n_symbols ** -key_len
        self.train_samples = self._samples(random.Random(f"passkey-train-{seed}"), n_train)
        self.eval_samples = self._samples(random.Random(f"passkey-eval-{seed}"), n_eval)

    def _samples(self, rng: random.Random, n: int) -> list[PassKeySample]:
        k, body = self.key_len, self.context_len - 1 - self.key_len      # body: everything before the query
        first_filler = 3 + self.n_symbols
        out = []
        for _ in range(n):
            ids = [rng.randrange(first_filler, self.vocab) for _ in range(body)]
            key = [rng.randrange(3, first_filler) for _ in range(k)]
            depth = rng.randrange(0, body - k)                            # the marker and the key fit before the query
            ids[depth:depth + 1 + k] = [self.KEY, *key]
            ids += [self.QUERY, *key]
            out.append(PassKeySample(tuple(ids), ((body + 1, body + 1 + k),), depth))
        return out

    def tensors(self, samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids (N, T), positions (M, 2), targets (M,))`` as :meth:`MQARData.tensors`: every key token after the
        query marker, predicted from the one before."""
        ids = torch.tensor([s.ids for s in samples])
        pos, tgt = [], []
        for row, s in enumerate(samples):
            for a, e in s.spans:
                for t in range(a, e):
                    pos.append((row, t - 1))
                    tgt.append(s.ids[t])
        return ids, torch.tensor(pos), torch.tensor(tgt)


@dataclass
class RecallConfig:
    """One training run."""
    mixers: tuple[str, ...]
    d_model: int
    head_dim: int = 16
    state_size: int = 16
    steps: int = 600
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    extra: dict = field(default_factory=dict)


def train(cfg: RecallConfig, data: MQARData, log: list | None = None, max_seconds: float | None = None):
    """Train a :class:`RecallModel` on ``data``'s training samples; returns the model (eval mode). ``log``
    receives ``{"step", "loss", "seconds"}`` rows every 25 steps. ``max_seconds`` stops early (recorded)."""
    torch.manual_seed(cfg.seed)
    model = RecallModel(data.vocab, cfg.d_model, cfg.mixers, cfg.head_dim, cfg.state_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.98))
    gen = random.Random(cfg.seed)
    start = time.perf_counter()
    warm = max(1, cfg.steps // 10)
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        ids, pos, tgt = data.tensors(gen.sample(data.train_samples, cfg.batch))
        loss = F.cross_entropy(model.logits_at(ids, pos), tgt) + model.aux_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - start
        if log is not None and (step % 25 == 0 or step == cfg.steps - 1):
            log.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(elapsed, 1)})
        if max_seconds is not None and elapsed > max_seconds:
            if log is not None:
                log.append({"stopped_at_step": step + 1, "seconds": round(elapsed, 1)})
            break
    return model.eval()


@torch.no_grad()
def evaluate(model: RecallModel, data: MQARData, batch: int = 64) -> tuple[int, int]:
    """``(right, total)`` over the evaluation samples' answer spans: a span is right when the arg-max at every
    one of its tokens is that token (greedy decoding would write the whole answer)."""
    right = total = 0
    for i in range(0, len(data.eval_samples), batch):
        chunk = data.eval_samples[i:i + batch]
        ids, pos, tgt = data.tensors(chunk)
        ok = model.logits_at(ids, pos).argmax(-1) == tgt
        j = 0
        for s in chunk:
            for a, e in s.spans:
                right += bool(ok[j:j + e - a].all())
                total += 1
                j += e - a
    return right, total


def _tokenizer():
    from transformers import AutoTokenizer

    from labsrc.models import resolve
    return AutoTokenizer.from_pretrained(resolve("lab-target"))


def run(cfg: RecallConfig, data: MQARData, max_seconds: float | None = None, extra=None) -> dict:
    """Train and evaluate one configuration; a JSON-able result row with its Wilson interval. ``extra(model,
    data)``, if given, returns more fields for the row (chapter 15 adds FLOPs and MoD's causal score)."""
    from labsrc.claims import wilson

    log: list = []
    t0 = time.perf_counter()
    model = train(cfg, data, log, max_seconds)
    right, total = evaluate(model, data)
    lo, hi = wilson(right, total)
    row = {"mixers": list(cfg.mixers), "d_model": cfg.d_model, "seed": cfg.seed, "steps": cfg.steps,
           "params": sum(p.numel() for p in model.parameters()),
           "memory_bytes": model.memory_bytes(data.context_len), "right": right, "total": total,
           "accuracy": right / total, "wilson95": [lo, hi]}
    if extra is not None:
        row.update(extra(model, data))
    row.update({"seconds": round(time.perf_counter() - t0, 1), "log": log})
    return row


# ------------------------------------------------------------------------------ stored runs and their version
# What decides a run's numbers besides its settings: the model, its blocks, the data, the training loop and
# the scoring. A mixer adds its own class and the functions it names in ``code_deps``; a data class the same.
_CORE = ("_Heads", "_Block", "RecallModel", "RecallConfig", "train", "evaluate", "run", "sweep")
DATA = {"mqar": MQARData, "passkey": PassKeyData}


def _with_deps(obj) -> list:
    out = [obj]
    for dep in getattr(obj, "code_deps", ()):        # a function or class, or "module:name" (imported late)
        if isinstance(dep, str):
            module, name = dep.split(":")
            dep = getattr(importlib.import_module(module), name)
        out.append(dep)
    return out


def code_version(mixers, task: str) -> str:
    """:func:`labsrc.curves.source_version` (a SHA-256, first 16 hex digits) over the source of everything that
    determines a stored run's result: this module's model, blocks, training loop, scoring and :func:`sweep`, the
    ``task``'s data class (``"mqar"`` or ``"passkey"``) and each mixer or block kind in ``mixers`` with the
    functions it names in ``code_deps``. Source is read with :func:`inspect.getsource`, so an edit elsewhere in a file (another
    function, a comment between functions) leaves it unchanged, while any edit inside these does not: a
    stored run whose version differs was made by other code and must be rerun by its stored command."""
    if task not in DATA:
        raise ValueError(f"task must be one of {sorted(DATA)}, got {task!r}")
    parts = [globals()[name] for name in _CORE] + _with_deps(DATA[task])
    for name in sorted(set(mixers)):
        if name not in MIXERS and name not in BLOCKS:
            raise ValueError(f"unknown mixer {name!r}; registered: {sorted(MIXERS) + sorted(BLOCKS)} "
                             "(chapter 15's kinds register when labsrc.frontier is imported)")
        parts += _with_deps(BLOCKS.get(name) or MIXERS[name])
    return curves.source_version(*parts)     # the stored curves' digest: one rule for every stored result


def sweep(grid: dict, data, widths: Sequence[int], seeds: Sequence[int], steps: int, batch: int = 32,
          max_seconds: float | None = None, extra=None, header: dict | None = None, out: Path | None = None,
          echo=print) -> dict:
    """Train every variant of ``grid`` (name -> mixers per layer) at every width and training seed on the same
    ``data`` (the data's own seed stays fixed, so seeds differ in initial weights and batch order only); one
    row per run, written to ``out`` after each run so an interrupted sweep keeps what it finished.
    ``extra(name) -> callable(model, data) -> dict`` adds fields to a variant's rows; ``header`` goes in front
    of the rows (the command, code version, task and training settings)."""
    result = {**(header or {}), "runs": []}
    for width in widths:
        for seed in seeds:
            for name, mixers in grid.items():
                cfg = RecallConfig(tuple(mixers), width, steps=steps, batch=batch, seed=seed)
                row = {"model": name, **run(cfg, data, max_seconds, extra(name) if extra else None)}
                result["runs"].append(row)
                echo(f"{name:8s} d={width:3d} seed={seed} acc={row['accuracy']:.3f} "
                     f"[{row['wilson95'][0]:.3f}, {row['wilson95'][1]:.3f}] {row['seconds']} s", flush=True)
                if out is not None:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(result, indent=1))
    return result


@contextlib.contextmanager
def progress_echo(total: int):
    """An ``echo`` for :func:`sweep` on the command line: it prints each run's line above a progress bar of
    ``total`` runs and advances the bar. (A bar inside :func:`sweep` would change the source
    :func:`code_version` fingerprints, and so stale every stored grid.)"""
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="runs", unit="run") as bar:
        def echo(*parts, **_):
            bar.write(" ".join(map(str, parts)))
            bar.update()
        yield echo


def across_seeds(runs: list[dict], key: str = "accuracy") -> dict:
    """``{(model, width): Estimate}``: each variant's mean ``key`` over its seeds with a Student-t 95% interval
    (:meth:`labsrc.claims.Estimate.mean`; ``n`` is the number of seeds). Two variants are ranked only where
    these intervals separate (:func:`labsrc.claims.compare`)."""
    from labsrc.claims import Estimate

    groups: dict = {}
    for r in runs:
        groups.setdefault((r["model"], r["d_model"]), []).append(r[key])
    return {k: Estimate.mean(v) for k, v in groups.items()}


def add_task_args(p: argparse.ArgumentParser, widths: Sequence[int], steps: int = 600) -> None:
    """The options every stored recall run shares (chapters 8 and 15), with one set of defaults."""
    p.add_argument("--widths", nargs="+", type=int, default=list(widths))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds (at least three)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--n-pairs", type=int, default=2, help="MQAR: pairs per sample")
    p.add_argument("--key-len", type=int, default=4, help="pass key: key symbols")
    p.add_argument("--context-len", type=int, default=72)
    p.add_argument("--n-train", type=int, default=1500)
    p.add_argument("--n-eval", type=int, default=150)
    p.add_argument("--max-seconds", type=float, default=None, help="wall-clock cap per run (not reproducible)")
    p.add_argument("--threads", type=int, default=1)


def make_data(task: str, args):
    """The task's data from the shared options: ``(data, task description for the stored file)``."""
    if task == "passkey":
        data = PassKeyData(args.key_len, args.context_len, args.n_train, args.n_eval)
        desc = {"name": "passkey (labsrc.recall.PassKeyData)", "key_len": args.key_len,
                "n_symbols": data.n_symbols, "n_filler": data.n_filler, "chance": data.chance}
    elif task == "mqar":
        data = MQARData(_tokenizer(), args.n_pairs, args.context_len, args.n_train, args.n_eval)
        desc = {"name": "mqar (labsrc.tasks.mqar_sample)", "n_pairs": args.n_pairs}
    else:
        raise ValueError(f"task must be one of {sorted(DATA)}, got {task!r}")
    return data, {**desc, "context_len": args.context_len, "n_train": args.n_train, "n_eval": args.n_eval,
                  "vocab": data.vocab}


def command_line(module: str, parser: argparse.ArgumentParser, args, omit_defaults=("out",)) -> str:
    """``python -m module`` with every option spelled out (defaults too), so the stored command reruns the same
    thing even if a default changes later; the options in ``omit_defaults`` are left out when at their default
    (the output path, which is a path on the machine that wrote it)."""
    words = ["python", "-m", module]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value is None or value is False:
            continue
        if action.dest in omit_defaults and value == action.default:
            continue
        words.append(action.option_strings[-1] if action.option_strings[-1].startswith("--")
                     else action.option_strings[0])
        if value is True:
            continue
        words += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return " ".join(shlex.quote(w) for w in words)


def stored_header(command: str, mixers, task: str, task_desc: dict, args, **train_extra) -> dict:
    """The head of a stored file: how to rerun it and which code made it."""
    return {"command": command, "code_version": code_version(mixers, task), "task": task_desc,
            "train": {"steps": args.steps, "batch": args.batch, "widths": list(args.widths),
                      "seeds": list(args.seeds), "threads": args.threads, "max_seconds": args.max_seconds,
                      "torch": torch.__version__, **train_extra}}


GRID = {"softmax": ("softmax", "softmax"), "linear": ("linear", "linear"), "delta": ("delta", "delta"),
        "mamba2": ("mamba2", "mamba2"), "hybrid": ("linear", "softmax")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--models", nargs="+", default=list(GRID), choices=list(GRID))
    add_task_args(p, widths=(16, 32))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data, task = make_data("mqar", args)
    grid = {name: GRID[name] for name in args.models}
    header = stored_header(command_line("labsrc.recall", p, args), [m for ms in grid.values() for m in ms],
                           "mqar", task, args)
    with progress_echo(len(args.widths) * len(args.seeds) * len(grid)) as echo:
        sweep(grid, data, args.widths, args.seeds, args.steps, args.batch, args.max_seconds, header=header,
              out=args.out, echo=echo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
