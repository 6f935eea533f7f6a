"""Data-parallel mini-batch across ranks (``--strategy mini --parts-dir PART_DIR --nproc P``).

One rank equals ``--strategy mini`` bit for bit on Cora (bag-of-words rows, dropout on; read from
TRELLIS_DATA_DIR: fails, never skips, when missing); two ranks launched by the CLI over an uneven layout run
every training node exactly once per epoch, with different batch counts per rank, and learn; bad input is
refused before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.helpers import one_rank_then_one_process, two_rank_resume_matches
from trellis.cli.main import main
from trellis.data.importers import import_graph
from trellis.data.store import GraphStore
from trellis.distributed.comm import free_port
from trellis.partition import partition_graph
from trellis.partition.base import PartitionBook
from trellis.partition.layout import write_layout
from trellis.train.config import TrainConfig
from trellis.train.strategies import strategy_class
from trellis.train.strategies.dist_mini import DistributedMini

KEYS = ("loss", "val_loss", "train_acc", "val_acc", "test_acc")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cora(dataset, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dist-mini")
    store = import_graph(dataset("cora"), root / "cora", format="planetoid", progress=False)
    layout = write_layout(GraphStore(store), partition_graph(GraphStore(store), "metis", 2, measure=False),
                          root / "cora-2")
    return store, layout


def test_one_rank_is_strategy_mini_bit_for_bit_on_cora(cora, tmp_path, monkeypatch):
    store, layout = cora
    common = dict(store=str(store), strategy="mini", model="sage", epochs=3, hidden=16, dropout=0.5, batch_size=64,
                  fanouts="5,5", progress=False, checkpoint_every=0, device="cpu")
    assert strategy_class("mini").for_config(TrainConfig(**common, parts_dir=str(layout), nproc=2)) is DistributedMini
    def ranked() -> TrainConfig:  # checked as a rank's options: made once RANK etc. are set
        return TrainConfig(**common, parts_dir=str(layout), out=str(tmp_path / "ranked"))

    one_rank_then_one_process(monkeypatch, ranked, TrainConfig(**common, out=str(tmp_path / "mini")))
    got, want = _records(tmp_path / "ranked"), _records(tmp_path / "mini")
    assert len(got) == 3
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]
    n_train = int(GraphStore(store).split("train").shape[0])
    assert all(r["targets"] == n_train and r["fetch_remote_rows"] == 0 for r in got)


@pytest.fixture(scope="module")
def layouts(sbm_store, tmp_path_factory) -> dict[int, Path]:
    """3 and 5 parts for 2 and 4 ranks: a rank trains one or two parts, so their batch counts differ."""
    store = GraphStore(sbm_store)
    root = tmp_path_factory.mktemp("uneven")
    return {p: write_layout(store, partition_graph(store, "metis", p, measure=False), root / f"p{p}") for p in (3, 5)}


@pytest.mark.parametrize(("ranks", "parts"), [(2, 3), (4, 5)])
def test_ranks_train_every_target_once_per_epoch_with_uneven_batches(sbm_store, layouts, tmp_path, capsys, ranks,
                                                                     parts):
    out = tmp_path / "run"
    code = main(["train", str(sbm_store), "--strategy", "mini", "--model", "sage", "--parts-dir", str(layouts[parts]),
                 "--nproc", str(ranks), "--batch-size", "8", "--fanouts", "5,5", "--epochs", "6", "--device", "cpu",
                 "--checkpoint-every", "0", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    store = GraphStore(sbm_store)
    n_train = int(store.split("train").shape[0])
    assert summary["world_size"] == ranks and sum(summary["rank_targets"]) == n_train
    batches = summary["rank_batches"]
    assert max(batches) > min(batches)  # the uneven path: some rank runs out of batches first
    records = _records(out)
    for r in records:
        assert r["targets"] == n_train and r["batches"] == max(batches)
        assert r["fetch_remote_rows"] > 0 and len(r["fetch_recv_bytes_per_rank"]) == ranks
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert records[-1]["val_acc"] > 1.5 / store.num_classes
    # the ranks' split evaluation equals one process's exact inference of the same weights (trellis predict)
    assert main(["predict", str(out), str(sbm_store), "--out", str(tmp_path / "p.npy"), "--proba"]) == 0
    proba = torch.from_numpy(np.load(tmp_path / "p.npy"))
    best = records[summary["best_epoch"][0]]
    val = torch.from_numpy(np.array(store.split("val"), dtype=np.int64))
    y = torch.from_numpy(np.array(store.y, dtype=np.int64))[val]
    assert abs(float((proba[val].argmax(1) == y).double().mean()) - best["val_acc"]) < 1e-9
    assert abs(float(torch.nn.functional.nll_loss(proba[val].log(), y)) - best["val_loss"]) < 1e-5


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "4"], "more ranks than the 3 parts"),
    (["--nproc", "2", "--buffer-replay", "4"], "--buffer-replay with --nproc 2"),
    (["--nproc", "2", "--buffer-parts", "2"], "--buffer-parts 2 is more than the 1 part(s) rank 1 of 2 holds"),
    (["--nproc", "2", "--buffer-parts", "1", "--samplers", "1"], "--samplers with a partition buffer per rank"),
    (["--nproc", "2", "--buffer-parts", "1", "--feature-cache", "1M"], "--feature-cache with a partition buffer"),
    (["--nproc", "2", "--norm", "batch"], "--norm batch across ranks"),
    (["--nproc", "1", "--feature-cache", "1M"], "--feature-cache caches other ranks' rows"),
    (["--nproc", "2", "--feature-cache", "lots"], "--feature-cache"),
])
def test_bad_input_is_refused_before_any_rank_starts(sbm_store, layouts, tmp_path, capsys, args, message):
    code = main(["train", str(sbm_store), "--strategy", "mini", "--parts-dir", str(layouts[3]), *args, "--epochs", "1",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_rank_without_training_nodes_is_named(sbm_store, tmp_path, capsys):
    store = GraphStore(sbm_store)
    parts = np.zeros(store.num_nodes, dtype=np.int32)
    others = np.setdiff1d(np.arange(store.num_nodes), np.asarray(store.split("train")))
    parts[others[: others.shape[0] // 2]] = 1  # part 1 holds no training node
    layout = write_layout(store, PartitionBook(parts, 2, "metis"), tmp_path / "skewed")
    code = main(["train", str(sbm_store), "--strategy", "mini", "--parts-dir", str(layout), "--nproc", "2",
                 "--epochs", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "rank 1 of 2 would train no target" in err and "--balance train" in err


def test_an_interrupted_two_rank_run_resumes_to_the_uninterrupted_metrics(sbm_store, layouts, tmp_path):
    kw = dict(store=str(sbm_store), strategy="mini", model="sage", epochs=4, hidden=16, dropout=0.5, batch_size=8,
              fanouts="5,5", progress=False, checkpoint_every=1, device="cpu", parts_dir=str(layouts[3]), nproc=2)
    two_rank_resume_matches(kw, tmp_path, KEYS, epochs=kw["epochs"])


def test_a_feature_cache_and_sampler_processes_change_the_traffic_not_the_result(sbm_store, layouts, tmp_path):
    import torch.multiprocessing as mp

    from tests.distributed.test_parallel import _worker

    kw = dict(store=str(sbm_store), strategy="mini", model="sage", epochs=3, hidden=16, dropout=0.5, batch_size=8,
              fanouts="5,5", progress=False, checkpoint_every=0, device="cpu", parts_dir=str(layouts[3]), nproc=2)
    plain = TrainConfig(**kw, out=str(tmp_path / "plain"))
    cached = TrainConfig(**kw, feature_cache="4K", out=str(tmp_path / "cached"))  # 64 rows of 16 floats
    sampled = TrainConfig(**kw, samplers=1, out=str(tmp_path / "sampled"))
    mp.spawn(_worker, args=(2, free_port(), [c.to_dict(session=True) for c in (plain, cached, sampled)]),
             nprocs=2, join=True)
    got, want = _records(tmp_path / "cached"), _records(tmp_path / "plain")
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]
    assert [[r[k] for k in KEYS] for r in _records(tmp_path / "sampled")] == [[r[k] for k in KEYS] for r in want]
    for g, w in zip(got, want):
        assert g["fetch_cache_rows"] > 0 and 0 < g["fetch_cache_hit_rate"] < 1
        assert g["fetch_remote_rows"] + g["fetch_cache_rows"] == w["fetch_remote_rows"]
        assert g["fetch_recv_bytes"] < w["fetch_recv_bytes"]
    held = json.loads((tmp_path / "cached" / "summary.json").read_text())["feature_cache_bytes"]
    assert 0 < held <= 64 * 16 * 4 and held % (16 * 4) == 0  # whole rows, within the size (rows never sampled: out)


def test_a_killed_rank_is_named_every_process_exits_and_resume_finishes_the_run(sbm_store, layouts, tmp_path):
    import subprocess
    import sys
    import time

    from tests.distributed.test_launch import ENV, _kill_rank, _ranks
    from tests.train.helpers import wait_for_epochs

    def train(out: Path) -> list[str]:
        return [sys.executable, "-m", "trellis.cli", "train", str(sbm_store), "--strategy", "mini", "--model", "sage",
                "--parts-dir", str(layouts[3]), "--nproc", "2", "--batch-size", "8", "--fanouts", "5,5", "--epochs",
                "30", "--checkpoint-every", "2", "--timeout", "30", "--device", "cpu", "--no-progress", "--out",
                str(out)]

    whole = subprocess.run(train(tmp_path / "whole"), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr.decode()[-2000:]
    cut = tmp_path / "cut"
    proc = subprocess.Popen(train(cut), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_epochs(cut, proc, 5)
    pid = _kill_rank(1)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30 and proc.returncode != 0
    assert f"rank 1 (pid {pid}) died: killed by SIGKILL" in err.decode()
    assert not _ranks() and not (cut / "summary.json").exists()
    rc = subprocess.run([sys.executable, "-m", "trellis.cli", "train", "--resume", str(cut), "--no-progress"],
                        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert rc.returncode == 0, rc.stderr.decode()[-2000:]
    got, want = _records(cut), _records(tmp_path / "whole")
    assert len(got) == len(want) == 30
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]


def test_explain_names_every_rank_and_trains_nothing(sbm_store, layouts, tmp_path, capsys):
    code = main(["train", str(sbm_store), "--strategy", "mini", "--model", "sage", "--parts-dir", str(layouts[3]),
                 "--nproc", "2", "--explain", "--device", "cpu", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "rank 0: parts [0, 2]" in out and "rank 1: parts [1]" in out and "sage:" in out
    assert not (tmp_path / "run").exists()
    # each rank through its partition buffer: the explain asked a partition buffer for a sampled batch and died
    code = main(["train", str(sbm_store), "--strategy", "mini", "--model", "sage", "--parts-dir", str(layouts[3]),
                 "--nproc", "2", "--memory-budget", "2G", "--explain", "--device", "cpu", "--out",
                 str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "rank 0, its 2 parts" in out and "part slots: 2 resident + 0 reading (of 2 parts)" in out
    assert "the plan below is of the whole graph" in out and "sage:" in out
    assert not (tmp_path / "run").exists()
    # --feature-cache was refused as if the job had one rank (the explaining process is a world of one)
    code = main(["train", str(sbm_store), "--strategy", "mini", "--parts-dir", str(layouts[3]), "--nproc", "2",
                 "--feature-cache", "1M", "--explain", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert code == 0 and "a cache of 1M per rank" in capsys.readouterr().out


def test_batches_from_the_trainer_sampler_processes_or_sampler_ranks_give_the_same_losses(sbm_store, layouts,
                                                                                         tmp_path, capsys):
    """The three producer modes (issue 25): in the trainer, --samplers 1, and --sampler-ranks 1 or 2 (one sampler
    rank serving both trainers, whose batch counts differ, or one each): the same metrics bit for bit."""
    runs = {}
    for name, extra in (("trainer", []), ("processes", ["--samplers", "1"]), ("one sampler rank",
                                                                             ["--sampler-ranks", "1"]),
                        ("two sampler ranks", ["--sampler-ranks", "2"])):
        out = tmp_path / name.replace(" ", "-")
        code = main(["train", str(sbm_store), "--strategy", "mini", "--model", "sage", "--parts-dir",
                     str(layouts[3]), "--nproc", "2", "--batch-size", "8", "--fanouts", "5,5", "--epochs", "3",
                     "--dropout", "0.5", "--device", "cpu", "--checkpoint-every", "0", "--no-progress", "--out",
                     str(out), *extra])
        assert code == 0, capsys.readouterr().err
        runs[name] = [[r[k] for k in KEYS] for r in _records(out)]
    summary = json.loads((tmp_path / "one-sampler-rank" / "summary.json").read_text())
    assert summary["world_size"] == 2 and max(summary["rank_batches"]) > min(summary["rank_batches"])
    assert len(runs["trainer"]) == 3
    for name, got in runs.items():
        assert got == runs["trainer"], name


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "2", "--sampler-ranks", "3"], "--sampler-ranks 3 is more than the 2 trainer ranks"),
    (["--nproc", "2", "--sampler-ranks", "-1"], "--sampler-ranks"),
    (["--nproc", "2", "--sampler-ranks", "1", "--samplers", "1"], "--samplers with --sampler-ranks"),
    (["--nproc", "1", "--sampler-ranks", "1"], "--sampler-ranks 1 applies to data-parallel mini-batch"),
    (["--sampler-ranks", "1"], "--sampler-ranks 1 applies to data-parallel mini-batch"),  # was trained unused
])
def test_bad_sampler_ranks_are_refused_before_any_rank_starts(sbm_store, layouts, tmp_path, capsys, args, message):
    code = main(["train", str(sbm_store), "--strategy", "mini", "--parts-dir", str(layouts[3]), "--epochs", "1",
                 "--no-progress", "--out", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_a_killed_sampler_rank_is_named_and_every_process_exits(sbm_store, layouts, tmp_path):
    import subprocess
    import sys
    import time

    from tests.distributed.test_launch import ENV, _kill_rank, _ranks
    from tests.train.helpers import wait_for_epochs

    out = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", str(sbm_store), "--strategy", "mini",
                             "--model", "sage", "--parts-dir", str(layouts[3]), "--nproc", "2", "--sampler-ranks",
                             "1", "--batch-size", "8", "--fanouts", "5,5", "--epochs", "50", "--checkpoint-every", "2",
                             "--timeout", "30", "--device", "cpu", "--no-progress", "--out", str(out)],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_epochs(out, proc, 3)
    pid = _kill_rank(2)  # the sampler rank (the trainers are ranks 0 and 1)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert time.monotonic() - t0 < 60 and proc.returncode != 0
    assert f"rank 2 (pid {pid}) died: killed by SIGKILL" in err.decode()
    assert not _ranks() and not (out / "summary.json").exists()


def test_a_rank_partition_buffer_with_every_row_available_is_the_plain_ranks_run(sbm_store, layouts, tmp_path):
    """Issue 25, part 1: a rank streams its parts through its own buffer. With all of them resident and every
    other row cached (--buffer-cache alone), its batches are the plain ranks' bit for bit; with one part resident
    (rank 0 holds parts 0 and 2 of 3, rank 1 part 1), every training node is still a target once per epoch, and
    each rank reads each of its parts once per epoch (after the first, an epoch starts from the last state)."""
    import torch.multiprocessing as mp

    from tests.distributed.test_parallel import _worker

    kw = dict(store=str(sbm_store), strategy="mini", model="sage", epochs=3, hidden=16, dropout=0.5, batch_size=8,
              fanouts="5,5", progress=False, checkpoint_every=0, device="cpu", parts_dir=str(layouts[3]), nproc=2)
    runs = {"plain": TrainConfig(**kw, out=str(tmp_path / "plain")),
            "all": TrainConfig(**kw, buffer_cache="1G", out=str(tmp_path / "all")),
            "one": TrainConfig(**kw, buffer_parts=1, buffer_cache="4K", out=str(tmp_path / "one"))}
    mp.spawn(_worker, args=(2, free_port(), [c.to_dict(session=True) for c in runs.values()]), nprocs=2, join=True)
    store = GraphStore(sbm_store)
    want = _records(tmp_path / "plain")
    assert [[r[k] for k in KEYS] for r in _records(tmp_path / "all")] == [[r[k] for k in KEYS] for r in want]
    one = _records(tmp_path / "one")
    n_train = int(store.split("train").shape[0])
    assert all(r["targets"] == n_train and r["fetch_remote_rows"] == 0 for r in one)
    assert [r["parts_loaded"] for r in one] == [3, 1, 1]
    assert all(0 < r["cache_hit_rate"] < 1 for r in one)
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["rank_buffer_parts"] == 1 and 0 < summary["rank_cache_rows"] <= 64
    losses = [r["loss"] for r in one]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_an_interrupted_buffered_two_rank_run_resumes_to_the_uninterrupted_metrics(sbm_store, layouts, tmp_path):
    kw = dict(store=str(sbm_store), strategy="mini", model="sage", epochs=4, hidden=16, dropout=0.5, batch_size=8,
              fanouts="5,5", progress=False, checkpoint_every=1, device="cpu", parts_dir=str(layouts[3]), nproc=2,
              buffer_parts=1, buffer_cache="8K")
    two_rank_resume_matches(kw, tmp_path, KEYS, epochs=kw["epochs"])


def test_the_rank_target_check_reads_the_split_the_ranks_train_on(data_dir, tmp_path):
    """check_ranks counted the store's own split: with --split-seed it refused a layout whose ranks all hold
    training nodes of the redrawn split, and let through one whose rank 1 holds none of them."""
    from trellis.errors import TrellisUserError
    from trellis.train.data import redraw_split
    from trellis.train.strategies.dist_mini import check_ranks

    store = GraphStore(import_graph(data_dir / "cora-npz", tmp_path / "s", format="npz", progress=False))
    n = store.num_nodes
    own = np.asarray(store.split("train"))
    redrawn = redraw_split(store, np.asarray(store.y), 1)["train"]
    layouts = {}
    for name, avoid in (("redrawn-in-both", own), ("store-in-both", redrawn)):
        parts = np.zeros(n, np.int32)
        parts[np.setdiff1d(np.arange(n // 2, n), avoid)] = 1  # part 1 holds none of `avoid`
        if name == "store-in-both":
            parts[np.setdiff1d(own, redrawn)[0]] = 1  # one store training node, not a redrawn one
        layouts[name] = write_layout(store, PartitionBook(parts, 2, "custom"), tmp_path / name)

    def cfg(layout):
        return TrainConfig(store=str(store.path), strategy="mini", parts_dir=str(layout), nproc=2, split_seed=1,
                           out=str(tmp_path / "r"))

    check_ranks(cfg(layouts["redrawn-in-both"]), store, 2)  # its part 1 holds redrawn training nodes
    with pytest.raises(TrellisUserError, match="rank 1 of 2 would train no target"):
        check_ranks(cfg(layouts["store-in-both"]), store, 2)


def test_a_resumed_buffered_rank_keeps_the_interrupted_ranks_residency(sbm_store, layouts, tmp_path, monkeypatch):
    """A rank's buffer plan under --memory-budget depends on the baseline it measures; a resuming rank planned
    its cache anew and its epochs sampled other neighbourhoods than the uninterrupted run's. Here the resumed
    rank plans half the cache (as a larger baseline would): the checkpoint's residency must win."""
    import dataclasses
    import io

    import torch

    from trellis.distributed.comm import free_port
    from trellis.train import trainer
    from trellis.train.strategies import dist_mini

    kw = dict(store=str(sbm_store), strategy="mini", model="sage", epochs=4, hidden=16, dropout=0.5, batch_size=8,
              fanouts="5,5", progress=False, device="cpu", parts_dir=str(layouts[3]), buffer_parts=1,
              memory_budget="2G")
    threads = torch.get_num_threads()

    def fit(cfg: TrainConfig, **extra) -> dict:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        return trainer.Trainer(cfg, err=io.StringIO(), **extra).fit()

    def stop_at(t, rec):
        if rec["epoch"] == 1:
            t.request_stop()

    try:
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            monkeypatch.setenv(k, v)
        ref = fit(TrainConfig(**kw, out=str(tmp_path / "ref")))
        assert ref["rank_cache_rows"] > 1
        cut = TrainConfig(**kw, checkpoint_every=1, out=str(tmp_path / "cut"))
        with pytest.raises(trainer.TrainingInterrupted):
            fit(cut, callbacks=[stop_at])
        plan = dist_mini.plan_residency
        monkeypatch.setattr(dist_mini, "plan_residency", lambda *a, **k: dataclasses.replace(
            plan(*a, **k), cache_rows=plan(*a, **k).cache_rows // 2))
        got = fit(TrainConfig.from_dict({**cut.to_dict(session=True), "resume": str(tmp_path / "cut")}))
    finally:
        torch.set_num_threads(threads)
    assert got["rank_cache_rows"] == ref["rank_cache_rows"]
    assert [r["loss"] for r in _records(tmp_path / "cut")] == [r["loss"] for r in _records(tmp_path / "ref")]
