"""The three descriptions of one environment (pyproject.toml, environment.yml, binder/) say the same thing."""
from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPS = PYPROJECT["project"]["dependencies"]


def _spec(requirements, name):
    """The version specifier of ``name`` in a list of requirement strings (markers and comments dropped)."""
    for req in requirements:
        m = re.match(rf"\s*{re.escape(name)}\s*([<>=!~][^;#]*)?(;.*)?$", req)
        if m:
            return (m.group(1) or "").replace(" ", "")
    raise AssertionError(f"{name} is not listed in {requirements}")


def test_environment_yml_installs_the_project_and_its_torch_range():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "pytorch" not in env["channels"], "the pytorch channel stopped at torch 2.5, older than triton 3.2 needs"
    deps = env["dependencies"]
    conda = [d for d in deps if isinstance(d, str)]
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert any(d.startswith("python") for d in conda) and "pip" in conda
    assert "c-compiler" in conda, "Triton compiles kernels with a C compiler at run time"
    assert not any(re.match(r"(pytorch|triton)\b", d) for d in conda), "torch and triton come from pip, together"
    assert _spec(pip, "torch") == _spec(DEPS, "torch")
    assert "-e .[dev,book]" in pip, "every other package comes from pyproject.toml, so the lists cannot drift"
    assert len(pip) == 2, f"environment.yml lists packages of its own: {pip}"


def test_binder_pins_python_and_the_cpu_torch():
    lines = [ln.strip() for ln in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert _spec(lines, "torch") == _spec(DEPS, "torch")
    assert any(ln.startswith("-e .") for ln in lines)
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    major, minor = map(int, re.fullmatch(r"python-(\d+)\.(\d+)", runtime).groups())
    low = tuple(map(int, re.search(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"]).groups()))
    assert (major, minor) >= low


def test_the_torch_range_holds_the_installed_build():
    import torch
    from packaging.specifiers import SpecifierSet

    version = torch.__version__.split("+")[0]
    assert version in SpecifierSet(_spec(DEPS, "torch")), f"torch {version} is outside pyproject's range"


@pytest.mark.skipif(not any(shutil.which(s) for s in ("mamba", "micromamba", "conda")),
                    reason="no conda solver on this machine; the file's package list is checked above")
def test_environment_yml_solves():
    solver = next(s for s in ("mamba", "micromamba", "conda") if shutil.which(s))
    out = subprocess.run([solver, "env", "create", "--dry-run", "-n", "lclab-check", "-f",
                          str(ROOT / "environment.yml")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_changing_torch_spec_reinstalls_torch(tmp_path):
    """The venv remembers the TORCH_SPEC it was built with; only a new spec reinstalls torch."""
    log = tmp_path / "pip.log"
    fake = tmp_path / "venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)

    def setup(spec):
        before = log.read_text() if log.exists() else ""
        out = subprocess.run(["make", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", f"PY={fake}",
                              f"TORCH_SPEC={spec}", str(tmp_path / "venv" / ".ready")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return log.read_text()[len(before):] if log.exists() else ""

    first = setup("torch==2.13.0")
    assert "--force-reinstall --no-deps torch==2.13.0" in first and "install -q -e .[dev,book]" in first
    assert setup("torch==2.13.0") == "", "the same spec again installs nothing"
    assert "--force-reinstall --no-deps torch" in setup("torch"), "a new spec reinstalls torch"


def test_set_up_pages_describe_this_environment():
    """book/how_to_run.md and the README say what set-up needs: the conda channels environment.yml really uses
    (not the pytorch/nvidia channels of old), python3-venv on Debian and Ubuntu, and how to get the CPU torch on
    Linux through the Makefile's TORCH_SPEC, with a torch inside pyproject.toml's range."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    how_to = (ROOT / "book" / "how_to_run.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for channel in env["channels"]:
        assert f"`{channel}`" in how_to, f"how_to_run.md does not name the {channel} channel"
    assert "`nvidia`" not in how_to and "from the `pytorch`" not in how_to, "channels environment.yml does not use"
    assert "TORCH_SPEC" in (ROOT / "Makefile").read_text()
    lower, upper = re.match(r">=([\d.]+),<([\d.]+)", _spec(DEPS, "torch")).groups()
    for page in (how_to, readme):
        assert "python3-venv" in page
        m = re.search(r"PIP_EXTRA_INDEX_URL=https://download\.pytorch\.org/whl/cpu\s*\\?\s*make book "
                      r"TORCH_SPEC=torch==([\d.]+)\+cpu", page)
        assert m, "the CPU build of torch on Linux, through TORCH_SPEC"
        version = tuple(int(x) for x in m.group(1).split("."))
        assert tuple(int(x) for x in lower.split(".")) <= version < tuple(int(x) for x in upper.split("."))
        assert "three times" in page, "make test takes about three times make book"
