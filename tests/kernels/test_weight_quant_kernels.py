"""The W4A16 and MXFP4 Triton GEMMs against dequantize-then-matmul.

Outputs start as NaN (the wrapper's allocation is patched), so an element the kernel forgets fails. Sizes are
odd: M from 1 (decode) to 17, N not a multiple of the tile, K not a multiple of the group size (a trailing
partial group), group sizes 7, 32, 128 and per channel. bf16 ``tl.dot`` is upcast under the interpreter.
"""
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import labsrc  # noqa: F401  (interpreter switch before triton)
from labsrc import runtime
from labsrc import weight_quant as wq
from labsrc.exercises import tolerance
from labsrc.kernels import weight_quant as kw

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = runtime.DEVICE


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    real = torch.empty

    def nan_empty(*shape, dtype=None, device=None):
        return real(*shape, dtype=dtype, device=device).fill_(float("nan"))

    monkeypatch.setattr(kw.matmul, "_new_output", lambda m, n, dtype, device: nan_empty(m, n, dtype=dtype, device=device))


def gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def assert_close(got, ref):
    rtol, atol = tolerance(ref.dtype)
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    assert not got.isnan().any() or ref.isnan().any(), "an output element was never written"
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol + 2 * rtol * scale)


def int4_args(qw):
    return qw.qweight.to(DEV), qw.scales.to(DEV), qw.zeros.to(DEV), qw.group_size


# (M, N, K, group_size)
INT4_SHAPES = [(1, 37, 64, 32), (5, 50, 98, 7), (16, 33, 320, 128), (17, 19, 126, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "M{}-N{}-K{}-g{}".format(*s))
def test_int4_matmul_matches_dequantize_then_matmul(shape, symmetric, dtype):
    M, N, K, g = shape
    gn = gen(shape, symmetric)
    qw = wq.quantize_rtn(torch.randn(N, K, generator=gn) * 0.1, 4, g, symmetric)
    x = torch.randn(M, K, generator=gn).to(DEV, dtype)
    got = kw.int4_matmul(x, *int4_args(qw))
    ref = kw.int4_matmul_ref(x, *int4_args(qw))
    assert got.shape == (M, N) and got.dtype == dtype
    assert_close(got, ref)
    # the reference is the definition: x @ dequantize(W).T, here in float64
    exact = (x.double() @ wq.dequantize(qw, torch.float64).to(DEV).T).to(dtype)
    assert_close(ref, exact)


# (M, N, K)
MX_SHAPES = [(1, 37, 64), (7, 33, 96), (17, 20, 320)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=lambda s: "M{}-N{}-K{}".format(*s))
def test_mxfp4_matmul_matches_dequantize_then_matmul(shape, dtype):
    M, N, K = shape
    gn = gen(shape)
    codes, scales = wq.mxfp4_quantize(torch.randn(N, K, generator=gn) * torch.logspace(-3, 3, K))
    x = torch.randn(M, K, generator=gn).to(DEV, dtype)
    got = kw.mxfp4_matmul(x, codes.to(DEV), scales.to(DEV))
    ref = kw.mxfp4_matmul_ref(x, codes.to(DEV), scales.to(DEV))
    assert got.shape == (M, N) and got.dtype == dtype
    assert_close(got, ref)
    exact = (x.double() @ wq.mxfp4_dequantize(codes, scales, torch.float64).to(DEV).T).to(dtype)
    assert_close(ref, exact)


def test_mxfp4_matmul_takes_torchaos_tensors_and_subnormal_scales():
    to_mx, _ = wq.torchao_mx()
    w = torch.randn(24, 64, generator=gen("ao"))
    w[3, :32] *= 2.0 ** -128  # a block whose scale is E8M0's subnormal 2^-127 (stored e = 0)
    scale, data = to_mx(w, torch.float4_e2m1fn_x2, 32)
    assert scale.dtype == torch.float8_e8m0fnu and int(scale.view(torch.uint8)[3, 0]) == 0
    x = torch.randn(3, 64, generator=gen("ao-x"))
    got = kw.mxfp4_matmul(x.to(DEV), data.view(torch.uint8).to(DEV), scale.to(DEV))
    assert_close(got, kw.mxfp4_matmul_ref(x.to(DEV), data.view(torch.uint8).to(DEV), scale.to(DEV)))


def test_gptq_and_awq_weights_run_through_the_int4_kernel():
    gn = gen("gptq")
    x = torch.randn(256, 96, generator=gn)
    w = torch.randn(40, 96, generator=gn) * 0.05
    for qw in (wq.gptq_quantize(w, wq.hessian(x), 4, 32, block_size=32, act_order=True),
               wq.apply_awq(w, wq.awq_search_scales(w, x, 4, 32, grid=4), 4, 32)):
        xs = x[:3].to(DEV)
        assert_close(kw.int4_matmul(xs, *int4_args(qw)), (xs @ wq.dequantize(qw).to(DEV).T))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "3d"])
def test_strided_expanded_and_batched_x(layout):
    gn = gen(layout)
    K = 64
    qw = wq.quantize_rtn(torch.randn(21, K, generator=gn), 4, 16)
    codes, scales = wq.mxfp4_quantize(torch.randn(21, K, generator=gn))
    base = torch.randn(K, 9, generator=gn).to(DEV)
    x = {"transposed": base.T, "sliced": torch.randn(5, 2 * K, generator=gn).to(DEV)[:, ::2],
         "expanded": base[:, 0].expand(4, K), "3d": torch.randn(2, 3, K, generator=gn).to(DEV)}[layout]
    assert_close(kw.int4_matmul(x, *int4_args(qw)), kw.int4_matmul_ref(x.contiguous(), *int4_args(qw)))
    assert_close(kw.mxfp4_matmul(x, codes.to(DEV), scales.to(DEV)),
                 kw.mxfp4_matmul_ref(x.contiguous(), codes.to(DEV), scales.to(DEV)))


def test_strided_weight_fields_are_copied_not_misread():
    gn = gen("strided-w")
    qw = wq.quantize_rtn(torch.randn(8, 64, generator=gn), 4, 16)
    wide = torch.zeros(8, 64, dtype=torch.uint8)
    wide[:, ::2] = qw.qweight
    x = torch.randn(2, 64, generator=gn).to(DEV)
    got = kw.int4_matmul(x, wide[:, ::2].to(DEV), qw.scales.T.contiguous().T.to(DEV), qw.zeros.to(DEV), 16)
    assert_close(got, kw.int4_matmul_ref(x, *int4_args(qw)))


def test_non_finite_inputs_give_nan_rows_as_the_reference():
    gn = gen("nan")
    qw = wq.quantize_rtn(torch.randn(10, 64, generator=gn), 4, 32)
    codes, scales = wq.mxfp4_quantize(torch.randn(10, 64, generator=gn))
    x = torch.randn(3, 64, generator=gn)
    x[1, 5] = float("nan")
    got = kw.int4_matmul(x.to(DEV), *int4_args(qw)).cpu()
    assert bool(got[1].isnan().all()) and not got[[0, 2]].isnan().any()
    scales[4, 1] = 255  # E8M0's NaN: weight row 4 is NaN
    got = kw.mxfp4_matmul(torch.randn(3, 64, generator=gn).to(DEV), codes.to(DEV), scales.to(DEV)).cpu()
    assert bool(got[:, 4].isnan().all()) and not got[:, [0, 1, 2, 3, 5]].isnan().any()


def test_no_rows():
    qw = wq.quantize_rtn(torch.randn(6, 32, generator=gen("empty")), 4, 32)
    assert kw.int4_matmul(torch.empty(0, 32, device=DEV), *int4_args(qw)).shape == (0, 6)


def _bad_int4(**over):
    qw = wq.quantize_rtn(torch.randn(6, 32, generator=gen("bad")), 4, 8)
    args = dict(x=torch.randn(2, 32, device=DEV), qweight=qw.qweight.to(DEV), scales=qw.scales.to(DEV),
                zeros=qw.zeros.to(DEV), group_size=8)
    args.update(over)
    return args


INT4_ERRORS = [
    (TypeError, "x must be a torch.Tensor", dict(x=[1.0])),
    (TypeError, "x must be float32", dict(x=torch.ones(2, 32, dtype=torch.int32))),
    (ValueError, "x must have shape", dict(x=torch.randn(2, 30))),
    (ValueError, "requires grad", dict(x=torch.randn(2, 32, requires_grad=True))),
    (TypeError, "qweight must be uint8", dict(qweight=torch.zeros(6, 16, dtype=torch.int8))),
    (ValueError, "qweight must be a non-empty", dict(qweight=torch.zeros(6, dtype=torch.uint8))),
    (TypeError, "scales must be float16", dict(scales=torch.ones(6, 4))),
    (TypeError, "zeros must be uint8", dict(zeros=torch.ones(6, 4))),
    (ValueError, "scales must have shape", dict(scales=torch.ones(6, 3, dtype=torch.float16))),
    (ValueError, "zeros must have shape", dict(zeros=torch.ones(5, 4, dtype=torch.uint8))),
    (ValueError, "group_size", dict(group_size=0)),
    (ValueError, "group_size", dict(group_size=8.0)),
    (TypeError, "qweight must be a torch.Tensor", dict(qweight=None)),
]


@pytest.mark.parametrize("exc, match, over", INT4_ERRORS, ids=[m for _, m, _ in INT4_ERRORS])
def test_int4_errors_name_the_argument_in_kernel_and_reference(exc, match, over):
    for fn in (kw.int4_matmul, kw.int4_matmul_ref):
        with pytest.raises(exc, match=match):
            fn(**_bad_int4(**over))


MX_ERRORS = [
    (TypeError, "codes must be uint8", dict(codes=torch.zeros(4, 32, dtype=torch.int16))),
    (TypeError, "scales must be uint8 or float8_e8m0fnu", dict(scales=torch.zeros(4, 2))),
    (ValueError, "multiple of 32", dict(codes=torch.zeros(4, 24, dtype=torch.uint8))),
    (ValueError, "scales must have shape", dict(scales=torch.zeros(4, 1, dtype=torch.uint8))),
    (ValueError, "x must have shape", dict(x=torch.randn(1, 60))),
    (ValueError, "requires grad", dict(x=torch.randn(1, 64, requires_grad=True))),
    (TypeError, "x must be float32", dict(x=torch.ones(1, 64, dtype=torch.float64))),
]


@pytest.mark.parametrize("exc, match, over", MX_ERRORS, ids=[m for _, m, _ in MX_ERRORS])
def test_mxfp4_errors_name_the_argument(exc, match, over):
    args = dict(x=torch.randn(1, 64), codes=torch.zeros(4, 32, dtype=torch.uint8),
                scales=torch.full((4, 2), 127, dtype=torch.uint8))
    args.update(over)
    with pytest.raises(exc, match=match):
        kw.mxfp4_matmul(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in args.items()})


def test_reference_takes_float64_the_kernel_does_not():
    qw = wq.quantize_rtn(torch.randn(6, 32, generator=gen("f64")), 4, 8)
    x = torch.randn(2, 32, dtype=torch.float64)
    assert kw.int4_matmul_ref(x, *int4_args(qw)).dtype == torch.float64
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        kw.int4_matmul(x.to(DEV), *int4_args(qw))


def test_too_many_weight_rows_are_refused_up_front(monkeypatch):
    monkeypatch.setattr(kw.matmul, "MAX_GRID_1", 1)
    qw = wq.quantize_rtn(torch.randn(200, 32, generator=gen("grid")), 4, 8)
    with pytest.raises(ValueError, match="grid axis 1"):
        kw.int4_matmul(torch.randn(1, 32, device=DEV), *int4_args(qw))


def test_compiled_kernels_need_cuda_tensors(monkeypatch):
    if runtime.HAS_CUDA:
        pytest.skip("on a GPU the kernels are compiled and CPU tensors are refused by the device check")
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    with pytest.raises(ValueError, match="CUDA"):
        kw.int4_matmul(**_bad_int4())


@given(m=st.integers(1, 20), n=st.integers(1, 40), half=st.integers(1, 48), g=st.sampled_from([3, 16, 32, 128]),
       dtype=st.sampled_from(DTYPES), sym=st.booleans(), seed=st.integers(0, 2 ** 16))
@settings(max_examples=12, deadline=None)
def test_property_int4_matches_reference(m, n, half, g, dtype, sym, seed):
    gn = torch.Generator().manual_seed(seed)
    qw = wq.quantize_rtn(torch.randn(n, 2 * half, generator=gn), 4, g, sym)
    x = torch.randn(m, 2 * half, generator=gn).to(DEV, dtype)
    assert_close(kw.int4_matmul(x, *int4_args(qw)), kw.int4_matmul_ref(x, *int4_args(qw)))


@given(m=st.integers(1, 20), n=st.integers(1, 40), blocks=st.integers(1, 4), dtype=st.sampled_from(DTYPES),
       log_scale=st.integers(-20, 20), seed=st.integers(0, 2 ** 16))
@settings(max_examples=12, deadline=None)
def test_property_mxfp4_matches_reference(m, n, blocks, dtype, log_scale, seed):
    if dtype == torch.float16:  # the kernel rounds weight tiles to fp16 (docstring): keep them in its range
        log_scale = min(log_scale, 10)
    gn = torch.Generator().manual_seed(seed)
    codes, scales = wq.mxfp4_quantize(torch.randn(n, 32 * blocks, generator=gn) * 2.0 ** log_scale)
    x = torch.randn(m, 32 * blocks, generator=gn).to(DEV, dtype)
    assert_close(kw.mxfp4_matmul(x, codes.to(DEV), scales.to(DEV)),
                 kw.mxfp4_matmul_ref(x, codes.to(DEV), scales.to(DEV)))


@given(which=st.sampled_from(["x", "qweight", "scales", "zeros"]),
       bad=st.sampled_from([None, 3, "w", 1.5, [1, 2]]))
@settings(max_examples=15, deadline=None)
def test_property_non_tensors_raise_type_error_naming_them(which, bad):
    with pytest.raises(TypeError, match=which):
        kw.int4_matmul(**_bad_int4(**{which: bad}))
