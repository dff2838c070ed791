"""The layout a newcomer can walk (issue 42), read from the tree without importing more than it must.

* One name per mechanism: CONTRIBUTING.md's table gives every chapter its name, and the chapter's module or
  package, exercise checks, tests, and (where the chapter has a kernel) kernel module, kernel tests and bench
  module carry it; every kernel, bench, sweep and exercise module is named for a chapter.
* One concept per file: no module of ``labsrc`` passes about 800 lines.
* The old paths of the moved modules still import, as the new modules themselves, for one release, and the
  names the split modules had are all still there.
(That no import runs from ``labsrc/kernels/`` up into a mechanism module is tests/test_kernel_imports.py.)
"""
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABSRC = ROOT / "labsrc"
MAX_LINES = 800


def name_table() -> dict[str, dict]:
    """CONTRIBUTING.md's table, one row per chapter stem: name, module(s), kernel, exercises, bench, sweep."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## One name per mechanism", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"`\d\d_\w+`", cells[0]):
            ticks = [re.findall(r"`([^`]+)`", c) for c in cells]
            rows[ticks[0][0]] = {"name": ticks[1][0], "modules": ticks[2], "kernel": ticks[3],
                                 "exercises": ticks[4], "bench": ticks[5], "sweep": ticks[6]}
    return rows


TABLE = name_table()
CHAPTERS = sorted(p.stem for p in (ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
NAMES = {row["name"] for row in TABLE.values()}
# Chapter 2 builds the lab's shared tools, each named for what it holds, and has no mechanism of its own.
SHARED_TOOLS = {"lab_bench": ("models/", "tasks/", "ledger.py")}


def exists(folder: Path, name: str) -> bool:
    """A module ``name.py`` or a package ``name/`` in ``folder``."""
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def test_the_table_has_one_row_per_chapter_and_each_stem_starts_with_its_name():
    assert len(CHAPTERS) == 15 and sorted(TABLE) == CHAPTERS
    for stem, row in TABLE.items():
        assert stem[3:] == row["name"] or stem[3:].startswith(row["name"] + "_"), (stem, row["name"])
    assert len(NAMES) == len(TABLE), "two chapters share a name"


@pytest.mark.parametrize("stem", CHAPTERS)
def test_every_file_of_a_chapter_carries_its_name(stem):
    row, name = TABLE[stem], TABLE[stem]["name"]
    if name in SHARED_TOOLS:
        assert tuple(row["modules"]) == SHARED_TOOLS[name]
        for tool in SHARED_TOOLS[name]:
            tool = tool.rstrip("/").removesuffix(".py")
            assert exists(LABSRC, tool) and (ROOT / "tests" / f"test_{tool}.py").is_file(), tool
    else:
        assert row["modules"][0].rstrip("/").removesuffix(".py") == name, f"{stem}: the table's module"
        assert exists(LABSRC, name), f"{stem}: no labsrc/{name}.py or labsrc/{name}/"
        for extra in row["modules"][1:]:          # a second module of the mechanism starts with its name
            assert extra.startswith(name + "_") and exists(LABSRC, extra.removesuffix(".py")), extra
        assert list((ROOT / "tests").glob(f"test_{name}*.py")), f"{stem}: no tests/test_{name}*.py"
    assert row["exercises"] == [f"{name}.py"] and (LABSRC / "exercises" / f"{name}.py").is_file(), stem
    has_kernel = exists(LABSRC / "kernels", name)
    assert bool(row["kernel"]) == has_kernel, f"{stem}: the table and the tree disagree on its kernel"
    if has_kernel:
        assert row["kernel"][0].rstrip("/").removesuffix(".py") == name
        assert list((ROOT / "tests" / "kernels").glob(f"test_{name}_kernel*.py")), f"{stem}: no kernel tests"
        assert row["bench"] == [f"{name}.py"] and (LABSRC / "bench" / f"{name}.py").is_file(), stem
    for sweep in row["sweep"]:
        if sweep.startswith("sweeps/"):
            assert sweep == f"sweeps/{name}.py" and (LABSRC / sweep).is_file(), stem


@pytest.mark.parametrize("folder, private", [("kernels", set()), ("bench", set()), ("sweeps", {"cli"}),
                                             ("exercises", {"core", "grade", "student", "kinds"})])
def test_every_kernel_bench_sweep_and_exercise_module_is_named_for_a_chapter(folder, private):
    found = {p.stem if p.suffix == ".py" else p.name for p in (LABSRC / folder).iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.name.startswith("_")}
    assert found - private <= NAMES, f"labsrc/{folder}/ holds modules named for no chapter: {found - private - NAMES}"


MODULES = sorted(p for p in LABSRC.rglob("*.py") if "checkpoints" not in p.parts)


def test_no_module_passes_about_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"past {MAX_LINES} lines: {long}. Split it into a package of one concept per file "
                      "(CONTRIBUTING.md, 'One name per mechanism')")


# ------------------------------------------------------------------------------------ the old paths, one release
from labsrc import _moved  # noqa: E402


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_path_imports_as_the_new_module_and_no_file_is_left_at_it(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    path = ROOT / Path(*old.split("."))
    assert not path.with_suffix(".py").exists() and not path.is_dir(), f"a file at {old}'s old path"


def test_a_moved_package_carries_its_submodules_and_a_from_import_works():
    import labsrc.distill.finetune as old
    import labsrc.distillation.finetune as new
    from labsrc.kernels.attention import _online_softmax_step, flash_attention  # noqa: F401

    assert old is new and flash_attention is importlib.import_module("labsrc.kernels.flash_attention").flash_attention


@pytest.mark.slow
@pytest.mark.parametrize("command", [["labsrc.sweeps.evict", "--help"], ["labsrc.distill", "--help"]])
def test_a_stored_runs_old_command_still_runs(command):
    """Stored result files record the command that made them (``python -m labsrc.sweeps.evict ...``)."""
    done = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


# Every top-level name the six modules split into packages defined before the split (issue 42): each is still
# importable from the same path, private names included (chapters show them with show_source, tests patch them).
SPLIT = {
    "labsrc.speculative": """
        _PROB_TOL _AssistedGenerationNote _check_probs _check_pair acceptance_rate total_variation
        kl_divergence pinsker_lower_bound _check_alpha _check_k expected_tokens_per_step speedup optimal_k
        adaptive_window chi_square_test residual_distribution _residual _check_verify_args _verify_core
        verify verify_batch tree_attention_mask tree_depths warp_logits StepStats SpecStats _rollback
        cache_nbytes _new_cache _forward _eos_ids _TwoModels run_layers _SharedBody _check_generate_args
        speculative_generate _check_rollback_window self_speculative_generate lookup_draft _PromptLookup
        prompt_lookup_generate _speculate count_layer_tokens _rope_tables _kv_layout cache_features
        KVProjection fit_kv_projection _TREE_MASK _TREE_ATTN _tree_attention_forward
        _register_tree_attention tree_verify_logits _keep_cache_positions tree_speculative_generate
        alpha_along alpha_along_drafts alpha_with_draft_cache acceptance_by_position plain_decode
        task_prompts draft_opd_generate EARLY_EXIT_DIR early_exit_draft _model_name train_early_exit_head
        main""",
    "labsrc.kv_eviction": """
        _check_budget _check_real _check_scores recency value_aware_scores inclusion_probabilities
        systematic_indices _uniform stochastic_keep bernoulli_keep retention_frequencies topk_keep
        value_norm_cv _check_qkv subset_loss optimal_subset TokenStats EvictionPolicy _recent_mask
        _nonneg_int FIFO SlidingWindow LRU H2O StreamingLLM Scissorhands ValueAware POLICIES make_policy
        PagedEvictionPool EvictingLayer EvictingCache survival_matrix token_nll budget_for generate_evicting
        answer_matches answer_accuracy record_qkv""",
    "labsrc.kv_quant": """
        SUPPORTED_BITS GRANULARITIES STORE_BYTES FP16_MAX _MIN_STD _check_bits pack_unit packed_width
        _check_int _check_group_size _check_granularity _check_x ChannelStats KVStats _resolve_stats
        _scale_zero _overflow_error scale_zero quantize_codes pack_codes unpack_codes _groups _expand
        QuantizedTensor quantize fake_quantize quantize_per_token quantize_per_channel channel_variance
        var_ratio group_range mse relative_mse quantization_mse predicted_mse_ratio kvarn_bytes_source
        kv_bytes _as_id_batches _text_config collect_kv calibrate KVarNLayer KVarNCache CacheFactory
        token_nll hidden_state_errors probe_accuracy""",
    "labsrc.weight_quant": """
        FP16_MAX SUPPORTED_BITS E2M1_VALUES MX_BLOCK _E2M1_EMAX _F32_MIN_NORMAL _check_int _check_bits
        _check_weight _check_acts _check_group_size QuantizedWeight pack_int4 unpack_int4 _params _fp16_up
        _codes _expand _assemble quantize_rtn dequantize layer_output_error outlier_columns absmax_int8
        int8_matmul_outlier hessian gptq_quantize awq_search_scales apply_awq e2m1_encode _pack_even_low
        _unpack_even_low mxfp4_quantize mxfp4_dequantize _STE fake_quant_mxfp4 LINEAR_NAMES linear_layers
        calibration_ids collect_linear_inputs AWQLinear _set_module quantize_model model_weight_bytes
        torchao_mx Int8OutlierLinear int8_model window_nll activation_outliers qat_mxfp4 PROBES
        ONE_ANSWER_PROBES probe_context probe_sets score_probes run_experiment main RESULTS_PATH""",
    "labsrc.memory": """
        INDEXES RULES NAME _positive_int _nonneg_int _matrix _exact_topk KVMemory joint_softmax_attention
        topk_merge recall_at_k _clustered index_benchmark _rotate _LayerState RetrievalStats _ACTIVE
        RetrievalContext _lab_memory_forward _REGISTERED register retrieval_logits chunk_spans _WORD _words
        BM25Retriever DenseRetriever question_ids _shifted rag_sample truncate_sample METHODS _answer_right
        _evict_logits run_method CHEAP comparison_plan planned_n comparison_documents compare_methods
        RESULTS results_path load_results summarize main""",
    "labsrc.kernels.flash_attention": """
        LOG2E LN2 MIN_HEAD_DIM MAX_HEAD_DIM GRID_AXIS_LIMIT MAX_NUM_SPLITS MAX_DECODE_GROUP MAX_INT32_OFFSET
        _DTYPES flash_attention_ref flash_attention_backward_ref decode_attention_ref _capability
        _flash_configs merge_warps _decode_configs _bwd_shapes _bwd_dkdv_configs _bwd_dq_configs
        _bwd_configs _bucket _online_softmax_step _softmax_finish _attend_blocks _flash_attention_kernel
        _bwd_preprocess_kernel _recompute_p _bwd_dkdv_kernel _bwd_dq_kernel _decode_split_kernel
        _decode_merge_kernel _check_tensor _check_float_dtype _check_device _check_last_dim_contiguous
        _check_head_dim _check_scale _check_offsets _check_heads_on_grid _batch_chunks _default_scale
        _check_out _check_kv_match_q _check_attention_args _check_grad_out _check_decode_args
        _kernel_operand _launch_flags flash_attention _flash_forward flash_attention_backward
        _flash_backward _FlashAttentionFunction _default_num_splits decode_attention""",
}


@pytest.mark.parametrize("module", sorted(SPLIT))
def test_a_split_module_still_has_every_name_it_had(module):
    mod = importlib.import_module(module)
    missing = [name for name in SPLIT[module].split() if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"
    assert all(hasattr(mod, name) for name in getattr(mod, "__all__", ()))
    assert mod.__path__, f"{module} is a package of one concept per file"
