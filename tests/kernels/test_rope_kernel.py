"""The Triton RoPE kernel against the PyTorch reference and transformers' apply_rotary_pos_emb.

Every kernel output is written into buffers prefilled with NaN, so an element the kernel forgets to write
fails the comparison. Shapes use odd lengths (1, 17, 129), head dims 32/64/80/128 (80: half of it, 40, is not
a power of two, so the tile is masked), GQA head counts and position offsets. The kernel uses no tl.dot, so
bf16 runs natively under the interpreter too (no upcasting needed in these tests).
"""
import zlib

import pytest
import torch

import labsrc  # noqa: F401  (interpreter switch before triton)
from labsrc import rope, runtime
from labsrc.exercises import tolerance
from labsrc.kernels.rope import apply_rope, apply_rope_ref
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = runtime.DEVICE

# (B, Hq, Hkv, T, D, positions kind, rope method)
SHAPES = [
    (1, 4, 4, 1, 32, "offset", "default"),       # a decode step far into the table
    (2, 6, 2, 17, 80, "random", "yarn"),          # GQA 3:1, non-power-of-two half dim, gathered positions
    (3, 8, 1, 17, 64, "none", "linear"),          # MQA
    (1, 5, 5, 129, 128, "offset", "llama3"),      # odd head count, prefill chunk after a cached prefix
    (2, 32, 8, 3, 128, "random", "ntk"),          # a wide GQA model: the head loop takes several tiles
]
TABLE_ROWS = 700


def tables(D, method, dtype=torch.float32):
    kw = {"default": {}, "linear": dict(factor=4.0), "ntk": dict(factor=4.0),
          "yarn": dict(factor=8.0, original_max_position=64),
          "llama3": dict(factor=8.0, original_max_position=128, low_freq_factor=1.0, high_freq_factor=4.0)}[method]
    inv, scale = rope.rope_frequencies(D, 10000.0, method, **kw)
    cos, sin = rope.rope_cos_sin(inv, TABLE_ROWS, scale, dtype=dtype)
    return cos.to(DEV), sin.to(DEV)


def make_positions(kind, B, T, gen):
    if kind == "none":
        return None
    if kind == "offset":
        return (torch.arange(T) + TABLE_ROWS - T).to(DEV)   # the last T rows of the table
    return torch.randint(0, TABLE_ROWS, (B, T), generator=gen).to(DEV)


def run_poisoned(q, k, cos, sin, positions):
    out_q = torch.full_like(q, float("nan"))
    out_k = torch.full_like(k, float("nan"))
    got_q, got_k = apply_rope(q, k, cos, sin, positions, out_q=out_q, out_k=out_k)
    assert got_q is out_q and got_k is out_k
    return got_q, got_k


def hf_in_float32(q, k, cos, sin, positions):
    """transformers' formula evaluated in float32 on the same (rounded) inputs, then rounded once."""
    T = q.shape[2]
    pos = torch.arange(T, device=q.device) if positions is None else positions
    pos = pos.expand(q.shape[0], T)
    qh, kh = apply_rotary_pos_emb(q.float(), k.float(), cos[pos].float(), sin[pos].float())
    return qh.to(q.dtype), kh.to(k.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-T{}-D{}-{}-{}".format(*s))
def test_kernel_matches_reference_and_transformers(shape, dtype):
    B, Hq, Hkv, T, D, kind, method = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr(shape).encode()))  # stable across processes
    q = torch.randn(B, Hq, T, D, generator=gen).to(DEV, dtype)
    k = torch.randn(B, Hkv, T, D, generator=gen).to(DEV, dtype)
    cos, sin = tables(D, method)
    positions = make_positions(kind, B, T, gen)
    got_q, got_k = run_poisoned(q, k, cos, sin, positions)
    rtol, atol = tolerance(dtype)
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin, positions)
    torch.testing.assert_close(got_q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_k, ref_k, rtol=rtol, atol=atol)
    hf_q, hf_k = hf_in_float32(q, k, cos, sin, positions)
    torch.testing.assert_close(got_q, hf_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_k, hf_k, rtol=rtol, atol=atol)


def test_float32_equals_transformers_native():
    """In float32 transformers computes in the input dtype too: the kernel agrees to fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 17, 64, generator=gen).to(DEV)
    k = torch.randn(2, 2, 17, 64, generator=gen).to(DEV)
    cos, sin = tables(64, "yarn")
    positions = torch.randint(0, TABLE_ROWS, (2, 17), generator=gen).to(DEV)
    got_q, got_k = run_poisoned(q, k, cos, sin, positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos[positions], sin[positions])
    torch.testing.assert_close(got_q, hf_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, hf_k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("table_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_tables_and_arbitrary_table_halves(table_dtype):
    """Tables in a different dtype from q, and tables whose two halves differ (the kernel must not assume
    cos[:D/2] == cos[D/2:], since apply_rotary_pos_emb does not)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 3, 17, 32, generator=gen).to(DEV)
    k = torch.randn(1, 1, 17, 32, generator=gen).to(DEV)
    cos = torch.randn(40, 32, generator=gen).to(DEV, table_dtype)
    sin = torch.randn(40, 32, generator=gen).to(DEV, table_dtype)
    positions = torch.randint(0, 40, (17,), generator=gen).to(DEV)
    got_q, got_k = run_poisoned(q, k, cos, sin, positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos[positions[None]].float(), sin[positions[None]].float())
    torch.testing.assert_close(got_q, hf_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, hf_k, rtol=1e-5, atol=1e-5)


def test_default_outputs_are_new_tensors_and_inputs_untouched():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 17, 64, generator=gen).to(DEV)
    k = torch.randn(1, 2, 17, 64, generator=gen).to(DEV)
    q0, k0 = q.clone(), k.clone()
    cos, sin = tables(64, "default")
    got_q, got_k = apply_rope(q, k, cos, sin)
    assert got_q.data_ptr() != q.data_ptr() and got_k.data_ptr() != k.data_ptr()
    assert torch.equal(q, q0) and torch.equal(k, k0)
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-6)


def test_in_place_and_strided_inputs():
    """q/k as (B, T, H, D) buffers viewed as (B, H, T, D) (no copy), rotated in place via out_q=q."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 17, 6, 80, generator=gen).to(DEV, torch.float16).transpose(1, 2)
    k = torch.randn(2, 17, 2, 80, generator=gen).to(DEV, torch.float16).transpose(1, 2)
    assert not q.is_contiguous()
    cos, sin = tables(80, "yarn")
    positions = (torch.arange(17) + 300).to(DEV)
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin, positions)
    got_q, got_k = apply_rope(q, k, cos, sin, positions, out_q=q, out_k=k)
    assert got_q is q and got_k is k
    rtol, atol = tolerance(torch.float16)
    torch.testing.assert_close(q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(k, ref_k, rtol=rtol, atol=atol)


def test_decode_step_equals_the_matching_row_of_a_prefill():
    """Rotating token 37 alone at position 37 gives the same as row 37 of a full prefill."""
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 129, 64, generator=gen).to(DEV)
    k = torch.randn(1, 2, 129, 64, generator=gen).to(DEV)
    cos, sin = tables(64, "default")
    full_q, full_k = run_poisoned(q, k, cos, sin, None)
    step_q, step_k = run_poisoned(q[:, :, 37:38], k[:, :, 37:38], cos, sin, torch.tensor([37], device=DEV))
    torch.testing.assert_close(step_q, full_q[:, :, 37:38], rtol=0, atol=0)
    torch.testing.assert_close(step_k, full_k[:, :, 37:38], rtol=0, atol=0)


def test_unchecked_positions_give_the_same_result():
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(2, 4, 17, 32, generator=gen).to(DEV)
    k = torch.randn(2, 2, 17, 32, generator=gen).to(DEV)
    cos, sin = tables(32, "default")
    positions = torch.randint(0, TABLE_ROWS, (2, 17), generator=gen).to(DEV)
    checked = run_poisoned(q, k, cos, sin, positions)
    unchecked = apply_rope(q, k, cos, sin, positions, out_q=torch.full_like(q, float("nan")),
                           out_k=torch.full_like(k, float("nan")), check_positions=False)
    assert torch.equal(checked[0], unchecked[0]) and torch.equal(checked[1], unchecked[1])


def test_empty_sequence():
    q = torch.empty(2, 4, 0, 32, device=DEV)
    k = torch.empty(2, 2, 0, 32, device=DEV)
    cos, sin = tables(32, "default")
    got_q, got_k = apply_rope(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape


# ------------------------------------------------------------------------------------------------ errors

def _args(**overrides):
    gen = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(2, 4, 5, 32, generator=gen), k=torch.randn(2, 2, 5, 32, generator=gen),
                cos=torch.randn(16, 32, generator=gen), sin=torch.randn(16, 32, generator=gen), positions=None)
    args.update(overrides)
    return args


ERRORS = [
    (TypeError, "q must be a torch.Tensor, got list", dict(q=[1.0])),
    (TypeError, "positions must be a torch.Tensor, got list", dict(positions=[0, 1, 2, 3, 4])),
    (ValueError, r"q must be 4-D \(B, Hq, T, D\), got shape \(4, 5, 32\)", dict(q=torch.randn(4, 5, 32))),
    (ValueError, r"k must be 4-D \(B, Hkv, T, D\)", dict(k=torch.randn(2, 5, 32))),
    (ValueError, r"k \(2, 2, 6, 32\) must share B, T and D with q", dict(k=torch.randn(2, 2, 6, 32))),
    (ValueError, "head dim D of q and k must be even", dict(q=torch.randn(2, 4, 5, 31), k=torch.randn(2, 2, 5, 31))),
    (TypeError, "q must be float32, float16 or bfloat16, got torch.float64",
     dict(q=torch.randn(2, 4, 5, 32, dtype=torch.float64), k=torch.randn(2, 2, 5, 32, dtype=torch.float64))),
    (TypeError, "k has dtype torch.float16 but q has torch.float32", dict(k=torch.randn(2, 2, 5, 32).half())),
    (ValueError, r"cos must be a table \(max_pos, D=32\), got shape \(16, 16\)", dict(cos=torch.randn(16, 16))),
    (TypeError, "sin must be float32, float16 or bfloat16, got torch.int64",
     dict(sin=torch.zeros(16, 32, dtype=torch.int64))),
    (ValueError, "cos must have a contiguous last dimension", dict(cos=torch.randn(32, 16).t())),
    (ValueError, r"sin \(17, 32\) and cos \(16, 32\) must have the same shape", dict(sin=torch.randn(17, 32))),
    (TypeError, "sin has dtype torch.float16 but cos has torch.float32", dict(sin=torch.randn(16, 32).half())),
    (ValueError, "q must have a contiguous last dimension", dict(q=torch.randn(2, 4, 32, 5).transpose(2, 3))),
    (ValueError, "k is on meta but q is on cpu", dict(k=torch.randn(2, 2, 5, 32, device="meta"))),
    (TypeError, "positions must be int32 or int64, got torch.float32", dict(positions=torch.arange(5.0))),
    (ValueError, r"positions must have shape \(T,\) = \(5,\) or \(B, T\) = \(2, 5\), got \(3, 5\)",
     dict(positions=torch.zeros(3, 5, dtype=torch.long))),
    (ValueError, r"positions must lie in \[0, 16\) .* got values in \[12, 16\]", dict(positions=torch.arange(5) + 12)),
    (ValueError, r"positions must lie in \[0, 16\) .* got values in \[-1, 3\]", dict(positions=torch.arange(5) - 1)),
    (ValueError, "the cos/sin tables have 4 rows but the default positions arange\\(T\\) need T = 5",
     dict(cos=torch.randn(4, 32), sin=torch.randn(4, 32))),
]


@pytest.mark.parametrize("exc,match,overrides", ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_errors_name_the_argument(exc, match, overrides):
    if runtime.DEVICE.type != "cpu":
        pytest.skip("the error table is built with CPU tensors")
    with pytest.raises(exc, match=match):
        apply_rope(**_args(**overrides))


def test_out_buffer_errors():
    if runtime.DEVICE.type != "cpu":
        pytest.skip("built with CPU tensors")
    args = _args()
    with pytest.raises(ValueError, match=r"out_q must have the shape \(2, 4, 5, 32\) and dtype torch.float32 of q"):
        apply_rope(**args, out_q=torch.empty(2, 4, 5, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="out_k must have a contiguous last dimension"):
        apply_rope(**args, out_k=torch.empty(2, 2, 32, 5).transpose(2, 3))
    with pytest.raises(TypeError, match="out_k must be a torch.Tensor"):
        apply_rope(**args, out_k="buffer")
    with pytest.raises(ValueError, match="out_q is on meta but q is on cpu"):
        apply_rope(**args, out_q=torch.empty(2, 4, 5, 32, device="meta"))


def test_compiled_kernels_need_cuda_tensors(monkeypatch):
    if runtime.DEVICE.type != "cpu":
        pytest.skip("only meaningful for CPU tensors")
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    with pytest.raises(ValueError, match="compiled Triton kernels need CUDA tensors"):
        apply_rope(**_args())
