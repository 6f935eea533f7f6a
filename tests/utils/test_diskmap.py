"""Memory maps made with their blocks reserved: a full file system is a clear error when the file is made,
not a SIGBUS when a page is written back later."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from trellis.errors import TrellisUserError
from trellis.utils import diskmap
from trellis.utils.spill import SpillDir


def allocated(path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.mark.parametrize("npy", [True, False])
def test_new_maps_have_every_block_allocated(tmp_path, npy):
    path = tmp_path / "a.npy"
    arr = diskmap.new_map(path, (1 << 18, 4), np.float32, "fix", npy=npy)  # 4 MiB, never written
    assert arr.shape == (1 << 18, 4) and not arr[-1].any()
    assert allocated(path) >= (1 << 20) * 4  # not sparse
    if npy:
        arr[3] = 7.0
        arr.flush()
        assert np.load(path)[3, 0] == 7.0


def test_spill_files_are_reserved(tmp_path):
    sp = SpillDir(tmp_path / "spill")
    sp.array("h1", (1 << 16, 16))
    assert allocated(sp.path / "h1.f32") >= (1 << 16) * 16 * 4
    sp.close()


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_file_system_names_the_directory_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "posix_fallocate", enospc)
    sp = SpillDir(tmp_path / "spill")
    with pytest.raises(TrellisUserError, match=r"spill-.*: no space left for h1\.f32 \(4.00 MiB\); free space or pick "
                                               r"another --spill-dir"):
        sp.array("h1", (1 << 16, 16))
    assert not (sp.path / "h1.f32").exists() and not sp.has("h1")
    sp.close()


def test_a_disk_full_while_the_file_is_made_is_the_same_error(tmp_path, monkeypatch):
    monkeypatch.setattr(np.lib.format, "open_memmap", enospc)
    with pytest.raises(TrellisUserError, match=r"no space left for x\.npy .*; write it elsewhere"):
        diskmap.new_map(tmp_path / "x.npy", (10, 2), np.int64, "write it elsewhere")


def test_a_file_system_that_cannot_reserve_keeps_a_sparse_file(tmp_path, monkeypatch):
    def unsupported(*args, **kwargs):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    arr = diskmap.new_map(tmp_path / "x.f32", (100, 4), np.float32, "fix", npy=False)
    arr[:] = 1.0
    assert arr.sum() == 400.0
