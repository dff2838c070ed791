"""Chapter 6's stored curve: every eviction policy against the share of the KV cache it may keep.

    python -m labsrc.sweeps.kv_eviction                  # the stored run: labsrc/data/results/evict_curve.json
    python -m labsrc.sweeps.kv_eviction --n 8 --out /tmp/evict.json --kept 0.2 0.5   # a small one

Each policy keeps a fraction ``x`` of the prompt's entries (from 10% to 90%: the budget of
:func:`labsrc.kv_eviction.budget_for` with ``evict_rate = 1 - x``) while ``lab-target`` reads the same ``n`` probe
samples per probe, at 90% of its trained context (:func:`labsrc.tasks.probe_samples`, seed 0), and greedy
decoding through :class:`labsrc.kv_eviction.EvictingCache` must reproduce the answer exactly
(:func:`labsrc.kv_eviction.answer_matches`). The full cache is the baseline. Small budgets are where policies differ;
near 90% every sensible policy keeps what the probe needs, so the curve shows both.
"""
from __future__ import annotations

import functools
import time


from labsrc import curves, kv_eviction as ev, tasks
from labsrc.models import context_len
from labsrc.models.stored_runs import models_stamp
from labsrc.sweeps import cli

POLICIES = ("fifo", "lru", "h2o", "streamingllm", "scissorhands", "value_aware")
KEPT = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
PROBES = ("passkey", "needle")
N = 100
PATH = curves.RESULTS / "evict_curve.json"


class Scorer:
    """Scores one point of the curve: a policy at a kept share on the first ``m`` samples of a probe."""

    def __init__(self, model, tokenizer, n: int = N, seed: int = 0):
        self.model, self.tokenizer, self.n, self.seed = model, tokenizer, n, seed
        self.context_len = context_len(model)

    @functools.cache
    def samples(self, probe: str) -> list:
        return tasks.probe_samples(probe, self.tokenizer, self.context_len, self.n, self.seed)

    def __call__(self, method: str, kept: float, probe: str, m: int | None = None) -> list[bool]:
        if not 0.0 < kept < 1.0:
            raise ValueError(f"kept must lie in (0, 1), got {kept!r}")
        samples = self.samples(probe)[:m]
        return ev.answer_matches(self.model, samples, ev.make_policy(method), 1.0 - kept)

    def baseline(self, probe: str) -> list[bool]:
        return ev.answer_matches(self.model, self.samples(probe), None, None)


def scoring_code() -> list:
    """Everything whose source decides a point's result (the samples are pinned by their own digest)."""
    policies = list(dict.fromkeys(ev.POLICIES.values()))
    return [ev.answer_matches, ev.generate_evicting, ev.budget_for, ev.EvictingCache, ev.EvictingLayer,
            ev.TokenStats, ev.EvictionPolicy, *policies, ev.recency, ev.value_aware_scores,
            ev.inclusion_probabilities, ev.systematic_indices, ev.stochastic_keep, ev.bernoulli_keep,
            ev.topk_keep, ev._recent_mask, Scorer]


def header(scorer: Scorer, model_name: str, probes, command: str) -> dict:
    """What the stored curve depends on; a test recomputes it to tell a stale file."""
    return {"command": command, "model": model_name, "models": models_stamp(model_name),
            "code_version": curves.source_version(*scoring_code()), "context_len": scorer.context_len,
            "n": scorer.n, "samples_digest": {p: curves.samples_digest(scorer.samples(p)) for p in probes}}


def main(argv=None) -> dict:
    parser = cli.parser("Chapter 6's stored curve: eviction policies against the share of the KV cache kept.",
                        n=N, probes=PROBES, out=PATH)
    parser.add_argument("--kept", nargs="+", type=float, default=list(KEPT))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=sorted(ev.POLICIES))
    args = parser.parse_args(argv)
    model, tok = cli.load_model(args.model, args.threads)
    scorer = Scorer(model, tok, args.n)
    command = (f"python -m labsrc.sweeps.kv_eviction --n {args.n} --probes {' '.join(args.probes)} --kept "
               f"{' '.join(map(str, args.kept))} --policies {' '.join(args.policies)} {cli.tail(args, PATH)}")
    t0 = time.perf_counter()
    result = curves.sweep(scorer, args.policies, args.kept, args.probes,
                          header(scorer, args.model, args.probes, command), out=args.out,
                          overwrite=args.overwrite, baseline=scorer.baseline)
    return cli.finish(result, args.out, args.threads, t0)


if __name__ == "__main__":
    main()
