from __future__ import annotations

import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.helpers import metrics_without_timing, summary_without_timing
from tests.train.stubmodel import make_sbm_store, stub_build
from trellis.data.store import write_store
from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig
from trellis.train.data import normalize_features
from trellis.train.runs import read_json, read_jsonl
from trellis.train.trainer import Trainer as _Trainer
from trellis.train.trainer import TrainingInterrupted
from trellis.train.trainer import train as _train

# The trainer on its own: every run here trains the small stub model, passed as the trainer's model factory.
Trainer = functools.partial(_Trainer, model_factory=stub_build)
train = functools.partial(_train, model_factory=stub_build)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("stub_model")


def cfg_for(store, out, **kw):
    kw.setdefault("epochs", 40)
    kw.setdefault("progress", False)
    return TrainConfig(store=str(store), out=str(out), device="cpu", **kw)


def test_run_directory_and_summary(small_store, tmp_path):
    s = train(cfg_for(small_store, tmp_path / "run", runs=3, seed=5))
    run = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "summary.json", "curves.svg", "checkpoints/last.pt",
                 "models/run-0.pt", "models/run-2.pt"):
        assert (run / name).is_file(), name
    assert read_json(run / "summary.json") == s
    assert s["seeds"] == [5, 6, 7]
    assert len(s["test_acc"]) == 3
    assert s["test_acc_mean"] == pytest.approx(statistics.fmean(s["test_acc"]))
    assert s["test_acc_std"] == pytest.approx(statistics.stdev(s["test_acc"]))
    assert s["val_acc_mean"] == pytest.approx(statistics.fmean(s["val_acc"]))
    for key in ("epoch_time_s_median", "peak_rss_mb", "peak_rss_anon_mb"):
        assert s[key] > 0
    assert s["steps_timed"] == sum(s["epochs_run"])
    assert s["test_acc_mean"] > 0.7  # the planted partition is learnable
    recs = read_jsonl(run / "metrics.jsonl")
    assert len(recs) == sum(s["epochs_run"])
    assert {"run", "seed", "epoch", "loss", "train_acc", "val_acc", "test_acc", "step_time_s", "time_s"} <= set(recs[0])
    # The test metric is the one at the best validation epoch, as logged.
    for r, res in enumerate(s["per_run"]):
        at_best = next(x for x in recs if x["run"] == r and x["epoch"] == res["best_epoch"])
        assert at_best["test_acc"] == res["test_acc"]
        assert at_best["val_acc"] == max(x["val_acc"] for x in recs if x["run"] == r)
    cfg_json = read_json(run / "config.json")
    assert cfg_json["epochs"] == 40 and "json" not in cfg_json


def test_different_seeds_differ_same_seed_repeats(small_store, tmp_path):
    train(cfg_for(small_store, tmp_path / "a", epochs=10, runs=2))
    train(cfg_for(small_store, tmp_path / "b", epochs=10, runs=2))
    a, b = metrics_without_timing(tmp_path / "a"), metrics_without_timing(tmp_path / "b")
    assert a == b
    assert [x["loss"] for x in a if x["run"] == 0] != [x["loss"] for x in a if x["run"] == 1]


def test_early_stopping_restores_best(small_store, tmp_path):
    s = train(cfg_for(small_store, tmp_path / "run", epochs=500, patience=5, lr=0.05))
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert s["epochs_run"][0] < 500
    assert recs[-1]["epoch"] == s["best_epoch"][0] + 5
    # The saved model holds the best-validation weights: evaluating it gives the logged best metrics.
    from trellis.train.predict import predict

    info = predict(tmp_path / "run", small_store, tmp_path / "p.npy", device="cpu", model_factory=stub_build)
    pred = np.load(info["predictions"])
    from trellis.data.store import GraphStore

    st = GraphStore(small_store)
    test = st.split("test")
    assert float(np.mean(pred[test] == st.y[test])) == pytest.approx(s["test_acc"][0])


def test_eval_every_evaluates_every_nth_epoch_and_the_last(small_store, tmp_path):
    """--eval-every 3 over 8 epochs: epochs 2, 5 and 7 carry the figures, which equal an every-epoch run's."""
    s = train(cfg_for(small_store, tmp_path / "run", epochs=8, patience=100, eval_every=3))
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in recs] == list(range(8))
    assert [r["epoch"] for r in recs if "val_acc" in r] == [2, 5, 7]
    assert s["best_epoch"][0] in (2, 5, 7)
    train(cfg_for(small_store, tmp_path / "every", epochs=8, patience=100))
    base = read_jsonl(tmp_path / "every" / "metrics.jsonl")
    assert [r["loss"] for r in recs] == [r["loss"] for r in base]  # evaluation draws no random numbers
    for r in recs:
        if "val_acc" in r:
            assert (r["val_acc"], r["test_acc"]) == (base[r["epoch"]]["val_acc"], base[r["epoch"]]["test_acc"])


def test_eval_every_keeps_patience_in_epochs(small_store, tmp_path):
    """Patience counts epochs, not evaluations: a run stops at the first evaluation ``patience`` epochs or more
    after its best one."""
    s = train(cfg_for(small_store, tmp_path / "run", epochs=500, patience=6, lr=0.05, eval_every=4))
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    best, last = s["best_epoch"][0], recs[-1]["epoch"]
    assert last < 499 and (best + 1) % 4 == 0 and (last + 1) % 4 == 0
    assert last - best >= 6 and last - best - 4 < 6  # the first evaluation at or past the patience


def _resume(run_dir, **session):
    cfg = TrainConfig.from_dict({**read_json(Path(run_dir) / "config.json"), "resume": str(run_dir),
                                 "progress": False, **session})
    return Trainer(cfg).fit()


@pytest.mark.parametrize(("stop_run", "stop_epoch", "eval_every"), [(0, 7, 1), (1, 3, 1), (0, 29, 1), (0, 7, 3)])
def test_resume_after_interrupt_is_exact(small_store, tmp_path, stop_run, stop_epoch, eval_every):
    """(With --eval-every 3 the cut falls between two evaluations.)"""
    kw = {"epochs": 30, "runs": 2, "checkpoint_every": 10, "patience": 12, "lr": 0.03, "eval_every": eval_every}
    train(cfg_for(small_store, tmp_path / "full", **kw))

    def stop(trainer, rec):
        if rec["run"] == stop_run and rec["epoch"] == stop_epoch:
            trainer.request_stop(signal.SIGINT)

    t = Trainer(cfg_for(small_store, tmp_path / "cut", **kw), callbacks=[stop])
    with pytest.raises(TrainingInterrupted) as exc:
        t.fit()
    assert exc.value.signum == signal.SIGINT
    assert not (tmp_path / "cut" / "summary.json").exists()
    _resume(tmp_path / "cut")
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(tmp_path / "full")
    assert summary_without_timing(tmp_path / "cut") == summary_without_timing(tmp_path / "full")


def test_resume_after_hard_kill_replays_from_last_checkpoint(small_store, tmp_path):
    """A crash between checkpoints (no signal handler ran): epochs after the checkpoint are redone once."""
    kw = {"epochs": 25, "checkpoint_every": 10}
    train(cfg_for(small_store, tmp_path / "full", **kw))

    class Crash(Exception):
        pass

    def crash(trainer, rec):
        if rec["epoch"] == 16:
            raise Crash

    with pytest.raises(Crash):
        Trainer(cfg_for(small_store, tmp_path / "cut", **kw), callbacks=[crash]).fit()
    assert len(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == 17
    _resume(tmp_path / "cut")
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(tmp_path / "full")


def test_resume_without_checkpoint_starts_over(small_store, tmp_path):
    def crash(trainer, rec):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        Trainer(cfg_for(small_store, tmp_path / "cut", epochs=5, checkpoint_every=0), callbacks=[crash]).fit()
    _resume(tmp_path / "cut")
    train(cfg_for(small_store, tmp_path / "full", epochs=5, checkpoint_every=0))
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(tmp_path / "full")


def test_resume_complete_run_returns_summary(small_store, tmp_path):
    s = train(cfg_for(small_store, tmp_path / "run", epochs=3))
    assert _resume(tmp_path / "run") == s


def test_resume_refuses_other_store(small_store, tmp_path):
    def stop(trainer, rec):
        trainer.request_stop()

    with pytest.raises(TrainingInterrupted):
        Trainer(cfg_for(small_store, tmp_path / "cut", epochs=5), callbacks=[stop]).fit()
    other = make_sbm_store(tmp_path / "other", seed=1)
    with pytest.raises(TrellisUserError, match="differs"):
        _resume(tmp_path / "cut", store=str(other))


def test_sigterm_subprocess_then_resume_is_exact(small_store, tmp_path):
    """The real path: SIGTERM to a training process, then `trellis train --resume` in another process."""
    args = ["train", str(small_store), "--epochs", "60", "--checkpoint-every", "0", "--device", "cpu",
            "--no-progress"]
    cmd = [sys.executable, "-c", "import tests.train.stubmodel as s; s.run_cli()"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "STUB_EPOCH_SLEEP": "0.02"}
    proc = subprocess.Popen([*cmd, *args, "--out", str(tmp_path / "cut")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_bytes().splitlines()) < 10):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "trellis train --resume" in err
    done = len(read_jsonl(metrics))
    assert 10 <= done < 60
    res = subprocess.run([*cmd, "train", "--resume", str(tmp_path / "cut"), "--no-progress"], cwd=REPO,
                         env={**env, "STUB_EPOCH_SLEEP": "0"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    train(cfg_for(small_store, tmp_path / "full", epochs=60, checkpoint_every=0))
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(tmp_path / "full")
    assert summary_without_timing(tmp_path / "cut") == summary_without_timing(tmp_path / "full")


def test_feature_norm():
    x = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, 2.0]])
    y, mode = normalize_features(x.clone(), "row")
    assert mode == "row" and torch.allclose(y, torch.tensor([[0.25, 0.75], [0.0, 0.0], [0.5, 0.5]]))
    y, mode = normalize_features(torch.tensor([[1.0, -1.0]]), "none")
    assert mode == "none" and torch.equal(y, torch.tensor([[1.0, -1.0]]))
    y, mode = normalize_features(torch.tensor([[1.0, -3.0]]), "row")
    assert mode == "row" and torch.allclose(y, torch.tensor([[0.25, -0.75]]))
    y, mode = normalize_features(torch.tensor([[3.0, -4.0], [0.0, 0.0]]), "l2")
    assert mode == "l2" and torch.allclose(y, torch.tensor([[0.6, -0.8], [0.0, 0.0]]))


def test_feature_norm_recorded(tmp_path):
    # auto reads the features: dense non-negative ones are left alone
    store = make_sbm_store(tmp_path / "nonneg", nonneg=True)
    assert train(cfg_for(store, tmp_path / "r1", epochs=2))["feature_norm"] == "none"
    assert train(cfg_for(store, tmp_path / "r2", epochs=2, feature_norm="row"))["feature_norm"] == "row"


def _store_without(tmp_path, drop):
    n = 4
    kw = {"indptr": np.array([0, 1, 2, 3, 4]), "indices": np.array([1, 0, 3, 2]),
          "x": np.ones((n, 2), np.float32), "y": np.array([0, 1, 0, 1]),
          "splits": {"train": np.array([0, 1]), "val": np.array([2]), "test": np.array([3])}}
    if drop == "val":
        kw["splits"].pop("val")
    else:
        kw.pop(drop)
    return write_store(tmp_path / f"no-{drop}", **kw)


@pytest.mark.parametrize(("drop", "message"), [("x", "no node features"), ("y", "no labels"),
                                               ("val", "no val split")])
def test_store_without_what_training_needs(tmp_path, drop, message):
    store = _store_without(tmp_path, drop)
    with pytest.raises(TrellisUserError, match=message):
        train(cfg_for(store, tmp_path / "run"))


def test_existing_run_dir_refused_then_overwrite(small_store, tmp_path):
    train(cfg_for(small_store, tmp_path / "run", epochs=2))
    with pytest.raises(TrellisUserError, match="already exists"):
        train(cfg_for(small_store, tmp_path / "run", epochs=2))
    s = train(cfg_for(small_store, tmp_path / "run", epochs=3, overwrite=True))
    assert s["epochs_run"] == [3] and len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 3


def test_model_builder_errors_are_user_errors(small_store, tmp_path):
    with pytest.raises(TrellisUserError, match="--model gcn: unexpected model options"):
        train(cfg_for(small_store, tmp_path / "run", model_args={"bogus": 1}))


def test_explain(small_store):
    text = Trainer(TrainConfig(store=str(small_store), device="cpu")).explain()
    assert text.startswith("stub plan: 2 layers")


def test_cuda_requested_without_gpu(small_store, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(TrellisUserError, match="no CUDA device"):
        train(TrainConfig(store=str(small_store), out=str(tmp_path / "r"), device="cuda", progress=False))


def _interrupted(small_store, out):
    def stop(trainer, rec):
        if rec["epoch"] == 3:
            trainer.request_stop(signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        Trainer(cfg_for(small_store, out, epochs=10, checkpoint_every=2), callbacks=[stop]).fit()
    return out


@pytest.mark.parametrize(("damage", "match"), [
    (lambda d: (d / "checkpoints" / "last.pt").write_bytes(b"garbage"), r"last\.pt: unreadable"),
    (lambda d: (d / "checkpoints" / "last.pt").write_bytes(b""), r"last\.pt: unreadable"),
    (lambda d: (d / "metrics.jsonl").write_text("{}\n"), r"metrics\.jsonl is shorter \(3 bytes\)"),
    (lambda d: (d / "metrics.jsonl").unlink(), r"metrics\.jsonl is missing"),
    (lambda d: (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "lr": 0.5})),
     r"its checkpoint was written with lr = 0\.01 but config\.json says 0\.5"),
    (lambda d: (d / "config.json").write_text(  # another strategy's run: named by its strategy, not batch_size
        json.dumps({**json.loads((d / "config.json").read_text()), "strategy": "mini", "batch_size": 7})),
     r"its checkpoint was written with strategy = 'full' but config\.json says 'mini'"),
], ids=["garbage-checkpoint", "empty-checkpoint", "short-log", "missing-log", "edited-config", "other-strategy"])
def test_a_damaged_run_directory_is_refused_on_resume_by_name(small_store, tmp_path, damage, match):
    """Tracebacks before; a short log was padded with NUL bytes and every later resume failed, a missing one gave a
    silently partial history, an edited config mixed two configurations in one run."""
    out = _interrupted(small_store, tmp_path / "cut")
    damage(out)
    with pytest.raises(TrellisUserError, match=match):
        Trainer(TrainConfig.from_dict({**json.loads((out / "config.json").read_text()), "resume": str(out),
                                       "progress": False})).fit()


def test_resume_removes_the_temporary_file_a_kill_left_mid_checkpoint(small_store, tmp_path):
    """kill -9 while a checkpoint was being written left .last.pt.XXXX.tmp (63 MB in one report) for good."""
    out = _interrupted(small_store, tmp_path / "cut")
    stale = out / "checkpoints" / ".last.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    _resume(out)
    assert not stale.exists() and (out / "summary.json").is_file()


def test_a_run_directory_being_written_is_refused_to_a_second_writer(small_store, tmp_path):
    """Two writers mixed two runs: a second --resume logged epochs twice, --overwrite of a running run left one run's
    summary beside the other's config. The lock goes with its holder (a killed run leaves none)."""
    from trellis.train.runs import RunLock

    out = _interrupted(small_store, tmp_path / "cut")
    held = RunLock(out).acquire()  # another process writing it
    try:
        with pytest.raises(TrellisUserError, match="another trellis process is writing this run directory"):
            _resume(out)
        with pytest.raises(TrellisUserError, match="another trellis process is writing this run directory"):
            Trainer(cfg_for(small_store, out, epochs=2, overwrite=True)).fit()
        assert (out / "checkpoints" / "last.pt").is_file()  # nothing cleared
    finally:
        held.release()
    _resume(out)
    assert (out / "summary.json").is_file()
