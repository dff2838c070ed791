"""Files that several processes write at once: a lock, and a write that a reader never sees half done.

Two notebooks executed side by side (``make execute`` runs two) may record the same claim or add to the same
ledger at the same moment. A fixed temporary name (``row.json.tmp``) is not enough: both writers open the same
temporary file, their bytes interleave, and the second ``os.replace`` finds the file already moved and
raises. :func:`write_atomic` gives every write its own temporary file in the target's folder (so the final
``os.replace`` is an atomic rename on one file system), and :func:`file_lock` is the lock (``filelock``, which
works on every platform) under which a read-modify-write of a shared file happens.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["file_lock", "write_atomic"]


def file_lock(path: Path | str):
    """The inter-process lock that guards ``path``: a ``filelock.FileLock`` on ``<path>.lock``. Use it as a
    context manager around every read-modify-write of ``path``."""
    from filelock import FileLock

    path = Path(path)
    return FileLock(str(path.with_name(path.name + ".lock")))


def write_atomic(path: Path | str, text: str) -> None:
    """Replace ``path`` by ``text`` in one step: readers see the old file or the new one, never a mix, and two
    writers never share a temporary file. The temporary file (``.<name>.<random>.tmp``) is removed if the
    write fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
