"""Open the built book in a headless browser and check what a reader would see (pytest-playwright tests).

Run by ``make test-browser`` after ``make book``::

    pytest -p no:cacheprovider tools/browser_check.py      # BOOK_HTML=_build/html BOOK_SCREENS=_build/screens

The browser comes from ``tools/browser_setup.py`` (Playwright's Chromium, one on the machine, or Debian's
unpacked into ``_build/browser``, without root); pytest-playwright launches it and hands each test a fresh
``page``. The built HTML folder is served on 127.0.0.1 by a local ``http.server``; every request to any other
host is refused (the book must work offline) and counts as a failure. Each page of the book is one test:

* no JavaScript exception and no console error;
* no request to a host other than the local server (a CDN script, font or stylesheet);
* no failed or 4xx/5xx request to the local server: every asset the book links must be in the build;
* on pages with maths, MathJax (served from the book itself) typeset it: ``mjx-container`` elements exist,
  and none holds a TeX error (``mjx-merror``);
* no blank output: every cell output area shows text or a loaded image, and every widget view either
  rendered or is not there (the book loads no widget JavaScript, so a widget output without a static
  fallback, see ``tools/widget_cells.py``, stays an empty box and fails here);
* on chapter 1, the figures in the code-cell outputs loaded (``naturalWidth > 0``), are more than a few KB
  and are not blank (more than a handful of distinct colours);
* what a reader should never see: text from a solution or a hidden test (the book renders the release
  version), an output under a code cell that reads a name a (stubbed) solution cell defines, directly or
  through a name computed from one (``tools/solution_outputs.py``: it would show the instructor's result),
  an executed cell's stderr (library warnings are silenced at their source), a printed Python dict,
  ``namespace(...)``, dataclass or object repr where prose, a figure or a table belongs, or a Markdown table
  from ``display(Markdown(...))`` left as a paragraph of pipes;
* no code block and no table wider than the text column (a scroll bar or a clipped line): a ``pre`` whose
  ``scrollWidth`` exceeds its ``clientWidth``, a table wider than its scrolling container or the article;
* no words from the book's own history on a chapter page ("the previous lab-target", "an earlier run",
  ``git show``: ``tools/history_words.py``);
* claims-ledger bookkeeping stays off the chapter pages: no row id of the ledger (``_build/claims``, or
  ``$LAB_CLAIMS_DIR``) or of the retired list in a chapter's text (verdicts reach the reader as sentences; ids
  stay on the claims page), and no shown code cell that decides a verdict (``claims.judge``, ``claims.check``,
  ``claims.Rule``, ``claims.record``: such cells are tagged remove-input or remove-cell);
* on each kernel chapter, the Triton kernel's own source, rendered from ``labsrc`` (``labsrc.show``): a
  highlighted block holding ``@triton.jit``;

and a full-page screenshot of each page is saved in the screens folder (``_build/screens``).
"""
from __future__ import annotations

import functools
import http.server
import os
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

import browser_setup
import history_words
import solution_outputs

ROOT = browser_setup.ROOT
HTML = Path(os.environ.get("BOOK_HTML", ROOT / "_build" / "html")).resolve()
SCREENS = Path(os.environ.get("BOOK_SCREENS", HTML.parent / "screens")).resolve()
# Pages that must exist; the figure checks apply to FIGURE_PAGE.
REQUIRED_PAGES = ("book/preface.html", "chapters/01_kv_cache.html")
FIGURE_PAGE = "chapters/01_kv_cache.html"
MIN_FIGURE_BYTES = 3_000      # a real matplotlib PNG is tens of KB; an empty canvas compresses to ~1-2 KB
MIN_FIGURE_COLOURS = 8        # a blank or single-colour image has 1-2 distinct colours
TIMEOUT_MS = 30_000
# Chapters that teach a Triton kernel and must show its source.
KERNEL_PAGES = (
    "chapters/01_kv_cache.html",
    "chapters/03_flash_attention.html",
    "chapters/04_rope.html",
    "chapters/05_kv_quant.html",
    "chapters/07_ssm_scans.html",
    "chapters/08_linear_attention.html",
    "chapters/09_serving.html",
    "chapters/10_speculative.html",
    "chapters/11_pipeline_decoding.html",
    "chapters/12_weight_quant.html",
    "chapters/13_distillation.html",
    "chapters/14_memory_retrieval.html",
    "chapters/15_frontier.html",
)
# What no rendered page may contain: solution regions and hidden tests (stripped from the release version).
FORBIDDEN_TEXT = ("### BEGIN SOLUTION", "### END SOLUTION", "### BEGIN HIDDEN TESTS", "BEGIN HIDDEN TESTS")
# The one console error not counted: pydata-sphinx-theme (under sphinx-book-theme) logs it on a reader's first
# visit, when localStorage has no colour mode yet and the template's `default_mode` is empty; the page then
# uses "auto", as intended. Each test opens a fresh browser context, so every page is a first visit. Setting
# `html_context: {default_mode: auto}` in _config.yml's sphinx.config makes the theme stop logging it.
THEME_FIRST_VISIT = ("Got invalid theme mode: . Resetting to auto.", "/_static/scripts/pydata-sphinx-theme.js")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serve files without logging each request to stderr."""

    def log_message(self, format, *args):  # noqa: A002 - the signature is http.server's
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    """A threaded server that does not print a traceback when the browser drops a connection early."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def is_local(url: str, base: str) -> bool:
    """True for URLs the local server answers; data:, blob: and about: URLs never touch the network."""
    return url.startswith(base) or urlsplit(url).scheme in ("data", "blob", "about")


def find_pages(html: Path) -> list[str]:
    """Every content page of the book (relative paths), required ones first."""
    pages = list(REQUIRED_PAGES)
    for folder in ("book", "chapters"):
        for path in sorted((html / folder).glob("*.html")):
            rel = path.relative_to(html).as_posix()
            if rel not in pages:
                pages.append(rel)
    return pages


# --- fixtures: pytest-playwright's, given the provisioned browser and an offline context --------------------
@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """Launch the browser ``browser_setup.provision`` found (cached by ``make test-browser``'s set-up step);
    when there is none, every test fails with the reason of each way tried."""
    try:
        found = browser_setup.provision(ROOT)
    except browser_setup.ProvisionError as exc:
        pytest.fail(f"browser set-up failed: {exc}", pytrace=False)
    return {**browser_type_launch_args, **found.launch_args()}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1280, "height": 900}, "service_workers": "block"}


@pytest.fixture(scope="session")
def base_url():
    """Serve the built book on a free port of 127.0.0.1 for the whole session; its URL ends with a slash."""
    missing = [p for p in REQUIRED_PAGES if not (HTML / p).is_file()]
    if missing:
        pytest.fail(f"{HTML} lacks {missing}; build the book first (make book)", pytrace=False)
    handler = functools.partial(QuietHandler, directory=str(HTML))
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


class Watch:
    """What one page did: exceptions, console errors, failed local requests, and external requests (refused
    by the route, never fetched)."""

    def __init__(self, page, base: str):
        self.base = base
        self.problems: list[str] = []
        self.external: list[str] = []
        page.on("pageerror", lambda e: self.problems.append(f"JavaScript exception: {e}"))
        page.on("console", self.console)
        page.on("requestfailed", lambda r: self.problems.append(f"local request failed: {r.url} ({r.failure})")
                if is_local(r.url, base) else None)
        page.on("response", lambda r: self.problems.append(f"local request failed: {r.url} (HTTP {r.status})")
                if r.status >= 400 and is_local(r.url, base) else None)
        page.route("**/*", self.route)

    def route(self, route):
        if is_local(route.request.url, self.base):
            route.continue_()
        else:
            self.external.append(route.request.url)
            route.abort()

    def console(self, message):
        if message.type != "error":
            return
        url = (message.location or {}).get("url", "")
        if message.text.startswith("Failed to load resource") and url and not is_local(url, self.base):
            return  # the refused external request, reported once below as such
        if message.text == THEME_FIRST_VISIT[0] and url.split("?")[0].endswith(THEME_FIRST_VISIT[1]):
            return  # see THEME_FIRST_VISIT
        self.problems.append(f"console error: {message.text} [{url}]")

    def report(self) -> list[str]:
        return self.problems + [f"request to a host other than the local server (the page needs the network): {u}"
                                for u in dict.fromkeys(self.external)]


def open_page(page, base: str, page_path: str) -> Watch:
    watch = Watch(page, base)
    page.goto(base + page_path, wait_until="load", timeout=TIMEOUT_MS)
    page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)
    return watch


FIGURE_JS = """
async (minColours) => {
  const imgs = Array.from(document.querySelectorAll('.cell_output img, .output img'));
  const out = [];
  for (const img of imgs) {
    try { await img.decode(); } catch (e) { /* reported below as naturalWidth 0 */ }
    let bytes = -1, colours = -1;
    try { bytes = (await (await fetch(img.currentSrc || img.src)).arrayBuffer()).byteLength; } catch (e) {}
    if (img.naturalWidth > 0) {
      const c = document.createElement('canvas');
      c.width = Math.min(img.naturalWidth, 800); c.height = Math.min(img.naturalHeight, 800);
      const ctx = c.getContext('2d');
      ctx.drawImage(img, 0, 0, c.width, c.height);
      const data = ctx.getImageData(0, 0, c.width, c.height).data;
      const seen = new Set();
      for (let i = 0; i < data.length && seen.size <= minColours; i += 4 * 7) {
        seen.add((data[i] << 24) ^ (data[i + 1] << 16) ^ (data[i + 2] << 8) ^ data[i + 3]);
      }
      colours = seen.size;
    }
    out.push({src: img.getAttribute('src'), width: img.naturalWidth, height: img.naturalHeight, bytes, colours});
  }
  return out;
}
"""

MATHJAX_JS = """
async () => {
  if (!window.MathJax || !MathJax.startup || !MathJax.startup.promise) return null;
  await MathJax.startup.promise;
  return {containers: document.querySelectorAll('mjx-container').length,
          errors: Array.from(document.querySelectorAll('mjx-merror')).map(e => e.textContent.slice(0, 120))};
}
"""

# Blank outputs. A widget view is a <script type=...widget-view+json> that widget JavaScript would replace by
# a rendered box (class jupyter-widgets); the book loads none, so an unrendered one is a blank area. Any other
# output area must show something: text, or an image/canvas/svg/video with a size.
BLANK_JS = """
() => {
  const visible = el => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  const cellOf = el => {
    const cell = el.closest('.cell');
    const src = cell && cell.querySelector('.cell_input');
    return src ? src.innerText.trim().split("\\n")[0].slice(0, 100) : '(no input shown)';
  };
  const out = [];
  for (const s of document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')) {
    const view = s.parentElement.querySelector('.jupyter-widgets, .widget-subarea');
    if (!view || !visible(view)) out.push({kind: 'widget view not rendered', cell: cellOf(s)});
  }
  for (const area of document.querySelectorAll('.cell_output')) {
    if (area.querySelector('script[type="application/vnd.jupyter.widget-view+json"]')) continue;  // above
    const media = Array.from(area.querySelectorAll('img, canvas, svg, video, iframe')).some(visible);
    if (!visible(area) || !(area.innerText.trim() || media)) out.push({kind: 'blank output', cell: cellOf(area)});
  }
  return out;
}
"""


# Outputs a reader should not meet: stderr streams, and printed reprs (a dict or list of dicts, a namespace,
# a dataclass or an object's default repr) in a cell's text output.
REPRS_JS = r"""
() => {
  const out = [];
  const cellOf = el => {
    const cell = el.closest('.cell');
    const src = cell && cell.querySelector('.cell_input');
    return src ? src.innerText.trim().split("\n")[0].slice(0, 100) : '(no input shown)';
  };
  for (const el of document.querySelectorAll('.cell_output .stderr, .cell_output .output.stderr')) {
    out.push({kind: 'stderr output: ' + el.innerText.trim().slice(0, 120), cell: cellOf(el)});
  }
  const repr = /^\s*(\{\s*['"][^'"]+['"]\s*:|\[\{\s*['"]|namespace\(|[A-Z][A-Za-z]+\([a-z_]+=|<[a-zA-Z_.]+ object at 0x)/m;
  for (const el of document.querySelectorAll('.cell_output .output.stream, .cell_output .output.text_plain')) {
    const text = el.innerText;
    const m = text.match(repr);
    if (m) out.push({kind: 'printed repr: ' + text.slice(m.index, m.index + 80).trim(), cell: cellOf(el)});
  }
  // A Markdown table that was not parsed as one shows its pipes and its |---| rule as text.
  const rule = /\|\s*:?(?:-{3,}|\u2014|\u2013)\s*:?\|/;   // the |:---| row (smart dashes or not)
  for (const el of document.querySelectorAll('.cell_output p')) {
    const text = el.innerText;
    if (rule.test(text)) {
      out.push({kind: 'a Markdown table shown as text: ' + text.trim().slice(0, 80), cell: cellOf(el)});
    }
  }
  return out;
}
"""

# Every code cell whose input the page shows, in page order: the code (the <pre> alone: the input area also holds
# the copy button's text), and whether the cell has a non-empty output.
CODE_CELLS_JS = """
() => Array.from(document.querySelectorAll('.cell')).filter(c => c.querySelector('.cell_input pre')).map(c => {
  const out = c.querySelector('.cell_output');
  return [c.querySelector('.cell_input pre').textContent,
          !!(out && (out.textContent.trim() || out.querySelector('img')))];
})
"""

# Code blocks and tables wider than the text column: a reader meets a scroll bar or a clipped line. A <pre> that
# scrolls, or a table whose scrolling container (or the article) is narrower than the table.
OVERFLOW_JS = """
() => {
  const article = document.querySelector('article') || document.querySelector('main') || document.body;
  const right = article.getBoundingClientRect().right;
  const out = [];
  const label = el => el.innerText.trim().split("\\n")[0].slice(0, 80);
  for (const pre of article.querySelectorAll('pre')) {
    if (pre.scrollWidth > pre.clientWidth + 1) {
      const widest = pre.textContent.split("\\n").reduce((a, b) => (b.length > a.length ? b : a), '');
      out.push(`a code block ${pre.scrollWidth - pre.clientWidth}px wider than the column, `
               + `its longest line ${widest.length} characters: '${widest.trim().slice(0, 80)}'`);
    }
  }
  for (const table of article.querySelectorAll('table')) {
    const box = table.closest('.pst-scrollable-table-container, .table-wrapper') || table.parentElement;
    const over = Math.max(box.scrollWidth - box.clientWidth, table.getBoundingClientRect().right - right);
    if (over > 1) {
      out.push(`a table ${Math.round(over)}px wider than the column (${table.rows[0] ? table.rows[0].cells.length : 0} `
               + `columns): ${label(table)}`);
    }
  }
  return out;
}
"""

# Code cells whose input the page shows uncollapsed (not hide-input): their code, first line for the message.
SHOWN_CODE_JS = """
() => Array.from(document.querySelectorAll('.cell:not(.tag_hide-input) .cell_input pre'))
        .map(pre => pre.textContent)
"""
VERDICT_CALLS = ("claims.judge(", "claims.check(", "claims.Rule(", "claims.record(")


@functools.lru_cache(maxsize=1)
def claim_ids() -> frozenset[str]:
    """The ledger's row ids (the records the executed chapters wrote) and the retired ids."""
    sys.path.insert(0, str(ROOT))
    from labsrc import claims
    from labsrc.claims_retired import RETIRED

    return frozenset(r["id"] for r in claims.load()) | frozenset(RETIRED)


def bookkeeping_problems(text: str, shown_code: list[str]) -> list[str]:
    """Row ids in a chapter page's text, and shown code cells that decide a verdict."""
    out = [f"shows the claims-ledger row id {i!r}: a chapter gives the verdict as a sentence, the id stays on "
           "the claims page" for i in sorted(claim_ids()) if i in text]
    out += [f"shows verdict bookkeeping ({', '.join(c for c in VERDICT_CALLS if c in code)}) in a cell starting "
            f"{code.strip().splitlines()[0][:80]!r}: tag it remove-input"
            for code in shown_code if any(c in code for c in VERDICT_CALLS)]
    return out


KERNEL_SOURCE_JS = """
() => Array.from(document.querySelectorAll('.cell_output .highlight, .cell_output pre'))
        .some(el => el.innerText.includes('@triton.jit'))
"""


def pytest_generate_tests(metafunc):
    if "page_path" in metafunc.fixturenames:
        metafunc.parametrize("page_path", find_pages(HTML))


# --- the tests ----------------------------------------------------------------------------------------------
def test_index_redirects_to_the_preface(page, base_url):
    """A broken redirect would leave the reader on an empty page."""
    watch = open_page(page, base_url, "index.html")
    page.wait_for_url("**/book/preface.html", timeout=TIMEOUT_MS)
    assert not watch.report(), "\n".join(watch.report())


def test_page(page, base_url, page_path):
    """Everything a reader of one page sees works offline; see the module docstring for the list."""
    assert (HTML / page_path).is_file(), f"{HTML / page_path} is not in the build"
    watch = open_page(page, base_url, page_path)
    problems, notes = watch.problems, []

    title = page.title()
    if "Long-Context Inference Lab" not in title:
        problems.append(f"page title {title!r} does not name the book")

    if page.locator(".math").count() > 0:
        try:
            page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                   timeout=TIMEOUT_MS)
            math = page.evaluate(MATHJAX_JS)
        except PlaywrightTimeout:
            math = None  # reported just below, with the failed request for MathJax's script if there was one
        if not math or math["containers"] == 0:
            problems.append(f"has maths but MathJax did not typeset it (no mjx-container after "
                            f"{TIMEOUT_MS // 1000} s; is _static/mathjax/ in the build?)")
        else:
            notes.append(f"MathJax typeset {math['containers']} expressions")
            problems += [f"MathJax reports a TeX error: {err!r}" for err in math["errors"]]
    elif page_path == FIGURE_PAGE:
        problems.append("expected maths on this chapter, found no .math element")

    for blank in page.evaluate(BLANK_JS):
        problems.append(f"{blank['kind']} (cell starting {blank['cell']!r})")

    text = page.inner_text("body")
    if page_path.startswith("chapters/"):  # the instructors page shows the markers to explain the format
        problems += [f"shows {marker!r}: solution or hidden-test text reached the page"
                     for marker in FORBIDDEN_TEXT if marker in text]
        problems += [f"words from the book's history, which the reader never met: {h!r}"
                     for h in history_words.find(text)]
    for bad in page.evaluate(REPRS_JS):
        problems.append(f"{bad['kind']} (cell starting {bad['cell']!r})")
    problems += page.evaluate(OVERFLOW_JS)
    if page_path.startswith("chapters/"):
        problems += solution_outputs.page_problems([tuple(c) for c in page.evaluate(CODE_CELLS_JS)])
        problems += bookkeeping_problems(text, page.evaluate(SHOWN_CODE_JS))
    if page_path in KERNEL_PAGES and not page.evaluate(KERNEL_SOURCE_JS):
        problems.append("a kernel chapter that shows no Triton kernel source (labsrc.show.show_source)")

    if page_path == FIGURE_PAGE:
        figures = page.evaluate(FIGURE_JS, MIN_FIGURE_COLOURS)
        if not figures:
            problems.append("no figure in any cell output")
        for fig in figures:
            if fig["width"] <= 0:
                problems.append(f"figure {fig['src']} did not load (naturalWidth 0)")
            elif fig["bytes"] < MIN_FIGURE_BYTES:
                problems.append(f"figure {fig['src']} is only {fig['bytes']} bytes")
            elif fig["colours"] < MIN_FIGURE_COLOURS:
                problems.append(f"figure {fig['src']} looks blank ({fig['colours']} colours)")
        notes.append(f"{len(figures)} figure(s): "
                     + ", ".join(f"{f['width']}x{f['height']} {f['bytes'] // 1024} KB" for f in figures))

    SCREENS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENS / (page_path.replace("/", "__").removesuffix(".html") + ".png")),
                    full_page=True)
    print(f"{page_path}: " + "; ".join(notes))  # shown with pytest -s or -rA
    problems = watch.report()
    assert not problems, f"{page_path}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems)
