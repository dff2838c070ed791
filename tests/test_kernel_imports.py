"""Kernel modules and the modules that use them import in one direction only: down.

A chapter's mechanism (``labsrc/<name>``: the experiment, the model-level code) uses its kernel family
(``labsrc/kernels/<name>``: the Triton kernels with the plain PyTorch references and the formats they read,
flash-linear-attention's naive-beside-the-fast-op layout). A kernel module imports only the runtime, the shared
PyTorch helpers below every mechanism (``labsrc.decay``) and other kernel modules, never a mechanism module above
it: the floors CONTRIBUTING.md promises (issue 42). And no import cycle passes through a kernel module: a cycle
makes the result of an import depend on which module a reader imports first. This reads every ``import``
statement in the package's source (function-level ones too: a lazy import is still a dependency) without
importing anything.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "labsrc"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The ``labsrc`` modules that ``name``'s source imports anywhere in it (``from labsrc import runtime``
    names the module ``labsrc.runtime``; ``from labsrc.kernels.distillation import kd_kl`` the module
    ``labsrc.kernels.distillation``)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}
KERNELS = sorted(m for m in MODULES if m.startswith("labsrc.kernels.") and not m.endswith("._triton"))


def path_back(start: str, goal: str) -> list[str] | None:
    """A chain of imports from ``start`` to ``goal`` (breadth first: the shortest), or None."""
    seen, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for m in frontier:
            for n in sorted(GRAPH[m]):
                if n in seen:
                    continue
                seen[n] = m
                if n == goal:
                    chain = [n]
                    while seen[chain[-1]] is not None:
                        chain.append(seen[chain[-1]])
                    return chain[::-1]
                nxt.append(n)
        frontier = nxt
    return None


def test_the_graph_sees_the_imports_the_kernel_families_are_built_on():
    """The parser finds a module-level import, a lazy one inside a function and a ``from package import
    module`` one: without these the cycle test below would pass on an empty graph."""
    assert "labsrc.kernels.rope" in GRAPH["labsrc.rope"]                 # from labsrc.kernels.rope import ...
    assert "labsrc.kernels.distillation" in GRAPH["labsrc.distillation.losses"]    # inside kd_loss (fused=True)
    assert "labsrc.runtime" in GRAPH["labsrc.kernels.distillation"]           # from labsrc import runtime
    assert "labsrc.kernels.flash_attention" in GRAPH["labsrc.kernels.serving"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_module_a_kernel_imports_imports_it_back(kernel):
    cycles = [chain for dep in sorted(GRAPH[kernel]) if (chain := path_back(dep, kernel))]
    assert not cycles, (f"{kernel} imports a module that imports it back: "
                        + "; ".join(" -> ".join([kernel, *c]) for c in cycles)
                        + ". Keep one direction: the kernel module holds the reference it needs, or the "
                          "mechanism module does not import the kernel")


# What a kernel module may import from labsrc: the package (its __init__ sets up the runtime), the runtime, the
# shared PyTorch helpers no mechanism owns, and the kernel layer itself.
BELOW_KERNELS = {"labsrc", "labsrc.runtime", "labsrc.decay", "labsrc._moved"}


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_import_runs_from_the_kernels_up_into_a_mechanism(kernel):
    up = sorted(m for m in GRAPH[kernel]
                if m not in BELOW_KERNELS and m != "labsrc.kernels" and not m.startswith("labsrc.kernels."))
    assert not up, (f"{kernel} imports {up}, above the kernel layer. Move what it needs (a reference, a check, a "
                    "format) into the kernel family, and let the mechanism module import it from there")


def test_the_direction_test_sees_a_mechanism_import():
    """Without this the test above could pass on a graph that misses imports of mechanism modules."""
    assert {"labsrc.kernels.ssm", "labsrc.decay"} <= GRAPH["labsrc.ssm"]
    assert "labsrc.kernels.kv_quant.codes" in GRAPH["labsrc.kv_quant"]       # a package's __init__ counts too
