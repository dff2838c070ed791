"""Find or fetch a Chromium for the browser test, without root and without changing the system.

Run by ``make test-browser`` before the test itself (which calls :func:`provision` again and gets the cached
answer)::

    python tools/browser_setup.py [--only playwright|system|debian] [--refresh]

The ways to get a browser, tried in this order; the first one whose browser really starts wins:

(a) ``playwright``: ``python -m playwright install chromium``, Playwright's own build, downloaded into the
    user's cache (``~/.cache/ms-playwright``, or ``$PLAYWRIGHT_BROWSERS_PATH``). Needs no root; this is what
    works on a student's laptop or on GitHub's CI. It fails where Playwright's download site is unreachable.
(b) ``system``: a Chromium already on the PATH (``chromium``, ``chromium-browser``, ``google-chrome``,
    ``google-chrome-stable``).
(c) ``debian``: Debian's ``chromium`` package, fetched and unpacked inside the repository, never installed.
    ``apt-get update`` and ``apt-get download`` run with apt's lists and cache redirected into
    ``_build/browser/apt/`` (they read the machine's ``/etc/apt/sources.list*`` and keyrings, which anyone
    may read); ``apt-get --simulate install`` against the system's dpkg status names the packages the system
    lacks (or has in too old a version); each one is unpacked with ``dpkg -x`` into ``_build/browser/root/``,
    and the browser runs from there with ``LD_LIBRARY_PATH`` pointing at the unpacked libraries. Nothing is
    written outside ``_build/browser/``: no ``apt-get install``, no ``dpkg -i``, no write to ``/usr``,
    ``/etc`` or ``/var``. Works as a normal user.

The winner is recorded in ``_build/browser/browser.json``; a later run checks that this browser still starts
and reuses it, so a second ``make test`` downloads nothing. ``--refresh`` forgets it. When every way fails,
:class:`ProvisionError` lists why each one failed, and the browser test fails with that message.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("playwright", "system", "debian")
LABELS = {"playwright": "(a) Playwright's Chromium in the user's cache",
          "system": "(b) a Chromium already on this machine",
          "debian": "(c) Debian's chromium, unpacked into the repository"}
SYSTEM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DEBIAN_PACKAGE = "chromium"
DEBIAN_BINARY = "usr/lib/chromium/chromium"  # the real binary; /usr/bin/chromium is a wrapper script
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL_TIMEOUT_S = 900  # a download of ~150 MB on a slow line


class ProvisionError(RuntimeError):
    """No way of getting a browser worked; the message says why each one failed."""


@dataclass
class Browser:
    """A browser the test can launch: how it was obtained, its binary (None: Playwright's own build), and the
    environment variables it needs on top of the caller's (the unpacked libraries and fonts for (c))."""

    method: str
    executable: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def launch_args(self) -> dict:
        """Keyword arguments for Playwright's ``chromium.launch`` (and pytest-playwright's
        ``browser_type_launch_args``). Playwright adds ``--no-sandbox`` itself (its ``chromium_sandbox``
        defaults to False), which an unpacked browser needs: its sandbox helper is not setuid root."""
        args: dict = {"args": list(CHROMIUM_ARGS)}
        if self.executable:
            args["executable_path"] = self.executable
        if self.env:
            args["env"] = {**os.environ, **self.env}
        return args

    def describe(self) -> str:
        return f"{LABELS[self.method]}: {self.executable or 'managed by Playwright'}"


Run = Callable[..., subprocess.CompletedProcess]
Which = Callable[[str], "str | None"]
Launch = Callable[[Browser], "str | None"]  # None when the browser started, else why not


def playwright_launch(browser: Browser) -> str | None:
    """Start the browser headless through Playwright, open a blank page, close it; None if that worked."""
    from playwright.sync_api import Error, sync_playwright

    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(headless=True, timeout=60_000, **browser.launch_args())
            b.new_page().goto("about:blank")
            b.close()
    except Error as exc:
        return " ".join(str(exc).split())[:400]
    return None


def folder(root: Path) -> Path:
    """Where everything this module writes lives: ``<repository>/_build/browser``."""
    return root / "_build" / "browser"


# The machine's apt configuration may run commands after an update or around dpkg (Debian's appstream
# refreshes /var/cache/swcatalog, PackageKit is notified, docker images clean /var/cache/apt). None of them
# concerns a download into the repository, and some write to the system: this file, read after the system's
# configuration (`apt-get -c`), clears them.
APT_CONF = """\
// Written by tools/browser_setup.py: no hooks for apt runs that only fetch packages into _build/browser.
#clear APT::Update::Pre-Invoke;
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
#clear APT::Update::Post-Invoke-Stamps;
#clear DPkg::Pre-Invoke;
#clear DPkg::Post-Invoke;
#clear DPkg::Pre-Install-Pkgs;
#clear DPkg::Post-Install-Pkgs;
"""


def apt_options(apt_dir: Path) -> list[str]:
    """apt options that keep apt's own state (package lists, downloaded .debs, caches, locks) in ``apt_dir``
    while reading the machine's sources, keyrings and dpkg status (the packages already installed), and that
    switch off the machine's apt hooks (``apt_dir/apt.conf``, written from :data:`APT_CONF`)."""
    opts = {
        "Dir::State": apt_dir / "state",
        "Dir::State::Lists": apt_dir / "lists",
        "Dir::Cache": apt_dir / "cache",
        "Dir::Log": apt_dir / "log",  # a simulated install writes the solver's log (eipp.log.xz) there
        "Dir::State::status": "/var/lib/dpkg/status",  # read only: what the system already has
        "Debug::NoLocking": "1",  # never take the system's dpkg lock (a simulation does not need it)
    }
    if os.geteuid() == 0:
        # As root apt downloads as the user _apt, who may not be allowed into the repository folder.
        opts["APT::Sandbox::User"] = "root"
    return ["-c", str(apt_dir / "apt.conf")] + [arg for key, value in opts.items() for arg in ("-o", f"{key}={value}")]


def parse_simulation(text: str) -> list[str]:
    """``name=version`` for every ``Inst`` line of ``apt-get --simulate install``: the packages the system
    lacks, or has in a version older than the browser needs (``Inst libx [old] (new ...)``)."""
    found = []
    for line in text.splitlines():
        m = re.match(r"Inst (\S+) (?:\[[^\]]*\] )?\((\S+) ", line)
        if m:
            found.append(f"{m.group(1)}={m.group(2)}")
    return found


def library_dirs(tree: Path) -> list[str]:
    """Every folder of the unpacked tree that holds a shared library, for ``LD_LIBRARY_PATH``."""
    dirs = {p.parent for p in tree.rglob("*.so*") if p.is_file() and re.search(r"\.so(\.\d+)*$", p.name)}
    return sorted(str(d) for d in dirs)


def fonts_conf(tree: Path, out: Path) -> Path | None:
    """A fontconfig file for the unpacked tree when it brought fonts or fontconfig's own configuration (the
    system had none): the system's and the tree's font folders, a cache inside ``out``'s folder. None when the
    tree has neither (the system's fontconfig set-up then serves as it is)."""
    if not ((tree / "etc/fonts").is_dir() or (tree / "usr/share/fonts").is_dir()):
        return None
    out.write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">\n<fontconfig>\n'
        "  <dir>/usr/share/fonts</dir>\n"
        f"  <dir>{tree / 'usr/share/fonts'}</dir>\n"
        '  <include ignore_missing="yes">/etc/fonts/conf.d</include>\n'
        f"  <cachedir>{out.parent / 'fontconfig-cache'}</cachedir>\n"
        "</fontconfig>\n")
    return out


def debian_env(root: Path) -> dict[str, str]:
    """The environment the unpacked browser needs: its libraries, fonts, and home folders in the build."""
    base = folder(root)
    tree = base / "root"
    env = {"LD_LIBRARY_PATH": ":".join(library_dirs(tree) + [os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(":"),
           "XDG_CONFIG_HOME": str(base / "home" / "config"),
           "XDG_CACHE_HOME": str(base / "home" / "cache")}
    conf = fonts_conf(tree, base / "fonts.conf")
    if conf:
        env["FONTCONFIG_FILE"] = str(conf)
    return env


def try_playwright(root: Path, run: Run, which: Which, log: Callable[[str], None]) -> Browser | str:
    """(a) Playwright's Chromium in the user's cache; already there, the install command returns at once."""
    cmd = [sys.executable, "-m", "playwright", "install", "chromium"]
    log("  (a) " + " ".join(cmd[1:]))
    try:
        done = run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`playwright install chromium` did not finish: {exc}"
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        first = next((line for line in lines if line.startswith("Error")), lines[-1] if lines else "no output")
        return f"`playwright install chromium` failed (exit {done.returncode}): {first[:300]}"
    return Browser("playwright")


def try_system(root: Path, run: Run, which: Which, log: Callable[[str], None]) -> Browser | str:
    """(b) A Chromium or Chrome on the PATH."""
    for name in SYSTEM_NAMES:
        path = which(name)
        if path:
            log(f"  (b) found {name} at {path}")
            return Browser("system", path)
    return f"none of {', '.join(SYSTEM_NAMES)} is on the PATH"


def try_debian(root: Path, run: Run, which: Which, log: Callable[[str], None]) -> Browser | str:
    """(c) Debian's chromium and the packages the system lacks, unpacked into ``_build/browser/root``."""
    base = folder(root)
    tree = base / "root"
    binary = tree / DEBIAN_BINARY
    if binary.is_file():  # unpacked by an earlier run
        return Browser("debian", str(binary), debian_env(root))
    missing = [tool for tool in ("apt-get", "dpkg") if not which(tool)]
    if missing:
        return f"not a Debian-like system ({' and '.join(missing)} missing)"
    apt_dir = base / "apt"
    for sub in ("state", "lists/partial", "cache/archives/partial", "log"):
        (apt_dir / sub).mkdir(parents=True, exist_ok=True)
    (apt_dir / "apt.conf").write_text(APT_CONF)
    opts = apt_options(apt_dir)

    def step(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
        log("  (c) " + " ".join(c for c in cmd if c not in opts))  # the options: see apt_options
        return run(cmd, capture_output=True, text=True, cwd=cwd, timeout=INSTALL_TIMEOUT_S)

    def failed(what: str, done: subprocess.CompletedProcess) -> str:
        return f"{what} failed (exit {done.returncode}): " + " ".join((done.stderr or done.stdout).split())[-300:]

    done = step(["apt-get", *opts, "-q", "update"])
    if done.returncode != 0:
        return failed("apt-get update (lists kept in _build/browser/apt)", done)
    done = step(["apt-get", *opts, "--simulate", "--no-install-recommends", "install", DEBIAN_PACKAGE])
    if done.returncode != 0:
        return failed(f"apt-get --simulate install {DEBIAN_PACKAGE}", done)
    packages = parse_simulation(done.stdout)
    if not any(p.startswith(DEBIAN_PACKAGE + "=") for p in packages):
        return f"apt does not offer the package {DEBIAN_PACKAGE!r} to this machine"
    debs = base / "debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir(parents=True)
    done = step(["apt-get", *opts, "-q", "download", *packages], cwd=debs)
    if done.returncode != 0:
        return failed("apt-get download", done)
    files = sorted(debs.glob("*.deb"))
    log(f"  (c) downloaded {len(files)} packages, {sum(f.stat().st_size for f in files) / 1e6:.0f} MB")
    partial = base / "root.partial"  # renamed to root/ only once every package is unpacked
    shutil.rmtree(partial, ignore_errors=True)
    for deb in files:
        done = step(["dpkg", "-x", str(deb), str(partial)])
        if done.returncode != 0:
            return failed(f"dpkg -x {deb.name}", done)
    if not (partial / DEBIAN_BINARY).is_file():
        return f"the unpacked packages have no {DEBIAN_BINARY}"
    shutil.rmtree(tree, ignore_errors=True)
    partial.rename(tree)
    shutil.rmtree(debs)  # the unpacked tree is the cache; the .debs would only double the disk used
    return Browser("debian", str(tree / DEBIAN_BINARY), debian_env(root))


TRIES = {"playwright": try_playwright, "system": try_system, "debian": try_debian}


def provision(root: Path = ROOT, methods: Sequence[str] = METHODS, *, refresh: bool = False,
              run: Run = subprocess.run, which: Which = shutil.which, launch: Launch = playwright_launch,
              log: Callable[[str], None] = print) -> Browser:
    """Return a browser that starts, trying ``methods`` in order (see the module docstring); reuse the one
    recorded in ``_build/browser/browser.json`` when it still starts. Raise :class:`ProvisionError` if none
    works."""
    unknown = [m for m in methods if m not in TRIES]
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty list of {METHODS}, got {list(methods)}")
    cache = folder(root) / "browser.json"
    if cache.is_file() and not refresh:
        try:
            cached = Browser(**json.loads(cache.read_text()))
        except (TypeError, ValueError):
            cached = None
        if cached and cached.method in methods and launch(cached) is None:
            log(f"browser (cached in {cache.relative_to(root)}): {cached.describe()}")
            return cached
    reasons = []
    for method in methods:
        start = time.monotonic()
        got = TRIES[method](root, run, which, log)
        if isinstance(got, Browser):
            why = launch(got)
            if why is None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(asdict(got), indent=1) + "\n")
                log(f"browser: {got.describe()} ({time.monotonic() - start:.0f} s)")
                return got
            got = f"it was found but did not start: {why}"
        log(f"  {LABELS[method]}: not available: {got}")
        reasons.append(f"{LABELS[method]}: {got}")
    raise ProvisionError("no browser for the browser test; every way failed:\n  " + "\n  ".join(reasons)
                         + "\nInstall Chromium (or Chrome) yourself, or make `playwright install chromium` work.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=METHODS, action="append",
                        help="try only this way (repeatable); default: all, in the order (a), (b), (c)")
    parser.add_argument("--refresh", action="store_true", help="ignore the browser recorded by an earlier run")
    args = parser.parse_args(argv)
    try:
        provision(ROOT, args.only or METHODS, refresh=args.refresh)
    except ProvisionError as exc:
        print(f"browser set-up FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
