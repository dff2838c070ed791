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
import stat
import tempfile
import threading
from pathlib import Path

__all__ = ["file_lock", "write_atomic"]


def file_lock(path: Path | str):
    """The inter-process lock that guards ``path``: a ``filelock.FileLock`` on ``<path>.lock``. Use it as a
    context manager around every read-modify-write of ``path``."""
    from filelock import FileLock

    path = Path(path)
    return FileLock(str(path.with_name(path.name + ".lock")))


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc/self/status``); elsewhere set
    and restored at once, under a lock."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def write_atomic(path: Path | str, text: str) -> None:
    """Replace ``path`` by ``text`` in one step: readers see the old file or the new one, never a mix, and two
    writers never share a temporary file. The temporary file (``.<name>.<random>.tmp``) is removed if the
    write fails. The file keeps its permissions (a new one gets what ``open`` would give it, 0666 less the
    umask): the temporary file is created 0600, and renaming it over a file used to make that file private."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        else:  # Windows: only the read-only bit means anything
            os.chmod(tmp, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
