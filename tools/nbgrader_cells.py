"""Give every exercise cell of the chapter notebooks its nbgrader metadata and hidden tests.

This script is the source of truth for the exercise cells' metadata: run it after adding or changing an
exercise, and after merging notebook changes. It is idempotent (a second run changes nothing) and touches only
exercise cells, which it finds by their content, never by position:

* a **solution cell** is a code cell holding ``### BEGIN SOLUTION``; it gets ``solution=true, grade=false``
  and the grade id ``solution_<name>``;
* its **test cell** is the next code cell, which must call ``ex.check_<name>(...)``; it gets
  ``grade=true, locked=true`` and the points below, the grade id ``check_<name>`` (the first check it calls),
  the estimated minutes and a title under ``metadata.lab``, and a hidden section that calls every check of the cell
  again with a seed of its own (further cases, and a failure raises in any environment)::

      ex.check_gqa_bytes(gqa_kv_bytes)
      ### BEGIN HIDDEN TESTS
      ex.check_gqa_bytes(gqa_kv_bytes, hidden=52817)
      ### END HIDDEN TESTS

  The seed is drawn at random the first time and kept from then on: it lives only in the instructor notebook,
  whose hidden section nbgrader strips from the release, so no ``labsrc`` function a student can import holds
  the hidden cases. An instructor may write cases instead of a seed (``hidden=[...]``, for the checks that take
  them); the script keeps whatever value the hidden call already has.

  An instructor may add lines of their own inside the hidden section; the script keeps them.
* the **description cell** (the markdown cell above the solution cell) must hold a ``### Exercise N: ...``
  heading; the script rewrites it with the exercise's number and title and writes the line under it that
  tells students its kind, points and estimated time (``*Derivation · 2 points · about 15 minutes*``).

A cell that carries nbgrader metadata but is no longer an exercise cell loses it. The notebooks keep their JSON
format (indent 1, UTF-8 text, and the trailing newline each file had).

Usage (from the repository root)::

    python tools/nbgrader_cells.py            # rewrite chapters/*.ipynb where needed
    python tools/nbgrader_cells.py --check    # exit 1, naming the notebooks, if any would change
    python tools/nbgrader_cells.py --seed chapters/08_*.ipynb   # give hidden=True calls a seed of their own
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import secrets
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

BEGIN_SOLUTION = "### BEGIN SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
HIDDEN_NOTE = "# The same checks on cases students do not see; a failure here raises anywhere."
CHECK_CALL = re.compile(r"\bex\.(check_\w+)\(([^()]*)\)")



def _kinds():
    """labsrc/exercises/kinds.py, where the kinds are defined once, loaded by path (no torch import)."""
    spec = importlib.util.spec_from_file_location("_lab_kinds", ROOT / "labsrc" / "exercises" / "kinds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_K = _kinds()
KINDS, THINKING, KIND_LABELS = _K.KINDS, _K.THINKING, _K.LABELS


class Exercise(NamedTuple):
    points: int
    minutes: int
    kind: str
    title: str


# Points, estimated minutes, kind and a short title of each exercise, by the first check its test cell calls
# (the exercise's heading line and the instructors page's table are generated from them). A new exercise must
# be listed here: the script refuses a test cell it cannot score.
_EXERCISES: dict[str, tuple[int, int, str, str]] = {
    # 01 KV cache
    "check_gqa_bytes": (1, 10, "transcription", "KV-cache bytes of a GQA model"),
    "check_decode_rate_ceiling": (1, 15, "transcription", "the decode ceiling when memory caps the batch"),
    "check_paged_utilisation": (3, 20, "prediction", "predict the measured utilisation of a paged cache"),
    "check_mla_equivalent_heads": (2, 15, "derivation", "derive MLA's equivalent number of K/V heads"),
    "check_kv_store_kernel": (3, 30, "kernel", "a store into a head-major cache, as a Triton kernel"),
    # 02 lab bench
    "check_parameter_count": (3, 25, "derivation", "count a Llama's parameters"),
    "check_probe_size": (3, 25, "experiment", "how many samples a probe needs"),
    "check_bucket_perplexity": (2, 15, "debugging", "find the bugs in a perplexity by position bucket"),
    "check_pareto_front": (2, 20, "transcription", "the Pareto front"),
    "check_keys_needed": (3, 20, "derivation", "how many keys a clear pass needs"),
    # 03 FlashAttention
    "check_merge": (1, 15, "transcription", "fix a merge of two partial softmax results"),
    "check_naive_bytes": (1, 10, "transcription", "bytes moved by naive attention"),
    "check_tiled_causal_bytes": (4, 30, "derivation",
                                 "derive the bytes of tiled causal attention, checked against a measurement"),
    "check_key_tile": (2, 15, "debugging", "find the bug in a masked load (Triton)"),
    "check_dq_kernel": (4, 40, "kernel", "the backward pass's dQ (Triton kernel)"),
    # 04 RoPE
    "check_wavelength": (1, 10, "transcription", "wavelength of a RoPE pair"),
    "check_first_new_angle": (3, 25, "derivation", "derive when PI and NTK first meet a new angle"),
    "check_rotate_new_tokens": (3, 25, "debugging", "fix a decode step's rotation"),
    "check_rope_kernel": (3, 30, "kernel", "the interleaved RoPE layout in a Triton kernel"),
    # 05 KV quantization
    "check_scale_zero": (1, 10, "transcription", "step and zero point of a group"),
    "check_fp16_params": (3, 25, "debugging", "fix fp16 codes that miss their reconstruction"),
    "check_group_size": (2, 20, "experiment", "the largest group an error budget affords"),
    "check_unpack_kernel": (3, 30, "kernel", "INT4 unpack with KIVI's per-channel steps (Triton)"),
    # 06 eviction (the LRU cell checks two functions)
    "check_scores": (2, 20, "transcription", "value-aware scores"),
    "check_lru_keep": (4, 30, "debugging", "fix a buggy LRU, then find the token it wrongly drops"),
    "check_attention_sums_kernel": (3, 30, "kernel", "attention sums from the log-sum-exp (Triton kernel)"),
    "check_ever_kept": (2, 15, "derivation", "derive what repeated draws keep that top-K never does"),
    # 09 serving
    "check_slot_mapping": (1, 10, "transcription", "slot mapping from a block table (warm-up)"),
    "check_fork_blocks": (3, 20, "derivation", "derive the blocks and copies of parallel samples"),
    "check_admission": (2, 15, "debugging", "find the bug in an admission test that over-admits"),
    "check_cached_prefix": (2, 15, "debugging", "find the bug in a prefix-cache lookup"),
    "check_packed_gather_kernel": (4, 35, "kernel",
                                   "gather many sequences into one packed tensor (Triton)"),
    # 14 memory and retrieval
    "check_sharded_recall": (3, 20, "derivation", "derive the recall of a sharded search"),
    "check_smallest_nprobe": (2, 20, "experiment", "the smallest nprobe that meets a recall target"),
    "check_fixed_chunks": (3, 20, "debugging", "the chunker that splits facts"),
    "check_gathered_rows_kernel": (4, 35, "kernel", "attention over rows gathered by id (Triton kernel)"),
    # 08 linear attention
    "check_association_costs": (1, 10, "derivation", "the cost of the two association orders"),
    "check_read_after_two_writes": (2, 20, "derivation", "derive what the delta rule reads after two writes"),
    "check_chunked_attention": (3, 25, "debugging", "find the bug in chunked attention with decay"),
    "check_features_needed": (2, 25, "experiment", "how many random features meet an error bound"),
    "check_recurrent_kernel": (3, 30, "kernel", "recurrent linear attention with decay (Triton kernel)"),
    # 07 state-space models and scans
    "check_zoh_diagonal": (1, 10, "transcription", "zero-order hold for a diagonal A (warm-up)"),
    "check_mamba_cache_bytes": (3, 20, "derivation", "derive the measured cache of a Mamba-2"),
    "check_chunk_state_reset": (2, 20, "debugging", "find the bug in a chunk state"),
    "check_scan_grad_kernel": (4, 40, "kernel", "the scan's gradient as a reverse blocked scan (Triton)"),
    # 12 weight quantization
    "check_rtn_outlier_ratio": (2, 15, "prediction",
                                "predict what one outlier costs a per-tensor step, then measure it"),
    "check_mxfp4_worst_error": (2, 20, "derivation", "the worst error of an MX block's largest element"),
    "check_gptq_fix": (3, 25, "debugging", "find the bug in a blocked GPTQ pass"),
    "check_cheapest_config": (2, 20, "experiment", "the cheapest RTN format that meets an error bound"),
    "check_int4_gemv_kernel": (4, 40, "kernel", "an INT4 GEMV from codes packed eight to an int32 (Triton kernel)"),
    # 10 speculative decoding
    "check_spec_acceptance": (2, 20, "derivation", "the acceptance of three drafts, in closed form"),
    "check_spec_tokens_by_position": (2, 15, "derivation",
                                      "tokens per call when acceptance depends on the position"),
    "check_spec_tree_mask": (2, 20, "transcription", "a tree mask from a parents array"),
    "check_spec_rollback": (3, 25, "debugging", "find the bug in a cache rollback"),
    "check_spec_residual_sample_kernel": (4, 35, "kernel", "sample from the residual in a Triton kernel"),
    # 11 pipeline decoding
    "check_pipeline_bubble": (1, 10, "transcription", "the bubble fraction of a pipeline timeline"),
    "check_pipeline_predicted_bubble": (2, 20, "derivation", "derive the bubble of a schedule, then simulate it"),
    "check_pipeline_split": (3, 25, "experiment", "choose the stage split by measurement"),
    "check_pipeline_lenient_kernel": (3, 30, "kernel", "lenient verification of a window (Triton kernel)"),
    # 13 distillation
    "check_jsd_fix": (2, 20, "debugging", "find the bug in GKD's divergence"),
    "check_reverse_kl_gradient": (2, 20, "derivation", "derive the reverse KL's gradient"),
    "check_fit_acceptance": (3, 25, "prediction", "forward or reverse KL: predict which draft is accepted more"),
    "check_kd_row_kernel": (4, 35, "kernel", "the whole KD loss of a token in one Triton kernel"),
    # 15 the architecture frontier
    "check_distractor_sign_change": (3, 20, "derivation",
                                     "where the subtraction stops turning a distractor negative"),
    "check_mod_block_fraction": (2, 20, "derivation", "derive the FLOPs a Mixture-of-Depths block does"),
    "check_yoco_length": (2, 15, "derivation", "the context at which YOCO keeps a given share of the cache"),
    "check_diff_norm_kernel": (4, 40, "kernel",
                               "differential attention with its per-head norm, in one Triton kernel"),
}
EXERCISES = {name: Exercise(*row) for name, row in _EXERCISES.items()}
assert all(e.kind in KINDS for e in EXERCISES.values()), "an exercise's kind must be one of KINDS"


def source_of(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def same_form(text: str, like: str | list) -> str | list[str]:
    """``text`` in the form the cell stored its source: one string, or (nbformat's other on-disk form) one
    string per line, each but the last ending in a newline."""
    return text if isinstance(like, str) else text.splitlines(keepends=True)


def _hidden_call(name: str, args: str) -> re.Pattern:
    """The generated hidden call of ``ex.<name>(<args>)``, whatever its ``hidden=`` value."""
    return re.compile(rf"^ex\.{re.escape(name)}\({re.escape(args)}, hidden=(.+)\)$")


def visible_part(source: str) -> tuple[str, list[str], dict[tuple[str, str], str]]:
    """Split a test cell into the part students see, the instructor's own lines of its hidden section
    (everything there except the generated calls and note), and the ``hidden=`` value of each generated call,
    by ``(check, args)``."""
    if BEGIN_HIDDEN not in source:
        return source.rstrip("\n"), [], {}
    head, _, rest = source.partition(BEGIN_HIDDEN)
    hidden, _, tail = rest.partition(END_HIDDEN)
    if tail.strip():
        raise ValueError(f"code after {END_HIDDEN!r}; keep the hidden section last in a test cell")
    calls = CHECK_CALL.findall(head)
    values, own = {}, []
    for line in hidden.strip("\n").splitlines():
        text = line.strip()
        if not text or text == HIDDEN_NOTE:
            continue
        match = next(((key, m) for key in calls if (m := _hidden_call(*key).match(text))), None)
        if match is not None and match[0] not in values:
            values[match[0]] = match[1].group(1)
        else:
            own.append(line)
    return head.rstrip("\n"), own, values


def new_seed() -> str:
    """A hidden seed for a new check: random, so that it is written nowhere but in the instructor notebook."""
    return str(10_000 + secrets.randbelow(90_000))


def test_source(source: str, seed: bool = False) -> tuple[str, list[str]]:
    """The test cell's source with its hidden section (re)generated, each check's ``hidden=`` value kept (a seed
    drawn for a check that has none; with ``seed``, also for an older cell's ``hidden=True``); and the checks it
    calls."""
    visible, own, values = visible_part(source)
    calls = CHECK_CALL.findall(visible)
    if not calls:
        raise ValueError("a test cell must call ex.check_<name>(answer)")
    lines = []
    for name, args in calls:
        value = values.get((name, args))
        if value is None or (seed and value == "True"):
            value = new_seed()
        lines.append(f"ex.{name}({args}, hidden={value})")
    hidden = [HIDDEN_NOTE] + lines + own
    return "\n".join([visible, BEGIN_HIDDEN, *hidden, END_HIDDEN]), [name for name, _ in calls]


HEADING = re.compile(r"^### Exercise \d+\b.*$", re.MULTILINE)
TAG_LINE = re.compile(r"^\*(?:" + "|".join(KIND_LABELS.values()) + r") · .*\*$")


def tag_line(ex: Exercise) -> str:
    """The line under an exercise's heading: its kind, points and estimated time."""
    points = f"{ex.points} point{'s' if ex.points != 1 else ''}"
    return f"*{KIND_LABELS[ex.kind]} · {points} · about {ex.minutes} minutes*"


def with_heading(text: str, number: int, ex: Exercise, name: str) -> str:
    """The exercise's description cell with its last ``### Exercise`` heading rewritten from ``EXERCISES``
    (number and title) and the tag line under it (kind, points, minutes) written or refreshed."""
    found = list(HEADING.finditer(text))
    if not found:
        raise ValueError(f"{name}: exercise {number}'s description has no '### Exercise {number}: ...' heading")
    head = found[-1]
    before, after = text[:head.start()], text[head.end():]
    lines = after.split("\n")  # lines[0] is the rest of the heading's line: empty
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    if rest and TAG_LINE.match(rest[0]):
        rest = rest[1:]
        while rest and not rest[0].strip():
            rest = rest[1:]
    body = "\n".join(rest)
    block = f"### Exercise {number}: {ex.title}\n\n{tag_line(ex)}"
    return before + block + ("\n\n" + body if body else "")


def nbgrader_meta(grade_id: str, *, solution: bool, points: int = 0) -> dict:
    meta = {"grade": not solution, "grade_id": grade_id, "locked": not solution}
    if not solution:
        meta["points"] = points
    meta.update({"schema_version": 3, "solution": solution, "task": False})
    return meta


def annotate(nb: dict, name: str = "notebook", seed: bool = False) -> list[dict]:
    """Set the exercise cells' metadata and hidden sections in ``nb`` (in place); return one row per exercise:
    ``{"grade_id", "solution_id", "checks", "points", "minutes", "title", "kind"}``. The description cell
    above each solution cell gets its heading and tag line (``with_heading``)."""
    cells = nb["cells"]
    exercise_cells, rows = set(), []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code" or BEGIN_SOLUTION not in source_of(cell):
            continue
        j = next((k for k in range(i + 1, len(cells)) if cells[k]["cell_type"] == "code"), None)
        if j is None or not CHECK_CALL.search(source_of(cells[j])):
            raise ValueError(f"{name}: the solution cell {cell.get('id', i)} is not followed by a code cell "
                             f"calling ex.check_<name>(...)")
        new_source, checks = test_source(source_of(cells[j]), seed)
        if checks[0] not in EXERCISES:
            raise ValueError(f"{name}: {checks[0]} has no points; add it to EXERCISES in {Path(__file__).name}")
        exercise = EXERCISES[checks[0]]
        points, minutes, title = exercise.points, exercise.minutes, exercise.title
        describe = next((k for k in range(i - 1, -1, -1) if cells[k]["cell_type"] == "markdown"), None)
        if describe is None:
            raise ValueError(f"{name}: the solution cell {cell.get('id', i)} has no description cell above it")
        text = with_heading(source_of(cells[describe]), len(rows) + 1, exercise, name)
        cells[describe]["source"] = same_form(text, cells[describe]["source"])
        grade_id = checks[0]
        solution_id = "solution_" + grade_id.removeprefix("check_")
        cell["metadata"]["nbgrader"] = nbgrader_meta(solution_id, solution=True)
        test = cells[j]
        test["source"] = same_form(new_source, test["source"])
        test["metadata"]["nbgrader"] = nbgrader_meta(grade_id, solution=False, points=points)
        test["metadata"]["lab"] = {"minutes": minutes, "title": title, "kind": exercise.kind}
        exercise_cells |= {i, j}
        rows.append({"grade_id": grade_id, "solution_id": solution_id, "checks": checks, "points": points,
                     "minutes": minutes, "title": title, "kind": exercise.kind})
    for i, cell in enumerate(cells):
        if i not in exercise_cells:
            cell["metadata"].pop("nbgrader", None)
            lab = cell["metadata"].get("lab", {})
            for key in ("minutes", "title", "kind"):
                lab.pop(key, None)
            if "lab" in cell["metadata"] and not lab:
                cell["metadata"].pop("lab")
    ids = [r["grade_id"] for r in rows] + [r["solution_id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name}: two exercises start with the same check: {sorted(ids)}")
    return rows


def dump(nb: dict, trailing_newline: bool) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + ("\n" if trailing_newline else "")


def process(path: Path, write: bool, seed: bool = False) -> bool:
    """Annotate one notebook; return True if its file changes (and write it when ``write``)."""
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    annotate(nb, path.name, seed)
    new = dump(nb, raw.endswith("\n"))
    if new != raw and write:
        path.write_text(new, encoding="utf-8")
    return new != raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: chapters/*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    parser.add_argument("--seed", action="store_true",
                        help="replace an older hidden call's hidden=True by a seed of its own")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    changed = [p for p in paths if process(p, write=not args.check, seed=args.seed)]
    for p in changed:
        print(f"{p.name}: {'would change' if args.check else 'updated'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
