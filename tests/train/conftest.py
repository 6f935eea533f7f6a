from __future__ import annotations

import pytest

from tests.train.stubmodel import make_sbm_store, stub_build


@pytest.fixture
def stub_model(monkeypatch):
    """Train the small stub model instead of ``trellis.nn``'s (opt in with ``usefixtures("stub_model")``).

    Also runs torch on one intra-op thread: on these tiny graphs that is faster and immune to a busy machine,
    and subprocess tests match it with ``OMP_NUM_THREADS=1`` so their results compare exactly.
    """
    import torch

    import trellis.train.trainer as trainer

    monkeypatch.setattr(trainer, "build_model_fn", stub_build)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    return make_sbm_store(tmp_path_factory.mktemp("stores") / "sbm")
