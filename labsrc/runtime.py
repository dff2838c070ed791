"""Where the lab runs and how big its experiments are.

Importing :mod:`labsrc` imports this module first. It decides, once per process:

* the device: CUDA when a GPU is visible, else the CPU;
* whether Triton kernels are compiled or *interpreted*: with no GPU, Triton's interpreter
  (``TRITON_INTERPRET=1``) runs every kernel on the CPU with NumPy, so the same notebook works on a
  laptop. The variable must be set before ``triton`` is imported, which is why this module sets it;
* the profile: ``"cpu"`` (small sizes that run in about two minutes on two cores) or ``"gpu"`` (real
  sizes). It follows the device unless the environment variable ``LAB_PROFILE`` says otherwise.

Every size a notebook uses comes from :func:`sizes`, never from constants scattered in cells.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import platform
import random
import sys
from types import MappingProxyType, SimpleNamespace

import numpy as np
import torch

HAS_CUDA: bool = torch.cuda.is_available()
"""True when a CUDA device is visible to torch."""

if not HAS_CUDA and "triton" not in sys.modules:
    # Must happen before the first `import triton`; a user who sets it to 0 on purpose keeps 0.
    os.environ.setdefault("TRITON_INTERPRET", "1")

class _KnownLibraryNoise(logging.Filter):
    """Drop two log records that torchao's import emits on a machine without its CUDA extensions.

    ``transformers`` imports torchao whenever it is installed (its quantizer registry does, on the first
    ``from_pretrained``), and torchao then logs, once per process: "Failed to load .../torchao/_C_*.so"
    (CUDA-only extensions that a CPU machine cannot load; torchao falls back to Python and works) and, from
    torch's ``_pytree``, that registering an Enum as a pytree constant is deprecated (torchao's call, not ours).
    Neither concerns the lab, and both would print on every chapter's page. Only these two exact messages are
    dropped; every other record of these loggers passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("torchao") and record.getMessage().startswith("Failed to load "):
            return "Could not load this library" not in record.getMessage()
        if record.name == "torch.utils._pytree":
            return "is an Enum subclass and is now natively supported" not in record.getMessage()
        return True


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_KnownLibraryNoise())


def _triton_installed() -> bool:
    """Whether ``import triton`` can work here, without importing it (that is the kernel modules' job)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install, or ``sys.modules["triton"] = None``
        return False


HAS_TRITON: bool = _triton_installed()
"""False where Triton is not installed (it has Linux wheels only): every kernel then runs its PyTorch reference."""

INTERPRETED: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""True when Triton kernels run in the interpreter (on the CPU) rather than compiled for a GPU."""

DEVICE: torch.device = torch.device("cuda" if HAS_CUDA else "cpu")
"""The device the lab's tensors live on."""

_PROFILES = ("cpu", "gpu")


def _profile_from_env() -> str:
    profile = os.environ.get("LAB_PROFILE", "gpu" if HAS_CUDA else "cpu").strip().lower()
    if profile not in _PROFILES:
        raise ValueError(f"LAB_PROFILE must be one of {_PROFILES}, got {profile!r}")
    return profile


PROFILE: str = _profile_from_env()
"""``"cpu"`` or ``"gpu"``: which column of :data:`SIZES` the notebooks use."""


def _cpu_threads() -> int:
    value = os.environ.get("LAB_TORCH_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LAB_TORCH_THREADS must be a positive integer, got {value!r}")
    return int(value)


if PROFILE == "cpu" and not HAS_CUDA:
    # The CPU profile's matrices are small: extra threads buy little, and on a shared or busy machine their
    # OpenMP spin-waiting made a decode step tens of times slower. One thread per process (the tests run two
    # notebooks side by side on two cores) keeps timings honest; LAB_TORCH_THREADS=N gives a laptop more.
    torch.set_num_threads(_cpu_threads())

# One table of every size a notebook uses, per chapter and per profile. Each chapter owns its own key.
# CPU sizes are chosen so the chapter runs in about two minutes on two cores; GPU sizes are the real ones.
SIZES: dict[str, dict[str, dict]] = {
    "kv_cache": {
        "cpu": dict(n_tokens=32, prompt_len=16, n_layers=4, hidden=128, n_heads=4, n_kv_heads=2,
                    intermediate=256, vocab=512, step_contexts=(16, 32, 64, 128, 256, 512, 1024),
                    timing_reps=3, step_reps=15,
                    kernel_rows=37, kernel_slots=101, kernel_heads=3, kernel_dim=48,
                    n_requests=200, max_len=2048, block_size=16),
        "gpu": dict(n_tokens=256, prompt_len=64, n_layers=8, hidden=512, n_heads=8, n_kv_heads=2,
                    intermediate=1408, vocab=32000, step_contexts=(16, 64, 256, 1024, 4096, 8192),
                    timing_reps=10, step_reps=20,
                    kernel_rows=4096, kernel_slots=65536, kernel_heads=8, kernel_dim=128,
                    n_requests=2000, max_len=2048, block_size=16),
    },
    "rope": {
        # multiples: live lengths as multiples of the model's trained context L (read from its config); the
        # comparison of the methods at L..4L is the stored curve (labsrc.sweeps.rope), live_n of its samples
        # are scored again (a multiple of tasks.score's batch of 8: the same batches as the stored run).
        "cpu": dict(multiples=(1, 2, 4), bucket=128, n_windows=1, passkey_n=2,
                    passkey_depths=(0.1, 0.5, 0.9), ft_steps=4, ft_batch=1, ft_lr=1e-4, live_n=8, ntk_diag_n=5,
                    kernel_shape=(2, 4, 2, 37, 40), table_rows=96),
        "gpu": dict(multiples=(1, 2, 4, 8), bucket=128, n_windows=12, passkey_n=10,
                    passkey_depths=(0.1, 0.3, 0.5, 0.7, 0.9), ft_steps=60, ft_batch=4, ft_lr=1e-4, live_n=16,
                    ntk_diag_n=20,
                    kernel_shape=(4, 32, 8, 1024, 128), table_rows=4096),
    },
    "kv_eviction": {
        # n: pass keys per policy and rate (the probe lab-target solves, so the one that ranks policies);
        # screen_n: samples of the probes the full cache is only checked on; diag_n: the recency diagnosis;
        # plateau_n: stored-curve pass keys re-run by the diagnosis of value-aware's plateau (90% kept).
        "cpu": dict(ctx=256, n=24, screen_n=8, diag_n=8, plateau_n=6, ppl_len=152, ppl_prefill=128, ablation_n=8,
                    gqa_n=8,
                    bf_tokens=14, bf_budget=7, bf_future=6, bf_slices=12, draws=400, cv_samples=2,
                    overhead_prompt=256, overhead_tokens=16, survival_chunk=16, anim_frames=8,
                    ledger_ctx=256, ledger_n=1, ledger_windows=1, ledger_decode=16),
        "gpu": dict(ctx=512, n=64, screen_n=20, diag_n=20, plateau_n=24, ppl_len=512, ppl_prefill=256, ablation_n=32,
                    gqa_n=32,
                    bf_tokens=16, bf_budget=8, bf_future=8, bf_slices=48, draws=4000, cv_samples=16,
                    overhead_prompt=512, overhead_tokens=64, survival_chunk=16, anim_frames=12,
                    ledger_ctx=512, ledger_n=10, ledger_windows=4, ledger_decode=64),
    },
    "kv_quant": {
        "cpu": dict(demo_tokens=2000, demo_dim=64, kernel_batch=2, kernel_kv_heads=2, kernel_q_per_kv=3,
                    kernel_tokens=301, kernel_dim=40, kernel_group=64, calib_samples=4, calib_len=512,
                    lengths=(64, 128, 256, 512, 1024), ppl_windows=8, err_windows=2,
                    ledger_n=1, ledger_windows=1, ledger_decode=16),
        "gpu": dict(demo_tokens=20000, demo_dim=128, kernel_batch=8, kernel_kv_heads=8, kernel_q_per_kv=4,
                    kernel_tokens=4099, kernel_dim=128, kernel_group=128, calib_samples=16, calib_len=512,
                    lengths=(64, 128, 256, 512, 1024), ppl_windows=32, err_windows=8,
                    ledger_n=10, ledger_windows=4, ledger_decode=64),
    },
    "flash_attention": {
        "cpu": dict(tq=37, tk=53, batch=2, n_heads=4, n_kv_heads=2, head_dim=40, block=16,
                    decode_tmax=77, decode_batch=3, mem_lengths=(128, 256, 512, 1024, 2048), gen_tokens=64,
                    prompt_words=40, sparse_len=480, sparse_layer=3, sparse_block=16, sparse_samples=4,
                    sparse_keep=(1.0, 0.5, 0.45, 0.25, 0.125, 0.0625), gpu_lengths=(), decode_lengths=()),
        "gpu": dict(tq=37, tk=53, batch=2, n_heads=4, n_kv_heads=2, head_dim=40, block=16,
                    decode_tmax=77, decode_batch=3, mem_lengths=(512, 1024, 2048, 4096, 8192), gen_tokens=64,
                    prompt_words=40, sparse_len=480, sparse_layer=3, sparse_block=16, sparse_samples=4,
                    sparse_keep=(1.0, 0.5, 0.45, 0.25, 0.125, 0.0625), gpu_lengths=(512, 1024, 2048, 4096, 8192, 16384),
                    decode_lengths=(1024, 4096, 16384, 65536)),
    },
    "serving": {
        # trace: Poisson arrivals per engine step; reps: timed repeats of each replay (>= 2 for an interval);
        # evict_slice: samples per point of the stored paged-eviction curve rescored live
        "cpu": dict(kernel_lens=(1, 37, 70), kernel_page=16, mix_n=200, mix_max_len=2048, pool_tokens=65536,
                    n_requests=12, rate=0.5, prompt_range=(8, 40), output_range=(8, 24), block_size=16,
                    num_blocks=24, max_seqs=16, budget=256, reps=3,
                    prefix_n=3, prefix_len=48, prefix_requests=10, suffix_range=(4, 12), prefix_out=6,
                    preempt_requests=6, preempt_pools=(40, 12, 8), preempt_block=8, identity_n=4,
                    evict_slice=8, http_n=8, compare_reps=3),
        "gpu": dict(kernel_lens=(1, 377, 4099), kernel_page=16, mix_n=2000, mix_max_len=2048, pool_tokens=65536,
                    n_requests=64, rate=2.0, prompt_range=(16, 200), output_range=(16, 200), block_size=16,
                    num_blocks=256, max_seqs=64, budget=1024, reps=5,
                    prefix_n=4, prefix_len=256, prefix_requests=48, suffix_range=(8, 64), prefix_out=32,
                    preempt_requests=16, preempt_pools=(256, 48, 32), preempt_block=16, identity_n=8,
                    evict_slice=25, http_n=64, compare_reps=5),
    },
    "weight_quant": {
        # live_*: the one small case the CPU profile reruns (the rest is read from the stored results of
        # `python -m labsrc.weight_quant`); the GPU profile reruns the whole experiment (full_* sizes).
        "cpu": dict(demo_rows=64, demo_cols=256, calib_tokens=1024, kernel_shape=(5, 37, 320, 64),
                    mx_shape=(3, 29, 128), live_calib=1, live_windows=2, live_probe_n=8, awq_grid=10,
                    rerun_all=False, full_windows=16, full_probe_n=100, full_calib=8, full_qat_steps=80,
                    ledger_ctx=512, ledger_n=1, ledger_windows=1, ledger_decode=16),
        "gpu": dict(demo_rows=256, demo_cols=1024, calib_tokens=4096, kernel_shape=(16, 4096, 4096, 128),
                    mx_shape=(16, 4096, 4096), live_calib=4, live_windows=8, live_probe_n=20, awq_grid=20,
                    rerun_all=True, full_windows=16, full_probe_n=100, full_calib=8, full_qat_steps=80,
                    ledger_ctx=512, ledger_n=10, ledger_windows=4, ledger_decode=64),
    },
    "lab_bench": {
        # lab-target is trained at 1,024 tokens: the CPU grid reaches 1.5x and 2x beyond it, and the
        # perplexity windows are twice its length, so both show the trained context's edge.
        "cpu": dict(passkey_lengths=[256, 512, 1024, 1536, 2048], passkey_depths=[0.0, 0.5, 1.0], passkey_n=4,
                    ppl_context=2048, ppl_windows=6, ppl_bucket=64, probe_n=16, ledger_n=2, ledger_ppl_windows=2,
                    ledger_decode_tokens=32, decode_reps=5),
        "gpu": dict(passkey_lengths=[128, 256, 384, 512, 640, 768, 1024, 1536, 2048],
                    passkey_depths=[0.0, 0.25, 0.5, 0.75, 1.0], passkey_n=20, ppl_context=2048, ppl_windows=28,
                    ppl_bucket=64, probe_n=50, ledger_n=10, ledger_ppl_windows=8, ledger_decode_tokens=128,
                    decode_reps=20),
    },
    "frontier": {
        # needle_*: the common-mode picture; kernel_shape (B, H, T, D, Dv): the fused-kernel check; int8_*: lab-target's
        # Q/K in INT8 (windows of int8_len tokens); live (variant, width, seed), live_seconds: the stored pass-key run
        # retrained for its first live_seconds (None: all of it) to show it reproduces;
        # moe_*: the expert-prefetch rerun (the stored run: python -m labsrc.frontier --moe); prune_windows: 512-token
        # validation windows for head pruning
        "cpu": dict(needle_len=64, kernel_shape=(1, 2, 37, 24, 48), int8_len=512, int8_windows=3,
                    live=("diff", 32, 0), live_seconds=8, moe_steps=60, moe_windows=8, prune_windows=6),
        "gpu": dict(needle_len=256, kernel_shape=(4, 16, 2048, 64, 128), int8_len=2048, int8_windows=8,
                    live=("diff", 32, 0), live_seconds=None, moe_steps=300, moe_windows=16,
                    prune_windows=24),
    },
    "memory": {
        # compare_*: the stored comparison (python -m labsrc.memory; compare_n per length for every method,
        # compare_n_cheap for truncation and BM25 RAG, which cost one window: why in labsrc.memory.main);
        # live_*: the case the chapter reruns.
        "cpu": dict(index_sizes=(1000, 4000, 16000), index_dim=40, index_queries=64, index_k=16,
                    kernel_shape=(1, 4, 2, 5, 24, 8, 40), eq_len=160, eq_window=32, eq_chunk=16,
                    compare_lengths=(1024, 2048, 4096, 8192), compare_n=(20, 20, 10, 10), compare_n_cheap=100,
                    top_ks=(32,), window=384, chunk=128,
                    live_length=2048, live_depth=0.1, rag_size=64, rag_overlap=32),
        # The memories are searched on the CPU (FAISS CPU, torch.topk on CPU tensors), so the GPU profile
        # stops at 16K tokens and 200K rows; 64K needs the exact memory on the GPU.
        "gpu": dict(index_sizes=(10000, 50000, 200000), index_dim=128, index_queries=256, index_k=32,
                    kernel_shape=(4, 32, 8, 64, 2048, 64, 128), eq_len=1024, eq_window=128, eq_chunk=64,
                    compare_lengths=(1024, 4096, 16384), compare_n=(20, 20, 20), compare_n_cheap=100,
                    top_ks=(8, 32, 128),
                    window=384, chunk=128, live_length=4096, live_depth=0.1, rag_size=64, rag_overlap=32),
    },
    "linear_attention": {
        # check_*: the reference/kernel comparison; perf_*: Performer's error against m; recall_live (mixer,
        # width, seed): the stored MQAR run whose first recall_live_seconds are retrained to show it reproduces
        # (the stored grid comes from the command in labsrc/data/recall_mqar.json); recall_*: the GPU retrain
        "cpu": dict(check_shape=(2, 100, 3, 40, 24), check_chunk=32, perf_len=256, perf_dim=32,
                    perf_ms=(8, 16, 32, 64, 128, 256, 512), perf_draws=6,
                    perf_temps=(0.25, 0.5, 1.0, 1.5),
                    recall_live=("softmax", 16, 0), recall_live_seconds=8, recall_steps=600,
                    recall_train=1500, recall_eval=150, retrain=False),   # recall_steps..: the stored grid's sizes
        "gpu": dict(check_shape=(4, 2048, 16, 128, 128), check_chunk=32, perf_len=1024, perf_dim=64,
                    perf_ms=(8, 16, 32, 64, 128, 256, 512, 1024), perf_draws=20,
                    perf_temps=(0.25, 0.5, 1.0, 1.5),
                    recall_live=("softmax", 16, 0), recall_live_seconds=8, recall_steps=3000,
                    recall_train=4000, recall_eval=150, retrain=True),
    },
    "ssm": {
        # legs_*: the HiPPO memory picture; conv_len: the LTI faces; kernel_*: interpreter-sized checks; swap_*:
        # lab-mamba on the ssd kernel; mem_lengths: caches measured; time_*: prefill/decode timings; live_*:
        # the pass keys rerun live for both models (the eval cards hold the full grids).
        "cpu": dict(legs_n=32, legs_len=400, conv_len=2048, sel_shape=(2, 5, 19, 4), ssd_small=(1, 24, 2, 3, 1, 4),
                    kernel_scan=(3, 257), kernel_sel=(1, 3, 63, 16), kernel_ssd=(1, 130, 4, 16, 2, 16, 32),
                    swap_len=64, swap_gen=6, mem_lengths=(128, 512, 2048), time_lengths=(128, 512, 1024),
                    time_reps=3, decode_tokens=8, live_ctx=256, live_depths=(0.1, 0.5, 0.9), live_n=4),
        "gpu": dict(legs_n=64, legs_len=1000, conv_len=16384, sel_shape=(2, 5, 19, 4), ssd_small=(1, 24, 2, 3, 1, 4),
                    kernel_scan=(64, 8193), kernel_sel=(2, 64, 4097, 16), kernel_ssd=(2, 4099, 16, 64, 2, 64, 64),
                    swap_len=512, swap_gen=32, mem_lengths=(128, 512, 2048, 8192),
                    time_lengths=(128, 512, 2048, 8192), time_reps=10, decode_tokens=32, live_ctx=512,
                    live_depths=(0.0, 0.25, 0.5, 0.75, 1.0), live_n=20),
    },
    "speculative": {
        # chi_draws: rejection-sampling draws for the chi-square; alpha_n: teacher-forced sequences per task
        # (acceptance by task, Table 10-9); self_alpha_n: teacher-forced prose sequences for the self-speculation
        # table (self_n: its generation prompts); n_*: prompts per task; new_tokens: generated
        # per prompt; ks: windows timed; tree_*: the tree sweep (compiled kernel on a GPU, its reference when
        # interpreted); opd_*: the Draft-OPD run (prompt + tokens stay within the 512-token trained context);
        # quant_decode: positions decoded through each quantized (or projected) draft cache to measure alpha;
        # proj_fit: sequences the target-to-draft KV projection is fitted on; pl_*: prompt lookup, pl_n prompts
        # per kind (two quoting kinds, prose) of pl_len tokens, pl_tokens generated, window pl_k, n-gram pl_ngram
        # (shortest match drafted from: pl_min_ngram), pl_reps interleaved timing repetitions.
        "cpu": dict(chi_vocab=8, chi_draws=100_000, chi_k=3, identity_n=3, identity_tokens=24, alpha_n=40,
                    alpha_len=192, n_prompts=4, prompt_len=96, new_tokens=48, ks=(1, 2, 4, 8),
                    tree_n=2, tree_tokens=32, tree_branches=(1, 2, 3, 4), self_n=3, self_alpha_n=40,
                    opd_tokens=96, opd_prompt=64, quant_decode=32, proj_fit=24,
                    pl_n=6, pl_len=128, pl_tokens=20, pl_k=8, pl_ngram=3, pl_min_ngram=2, pl_reps=2),
        "gpu": dict(chi_vocab=8, chi_draws=1_000_000, chi_k=3, identity_n=10, identity_tokens=64, alpha_n=40,
                    alpha_len=448, n_prompts=20, prompt_len=192, new_tokens=128, ks=(1, 2, 3, 4, 6, 8),
                    tree_n=8, tree_tokens=64, tree_branches=(1, 2, 3, 4),
                    self_n=10, self_alpha_n=40, opd_tokens=320, opd_prompt=128, quant_decode=96, proj_fit=64,
                    pl_n=20, pl_len=384, pl_tokens=96, pl_k=8, pl_ngram=3, pl_min_ngram=2, pl_reps=3),
    },
    "pipeline": {
        # prompts: sequences (micro-batches) of prompt_len tokens, new_tokens each; live_k: the window of the
        # live two-rank run; sim_*: the simulator's extrapolation (P up to 8, the source's 70B settings).
        "cpu": dict(prompts=3, prompt_len=20, new_tokens=24, live_k=4, local_ks=(2, 4, 8), sim_tokens=96,
                    sim_stages=(1, 2, 4, 8), sim_ks=(2, 4, 8, 16), sim_seeds=4, exp_ks=(2, 4, 8, 16),
                    exp_reps=3, exp_stages=(1, 2)),
        "gpu": dict(prompts=4, prompt_len=32, new_tokens=64, live_k=8, local_ks=(2, 4, 8, 16), sim_tokens=256,
                    sim_stages=(1, 2, 4, 8), sim_ks=(2, 4, 8, 16, 32), sim_seeds=16, exp_ks=(2, 4, 8, 16),
                    exp_reps=5, exp_stages=(1, 2)),
    },
    "distill": {
        # kernel_*: the fused-loss check; grad_temps: the T² gradient plot; live_*: the one short distillation
        # run the notebook does live (the experiment itself is stored: python -m labsrc.distillation experiment);
        # spec_*: chapter 10's speculative decoding with each student as the draft.
        "cpu": dict(kernel_rows=6, kernel_vocab=1500, grad_temps=(1, 2, 4, 8, 16, 32, 64), live_steps=12,
                    live_eval_windows=4, spec_prompts=4, spec_prompt_len=64, spec_tokens=32, spec_k=4),
        "gpu": dict(kernel_rows=64, kernel_vocab=32000, grad_temps=(1, 2, 4, 8, 16, 32, 64), live_steps=100,
                    live_eval_windows=16, spec_prompts=16, spec_prompt_len=128, spec_tokens=64, spec_k=4),
    },
}


def sizes(chapter: str, profile: str | None = None) -> SimpleNamespace:
    """Return the sizes chapter ``chapter`` uses in the current (or the given) profile.

    >>> s = sizes("kv_cache"); s.n_tokens   # doctest: +SKIP
    48
    """
    if chapter not in SIZES:
        raise KeyError(f"no sizes for chapter {chapter!r}; known chapters: {sorted(SIZES)}")
    profile = PROFILE if profile is None else profile
    if profile not in _PROFILES:
        raise ValueError(f"profile must be one of {_PROFILES}, got {profile!r}")
    return SimpleNamespace(**MappingProxyType(SIZES[chapter][profile]))


def seed_everything(seed: int = 0) -> torch.Generator:
    """Seed Python, NumPy and torch (CPU and CUDA) and return a fresh torch generator seeded with ``seed``.

    Call it at the top of every notebook so that every figure is the same on every run.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if HAS_CUDA:
        torch.cuda.manual_seed_all(seed)
    return torch.Generator(device="cpu").manual_seed(seed)


def _version(name: str) -> str:
    try:
        module = __import__(name)
    except ImportError:
        return "not installed"
    return getattr(module, "__version__", "unknown")


def device_name() -> str:
    """A human-readable name of the device: the GPU's name, or the CPU's architecture and core count."""
    if HAS_CUDA:
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


KERNEL_MODE: str = ("PyTorch references (Triton unavailable)" if not HAS_TRITON else
                    "Triton, interpreted on the CPU (TRITON_INTERPRET=1)" if INTERPRETED else
                    "Triton, compiled for the GPU")
"""How the lab's kernels run here, in words: the runtime stamp's ``kernels`` line."""


def stamp(file=None) -> dict:
    """Print (and return) what produced a notebook's numbers: device, profile, kernel mode, versions."""
    info = {
        "device": device_name(),
        "profile": PROFILE,
        "kernels": KERNEL_MODE,
        "torch threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:>{width}} : {value}", file=file)
    return info
