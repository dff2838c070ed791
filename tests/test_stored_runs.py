"""Stored runs are the results of the checkpoints that ship (labsrc.models.stored_runs)."""
import json

import pytest

from labsrc.models import stored_runs
from labsrc.models.stored_runs import STORED, StoredRun, model_digest, models_stamp, stale


def test_every_stored_run_was_computed_with_the_shipped_checkpoints():
    found = stale()
    assert not found, "stale stored runs; recompute them in this order:\n" + "\n".join(
        f"  {run.command}    # {run.path}: {'; '.join(problems)}" for run, problems in found)


def test_every_stored_result_that_names_a_shipped_model_is_registered():
    # A result file that says which checkpoint made it ("models") must be listed, or nothing checks it.
    roots = [stored_runs.ROOT / "labsrc" / d for d in ("data", "models", "pipeline")]
    registered = {run.path for run in STORED}
    for root in roots:
        for path in root.rglob("*.json"):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and "models" in data:
                assert str(path.relative_to(stored_runs.ROOT)) in registered, f"{path} is not in STORED"


def test_a_run_of_another_checkpoint_is_named_with_its_command(tmp_path, monkeypatch):
    (tmp_path / "w.safetensors").write_bytes(b"abc")
    digest = model_digest(tmp_path)
    (tmp_path / "w.safetensors").write_bytes(b"abd")
    assert model_digest(tmp_path) != digest
    monkeypatch.setattr(stored_runs, "ROOT", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"models": {str(tmp_path): digest}}))
    run = StoredRun("r.json", (str(tmp_path),), "a test", "python -m recompute")
    assert stale((run,)) == [(run, [f"it was computed with another {tmp_path} ({digest}, shipped "
                                     f"{model_digest(tmp_path)})"])]
    (tmp_path / "r.json").write_text(json.dumps({"models": models_stamp(str(tmp_path))}))
    assert stale((run,)) == []
    (tmp_path / "r.json").write_text(json.dumps({}))
    assert stale((run,))[0][1] == [f"it records no digest of {tmp_path}"]
    assert StoredRun("gone.json", ("x",), "", "").problems() == ["gone.json is missing"]
    with pytest.raises(FileNotFoundError):
        model_digest(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="at least one"):
        models_stamp()
