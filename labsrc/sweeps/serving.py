"""Chapter 9's stored curve: block-eviction policies in the paged engine against the share of blocks kept.

    python -m labsrc.sweeps.serving             # the stored run: labsrc/data/results/paged_evict_curve.json
    python -m labsrc.sweeps.serving --n 4 --out /tmp/paged.json --kept 0.3   # a small one

Each policy of :meth:`labsrc.serving.engine.Engine.evict_blocks` (value-aware block scores, attention alone,
recency: the first and the newest blocks, random blocks) keeps a share ``x`` of a prompt's blocks of 16 tokens
(from 10% to 90%: as many blocks as come closest to chapter 6's token budget for ``x``,
:func:`labsrc.serving.experiments.blocks_to_keep`), dropped once after the prefill, while ``lab-target`` answers
the same ``n`` probe samples per probe at 90% of its trained context (:func:`labsrc.tasks.probe_samples`, seed
0: chapter 6's samples). Greedy decoding through the engine must reproduce the answer exactly
(:func:`labsrc.serving.experiments.paged_eviction_matches`); the full cache is the baseline. Set beside chapter
6's curve (``evict_curve.json``, token-level policies on the same samples) it says what dropping whole pages
costs against choosing tokens one by one at the same budget.
"""
from __future__ import annotations

import functools
import time


from labsrc import curves, kv_eviction as ev, tasks
from labsrc.models import context_len
from labsrc.models.stored_runs import models_stamp
from labsrc.sweeps import cli
from labsrc.serving import blocks as serving_blocks, engine as serving_engine, experiments as X

POLICIES = ("value", "attention", "recency", "random")
KEPT = (0.1, 0.3, 0.5, 0.7, 0.9)
PROBES = ("passkey", "needle")
N = 100
BLOCK_SIZE = 16   # the source's (and vLLM's) default block
PATH = curves.RESULTS / "paged_evict_curve.json"


class Scorer:
    """Scores one point of the curve: a block policy at a kept share on the first ``m`` samples of a probe."""

    def __init__(self, model, tokenizer, n: int = N, seed: int = 0, block_size: int = BLOCK_SIZE):
        self.model, self.tokenizer, self.n, self.seed = model, tokenizer, n, seed
        self.block_size = block_size
        self.context_len = context_len(model)
        self._prefilled = {}

    @functools.cache
    def samples(self, probe: str) -> list:
        return tasks.probe_samples(probe, self.tokenizer, self.context_len, self.n, self.seed)

    def prefilled(self, probe: str, m: int | None = None) -> list:
        """The first ``m`` samples' prefilled engines, each prefilled once and kept: every policy and budget
        drops blocks from a copy of the same prefill (:func:`labsrc.serving.experiments.evict_and_answer`)."""
        samples = self.samples(probe)[:m]
        for j, s in enumerate(samples):
            if (probe, j) not in self._prefilled:
                self._prefilled[probe, j] = X.prefill_for_eviction(self.model, s, self.block_size,
                                                                   tokenizer=self.tokenizer)
        return [self._prefilled[probe, j] for j in range(len(samples))]

    def __call__(self, method: str, kept: float, probe: str, m: int | None = None) -> list[bool]:
        if not 0.0 < kept < 1.0:
            raise ValueError(f"kept must lie in (0, 1), got {kept!r}")
        if method not in serving_engine.BLOCK_POLICIES:
            raise ValueError(f"method must be one of {serving_engine.BLOCK_POLICIES}, got {method!r}")
        return X.paged_eviction_matches(self.model, self.samples(probe)[:m], method, kept,
                                        prefilled=self.prefilled(probe, m))

    def baseline(self, probe: str) -> list[bool]:
        return X.paged_eviction_matches(self.model, self.samples(probe), None, None,
                                        prefilled=self.prefilled(probe))

    def kept_tokens(self, probe: str, kept: float) -> list[int]:
        """Tokens of each sample's prompt the blocks kept at share ``kept`` hold (the equal-budget check)."""
        out = []
        for s in self.samples(probe):
            n, bs = len(s.prompt_ids), self.block_size
            k = X.blocks_to_keep(n, kept, bs)
            out.append((k - 1) * bs + (n - (-(-n // bs) - 1) * bs))
        return out


def scoring_code() -> list:
    """Everything whose source decides a point's result (the samples are pinned by their own digest)."""
    E = serving_engine.Engine
    return [X.paged_eviction_matches, X.prefill_for_eviction, X.evict_and_answer, X.blocks_to_keep,
            ev.budget_for, E.evict_blocks, E.block_scores, ev.value_aware_scores, ev.recency,
            serving_blocks.BlockManager.drop_blocks, serving_engine.paged_attention_forward, Scorer]


def header(scorer: Scorer, model_name: str, probes, command: str) -> dict:
    """What the stored curve depends on; a test recomputes it to tell a stale file."""
    return {"command": command, "model": model_name, "models": models_stamp(model_name),
            "code_version": curves.source_version(*scoring_code()), "context_len": scorer.context_len,
            "block_size": scorer.block_size, "n": scorer.n,
            "samples_digest": {p: curves.samples_digest(scorer.samples(p)) for p in probes}}


def main(argv=None) -> dict:
    parser = cli.parser("Chapter 9's stored curve: block-eviction policies in the paged engine against the "
                        "share of blocks kept.", n=N, probes=PROBES, out=PATH)
    parser.add_argument("--kept", nargs="+", type=float, default=list(KEPT))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=serving_engine.BLOCK_POLICIES)
    args = parser.parse_args(argv)
    model, tok = cli.load_model(args.model, args.threads)
    scorer = Scorer(model, tok, args.n)
    command = (f"python -m labsrc.sweeps.serving --n {args.n} --probes {' '.join(args.probes)} --kept "
               f"{' '.join(map(str, args.kept))} --policies {' '.join(args.policies)} {cli.tail(args, PATH)}")
    t0 = time.perf_counter()
    result = curves.sweep(scorer, args.policies, args.kept, args.probes,
                          header(scorer, args.model, args.probes, command), out=args.out,
                          overwrite=args.overwrite, baseline=scorer.baseline)
    return cli.finish(result, args.out, args.threads, t0)


if __name__ == "__main__":
    main()
