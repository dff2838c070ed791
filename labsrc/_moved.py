"""Old module paths that still import, for one release (0.1.x): each names the module that now holds its code.

Issue 42 gave every chapter's files the chapter's one name (``CONTRIBUTING.md``'s table). The stored result
files record the commands that made them (``python -m labsrc.sweeps.evict ...``) and older notebooks import
the old paths, so each old path is kept as an alias: ``import labsrc.kvmath`` returns the module
``labsrc.kv_cache`` itself (the same object, so a patched attribute is patched for both), and
``python -m labsrc.sweeps.evict`` runs ``labsrc/sweeps/kv_eviction.py`` as ``__main__``. A package's old
path carries its submodules (``labsrc.distill.finetune`` is ``labsrc.distillation.finetune``).

No file stays at an old path: git then sees each move as a rename, and edits made on the old layout follow it
when branches merge. The aliases go in 0.2; new code imports the new names.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# old module path -> new module path (a package's entry also maps its submodules)
MOVED = {
    "labsrc.kvmath": "labsrc.kv_cache",
    "labsrc.kernels.kv_store": "labsrc.kernels.kv_cache",
    "labsrc.bench.kv_store": "labsrc.bench.kv_cache",
    "labsrc.attention": "labsrc.flash_attention",
    "labsrc.kernels.attention": "labsrc.kernels.flash_attention",
    "labsrc.bench.attention": "labsrc.bench.flash_attention",
    "labsrc.finetune": "labsrc.rope_finetune",
    "labsrc.kvquant": "labsrc.kv_quant",
    "labsrc.kernels.kvquant": "labsrc.kernels.kv_quant",
    "labsrc.bench.kvquant": "labsrc.bench.kv_quant",
    "labsrc.sweeps.kvquant": "labsrc.sweeps.kv_quant",
    "labsrc.evict": "labsrc.kv_eviction",
    "labsrc.exercises.eviction": "labsrc.exercises.kv_eviction",
    "labsrc.sweeps.evict": "labsrc.sweeps.kv_eviction",
    "labsrc.kernels.paged_attention": "labsrc.kernels.serving",
    "labsrc.bench.paged_attention": "labsrc.bench.serving",
    "labsrc.sweeps.paged_evict": "labsrc.sweeps.serving",
    "labsrc.kernels.tree_attention": "labsrc.kernels.speculative",
    "labsrc.bench.tree_attention": "labsrc.bench.speculative",
    "labsrc.kernels.verify": "labsrc.kernels.pipeline",
    "labsrc.bench.verify": "labsrc.bench.pipeline",
    "labsrc.distill": "labsrc.distillation",
    "labsrc.kernels.distill": "labsrc.kernels.distillation",
    "labsrc.bench.distill": "labsrc.bench.distillation",
    "labsrc.exercises.distill": "labsrc.exercises.distillation",
}


def new_name(old: str) -> str | None:
    """The module that holds ``old``'s code now, or None when ``old`` did not move."""
    if old in MOVED:
        return MOVED[old]
    for prefix, target in MOVED.items():
        if old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the new module object; for ``python -m`` gives the new file's code."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass                                  # the new module has run already

    def _target_spec(self):
        spec = importlib.util.find_spec(self.target)
        if spec is None:
            raise ImportError(f"{self.target} (the new path of a moved module) is missing")
        return spec

    def is_package(self, fullname):
        return self._target_spec().submodule_search_locations is not None

    def get_code(self, fullname):            # runpy (python -m OLD) runs the new module's code
        spec = self._target_spec()
        return spec.loader.get_code(self.target)

    def get_source(self, fullname):
        spec = self._target_spec()
        return spec.loader.get_source(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        loader = _AliasLoader(new)
        target_spec = loader._target_spec()
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=target_spec.origin,
                                              is_package=target_spec.submodule_search_locations is not None)
        if target_spec.submodule_search_locations is not None:
            spec.submodule_search_locations = list(target_spec.submodule_search_locations)
        return spec


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once): an old path must not load a second copy."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
