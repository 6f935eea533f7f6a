"""Time to accuracy: the rules of trellis.train.convergence on hand-built curves, and the trainer's summary."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig
from trellis.train.convergence import (
    converged_index,
    cumulative_times,
    first_reaching,
    index_at_fraction_of_peak,
    mean_if_all,
    run_time_to_accuracy,
    summarize_time_to_accuracy,
)
from trellis.train.runs import read_json, read_jsonl
from trellis.train.trainer import Trainer, TrainingInterrupted, train


def recs(vals, run=0, dt=0.5):
    """Per-epoch records like the trainer's: val_acc and cumulative time_s."""
    return [{"run": run, "epoch": e, "val_acc": v, "time_s": dt * (e + 1)} for e, v in enumerate(vals)]


# ---- the rules ---------------------------------------------------------------------------------------
def test_first_reaching():
    assert first_reaching([0.1, 0.5, 0.8, 0.9], 0.8) == 2  # >=, not >
    assert first_reaching([0.1, 0.5], 0.8) is None
    assert first_reaching([None, float("nan"), 0.9], 0.5) == 2  # missing values never reach
    assert first_reaching([3.0, 2.0, 1.0], 1.5, higher_is_better=False) == 2


def test_99pct_of_peak():
    # peak 0.80 -> threshold 0.792; 0.79 is below, 0.795 the first above
    assert index_at_fraction_of_peak([0.2, 0.6, 0.79, 0.795, 0.80, 0.78]) == 3
    assert index_at_fraction_of_peak([0.5]) == 0
    assert index_at_fraction_of_peak([None, None]) is None
    assert index_at_fraction_of_peak([2.0, 1.005, 1.0], higher_is_better=False) == 1  # 1.005 <= 1/0.99


def test_converged_is_first_small_change_after_the_initial_plateau():
    # epochs 0-2 sit at the initial value (not learning yet): their zero changes do not count
    vals = [0.30, 0.30, 0.30, 0.50, 0.70, 0.7005, 0.72, 0.72]
    assert converged_index(vals, window=1) == 5  # |0.7005 - 0.70| <= 0.001 (Dorylus' rule taken literally)
    assert converged_index(vals, window=2) is None  # 0.70->0.7005 then 0.7005->0.72 breaks it
    assert converged_index(vals) is None  # the default window is 3
    assert converged_index([0.3, 0.5, 0.72, 0.7205, 0.7210, 0.7212]) == 5  # three small changes end at 5
    assert converged_index([0.3, 0.5, 0.72, 0.7205, 0.7210, 0.73, 0.7302, 0.7304, 0.7304]) == 8  # streak restarts
    assert converged_index([0.3, 0.3, 0.3, 0.3, 0.3]) is None  # never moved
    assert converged_index([0.1, 0.2, 0.3, 0.4]) is None  # never held still
    assert converged_index([0.1, 0.5, None, 0.5005], window=1) is None  # a missing value breaks the pair
    assert converged_index([0.1, 0.5, 0.5011], window=1) is None  # 0.0011 > 0.001
    assert converged_index([]) is None
    with pytest.raises(ValueError):
        converged_index([0.1], window=0)


def test_cumulative_times_from_time_s_or_pp_parts():
    assert cumulative_times(recs([0.1, 0.2, 0.3])) == [0.5, 1.0, 1.5]
    pp_old = [{"epoch": e, "val_acc": 0.1, "epoch_time_s": 0.2, "eval_time_s": 0.05} for e in range(3)]
    assert cumulative_times(pp_old) == pytest.approx([0.25, 0.5, 0.75])


def test_run_time_to_accuracy_and_summary():
    r0 = recs([0.2, 0.5, 0.81, 0.85, 0.8505, 0.851, 0.8505, 0.84], run=0, dt=1.0)
    r1 = recs([0.1, 0.3, 0.6, 0.79, 0.79, 0.79, 0.79], run=1, dt=0.25)
    one = run_time_to_accuracy(r0, "acc", 0.8)
    assert one == {"epoch_at_99pct_peak_val": 3, "converged_epoch": 6, "epochs_to_target": 3,
                   "time_to_target_s": 3.0}
    assert "time_to_target_s" not in run_time_to_accuracy(r0, "acc")
    s = summarize_time_to_accuracy(r1 + r0, "acc", 0.8)  # order of lines does not matter
    assert s["target_acc"] == 0.8 and s["runs_reaching_target"] == 1
    assert s["epochs_to_target"] == [3, None] and s["time_to_target_s"] == [3.0, None]
    assert s["epochs_to_target_mean"] is None and s["time_to_target_s_mean"] is None  # not every run reached it
    assert s["epoch_at_99pct_peak_val"] == [3, 3] and s["epoch_at_99pct_peak_val_mean"] == 3.0
    assert s["converged_epoch"] == [6, 6] and s["converged_epoch_mean"] == 6.0
    s2 = summarize_time_to_accuracy(r0 + r1, "acc", 0.75)
    assert s2["epochs_to_target"] == [3, 4] and s2["epochs_to_target_mean"] == 3.5
    assert s2["time_to_target_s_mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert set(summarize_time_to_accuracy(r0, "acc")) == {"epoch_at_99pct_peak_val", "epoch_at_99pct_peak_val_mean",
                                                          "converged_epoch", "converged_epoch_mean"}


def test_mean_if_all():
    assert mean_if_all([1, 2]) == 1.5
    assert mean_if_all([1, None]) is None
    assert mean_if_all([]) is None


# ---- --target-acc and the trainer's summary ------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, math.nan, math.inf])
def test_target_acc_range(bad):
    with pytest.raises(TrellisUserError, match=r"--target-acc must be in \(0, 1\]"):
        TrainConfig(store="s", target_acc=bad)
    assert TrainConfig(store="s", target_acc=1).target_acc == 1.0
    assert TrainConfig.from_dict({"store": "s", "target_acc": "0.7"}).target_acc == 0.7


def _check_against_log(s: dict, run_dir: Path, target: float) -> None:
    log = read_jsonl(run_dir / "metrics.jsonl")
    for r in range(s["runs"]):
        mine = [x for x in log if x["run"] == r]
        times = [x["time_s"] for x in mine]
        assert times == sorted(times) and times[0] > 0  # cumulative within the run
        vals = [x["val_acc"] for x in mine]
        ett = s["epochs_to_target"][r]
        if ett is None:
            assert max(vals) < target
        else:
            assert vals[ett - 1] >= target and all(v < target for v in vals[:ett - 1])
            assert s["time_to_target_s"][r] == mine[ett - 1]["time_s"]
        peak_ep = s["epoch_at_99pct_peak_val"][r]
        assert vals[peak_ep] >= 0.99 * max(vals) and all(v < 0.99 * max(vals) for v in vals[:peak_ep])
        assert s["converged_epoch"][r] == converged_index(vals)


def test_summary_fields_end_to_end(small_store, tmp_path, stub_model):
    s = train(TrainConfig(store=str(small_store), out=str(tmp_path / "run"), device="cpu", epochs=25, runs=2,
                          lr=0.03, target_acc=0.6, progress=False), model_factory=stub_model)
    assert s == read_json(tmp_path / "run" / "summary.json")
    assert s["target_acc"] == 0.6 and s["runs_reaching_target"] == 2  # the planted partition is easy
    assert len(s["time_to_target_s"]) == len(s["epochs_to_target"]) == 2
    assert s["time_to_target_s_mean"] == pytest.approx(sum(s["time_to_target_s"]) / 2)
    _check_against_log(s, tmp_path / "run", 0.6)
    # without --target-acc: no target fields, the convergence fields still there
    s2 = train(TrainConfig(store=str(small_store), out=str(tmp_path / "nt"), device="cpu", epochs=5,
                           progress=False), model_factory=stub_model)
    assert "time_to_target_s" not in s2 and "target_acc" not in s2
    assert len(s2["epoch_at_99pct_peak_val"]) == 1 and "converged_epoch" in s2


def test_summary_fields_survive_resume(small_store, tmp_path, stub_model):
    """The fields come from metrics.jsonl, so a run resumed in a new process counts the earlier epochs."""
    kw = {"store": str(small_store), "device": "cpu", "epochs": 20, "runs": 2, "checkpoint_every": 5, "lr": 0.03,
          "target_acc": 0.6, "progress": False}
    full = train(TrainConfig(out=str(tmp_path / "full"), **kw), model_factory=stub_model)

    def stop(trainer, rec):
        if rec["run"] == 1 and rec["epoch"] == 7:
            trainer.request_stop(signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        Trainer(TrainConfig(out=str(tmp_path / "cut"), **kw), callbacks=[stop], model_factory=stub_model).fit()
    cfg = TrainConfig.from_dict({**read_json(tmp_path / "cut" / "config.json"), "resume": str(tmp_path / "cut"),
                                 "progress": False})
    cut = Trainer(cfg, model_factory=stub_model).fit()
    for key in ("epochs_to_target", "epoch_at_99pct_peak_val", "converged_epoch", "runs_reaching_target"):
        assert cut[key] == full[key], key
    _check_against_log(cut, tmp_path / "cut", 0.6)


def test_pp_strategy_reports_the_same_fields(small_store, tmp_path):
    """Pre-propagation runs through the one trainer: cumulative time_s and the same summary fields."""
    import torch

    from trellis.cli.main import main

    assert main(["preprocess", str(small_store), "--hops", "2", "--out", str(tmp_path / "pp"), "--no-progress"]) == 0
    with pytest.raises(TrellisUserError, match=r"--target-acc must be in \(0, 1\]"):
        TrainConfig(store=str(small_store), strategy="pp", pp_dir=str(tmp_path / "pp"), target_acc=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainConfig(store=str(small_store), strategy="pp", pp_dir=str(tmp_path / "pp"), model="sgc",
                          epochs=15, runs=2, batch_size=64, target_acc=0.5, out=str(tmp_path / "run"),
                          device="cpu", progress=False)
        s = train(cfg)
    finally:
        torch.set_num_threads(threads)
    assert s == read_json(tmp_path / "run" / "summary.json")
    log = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for r in range(2):
        mine = [x for x in log if x["run"] == r]
        times = [x["time_s"] for x in mine]  # cumulative, as the trainer logs it for every strategy
        assert len(mine) == s["epochs_run"][r] and all(b > a for a, b in zip(times, times[1:]))
        assert all(x["step_time_s"] < x["time_s"] for x in mine)
    assert s["target_acc"] == 0.5 and len(s["epochs_to_target"]) == 2
    assert s == {**s, **summarize_time_to_accuracy(log, "acc", 0.5)}
