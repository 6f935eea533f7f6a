"""Writable memory maps whose disk blocks are reserved when they are made.

Why: a memory map of a new file is sparse, so its blocks are allocated only when a page is first written back.
When the file system fills while a run writes a spill, a store or a layout, that write-back has nowhere to
go and the kernel kills the process with ``SIGBUS`` (no message, no cleanup, half-written files). Reserving
the whole file with ``posix_fallocate`` when it is made turns that into an ``ENOSPC`` at a known point, which
becomes one clear error naming the directory. On ext4/xfs/tmpfs the reservation takes milliseconds for
gigabytes (extents marked unwritten, read back as zeros); where a file system cannot reserve, the file stays
sparse as before.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np

from trellis.errors import TrellisUserError
from trellis.utils.sizes import format_size

#: The errors of a full file system (or of a full quota).
FULL = (errno.ENOSPC, errno.EDQUOT)

#: The fix named when a spill file finds its file system full.
SPILL_FIX = "free space or pick another --spill-dir"


def _full(path: str | os.PathLike[str], size: int, fix: str) -> TrellisUserError:
    """The error for a file system with no room for ``path`` (which is removed)."""
    Path(path).unlink(missing_ok=True)
    return TrellisUserError(f"{Path(path).parent}: no space left for {Path(path).name} ({format_size(size)}); {fix}")


def reserve(path: str | os.PathLike[str], fix: str) -> None:
    """Allocate every block of ``path`` now; a full file system raises :class:`TrellisUserError`.

    Args:
        path: An existing file (its current size is reserved).
        fix: What the user can do, ending the error message (e.g. "free space or pick another --spill-dir").
    """
    size = os.path.getsize(path)
    if size == 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in FULL:
            raise _full(path, size, fix) from None
        # the file system cannot reserve (EOPNOTSUPP, EINVAL): the file stays sparse
    finally:
        os.close(fd)


def new_map(path: str | os.PathLike[str], shape: tuple[int, ...], dtype: Any, fix: str, *,
            npy: bool = True) -> np.memmap:
    """A new writable memory map of ``shape`` at ``path`` with its blocks reserved (see :func:`reserve`).

    Args:
        path: The file to create (replaced if it exists).
        shape: The array's shape.
        dtype: The array's dtype.
        fix: The end of the error message when the file system is full.
        npy: Write a ``.npy`` file (header and data, ``np.load``-able); otherwise raw data only.
    """
    try:
        if npy:
            arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        else:
            arr = np.memmap(path, dtype=dtype, mode="w+", shape=shape)
    except OSError as e:  # making the file writes its header or last byte, which may find the disk full
        if e.errno in FULL:
            raise _full(path, int(np.prod(shape)) * np.dtype(dtype).itemsize, fix) from None
        raise
    reserve(path, fix)
    return arr
