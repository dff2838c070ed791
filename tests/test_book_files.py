"""Fast checks of the book's own files, without building it.

The full build (``make book``, Sphinx with warnings as errors) catches the same mistakes, but only after every
chapter has been executed; these tests catch them in a second: a table of contents that names a missing file,
a citation key that is not in the bibliography, a bibliography that does not parse, a broken link between pages.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pybtex.database
import pybtex.errors
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
BIB = BOOK / "references.bib"
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]*)`")
REPO_URL = "https://github.com/long-context-lab/long-context-inference-lab"


def toc_files() -> list[str]:
    """Every ``file:`` the table of contents lists, the root first (paths without suffix)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return files


def source_of(name: str) -> Path | None:
    """The .md or .ipynb file a toc entry refers to, or None when neither exists."""
    for suffix in (".md", ".ipynb"):
        path = ROOT / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def bib_keys() -> set[str]:
    return set(pybtex.database.parse_file(str(BIB)).entries)


def markdown_sources() -> list[tuple[str, str]]:
    """(where, text) for every book page and every markdown cell of every chapter notebook."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(BOOK.glob("*.md"))]
    for nb_path in sorted((ROOT / "chapters").glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        for index, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "markdown":
                out.append((f"{nb_path.relative_to(ROOT)} cell {index}", "".join(cell["source"])))
    return out


def test_toc_has_the_agreed_structure():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    assert toc["format"] == "jb-book"
    assert toc["root"] == "book/preface"
    captions = [part["caption"] for part in toc["parts"]]
    assert captions == ["Getting started", "Chapters", "Results"]
    files = toc_files()
    assert len(files) == len(set(files)), f"a page is listed twice: {Counter(files).most_common(1)}"
    assert all(not f.endswith((".md", ".ipynb")) for f in files), "toc entries are written without a suffix"


@pytest.mark.parametrize("name", toc_files())
def test_toc_entry_exists(name):
    assert source_of(name) is not None, f"_toc.yml lists {name!r}, but neither {name}.md nor {name}.ipynb exists"


def test_every_chapter_notebook_is_in_the_toc():
    # The config builds only the files in the toc, so a chapter missing from it would silently vanish.
    listed = set(toc_files())
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        assert f"chapters/{path.stem}" in listed, f"{path.name} is not listed in _toc.yml"


def test_chapter_titles_are_not_hand_numbered():
    # The toc numbers the chapters ("numbered: true"); a title "1. The KV cache" would read "1. 1. The KV cache".
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]
        assert cells, f"{path.name} has no markdown cell"
        first = "".join(cells[0]["source"]).lstrip().splitlines()[0]
        assert first.startswith("# "), f"{path.name} must open with a '# Title' line, got {first!r}"
        assert not re.match(r"#\s*(chapter\s*)?\d+\s*[.:)-]", first, re.IGNORECASE), \
            f"{path.name}: title {first!r} is numbered by hand; the table of contents numbers chapters"


def test_bibliography_parses_strictly_without_duplicates():
    text = BIB.read_text()
    declared = re.findall(r"^@\w+\{([^,\s]+),", text, flags=re.MULTILINE)
    duplicates = [k for k, n in Counter(k.lower() for k in declared).items() if n > 1]
    assert not duplicates, f"duplicate keys in references.bib: {duplicates}"
    pybtex.errors.set_strict_mode(True)
    try:
        data = pybtex.database.parse_file(str(BIB))
    finally:
        pybtex.errors.set_strict_mode(False)
    assert len(data.entries) == len(declared)


def test_every_entry_is_complete():
    data = pybtex.database.parse_file(str(BIB))
    for key, entry in data.entries.items():
        fields = {k.lower(): v for k, v in entry.fields.items()}
        assert entry.persons.get("author"), f"{key}: no author"
        assert fields.get("title", "").strip(), f"{key}: no title"
        assert re.fullmatch(r"(19|20)\d\d", fields.get("year", "")), f"{key}: year {fields.get('year')!r}"
        assert ("url" in fields or "doi" in fields or entry.type == "techreport"), f"{key}: no url or doi"
        venue = {"article": "journal", "inproceedings": "booktitle", "misc": "howpublished",
                 "techreport": "institution"}.get(entry.type)
        assert venue is not None, f"{key}: unexpected entry type @{entry.type}"
        assert fields.get(venue, "").strip(), f"{key}: @{entry.type} needs a {venue}"
        for arxiv_id in re.findall(r"arXiv:(\S+?)[\s),}]", " ".join(fields.values()) + " "):
            assert re.fullmatch(r"\d{4}\.\d{4,5}", arxiv_id), f"{key}: malformed arXiv id {arxiv_id!r}"


def test_keys_promised_to_chapter_authors_exist():
    # These keys were announced to everyone writing chapters; renaming one would break their citations.
    promised = """vaswani2017attention kwon2023paged dao2022flashattention dao2023flashattention2
        shah2024flashattention3 ainslie2023gqa shazeer2019mqa deepseekv2 zuhri2024mlkv su2021roformer peng2023yarn
        chen2023pi hsieh2024ruler kamradt2023niah xiao2023streamingllm zhang2023h2o liu2023scissorhands liu2024kivi
        leviathan2023speculative chen2023accelerating frantar2022gptq lin2023awq dettmers2022llmint8 gu2023mamba
        dao2024mamba2 gu2021s4 katharopoulos2020linear choromanski2020performer yang2024gateddeltanet
        wu2022memorizing lewis2020rag pope2022inference touvron2023llama2 dubey2024llama3 milakov2018online
        dao2023flashdecoding""".split()
    missing = sorted(set(promised) - bib_keys())
    assert not missing, f"keys missing from references.bib: {missing}"


def test_every_cited_key_is_in_the_bibliography():
    keys = bib_keys()
    sources = markdown_sources()
    # Docstrings in labsrc use the same {cite} syntax; keep them consistent with the book even though
    # Sphinx does not render them.
    sources += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "labsrc").rglob("*.py"))]
    unknown = []
    for where, text in sources:
        for group in CITE.findall(text):
            for key in filter(None, (k.strip() for k in group.split(","))):
                if key not in keys:
                    unknown.append(f"{where}: {key}")
    assert not unknown, "citation keys not in book/references.bib:\n" + "\n".join(unknown)


def test_exactly_one_bibliography_directive():
    # A second {bibliography} without a filter would list every citation twice and warn about duplicates.
    directives = [where for where, text in markdown_sources() if re.search(r"^```\{bibliography\}", text, re.M)]
    assert directives == ["book/preface.md"], directives


def test_pages_include_the_generated_fragments():
    # tools/stage_book.py writes these files under book/_generated/ in the staged tree.
    assert "```{include} _generated/claims_table.md\n```" in (BOOK / "claims.md").read_text()
    assert "```{include} _generated/bench_tables.md\n```" in (BOOK / "kernel_bench.md").read_text()
    assert "```{include} _generated/compile_table.md\n```" in (BOOK / "kernel_bench.md").read_text()
    assert not (BOOK / "_generated").exists(), "book/_generated/ is written by the build and must not be committed"


def test_links_between_pages_resolve():
    for page in sorted(BOOK.glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+\.(?:md|ipynb))(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), f"{page.name} links to missing {target}"


def test_config_renders_offline_and_executes_nothing():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["title"] == "The Long-Context Inference Lab"
    assert config["execute"]["execute_notebooks"] == "off"
    assert config["bibtex_bibfiles"] == ["book/references.bib"]
    sphinx = config["sphinx"]["config"]
    assert not sphinx["mathjax_path"].startswith(("http:", "https:", "//")), "MathJax must be served locally"
    assert sphinx["html_static_path"] == ["_mathjax_static", "book/_static"]
    # Static files are the local MathJax and the lab's stylesheet: nothing that runs (jupyter-book would add
    # every .js found there as a script on every page).
    assert [p.name for p in (BOOK / "_static").iterdir()] == ["lab.css"]
    assert sphinx["html_css_files"] == ["lab.css"]
    assert not sphinx.get("suppress_warnings"), "warnings are kept visible"
    assert "sphinx_thebe" not in sphinx["extensions"]
    for ext in ("amsmath", "dollarmath", "colon_fence"):
        assert ext in config["parse"]["myst_enable_extensions"]


def test_repository_url_is_written_in_one_place():
    assert (ROOT / "_config.yml").read_text().count(REPO_URL) == 1
    for page in sorted(BOOK.glob("*.md")):
        assert REPO_URL not in page.read_text(), f"{page.name} repeats the repository URL; link via _config.yml"


def test_code_blocks_of_the_book_pages_fit_the_text_column():
    """A fenced code block of a book page is shown in the same column as the chapters' code (88 characters at
    the size book/_static/lab.css sets); a longer line scrolls or is clipped."""
    too_long = []
    for page in sorted(BOOK.glob("*.md")):
        fence = None
        for number, line in enumerate(page.read_text().splitlines(), 1):
            marker = re.match(r"\s*(```+|~~~+)", line)
            if marker and (fence is None or marker.group(1).startswith(fence)):
                fence = None if fence else marker.group(1)
            elif fence and len(line) > 88:
                too_long.append(f"{page.name}:{number} ({len(line)} characters)")
    assert not too_long, f"code lines wider than the text column: {too_long}"
