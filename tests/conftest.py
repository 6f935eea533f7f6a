"""Shared fixtures.

``data_dir``: the real datasets (``TRELLIS_DATA_DIR``, default ``<repo>/../shared/data``). Tests that use
it fail, never skip, when the data is missing: a silently skipped real-data test hides a broken setup.
``sbm_store``: a small generated store (session-scoped) for tests that just need a graph.
``one_thread``: one torch thread for a module (opt in with ``pytestmark``).
``stub_model``: the small stub model's factory (pass it as ``model_factory=``), on one thread (opt in).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = Path(os.environ.get("TRELLIS_DATA_DIR", DEFAULT_DATA_DIR))
    if not path.is_dir():
        pytest.fail(f"real datasets not found at {path}; set TRELLIS_DATA_DIR to the shared data folder")
    return path


@pytest.fixture(scope="session")
def dataset(data_dir: Path):
    """``dataset("cora")`` -> the folder of one real dataset (the test fails if it is missing)."""

    def get(name: str) -> Path:
        path = data_dir / name
        if not path.is_dir():
            pytest.fail(f"dataset {name!r} not found at {path}; set TRELLIS_DATA_DIR to the shared data folder")
        return path

    return get


@pytest.fixture(scope="session")
def sbm_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 500-node, 4-class SBM store with 16 features and train/val/test splits (seed 0)."""
    from trellis.data.generate import generate_sbm

    out = tmp_path_factory.mktemp("stores") / "sbm"
    return generate_sbm(out, nodes=500, avg_degree=8, features=16, classes=4, seed=0, progress=False)


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    Tiny models and tensors: one thread avoids OpenMP spin-waits on a shared 2-core machine.
    """
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def stub_model():
    """The small stub model's factory, to pass as ``model_factory=`` instead of ``trellis.nn``'s.

    Also runs torch on one intra-op thread while the test runs: on these tiny graphs that is faster and immune
    to a busy machine, and subprocess tests match it with ``OMP_NUM_THREADS=1`` so their results compare exactly.
    """
    import torch

    from tests.train.stubmodel import stub_build

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield stub_build
    torch.set_num_threads(before)
