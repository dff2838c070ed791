"""The results the lab stores that were computed with its shipped checkpoints, and whether each still is.

A chapter that plots a stored run (chapter 12's weight-quantization table, chapter 14's memory comparison,
chapter 13's distillation table, the early-exit head of chapters 10 and 11, ...) is only right while the
checkpoints that run used are the ones that ship. So every such file records the digest of each checkpoint
it was computed with, under ``"models"`` (written by :func:`models_stamp` when the run saves), and
:data:`STORED` lists the files with the command that recomputes each. When a checkpoint is retrained, the
test suite (``tests/test_stored_runs.py``) and ::

    python -m labsrc.models.stored_runs          # exit 1 and list the stale runs with their commands

name every run to recompute, in the order given here (a later run may use an earlier one's output).
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def model_digest(name_or_path) -> str:
    """First 16 hex digits of a SHA-256 over a checkpoint's weight files (``*.safetensors``, sorted by name):
    a shipped model's name (``"lab-target"``) or a checkpoint folder."""
    from labsrc.models.train import CHECKPOINTS

    folder = Path(name_or_path)
    if not folder.is_dir():
        folder = CHECKPOINTS / str(name_or_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def models_stamp(*names: str) -> dict[str, str]:
    """``{name: model_digest(name)}`` for the shipped checkpoints a run used: store it as the run's
    ``"models"`` field."""
    if not names:
        raise ValueError("name at least one checkpoint the run used")
    return {name: model_digest(name) for name in names}


@dataclass(frozen=True)
class StoredRun:
    """One stored result: the JSON file that holds it (repository-relative), the checkpoints it was computed
    with, what uses it, and the command that recomputes it."""

    path: str
    models: tuple[str, ...]
    used_by: str
    command: str

    def recorded(self) -> dict:
        """The digests the file says it was computed with (``{}`` if it records none)."""
        return json.loads((ROOT / self.path).read_text(encoding="utf-8")).get("models", {})

    def problems(self) -> list[str]:
        """Why this run is not the result of the checkpoints that ship now (empty when it is)."""
        if not (ROOT / self.path).is_file():
            return [f"{self.path} is missing"]
        recorded, out = self.recorded(), []
        for name in self.models:
            if name not in recorded:
                out.append(f"it records no digest of {name}")
            elif recorded[name] != (shipped := model_digest(name)):
                out.append(f"it was computed with another {name} ({recorded[name]}, shipped {shipped})")
        return out


# In the order to recompute them: the early-exit head and the distilled draft before the runs that use them.
STORED: tuple[StoredRun, ...] = (
    StoredRun("labsrc/models/early_exit/lab-target-L3.json", ("lab-target",), "chapters 10 and 11",
              "python -m labsrc.speculative train-early-exit --steps 160"),
    StoredRun("labsrc/data/distill_results.json", ("lab-target", "lab-draft"), "chapter 13",
              "python -m labsrc.distill experiment --save-dir /tmp/students && "
              "python -m labsrc.distill drafts --students /tmp/students"),
    StoredRun("labsrc/data/results/distill_finetune.json", ("lab-target", "lab-draft"), "chapter 13",
              "python -m labsrc.distill finetune-experiment --steps 300 --seeds 0 1 2 --threads 1"),
    StoredRun("labsrc/models/checkpoints/lab-draft-distilled/eval_card.json", ("lab-target", "lab-draft"),
              "chapter 13", "python -m labsrc.distill ship-finetuned --method gkd --seed 1 --overwrite"),
    StoredRun("labsrc/data/results/weight_quant.json", ("lab-target",), "chapter 12",
              "python -m labsrc.weight_quant --eval-windows 16 --probe-n 100 --probes needle variable_tracking "
              "--calib-windows 8 --qat-steps 80"),
    StoredRun("labsrc/data/results/memory_comparison_cpu.json", ("lab-target",), "chapter 14",
              "python -m labsrc.memory --profile cpu"),
    StoredRun("labsrc/pipeline/results/cpu.json", ("lab-target",), "chapter 11",
              "python -m labsrc.pipeline.experiment"),
    StoredRun("labsrc/data/results/evict_curve.json", ("lab-target",), "chapter 6",
              "python -m labsrc.sweeps.evict --n 100 --probes passkey --kept 0.1 0.3 0.5 0.7 0.9 "
              "--policies fifo lru h2o streamingllm scissorhands value_aware --model lab-target --threads 1"),
    StoredRun("labsrc/data/results/paged_evict_curve.json", ("lab-target",), "chapter 9",
              "python -m labsrc.sweeps.paged_evict --n 100 --probes passkey needle --kept 0.1 0.3 0.5 0.7 0.9 "
              "--policies value attention recency random --model lab-target --threads 1"),
    StoredRun("labsrc/data/results/rope_curve.json", ("lab-target",), "chapter 4",
              "python -m labsrc.sweeps.rope --n 100 --probes passkey --multiples 1 1.5 2 4 "
              "--methods default linear ntk dynamic yarn --windows 8 --model lab-target --threads 1"),
    StoredRun("labsrc/data/results/kvquant_curve.json", ("lab-target",), "chapter 5",
              "python -m labsrc.sweeps.kvquant --n 100 --probes needle variable_tracking passkey --bits 2 3 4 "
              "--configs per_token per_token_norm kivi kivi_norm group128 kvarn128 --model lab-target "
              "--threads 1"),
)


def stale(runs: tuple[StoredRun, ...] = STORED) -> list[tuple[StoredRun, list[str]]]:
    """The runs whose recorded checkpoints are not the shipped ones, each with the reasons."""
    return [(run, problems) for run in runs if (problems := run.problems())]


def main(argv: list[str] | None = None) -> int:
    found = stale()
    for run, problems in found:
        print(f"{run.path} ({run.used_by}): {'; '.join(problems)}\n    recompute: {run.command}")
    if not found:
        print(f"all {len(STORED)} stored runs were computed with the shipped checkpoints")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
