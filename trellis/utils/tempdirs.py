"""Temporary directories that outlive a killed owner only until the next process makes one.

Why: the library writes an in-memory graph to a temporary store, and trains without a run directory or with a
budget in temporary scratch and spill directories. ``tempfile.TemporaryDirectory`` removes them at the end of the
``with`` block or at interpreter exit, but a process killed by ``SIGTERM`` (a notebook kernel restarted, a job
cancelled) or ``SIGKILL`` never runs either, so each kill left a copy of the graph in ``$TMPDIR``. And the library
must not install signal handlers in its caller's process.

How: the owner holds an exclusive ``flock`` on ``DIR/.owner.lock`` for the directory's lifetime; the kernel releases
it when the process dies, however it dies. Making a directory first removes the directories of the same prefix
whose lock can be taken: their owner is gone. A lock, not a recorded pid: a pid is reused, and another container
sharing ``/tmp`` sees other pids. The lock file is locked before it is renamed into place, so no cleaner can take
the lock of a directory still being made; a directory without one (made by an older Trellis) is left alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from types import TracebackType

LOCK = ".owner.lock"


def clean_unowned(root: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Remove the directories ``root/prefix*`` whose owner is gone (their lock is free); returns them."""
    removed: list[Path] = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for d in root.glob(prefix + "*"):
        try:
            fd = os.open(d / LOCK, os.O_RDONLY)
        except OSError:
            continue  # no lock file: not made here, or not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: its owner is alive
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        finally:
            os.close(fd)
    return removed


def _remove(path: str, fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


class OwnedTempDir:
    """A ``tempfile.TemporaryDirectory`` that the next one of its prefix removes if this process is killed.

    Like it: ``name``, ``cleanup()``, a context manager, removed at exit. See the module docstring.

    Args:
        prefix: The directory's name starts with it (and the cleaning is by it).
        dir: Where to make it (default: ``$TMPDIR``).
    """

    def __init__(self, prefix: str, dir: str | os.PathLike[str] | None = None) -> None:
        root = Path(dir) if dir is not None else Path(tempfile.gettempdir())
        clean_unowned(root, prefix)
        self.name = tempfile.mkdtemp(prefix=prefix, dir=root)
        fd, tmp = tempfile.mkstemp(prefix=".owner-", dir=self.name)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(self.name, LOCK))
        self._finalizer = weakref.finalize(self, _remove, self.name, fd)

    def cleanup(self) -> None:
        """Remove the directory now (idempotent)."""
        self._finalizer()

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()
