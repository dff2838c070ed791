"""The from-scratch weight quantizers: RTN and its packing, LLM.int8()'s split, GPTQ and AWQ against RTN on
correlated activations, and MXFP4 bit for bit against torchao's MX implementation."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from labsrc import weight_quant as wq


def gen(seed):
    return torch.Generator().manual_seed(seed)


def correlated(n, k, seed, outliers=4):
    """Activations with correlated channels and a few large ones, as a transformer's hidden states have."""
    g = gen(seed)
    a = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(n, k, generator=g) @ a + 0.1 * torch.randn(n, k, generator=g)
    x[:, :outliers] *= 20
    return x


# ----------------------------------------------------------------------------------------------- RTN
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [None, 7, 32, 128])
def test_rtn_error_is_within_half_a_step_and_fields_match(bits, symmetric, group_size):
    w = torch.randn(19, 90, generator=gen(bits)) * 0.1 + (0 if symmetric else 0.05)
    qw = wq.quantize_rtn(w, bits, group_size, symmetric).validate()
    g = 90 if group_size is None else min(group_size, 90)
    assert qw.group_size == g and qw.scales.shape == (19, -(-90 // g)) and qw.shape == (19, 90)
    w_hat = wq.dequantize(qw)
    step = qw.scales.float().repeat_interleave(g, 1)[:, :90]
    assert bool(((w - w_hat).abs() <= step / 2 + 1e-6).all())
    assert int(qw.codes.max()) <= 2 ** bits - 1
    if bits == 4:
        assert qw.qweight.shape == (19, 45)


def fp16_up(v: float) -> float:
    """The smallest fp16 value >= v (the stored step is rounded up)."""
    h = torch.tensor(v).half()
    return float(torch.nextafter(h, torch.tensor(float("inf")).half())) if float(h) < v else float(h)


def test_rtn_formula_by_hand():
    """One asymmetric 4-bit group: s = (max - min) / 15, z = round(-min / s), q = round(w / s) + z."""
    w = torch.tensor([[-0.3, 0.1, 0.45, 1.2]])
    qw = wq.quantize_rtn(w, 4, symmetric=False)
    s = torch.tensor(fp16_up(1.5 / 15))
    z = torch.round(0.3 / s)
    assert float(qw.scales) == float(s) and int(qw.zeros) == int(z)
    assert torch.equal(qw.codes.float(), torch.clamp(torch.round(w / s) + z, 0, 15))
    sym = wq.quantize_rtn(w, 4)
    assert float(sym.scales) == fp16_up(1.2 / 7) and int(sym.zeros) == 8


def test_zeros_and_dead_columns_stay_exactly_zero():
    w = torch.randn(4, 64, generator=gen(1))
    w[:, 10:20] = 0
    w[2] = 0
    for sym in (True, False):
        w_hat = wq.dequantize(wq.quantize_rtn(w, 4, 16, sym))
        assert torch.equal(w_hat[:, 10:20], torch.zeros(4, 10)) and torch.equal(w_hat[2], torch.zeros(64))


def test_per_tensor_uses_one_step_and_outliers_cost_precision():
    w = torch.randn(16, 64, generator=gen(2)) * 0.02
    w[0, 0] = 2.0  # one outlier weight sets the per-tensor step
    pt, pc = wq.quantize_rtn(w, 8, per_tensor=True), wq.quantize_rtn(w, 8)
    assert pt.scales.unique().numel() == 1
    err_t = (wq.dequantize(pt) - w)[1:].abs().mean()
    err_c = (wq.dequantize(pc) - w)[1:].abs().mean()
    assert err_t > 10 * err_c


@given(n=st.integers(1, 6), half=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
@settings(max_examples=20, deadline=None)
def test_pack_unpack_int4_round_trip(n, half, seed):
    codes = torch.randint(0, 16, (n, 2 * half), generator=gen(seed), dtype=torch.uint8)
    packed = wq.pack_int4(codes)
    assert packed.shape == (n, half) and torch.equal(wq.unpack_int4(packed), codes)
    # planar: column j in the low nibble of byte j, column j + K/2 in the high nibble
    assert torch.equal(packed & 15, codes[:, :half]) and torch.equal(packed >> 4, codes[:, half:])


def test_nbytes_counts_packed_codes_steps_and_asymmetric_zeros():
    w = torch.randn(64, 320, generator=gen(3))
    assert wq.quantize_rtn(w, 4, 128).nbytes == 64 * 320 // 2 + 2 * 64 * 3
    assert wq.quantize_rtn(w, 4, 128, symmetric=False).nbytes == 64 * 320 // 2 + 3 * 64 * 3
    assert wq.quantize_rtn(w, 3, 128).nbytes == 64 * 320 * 3 // 8 + 2 * 64 * 3


@pytest.mark.parametrize("exc, match, call", [
    (ValueError, "bits", lambda w: wq.quantize_rtn(w, 5)),
    (ValueError, "group_size", lambda w: wq.quantize_rtn(w, 4, 0)),
    (ValueError, "even K", lambda w: wq.quantize_rtn(w[:, :9], 4)),
    (TypeError, "floating", lambda w: wq.quantize_rtn(w.long(), 4)),
    (ValueError, "NaN", lambda w: wq.quantize_rtn(w * float("nan"), 4)),
    (ValueError, "fp16", lambda w: wq.quantize_rtn(w * 1e7, 4)),
    (ValueError, "matrix", lambda w: wq.quantize_rtn(w[0], 4)),
    (TypeError, "QuantizedWeight", lambda w: wq.dequantize(w)),
    (ValueError, "H must be", lambda w: wq.gptq_quantize(w, torch.eye(3))),
    (ValueError, "x must have shape", lambda w: wq.awq_search_scales(w, torch.randn(5, 3))),
    (ValueError, "s must be", lambda w: wq.apply_awq(w, -torch.ones(10))),
    (ValueError, "threshold", lambda w: wq.int8_matmul_outlier(torch.randn(2, 10), w, -1.0)),
    (ValueError, "multiple of block_size", lambda w: wq.mxfp4_quantize(w)),
    (TypeError, "float32, float16 or bfloat16", lambda w: wq.mxfp4_quantize(w.double())),
])
def test_errors_name_the_argument(exc, match, call):
    with pytest.raises(exc, match=match):
        call(torch.randn(4, 10, generator=gen(4)))


def test_validate_names_the_bad_field():
    qw = wq.quantize_rtn(torch.randn(4, 10, generator=gen(5)), 4, 4)
    for field, bad, exc in (("scales", qw.scales.float(), TypeError), ("zeros", qw.zeros[:, :1], ValueError),
                            ("qweight", qw.qweight.int(), TypeError)):
        broken = wq.QuantizedWeight(**{**qw.__dict__, field: bad})
        with pytest.raises(exc, match=field):
            broken.validate()


# ----------------------------------------------------------------------------------------------- LLM.int8
def test_int8_outlier_decomposition_is_close_and_beats_plain_int8():
    g = gen(6)
    x = torch.randn(32, 128, generator=g)
    x[:, [5, 77]] *= 40  # two outlier features, as LLM.int8() finds in large models
    w = torch.randn(48, 128, generator=g) * 0.05
    ref = x @ w.T
    y, cols = wq.int8_matmul_outlier(x, w, 6.0, return_outliers=True)
    assert sorted(cols.tolist()) == [5, 77]
    rel = float((y - ref).norm() / ref.norm())
    plain = float((wq.int8_matmul_outlier(x, w, float("inf")) - ref).norm() / ref.norm())
    assert rel < 0.01 and plain > 3 * rel
    # the bound of the docstring, per output: (|x|_1 s_w + |w|_1 s_x) / 2 + s_x s_w |K| / 4 on the INT8 part
    keep = torch.ones(128, dtype=torch.bool)
    keep[cols] = False
    sx = x[:, keep].abs().amax(1, keepdim=True) / 127
    sw = w[:, keep].abs().amax(1, keepdim=True) / 127
    bound = (x[:, keep].abs().sum(1, keepdim=True) * sw.T + sx * w[:, keep].abs().sum(1)[None]) / 2 \
        + sx * sw.T * keep.sum() / 4
    assert bool(((y - ref).abs() <= bound + 1e-5).all())
    assert torch.allclose(wq.int8_matmul_outlier(x, w, 0.0), ref, atol=1e-5)


# ----------------------------------------------------------------------------------------------- GPTQ / AWQ
@pytest.mark.parametrize("bits, group_size, act_order", [(4, 64, False), (3, 64, True), (4, None, False),
                                                         (3, 48, False)])
def test_gptq_output_error_below_rtn_on_correlated_calibration(bits, group_size, act_order):
    x = correlated(1024, 192, seed=bits)
    w = torch.randn(64, 192, generator=gen(7)) * 0.05
    rtn = wq.dequantize(wq.quantize_rtn(w, bits, group_size))
    gq = wq.dequantize(wq.gptq_quantize(w, wq.hessian(x), bits, group_size, block_size=32, act_order=act_order))
    assert wq.layer_output_error(w, gq, x) < 0.7 * wq.layer_output_error(w, rtn, x)


def test_gptq_one_column_update_is_the_obs_step():
    """With block_size 1 and no damping, after column 0 the rest move by -err / Hinv[0,0] * Hinv[0, 1:]."""
    x = correlated(256, 8, seed=9, outliers=0)
    H = wq.hessian(x).double()
    w = torch.randn(3, 8, generator=gen(9), dtype=torch.float64)
    qw = wq.gptq_quantize(w.float(), H.float(), 8, None, block_size=1, damp=0.0)
    # redo the first step by hand with the same quantizer grid
    s = qw.scales.double()[:, 0]
    z = qw.zeros.double()[:, 0]
    q0 = (torch.clamp(torch.round(w[:, 0] / s) + z, 0, 255) - z) * s
    hinv = torch.linalg.inv(H.float().double())
    w1 = w[:, 1:] - ((w[:, 0] - q0) / hinv[0, 0])[:, None] * hinv[0, 1:][None]
    # column 1 is then quantized from w1[:, 0]: its code must match
    assert torch.equal(qw.codes[:, 1].double(), torch.clamp(torch.round(w1[:, 0] / s) + z, 0, 255))


def test_gptq_columns_without_activation_are_zero_and_finite():
    x = correlated(256, 64, seed=10)
    x[:, 7] = 0
    qw = wq.gptq_quantize(torch.randn(8, 64, generator=gen(10)), wq.hessian(x), 4, 32)
    w_hat = wq.dequantize(qw)
    assert bool(torch.isfinite(w_hat).all()) and torch.equal(w_hat[:, 7], torch.zeros(8))


def test_awq_scales_are_positive_and_error_below_rtn():
    x = correlated(512, 128, seed=11, outliers=8)
    w = torch.randn(48, 128, generator=gen(11)) * 0.05
    s = wq.awq_search_scales(w, x, 4, 32)
    assert s.shape == (128,) and bool((s > 0).all())
    awq = wq.dequantize(wq.apply_awq(w, s, 4, 32)) / s
    rtn = wq.dequantize(wq.quantize_rtn(w, 4, 32))
    assert wq.layer_output_error(w, awq, x) < wq.layer_output_error(w, rtn, x)
    # scaling alone leaves the full-precision product unchanged
    assert torch.allclose((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------- MXFP4
@pytest.fixture(scope="module")
def torchao():
    return wq.torchao_mx()


def _mx_cases():
    g = gen(12)
    return {
        "random": torch.randn(24, 128, generator=g),
        "tiny": torch.randn(4, 64, generator=g) * 1e-30,
        "huge": torch.randn(4, 64, generator=g) * 1e37,
        "zero": torch.zeros(3, 32),
        "negative zero": -torch.zeros(1, 32),
        "subnormal": torch.randn(4, 64, generator=g) * 2.0 ** -133,
        "smallest normals": torch.randn(4, 64, generator=g) * 2.0 ** -126,
        "ties": (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4)
                 * torch.tensor([1.0, -1.0] * 16)).reshape(1, 32),
        "saturating": torch.tensor([6.5, -7.0, 100.0] + [1.0] * 29).reshape(1, 32),
        "inf": torch.tensor([float("inf")] + [1.0] * 31).reshape(1, 32),
        "wide range": torch.randn(8, 64, generator=g) * torch.logspace(-20, 20, 64),
        # NaN blocks (scale 255): NaN of either sign, an inf and -0.0 beside finite values, and a block of NaN
        "nan": torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 1.0, -3.0, 7.0, -1e30] * 4
                            + [0.5] * 32).reshape(1, 64),
        "all nan": torch.full((2, 32), float("nan")),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(_mx_cases()))
def test_mxfp4_bit_identical_to_torchao(torchao, case, dtype):
    to_mx, to_dtype = torchao
    x = _mx_cases()[case].to(dtype)
    scale_ref, data_ref = to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32)
    codes, scales = wq.mxfp4_quantize(x)
    assert torch.equal(codes, data_ref.view(torch.uint8)), case
    assert torch.equal(scales, scale_ref.view(torch.uint8)), case
    ours = wq.mxfp4_dequantize(codes, scales)
    theirs = to_dtype(data_ref, scale_ref, torch.float4_e2m1fn_x2, 32, torch.float32)
    assert torch.equal(ours, theirs) or torch.equal(ours.isnan(), theirs.isnan()) \
        and torch.equal(ours.nan_to_num(), theirs.nan_to_num())


@given(rows=st.integers(1, 4), blocks=st.integers(1, 4), log_scale=st.integers(-140, 120),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_property_mxfp4_bit_identical_to_torchao(torchao, rows, blocks, log_scale, seed):
    to_mx, _ = torchao
    x = torch.randn(rows, 32 * blocks, generator=gen(seed)) * 2.0 ** log_scale
    scale_ref, data_ref = to_mx(x, torch.float4_e2m1fn_x2, 32)
    codes, scales = wq.mxfp4_quantize(x)
    assert torch.equal(codes, data_ref.view(torch.uint8)) and torch.equal(scales, scale_ref.view(torch.uint8))


@given(rows=st.integers(1, 3), blocks=st.integers(1, 3), n_bad=st.integers(1, 6),
       bad=st.sampled_from(["nan", "-nan", "inf", "-inf", "mixed"]), bf16=st.booleans(),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=30, deadline=None)
def test_property_mxfp4_nan_and_inf_bytes_match_torchao(torchao, rows, blocks, n_bad, bad, bf16, seed):
    """NaN-poisoned blocks: the packed bytes, not only the values, are torchao's (E2M1 has no NaN; torchao's
    bit arithmetic gives a NaN a code by its payload, which differs between fp32 and bf16 NaNs)."""
    to_mx, _ = torchao
    g = gen(seed)
    x = torch.randn(rows, 32 * blocks, generator=g) * 4
    idx = torch.randint(0, x.numel(), (n_bad,), generator=g)
    values = {"nan": [float("nan")], "-nan": [-float("nan")], "inf": [float("inf")], "-inf": [-float("inf")],
              "mixed": [float("nan"), -float("nan"), float("inf"), -float("inf")]}[bad]
    flat = x.view(-1)
    for i, j in enumerate(idx.tolist()):
        flat[j] = values[i % len(values)]
    x = x.to(torch.bfloat16) if bf16 else x
    scale_ref, data_ref = to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32)
    codes, scales = wq.mxfp4_quantize(x)
    assert torch.equal(scales, scale_ref.view(torch.uint8))
    assert torch.equal(codes, data_ref.view(torch.uint8))


def test_mxfp4_nan_block_gets_the_nan_scale():
    x = torch.ones(2, 64)
    x[1, 40] = float("nan")
    _, scales = wq.mxfp4_quantize(x)
    assert scales.tolist() == [[125, 125], [125, 255]]  # max 1 = 2^0: scale 2^(0 - 2)
    assert bool(wq.mxfp4_dequantize(*wq.mxfp4_quantize(x))[1, 32:].isnan().all())


def test_mxfp4_e2m1_by_hand_and_round_trip_error():
    v = torch.tensor([0.0, 0.3, 0.74, 0.76, 1.25, 2.6, 4.9, 5.1, 9.0, -1.5, -0.1])
    assert wq.E2M1_VALUES[wq.e2m1_encode(v).long() & 7].tolist() == [0, 0.5, 0.5, 1, 1, 3, 4, 6, 6, 1.5, 0]
    assert (wq.e2m1_encode(v)[-2:] >> 3).tolist() == [1, 1]
    x = torch.randn(16, 256, generator=gen(13)).reshape(16, 8, 32)
    err = (wq.mxfp4_dequantize(*wq.mxfp4_quantize(x)) - x).abs()
    # the block scale is 2^(floor(log2 max|x|) - 2); below the clipping edge (6 scales) an error is at most
    # half of E2M1's widest gap (2 scales); above it the element is clipped to 6 scales
    scale = 2.0 ** (torch.floor(torch.log2(x.abs().amax(-1, keepdim=True))) - 2)
    assert bool((err <= torch.maximum(scale, x.abs() - 6 * scale) + 1e-6).all())
    assert bool((x.abs() > 6 * scale).any()), "the floor rule clips some blocks' largest elements"


def test_fake_quant_ste_passes_the_gradient_through():
    w = torch.randn(4, 64, generator=gen(14), requires_grad=True)
    y = wq.fake_quant_mxfp4(w)
    assert torch.equal(y.detach(), wq.mxfp4_dequantize(*wq.mxfp4_quantize(w.detach())))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(4, 64))


# ----------------------------------------------------------------------------------------------- a model
@pytest.fixture(scope="module")
def lab_target():
    from labsrc import models

    return models.load("lab-target")


def test_quantize_model_replaces_every_linear_and_counts_bytes(lab_target):
    model, tok = lab_target
    ids = wq.calibration_ids(tok, 1, 64, "train", seed=3)
    q, nbytes = wq.quantize_model(model, "rtn", bits=4, group_size=128)
    for (name, m), (_, mq) in zip(wq.linear_layers(model), wq.linear_layers(q)):
        expect = wq.dequantize(wq.quantize_rtn(m.weight.detach().float(), 4, 128))
        assert torch.equal(mq.weight.detach(), expect), name
    assert nbytes == sum(wq.quantize_rtn(m.weight.detach().float(), 4, 128).nbytes
                         for _, m in wq.linear_layers(model))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # the original is untouched
    # AWQ layers compute (x / s) @ W_hat^T; GPTQ and MXFP4 copies run; window_nll is per window
    a, _ = wq.quantize_model(model, "awq", ids, bits=4, group_size=128, grid=4)
    layer = a.model.layers[0].mlp.down_proj
    assert isinstance(layer, wq.AWQLinear)
    x = torch.randn(3, layer.weight.shape[1])
    assert torch.allclose(layer(x), (x * layer.inv_s) @ layer.weight.T)
    m8, b8 = wq.int8_model(model)
    assert b8 == sum(m.weight.numel() + 2 * m.weight.shape[0] for _, m in wq.linear_layers(model))
    windows = wq.calibration_ids(tok, 2, 48, "validation", seed=4)
    base = wq.window_nll(model, windows)
    assert base.shape == (2,)
    for other in (q, a, m8, wq.quantize_model(model, "mxfp4")[0]):
        assert (wq.window_nll(other, windows) - base).abs().max() < 0.2
    with pytest.raises(ValueError, match="calib_ids"):
        wq.quantize_model(model, "gptq")
    with pytest.raises(ValueError, match="method"):
        wq.quantize_model(model, "nf4")


# ----------------------------------------------------------------------------------------------- the experiment
def _card():
    import json

    from labsrc.models.train import CHECKPOINTS

    return json.loads((CHECKPOINTS / "lab-target" / "eval_card.json").read_text())


def test_probes_are_the_eval_cards_at_nine_tenths_of_the_trained_context(lab_target):
    model, tok = lab_target
    card = _card()
    assert wq.probe_context(model) == int(0.9 * card["trained_context"])
    # The same samples and scoring as the eval card: full precision answers what its card says it does.
    sets = wq.probe_sets(tok, wq.PROBES, wq.probe_context(model), n=3, seed=0)
    assert {p: len(s) for p, s in sets.items()} == {p: 3 for p in wq.PROBES}
    answers = wq.score_probes(model, sets)
    for p in wq.PROBES:
        assert answers[p] == [int(x) for x in card["probes"][p]["per_sample"][:3]], p
    with pytest.raises(ValueError, match="probes"):
        wq.probe_sets(tok, ("needle", "haystack"), 128, n=1)
    with pytest.raises(ValueError, match="probes"):
        wq.probe_sets(tok, (), 128, n=1)
    with pytest.raises(ValueError, match="fractions"):  # MQAR scores 8 queries a sample
        wq.probe_sets(tok, ("mqar",), 128, n=1)


def test_stored_run_scores_every_config_on_the_eval_cards_probes(lab_target):
    from labsrc.curves import samples_digest

    model, tok = lab_target
    R = __import__("json").loads(wq.RESULTS_PATH.read_text())
    card = _card()
    assert R["probe_ctx"] == wq.probe_context(model) and R["probe_n"] >= 100
    assert R["weights"] == sum(m.weight.numel() for _, m in wq.linear_layers(model))
    # scored on the samples the probes draw today (a change to the generators makes the run stale)
    sets = wq.probe_sets(tok, tuple(R["probes"]), R["probe_ctx"], R["probe_n"], R["probe_seed"])
    assert R["probe_samples_digest"] == {p: samples_digest(s) for p, s in sets.items()}
    for name, c in R["configs"].items():
        assert set(c["probes"]) == set(R["probes"]), name
        assert all(len(a) == R["probe_n"] and set(a) <= {0, 1} for a in c["probes"].values()), name
    # fp32 is the checkpoint itself: its answers are the eval card's, sample for sample
    for p in R["probes"]:
        assert R["configs"]["fp32"]["probes"][p] == [int(x) for x in card["probes"][p]["per_sample"]], p
    # a curve across bits: RTN and GPTQ with groups of 128 at 4, 3 and 2 bits
    for method in ("RTN", "GPTQ"):
        assert all(f"{method} INT{b} g128" in R["configs"] for b in (4, 3, 2))


@pytest.mark.slow
def test_run_experiment_records_probe_answers_for_every_config(lab_target, monkeypatch):
    # The quantizers are tested above; here they are stubbed (each returns the model itself), so that the
    # test checks what run_experiment records, in seconds: then every config must answer as fp32 does.
    model, tok = lab_target
    # (patched where run_experiment looks them up: its own module, labsrc.weight_quant.experiment)
    monkeypatch.setattr(wq.experiment, "quantize_model", lambda m, *a, **k: (m, 1))
    monkeypatch.setattr(wq.experiment, "int8_model", lambda m, *a, **k: (m, 1))
    monkeypatch.setattr(wq.experiment, "qat_mxfp4", lambda m, *a, **k: (m, [1.0], m))
    monkeypatch.setattr(wq.experiment, "gptq_quantize", lambda w, h, bits, g, **k: wq.quantize_rtn(w, bits, g))
    monkeypatch.setattr(wq.experiment, "awq_search_scales", lambda w, x, *a, **k: torch.ones(w.shape[1]))
    R = wq.run_experiment(calib_windows=1, calib_len=32, eval_windows=1, eval_len=32, probe_n=2,
                          qat_steps=1, log=lambda m: None)
    assert R["probe_ctx"] == wq.probe_context(model) and R["probe_n"] == 2 and R["probe_seed"] == 0
    assert R["probes"] == list(wq.PROBES)
    fp32 = R["configs"]["fp32"]["probes"]
    assert fp32 == {p: [int(x) for x in _card()["probes"][p]["per_sample"][:2]] for p in wq.PROBES}
    for name, c in R["configs"].items():
        assert c["probes"] == fp32 and c["seconds"] >= 0 and len(c["nll"]) == 1, name
    with pytest.raises(ValueError, match="other settings"):
        wq.run_experiment(calib_windows=1, calib_len=32, eval_windows=1, eval_len=32, probe_n=3,
                          qat_steps=1, log=lambda m: None, reuse=R)
