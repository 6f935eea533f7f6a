"""Model options through the strategies: every strategy trains them, ranks give one process's losses, and the
strategies that cannot run them say so (trellis/nn/models.py GNN options, trellis/train/config.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

import trellis
from tests.distributed.test_parallel import _losses, _worker
from trellis.data.importers import import_graph
from trellis.data.store import GraphStore
from trellis.distributed.comm import free_port
from trellis.errors import TrellisUserError
from trellis.partition import partition_graph
from trellis.partition.layout import write_layout
from trellis.train.config import TrainConfig
from trellis.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
OPTS = dict(residual=True, norm="layer", jk="cat", layers=3)


def _cfg(store: Path, out: Path, **kw) -> TrainConfig:
    return TrainConfig(store=str(store), model="gcn", epochs=4, hidden=8, out=str(out), progress=False,
                       checkpoint_every=0, device="cpu", **{**OPTS, **kw})


@pytest.mark.parametrize(("data", "opts"), [("sbm", {}), ("cora", dict(pre_norm=True, jk="none", dropout=0.5))],
                         ids=["post-norm-sbm", "pre-norm-cora"])
def test_ranks_give_one_process_losses(sbm_store, dataset, tmp_path, data, opts):
    """Cora's bag-of-words rows: a pre-norm input layer reads sparse rows, each rank its own."""
    store = sbm_store if data == "sbm" else import_graph(dataset("cora"), tmp_path / "cora", format="planetoid",
                                                         progress=False)
    Trainer(_cfg(store, tmp_path / "one", **opts), err=io.StringIO()).fit()
    gs = GraphStore(store)
    layout = write_layout(gs, partition_graph(gs, "metis", 2, measure=False), tmp_path / "p2")
    job = _cfg(store, tmp_path / "two", parts_dir=str(layout), timeout=120.0, **opts).to_dict(session=True)
    mp.spawn(_worker, args=(2, free_port(), [job]), nprocs=2, join=True)
    one = [r["loss"] for r in _losses(tmp_path / "one")]
    two = [r["loss"] for r in _losses(tmp_path / "two")]
    assert len(one) == len(two) == 4
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-4)


@pytest.mark.parametrize("strategy", ["full", "mini", "cluster"])
@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
def test_every_strategy_trains_the_options(sbm_store, strategy, model):
    run = trellis.train(sbm_store, model=model, strategy=strategy, epochs=30, hidden=16, lr=0.02,
                        **{**OPTS, "norm": "batch" if strategy == "full" else "layer"})
    losses = [r["loss"] for r in run.history]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert run.test_score() > 0.4  # 4 classes: chance is 0.25


@pytest.mark.parametrize("strategy", ["full", "mini", "cluster"])
@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
def test_every_strategy_trains_pre_norm_blocks(sbm_store, strategy, model):
    run = trellis.train(sbm_store, model=model, strategy=strategy, epochs=60, hidden=16, lr=0.01, layers=3,
                        pre_norm=True, norm="layer")
    losses = [r["loss"] for r in run.history]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert run.test_score() > 0.4  # 4 classes: chance is 0.25


def test_edge_weights_are_used(tmp_path):
    rng = np.random.default_rng(0)
    n = 200
    src, dst = rng.integers(0, n, 1200), rng.integers(0, n, 1200)
    graph = {"src": src, "dst": dst, "num_nodes": n, "x": rng.standard_normal((n, 8)).astype(np.float32),
             "y": rng.integers(0, 3, n), "edge_weight": rng.uniform(0.1, 3.0, 1200).astype(np.float32),
             "splits": {"train": np.arange(0, 100), "val": np.arange(100, 150), "test": np.arange(150, 200)}}
    for model in ("gcn", "sage"):
        for strategy in ("full", "mini"):
            plain = trellis.train(graph, model=model, strategy=strategy, epochs=3, hidden=8)
            weighted = trellis.train(graph, model=model, strategy=strategy, epochs=3, hidden=8, edge_weight=True)
            assert [r["loss"] for r in plain.history] != [r["loss"] for r in weighted.history]


def test_edge_weights_must_be_there_and_not_negative_in_train_and_sweep(sbm_store, tmp_path):
    """Negative weights gave a node whose weighted in-degree is not positive a silent 0 (PyG's GCN: NaN), and a
    sweep with edge_weight=true on a store without weights trained unweighted (train refused it)."""
    rng = np.random.default_rng(0)
    n = 100
    w = rng.uniform(0.1, 2.0, 600).astype(np.float32)
    w[7] = -1.5
    graph = {"src": rng.integers(0, n, 600), "dst": rng.integers(0, n, 600), "num_nodes": n, "symmetrize": False,
             "x": rng.standard_normal((n, 4)).astype(np.float32), "y": rng.integers(0, 3, n), "edge_weight": w,
             "splits": {"train": np.arange(0, 50), "val": np.arange(50, 75), "test": np.arange(75, n)}}
    negative = r"--edge-weight: 1 of the store's \d+ edge weights are negative \(smallest -1.5\).*non-negative"
    with pytest.raises(TrellisUserError, match=negative):
        trellis.train(graph, model="sage", edge_weight=True, epochs=1)
    with pytest.raises(TrellisUserError, match=negative):
        trellis.sweep(graph, {"lr": [0.01, 0.02]}, edge_weight=True, epochs=1)
    with pytest.raises(TrellisUserError, match="--edge-weight: the store .* has no edge weights"):
        trellis.sweep(sbm_store, {"lr": [0.01, 0.02]}, edge_weight=True, epochs=1)
    trellis.train(graph, model="sage", epochs=1)  # unweighted: the weights are not read


def test_options_refused_where_they_cannot_run(sbm_store, tmp_path):
    gs = GraphStore(sbm_store)
    layout = write_layout(gs, partition_graph(gs, "metis", 2, measure=False), tmp_path / "p2")
    with pytest.raises(TrellisUserError, match="--norm batch across ranks"):
        trellis.train(sbm_store, norm="batch", parts_dir=str(layout), out=tmp_path / "r")
    with pytest.raises(TrellisUserError, match="--edge-weight: the store .* has no edge weights"):
        trellis.train(sbm_store, edge_weight=True)
    with pytest.raises(TrellisUserError, match="cannot train under --memory-budget: .*--residual, --jk or --pre-norm"):
        trellis.train(sbm_store, residual=True, memory_budget="1G")
    with pytest.raises(TrellisUserError, match="cannot train under --memory-budget: .*--pre-norm"):
        trellis.train(sbm_store, pre_norm=True, memory_budget="1G")
    with pytest.raises(TrellisUserError, match="--pre-norm builds gcn, sage and gin blocks"):
        trellis.train(sbm_store, model="gat", pre_norm=True)
    with pytest.raises(TrellisUserError, match="--pre-norm blocks end in their own output layer; drop --jk"):
        trellis.train(sbm_store, pre_norm=True, jk="max")
    with pytest.raises(TrellisUserError, match="--mlp-hidden is GIN's"):
        trellis.train(sbm_store, model="sage", mlp_hidden=8)
    with pytest.raises(TrellisUserError, match="--residual applies to message-passing models"):
        trellis.train(sbm_store, model="mlp", residual=True)
    with pytest.raises(TrellisUserError, match="--norm"):
        trellis.train(sbm_store, norm="group")
    assert not (tmp_path / "r").exists()
