"""Tests of labsrc.kv_cache: the exact figures the chapter quotes, each formula against an independent count,
and the bytes a transformers DynamicCache really holds."""
import labsrc  # noqa: F401

import math

import numpy as np
import pytest
import torch

from labsrc import hardware, kv_cache
from labsrc.kv_cache import GiB, PRESETS


# --- the figures the chapter quotes ------------------------------------------------------------------------
def test_source_70b_mha_example_is_320_gib():
    assert kv_cache.kv_cache_bytes(80, 64, 128, 131072) == 343_597_383_680
    assert kv_cache.kv_cache_bytes(80, 64, 128, 131072) == 320 * GiB
    assert PRESETS["source-70B-MHA"].kv_cache_bytes(131072) == 320 * GiB


def test_real_llama3_70b_with_gqa_is_40_gib():
    assert kv_cache.kv_cache_bytes(80, 8, 128, 131072) == 40 * GiB
    assert kv_cache.gqa_cache_bytes(80, 64, 8, 128, 131072) == 40 * GiB
    assert PRESETS["Llama-3-70B"].kv_cache_bytes(131072) == 40 * GiB
    # the same model with its 64 query heads each keeping K/V is the source's figure
    assert PRESETS["Llama-3-70B"].kv_cache_bytes(131072, grouping="mha") == 320 * GiB
    assert PRESETS["Llama-3-70B"].kv_cache_bytes(131072, grouping="mqa") == 5 * GiB


def test_per_token_figures():
    assert PRESETS["Llama-3-8B"].kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert PRESETS["Llama-3-70B"].kv_bytes_per_token() == 320 * 1024
    assert kv_cache.kv_bytes_per_token(80, 8, 128) == 327_680


def test_deepseek_mla_figures():
    v2, v3 = PRESETS["DeepSeek-V2"], PRESETS["DeepSeek-V3"]
    assert (v2.kv_lora_rank, v2.qk_rope_head_dim, v2.n_layers) == (512, 64, 60)
    assert (v3.kv_lora_rank, v3.qk_rope_head_dim, v3.n_layers) == (512, 64, 61)
    assert v2.kv_bytes_per_token() == 60 * 576 * 2 == 69_120
    assert v3.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert kv_cache.mla_cache_bytes(61, 512, 64, 131072) == 61 * 576 * 131072 * 2
    # the DeepSeek-V2 paper: MLA costs as much as GQA with 2.25 groups of head_dim 128
    assert kv_cache.mla_equivalent_kv_heads(512, 64, 128) == 2.25
    # against the MHA it replaces (128 heads x 128) the cache is 32768/576 ~ 57x smaller per layer
    assert v2.kv_bytes_per_token(grouping="mha") / v2.kv_bytes_per_token() == pytest.approx(60 * 2 * 128 * 128 / (60 * 576))
    # against a GQA layer with 8 K/V heads (Llama-3) it is only 2048/576 ~ 3.6x smaller
    assert kv_cache.kv_cache_bytes(1, 8, 128, 1) / kv_cache.mla_cache_bytes(1, 512, 64, 1) == pytest.approx(2048 / 576)


def test_mqa_gqa_mha_heads():
    assert kv_cache.kv_heads(64, "mha") == 64
    assert kv_cache.kv_heads(64, "mqa") == 1
    assert kv_cache.kv_heads(64, "gqa", 8) == 8
    mha = kv_cache.kv_cache_bytes(32, kv_cache.kv_heads(32, "mha"), 128, 1000)
    gqa = kv_cache.kv_cache_bytes(32, kv_cache.kv_heads(32, "gqa", 8), 128, 1000)
    mqa = kv_cache.kv_cache_bytes(32, kv_cache.kv_heads(32, "mqa"), 128, 1000)
    assert mha == 4 * gqa == 32 * mqa


def test_mlkv_sharing():
    full = kv_cache.kv_cache_bytes(80, 8, 128, 4096)
    assert kv_cache.mlkv_cache_bytes(80, 1, 8, 128, 4096) == full
    assert kv_cache.mlkv_cache_bytes(80, 2, 8, 128, 4096) * 2 == full
    assert kv_cache.mlkv_cache_bytes(80, 4, 8, 128, 4096) * 4 == full
    # 61 layers in pairs: 31 caches (the last "pair" is a single layer)
    assert kv_cache.mlkv_cache_bytes(61, 2, 8, 128, 10) == kv_cache.kv_cache_bytes(31, 8, 128, 10)
    assert kv_cache.mlkv_cache_bytes(80, 80, 8, 128, 1) == kv_cache.kv_cache_bytes(1, 8, 128, 1)


def test_quantized_cache_bytes_count_scales_and_zero_points():
    elements = 2 * 80 * 8 * 128 * 131072
    groups = elements // 32
    assert kv_cache.quantized_kv_cache_bytes(80, 8, 128, 131072, bits=8, group_size=32) == elements + groups * 4
    assert kv_cache.quantized_kv_cache_bytes(80, 8, 128, 131072, bits=4, group_size=32) == elements // 2 + groups * 4
    assert kv_cache.quantized_kv_cache_bytes(80, 8, 128, 131072, bits=4, group_size=32, zero_point=False) \
        == elements // 2 + groups * 2
    assert kv_cache.quantized_kv_cache_bytes(2, 1, 64, 3, bits=2, group_size=64, scale_bytes=4) == (2 * 2 * 64 * 3) * 2 // 8 + (2 * 2 * 64 * 3 // 64) * 8
    # int4 with group 128 and fp16 scale + zero: 4.25 bits per element, so 3.76x smaller than FP16
    q = kv_cache.quantized_kv_cache_bytes(32, 8, 128, 1000, bits=4, group_size=128)
    assert kv_cache.kv_cache_bytes(32, 8, 128, 1000) / q == pytest.approx(16 / 4.25)


def test_int4_dtype_bytes_gives_fraction_free_count():
    assert kv_cache.kv_cache_bytes(1, 1, 3, 1, dtype_bytes=0.5) == 3
    assert kv_cache.kv_cache_bytes(1, 1, 1, 1, dtype_bytes=0.25) == 0.5


# --- validation: every argument is named ----------------------------------------------------------------
@pytest.mark.parametrize("name,kwargs", [
    ("n_layers", dict(n_layers=0)), ("n_kv_heads", dict(n_kv_heads=-8)), ("head_dim", dict(head_dim=0)),
    ("seq_len", dict(seq_len=0)), ("batch", dict(batch=0)), ("dtype_bytes", dict(dtype_bytes=0)),
    ("seq_len", dict(seq_len=1.5)), ("n_layers", dict(n_layers=True)), ("dtype_bytes", dict(dtype_bytes=float("nan"))),
])
def test_kv_cache_bytes_rejects(name, kwargs):
    args = dict(n_layers=2, n_kv_heads=2, head_dim=4, seq_len=5, batch=1, dtype_bytes=2) | kwargs
    with pytest.raises(ValueError, match=name):
        kv_cache.kv_cache_bytes(**args)


def test_heads_that_do_not_divide():
    with pytest.raises(ValueError, match=r"n_kv_heads \(6\) must divide n_heads \(64\)"):
        kv_cache.gqa_cache_bytes(80, 64, 6, 128, 10)
    with pytest.raises(ValueError, match="n_kv_heads"):
        kv_cache.kv_heads(64, "gqa", 0)
    with pytest.raises(ValueError, match="n_kv_heads is required"):
        kv_cache.kv_heads(64, "gqa")
    with pytest.raises(ValueError, match="grouping"):
        kv_cache.kv_heads(64, "mla")
    with pytest.raises(ValueError, match="n_heads"):
        kv_cache.kv_heads(0, "mha")


def test_other_validation():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        kv_cache.mla_cache_bytes(60, 0, 64, 10)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        kv_cache.mla_cache_bytes(60, 512, -1, 10)
    with pytest.raises(ValueError, match="layers_per_kv"):
        kv_cache.mlkv_cache_bytes(8, 0, 8, 128, 10)
    with pytest.raises(ValueError, match=r"layers_per_kv \(9\) cannot exceed n_layers \(8\)"):
        kv_cache.mlkv_cache_bytes(8, 9, 8, 128, 10)
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide head_dim \(128\)"):
        kv_cache.quantized_kv_cache_bytes(8, 8, 128, 10, group_size=48)
    with pytest.raises(ValueError, match="bits"):
        kv_cache.quantized_kv_cache_bytes(8, 8, 128, 10, bits=3)
    with pytest.raises(ValueError, match="hbm_bytes_per_s"):
        kv_cache.decode_time_floor(1e9, 0, 0)
    with pytest.raises(ValueError, match="kv_bytes"):
        kv_cache.decode_time_floor(1e9, -1, 1e9)
    with pytest.raises(ValueError, match="max_len"):
        kv_cache.reservation_utilisation([5, 10], 8)
    with pytest.raises(ValueError, match="lengths"):
        kv_cache.reservation_utilisation([], 8)
    with pytest.raises(ValueError, match="n_query"):
        kv_cache.forward_flops(10, 1, 4, 5, 4)


# --- the memory wall --------------------------------------------------------------------------------------
def test_bandwidth_floor_and_crossover():
    h100 = hardware.ACCELERATORS["H100-SXM"]
    m = PRESETS["Llama-3-8B"]
    w, per_tok = m.weight_bytes(), m.kv_bytes_per_token()
    ctx = kv_cache.kv_equals_weights_context(w, per_tok)
    assert ctx * per_tok == pytest.approx(w)
    assert ctx == pytest.approx(8.03e9 * 2 / 131072)
    # at the crossover the floor is exactly twice the weights-only floor
    t0 = kv_cache.decode_time_floor(w, 0, h100.hbm_gbps * 1e9)
    assert kv_cache.decode_time_floor(w, ctx * per_tok, h100.hbm_gbps * 1e9) == pytest.approx(2 * t0)
    ceiling = kv_cache.tokens_per_s_ceiling(w, per_tok, np.array([0.0, ctx]), h100.hbm_gbps * 1e9)
    assert ceiling[0] == pytest.approx(1 / t0) and ceiling[1] == pytest.approx(0.5 / t0)
    # a batch shares the weight read: B tokens per step
    b4 = kv_cache.tokens_per_s_ceiling(w, per_tok, 0, h100.hbm_gbps * 1e9, batch=4)
    assert b4 == pytest.approx(4 / t0)
    assert kv_cache.kv_equals_weights_context(w, per_tok, batch=4) == pytest.approx(ctx / 4)


def test_sequences_that_fit():
    assert kv_cache.sequences_that_fit(80e9, 10e9) == 8
    assert kv_cache.sequences_that_fit(80e9, 10e9, weight_bytes=16e9) == 6
    assert kv_cache.sequences_that_fit(80e9, 10e9, weight_bytes=141e9) == 0


# --- FLOPs: the formula against an independent count by torch's FlopCounterMode -------------------------------
def _tiny_llama(n_kv_heads=2, attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=n_kv_heads, max_position_embeddings=128, attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_flops_match_flop_counter(use_cache):
    from torch.utils.flop_counter import FlopCounterMode
    model = _tiny_llama()
    layer_params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, use_cache=use_cache,
                             pad_token_id=0)
    assert out.shape[1] == 12
    expected = kv_cache.generation_flops(layer_params, 3, 64, 7, 5, use_cache, lm_head_params=model.lm_head.weight.numel(),
                                         full_square=True)
    assert counter.get_total_flops() == expected


def test_causal_flops_are_about_half_the_square():
    causal = kv_cache.forward_flops(1, 1, 1, 100, 100) - 2 * 100
    square = kv_cache.forward_flops(1, 1, 1, 100, 100, full_square=True) - 2 * 100
    assert causal == 4 * 5050 and square == 4 * 10000
    assert kv_cache.forward_flops(1, 1, 1, 1, 100) == kv_cache.forward_flops(1, 1, 1, 1, 100, full_square=True)


def test_cache_saves_flops():
    with_cache = kv_cache.generation_flops(10**6, 4, 128, 16, 48, True)
    without = kv_cache.generation_flops(10**6, 4, 128, 16, 48, False)
    assert without > 10 * with_cache


# --- measured equals computed: a transformers DynamicCache --------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads,dtype,batch", [(4, torch.float32, 1), (2, torch.float16, 3), (1, torch.bfloat16, 2)])
def test_dynamic_cache_bytes_equal_formula(n_kv_heads, dtype, batch):
    from transformers import DynamicCache
    model = _tiny_llama(n_kv_heads, attn="sdpa").to(dtype)
    cfg = model.config
    cache = DynamicCache(config=cfg)
    ids = torch.randint(0, 97, (batch, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)   # one decode step adds one token
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert cache.get_seq_length() == 12
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert held == kv_cache.kv_cache_bytes(cfg.num_hidden_layers, n_kv_heads, head_dim, 12, batch,
                                           torch.finfo(dtype).bits // 8)


# --- fragmentation -------------------------------------------------------------------------------------------
def test_request_mix_is_seeded_and_bounded():
    a = kv_cache.sample_request_lengths(500, 2048, seed=3)
    b = kv_cache.sample_request_lengths(500, 2048, seed=3)
    assert np.array_equal(a, b) and a.min() >= 1 and a.max() <= 2048
    assert not np.array_equal(a, kv_cache.sample_request_lengths(500, 2048, seed=4))


def test_utilisation():
    assert kv_cache.reservation_utilisation([512, 1024, 2048], 2048) == pytest.approx(3584 / 6144)
    assert kv_cache.paged_utilisation([1, 16, 17], 16) == pytest.approx(34 / 64)
    assert kv_cache.paged_utilisation([5, 7], 1) == 1.0
    lengths = kv_cache.sample_request_lengths(1000, 4096, seed=0)
    assert kv_cache.paged_utilisation(lengths, 16) > kv_cache.reservation_utilisation(lengths, 4096)


def test_presets_are_consistent():
    for preset in PRESETS.values():
        assert preset.n_heads % preset.n_kv_heads == 0
        assert preset.n_active_params <= preset.n_params
        assert preset.source
        assert preset.kv_bytes_per_token() > 0 and math.isfinite(preset.weight_bytes())


def test_calculator():
    row = kv_cache.calculator("Llama-3-8B", 131072, batch=2, dtype="bf16")
    assert row["kv_bytes"] == 2 * 16 * GiB and row["kv_gib"] == 32
    # 80 GB card, 16.06 GB of weights: (80 - 16.06) / 17.18 GB per sequence -> 3 sequences
    assert row["fit_80GB"] == int((80e9 - 8.03e9 * 2) // (16 * GiB)) == 3
    assert row["kv_only_fit_141GB"] == int(141e9 // (16 * GiB))
    assert kv_cache.calculator("Llama-3-70B", 131072)["fit_80GB"] == 0          # 141 GB of weights
    assert kv_cache.calculator("Llama-3-70B", 131072, grouping="mha")["kv_gib"] == 320
    assert kv_cache.calculator("DeepSeek-V3", 4096)["kv_bytes"] == 70_272 * 4096
    assert kv_cache.calculator("Llama-3-8B", 1000, dtype="fp8")["kv_bytes"] == 64 * 1024 * 1000
    int4 = kv_cache.calculator("Llama-3-8B", 1000, dtype="int4")["kv_bytes"]
    assert int4 == kv_cache.quantized_kv_cache_bytes(32, 8, 128, 1000, bits=4, group_size=32)
    mla8 = kv_cache.calculator("DeepSeek-V2", 10, dtype="int8")["kv_bytes"]
    assert mla8 == 60 * 576 * 10 + 60 * 576 * 10 // 32 * 4
    with pytest.raises(ValueError, match="dtype"):
        kv_cache.calculator("Llama-3-8B", 10, dtype="fp4")
    with pytest.raises(ValueError, match="group_size"):
        kv_cache.calculator("DeepSeek-V2", 10, dtype="int4", group_size=100)


# --- validation promises kept: every public function names a bad argument -----------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("call,match", [
    # used to raise KeyError
    (lambda: kv_cache.calculator("Llama-9-1T", 10), r"unknown preset 'Llama-9-1T'; known presets: source-70B-MHA"),
    (lambda: kv_cache.calculator(3, 10), "preset must be a ModelPreset"),
    (lambda: kv_cache.calculator("Llama-3-8B", 10, memories_gb=(80, NAN)), "memories_gb must be a positive number"),
    (lambda: kv_cache.calculator("Llama-3-8B", 10, memories_gb=80), "memories_gb must be a sequence"),
    (lambda: kv_cache.calculator("Llama-3-8B", NAN), "seq_len must be a positive integer"),
    (lambda: kv_cache.calculator("Llama-3-8B", 10, batch=True), "batch must be a positive integer"),
    (lambda: kv_cache.calculator("Llama-3-8B", 10, group_size=1.5), "group_size must be a positive integer"),
    # used to return NaN
    (lambda: kv_cache.decode_time_floor(1e9, NAN, 1e9), "kv_bytes must be a non-negative number"),
    (lambda: kv_cache.tokens_per_s_ceiling(1e9, 1e5, [1.0, NAN], 1e12), "context must be non-negative and finite"),
    (lambda: kv_cache.tokens_per_s_ceiling(1e9, 1e5, INF, 1e12), "context must be non-negative and finite"),
    (lambda: PRESETS["Llama-3-8B"].weight_bytes(NAN), "dtype_bytes must be a positive number"),
    # used to raise a ValueError/TypeError that named nothing, or a bare TypeError from a comparison
    (lambda: kv_cache.tokens_per_s_ceiling(1e9, 1e5, "long", 1e12), "context must be a non-negative number"),
    (lambda: kv_cache.decode_time_floor(1e9, "x", 1e9), "kv_bytes must be a non-negative number"),
    (lambda: kv_cache.sequences_that_fit(80e9, 1e9, NAN), "weight_bytes must be a non-negative number"),
    (lambda: kv_cache.sequences_that_fit(80e9, 1e9, "w"), "weight_bytes must be a non-negative number"),
    (lambda: kv_cache.sample_request_lengths(4, 100, seed=-1), "seed must be a non-negative integer"),
    (lambda: kv_cache.sample_request_lengths(4, 100, seed=1.5), "seed must be a non-negative integer"),
    # float-where-int and non-bool flags used to be accepted
    (lambda: kv_cache.forward_flops(10, 1, 4, 2, 4, lm_head_params=2.5), "lm_head_params must be a non-negative integer"),
    (lambda: kv_cache.forward_flops(10, 1, 4, 2, 4, lm_head_params=NAN), "lm_head_params must be a non-negative integer"),
    (lambda: kv_cache.forward_flops(10, 1, 4, 2, 4, full_square="no"), "full_square must be a bool"),
    (lambda: kv_cache.generation_flops(10, 1, 4, 2, 3, use_cache="no"), "use_cache must be a bool"),
    (lambda: kv_cache.quantized_kv_cache_bytes(8, 8, 128, 10, bits=8.0), r"bits must be 2, 4 or 8 \(an int\)"),
    (lambda: kv_cache.quantized_kv_cache_bytes(8, 8, 128, 10, bits=True), "bits must be 2, 4 or 8"),
    (lambda: kv_cache.quantized_kv_cache_bytes(8, 8, 128, 10, zero_point="no"), "zero_point must be a bool"),
    (lambda: PRESETS["Llama-3-8B"].weight_bytes(2, active="yes"), "active must be a bool"),
])
def test_public_functions_raise_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_hardware_lookup_refuses_a_non_string():
    with pytest.raises(TypeError, match="device_name must be a str"):   # AttributeError before
        hardware.lookup(None)
    assert hardware.lookup("NVIDIA H200").name == "H200"


@pytest.mark.parametrize("preset", ["Llama-3-8B", "Llama-3-70B", "source-70B-MHA"])
@pytest.mark.parametrize("group_size", [1, 3, 16, 32, 48, 64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_calculator_and_byte_formula_accept_the_same_group_sizes(preset, group_size, dtype, bits):
    """The calculator used to accept any group dividing 2 * n_kv_heads * head_dim (e.g. 256 for Llama-3-8B)
    that quantized_kv_cache_bytes rejects; both now use one check and one formula."""
    p = PRESETS[preset]

    def formula():
        return kv_cache.quantized_kv_cache_bytes(p.n_layers, p.n_kv_heads, p.head_dim, 1000, 2, bits=bits,
                                                 group_size=group_size)

    def calc():
        return kv_cache.calculator(preset, 1000, 2, dtype=dtype, group_size=group_size)["kv_bytes"]

    if p.head_dim % group_size:
        for fn in (formula, calc):
            with pytest.raises(ValueError, match=rf"group_size \({group_size}\) must divide head_dim \(128\)"):
                fn()
    else:
        assert calc() == formula()


def test_calculator_mla_groups_run_along_the_latent():
    with pytest.raises(ValueError, match=r"group_size \(128\) must divide the MLA latent row .* \(576\)"):
        kv_cache.calculator("DeepSeek-V2", 10, dtype="int4", group_size=128)
    assert kv_cache.calculator("DeepSeek-V2", 10, dtype="int4", group_size=64)["kv_bytes"] == 60 * 576 * 10 // 2 + 60 * 576 * 10 // 64 * 4


# --- property-based ---------------------------------------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=30, deadline=None)
_POS = st.integers(1, 512)


@_SETTINGS
@given(n_layers=_POS, n_kv_heads=st.integers(1, 64), head_dim=_POS, seq_len=st.integers(1, 10 ** 6),
       batch=st.integers(1, 64), dtype_bytes=st.sampled_from(sorted(set(kv_cache.DTYPE_BYTES.values()))),
       k=st.integers(1, 9))
def test_property_kv_cache_bytes_is_linear_in_seq_len_and_batch(n_layers, n_kv_heads, head_dim, seq_len, batch,
                                                                dtype_bytes, k):
    base = kv_cache.kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch, dtype_bytes)
    assert kv_cache.kv_cache_bytes(n_layers, n_kv_heads, head_dim, k * seq_len, batch, dtype_bytes) == k * base
    assert kv_cache.kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, k * batch, dtype_bytes) == k * base
    per_token = kv_cache.kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype_bytes)
    assert base == per_token * seq_len * batch
    assert kv_cache.mlkv_cache_bytes(n_layers, 1, n_kv_heads, head_dim, seq_len, batch, dtype_bytes) == base


@_SETTINGS
@given(n_layers=st.integers(1, 100), n_kv_heads=st.integers(1, 16), groups_per_head=st.integers(1, 8),
       group_size=st.sampled_from([8, 16, 32, 64]), seq_len=st.integers(1, 4096), bits=st.sampled_from([2, 4, 8]),
       zero_point=st.booleans())
def test_property_quantized_bytes_are_data_plus_metadata(n_layers, n_kv_heads, groups_per_head, group_size, seq_len,
                                                         bits, zero_point):
    head_dim = group_size * groups_per_head
    elements = kv_cache.kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, dtype_bytes=1)
    q = kv_cache.quantized_kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, bits=bits, group_size=group_size,
                                          zero_point=zero_point)
    assert q == elements * bits / 8 + elements // group_size * 2 * (2 if zero_point else 1)
    assert q < elements * 2                      # always smaller than the fp16 cache


_BAD_INT = st.one_of(st.just(NAN), st.just(INF), st.just(-INF), st.integers(-100, 0), st.booleans(),
                     st.floats(0.1, 100).filter(lambda x: not x.is_integer()), st.text(max_size=2), st.none())


@_SETTINGS
@given(name=st.sampled_from(["n_layers", "n_kv_heads", "head_dim", "seq_len", "batch"]), bad=_BAD_INT)
def test_property_bad_sizes_are_refused_naming_them(name, bad):
    args = dict(n_layers=2, n_kv_heads=2, head_dim=4, seq_len=5, batch=1)
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        kv_cache.kv_cache_bytes(**args)
    with pytest.raises(ValueError, match=name):
        kv_cache.quantized_kv_cache_bytes(**args, group_size=2)


_BAD_NUMBER = st.one_of(st.just(NAN), st.just(INF), st.just(-INF), st.floats(-1e12, 0.0), st.booleans(),
                        st.text(max_size=2), st.none())


@_SETTINGS
@given(which=st.sampled_from(["weight_bytes", "kv_bytes_per_token", "hbm_bytes_per_s"]), bad=_BAD_NUMBER)
def test_property_bad_numbers_are_refused_naming_them(which, bad):
    args = dict(weight_bytes=16e9, kv_bytes_per_token=131072, hbm_bytes_per_s=3.35e12)
    args[which] = bad
    with pytest.raises(ValueError, match=which):
        kv_cache.tokens_per_s_ceiling(args["weight_bytes"], args["kv_bytes_per_token"], 1024, args["hbm_bytes_per_s"])
    if which != "hbm_bytes_per_s":
        with pytest.raises(ValueError, match=which):
            kv_cache.kv_equals_weights_context(args["weight_bytes"], args["kv_bytes_per_token"])


@_SETTINGS
@given(name=st.text(min_size=1, max_size=12).filter(lambda s: s not in PRESETS))
def test_property_unknown_presets_are_a_value_error(name):
    with pytest.raises(ValueError, match="unknown preset"):
        kv_cache.calculator(name, 10)
