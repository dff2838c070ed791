"""Show the lab's own code in a chapter: one source of truth, rendered from the package, never a copy.

    from labsrc.show import show_source
    show_source(labsrc.kernels.flash_attention._flash_attention_kernel)

displays the kernel's source as a highlighted Python block, with the file and line it comes from, so the book
always shows the code that the tests check.
"""
from __future__ import annotations

import inspect
from pathlib import Path

__all__ = ["source_of", "show_source"]

_PACKAGE_ROOT = Path(__file__).resolve().parent


def _unwrap(obj):
    """The Python function behind a Triton kernel: ``@triton.autotune`` wraps a ``JITFunction``, which wraps
    the function (``.fn`` twice); without Triton the stand-in decorators return the function itself. A
    ``functools.wraps`` decorator (``@torch.no_grad()``) is followed through ``__wrapped__``, so the file shown
    is the function's own, not the decorator's."""
    for _ in range(3):
        inner = getattr(obj, "fn", None)
        if inner is None or inner is obj:
            break
        obj = inner
    return inspect.unwrap(obj) if callable(obj) else obj


def source_of(obj, *, start: str | None = None, end: str | None = None) -> tuple[str, str]:
    """``(source, where)`` of a function, class or kernel of the package.

    ``start``/``end`` cut the source to the lines from the first one containing ``start`` to the first later
    one containing ``end`` (both kept), to show one part of a long kernel. ``where`` reads
    ``labsrc/kernels/flash_attention/forward.py, line 60``. Raises ``ValueError`` when a marker is not found.
    """
    obj = _unwrap(obj)
    try:
        lines, first = inspect.getsourcelines(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
    except (TypeError, OSError) as e:
        raise TypeError(f"cannot show the source of {obj!r}: {e}") from None
    lo, hi = 0, len(lines)
    if start is not None:
        found = [i for i, ln in enumerate(lines) if start in ln]
        if not found:
            raise ValueError(f"start={start!r} is not in the source of {getattr(obj, '__name__', obj)}")
        lo = found[0]
    if end is not None:
        found = [i for i, ln in enumerate(lines) if end in ln and i >= lo]
        if not found:
            raise ValueError(f"end={end!r} is not in the source of {getattr(obj, '__name__', obj)} after start")
        hi = found[0] + 1
    try:
        shown = path.relative_to(_PACKAGE_ROOT.parent)
    except ValueError:
        shown = path
    return "".join(lines[lo:hi]), f"{shown}, line {first + lo}"


def show_source(obj, *, start: str | None = None, end: str | None = None) -> None:
    """Display :func:`source_of` ``obj`` as a highlighted block under a line saying where it lives."""
    from IPython.display import Markdown, display

    source, where = source_of(obj, start=start, end=end)
    display(Markdown(f"`{where}`\n\n```python\n{source.rstrip()}\n```"))
