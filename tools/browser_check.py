"""Open the built book in a headless browser and check what a reader would see.

Run by ``make test-browser`` after ``make book``::

    python tools/browser_check.py _build/html [--screens _build/screens]

It serves the HTML folder on 127.0.0.1 (a local ``http.server`` in a thread), drives Debian's Chromium through
Playwright with no network, and checks every page of the book:

* no JavaScript exception and no console error, except the environmental ones listed in
  :func:`environmental` (each with its reason);
* no failed or 4xx/5xx request to the local server: every asset the book links must be in the build;
* on pages with maths, MathJax (served from the book itself) typeset it: ``mjx-container`` elements exist,
  and none holds a TeX error (``mjx-merror``);
* on chapter 1, the figures in the code-cell outputs loaded (``naturalWidth > 0``), are more than a few KB
  and are not blank (more than a handful of distinct colours);

and saves a full-page screenshot of each page to the screens folder. It exits non-zero, listing every problem,
when a check fails.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # the check runs as root in CI containers, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Pages that must exist; the figure checks apply to FIGURE_PAGE.
REQUIRED_PAGES = ("book/preface.html", "chapters/01_kv_cache.html")
FIGURE_PAGE = "chapters/01_kv_cache.html"
MIN_FIGURE_BYTES = 3_000      # a real matplotlib PNG is tens of KB; an empty canvas compresses to ~1-2 KB
MIN_FIGURE_COLOURS = 8        # a blank or single-colour image has 1-2 distinct colours
TIMEOUT_MS = 30_000


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serve files without logging each request to stderr."""

    def log_message(self, format, *args):  # noqa: A002 - the signature is http.server's
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    """A threaded server that does not print a traceback when the browser drops a connection early."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Start a static server for ``folder`` on a free port of 127.0.0.1; return it and its base URL."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def is_local(url: str, base: str) -> bool:
    """True for URLs the local server answers; data: and blob: URLs never touch the network."""
    return url.startswith(base) or urlsplit(url).scheme in ("data", "blob", "about")


def environmental(message, base: str) -> str | None:
    """Why a console error comes from the offline test environment rather than from the book, or None.

    The only console errors we accept are the browser reporting a resource it could not load from *outside*
    the local server: the check blocks every external request (the book must work offline), so a page that
    references, e.g., a CDN font or the thebe/Binder runtime gets ``net::ERR_FAILED`` for it. Those resources
    are optional in the book (nothing renders from them), and reporting them as book errors would make the
    test depend on the network. Every other console error, including any failure of a local URL, counts.
    """
    url = (message.location or {}).get("url", "")
    if message.text.startswith("Failed to load resource") and url and not is_local(url, base):
        return f"external resource blocked by the offline test: {url}"
    return None


def find_pages(html: Path) -> list[str]:
    """Every content page of the book (relative paths), required ones first."""
    pages = list(REQUIRED_PAGES)
    for folder in ("book", "chapters"):
        for path in sorted((html / folder).glob("*.html")):
            rel = path.relative_to(html).as_posix()
            if rel not in pages:
                pages.append(rel)
    return pages


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


def check_page(context, base: str, page_path: str, screens: Path, problems: list[str], notes: list[str]) -> None:
    """Open one page, run the checks that apply to it, save its screenshot; append failures to ``problems``."""
    page = context.new_page()
    console_errors, local_failures = [], []
    page.on("console", lambda m: console_errors.append(m) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"{page_path}: JavaScript exception: {e}"))
    page.on("requestfailed", lambda r: local_failures.append(f"{r.url} ({r.failure})") if is_local(r.url, base) else None)
    page.on("response", lambda r: local_failures.append(f"{r.url} (HTTP {r.status})")
            if r.status >= 400 and is_local(r.url, base) else None)

    page.goto(base + page_path, wait_until="load", timeout=TIMEOUT_MS)
    page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)
    title = page.title()
    if "Long-Context Inference Lab" not in title:
        problems.append(f"{page_path}: page title {title!r} does not name the book")

    has_math = page.locator(".math").count() > 0
    if has_math:
        try:
            page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                   timeout=TIMEOUT_MS)
            math = page.evaluate(MATHJAX_JS)
        except PlaywrightTimeout:
            math = None  # reported just below, with the failed request for MathJax's script if there was one
        if not math or math["containers"] == 0:
            problems.append(f"{page_path}: has maths but MathJax did not typeset it (no mjx-container after "
                            f"{TIMEOUT_MS // 1000} s; is _static/mathjax/ in the build?)")
        else:
            notes.append(f"{page_path}: MathJax typeset {math['containers']} expressions")
            for err in math["errors"]:
                problems.append(f"{page_path}: MathJax reports a TeX error: {err!r}")
    elif page_path == FIGURE_PAGE:
        problems.append(f"{page_path}: expected maths on this chapter, found no .math element")

    if page_path == FIGURE_PAGE:
        figures = page.evaluate(FIGURE_JS, MIN_FIGURE_COLOURS)
        if not figures:
            problems.append(f"{page_path}: no figure in any cell output")
        for fig in figures:
            if fig["width"] <= 0:
                problems.append(f"{page_path}: figure {fig['src']} did not load (naturalWidth 0)")
            elif fig["bytes"] < MIN_FIGURE_BYTES:
                problems.append(f"{page_path}: figure {fig['src']} is only {fig['bytes']} bytes")
            elif fig["colours"] < MIN_FIGURE_COLOURS:
                problems.append(f"{page_path}: figure {fig['src']} looks blank ({fig['colours']} colours)")
        notes.append(f"{page_path}: {len(figures)} figure(s): "
                     + ", ".join(f"{f['width']}x{f['height']} {f['bytes'] // 1024} KB" for f in figures))

    page.screenshot(path=str(screens / (page_path.replace("/", "__").removesuffix(".html") + ".png")),
                    full_page=True)
    for message in console_errors:
        reason = environmental(message, base)
        if reason:
            notes.append(f"{page_path}: ignored console error ({reason})")
        else:
            where = (message.location or {}).get("url", "")
            problems.append(f"{page_path}: console error: {message.text} [{where}]")
    for failure in local_failures:
        problems.append(f"{page_path}: local request failed: {failure}")
    page.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, nargs="?", default=Path("_build/html"), help="the built HTML folder")
    parser.add_argument("--screens", type=Path, default=None,
                        help="where to save screenshots (default: screens/ beside the HTML folder)")
    args = parser.parse_args(argv)

    html = args.html.resolve()
    missing = [p for p in REQUIRED_PAGES if not (html / p).is_file()]
    if missing:
        print(f"browser check FAILED: {html} lacks {missing}; build the book first (make book)", file=sys.stderr)
        return 1
    chromium = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if not chromium:
        print("browser check FAILED: no chromium; install it with `apt-get install -y chromium`", file=sys.stderr)
        return 1
    screens = (args.screens or html.parent / "screens").resolve()
    screens.mkdir(parents=True, exist_ok=True)

    server, base = serve(html)
    problems: list[str] = []
    notes: list[str] = []
    blocked: set[str] = set()

    def route(r):
        # Offline by construction: anything not served by the local server is refused, never fetched.
        if is_local(r.request.url, base):
            r.continue_()
        else:
            blocked.add(r.request.url)
            r.abort()

    try:
        with tempfile.TemporaryDirectory(prefix="book-browser-") as profile, sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 900}, service_workers="block")
            context.route("**/*", route)
            # The index redirects to the preface; a broken redirect leaves the reader on an empty page.
            page = context.new_page()
            page.goto(base + "index.html", wait_until="load", timeout=TIMEOUT_MS)
            page.wait_for_url("**/book/preface.html", timeout=TIMEOUT_MS)
            page.close()
            pages = find_pages(html)
            for page_path in pages:
                check_page(context, base, page_path, screens, problems, notes)
            context.close()
    finally:
        server.shutdown()

    for note in notes:
        print(f"  {note}")
    for url in sorted(blocked):
        print(f"  blocked external request (offline test): {url}")
    if problems:
        print(f"browser check FAILED ({len(problems)} problem(s)):", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"browser check passed: {len(pages)} pages, screenshots in {screens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
