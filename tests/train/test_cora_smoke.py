"""Cora accuracy smoke test: the real importer, models and trainer reproduce the GCN paper's result.

Uses the Planetoid files in TRELLIS_DATA_DIR (default <repo>/../shared/data); fails, never skips, when they
are missing (the ``dataset`` fixture in tests/conftest.py).
"""

from __future__ import annotations

import pytest

import trellis.train.trainer as trainer
from trellis.data.importers import import_graph
from trellis.train.config import TrainConfig


@pytest.fixture(scope="module")
def cora_store(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("cora") / "store"
    return import_graph(dataset("cora"), out, format="planetoid", progress=False)


@pytest.mark.timeout(1500)  # ~1 min on an idle 2-core machine; allow for a heavily shared one
def test_gcn_on_cora_reaches_paper_accuracy(cora_store, tmp_path):
    cfg = TrainConfig(store=str(cora_store), model="gcn", runs=3, out=str(tmp_path / "run"), device="cpu",
                      progress=False, checkpoint_every=0)
    s = trainer.train(cfg)
    assert s["feature_norm"] == "row"  # bag-of-words features: the paper's row normalization
    assert s["test_acc_mean"] >= 0.79, s["test_acc"]
