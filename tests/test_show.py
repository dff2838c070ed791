import pytest

from labsrc.kernels import flash_attention, kv_cache
from labsrc.show import source_of


def test_a_kernel_shows_its_own_python_source():
    src, where = source_of(kv_cache._kv_store_kernel)  # a JITFunction
    assert src.lstrip().startswith("@triton.jit") and "def _kv_store_kernel(" in src
    assert where.startswith("labsrc/kernels/kv_cache.py, line ")
    line = int(where.rsplit(" ", 1)[1])
    assert open(kv_cache.__file__).read().splitlines()[line - 1].strip() == src.splitlines()[0].strip()


def test_an_autotuned_kernel_unwraps_to_its_function_and_can_be_cut():
    src, _ = source_of(flash_attention._flash_attention_kernel)
    assert "def _flash_attention_kernel(" in src
    part, where = source_of(flash_attention._flash_attention_kernel, start="def _flash_attention_kernel(", end=")")
    assert part.startswith("def _flash_attention_kernel(") and len(part) < len(src)
    with pytest.raises(ValueError, match="start='no such line'"):
        source_of(flash_attention._flash_attention_kernel, start="no such line")
    with pytest.raises(TypeError, match="cannot show the source"):
        source_of(3)


def test_a_decorated_method_shows_its_own_file_not_the_decorators():
    from labsrc import speculative as spec
    src, where = source_of(spec._SharedBody.score)     # wrapped by @torch.no_grad()
    assert where.startswith("labsrc/speculative/self_spec.py, line ") and "def score(self, feed)" in src
    line = int(where.rsplit(" ", 1)[1])
    assert open(spec.self_spec.__file__).read().splitlines()[line - 1].strip() == src.splitlines()[0].strip()
