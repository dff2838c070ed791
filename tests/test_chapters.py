"""The shape every chapter promises (conventions.md), checked without executing anything.

Executing the chapters is `make execute` (nbmake over the instructor notebooks) and `make test-student`.
"""
import json
import re
from pathlib import Path

import pytest

from labsrc.exercises import student

CHAPTERS = sorted((Path(__file__).resolve().parents[1] / "chapters").glob("*.ipynb"))


def cells(path):
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"], c)
            for c in nb["cells"]]


def test_there_are_chapters():
    assert CHAPTERS, "no chapter notebooks found"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_is_stored_without_outputs(path):
    for kind, _, cell in cells(path):
        if kind == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{path.name} has outputs"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_the_conventional_shape(path):
    assert re.fullmatch(r"\d\d_[a-z0-9_]+", path.stem), "chapters are named NN_topic.ipynb"
    all_cells = cells(path)
    markdown = "\n".join(src for kind, src, _ in all_cells if kind == "markdown").lower()
    code = "\n".join(src for kind, src, _ in all_cells if kind == "code")
    assert all_cells[0][0] == "markdown" and all_cells[0][1].lstrip().startswith("# "), "starts with a title"
    for heading in ("you will learn", "runs on", "exercise", "summary", "references"):
        assert heading in markdown, f"{path.name} lacks a '{heading}' section"
    assert "labsrc.stamp()" in code or "stamp()" in code, "the setup cell prints the runtime stamp"
    assert "seed_everything" in code, "the chapter seeds everything"
    assert "sizes(" in code, "sizes come from the runtime profile"
    assert "{cite}" in markdown, "the chapter cites its references"
    assert not re.search(r"^\s*except\s*(Exception)?\s*:", code, re.M), "notebooks never hide errors"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_three_checked_exercises(path):
    nb = json.loads(path.read_text())
    solved = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            solved += student.strip_solutions("".join(cell["source"]))[1]
    assert solved >= 3, f"{path.name} has {solved} solution blocks; a chapter needs at least three exercises"
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert code.count("labsrc.exercises") + code.count("from labsrc.exercises") >= 1
    assert len(re.findall(r"\bex\.check\w*\(|\bcheck_\w+\(", code)) >= 3, "each exercise needs a check call"


# Code the page shows must fit the text column (about 88 characters). Lines that cannot be wrapped without
# changing what the code does, as (notebook stem, a substring of the line):
LONG_LINE_LIMIT = 88
LONG_LINES_ALLOWED = [
    # Docstrings: rewrapping one changes the string (its __doc__), so these wait for a rewrite by hand.
    ('01_kv_cache', 'outputs of every step and how many tokens were pro'),
    ('01_kv_cache', '"""Decode with a growing cache: step t projects on'),
    ('01_kv_cache', '"""Median wall-clock seconds of fn() over reps run'),
    ('01_kv_cache', '"""Greedy decoding of exactly S.n_tokens new token'),
    ('01_kv_cache', '"""Bytes of every key and value tensor a transform'),
    ('01_kv_cache', '"""Wall-clock seconds of one fn() call (the GPU is'),
    ('01_kv_cache', '"""Decode with one cache of len(X) slots allocated'),
    ('01_kv_cache', '"""Print the cache size of one setting and how man'),
    ('01_kv_cache', '"""Number of GQA K/V heads of head_dim numbers who'),
    ('01_kv_cache', '"""Copy block program_id(1) of row program_id(0) o'),
    ('02_lab_bench', '"""Right first digits, and right later digits give'),
    ('03_flash_attention', '"""Attention of eq. (eq-fa-naive) for tensors (...'),
    ('03_flash_attention', '"""Stream the scores of one row in blocks, keeping'),
    ('03_flash_attention', 'Returns (output, bytes moved to and from q/k/v/o).'),
    ('03_flash_attention', '"""Sum the bytes that each ATen op reads (tensor i'),
    ('03_flash_attention', 'block_m=None counts Q, K, V, O once (re-reads serv'),
    ('03_flash_attention', '"""Each (query block, key block): \'full\', \'masked\''),
    ('03_flash_attention', '"""True where query i may see key j (causal, align'),
    ('03_flash_attention', '"""Peak of the live bytes of the tensor storages c'),
    ('03_flash_attention', '"""FLOPs of the matrix products fn runs (2 per mul'),
    ('03_flash_attention', '"""An attention implementation that records the la'),
    ('03_flash_attention', '"""Block-sparse causal attention with blocks chose'),
    ('03_flash_attention', 'q, k, v: (H, T, D). Returns (output, kept) where k'),
    ('03_flash_attention', '"""The softmax-attention output over the union of'),
    ('03_flash_attention', '"""The (block_n, block_d) tile of k\'s rows start..'),
    ('03_flash_attention', '"""Fold one block of n_keys keys into the running'),
    ('04_rope', '"""Per pair: angle at position factor*L - 1 over t'),
    ('04_rope', '"""Plot relative_angles for every method at one fa'),
    ('04_rope', '"""The rule stated above, on one evaluation: perpl'),
    ('04_rope', '"""Which tested factors show the method visibly be'),
    ('04_rope', '"""The verdict for \'method extends the window lo-h'),
    ('04_rope', '"""The most keys plain RoPE may get right of n for'),
    ('04_rope', '"""What a pass-key gain would have to be to show,'),
    ('04_rope', '"""Tokens per full turn of RoPE pair i for a head'),
    ('05_kv_quant', '"""misattributed when any statement of the source'),
    ('05_kv_quant', '"""Quantize all of x with one step and zero point:'),
    ('05_kv_quant', '"""Quantize-dequantize x (T, D); `groups` yields i'),
    ('05_kv_quant', '"""Eq. (kvq-kvarn): normalise each channel, quanti'),
    ('05_kv_quant', '"""From scratch: softmax(q . K^T / sqrt(d)) V over'),
    ('05_kv_quant', '"""n non-overlapping windows of `length` tokens (B'),
    ('05_kv_quant', '"""The chapter\'s cache factories: name -> function'),
    ('05_kv_quant', '"""Perplexity of all windows pooled, and of each w'),
    ('05_kv_quant', '"""Per-window perplexity rise (%) of cache `name`'),
    ('05_kv_quant', '"""Quantization MSE of x (INT4) relative to its pe'),
    ('05_kv_quant', '"""One batched forward pass through one fresh cach'),
    ('05_kv_quant', 'windows, pass-key and variable-tracking accuracy,'),
    ('05_kv_quant', 'token (FP counted as FP16). Quantization groups ne'),
    ('05_kv_quant', '"""Table 10-4\'s configurations at `bits`, plus the'),
    ('06_kv_eviction', "'''Value-aware scores with explicit loops: attn (H"),
    ('06_kv_eviction', "'''Keep-probabilities proportional to scores, capp"),
    ('06_kv_eviction', "'''Indices kept by systematic sampling: item i whe"),
    ('06_kv_eviction', "'''(G, T, N) softmax rows of queries q (G, T, d) a"),
    ('06_kv_eviction', '"""n seeded samples of task at ctx tokens (answer'),
    ('06_kv_eviction', '"""k right out of len(samples), as an Estimate wit'),
    ('06_kv_eviction', '"""Perplexity of the last ppl_len - ppl_prefill to'),
    ('06_kv_eviction', '"""About how many samples per arm make the 95% int'),
    ('06_kv_eviction', '(normal approximation: the two half-widths must ad'),
    ('06_kv_eviction', "'''An EvictingCache whose incoming K/V are quantiz"),
    ('06_kv_eviction', "'''A ledger cache_factory: a fresh evicting cache"),
    ('06_kv_eviction', "'''Value-aware scores A^alpha ||V||^beta R^gamma:"),
    ('06_kv_eviction', "'''The index of the token LRU drops from the reaso"),
    # A long string inside an f-string's replacement field: it cannot be split across lines there.
    ('04_rope', 'f"{\'\' if t_yarn and max(t_yarn) / L >= 8 else \' (t'),
    ('04_rope', 'f"{\' and beats plain RoPE visibly at \' + \', \'.join'),
    # Inside ### BEGIN SOLUTION regions, which tools/nbgrader_cells.py and the exercises own.
    ('06_kv_eviction', 'used = torch.where(attn > threshold, qpos[:, None]'),
    ('06_kv_eviction', 'p = torch.where(capped, torch.ones_like(s), (budge'),
    ('06_kv_eviction', 'c = c * (k / float(c[-1]))                 # remov'),
]


def shown_code_lines(path):
    """(line) of every code cell the page shows, outside hidden-test sections; cells with magics skipped."""
    for kind, src, cell in cells(path):
        tags = cell.get("metadata", {}).get("tags", [])
        if kind != "code" or "remove-input" in tags or "remove-cell" in tags:
            continue
        lines = src.split("\n")
        if any(line.lstrip().startswith(("%", "!")) for line in lines):
            continue
        hidden = False
        for line in lines:
            if line.strip().startswith("### BEGIN HIDDEN TESTS"):
                hidden = True
            if not hidden:
                yield line
            if line.strip().startswith("### END HIDDEN TESTS"):
                hidden = False


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_shown_code_fits_the_text_column(path):
    allowed = [sub for stem, sub in LONG_LINES_ALLOWED if stem == path.stem]
    too_long = [line for line in shown_code_lines(path)
                if len(line) > LONG_LINE_LIMIT and not any(sub in line for sub in allowed)]
    assert not too_long, (f"{path.name}: {len(too_long)} shown code lines over {LONG_LINE_LIMIT} characters, "
                          f"e.g. {too_long[0]!r}")
    # An allow-list entry that matches nothing is stale: drop it.
    long_lines = [line for line in shown_code_lines(path) if len(line) > LONG_LINE_LIMIT]
    stale = [sub for sub in allowed if not any(sub in line for line in long_lines)]
    assert not stale, f"{path.name}: allow-listed long lines no longer present: {stale}"
