"""Partition-parallel training equals the single process: spawned gloo ranks on 127.0.0.1, world sizes 1, 2, 4.

One spawned world per size trains every job of that size in turn (the default process group is created once
per world, so the test pays the ranks' start-up once); the single-process runs are trained here, in this
process. Every job trains with dropout on, so equal losses also mean every rank drew the single process's
masks on its rows.
"""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trellis.data.store import GraphStore
from trellis.distributed.comm import free_port
from trellis.partition import evaluate
from trellis.partition.layout import PartitionedGraph
from trellis.train.config import TrainConfig
from trellis.train.trainer import Trainer, TrainingInterrupted

pytestmark = pytest.mark.usefixtures("one_thread")

EPOCHS = 4
MODELS = ("gcn", "sage", "gin", "gat", "gate")

#: World size -> (method, model) jobs: every model on a pull layout and, at 4 ranks, on every other ownership
#: (GAT and GAT-E through the two-phase edge softmax).
JOBS = {
    1: [("metis", "gcn"), ("metis", "gat")],
    2: [("metis", "gcn"), ("hash", "sage"), ("metis", "gat")],
    4: [("metis", m) for m in MODELS]
       + [(method, m) for method in ("hash", "reverse", "vertex-cut") for m in MODELS],
}


def _cfg(store: Path, model: str, out: Path, **kw: Any) -> TrainConfig:
    values = {"store": str(store), "model": model, "epochs": EPOCHS, "hidden": 16, "out": str(out),
              "progress": False, "checkpoint_every": 0, **({"heads": 2} if model in ("gat", "gate") else {}), **kw}
    return TrainConfig(**values)


def _losses(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _worker(rank: int, world: int, port: int, jobs: list[dict[str, Any]]) -> None:
    """One rank: join the world once, then train every job (rank 0 writes each run directory).

    A job with ``stop_at`` is interrupted after that epoch, as SIGTERM would (every rank stops there).
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for job in jobs:
        job = dict(job)
        stop_at = job.pop("stop_at", None)

        def stop(t: Trainer, rec: dict[str, Any], at: int | None = stop_at) -> None:
            if rec["epoch"] == at:
                t.request_stop(signal.SIGTERM)

        try:
            Trainer(TrainConfig(**job), err=io.StringIO(), callbacks=[stop]).fit()
        except TrainingInterrupted:
            pass
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def single(dist_store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Single-process run of every model."""
    root = tmp_path_factory.mktemp("single")
    for m in MODELS:
        Trainer(_cfg(dist_store, m, root / m), err=io.StringIO()).fit()
    return {m: root / m for m in MODELS}


@pytest.fixture(scope="module")
def parallel(dist_store: Path, layouts: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """``(world, method, model) -> RUN_DIR`` of every job of :data:`JOBS`, trained by spawned ranks."""

    root = tmp_path_factory.mktemp("parallel")
    runs = {}
    for world, jobs in JOBS.items():
        specs = []
        for method, model in jobs:
            out = root / f"{world}-{method}-{model}"
            cfg = _cfg(dist_store, model, out, parts_dir=str(layouts[(method, world)]), timeout=120.0)
            specs.append(cfg.to_dict(session=True))
            runs[(world, method, model)] = out
        mp.spawn(_worker, args=(world, free_port(), specs), nprocs=world, join=True)
    return runs


def test_world_size_one_is_the_single_process_bit_for_bit(dist_store, layouts, single, tmp_path):

    out = tmp_path / "one"
    Trainer(_cfg(dist_store, "gcn", out, parts_dir=str(layouts[("metis", 1)]), nproc=1), err=io.StringIO()).fit()
    got, want = _losses(out), _losses(single["gcn"])
    keys = ("loss", "val_loss", "train_acc", "val_acc", "test_acc")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]



def test_predict_a_run_whose_store_moved_its_features_to_the_layout(dist_store, layouts, tmp_path):
    """``trellis predict`` of a partition-parallel run read the store's features, which ``--move-features``
    deletes; it now reads the layout's (the buffer's exact inference) and predicts what it did before the move."""
    import shutil

    import numpy as np

    from trellis.data.store import GraphStore
    from trellis.train.predict import embedding_path, predict

    store, layout = tmp_path / "store", layouts[("metis", 1)]
    shutil.copytree(dist_store, store)
    Trainer(_cfg(store, "gcn", tmp_path / "run", parts_dir=str(layout), nproc=1), err=io.StringIO()).fit()
    before = predict(tmp_path / "run", store, tmp_path / "before.npy", device="cpu", proba=True)
    GraphStore(store).move_features(layout)
    after = predict(tmp_path / "run", store, tmp_path / "after.npy", device="cpu", proba=True)
    assert before["embedding_source"] == after["embedding_source"] == "penultimate"
    for name in ("before.npy", "after.npy"):
        assert np.isfinite(np.load(tmp_path / name)).all()
    np.testing.assert_allclose(np.load(tmp_path / "after.npy"), np.load(tmp_path / "before.npy"), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.load(embedding_path(tmp_path / "after.npy")),
                               np.load(embedding_path(tmp_path / "before.npy")), rtol=0, atol=1e-5)


@pytest.mark.parametrize("world,method,model", [(w, me, mo) for w, jobs in JOBS.items() for me, mo in jobs])
def test_ranks_train_the_single_process_losses(parallel, single, world, method, model):
    got, want = _losses(parallel[(world, method, model)]), _losses(single[model])
    assert len(got) == len(want) == EPOCHS
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-4
        assert abs(g["val_loss"] - w["val_loss"]) <= 1e-4
    assert got[0]["loss"] != got[-1]["loss"]  # it trained
    summary = json.loads((parallel[(world, method, model)] / "summary.json").read_text())
    assert summary["world_size"] == world
    assert len(summary["rank_peak_rss_anon_mb"]) == world


@pytest.mark.parametrize("method", ["metis", "hash", "reverse", "vertex-cut"])
def test_measured_bytes_equal_the_partition_estimate(parallel, layouts, dist_store, method):
    """GCN 16 -> 16 -> 4: layer 0 exchanges 16-wide rows, layer 1 the 4-wide transformed rows."""
    last = _losses(parallel[(4, method, "gcn")])[-1]
    book = PartitionedGraph(layouts[(method, 4)]).book
    store = GraphStore(dist_store)
    q16, q4 = evaluate(store, book, width=16), evaluate(store, book, width=4)
    assert last["exchange_l0_fwd_bytes"] == q16.exchange_fwd_bytes > 0
    assert last["exchange_l1_fwd_bytes"] == q4.exchange_fwd_bytes
    assert last["exchange_l1_bwd_bytes"] == q4.exchange_bwd_bytes
    assert "exchange_l0_bwd_bytes" not in last  # the features need no gradient: layer 0 sends none back
    assert sum(last["exchange_bytes_per_rank"]) == last["exchange_bytes"]


def test_a_layout_refuses_what_it_cannot_train(dist_store, layouts, tmp_path):
    from trellis.errors import TrellisUserError


    with pytest.raises(TrellisUserError, match="trellis partition .* --parts 1"):
        Trainer(_cfg(dist_store, "gcn", tmp_path / "b", parts_dir=str(layouts[("metis", 2)]), nproc=1)).fit()
    assert not (tmp_path / "b").exists()
