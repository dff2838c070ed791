"""RoPE frequency methods against transformers' ROPE_INIT_FUNCTIONS, the helpers, and the exercise checks."""
import itertools
import logging
import math

import pytest
import torch

import labsrc  # noqa: F401  (sets the interpreter switch before anything imports triton)
from labsrc import rope
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

logging.getLogger("transformers").setLevel(logging.ERROR)

HEAD_DIMS = (32, 64, 80, 128)
BASES = (10000.0, 500000.0)
FACTORS = (2.0, 4.0, 8.0, 16.0)


def hf_config(head_dim, base, rope_type, max_position=4096, partial_rotary_factor=None, **rope_params):
    params = {"rope_type": rope_type, "rope_theta": base, **rope_params}
    if partial_rotary_factor is not None:
        params["partial_rotary_factor"] = partial_rotary_factor
    return LlamaConfig(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_position, rope_parameters=params)


def hf(config, rope_type, seq_len=None):
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def assert_same(ours, theirs):
    inv, scale = ours
    inv_hf, scale_hf = theirs
    assert inv.dtype == torch.float32 and inv.shape == inv_hf.shape
    # Same formulas in float32: agreement to the last few ulps.
    torch.testing.assert_close(inv, inv_hf.float(), rtol=2e-6, atol=0)
    assert math.isclose(scale, float(scale_hf), rel_tol=1e-12)


@pytest.mark.parametrize("head_dim,base", list(itertools.product(HEAD_DIMS, BASES)))
def test_default_matches_transformers(head_dim, base):
    assert_same(rope.rope_frequencies(head_dim, base), hf(hf_config(head_dim, base, "default"), "default"))


@pytest.mark.parametrize("head_dim,base,factor", list(itertools.product(HEAD_DIMS, BASES, FACTORS)))
def test_linear_matches_transformers(head_dim, base, factor):
    ours = rope.rope_frequencies(head_dim, base, "linear", factor=factor)
    assert_same(ours, hf(hf_config(head_dim, base, "linear", factor=factor), "linear"))


@pytest.mark.parametrize("head_dim,base,factor", list(itertools.product(HEAD_DIMS, BASES, FACTORS)))
@pytest.mark.parametrize("seq_len", [None, 100, 4096, 5000, 20000, 65536])
def test_dynamic_matches_transformers(head_dim, base, factor, seq_len):
    ours = rope.rope_frequencies(head_dim, base, "dynamic", factor=factor, max_position=4096, seq_len=seq_len)
    assert_same(ours, hf(hf_config(head_dim, base, "dynamic", factor=factor), "dynamic", seq_len=seq_len))


@pytest.mark.parametrize("head_dim,base,factor", list(itertools.product(HEAD_DIMS, BASES, FACTORS)))
def test_static_ntk_is_dynamic_at_the_stretched_length(head_dim, base, factor):
    """Static NTK with ratio s == transformers' dynamic with factor 1 evaluated at s * max_position."""
    ours = rope.rope_frequencies(head_dim, base, "ntk", factor=factor)
    config = hf_config(head_dim, base, "dynamic", max_position=2048, factor=1.0)
    assert_same(ours, hf(config, "dynamic", seq_len=int(factor * 2048)))


@pytest.mark.parametrize("head_dim,base,factor", list(itertools.product(HEAD_DIMS, BASES, FACTORS)))
def test_ntk_keeps_pair_zero_and_slows_the_last_pair_by_s(head_dim, base, factor):
    default, _ = rope.rope_frequencies(head_dim, base)
    ntk, _ = rope.rope_frequencies(head_dim, base, "ntk", factor=factor)
    assert ntk[0] == default[0]
    torch.testing.assert_close(ntk[-1].double(), default[-1].double() / factor, rtol=1e-5, atol=0)
    # every pair in between is slowed by s ** (2i/(d-2))
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    torch.testing.assert_close(ntk.double(), default.double() / factor ** (2 * i / (head_dim - 2)),
                               rtol=1e-5, atol=0)
    assert rope.ntk_base(base, factor, head_dim) == pytest.approx(base * factor ** (head_dim / (head_dim - 2)))


YARN_VARIANTS = [
    {},
    {"beta_fast": 16, "beta_slow": 2},
    {"beta_fast": 64.0, "beta_slow": 0.5, "truncate": False},
    {"mscale": 1.0, "mscale_all_dim": 0.707},
    {"mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 24},
    {"attention_factor": 1.25},
    {"truncate": False},
]


@pytest.mark.parametrize("head_dim,base,factor", list(itertools.product(HEAD_DIMS, BASES, FACTORS)))
@pytest.mark.parametrize("variant", range(len(YARN_VARIANTS)))
def test_yarn_matches_transformers(head_dim, base, factor, variant):
    extra = YARN_VARIANTS[variant]
    original = 2048
    config = hf_config(head_dim, base, "yarn", max_position=int(factor * original), factor=factor,
                       original_max_position_embeddings=original, **extra)
    ours = rope.rope_frequencies(head_dim, base, "yarn", factor=factor, original_max_position=original, **extra)
    assert_same(ours, hf(config, "yarn"))


def test_yarn_infers_factor_and_original_length_like_transformers():
    # factor None -> max_position / original_max_position
    config = hf_config(64, 10000.0, "yarn", max_position=16384, factor=None, original_max_position_embeddings=4096)
    ours = rope.rope_frequencies(64, 10000.0, "yarn", factor=None, max_position=16384, original_max_position=4096)
    assert_same(ours, hf(config, "yarn"))
    # no original length -> max_position is the pre-training length
    config = hf_config(64, 10000.0, "yarn", max_position=4096, factor=4.0)
    assert_same(rope.rope_frequencies(64, 10000.0, "yarn", factor=4.0, max_position=4096), hf(config, "yarn"))


@pytest.mark.parametrize("head_dim,base,factor", list(itertools.product(HEAD_DIMS, BASES, FACTORS)))
@pytest.mark.parametrize("low,high,original", [(1.0, 4.0, 8192), (2.0, 8.0, 2048), (1.0, 2.0, 512)])
def test_llama3_matches_transformers(head_dim, base, factor, low, high, original):
    config = hf_config(head_dim, base, "llama3", max_position=int(factor * original), factor=factor,
                       low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original)
    ours = rope.rope_frequencies(head_dim, base, "llama3", factor=factor, original_max_position=original,
                                 low_freq_factor=low, high_freq_factor=high)
    assert_same(ours, hf(config, "llama3"))


@pytest.mark.parametrize("method", ["linear", "dynamic", "yarn", "llama3"])
def test_partial_rotary_factor_matches_transformers(method):
    extra = {"yarn": dict(original_max_position_embeddings=1024),
             "llama3": dict(original_max_position_embeddings=1024, low_freq_factor=1.0, high_freq_factor=4.0)}
    config = hf_config(80, 10000.0, method, factor=4.0, partial_rotary_factor=0.5, **extra.get(method, {}))
    kwargs = {k.replace("_embeddings", ""): v for k, v in extra.get(method, {}).items()}
    ours = rope.rope_frequencies(80, 10000.0, method, factor=4.0, max_position=4096, seq_len=9000,
                                 partial_rotary_factor=0.5, **kwargs)
    assert ours[0].shape == (20,)
    assert_same(ours, hf(config, method, seq_len=9000))


def test_yarn_keeps_fast_pairs_and_interpolates_slow_pairs():
    default, _ = rope.rope_frequencies(128, 10000.0)
    yarn, scale = rope.rope_frequencies(128, 10000.0, "yarn", factor=8.0, original_max_position=4096)
    low, high = rope.yarn_correction_range(128, 10000.0, 4096, 32, 1)
    assert 0 < low < high < 64
    assert torch.equal(yarn[: low + 1], default[: low + 1])
    torch.testing.assert_close(yarn[high:], default[high:] / 8.0, rtol=1e-6, atol=0)
    assert scale == pytest.approx(0.1 * math.log(8.0) + 1)
    # the pairs it keeps turn more than beta_fast times over the trained length
    turns = 4096 / rope.wavelengths(default)
    assert (turns[: low + 1] > 32).all() and (turns[high:] < 1).all()


def test_dynamic_is_default_up_to_the_trained_length():
    default, _ = rope.rope_frequencies(64)
    for seq_len in (1, 100, 2048):
        dyn, _ = rope.rope_frequencies(64, method="dynamic", factor=4.0, max_position=2048, seq_len=seq_len)
        assert torch.equal(dyn, default)
    longer, _ = rope.rope_frequencies(64, method="dynamic", factor=4.0, max_position=2048, seq_len=4096)
    assert (longer[1:] < default[1:]).all()


# ---------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs,match", [
    (dict(method="rope2"), r"unknown RoPE method 'rope2'; known methods: default, linear"),
    (dict(method=None), r"unknown RoPE method None"),
    (dict(method="linear"), r"method 'linear' needs factor"),
    (dict(method="linear", factor=0.5), r"factor must be >= 1 for method 'linear'"),
    (dict(method="ntk", factor="2"), r"factor must be a finite number >= 1 for method 'ntk', got '2'"),
    (dict(method="yarn", factor=True, original_max_position=64), r"factor must be a finite number"),
    (dict(method="linear", factor=float("nan")), r"factor must be a finite number"),
    (dict(method="default", factor=2.0), r"method 'default' does not scale"),
    (dict(method="dynamic", factor=2.0), r"method 'dynamic' needs max_position"),
    (dict(method="dynamic", factor=2.0, max_position=64, seq_len=0), r"seq_len must be a positive int"),
    (dict(method="yarn", factor=2.0), r"method 'yarn' needs original_max_position"),
    (dict(method="yarn"), r"method 'yarn' needs factor, or both max_position and original_max_position"),
    (dict(method="yarn", factor=2.0, max_position=64, beta_fast=1, beta_slow=2),
     r"beta_fast \(1\) must be >= beta_slow \(2\)"),
    (dict(method="yarn", factor=2.0, max_position=64, beta_slow=0), r"beta_slow must be > 0"),
    (dict(method="yarn", factor=2.0, max_position=64, attention_factor=-1.0), r"attention_factor must be > 0"),
    (dict(method="yarn", factor=2.0, max_position=64, mscale="big"), r"mscale must be a finite number"),
    (dict(method="yarn", factor=2.0, max_position=64, truncate=1), r"truncate must be a bool"),
    (dict(method="llama3", factor=8.0, original_max_position=8192, high_freq_factor=4.0),
     r"method 'llama3' needs low_freq_factor"),
    (dict(method="llama3", factor=8.0, max_position=8192, low_freq_factor=1.0),
     r"method 'llama3' needs high_freq_factor"),
    (dict(method="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
     r"method 'llama3' needs original_max_position"),
    (dict(method="llama3", factor=8.0, max_position=8192, low_freq_factor=4.0, high_freq_factor=1.0),
     r"high_freq_factor \(1\) must be > low_freq_factor \(4\)"),
    (dict(method="linear", factor=2.0, beta_fast=3), r"unknown parameter\(s\) \['beta_fast'\] for method 'linear'"),
    (dict(base=1.0), r"base must be > 1"),
    (dict(base="10000"), r"base must be a finite number"),
    (dict(original_max_position=-5, method="yarn", factor=2.0), r"original_max_position must be a positive int"),
    (dict(max_position=1.5, method="dynamic", factor=2.0), r"max_position must be a positive int"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\]"),
    (dict(partial_rotary_factor=0.3), r"rotary dimension .* = 19 must be even"),
])
def test_invalid_arguments_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope.rope_frequencies(64, **kwargs)


@pytest.mark.parametrize("head_dim", [0, -2, 2.0, True])
def test_head_dim_must_be_a_positive_int(head_dim):
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        rope.rope_frequencies(head_dim)


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="must be even"):
        rope.rope_frequencies(63)


# ---------------------------------------------------------------------------------------------- helpers

@pytest.mark.parametrize("method,kw", [("default", {}), ("yarn", dict(factor=4.0, original_max_position=512))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cos_sin_tables_match_llama_rotary_embedding(method, kw, dtype):
    config = hf_config(64, 10000.0, method, max_position=2048,
                       **({"factor": 4.0, "original_max_position_embeddings": 512} if method == "yarn" else {}))
    emb = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 17, 511, 2047]])
    cos_hf, sin_hf = emb(torch.zeros(1, dtype=dtype), positions)
    inv, scale = rope.rope_frequencies(64, 10000.0, method, **kw)
    cos, sin = rope.rope_cos_sin(inv, positions, scale, dtype=dtype)
    assert cos.dtype == dtype and cos.shape == cos_hf.shape
    torch.testing.assert_close(cos, cos_hf, rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_hf, rtol=0, atol=0)
    full_cos, _ = rope.rope_cos_sin(inv, 2048, scale, dtype=dtype)
    assert full_cos.shape == (2048, 64)
    torch.testing.assert_close(full_cos[positions[0]], cos[0], rtol=0, atol=0)


def test_cos_sin_rejects_bad_inputs():
    with pytest.raises(ValueError, match="inv_freq must be a 1-D tensor"):
        rope.rope_cos_sin(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="positions must be an int or an integer tensor"):
        rope.rope_cos_sin(torch.ones(4), torch.arange(4.0))


@pytest.mark.parametrize("positions_kind", ["none", "1d", "2d"])
def test_reference_matches_transformers_apply_rotary_pos_emb(positions_kind):
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, T, D = 2, 6, 2, 17, 80
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, Hkv, T, D, generator=gen)
    inv, scale = rope.rope_frequencies(D, 500000.0, "yarn", factor=4.0, original_max_position=64)
    cos, sin = rope.rope_cos_sin(inv, 300, scale)
    positions = {"none": None, "1d": torch.arange(T) + 200,
                 "2d": torch.randint(0, 300, (B, T), generator=gen)}[positions_kind]
    pos2d = (torch.arange(T) if positions is None else positions).expand(B, T)
    q_ref, k_ref = rope.apply_rope_ref(q, k, cos, sin, positions)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos[pos2d], sin[pos2d])
    torch.testing.assert_close(q_ref, q_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_ref, k_hf, rtol=1e-6, atol=1e-6)


def test_rotation_preserves_norms_and_depends_on_relative_position_only():
    gen = torch.Generator().manual_seed(0)
    D = 64
    inv, _ = rope.rope_frequencies(D)
    angles = torch.arange(1000, dtype=torch.float64)[:, None] * inv.double()   # float64 angles: exact check
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    scores = []
    for m, n in [(10, 3), (500, 493), (907, 900)]:
        qm, _ = rope.apply_rope_ref(q, k, cos, sin, torch.tensor([m]))
        _, kn = rope.apply_rope_ref(q, k, cos, sin, torch.tensor([n]))
        torch.testing.assert_close(qm.norm(), q.norm())
        scores.append((qm * kn).sum())
    torch.testing.assert_close(scores[0], scores[1])
    torch.testing.assert_close(scores[0], scores[2])


def test_wavelengths_and_max_angles_identify_the_low_frequency_pairs():
    D, L = 64, 2048
    inv, _ = rope.rope_frequencies(D)
    lam = rope.wavelengths(inv)
    torch.testing.assert_close(lam.double(), 2 * math.pi * 10000.0 ** (torch.arange(0, D, 2).double() / D),
                               rtol=1e-6, atol=0)
    ranges = rope.max_angles(inv, L, 4 * L)
    torch.testing.assert_close(ranges.trained, (L - 1) * inv.double())
    torch.testing.assert_close(ranges.target, (4 * L - 1) * inv.double())
    # unseen exactly where the wavelength is longer than what training covered: the slow (last) pairs
    expected = (L - 1) * inv.double() < 2 * math.pi
    assert torch.equal(ranges.unseen, expected)
    first_unseen = int(ranges.unseen.nonzero()[0])
    assert ranges.unseen[first_unseen:].all() and not ranges.unseen[:first_unseen].any()
    assert first_unseen > D // 4   # the fast half of the pairs is never out of range
    # position interpolation by the same factor maps every position below 4L to an angle below L * theta
    pi, _ = rope.rope_frequencies(D, method="linear", factor=4.0)
    assert (rope.max_angles(pi, L, 4 * L).target < L * inv.double()).all()
    with pytest.raises(ValueError, match="train_length must be a positive int"):
        rope.max_angles(inv, 0, 10)


# ---------------------------------------------------------------------------------------------- exercises

from labsrc.exercises import ExerciseFailed  # noqa: E402
from labsrc.exercises import rope as ex  # noqa: E402


def _stub(*args):
    raise NotImplementedError


def wavelength_right(i, head_dim, base):
    return 2 * math.pi * base ** (2 * i / head_dim)


def wavelength_wrong(i, head_dim, base):          # forgets the 2 pi: 1 / theta_i is tokens per radian
    return base ** (2 * i / head_dim)


EXERCISES = [
    (ex.check_wavelength, wavelength_right, wavelength_wrong),
]


@pytest.mark.parametrize("check,right,wrong", EXERCISES)
def test_exercise_checks(check, right, wrong, monkeypatch, capsys):
    monkeypatch.delenv("LAB_EXERCISES", raising=False)
    assert check(right).status == "passed"
    failed = check(wrong)
    assert failed.status == "failed" and "Hint" in failed.message
    assert check(_stub).status == "not solved yet"
    monkeypatch.setenv("LAB_EXERCISES", "strict")
    with pytest.raises(ExerciseFailed):
        check(wrong)
    assert check(right).passed


# ------------------------------------------------------------------ every public function checks its inputs
# Each of these used to raise ZeroDivisionError/RuntimeError/AttributeError, or return NaN, inf or a
# silently wrong table. Now: ValueError naming the argument.
NAN, INF = float("nan"), float("inf")
BAD_CALLS = [
    (lambda: rope.rope_frequencies(2, method="dynamic", factor=2.0, max_position=8), "rotary dimension > 2"),
    (lambda: rope.dynamic_frequencies(2, 1e4, 2.0, 8, None), "rotary dimension > 2"),
    (lambda: rope.default_frequencies(0, 1e4), r"dim \(the rotary dimension\) must be an even int >= 2"),
    (lambda: rope.default_frequencies(7, 1e4), r"dim \(the rotary dimension\) must be an even int >= 2"),
    (lambda: rope.default_frequencies(8, NAN), "base must be a finite number"),
    (lambda: rope.linear_frequencies(8, 1e4, 0), "factor must be >= 1"),
    (lambda: rope.ntk_base(1e4, NAN, 8), "factor must be a finite number"),
    (lambda: rope.yarn_attention_scaling(NAN), "factor must be a finite number"),
    (lambda: rope.yarn_attention_scaling(4.0, NAN, 1.0), "mscale must be a finite number"),
    (lambda: rope.yarn_attention_scaling(math.e, 1.0, -10.0), "mscale_all_dim=-10.0 makes .* zero"),
    (lambda: rope.yarn_correction_range(8, 1.0, 64, 32, 1), "base must be > 1"),
    (lambda: rope.yarn_correction_range(8, 1e4, 64, 0, 1), "beta_fast must be > 0"),
    (lambda: rope.yarn_correction_range(8, 1e4, 64, 32, 1, truncate="yes"), "truncate must be a bool"),
    (lambda: rope.yarn_frequencies(8, 1e4, 4.0, 64, attention_factor=INF), "attention_factor must be a finite"),
    (lambda: rope.llama3_frequencies(8, 1e4, 8.0, 64, 2.0, 2.0), r"high_freq_factor \(2\) must be > low_freq"),
    (lambda: rope.rope_cos_sin(torch.ones(4), -3), "positions must be a non-negative int"),
    (lambda: rope.rope_cos_sin(torch.ones(4), 3, NAN), "attention_scaling must be a finite number"),
    (lambda: rope.rope_cos_sin(torch.ones(4), 3, 1.0, torch.int32), "dtype must be a floating-point"),
    (lambda: rope.rope_cos_sin(torch.tensor([1.0, NAN]), 3), "inv_freq must hold finite positive"),
    (lambda: rope.rope_cos_sin(torch.ones(4, dtype=torch.int64), 3), "inv_freq must be a floating-point"),
    (lambda: rope.rotate_half(torch.arange(5.0)), "last dimension of x must be even"),
    (lambda: rope.rotate_half([1.0, 2.0]), "x must be a tensor"),
    (lambda: rope.wavelengths(torch.zeros(2)), "inv_freq must hold finite positive"),
    (lambda: rope.wavelengths([1.0]), "inv_freq must be a 1-D tensor"),
    (lambda: rope.max_angles([1.0], 4, 8), "inv_freq must be a 1-D tensor"),
]


@pytest.mark.parametrize("call,match", BAD_CALLS, ids=[m[:40] for _, m in BAD_CALLS])
def test_public_functions_raise_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_reference_rejects_negative_positions_and_zero_head_dim():
    """``cos[positions]`` used to wrap -1 to the last row of the table, and D = 0 passed silently."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 6\) .* got values in \[-1, 1\]"):
        rope.apply_rope_ref(q, k, cos, sin, torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="head dim D of q and k must be even and positive"):
        rope.apply_rope_ref(q[..., :0], k[..., :0], cos[:, :0], sin[:, :0])


# ------------------------------------------------------------------ property-based
from hypothesis import given, settings, strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=25, deadline=None)
_BAD_NUMBERS = st.one_of(st.just(NAN), st.just(INF), st.just(-INF), st.floats(-1e6, 1.0), st.booleans(),
                         st.text(max_size=2), st.none())


@_SETTINGS
@given(half=st.integers(1, 64), base=st.floats(1.5, 1e6), factor=st.floats(1.0, 64.0))
def test_property_method_identities(half, base, factor):
    dim = 2 * half
    default, scale = rope.default_frequencies(dim, base)
    assert scale == 1.0 and default.shape == (half,) and torch.isfinite(default).all()
    assert bool((default[1:] < default[:-1]).all()) or half == 1 or base < 2     # a ladder of slower pairs
    linear, _ = rope.linear_frequencies(dim, base, factor)
    torch.testing.assert_close(linear, default / factor)
    if dim > 2:
        ntk, _ = rope.ntk_frequencies(dim, base, factor)
        assert ntk[0] == default[0]                                            # pair 0 is never slowed
        torch.testing.assert_close(ntk[-1], default[-1] / factor, rtol=1e-4, atol=0)


@_SETTINGS
@given(name=st.sampled_from(["dim", "base", "factor"]), bad=_BAD_NUMBERS)
def test_property_bad_numbers_are_refused(name, bad):
    args = dict(dim=16, base=1e4, factor=2.0)
    args[name] = bad
    if name == "base" and isinstance(bad, float) and bad > 1:
        return  # a valid base
    if name == "factor" and isinstance(bad, float) and bad >= 1:
        return
    with pytest.raises(ValueError, match=f"{name}"):
        rope.linear_frequencies(args["dim"], args["base"], args["factor"])
    with pytest.raises(ValueError, match=f"{name}"):
        rope.ntk_frequencies(args["dim"], args["base"], args["factor"])


@_SETTINGS
@given(bad=_BAD_NUMBERS, which=st.sampled_from(["beta_fast", "beta_slow", "original_max_position"]))
def test_property_yarn_range_refuses_bad_arguments(bad, which):
    args = dict(dim=16, base=1e4, original_max_position=64, beta_fast=32, beta_slow=1)
    args[which] = bad
    if which != "original_max_position" and isinstance(bad, float) and bad > 0 and math.isfinite(bad):
        return
    with pytest.raises(ValueError, match=which):
        rope.yarn_correction_range(**args)
