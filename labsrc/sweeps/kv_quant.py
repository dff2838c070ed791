"""Chapter 5's stored curve: probe accuracy of every quantized KV cache against its bit width.

    python -m labsrc.sweeps.kv_quant                 # the stored run: labsrc/data/results/kvquant_curve.json
    python -m labsrc.sweeps.kv_quant --n 10 --out /tmp/kvq.json --bits 2 --configs per_token kvarn128   # small

Each configuration of chapter 5's ladder (:data:`CONFIGS`: per token, KIVI and a group of 128 tokens, each
without and with KVarN's per-channel normalisation) stores the cache at 2, 3 and 4 bits while ``lab-target``
reads the same ``n`` probe samples per probe, at 90% of its trained context (:func:`labsrc.tasks.probe_samples`,
seed 0): the needle with 3 distractors and two-hop variable tracking, which the unquantized model passes about
half the time (so a cache can cost accuracy there, and it shows), and the pass key, which it nearly always
passes. A sample counts when the arg-max of one teacher-forced forward pass reproduces every answer token,
which is what greedy decoding would produce, the way the chapter scores its probes (:func:`answer_right`); the
prompt and the answer both go through the quantized cache. The unquantized model is the baseline.

KVarN's statistics are calibrated on :data:`CALIB_WINDOWS` windows of :data:`CALIB_LEN` tokens of the training
split, as chapter 5's CPU profile does (:func:`calibration_stats`). INT3 runs on the PyTorch path of
:mod:`labsrc.kv_quant` (the Triton kernels read 2, 4 and 8 bits), as every configuration here does: the cache
simulates the stored codes and the attention reads their dequantized values.
"""
from __future__ import annotations

import functools
import hashlib
import time

import torch

from labsrc import curves, kv_quant as kq, tasks
from labsrc.kv_quant import KVarNCache
from labsrc.models import context_len
from labsrc.models.stored_runs import models_stamp
from labsrc.sweeps import cli

BITS = (2, 3, 4)
PROBES = ("needle", "variable_tracking", "passkey")
N = 100
BATCH = 10          # samples per forward pass; a live slice of a multiple of it repeats the stored batches
CALIB_WINDOWS = 4   # chapter 5's CPU profile: 4 training windows of 512 tokens
CALIB_LEN = 512
PATH = curves.RESULTS / "kvquant_curve.json"

CONFIGS = ("per_token", "per_token_norm", "kivi", "kivi_norm", "group128", "kvarn128")
LABELS = {"per_token": "per token", "per_token_norm": "per token + norm.", "kivi": "KIVI",
          "kivi_norm": "KIVI + norm.", "group128": "group g=128", "kvarn128": "KVarN g=128 (group + norm.)"}
# Each configuration without normalisation, and the same with it: the pairs the chapter's question is about.
NORM_PAIRS = (("per_token", "per_token_norm"), ("kivi", "kivi_norm"), ("group128", "kvarn128"))


def make_cache(config: str, model_config, stats, bits: int) -> KVarNCache:
    """A fresh cache of one of chapter 5's configurations (:data:`CONFIGS`) at ``bits`` bits.

    KIVI keeps keys per channel and values per token in groups of 32, the last 32 tokens in full precision;
    the group configurations share one step per block of 128 tokens by all channels and, like the chapter's
    ladder, keep a trailing incomplete block (the last 921 mod 128 = 25 tokens of a probe) in full precision.
    ``_norm`` and ``kvarn128`` normalise every channel with the calibrated ``stats`` first."""
    cfg = model_config
    if config == "per_token":
        return KVarNCache.per_token(cfg, bits)
    if config == "per_token_norm":
        return KVarNCache(cfg, bits, 1, "token", "token", True, stats)
    if config == "kivi":
        return KVarNCache.kivi(cfg, bits, group_size=32, window=32)
    if config == "kivi_norm":
        return KVarNCache(cfg, bits, 32, "channel", "token", True, stats, 32)
    if config == "group128":
        return KVarNCache(cfg, bits, 128, "group", "group", False, None)
    if config == "kvarn128":
        return KVarNCache.kvarn(cfg, stats, bits, 128)
    raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")


def calibration_ids(tokenizer, n: int = CALIB_WINDOWS, length: int = CALIB_LEN) -> torch.Tensor:
    """``n`` non-overlapping training windows of ``length`` tokens (BOS + text): what KVarN is calibrated on."""
    ids = tasks.corpus_ids(tokenizer, "train")
    span = length - 1
    return torch.stack([torch.cat([torch.tensor([tokenizer.bos_token_id]), ids[i * span:(i + 1) * span]])
                        for i in range(n)])


def calibration_stats(model, tokenizer) -> list:
    """KVarN's per-layer channel statistics (:func:`labsrc.kvquant.calibrate`) on :func:`calibration_ids`."""
    return kq.calibrate(model, list(calibration_ids(tokenizer)))


@torch.no_grad()
def answer_right(model, samples, make_cache, batch: int = BATCH) -> list[bool]:
    """Per sample: whether the arg-max of one teacher-forced forward pass through ``make_cache()`` (a fresh
    cache per batch; None for the plain model) reproduces every token of every answer span. Samples of one
    probe have one length, so ``batch`` of them share a pass; quantization groups never mix sequences."""
    device = next(model.parameters()).device
    right = []
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        ids = torch.tensor([s.ids for s in chunk], device=device)
        cache = make_cache()
        kw = {} if cache is None else {"cache": cache, "use_cache": True}
        pred = model(input_ids=ids, **kw).logits.argmax(-1)
        right += [all(bool((pred[b, a - 1:e - 1] == ids[b, a:e]).all()) for a, e in s.spans)
                  for b, s in enumerate(chunk)]
    return right


class Scorer:
    """Scores one point of the curve: a configuration at a bit width on the first ``m`` samples of a probe."""

    def __init__(self, model, tokenizer, n: int = N, seed: int = 0):
        self.model, self.tokenizer, self.n, self.seed = model, tokenizer, n, seed
        self.context_len = context_len(model)
        self.stats = calibration_stats(model, tokenizer)

    @functools.cache
    def samples(self, probe: str) -> list:
        return tasks.probe_samples(probe, self.tokenizer, self.context_len, self.n, self.seed)

    def __call__(self, config: str, bits: int, probe: str, m: int | None = None) -> list[bool]:
        make_cache(config, self.model.config, self.stats, bits)   # a bad name or width fails before scoring
        return answer_right(self.model, self.samples(probe)[:m],
                            lambda: make_cache(config, self.model.config, self.stats, bits))

    def baseline(self, probe: str, m: int | None = None) -> list[bool]:
        return answer_right(self.model, self.samples(probe)[:m], lambda: None)


def scoring_code() -> list:
    """Everything whose source decides a point's result (the samples are pinned by their own digest)."""
    return [answer_right, make_cache, Scorer, context_len, calibration_ids, calibration_stats, kq.calibrate, kq.collect_kv,
            kq.KVarNCache, kq.KVarNLayer, kq.quantize, kq.QuantizedTensor, kq.ChannelStats, kq._resolve_stats,
            kq._scale_zero, kq.quantize_codes, kq.pack_codes, kq.unpack_codes, kq.pack_unit, kq.packed_width,
            kq._groups, kq._expand]


def calibration_digest(tokenizer) -> str:
    """First 16 hex digits of a SHA-256 over the calibration windows' token ids."""
    return hashlib.sha256(calibration_ids(tokenizer).numpy().tobytes()).hexdigest()[:16]


def header(scorer: Scorer, model_name: str, probes, command: str) -> dict:
    """What the stored curve depends on; a test recomputes it to tell a stale file."""
    return {"command": command, "model": model_name, "models": models_stamp(model_name),
            "code_version": curves.source_version(*scoring_code()),
            "context_len": scorer.context_len, "n": scorer.n, "batch": BATCH,
            "calibration": {"split": "train", "windows": CALIB_WINDOWS, "length": CALIB_LEN,
                            "digest": calibration_digest(scorer.tokenizer)},
            "samples_digest": {p: curves.samples_digest(scorer.samples(p)) for p in probes}}


def main(argv=None) -> dict:
    parser = cli.parser("Chapter 5's stored curve: quantized KV caches against bits.", n=N, probes=PROBES,
                        out=PATH)
    parser.add_argument("--bits", nargs="+", type=int, default=list(BITS), choices=kq.SUPPORTED_BITS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args(argv)
    model, tok = cli.load_model(args.model, args.threads)
    scorer = Scorer(model, tok, args.n)
    command = (f"python -m labsrc.sweeps.kv_quant --n {args.n} --probes {' '.join(args.probes)} --bits "
               f"{' '.join(map(str, args.bits))} --configs {' '.join(args.configs)} {cli.tail(args, PATH)}")
    t0 = time.perf_counter()
    result = curves.sweep(scorer, args.configs, args.bits, args.probes,
                          header(scorer, args.model, args.probes, command), out=args.out,
                          overwrite=args.overwrite, baseline=scorer.baseline)
    return cli.finish(result, args.out, args.threads, t0)


if __name__ == "__main__":
    main()
