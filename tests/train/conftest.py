from __future__ import annotations

import pytest

from tests.train.stubmodel import make_sbm_store


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    return make_sbm_store(tmp_path_factory.mktemp("stores") / "sbm")
