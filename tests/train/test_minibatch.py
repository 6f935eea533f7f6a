"""Mini-batch and cluster-batch strategies through the real trainer and the real models."""

import json
import os
import re

import numpy as np
import pytest
import torch

import trellis.train.trainer as trainer
from trellis.cli.main import main
from trellis.data.generate import generate_sbm
from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig


@pytest.fixture(scope="module")
def sbm(tmp_path_factory):
    out = tmp_path_factory.mktemp("mb") / "sbm"
    return str(generate_sbm(out, nodes=2000, avg_degree=8, features=16, classes=4, seed=1, train_frac=0.3,
                            val_frac=0.2, progress=False))


def cfg(sbm, tmp_path, **kw):
    base = dict(store=sbm, out=str(tmp_path / "run"), epochs=8, patience=50, progress=False, checkpoint_every=0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kw", [
    dict(strategy="mini", model="sage", fanouts="5,5", batch_size=128),
    dict(strategy="mini", model="gcn", fanouts="5,5", batch_size=128, labor=True, hidden=32),
    dict(strategy="cluster", model="gcn", clusters=16, clusters_per_batch=4, cluster_method="hash", hidden=32),
    dict(strategy="cluster", model="sage", clusters=16, clusters_per_batch=4, cluster_method="metis",
         boundary_hops=1),
])
def test_batch_strategies_learn(sbm, tmp_path, kw):
    s = trainer.train(cfg(sbm, tmp_path, lr=0.01, **kw))
    assert s["strategy"] == kw["strategy"]
    assert s["test_acc_mean"] > 0.6, s["test_acc_mean"]  # 4 planted classes: chance is 0.25


def test_minibatch_gradient_with_all_neighbors_equals_full_batch(sbm):
    from trellis.data.store import open_store
    from trellis.loader.sampler import NeighborSampler
    from trellis.nn import build_model
    from trellis.ops.graph import CSRGraph

    store = open_store(sbm)
    g = CSRGraph.from_store(store)
    x = torch.from_numpy(np.array(store.x))
    y = torch.from_numpy(np.array(store.y))
    targets = np.array(store.split("train"))[:64]
    for name in ("gcn", "sage"):
        torch.manual_seed(0)
        model = build_model(name, x.shape[1], 4, hidden=8, layers=2, dropout=0.0)
        loss = torch.nn.functional.cross_entropy(model(g, x)[targets], y[targets])
        full = torch.autograd.grad(loss, list(model.parameters()))
        b = NeighborSampler(store.indptr, store.indices, [-1, -1]).sample(targets, 0)
        loss_b = torch.nn.functional.cross_entropy(model(b.graph, x[b.node_ids]), y[targets])
        mini = torch.autograd.grad(loss_b, list(model.parameters()))
        for p, q in zip(full, mini):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_resume_is_exact_for_minibatch(sbm, tmp_path):
    c = cfg(sbm, tmp_path, strategy="mini", model="sage", fanouts="3,3", batch_size=512, epochs=3, hidden=16,
            checkpoint_every=2)
    stopped = []

    def stop_at(t, rec):
        if rec["epoch"] == 1 and not stopped:
            stopped.append(1)
            t.request_stop()

    with pytest.raises(trainer.TrainingInterrupted):
        trainer.Trainer(c, callbacks=[stop_at]).fit()
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    resumed = trainer.train(TrainConfig.from_dict({**saved, "resume": c.out, "progress": False}))
    ref = trainer.train(cfg(sbm, tmp_path / "ref", strategy="mini", model="sage", fanouts="3,3", batch_size=512,
                            epochs=3, hidden=16, checkpoint_every=2))
    assert resumed["test_acc"] == ref["test_acc"]


@pytest.mark.parametrize("kw,match", [
    (dict(strategy="mini", fanouts="15,10,5"), "--layers 2"),
    (dict(strategy="mini", batch_size=0), "--batch-size"),
    (dict(strategy="mini", batch_size=-5), "--batch-size"),
    (dict(strategy="cluster", clusters=4, clusters_per_batch=5), "exceeds --clusters 4"),
    (dict(strategy="cluster", boundary_hops=3), "--boundary-hops"),
])
def test_bad_config(sbm, tmp_path, kw, match):
    with pytest.raises(TrellisUserError, match=match):
        cfg(sbm, tmp_path, **kw)


def test_cli_exit_codes(sbm, tmp_path, capsys):
    assert main(["train", sbm, "--strategy", "mini", "--fanouts", "15,10,5"]) == 2
    assert "--layers 2" in capsys.readouterr().err
    assert main(["train", sbm, "--strategy", "cluster", "--clusters", "3", "--clusters-per-batch", "4"]) == 2
    assert main(["train", sbm, "--strategy", "mini", "--batch-size", "0"]) == 2
    rc = main(["train", sbm, "--strategy", "mini", "--model", "sage", "--fanouts", "4,4", "--batch-size", "512",
               "--epochs", "2", "--out", str(tmp_path / "cli"), "--no-progress", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(out)["strategy"] == "mini"


def test_bench_sampler_cli(sbm, capsys):
    assert main(["bench", "sampler", sbm, "--fanouts", "5,5", "--batch-size", "100", "--batches", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["batches"] == 4 and r["sampling"]["batches_per_s"] > 0 and r["sampling_gather"]["edges_per_s"] > 0
    assert main(["bench", "sampler", sbm, "--fanouts", "5,5", "--batches", "2", "--labor", "--workers", "2"]) == 0
    assert "sampling + feature gather" in capsys.readouterr().out
    assert main(["bench", "sampler", sbm, "--batch-size", "0"]) == 2
    from trellis.utils.numba import max_threads

    assert main(["bench", "sampler", sbm, "--threads", str(max_threads() + 1)]) == 2
    assert "numba runs at most" in capsys.readouterr().err
    # "-1 = all neighbours" right after the flag (argparse alone reads -1,3 as an unknown option)
    assert main(["bench", "sampler", sbm, "--fanouts", "-1,3", "--batches", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fanouts"] == [-1, 3]


def test_sampler_processes_get_cores_of_their_own_on_four_cores_or_more():
    import torch

    from trellis.train.strategies.batches import leave_cores

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert leave_cores(1) is None and torch.get_num_threads() == 2  # 2 cores: all threads stay
        torch.set_num_threads(8)
        kept = leave_cores(2)
        assert kept is not None and kept[0] == 8 and torch.get_num_threads() == 6
        assert leave_cores(0) is None and torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("strategy", ["mini", "cluster"])
def test_explain_describes_the_batches_and_the_model_plan(sbm_store, capsys, strategy):
    from trellis.cli.main import main

    assert main(["train", str(sbm_store), "--strategy", strategy, "--model", "gcn", "--explain", "--device",
                 "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"{strategy}: " in out and re.search(r"\d+ batch(es)? per epoch", out) and "gcn: pushdown=" in out
    # the plan is one step's: the first batch's rows, not every node of the graph (as it printed before)
    rows = [int(m) for m in re.findall(r"linear +\d+->\d+ on (\d+) rows", out)]
    assert rows and max(rows) < GraphStore(sbm_store).num_nodes
    assert "the plan below is of the first batch" in out


def test_waited_batches_tells_a_starving_trial_while_the_trainer_still_waits():
    """The watcher reports the wait in progress (a starved sampler may take minutes for one batch), and the total
    wait is the time spent in ``next``."""
    import time as _time

    from trellis.train.strategies import batches as batches_mod

    seen: list[tuple[float, float]] = []

    def slow():
        _time.sleep(0.8)
        yield 1
        yield 2

    waited = batches_mod.WaitedBatches(slow(), lambda w, e: seen.append((w, e)))
    assert list(waited) == [1, 2]
    mid = [w for w, _ in seen if w < 0.79]  # the watcher's reports, before the first batch arrived
    assert len(mid) >= 2 and min(mid) >= 0.2, seen
    assert 0.8 <= waited.wait_s < 1.5


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="scheduling policies are Linux's")
def test_loader_threads_keep_the_normal_priority_in_every_epoch(sbm, monkeypatch):
    """Only sampler processes go to the background. The loader's own threads stay at the normal priority, also in
    the priority trial's background epoch (1): a thread of the trainer at the lowest priority that holds the GIL
    stalls the whole process (docs/benchmarks.md, "Batch builders in the background")."""
    from trellis.train.build import build_run_optimizer, default_model_factory
    from trellis.train.strategies import strategy_class

    monkeypatch.delenv("TRELLIS_BACKGROUND", raising=False)
    c = TrainConfig(store=sbm, strategy="mini", model="sage", fanouts="5,5", batch_size=256, progress=False)
    strategy = strategy_class("mini").for_config(c)(c, torch.device("cpu"))
    strategy.load()
    loader, policies = strategy.loader, []
    get = loader.get
    monkeypatch.setattr(loader, "get", lambda *a, **kw: policies.append(os.sched_getscheduler(0)) or get(*a, **kw))
    model = strategy.build_model(default_model_factory)
    opt = build_run_optimizer(c, model)
    try:
        for epoch in range(4):
            strategy.train_step(model, opt, strategy.task, epoch)
    finally:
        strategy.close()
    assert len(policies) == 4 * len(loader) and set(policies) == {os.SCHED_OTHER}


@pytest.mark.parametrize("data", ["sbm", "cora"])
@pytest.mark.parametrize("kw", [
    dict(strategy="mini", model="sage", fanouts="4,4", batch_size=128),
    dict(strategy="cluster", model="gcn", clusters=8, clusters_per_batch=2, cluster_method="hash"),
])
def test_rows_resident_with_the_trainer_give_the_hosts_losses(sbm, dataset, tmp_path, kw, data):
    """``--feature-residency device``: the trainer gathers each batch's rows from its own copy (sampler processes
    only sample), and the losses are the host gather's bit for bit, on a bag-of-words store too (Cora: rows
    normalized at gather; the copy is made through the same gather)."""
    from tests.train.helpers import metrics_without_timing
    from trellis.data.importers import import_graph

    store = sbm if data == "sbm" else str(import_graph(dataset("cora"), tmp_path / "cora", format="planetoid",
                                                       progress=False))
    losses, evals = {}, {}
    for residency in ("host", "device"):
        for samplers in (0, 1):
            out = tmp_path / f"{residency}{samplers}"
            s = trainer.train(cfg(store, out, epochs=2, hidden=16, feature_residency=residency, samplers=samplers,
                                  **kw))
            assert s["feature_residency"] == residency
            recs = metrics_without_timing(out / "run")
            losses[residency, samplers] = [r["loss"] for r in recs]
            evals[residency, samplers] = [r["val_loss"] for r in recs]
    assert len(set(map(tuple, losses.values()))) == 1, losses
    # evaluation reads the device copy whole (the host's memory map in chunks): the same up to summation order
    for key, v in evals.items():
        assert v == pytest.approx(evals["host", 0], rel=1e-5, abs=1e-6), key


def test_feature_residency_plan():
    from trellis.plan.residency import feature_residency

    assert feature_residency("host", 10, "cuda", 100) == "host"
    assert feature_residency("auto", 10, "cpu", None) == "host"  # the CPU: the memory map, not a copy
    assert feature_residency("auto", 10, "cuda", 40) == "device"  # four times the rows fit
    assert feature_residency("auto", 11, "cuda", 40) == "host"
    assert feature_residency("device", 10, "cpu", None) == "device"
    assert feature_residency("device", 40, "cuda", 40) == "device"
    with pytest.raises(TrellisUserError, match="--feature-residency host"):
        feature_residency("device", 41, "cuda", 40)


def test_feature_residency_bad_input(sbm, tmp_path, capsys):
    assert main(["train", sbm, "--strategy", "mini", "--feature-residency", "gpu"]) == 2
    assert "--feature-residency" in capsys.readouterr().err
    with pytest.raises(TrellisUserError, match="--feature-residency device with --parts-dir"):
        cfg(sbm, tmp_path, strategy="mini", parts_dir=str(tmp_path), nproc=1, feature_residency="device")


def test_sigterm_to_the_process_group_with_sampler_processes_checkpoints(sbm, tmp_path):
    """``timeout``, Slurm and systemd send SIGTERM to the whole group: the samplers' fork server died of it, every
    worker then read as exited (code 255), and the run failed with exit 1 and no checkpoint (2 of 5 tries)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.train.helpers import wait_for_epochs

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    for attempt in range(3):
        out = tmp_path / f"r{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", str(sbm), "--strategy", "mini",
                                 "--model", "sage", "--fanouts", "5,5", "--batch-size", "64", "--epochs", "500",
                                 "--samplers", "1", "--no-progress", "--out", str(out)],
                                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for_epochs(out, proc, 3 + 2 * attempt)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143 and "checkpoint written" in err.decode(), err.decode()[-1500:]
        assert "leaked" not in err.decode()


@pytest.mark.parametrize("kw", [
    dict(strategy="mini", model="sage", fanouts="4,4", batch_size=64, residual=True, norm="layer"),
    dict(strategy="mini", model="gin", fanouts="4,4", batch_size=64),
    dict(strategy="cluster", model="gcn", clusters=8, clusters_per_batch=2, cluster_method="hash"),
    dict(strategy="cluster", model="gat", clusters=8, clusters_per_batch=2, cluster_method="hash", jk="cat"),
])
def test_bag_of_words_rows_reach_the_model_sparse(dataset, tmp_path, monkeypatch, kw):
    """Mini- and cluster-batch gathered bag-of-words rows dense, normalized and dropped out every value: on Coauthor
    Physics 7x slower than sparse rows and 5x the memory (docs/benchmarks.md). They now gather CSR rows, whose losses
    are the dense path's up to summation order; where the CSR copy is not made (memory), each batch is converted,
    which gives the same bits. Roots of sampled blocks (SAGE, residual) read the CSR's first rows."""
    from tests.train.helpers import metrics_without_timing
    from trellis.data.importers import import_graph
    from trellis.loader.features import SparseRows
    from trellis.train.strategies.batches import BatchStrategy

    store = str(import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False))
    gathered = []
    real = SparseRows.gather

    def counted(self, ids, out=None):
        gathered.append(len(ids))
        return real(self, ids, out)

    def run(name):
        out = tmp_path / name
        trainer.train(cfg(store, out, epochs=3, hidden=16, **kw))
        return [(r["loss"], r["val_loss"]) for r in metrics_without_timing(out / "run")]

    monkeypatch.setattr(SparseRows, "gather", counted)
    sparse = run("sparse")
    assert gathered  # the batches' rows and the evaluation's came from the CSR
    with monkeypatch.context() as m:
        m.setattr(BatchStrategy, "_sparse_source", lambda self, x: None)
        assert run("converted") == sparse
    with monkeypatch.context() as m:
        m.setattr(BatchStrategy, "sparse_input", property(lambda self: False))
        dense = run("dense")
    assert np.allclose(dense, sparse, rtol=1e-5, atol=1e-6), (dense, sparse)
    import trellis

    assert "input rows: sparse (bag-of-words, 1.27% non-zero), held as CSR" in trellis.explain(store, **kw)


@pytest.mark.parametrize("strategy", ["full", "mini"])
def test_predict_keeps_bag_of_words_rows_sparse(dataset, tmp_path, monkeypatch, strategy):
    """`trellis predict` of a full-, mini- or cluster-batch run loaded the store's rows dense (Coauthor Physics: 1,326
    MiB of RssAnon against 300 MiB sparse). They stay sparse for the message-passing models now, with the dense
    predictions' classes and their logits up to summation order."""
    import trellis
    import trellis.train.strategies.full as full
    from trellis.data.importers import import_graph

    store = str(import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False))
    run = trellis.train(store, model="sage", strategy=strategy, epochs=2, hidden=16)
    seen = []
    real = full.load_graph_data

    def spy(*args, **kwargs):
        seen.append(kwargs.get("sparse_rows"))
        return real(*args, **kwargs)

    monkeypatch.setattr(full, "load_graph_data", spy)
    sparse = run.predict(logits=True)
    monkeypatch.setattr(full, "SPARSE_ROW_MODELS", frozenset())
    dense = run.predict(logits=True)
    assert seen == [True, False]
    assert torch.allclose(sparse, dense, rtol=1e-5, atol=1e-5)
    assert torch.equal(sparse.argmax(1), dense.argmax(1))
