"""``--strategy full --memory-budget``: the same losses as in memory, spills removed, bad input refused (exit 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.train.helpers import metrics_without_timing, wait_for_epochs
from tests.train.stubmodel import make_sbm_store
from trellis.cli.main import main
from trellis.train.config import TrainConfig
from trellis.train.runs import read_json, read_jsonl
from trellis.train.strategies.outofcore import OutOfCoreFull
from trellis.train.trainer import Trainer, TrainingInterrupted, train
from trellis.utils.spill import PREFIX

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_sbm_store(tmp_path_factory.mktemp("ooc") / "sbm", n=400, features=10)


def _cfg(store: Path, out: Path, **kw) -> TrainConfig:
    values = {"store": str(store), "device": "cpu", "progress": False, "out": str(out), "epochs": 6, "hidden": 16,
              "dropout": 0.5, **kw}
    return TrainConfig(**values)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
@pytest.mark.parametrize("rows", [1, 7, None])
def test_budgeted_run_trains_what_the_in_memory_run_trains(store, tmp_path, monkeypatch, model, rows):
    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", rows)
    kw = {"model": model, "layers": 3 if rows == 7 else 2, "feature_norm": "row" if model == "gin" else "none"}
    train(_cfg(store, tmp_path / "mem", **kw))
    train(_cfg(store, tmp_path / "ooc", memory_budget="3G", **kw))
    mem, ooc = _losses(tmp_path / "mem"), _losses(tmp_path / "ooc")
    assert max(abs(a - b) for a, b in zip(mem, ooc)) <= 1e-6 and len(mem) == len(ooc) == 6
    recs = read_jsonl(tmp_path / "ooc" / "metrics.jsonl")
    for a, b in zip(read_jsonl(tmp_path / "mem" / "metrics.jsonl"), recs):
        assert a["val_acc"] == b["val_acc"] and abs(a["val_loss"] - b["val_loss"]) <= 1e-6
    assert all(r["spill_written_bytes"] > 0 and r["spill_read_bytes"] > 0 for r in recs)
    summary = read_json(tmp_path / "ooc" / "summary.json")
    assert summary["tiles"] >= (400 // rows if rows else 1) and summary["memory_budget_bytes"] == 3 * 10**9
    assert not (tmp_path / "ooc" / "spill").exists()  # removed with the run


def test_spill_dir_flag_and_explain(store, tmp_path, capsys):
    spill = tmp_path / "spills"
    assert main(["train", str(store), "--memory-budget", "2G", "--spill-dir", str(spill), "--epochs", "2",
                 "--no-progress", "--out", str(tmp_path / "run")]) == 0
    assert not spill.exists()
    assert main(["train", str(store), "--memory-budget", "2G", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "out-of-core plan: budget" in out and "row tiles" in out and "spilled" in out and "recomputed" in out


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
@pytest.mark.parametrize(("dropout", "layers"), [(0.0, 2), (0.5, 2), (0.5, 3)])
def test_explain_prices_the_spill_traffic_the_epoch_measures(store, tmp_path, capsys, model, dropout, layers):
    """``--explain`` printed 2 MiB of reads for a Cora epoch that read 45 (the features' reads were left out)
    and counted a cached first aggregation as written every epoch; its rule now follows the engine's passes."""
    import trellis
    from trellis.data.store import GraphStore
    from trellis.nn.tiled import epoch_traffic
    from trellis.plan.cost import GraphStats
    from trellis.utils.sizes import format_size

    run = trellis.train(str(store), model=model, dropout=dropout, layers=layers, hidden=16, epochs=3,
                        memory_budget="2G", feature_norm="row" if model == "gin" else "none", device="cpu",
                        out=tmp_path / "run")
    g = GraphStore(store)
    io = epoch_traffic(run.model, GraphStats(g.num_nodes, g.num_nodes, g.num_edges), int(g.split("train").shape[0]))
    for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]:  # after the first epoch's one-off writes
        assert (r["spill_written_bytes"], r["spill_read_bytes"]) == (io.written, io.read)
    assert main(["train", str(store), "--model", model, "--dropout", str(dropout), "--layers", str(layers),
                 "--hidden", "16", "--memory-budget", "2G", "--feature-norm", "row" if model == "gin" else "none",
                 "--device", "cpu", "--explain"]) == 0
    out = capsys.readouterr().out
    assert f"spill writes {format_size(io.written, digits=1)}, reads {format_size(io.read, digits=1)}" in out


def _whole_and_cut(store, tmp_path, **kw) -> None:
    """Train ``whole`` uninterrupted, and ``cut`` stopped by SIGTERM after its epoch 2 (a checkpoint written)."""
    train(_cfg(store, tmp_path / "whole", **kw))

    def stop(t, rec):
        if rec["epoch"] == 2:
            t.request_stop(signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        Trainer(_cfg(store, tmp_path / "cut", **kw), callbacks=[stop]).fit()


def _resume_cut(tmp_path) -> None:
    resumed = TrainConfig.from_dict({**read_json(tmp_path / "cut" / "config.json"), "resume": str(tmp_path / "cut")})
    Trainer(resumed).fit()
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(tmp_path / "whole")


def test_interrupt_removes_the_spills_and_resume_is_exact(store, tmp_path):
    _whole_and_cut(store, tmp_path, model="gcn", memory_budget="2G", checkpoint_every=2)
    assert not (tmp_path / "cut" / "spill").exists()
    _resume_cut(tmp_path)


def test_resume_keeps_the_interrupted_run_s_tiles(store, tmp_path, monkeypatch):
    """A resumed process that would plan other tiles (it measures its own memory) trains on the checkpoint's: the
    per-tile sums, so the losses, stay those of the uninterrupted run."""
    from trellis.train.strategies.outofcore import OutOfCoreFull

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 7)
    _whole_and_cut(store, tmp_path, model="gcn", memory_budget="2G", checkpoint_every=2, dropout=0.0, epochs=6)
    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 10**6)  # this process alone would plan other tiles
    _resume_cut(tmp_path)
    tiles = [read_json(tmp_path / d / "summary.json")["tiles"] for d in ("whole", "cut")]
    assert tiles[0] == tiles[1] > 1


def _spawn(store: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", str(store), "--memory-budget", "2G",
                             "--epochs", "400", "--hidden", "16", "--checkpoint-every", "1", "--no-progress",
                             "--out", str(out), *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _spill_dirs(root: Path) -> list[Path]:
    return list(root.glob(f"{PREFIX}*")) if root.is_dir() else []


def test_sigterm_removes_the_spills(store, tmp_path):
    out = tmp_path / "run"
    proc = _spawn(store, out)
    wait_for_epochs(out, proc, 2)
    assert _spill_dirs(out / "spill")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    assert not (out / "spill").exists()
    assert (out / "checkpoints").is_dir()


def test_kill_9_leaves_spills_that_resume_removes(store, tmp_path):
    out, spill = tmp_path / "run", tmp_path / "spill"
    proc = _spawn(store, out, "--spill-dir", str(spill), "--epochs", "400")
    wait_for_epochs(out, proc, 3)
    proc.kill()
    proc.wait(timeout=60)
    stale = _spill_dirs(spill)
    assert stale  # kill -9 runs no cleanup
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"resume": str(out), "epochs": len(read_jsonl(out / "metrics.jsonl")) + 1, "progress": False})
    Trainer(TrainConfig.from_dict(cfg)).fit()
    assert not any(d.exists() for d in stale) and not spill.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--memory-budget", "lots"], "--memory-budget"),
    (["--memory-budget", "20M"], "is below the smallest budget that trains this model on this graph"),
    (["--memory-budget", "2G", "--model", "gat"], "cannot train under --memory-budget"),
    (["--memory-budget", "2G", "--features", "embedding:8"], "does not run under --memory-budget"),
    (["--memory-budget", "2G", "--spill-dir", "/proc/version/spill"], "--spill-dir /proc/version/spill"),
    (["--memory-budget", "2G", "--device", "cuda"], "--device"),
])
def test_bad_input_exits_2_and_leaves_nothing(store, tmp_path, capsys, args, message):
    assert main(["train", str(store), *args, "--epochs", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_spill_dir_without_room_is_refused(store, tmp_path, capsys, monkeypatch):
    import shutil

    from trellis.utils import spill

    monkeypatch.setattr(spill.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    assert main(["train", str(store), "--memory-budget", "2G", "--spill-dir", str(tmp_path / "s"), "--epochs", "2",
                 "--out", str(tmp_path / "run")]) == 2
    assert "GiB are free there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()


def test_an_in_memory_run_that_will_not_fit_names_a_budget(store, tmp_path, capsys, monkeypatch):
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=100 * 2**20))
    assert main(["train", str(store), "--epochs", "1", "--no-progress", "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "full-batch in memory needs about" in err and "--memory-budget 80.00 MiB" in err


def test_predict_keeps_the_runs_budget_and_equals_the_in_memory_prediction(store, tmp_path, capsys):
    import numpy as np

    for name, extra in (("mem", []), ("ooc", ["--memory-budget", "2G"])):
        assert main(["train", str(store), "--epochs", "3", "--layers", "3", "--no-progress", "--out",
                     str(tmp_path / name), *extra]) == 0
        assert main(["predict", str(tmp_path / name), str(store), "--out", str(tmp_path / f"{name}.npy"),
                     "--proba", "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["embedding_source"] == "penultimate" and info["num_nodes"] == 400
    for suffix in (".npy", "_emb.npy"):
        a, b = (np.load(tmp_path / f"{name}{suffix}") for name in ("mem", "ooc"))
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5
    assert not (tmp_path / "ooc" / "spill").exists() and not list(tmp_path.glob("*.tmp.npy"))
    # a budget too small for the prediction names it as such (it said "trains this model")
    assert main(["predict", str(tmp_path / "ooc"), str(store), "--out", str(tmp_path / "small.npy"),
                 "--memory-budget", "20M"]) == 2
    assert "smallest budget that runs this model" in capsys.readouterr().err
    assert not (tmp_path / "small.npy").exists()
    # tiled inference runs on the CPU: a GPU asked for is refused, not silently ignored (it was)
    assert main(["predict", str(tmp_path / "ooc"), str(store), "--out", str(tmp_path / "gpu.npy"),
                 "--device", "cuda"]) == 2
    assert "runs on the CPU only" in capsys.readouterr().err and not (tmp_path / "gpu.npy").exists()


def test_a_node_listed_twice_in_a_split_is_refused_before_either_strategy_trains_on_it(tmp_path):
    """Out of core once counted a repeated training node once where memory counted it twice (fixed to agree);
    a repeated id is now refused when the store is made, so neither trains on it."""
    from trellis.data import from_arrays
    from trellis.errors import TrellisUserError

    rng = np.random.default_rng(0)
    n = 60
    with pytest.raises(TrellisUserError, match="node 5 appears 3 times in the split"):
        from_arrays(rng.integers(0, n, 300), rng.integers(0, n, 300), n, out=tmp_path / "s",
                    x=rng.normal(size=(n, 6)).astype(np.float32), y=rng.integers(0, 3, n), remove_self_loops=True,
                    splits={"train": np.array([0, 1, 2, 3, 4, 5, 5, 5, 6, 7]), "val": np.arange(10, 20),
                            "test": np.arange(20, 30)})


@pytest.fixture(scope="module")
def cora(dataset, tmp_path_factory) -> Path:
    """Planetoid Cora: bag-of-words rows (1.3% non-zero), which out-of-core tiles read as sparse rows."""
    from trellis.data.importers import import_graph

    return import_graph(dataset("cora"), tmp_path_factory.mktemp("cora") / "cora", format="planetoid",
                        progress=False)


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
def test_bag_of_words_tiles_read_sparse_rows_and_train_the_in_memory_losses(cora, tmp_path, monkeypatch, model):
    """Tiles of bag-of-words rows were read, dropped out and multiplied dense (Coauthor CS: 2.0 s a step against
    0.14 s now); they are sparse rows now, written once, and each tile reads only its stored values."""
    from trellis.data.store import GraphStore

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 500)
    kw = {"model": model, "hidden": 16, "epochs": 4}
    train(_cfg(cora, tmp_path / "mem", **kw))
    train(_cfg(cora, tmp_path / "ooc", memory_budget="3G", **kw))
    mem, ooc = _losses(tmp_path / "mem"), _losses(tmp_path / "ooc")
    assert max(abs(a - b) for a, b in zip(mem, ooc)) <= 1e-6 and len(ooc) == 4 and ooc[0] != ooc[-1]
    recs = read_jsonl(tmp_path / "ooc" / "metrics.jsonl")
    for a, b in zip(read_jsonl(tmp_path / "mem" / "metrics.jsonl"), recs):
        assert a["val_acc"] == b["val_acc"]
    x = GraphStore(cora).x
    dense_read = x.shape[0] * x.shape[1] * 4  # one read of the dense rows: a transform-first layer reads 3 a epoch
    assert all(r["spill_read_bytes"] < dense_read for r in recs[1:])
    assert read_json(tmp_path / "ooc" / "summary.json")["tiles"] >= 5


def test_explain_prices_sparse_rows_and_their_reads(cora, capsys):
    """``--explain`` lists the sparse rows' spill at its size and the epoch's reads of them (held to the engine's
    counters by the test above's rule, :func:`epoch_traffic`)."""
    assert main(["train", str(cora), "--memory-budget", "1G", "--explain"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("x "))
    assert "sparse rows (CSR)" in line
    mib = float(line.split("MiB")[0].split()[-1])
    assert 0.5 < mib < 2.0  # 49k stored values: 0.6 MiB, not the 14.8 MiB of dense rows


def test_bag_of_words_tiles_explain_traffic_equals_the_epoch(cora, tmp_path):
    """The traffic rule with sparse rows' reads equals what the engine counted, epoch by epoch."""
    import trellis
    from trellis.data.store import GraphStore
    from trellis.nn.tiled import epoch_traffic
    from trellis.plan.cost import GraphStats

    run = trellis.train(str(cora), model="sage", dropout=0.5, hidden=16, epochs=3, memory_budget="2G",
                        device="cpu", out=tmp_path / "run")
    g = GraphStore(cora)
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    nnz = int(np.count_nonzero(np.asarray(g.x)))
    io = epoch_traffic(run.model, GraphStats(g.num_nodes, g.num_nodes, g.num_edges, sparse_input=0.01),
                       int(g.split("train").shape[0]), input_bytes=nnz * 12 + g.num_nodes * 8)
    for r in recs[1:]:
        assert (r["spill_written_bytes"], r["spill_read_bytes"]) == (io.written, io.read)


def test_library_predict_of_a_bag_of_words_run_under_a_budget(cora):
    """``Run.predict`` runs under ``torch.no_grad``: the sparse kernels' warm-up ran a backward there and raised."""
    import torch

    import trellis

    run = trellis.train(str(cora), model="sage", epochs=2, memory_budget="1G", device="cpu")
    pred = run.predict(str(cora))
    assert tuple(pred.shape) == (2708,) and torch.is_grad_enabled()


def test_bag_of_words_predict_out_of_core_equals_in_memory(cora, tmp_path):
    """Prediction under a budget reads the sparse rows too, and a one-layer model's embeddings (the input rows)
    are written dense."""
    for layers in ("2", "1"):
        for name, extra in (("mem", []), ("ooc", ["--memory-budget", "2G"])):
            run = tmp_path / f"{name}{layers}"
            assert main(["train", str(cora), "--epochs", "2", "--layers", layers, "--no-progress", "--out", str(run),
                         *extra]) == 0
            assert main(["predict", str(run), str(cora), "--out", str(tmp_path / f"{name}{layers}.npy")]) == 0
        for suffix in (".npy", "_emb.npy"):
            a, b = (np.load(tmp_path / f"{name}{layers}{suffix}") for name in ("mem", "ooc"))
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5


@pytest.mark.parametrize("mlp_hidden", [8, 32])
def test_gin_with_its_own_mlp_width_trains_the_in_memory_losses(store, tmp_path, monkeypatch, mlp_hidden):
    """``--mlp-hidden`` differing from ``--hidden`` crashed out of core (a broadcast error: the engine sized the
    layer's output by the MLP's hidden width, which GIN declares); the traffic rule priced it the same way."""
    from trellis.data.store import GraphStore
    from trellis.nn.tiled import epoch_traffic
    from trellis.plan.cost import GraphStats

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 90)
    kw = {"model": "gin", "mlp_hidden": mlp_hidden, "layers": 3, "feature_norm": "row"}
    import trellis

    train(_cfg(store, tmp_path / "mem", **kw))
    run = trellis.train(str(store), memory_budget="3G", hidden=16, dropout=0.5, epochs=6, device="cpu",
                        out=tmp_path / "ooc", **kw)
    mem, ooc = _losses(tmp_path / "mem"), _losses(tmp_path / "ooc")
    assert max(abs(a - b) for a, b in zip(mem, ooc)) <= 1e-6 and len(ooc) == 6
    g = GraphStore(store)
    io = epoch_traffic(run.model, GraphStats(g.num_nodes, g.num_nodes, g.num_edges), int(g.split("train").shape[0]))
    for r in read_jsonl(tmp_path / "ooc" / "metrics.jsonl")[1:]:
        assert (r["spill_written_bytes"], r["spill_read_bytes"]) == (io.written, io.read)


def test_bag_of_words_interrupt_and_resume_is_exact(cora, tmp_path, monkeypatch):
    """The sparse rows' spill is rewritten by the resumed process; the run ends with the uninterrupted losses."""
    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 700)
    _whole_and_cut(cora, tmp_path, model="sage", memory_budget="2G", checkpoint_every=2)
    assert not (tmp_path / "cut" / "spill").exists()
    _resume_cut(tmp_path)
