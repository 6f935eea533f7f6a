"""Spill files: ``[N, F]`` float32 arrays on disk, memory-mapped, owned by one process and removed with it.

Why memory maps: a tile read from a spill file is a view of the page cache, so it never counts in the
process's ``RssAnon`` (the memory a ``--memory-budget`` caps), and a tile written to one is written back
by the kernel behind the computation. Where RAM is free the page cache keeps the spills and re-reads cost
nothing; where it is not, they come from storage — the out-of-core engine accounts for both (bytes
written and read here, ``/proc/self/io`` for what actually came from storage).

Lifetime: a :class:`SpillDir` is one directory ``trellis-spill-<pid>-<n>`` under a spill root, holding an
``owner`` file with the pid. :meth:`SpillDir.close` removes it (end of a run, SIGINT/SIGTERM through the
trainer's ``finally``); a run killed with ``kill -9`` leaves it, and the next process that opens a spill
root (``--resume``, or any run using that root) removes spill directories whose owner is dead
(:func:`clean_stale_spills`).
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from trellis.errors import TrellisUserError
from trellis.utils.atomic import pid_alive
from trellis.utils.diskmap import SPILL_FIX, new_map

PREFIX = "trellis-spill-"
_counter = itertools.count()


def clean_stale_spills(root: str | os.PathLike[str]) -> list[Path]:
    """Remove spill directories under ``root`` whose owning process is gone; returns what was removed."""
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for d in root.glob(PREFIX + "*"):
        try:
            pid = int((d / "owner").read_text().strip())
        except (OSError, ValueError):
            pid = -1
        if pid == os.getpid() or (pid > 0 and pid_alive(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def check_spill_root(root: str | os.PathLike[str], need_bytes: int, flag: str = "--spill-dir") -> Path:
    """Refuse a spill root that cannot be created, is not writable or lacks ``need_bytes`` of free space.

    Nothing is left behind: directories this check had to create to probe the root are removed again.
    """
    root = Path(root)
    existing = root
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise TrellisUserError(f"{flag} {root}: {existing} is not a directory; pick a directory for spill files")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TrellisUserError(f"{flag} {root}: {existing} is not writable; pick a writable directory for spill "
                               "files")
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise TrellisUserError(f"{flag} {root}: the plan spills {need_bytes / 2**30:.2f} GiB but only "
                               f"{free / 2**30:.2f} GiB are free there; free space or pick another --spill-dir")
    return root


class SpillDir:
    """One process's spill files under ``root`` (see the module docstring).

    Args:
        root: Directory that holds spill directories (created if missing; stale ones are removed).

    Attributes:
        path: This process's spill directory.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._made: list[Path] = []  # the root and the parents this created, deepest first
        missing = self.root
        while not missing.exists():
            self._made.append(missing)
            missing = missing.parent
        self.root.mkdir(parents=True, exist_ok=True)
        clean_stale_spills(self.root)
        self.path = self.root / f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.path.mkdir()
        (self.path / "owner").write_text(str(os.getpid()))
        self._arrays: dict[str, np.memmap] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.memmap:
        """The spill ``name`` of ``shape`` and ``dtype`` (made zero-filled, blocks reserved, or the existing one)."""
        arr = self._arrays.get(name)
        if arr is not None and arr.shape == tuple(shape) and arr.dtype == np.dtype(dtype):
            return arr
        if arr is not None:
            self.delete(name)
        arr = new_map(self._file(name, dtype), tuple(shape), dtype, SPILL_FIX, npy=False)
        self._arrays[name] = arr
        return arr

    def _file(self, name: str, dtype: Any) -> Path:
        """``h1.f32``, ``xi.i64``: the dtype's kind and bits."""
        dt = np.dtype(dtype)
        return self.path / f"{name}.{dt.kind}{dt.itemsize * 8}"

    def get(self, name: str) -> np.memmap:
        """The existing spill ``name`` (KeyError when there is none)."""
        return self._arrays[name]

    def has(self, name: str) -> bool:
        """Whether spill ``name`` exists."""
        return name in self._arrays

    def delete(self, name: str) -> None:
        """Drop spill ``name`` and its file (its pages are released once no view of it is left)."""
        arr = self._arrays.pop(name, None)
        if arr is not None:
            path = self._file(name, arr.dtype)
            del arr
            path.unlink(missing_ok=True)

    @property
    def disk_bytes(self) -> int:
        """Bytes the spill files occupy on disk now (their blocks are reserved when they are made)."""
        total = 0
        for name, arr in self._arrays.items():
            try:
                total += os.stat(self._file(name, arr.dtype)).st_blocks * 512
            except OSError:
                pass
        return total

    def drop_cache(self) -> None:
        """Flush and drop the spill files' pages from the page cache (benchmarks: read from storage)."""
        for arr in self._arrays.values():
            drop_map_cache(arr)

    def close(self) -> None:
        """Remove every spill file and the directory, and the root and its parents this created when left empty.

        A run without a run directory (``trellis.train`` without ``out``) leaves nothing behind, not even the
        ``runs/<name>/`` that held its spill root; another process's spills, or a run directory, keep theirs.
        """
        self._arrays.clear()
        shutil.rmtree(self.path, ignore_errors=True)
        for d in [self.root] + [m for m in self._made if m != self.root]:
            try:
                d.rmdir()  # only succeeds when empty
            except OSError:
                break


def drop_file_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (``POSIX_FADV_DONTNEED``; no root)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def drop_map_cache(arr: np.ndarray) -> None:
    """Drop a memory-mapped array's pages: unmap them from this process, then drop them from the page cache.

    ``POSIX_FADV_DONTNEED`` alone leaves pages that are still mapped; ``MADV_DONTNEED`` on the mapping
    first releases this process's hold (a shared file mapping re-reads them from the file on next access).
    """
    mm = getattr(arr, "_mmap", None)
    name = getattr(arr, "filename", None)
    if mm is None or name is None:
        return
    if arr.flags.writeable:
        mm.flush()
    try:
        mm.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError, AttributeError):
        pass
    drop_file_cache(name)


def prefetch_rows(arr: np.ndarray, r0: int, r1: int) -> None:
    """Ask the kernel to read rows ``[r0, r1)`` of a memory-mapped 2-D array ahead (``POSIX_FADV_WILLNEED``).

    The read-ahead runs in the kernel, so the next tile's contiguous rows arrive while the current tile
    computes, without copying them into the process's memory. A no-op for arrays that are not file maps.
    """
    name = getattr(arr, "filename", None)
    if name is None or r1 <= r0:
        return
    row = int(arr.strides[0])
    base = int(getattr(arr, "offset", 0))
    try:
        fd = os.open(name, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, base + r0 * row, (r1 - r0) * row, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
