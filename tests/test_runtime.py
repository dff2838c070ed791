import os
import subprocess
import sys

import pytest
import torch

import labsrc
from labsrc import runtime


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LAB_PROFILE")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch is for machines without a GPU")
def test_importing_labsrc_sets_the_interpreter_before_triton_loads():
    out = run_python("import labsrc, os, sys, triton; print(os.environ['TRITON_INTERPRET'], labsrc.INTERPRETED)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]


def test_profile_follows_the_environment_variable():
    out = run_python("import labsrc; print(labsrc.PROFILE, labsrc.sizes('kv_cache') == labsrc.sizes('kv_cache', 'gpu'))",
                     LAB_PROFILE="gpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gpu", "True"]


def test_bad_profile_is_a_clear_error():
    out = run_python("import labsrc", LAB_PROFILE="tpu")
    assert out.returncode != 0
    assert "LAB_PROFILE must be one of" in out.stderr


def test_sizes_are_per_chapter_and_profile():
    cpu, gpu = runtime.sizes("kv_cache", "cpu"), runtime.sizes("kv_cache", "gpu")
    assert vars(cpu).keys() == vars(gpu).keys(), "both profiles must define the same sizes"
    for chapter, table in runtime.SIZES.items():
        assert set(table) == {"cpu", "gpu"}, chapter
        assert table["cpu"].keys() == table["gpu"].keys(), chapter
    with pytest.raises(KeyError, match="known chapters"):
        runtime.sizes("no_such_chapter")
    with pytest.raises(ValueError, match="profile must be one of"):
        runtime.sizes("kv_cache", "tpu")


def test_seed_everything_makes_runs_repeat():
    g = labsrc.seed_everything(7)
    a = (torch.rand(3), torch.rand(2, generator=g))
    g = labsrc.seed_everything(7)
    b = (torch.rand(3), torch.rand(2, generator=g))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="seed"):
        labsrc.seed_everything(-1)


def test_stamp_names_device_profile_kernels_and_versions(capsys):
    info = labsrc.stamp()
    printed = capsys.readouterr().out
    for key in ("device", "profile", "kernels", "torch threads", "torch", "triton", "transformers"):
        assert key in info and key in printed
    assert info["torch"] == torch.__version__
    assert ("interpreted" in info["kernels"]) == runtime.INTERPRETED


@pytest.mark.skipif(torch.cuda.is_available(), reason="the thread setting is for the CPU profile")
def test_cpu_profile_uses_one_thread_unless_told_otherwise():
    out = run_python("import labsrc, torch; print(torch.get_num_threads())")
    assert out.stdout.split() == ["1"], out.stderr
    out = run_python("import labsrc, torch; print(torch.get_num_threads())", LAB_TORCH_THREADS="2")
    assert out.stdout.split() == ["2"], out.stderr
    out = run_python("import labsrc", LAB_TORCH_THREADS="many")
    assert "LAB_TORCH_THREADS must be a positive integer" in out.stderr


def test_known_library_noise_is_dropped_and_nothing_else():
    import logging

    from labsrc.runtime import _KnownLibraryNoise

    noise = _KnownLibraryNoise()

    def record(name, msg):
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None)

    assert not noise.filter(record("torchao", "Failed to load /x/_C_mxfp8.so: Could not load this library: /x"))
    assert not noise.filter(record("torch.utils._pytree", "<enum 'K'> is an Enum subclass and is now natively "
                                                         "supported by torch.compile as an opaque value type."))
    assert noise.filter(record("torchao", "Failed to load /x.so: undefined symbol foo")), "other failures pass"
    assert noise.filter(record("torchao", "something else"))
    assert noise.filter(record("torch.utils._pytree", "another warning"))


def test_importing_torchao_after_labsrc_prints_nothing():
    import subprocess
    import sys

    pytest.importorskip("torchao")
    out = subprocess.run([sys.executable, "-c", "import labsrc, torchao, torchao.prototype.mx_formats"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Failed to load" not in out.stderr and "Enum subclass" not in out.stderr, out.stderr
