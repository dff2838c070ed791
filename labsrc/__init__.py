"""The Long-Context Inference Lab's importable package.

Importing it first runs :mod:`labsrc.runtime`, which picks the device and, with no GPU, switches Triton to
its CPU interpreter before anything imports ``triton``.
"""
from labsrc import runtime
from labsrc.runtime import DEVICE, INTERPRETED, PROFILE, seed_everything, sizes, stamp
from labsrc import _moved

_moved.install()  # the paths issue 42 renamed still import, as the new modules, for one release

__all__ = ["runtime", "DEVICE", "INTERPRETED", "PROFILE", "seed_everything", "sizes", "stamp"]
__version__ = "0.1.0"
