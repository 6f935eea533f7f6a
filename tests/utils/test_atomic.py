from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from trellis.errors import TrellisUserError
from trellis.utils.atomic import (
    atomic_dir,
    check_output,
    clean_stale_temps,
    save_npy_atomic,
    temp_sibling,
    torch_save_atomic,
    write_json_atomic,
    write_text_atomic,
)


def test_file_writers_replace_whole_files_and_leave_no_temporaries(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": np.float32(1.5), "v": np.arange(2), "t": torch.tensor(3)})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1.5, "v": [0, 1], "t": 3}
    assert (tmp_path / "a.json").read_text().endswith("}\n")
    torch_save_atomic({"w": torch.ones(2)}, tmp_path / "c.pt")
    assert torch.equal(torch.load(tmp_path / "c.pt")["w"], torch.ones(2))
    save_npy_atomic(tmp_path / "d.npy", np.arange(3))
    assert np.array_equal(np.load(tmp_path / "d.npy"), np.arange(3))
    write_text_atomic(tmp_path / "e.txt", "old")

    class Boom(Exception):
        pass

    def fail(f):
        f.write(b"half")
        raise Boom

    from trellis.utils.atomic import atomic_write

    with pytest.raises(Boom):
        atomic_write(tmp_path / "e.txt", fail)
    assert (tmp_path / "e.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "c.pt", "d.npy", "e.txt"]


def test_guard_refuses_what_is_not_ours_and_deletes_nothing(tmp_path):
    mine = tmp_path / "data"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(TrellisUserError, match="already exists.*--overwrite"):
        check_output(mine)
    with pytest.raises(TrellisUserError, match="not a sweep directory; refusing to overwrite it.*--out"):
        with atomic_dir(mine, overwrite=True, owned=lambda p: (p / "sweep.json").is_file(), what="sweep directory"):
            raise AssertionError("never reached")
    assert (mine / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", overwrite=True)  # an empty directory may always be replaced


def test_atomic_dir_replaces_an_owned_directory_only_when_complete(tmp_path):
    out = tmp_path / "out"
    store, new = '{"format": "trellis-store"}', '{"format": "trellis-store", "new": 1}'
    with atomic_dir(out) as tmp:
        (tmp / "manifest.json").write_text(store)
        assert not out.exists()
    assert (out / "manifest.json").is_file()
    with pytest.raises(RuntimeError), atomic_dir(out, overwrite=True) as tmp:
        (tmp / "manifest.json").write_text(new)
        raise RuntimeError("killed")
    assert (out / "manifest.json").read_text() == store
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "manifest.json").write_text(new)
    assert json.loads((out / "manifest.json").read_text()) == json.loads(new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_stale_temporaries_of_dead_processes_are_cleaned(tmp_path):
    out = tmp_path / "cache"
    live = temp_sibling(out, tag="pp-tmp")
    dead = tmp_path / ".cache.pp-tmp-999999999-abcd"
    dead.mkdir()
    clean_stale_temps(out, tag="pp-tmp")
    assert live.is_dir() and not dead.exists()
    assert live.name.startswith(f".cache.pp-tmp-{os.getpid()}-")


def test_atomic_files_get_the_mode_open_gives(tmp_path):
    import os
    import stat

    from trellis.utils.atomic import write_text_atomic

    write_text_atomic(tmp_path / "a.json", "{}")
    (tmp_path / "b.json").write_text("{}")
    mode = stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "b.json").st_mode)
    assert mode & 0o044  # readable by others under the usual umask, not mkstemp's 0600


def test_a_killed_writers_sibling_goes_when_the_output_is_written_again(tmp_path):
    """A sweep stopped by SIGTERM left ``.out.tmp-<pid>-<hex>`` beside its output for good."""
    out = tmp_path / "sweep"
    dead = tmp_path / ".sweep.tmp-999999999-abcd"
    dead.mkdir()
    (dead / "spill").mkdir()
    with atomic_dir(out, what="sweep directory") as tmp:
        (tmp / "sweep.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def test_overwrite_replaces_a_store_but_not_another_trellis_artefact(tmp_path):
    """Any directory with a manifest.json was replaceable: an import or `generate --overwrite` with a mistyped --out
    replaced a pre-propagation cache (or a layout) with a store."""
    import json

    from trellis.errors import TrellisUserError
    from trellis.utils.atomic import check_output

    for name, fmt in (("cache", "trellis-pp"), ("layout", "trellis-partition"), ("store", "trellis-store")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"format": fmt}))
    check_output(tmp_path / "store", overwrite=True)
    for name in ("cache", "layout"):
        with pytest.raises(TrellisUserError, match="is not a Trellis store; refusing to overwrite it"):
            check_output(tmp_path / name, overwrite=True)
