"""labsrc.atomic.write_atomic keeps a file's permissions (the temporary file it renames is created 0600, and every
write made the file private), and a new file gets what ``open`` gives it: 0666 less the umask."""
import os
import stat
import sys

import pytest
from hypothesis import given, settings, strategies as st

from labsrc.atomic import write_atomic

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")


@settings(max_examples=60, deadline=None)
@given(mode=st.integers(0o400, 0o777).filter(lambda m: m & 0o600 == 0o600), umask=st.integers(0, 0o077))
def test_write_atomic_keeps_the_mode_or_gives_the_umask_default(tmp_path_factory, mode, umask):
    folder = tmp_path_factory.mktemp("atomic")
    old = os.umask(umask)
    try:
        fresh = folder / "new.txt"
        write_atomic(fresh, "a")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask
        existing = folder / "old.txt"
        existing.write_text("x")
        os.chmod(existing, mode)
        write_atomic(existing, "b")
        assert stat.S_IMODE(existing.stat().st_mode) == mode and existing.read_text() == "b"
    finally:
        os.umask(old)
    assert sorted(p.name for p in folder.iterdir()) == ["new.txt", "old.txt"]  # no temporary file left
