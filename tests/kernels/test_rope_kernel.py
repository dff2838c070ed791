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


def _poisoned_like(x):
    """A NaN buffer in the layout of ``x`` where the kernel can write it (a dense last dimension), else dense."""
    out = torch.full_like(x, float("nan"))
    writable = (out.stride(-1) == 1 or out.shape[-1] <= 1) and 0 not in out.stride()
    return out if writable else torch.full_like(
        x, float("nan"), memory_format=torch.contiguous_format)


def run_poisoned(q, k, cos, sin, positions):
    out_q = _poisoned_like(q)
    out_k = _poisoned_like(k)
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
                cos=torch.randn(16, 32, generator=gen), sin=torch.randn(16, 32, generator=gen), positions=None,
                check_positions=True)
    args.update(overrides)
    return args


ERRORS = [
    (TypeError, "q must be a torch.Tensor, got list", dict(q=[1.0])),
    (TypeError, "positions must be a torch.Tensor, got list", dict(positions=[0, 1, 2, 3, 4])),
    (ValueError, r"q must be 4-D \(B, Hq, T, D\), got shape \(4, 5, 32\)", dict(q=torch.randn(4, 5, 32))),
    (ValueError, r"k must be 4-D \(B, Hkv, T, D\)", dict(k=torch.randn(2, 5, 32))),
    (ValueError, r"k \(2, 2, 6, 32\) must share B, T and D with q", dict(k=torch.randn(2, 2, 6, 32))),
    (ValueError, "head dim D of q and k must be even", dict(q=torch.randn(2, 4, 5, 31), k=torch.randn(2, 2, 5, 31))),
    (ValueError, "head dim D of q and k must be even and positive .* got 0",
     dict(q=torch.randn(2, 4, 5, 0), k=torch.randn(2, 2, 5, 0), cos=torch.randn(16, 0), sin=torch.randn(16, 0))),
    (TypeError, "check_positions must be a bool", dict(check_positions=1)),
    (TypeError, "q must be float32, float16 or bfloat16, got torch.float64",
     dict(q=torch.randn(2, 4, 5, 32, dtype=torch.float64), k=torch.randn(2, 2, 5, 32, dtype=torch.float64))),
    (TypeError, "k has dtype torch.float16 but q has torch.float32", dict(k=torch.randn(2, 2, 5, 32).half())),
    (ValueError, r"cos must be a table \(max_pos, D=32\), got shape \(16, 16\)", dict(cos=torch.randn(16, 16))),
    (TypeError, "sin must be float32, float16 or bfloat16, got torch.int64",
     dict(sin=torch.zeros(16, 32, dtype=torch.int64))),
    (ValueError, r"sin \(17, 32\) and cos \(16, 32\) must have the same shape", dict(sin=torch.randn(17, 32))),
    (TypeError, "sin has dtype torch.float16 but cos has torch.float32", dict(sin=torch.randn(16, 32).half())),
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


_KERNEL_ONLY = ("q must be float32", "k is on meta", "check_positions")


@pytest.mark.parametrize("exc,match,overrides", [e for e in ERRORS if not e[1].startswith(_KERNEL_ONLY)],
                         ids=[e[1][:40] for e in ERRORS if not e[1].startswith(_KERNEL_ONLY)])
def test_reference_refuses_what_the_kernel_refuses(exc, match, overrides):
    """apply_rope_ref used to accept D = 0 and wrap negative positions to the end of the table."""
    args = _args(**overrides)
    args.pop("check_positions")
    with pytest.raises(exc, match=match):
        apply_rope_ref(**args)


def test_zero_head_dim_used_to_divide_by_zero():
    q, k = torch.randn(1, 2, 3, 0, device=DEV), torch.randn(1, 1, 3, 0, device=DEV)
    table = torch.randn(8, 0, device=DEV)
    for fn in (apply_rope, apply_rope_ref):
        with pytest.raises(ValueError, match="head dim D of q and k must be even and positive"):
            fn(q, k, table, table)


# --------------------------------------------------------------------------------------- memory layouts

def _view(x, how, gen):
    """The values of ``x`` (B, H, T, D) in another layout: the kernel must read the same numbers."""
    if how == "dense":
        return x
    if how == "last_sliced":     # every other column of a buffer twice as wide: last stride 2
        big = torch.randn(x.shape[:-1] + (2 * x.shape[-1],), generator=gen).to(x)
        big[..., ::2] = x
        return big[..., ::2]
    if how == "last_transposed":  # stored (B, H, D, T), viewed as (B, H, T, D): last stride T
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if how == "bthd":            # stored (B, T, H, D), the layout projections produce
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "heads_sliced":    # every other head
        big = torch.randn((x.shape[0], 2 * x.shape[1]) + x.shape[2:], generator=gen).to(x)
        big[:, ::2] = x
        return big[:, ::2]
    if how == "expanded":        # one head broadcast to all (stride 0 on the head axis)
        return x[:, :1].expand_as(x)
    raise AssertionError(how)


def _table_view(t, how, gen):
    if how == "dense":
        return t
    if how == "transposed":      # stored (D, max_pos): last stride max_pos
        return t.t().contiguous().t()
    if how == "row_sliced":      # every other row of a longer table: row stride 2 D
        big = torch.randn((2 * t.shape[0], t.shape[1]), generator=gen).to(t)
        big[::2] = t
        return big[::2]
    if how == "expanded":        # one row for every position
        return t[:1].expand_as(t)
    raise AssertionError(how)


def _positions_view(p, how, B):
    if p is None or how == "dense":
        return p
    if how == "sliced":          # a column of a (.., 2) table: stride 2
        return torch.stack([p, torch.full_like(p, -5)], -1)[..., 0]
    if how == "expanded":        # (T,) broadcast to (B, T): batch stride 0
        return (p if p.dim() == 1 else p[0]).expand(B, -1)
    if how == "transposed":      # (B, T) stored as (T, B)
        p2 = p if p.dim() == 2 else p.expand(B, -1)
        return p2.t().contiguous().t()
    raise AssertionError(how)


def _compare_poisoned(q, k, cos, sin, positions, dtype):
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin, positions)
    got_q, got_k = run_poisoned(q, k, cos, sin, positions)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got_q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_k, ref_k, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_layout", ["last_sliced", "last_transposed", "bthd", "heads_sliced", "expanded"])
@pytest.mark.parametrize("table_layout", ["dense", "transposed", "row_sliced", "expanded"])
def test_strided_q_k_and_tables_match_reference(dtype, x_layout, table_layout):
    """A last dimension with a stride, or a table stored column-major, used to be refused; the kernel now
    reads a dense copy. Outputs are NaN-poisoned, so a missed element fails."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{x_layout}{table_layout}".encode()))
    q = _view(torch.randn(2, 3, 7, 24, generator=gen).to(DEV, dtype), x_layout, gen)
    k = _view(torch.randn(2, 1, 7, 24, generator=gen).to(DEV, dtype), x_layout, gen)
    cos, sin = tables(24, "yarn")
    cos, sin = _table_view(cos, table_layout, gen), _table_view(sin, table_layout, gen)
    positions = torch.randint(0, TABLE_ROWS, (2, 7), generator=gen).to(DEV)
    _compare_poisoned(q, k, cos, sin, positions, dtype)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("layout", ["sliced", "expanded", "transposed"])
@pytest.mark.parametrize("shape", ["1d", "2d"])
def test_strided_and_expanded_positions_match_reference(pos_dtype, layout, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{pos_dtype}{layout}{shape}".encode()))
    q = torch.randn(3, 2, 9, 16, generator=gen).to(DEV)
    k = torch.randn(3, 2, 9, 16, generator=gen).to(DEV)
    cos, sin = tables(16, "default")
    positions = torch.randint(0, TABLE_ROWS, (9,) if shape == "1d" else (3, 9), generator=gen).to(DEV, pos_dtype)
    positions = _positions_view(positions, layout, 3)
    _compare_poisoned(q, k, cos, sin, positions, torch.float32)


def test_in_place_on_a_strided_last_dimension_is_refused_not_miswritten():
    q = torch.randn(1, 2, 5, 32, 2)[..., 0]          # last stride 2
    args = _args(q=torch.randn(1, 2, 5, 32), k=torch.randn(1, 1, 5, 32))
    args.pop("check_positions")
    with pytest.raises(ValueError, match="out_q must have a contiguous last dimension"):
        apply_rope(**dict(args, q=q), out_q=q)


def test_expanded_output_buffer_is_refused():
    args = _args()
    out = torch.empty(2, 1, 5, 32).expand(2, 4, 5, 32)
    with pytest.raises(ValueError, match="out_q must not be an expanded view"):
        apply_rope(**args, out_q=out)


def test_in_place_rotation_of_a_bthd_buffer_still_matches():
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 9, 3, 32, generator=gen).transpose(1, 2)
    k = torch.randn(1, 9, 1, 32, generator=gen).transpose(1, 2)
    cos, sin = tables(32, "default")
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin)
    apply_rope(q, k, cos, sin, out_q=q, out_k=k)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- launch limits

def test_head_dim_beyond_the_block_limit_is_refused_up_front():
    """D/2 = 2^20 + 1 needs a tile of 2^21 columns, beyond Triton's 2^20 elements."""
    D = 2 * (2 ** 20 + 1)
    q = torch.zeros(1, 1, 1, D)
    table = torch.zeros(1, D)
    with pytest.raises(ValueError, match=r"head dim D = 2097154 .* exceeds Triton's limit of 1048576"):
        apply_rope(q, q, table, table)


def test_more_tokens_than_grid_axis_0_are_refused_up_front():
    q = torch.zeros(1, 1, 1, 2).expand(2 ** 16, 1, 2 ** 15, 2)   # 2^31 tokens, no memory
    table = torch.zeros(2 ** 15, 2)
    with pytest.raises(ValueError, match=r"B \* T = 2147483648 tokens but one launch handles at most 2147483647"):
        apply_rope(q, q, table, table)


# ---------------------------------------------------------------------------------------- property-based

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(B=st.integers(1, 3), Hq=st.integers(1, 5), group=st.integers(1, 3), T=st.integers(0, 9),
       half=st.integers(1, 40), dtype=st.sampled_from(DTYPES), table_dtype=st.sampled_from(DTYPES),
       x_layout=st.sampled_from(["dense", "last_sliced", "last_transposed", "bthd", "heads_sliced", "expanded"]),
       table_layout=st.sampled_from(["dense", "transposed", "row_sliced", "expanded"]),
       pos=st.sampled_from(["none", "1d", "2d"]), pos_layout=st.sampled_from(["dense", "sliced", "expanded", "transposed"]),
       pos_dtype=st.sampled_from([torch.int32, torch.int64]), scale=st.sampled_from([1.0, 1e-3, 1e3]),
       seed=st.integers(0, 2 ** 16))
def test_property_matches_reference(B, Hq, group, T, half, dtype, table_dtype, x_layout, table_layout, pos,
                                    pos_layout, pos_dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    D, rows = 2 * half, 12
    Hkv = max(1, Hq // group)
    q = _view((scale * torch.randn(B, Hq, T, D, generator=gen)).to(DEV, dtype), x_layout, gen)
    k = _view((scale * torch.randn(B, Hkv, T, D, generator=gen)).to(DEV, dtype), x_layout, gen)
    cos = _table_view(torch.randn(max(rows, T), D, generator=gen).to(DEV, table_dtype), table_layout, gen)
    sin = _table_view(torch.randn(max(rows, T), D, generator=gen).to(DEV, table_dtype), table_layout, gen)
    positions = None
    if pos != "none":
        positions = torch.randint(0, cos.shape[0], (T,) if pos == "1d" else (B, T), generator=gen).to(DEV, pos_dtype)
        positions = _positions_view(positions, pos_layout, B)
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin, positions)
    got_q, got_k = run_poisoned(q, k, cos, sin, positions)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got_q, ref_q, rtol=rtol, atol=atol * scale)
    torch.testing.assert_close(got_k, ref_k, rtol=rtol, atol=atol * scale)


_BAD = st.one_of(st.just(float("nan")), st.just(float("inf")), st.integers(-5, -1), st.just(0), st.booleans(),
                 st.just(1.5), st.text(max_size=3), st.lists(st.floats(allow_nan=True), max_size=3))


@_SETTINGS
@given(which=st.sampled_from(["q", "k", "cos", "sin", "positions"]), bad=_BAD)
def test_property_non_tensors_raise_type_error_naming_them(which, bad):
    args = _args()
    args.pop("check_positions")
    args[which] = bad
    for fn in (apply_rope, apply_rope_ref):
        with pytest.raises(TypeError, match=f"{which} must be a torch.Tensor"):
            fn(**args)


@_SETTINGS
@given(bad=st.one_of(st.integers(-2 ** 40, -1), st.integers(16, 2 ** 40)), at=st.integers(0, 4),
       pos_dtype=st.sampled_from([torch.int32, torch.int64]), odd_half=st.integers(0, 20))
def test_property_bad_positions_and_head_dims_raise(bad, at, pos_dtype, odd_half):
    info = torch.iinfo(pos_dtype)
    positions = torch.arange(5, dtype=pos_dtype)
    positions[at] = min(max(bad, info.min), info.max)
    args = _args(positions=positions)
    args.pop("check_positions")
    for fn in (apply_rope, apply_rope_ref):
        with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
            fn(**args)
    D = 2 * odd_half + 1 if odd_half % 2 else 0     # odd head dims and 0
    bad_dim = dict(q=torch.randn(2, 4, 5, D), k=torch.randn(2, 2, 5, D), cos=torch.randn(16, D), sin=torch.randn(16, D))
    for fn in (apply_rope, apply_rope_ref):
        with pytest.raises(ValueError, match="head dim D of q and k must be even"):
            fn(**bad_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_inputs_behave_as_in_the_reference(dtype):
    """inf and NaN in q/k go through the same arithmetic as in the reference (inf * 0 = NaN included)."""
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(1, 2, 5, 16, generator=gen).to(DEV, dtype)
    k = torch.randn(1, 1, 5, 16, generator=gen).to(DEV, dtype)
    q[0, 0, 1, 3], q[0, 1, 4, 12], k[0, 0, 2, 0] = float("inf"), float("nan"), -float("inf")
    cos, sin = tables(16, "default")
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin)
    got_q, got_k = run_poisoned(q, k, cos, sin, None)
    rtol, atol = tolerance(dtype)
    assert torch.isnan(ref_q).any() and torch.isinf(ref_k).any()
    torch.testing.assert_close(got_q, ref_q, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(got_k, ref_k, rtol=rtol, atol=atol, equal_nan=True)
