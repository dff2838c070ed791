"""How each launchable kernel is compiled without a GPU: its argument types and GPU-profile constexprs.

A launch gives Triton tensors and numbers; compiling ahead of time needs their types instead. For each kernel
(``"<module>.<name>"``, as :mod:`labsrc.gpucheck.discover` finds it) a :class:`Spec` names

* ``types``: every pointer argument and every float scalar, ``"*T"`` being the data dtype (bf16, then fp16);
  every other non-constexpr argument is an ``i32`` scalar (sizes, strides, counts);
* ``constexprs``: the values its wrapper passes at the GPU profile's sizes (the bench's ``gpu`` shapes:
  Llama-like heads, ``D = 128``, 32 query and 8 KV heads), one dict per variant worth compiling;
* for an autotuned kernel, its autotune list supplies the rest of each configuration (block sizes, warps,
  stages): every entry of the list is compiled, for both architectures. ``arch_configs`` names the
  module's config function when the list depends on the GPU (attention's Hopper and Ampere lists);
* for a kernel its wrapper launches directly, ``num_warps`` as the wrapper passes it (Triton's default 4),
  in the Spec or, where it depends on the constexprs, in each constexpr dict;
* ``ints``: the integer arguments that are *not* multiples of 16 at those sizes, with their value (``None``
  where it varies with the shape). Triton specialises every launch on its integers (a multiple of 16 gets a
  divisibility hint that lets loads vectorise; 1 becomes a constant), so the compile check must too: every
  integer argument not named here is compiled as a multiple of 16 (strides of ``D = 128`` rows, lengths of
  1K-64K), and every pointer as 16-byte aligned (:func:`labsrc.gpucheck.compile.launch_attrs`). A value
  that differs between variants goes in each constexpr dict instead (SSD's ``G``, the GEMMs' ``M = 1``).

``UPCAST`` is ``False`` (a GPU's ``tl.dot`` takes bf16; only the interpreter upcasts) and ``PRECISION`` is
``"tf32"`` for 16-bit inputs, as the wrappers set them on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Spec:
    types: dict
    constexprs: list = field(default_factory=lambda: [{}])
    num_warps: int = 4
    arch_configs: str | None = None   # name of the module's config function, called for each architecture
    dtypes: tuple = ("bf16", "fp16")
    not_compiled: str | None = None   # why the kernel is not compiled yet: its rows say so and count as failed
    ints: dict = field(default_factory=dict)   # integer arguments that are not multiples of 16 (module docstring)


_GPU16 = dict(UPCAST=False, PRECISION="tf32")
_SPLIT16 = dict(SPLIT=True, UPCAST=False, PRECISION="ieee")   # the chunked scans' split products on a GPU
# the GEMMs at M = 16 or 256 rows, and at M = 1 (a decode step: Triton makes M = 1 a constant)
_GEMM_ROWS = [dict(**_GPU16), dict(**_GPU16, M=1, M_BUCKET=1)]
_ATT_IO = {n: "*T" for n in ("Q", "K", "V", "O")}
# Integer arguments that are not multiples of 16 at the GPU profile's sizes (see ``Spec.ints``): 32 query heads
# share 8 K/V heads (groups of 4); a decode launch splits each sequence into a count that depends on the batch.
_GQA = dict(GROUP=4)
_SPLIT_DECODE = dict(GROUP=4, Hkv=8, NUM_SPLITS=None, stride_mlh=None)
_GRADS = {"DO": "*T", "LSE": "*fp32", "DELTA": "*fp32", "DK": "*T", "DV": "*T", "DQ": "*T"}

SPECS: dict[str, Spec] = {
    # chapter 3: prefill forward (causal, D = 128), its backward, and flash-decoding with GQA (4 heads per group)
    "flash_attention._flash_attention_kernel": Spec(
        {**_ATT_IO, "LSE": "*fp32", "qk_scale": "fp32"},
        [dict(CAUSAL=True, WRITE_LSE=True, **_GPU16, BLOCK_D=128)], arch_configs="_flash_configs", ints=_GQA),
    "flash_attention._bwd_preprocess_kernel": Spec(
        {"O": "*T", "DO": "*T", "DELTA": "*fp32"}, [dict(BLOCK_M=64, BLOCK_D=128)]),
    "flash_attention._bwd_dkdv_kernel": Spec(
        {**_ATT_IO, **_GRADS, "qk_scale": "fp32", "sm_scale": "fp32"},
        [dict(CAUSAL=True, **_GPU16, BLOCK_D=128)], arch_configs="_bwd_dkdv_configs", ints=dict(_GQA, Hkv=8)),
    "flash_attention._bwd_dq_kernel": Spec(
        {**_ATT_IO, **_GRADS, "qk_scale": "fp32", "sm_scale": "fp32"},
        [dict(CAUSAL=True, **_GPU16, BLOCK_D=128)], arch_configs="_bwd_dq_configs", ints=_GQA),
    "flash_attention._decode_split_kernel": Spec(
        {**_ATT_IO, "SEQ_LENS": "*i32", "MID_O": "*fp32", "MID_LSE": "*fp32", "qk_scale": "fp32"},
        [dict(**_GPU16, BLOCK_G=16, BLOCK_D=128)], arch_configs="_decode_configs", ints=_SPLIT_DECODE),
    "flash_attention._decode_merge_kernel": Spec(
        {"MID_O": "*fp32", "MID_LSE": "*fp32", "O": "*T"},   # 16 splits, and the most (256), as the wrapper warps them
        [dict(BLOCK_S=16, BLOCK_D=128, num_warps=4), dict(BLOCK_S=256, BLOCK_D=128, num_warps=8)],
        ints=dict(NUM_SPLITS=None, stride_mlh=None)),
    # chapter 11 (distillation): a 128K vocabulary row streamed in BLOCK_V chunks
    "distillation._kd_kl_fwd_kernel": Spec(
        {"s_ptr": "*T", "t_ptr": "*T", "kl_ptr": "*fp32", "lse_s_ptr": "*fp32", "lse_t_ptr": "*fp32",
         "inv_T": "fp32"}),
    "distillation._kd_kl_bwd_kernel": Spec(
        {"s_ptr": "*T", "t_ptr": "*T", "lse_s_ptr": "*fp32", "lse_t_ptr": "*fp32", "g_ptr": "*fp32",
         "ds_ptr": "*T", "inv_T": "fp32"}),
    # differential attention: 64 x 64 blocks on a GPU, head dims 64 and 128
    "frontier._diff_attention_kernel": Spec(
        {"Q1": "*T", "K1": "*T", "Q2": "*T", "K2": "*T", "V": "*T", "LAM": "*fp32", "O": "*T", "qk_scale": "fp32"},
        [dict(**_GPU16, BLOCK_M=b, BLOCK_N=b, BLOCK_D=d, BLOCK_DV=2 * d) for b, d in ((64, 64), (32, 128))],
        num_warps=8),
    # the slot-addressed cache write: 1024-element blocks of one (8 heads x 128) row
    "kv_cache._kv_store_kernel": Spec(
        {"k_cache": "*T", "v_cache": "*T", "k_new": "*T", "v_new": "*T", "slots": "*i64"}, [dict(BLOCK=1024)]),
    # KV quantization, D = 128, groups of 128 tokens, INT4 and INT8
    "kv_quant._quantize_pack_kernel": Spec(
        {"x_ptr": "*T", "mean_ptr": "*fp32", "std_ptr": "*fp32", "out_ptr": "*u8", "scale_ptr": "*fp16",
         "zero_ptr": "*fp16"},
        [dict(BITS=b, PACK=8 // b, GROUP=128, BLOCK_T=128, BLOCK_DP=128 * b // 8) for b in (4, 8)], num_warps=8),
    "kv_quant._dequantize_kernel": Spec(
        {"p_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16", "mean_ptr": "*fp32", "std_ptr": "*fp32",
         "out_ptr": "*T"},
        [dict(BITS=b, PACK=8 // b, GROUP=128, BLOCK_T=64, BLOCK_DP=128 * b // 8) for b in (4, 8)], num_warps=8),
    "kv_quant._decode_kernel": Spec(
        {"q_ptr": "*T", "kp_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "kstd_ptr": "*fp32",
         "vp_ptr": "*u8", "vs_ptr": "*fp16", "vz_ptr": "*fp16", "lens_ptr": "*i32", "o_ptr": "*fp32",
         "m_ptr": "*fp32", "l_ptr": "*fp32", "sm_scale": "fp32"},
        [dict(BITS=b, PACK=8 // b, GROUP=128, QPK=4, BLOCK_H=16, BLOCK_T=64, BLOCK_DP=max(16, 128 * b // 8))
         for b in (4, 8)], num_warps=8, ints=dict(Hkv=8)),
    # chunked linear attention and Gated DeltaNet: chunks of 32 (the bench's GPU chunk), K = V = 128
    # (BLOCK_V = 64, 16 rows of the state per step of the inner loops); 16-bit inputs split their products
    "linear_attention._chunk_linear_attention_kernel": Spec(
        {"q_ptr": "*T", "k_ptr": "*T", "v_ptr": "*T", "log_lam_ptr": "*fp32", "s_ptr": "*fp32", "o_ptr": "*T",
         "scale": "fp32"},
        [dict(HAS_DECAY=True, BLOCK_T=32, BLOCK_K=128, BLOCK_KB=16, BLOCK_V=64, **_SPLIT16)]),
    "linear_attention._chunk_gated_delta_rule_kernel": Spec(
        {"q_ptr": "*T", "k_ptr": "*T", "v_ptr": "*T", "g_ptr": "*fp32", "beta_ptr": "*fp32", "s_ptr": "*fp32",
         "o_ptr": "*T", "scale": "fp32"},
        [dict(LOG2_T=5, BLOCK_T=32, BLOCK_K=128, BLOCK_KB=16, BLOCK_V=64, **_SPLIT16)],
        ints=dict(s_gh=1, s_bh=1)),   # g and beta are (B, T, H)
    # kNN-memory attention: D = 128, 64 retrieved rows (tiles of 4096 fp32 values)
    "memory._knn_memory_attention_kernel": Spec(
        {"Q": "*T", "KL": "*T", "VL": "*T", "MK": "*T", "MV": "*T", "MM": "*u8", "G": "*fp32", "O": "*T",
         "qk_scale": "fp32"}, [dict(HAS_VALID=True, BLOCK_N=32, BLOCK_K=32, BLOCK_D=128)],
        ints=dict(GROUP=4, T=1, stride_mmn=1)),   # one decode step; the (B, H, T, K) byte mask is dense
    # paged decode: 16-token pages, 4 query heads per KV head, D = 128
    "serving._paged_decode_split_kernel": Spec(
        {"Q": "*T", "K_POOL": "*T", "V_POOL": "*T", "BLOCK_TABLES": "*i32", "SEQ_LENS": "*i32",
         "MID_O": "*fp32", "MID_LSE": "*fp32", "qk_scale": "fp32"},
        [dict(**_GPU16, BLOCK_G=16, BLOCK_D=128)], arch_configs="_decode_configs", ints=_SPLIT_DECODE),
    # RoPE, D = 128 (64 columns per half), 32 query heads in one tile of 2048 elements
    "rope._rope_kernel": Spec(
        {"x_ptr": "*T", "out_ptr": "*T", "pos_ptr": "*i64", "cos_ptr": "*T", "sin_ptr": "*T"},
        [dict(HALF=64, BLOCK_H=32, BLOCK_D=64)], ints=dict(H=None, stride_pt=1)),   # 32 query or 8 KV heads
    # the scans: Mamba's selective scan (n = 16, 8 warps as scan_warps gives them), Mamba-2's SSD (the bench's
    # GPU chunk of 32, p = 64, n = 64 or 128; head-dim block, warps and stages per architecture)
    "ssm._linear_scan_kernel": Spec(
        {"a_ptr": "*T", "b_ptr": "*T", "h0_ptr": "*fp32", "out_ptr": "*T"}, [dict(BLOCK_L=1024)]),
    "ssm._selective_scan_kernel": Spec(
        {"u_ptr": "*T", "delta_ptr": "*T", "A_ptr": "*fp32", "B_ptr": "*T", "C_ptr": "*T", "D_ptr": "*fp32",
         "z_ptr": "*T", "bias_ptr": "*fp32", "y_ptr": "*T", "last_ptr": "*fp32"},
        [dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, BLOCK_L=512, BLOCK_N=16, num_warps=8)]),
    "ssm._ssd_kernel": Spec(
        {"x_ptr": "*T", "dt_ptr": "*fp32", "A_ptr": "*fp32", "B_ptr": "*T", "C_ptr": "*T", "D_ptr": "*fp32",
         "s0_ptr": "*fp32", "y_ptr": "*T", "sT_ptr": "*fp32"},
        [dict(HAS_D=True, HAS_INIT=True, **_SPLIT16, BLOCK_Q=32, BLOCK_N=n, G=g)
         for n, g in ((64, 8), (128, 1))], arch_configs="_ssd_configs"),   # 8 groups of n = 64, or one of 128
    # tree attention: a draft tree against the cached prefix, D = 128
    "speculative._tree_attention_kernel": Spec(
        {**_ATT_IO, "MASK": "*i8", "qk_scale": "fp32"}, [dict(**_GPU16, BLOCK_D=128)], ints=_GQA),
    # greedy verification of a 17-token window over a 128K vocabulary (tiles of 8192 values)
    "pipeline._greedy_verify_kernel": Spec(
        {"logits": "*T", "tokens": "*i64", "first": "*i64", "preds": "*i64", "accepted": "*i64"},
        [dict(BLOCK_N=32, BLOCK_V=256)], ints=dict(N=17)),
    # W4A16 and MXFP4 GEMMs: the autotune list covers decode (M <= 16) and prefill tiles
    "weight_quant._int4_matmul_kernel": Spec(
        {"x_ptr": "*T", "q_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": "*T"}, _GEMM_ROWS),
    "weight_quant._mxfp4_matmul_kernel": Spec(
        {"x_ptr": "*T", "c_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*T"}, _GEMM_ROWS),
}
