"""Spill directories: files as memory maps, removed on close, stale ones removed by the next process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from trellis.errors import TrellisUserError
from trellis.utils.spill import PREFIX, SpillDir, check_spill_root, clean_stale_spills


def test_arrays_are_zero_filled_maps_and_close_removes_everything(tmp_path):
    root = tmp_path / "spill"
    sp = SpillDir(root)
    a = sp.array("a", (10, 3))
    assert isinstance(a, np.memmap) and a.dtype == np.float32 and not a.any()
    a[2] = 5.0
    assert sp.array("a", (10, 3)) is a and sp.get("a")[2, 0] == 5.0
    assert sp.array("a", (4, 3)).shape == (4, 3)  # a new shape replaces the file
    sp.delete("a")
    assert not sp.has("a") and not list(sp.path.glob("*.f32"))
    sp.array("b", (3, 3))[:] = 1.0
    assert sp.disk_bytes > 0
    sp.close()
    assert not root.exists()  # the root is removed too when nothing else is in it


def test_stale_spills_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{PREFIX}{dead.stdout.strip()}-0"
    stale.mkdir()
    (stale / "owner").write_text(dead.stdout.strip())
    (stale / "h1.f32").write_bytes(b"\0" * 64)
    live = SpillDir(tmp_path)  # opening a root cleans it
    assert not stale.exists() and live.path.exists()
    assert clean_stale_spills(tmp_path) == []  # our own directory stays
    live.close()


def test_spill_root_checks_name_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrellisUserError, match="--spill-dir .*is not a directory"):
        check_spill_root(blocker / "sub", 1)
    with pytest.raises(TrellisUserError, match="--spill-dir .*GiB are free there"):
        check_spill_root(tmp_path / "new" / "deeper", 1 << 60)
    assert not (tmp_path / "new").exists()  # the check creates nothing
    assert check_spill_root(tmp_path / "ok", 1024) == tmp_path / "ok"
