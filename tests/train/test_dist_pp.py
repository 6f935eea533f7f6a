"""Pre-propagation training data-parallel over rows (``--strategy pp --pp-dir PP_DIR --nproc P``).

On Cora's cache (bag-of-words rows; read from TRELLIS_DATA_DIR: fails, never skips, when missing): ranks split
the training rows, train every row once per epoch with uneven slices, and learn; their gathered evaluation is
one process's evaluation of the same weights; an interrupted run resumes to the uninterrupted metrics; bad input
is refused before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.helpers import two_rank_resume_matches
from trellis.cli.main import main
from trellis.data.importers import import_graph
from trellis.data.store import GraphStore
from trellis.loader.ppcache import preprocess
from trellis.train.config import TrainConfig
from trellis.train.strategies import strategy_class
from trellis.train.strategies.dist_pp import DistributedPP, rank_slice
from trellis.train.strategies.pp import PrePropagation

KEYS = ("loss", "val_loss", "val_acc", "test_acc")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cora_pp(dataset, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dist-pp")
    store = import_graph(dataset("cora"), root / "cora", format="planetoid", progress=False)
    preprocess(store, root / "pp", hops=2, progress=False)
    return Path(store), root / "pp"


def test_rank_slices_cover_the_rows_once():
    for world in (1, 2, 3, 7):
        parts = [rank_slice((10, 150), r, world) for r in range(world)]
        assert parts[0][0] == 10 and parts[-1][1] == 150
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        sizes = [b - a for a, b in parts]
        assert max(sizes) - min(sizes) <= 1


def test_ranks_are_chosen_by_nproc_or_a_rank_environment(cora_pp, monkeypatch):
    store, cache = cora_pp
    cfg = TrainConfig(store=str(store), strategy="pp", pp_dir=str(cache), model="sign")
    assert strategy_class("pp").for_config(cfg) is PrePropagation
    assert strategy_class("pp").for_config(TrainConfig.from_dict({**cfg.to_dict(), "nproc": 2})) is DistributedPP
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    assert strategy_class("pp").for_config(cfg) is DistributedPP


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_train_every_row_once_per_epoch_and_evaluate_the_whole_splits(cora_pp, tmp_path, capsys, ranks):
    store, cache = cora_pp
    out = tmp_path / "run"
    # 140 training rows: 3 ranks get 46/47/47 rows and batches of 8 -> 6 batches each, but the last rank's
    # slice and batch differ; batch 20 over 3 ranks gives shares 7/7/7 and 7 batches (uneven last batches)
    code = main(["train", str(store), "--strategy", "pp", "--pp-dir", str(cache), "--model", "sign",
                 "--nproc", str(ranks), "--batch-size", "20", "--epochs", "12", "--hidden", "32", "--device", "cpu",
                 "--checkpoint-every", "0", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    n_train = int(GraphStore(store).split("train").shape[0])
    assert summary["world_size"] == ranks and sum(summary["rank_rows"]) == n_train
    records = _records(out)
    assert all(r["rows"] == n_train for r in records)  # every training row once per epoch
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    assert records[-1]["val_acc"] > 0.6
    # the gathered evaluation is one process's evaluation of the same weights (trellis predict: one process)
    assert main(["predict", str(out), str(store), "--out", str(tmp_path / "p.npy"), "--proba"]) == 0
    proba = torch.from_numpy(np.load(tmp_path / "p.npy"))
    best = records[summary["best_epoch"][0]]
    st = GraphStore(store)
    y = torch.from_numpy(np.array(st.y, dtype=np.int64))
    for split in ("val", "test"):
        idx = torch.from_numpy(np.array(st.split(split), dtype=np.int64))
        acc = float((proba[idx].argmax(1) == y[idx]).double().mean())
        assert abs(acc - best[f"{split}_acc"]) < 1e-9, split
    val = torch.from_numpy(np.array(st.split("val"), dtype=np.int64))
    assert abs(float(torch.nn.functional.nll_loss(proba[val].log(), y[val])) - best["val_loss"]) < 1e-5


def test_an_interrupted_two_rank_run_resumes_to_the_uninterrupted_metrics(cora_pp, tmp_path):
    store, cache = cora_pp
    kw = dict(store=str(store), strategy="pp", pp_dir=str(cache), model="sign", epochs=4, hidden=16, dropout=0.5,
              batch_size=32, progress=False, checkpoint_every=1, device="cpu", nproc=2)
    two_rank_resume_matches(kw, tmp_path, KEYS, epochs=kw["epochs"])


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "500"], "--nproc 500 is more ranks than the 140 training rows"),
    (["--nproc", "2", "--pp-loader", "naive"], "--pp-loader naive with --nproc 2"),
    (["--nproc", "0"], "--nproc"),
])
def test_bad_input_is_refused_before_any_rank_starts(cora_pp, tmp_path, capsys, args, message):
    store, cache = cora_pp
    code = main(["train", str(store), "--strategy", "pp", "--pp-dir", str(cache), "--model", "sign", "--epochs", "1",
                 "--no-progress", "--out", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_explain_names_the_ranks_and_trains_nothing(cora_pp, tmp_path, capsys):
    store, cache = cora_pp
    code = main(["train", str(store), "--strategy", "pp", "--pp-dir", str(cache), "--model", "sign", "--nproc", "3",
                 "--batch-size", "30", "--explain", "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0 and "over 3 rank(s): training rows per rank [46, 47, 47], batch per rank [10, 11, 11]" in out
    assert not (tmp_path / "r").exists()


def test_ranks_train_a_multilabel_cache_and_evaluate_it_as_one_process(tmp_path, capsys):
    """Pre-propagation refused multilabel stores (its cache keeps a 0/1 row per node); two ranks now train one,
    and their gathered evaluation is one process's evaluation of the same weights."""
    from trellis.data.generate import generate_sbm
    from trellis.train import metrics as M

    store = generate_sbm(tmp_path / "ml", nodes=400, features=16, feature_noise=0.7, task="multilabel", labels=5,
                         progress=False)
    preprocess(store, tmp_path / "pp", hops=2, progress=False)
    out = tmp_path / "run"
    code = main(["train", str(store), "--strategy", "pp", "--pp-dir", str(tmp_path / "pp"), "--model", "sign",
                 "--nproc", "2", "--batch-size", "16", "--epochs", "15", "--lr", "0.05", "--device", "cpu",
                 "--checkpoint-every", "0", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    records = _records(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "multilabel" and records[-1]["loss"] < 0.8 * records[0]["loss"]
    assert main(["predict", str(out), str(store), "--out", str(tmp_path / "p.npy")]) == 0
    pred = torch.from_numpy(np.load(tmp_path / "p.npy")).float()
    st = GraphStore(store)
    y = torch.from_numpy(np.array(st.y, dtype=np.float32))
    best = records[summary["best_epoch"][0]]
    for split in ("val", "test"):
        idx = torch.from_numpy(np.array(st.split(split), dtype=np.int64))
        assert abs(M.f1_micro(pred[idx], y[idx]) - best[f"{split}_f1_micro"]) < 1e-9, split
