"""Owned temporary directories: a killed owner's directory is removed by the next one made, a live owner's is not."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from trellis.utils.tempdirs import LOCK, OwnedTempDir, clean_unowned

MAKE = textwrap.dedent("""
    import os, signal, sys
    from trellis.utils.tempdirs import OwnedTempDir
    d = OwnedTempDir("trellis-x-", dir=sys.argv[1])
    open(os.path.join(d.name, "payload"), "w").write("a graph")
    print(d.name, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # alive until its stdin closes
""")


def test_a_killed_owners_directory_goes_with_the_next_one_made(tmp_path):
    done = subprocess.run([sys.executable, "-c", MAKE, str(tmp_path), "kill"], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL
    dead = done.stdout.strip()
    alive = subprocess.Popen([sys.executable, "-c", MAKE, str(tmp_path), "wait"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        held = alive.stdout.readline().strip()
        foreign = tmp_path / "trellis-x-old"  # no lock file: not judged
        foreign.mkdir()
        other = tmp_path / "trellis-y-1"  # another prefix
        other.mkdir()
        (other / LOCK).write_text("")
        with OwnedTempDir("trellis-x-", dir=tmp_path) as mine:
            left = {p.name for p in tmp_path.iterdir()}
            assert dead.split("/")[-1] not in left
            assert {held.split("/")[-1], "trellis-x-old", "trellis-y-1", mine.split("/")[-1]} <= left
            assert clean_unowned(tmp_path, "trellis-x-") == []  # ours is held too
        assert not (tmp_path / mine).exists()
    finally:
        alive.communicate("")
    assert alive.returncode == 0 and not (tmp_path / held).exists()  # an owner that exits removes its own


def test_a_library_trainings_temporary_store_is_removed_after_a_sigterm(tmp_path):
    script = textwrap.dedent("""
        import os, signal
        import numpy as np
        import trellis
        import trellis.train.trainer as T
        def fit(self, *a, **k):
            os.kill(os.getpid(), signal.SIGTERM)  # a notebook kernel stopped mid-training
        T.Trainer.fit = fit
        n = 300
        rng = np.random.default_rng(0)
        trellis.train(dict(src=rng.integers(0, n, 2000), dst=rng.integers(0, n, 2000),
                           x=rng.standard_normal((n, 4)).astype(np.float32), y=rng.integers(0, 3, n),
                           splits={"train": np.arange(100), "val": np.arange(100, 200), "test": np.arange(200, n)}),
                      model="gcn", epochs=1)
    """)
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        assert done.returncode == -signal.SIGTERM, done.stderr
        left = [p.name for p in tmp_path.iterdir() if p.name.startswith("trellis-store-")]
        assert len(left) == 1  # the second run removed the first's

