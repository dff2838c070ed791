"""The browser test's set-up (tools/browser_setup.py) and the widget fallback script (tools/widget_cells.py).

Fast: every command is a fake that records what it was asked to run, except ``apt-config`` (local, no network),
which resolves the apt options for real. ``make test-browser`` is the end-to-end check.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bs = load_tool("browser_setup")
wc = load_tool("widget_cells")

SIMULATION = """\
NOTE: This is only a simulation!
Reading package lists...
Inst libfoo1 (1.2-3 Debian:12.8/stable [amd64])
Inst libbar2 [2.0-1] (2.1-1 Debian-Security:12/stable-security [amd64])
Inst chromium-common (120.0-1~deb12u1 Debian-Security:12/stable-security [amd64])
Inst chromium (120.0-1~deb12u1 Debian-Security:12/stable-security [amd64])
Conf libfoo1 (1.2-3 Debian:12.8/stable [amd64])
Conf chromium (120.0-1~deb12u1 Debian-Security:12/stable-security [amd64])
"""


class FakeSystem:
    """Stands in for subprocess.run and shutil.which: records every command; `apt-get download` writes fake
    .debs into its cwd and `dpkg -x` unpacks a fake tree, as the real ones would."""

    def __init__(self, playwright_rc=1, on_path=(), apt=True, simulation=SIMULATION):
        self.calls: list[tuple[list[str], Path | None]] = []
        self.playwright_rc = playwright_rc
        self.on_path = set(on_path)
        self.apt = apt
        self.simulation = simulation

    def which(self, name):
        if name in ("apt-get", "dpkg"):
            return f"/usr/bin/{name}" if self.apt else None
        return f"/opt/bin/{name}" if name in self.on_path else None

    def run(self, cmd, capture_output=True, text=True, cwd=None, timeout=None):
        self.calls.append((list(cmd), cwd))
        out = ""
        if cmd[1:4] == ["-m", "playwright", "install"]:
            return subprocess.CompletedProcess(cmd, self.playwright_rc, "", "Error: Download failure, code=1")
        if cmd[0] == "apt-get" and "--simulate" in cmd:
            out = self.simulation
        elif cmd[0] == "apt-get" and "download" in cmd:
            for spec in cmd[cmd.index("download") + 1:]:
                name, version = spec.split("=")
                (Path(cwd) / f"{name}_{version}_amd64.deb").write_bytes(b"!<arch>\n")
        elif cmd[:2] == ["dpkg", "-x"]:
            deb, dest = Path(cmd[2]), Path(cmd[3])
            lib = dest / "usr/lib/x86_64-linux-gnu"
            lib.mkdir(parents=True, exist_ok=True)
            (lib / f"{deb.name.split('_')[0]}.so.1").write_bytes(b"\x7fELF")
            if deb.name.startswith("chromium_"):
                (dest / "usr/lib/chromium").mkdir(parents=True, exist_ok=True)
                (dest / bs.DEBIAN_BINARY).write_bytes(b"\x7fELF")
                (dest / "usr/lib/chromium/libEGL.so").write_bytes(b"\x7fELF")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    def commands(self, program):
        return [cmd for cmd, _ in self.calls if cmd[0] == program]


def starts(browser):
    return None


def provision(repo, fake, launch=starts, **kw):
    return bs.provision(repo, run=fake.run, which=fake.which, launch=launch, log=lambda _: None, **kw)


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "repo").mkdir()
    return tmp_path / "repo"


def test_playwright_first_when_its_install_works(repo):
    fake = FakeSystem(playwright_rc=0, on_path={"chromium"})
    got = provision(repo, fake)
    assert (got.method, got.executable) == ("playwright", None)
    assert fake.calls[0][0][1:] == ["-m", "playwright", "install", "chromium"]
    assert not fake.commands("apt-get")
    assert "executable_path" not in got.launch_args()


def test_a_chromium_on_the_path_when_playwright_cannot_download(repo):
    fake = FakeSystem(on_path={"google-chrome"})
    got = provision(repo, fake)
    assert (got.method, got.executable) == ("system", "/opt/bin/google-chrome")
    assert got.launch_args()["executable_path"] == "/opt/bin/google-chrome"
    assert not fake.commands("apt-get")


def test_a_browser_that_does_not_start_is_passed_over(repo):
    fake = FakeSystem(playwright_rc=0, on_path={"chromium"})
    got = provision(repo, fake, launch=lambda b: "missing libnss3.so" if b.method == "playwright" else None)
    assert got.method == "system"


def test_debian_package_unpacked_into_the_build_folder(repo):
    fake = FakeSystem()
    got = provision(repo, fake)
    base = repo / "_build" / "browser"
    assert got.method == "debian"
    assert got.executable == str(base / "root" / bs.DEBIAN_BINARY)
    # the libraries of every unpacked package, and chromium's own folder, are on the library path
    lib_path = got.env["LD_LIBRARY_PATH"].split(":")
    assert str(base / "root/usr/lib/x86_64-linux-gnu") in lib_path
    assert str(base / "root/usr/lib/chromium") in lib_path
    assert got.launch_args()["env"]["LD_LIBRARY_PATH"] == got.env["LD_LIBRARY_PATH"]
    # exactly the packages of the simulation's Inst lines, pinned to the simulated versions
    download = next(c for c in fake.commands("apt-get") if "download" in c)
    assert download[download.index("download") + 1:] == [
        "libfoo1=1.2-3", "libbar2=2.1-1", "chromium-common=120.0-1~deb12u1", "chromium=120.0-1~deb12u1"]
    assert not (base / "debs").exists(), "the .debs are deleted once unpacked"
    assert not (base / "root.partial").exists()
    assert json.loads((base / "browser.json").read_text())["method"] == "debian"


def test_apt_and_dpkg_never_install_and_keep_their_state_in_the_build_folder(repo):
    fake = FakeSystem()
    provision(repo, fake)
    base = repo / "_build" / "browser"
    apt = fake.commands("apt-get")
    assert [next(a for a in ("update", "install", "download") if a in c) for c in apt] == \
        ["update", "install", "download"]
    for cmd in apt:
        assert "install" not in cmd or "--simulate" in cmd, cmd
        opts = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "-o")
        for key in ("Dir::State", "Dir::State::Lists", "Dir::Cache", "Dir::Log"):
            assert Path(opts[key]).is_relative_to(base / "apt"), (key, opts[key])
        assert opts["Dir::State::status"] == "/var/lib/dpkg/status"  # read: what the system has
        assert cmd[cmd.index("-c") + 1] == str(base / "apt" / "apt.conf")
    assert (base / "apt" / "apt.conf").read_text() == bs.APT_CONF
    dpkg = fake.commands("dpkg")
    assert dpkg and all(c[:2] == ["dpkg", "-x"] and Path(c[3]).is_relative_to(base) for c in dpkg)
    for cmd, cwd in fake.calls:
        if cwd is not None:
            assert Path(cwd).is_relative_to(base)


def test_nothing_is_written_outside_the_repository(repo, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    provision(repo, FakeSystem())
    written = [p for p in tmp_path.rglob("*") if not p.is_relative_to(repo)]
    assert sorted(written) == [outside, outside / "keep"]
    assert all(p.is_relative_to(repo / "_build" / "browser") for p in repo.rglob("*") if p != repo / "_build")


def test_a_second_run_reuses_the_cached_browser_without_any_command(repo):
    provision(repo, FakeSystem())
    fake = FakeSystem()
    got = provision(repo, fake)
    assert got.method == "debian" and fake.calls == []


def test_a_cached_browser_that_no_longer_starts_is_provisioned_again(repo):
    provision(repo, FakeSystem(on_path={"chromium"}))
    fake = FakeSystem(playwright_rc=0, on_path={"chromium"})
    got = provision(repo, fake, launch=lambda b: "gone" if b.method == "system" else None)
    assert got.method == "playwright"
    assert json.loads((repo / "_build/browser/browser.json").read_text())["method"] == "playwright"


def test_an_unpacked_tree_is_reused_without_downloading(repo):
    provision(repo, FakeSystem())
    (repo / "_build/browser/browser.json").unlink()
    fake = FakeSystem()
    got = provision(repo, fake, methods=["debian"])
    assert got.method == "debian" and fake.calls == []


def test_every_way_failing_is_an_error_naming_each_reason(repo):
    fake = FakeSystem(apt=False)
    with pytest.raises(bs.ProvisionError) as err:
        provision(repo, fake)
    text = str(err.value)
    assert "(a)" in text and "Download failure" in text
    assert "(b)" in text and "chromium-browser" in text
    assert "(c)" in text and "apt-get and dpkg missing" in text
    assert not (repo / "_build/browser/browser.json").exists()


def test_no_chromium_offered_by_apt_is_an_error(repo):
    fake = FakeSystem(simulation="Inst libfoo1 (1.2-3 Debian:12.8/stable [amd64])\n")
    with pytest.raises(bs.ProvisionError, match="does not offer the package 'chromium'"):
        provision(repo, fake, methods=["debian"])


@pytest.mark.parametrize("methods", [[], ["apt"], ["system", "snap"]])
def test_unknown_methods_are_refused(repo, methods):
    with pytest.raises(ValueError, match="methods must be a non-empty list"):
        provision(repo, FakeSystem(), methods=methods)


def test_parse_simulation_reads_new_and_upgraded_packages_only():
    assert bs.parse_simulation(SIMULATION) == [
        "libfoo1=1.2-3", "libbar2=2.1-1", "chromium-common=120.0-1~deb12u1", "chromium=120.0-1~deb12u1"]
    assert bs.parse_simulation("Remv libold (1.0)\nConf x (1 y [all])\n") == []


def test_fonts_conf_only_when_the_tree_brought_fonts(tmp_path):
    tree = tmp_path / "root"
    tree.mkdir()
    assert bs.fonts_conf(tree, tmp_path / "fonts.conf") is None
    (tree / "usr/share/fonts/truetype").mkdir(parents=True)
    conf = bs.fonts_conf(tree, tmp_path / "fonts.conf")
    text = conf.read_text()
    assert f"<dir>{tree / 'usr/share/fonts'}</dir>" in text and "<dir>/usr/share/fonts</dir>" in text
    assert f"<cachedir>{tmp_path / 'fontconfig-cache'}</cachedir>" in text


@pytest.mark.skipif(not shutil.which("apt-config"), reason="apt-config exists on Debian-like systems only")
def test_apt_resolves_every_state_folder_into_the_build_folder(tmp_path):
    """The real apt reads the options: lists, archives and logs land in the folder; the hooks are cleared."""
    apt_dir = tmp_path / "apt"
    apt_dir.mkdir()
    (apt_dir / "apt.conf").write_text(bs.APT_CONF)
    shell = subprocess.run(["apt-config", *bs.apt_options(apt_dir), "shell", "L", "Dir::State::lists/d",
                            "A", "Dir::Cache::archives/d", "G", "Dir::Log/d", "S", "Dir::State::status/f"],
                           capture_output=True, text=True, check=True).stdout
    got = dict(line.split("=", 1) for line in shell.split())
    for key in "LAG":
        assert Path(got[key].strip("'")).is_relative_to(apt_dir), (key, got[key])
    assert got["S"].strip("'") == "/var/lib/dpkg/status"
    dump = subprocess.run(["apt-config", *bs.apt_options(apt_dir), "dump"], capture_output=True, text=True,
                          check=True).stdout
    hooks = [line for line in dump.splitlines() if "Invoke" in line or "Install-Pkgs" in line]
    # a cleared list leaves its empty head (`APT::Update::Post-Invoke-Success "";`) and no command under it
    assert all(line.endswith(' "";') for line in hooks), f"apt hooks would still run: {hooks}"


# --- tools/widget_cells.py ------------------------------------------------------------------------------------
def notebook(*sources):
    return {"cells": [{"cell_type": "code", "metadata": {}, "source": s, "outputs": [], "execution_count": None}
                      for s in sources], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_widget_cells_edit_once_and_then_leave_the_cell_alone():
    plan = [("widgets.interactive(", [("display(w)\n", "display({**w._repr_mimebundle_(), **static})\n")])]
    nb = notebook("x = 1", "w = widgets.interactive(f)\ndisplay(w)")
    assert wc.edit_notebook(nb, plan, "nb") == 1
    assert nb["cells"][1]["source"] == "w = widgets.interactive(f)\ndisplay({**w._repr_mimebundle_(), **static})"
    assert nb["cells"][0]["source"] == "x = 1"
    assert wc.edit_notebook(nb, plan, "nb") == 0


def test_widget_cells_refuse_a_cell_that_changed():
    plan = [("widgets.interactive(", [("display(w)\n", "display(fallback)\n")])]
    with pytest.raises(wc.CellChanged, match="expected exactly one 'display"):
        wc.edit_notebook(notebook("w = widgets.interactive(f)\nshow(w)"), plan, "nb")
    with pytest.raises(wc.CellChanged, match="found 0"):
        wc.edit_notebook(notebook("x = 1"), plan, "nb")


def test_the_chapters_widget_cells_have_their_static_fallback(tmp_path):
    """The widget cells of the chapters carry the fallback; rerunning the script changes nothing."""
    for rel in wc.EDITS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert wc.main(["--check", "--root", str(ROOT)]) == 0
    assert wc.main(["--root", str(tmp_path)]) == 0
    for rel in wc.EDITS:
        assert json.loads((tmp_path / rel).read_text()) == json.loads((ROOT / rel).read_text())
