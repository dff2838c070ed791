"""Find the launchable Triton kernels of :mod:`labsrc.kernels` by reading its source.

A kernel is *launchable* when it is a ``@triton.jit`` function that no other ``@triton.jit`` function of the
package uses: the helpers (``_online_softmax_step``, ``_decay.chunk_segsum``, the combine function handed to
``tl.associative_scan``, ...) are inlined into the kernels that use them and cannot be launched alone.
Reading the source (with :mod:`ast`, importing nothing) rather than keeping a list means that a kernel added
to the package is found by the compile check, which then fails until the kernel has a compile spec
(:mod:`labsrc.gpucheck.specs`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"


@dataclass(frozen=True)
class Kernel:
    """One launchable kernel: its module (``labsrc.kernels.<module>``), its name, whether it runs ``tl.dot``."""

    module: str
    name: str
    uses_dot: bool

    @property
    def qualname(self) -> str:
        return f"labsrc.kernels.{self.module}.{self.name}"


def _is_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in node.decorator_list)


def _used_names(node: ast.FunctionDef) -> set[str]:
    """Names a function calls or passes on: ``f(...)``, ``mod.f(...)`` and ``tl.associative_scan(x, 0, f)``."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
    return names


def _uses_dot(node: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "dot" and ast.unparse(n.value) == "tl"
               for n in ast.walk(node))


def launchable_kernels(folder: Path = KERNELS_DIR) -> list[Kernel]:
    """Every launchable ``@triton.jit`` kernel under ``folder``, sorted by module and name."""
    jit: dict[tuple[str, str], ast.FunctionDef] = {}
    for path in sorted(folder.rglob("*.py")):
        # a family split into a package (kernels/flash_attention/forward.py) is named by its folder, whose
        # __init__ re-exports its kernels: labsrc.kernels.flash_attention._flash_attention_kernel
        family = path.relative_to(folder).parts[0].removesuffix(".py")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                jit[(family, node.name)] = node
    calls = {key: _used_names(node) for key, node in jit.items()}
    helpers = {name for (_, name) in jit if any(name in called for called in calls.values())}

    def dot_anywhere(key, seen=()):
        # tl.dot in the kernel itself or in a helper it calls (helpers are inlined)
        if _uses_dot(jit[key]):
            return True
        return any(dot_anywhere(other, seen + (key,)) for other in jit
                   if other[1] in calls[key] and other not in seen and other != key)

    return [Kernel(module, name, dot_anywhere((module, name)))
            for (module, name) in sorted(jit) if name not in helpers]
