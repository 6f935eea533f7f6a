"""trellis.train.compare on hand-built run directories (trainer- and pp-style) and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trellis.errors import TrellisUserError
from trellis.train.compare import compare_runs, format_table, load_run_dir, plot_compare


def write_run(root: Path, curves: list[list[float]], *, dt: float, model: str = "gcn", strategy: str = "full",
              target: float | None = None, pp: bool = False, test: float = 0.8) -> Path:
    """A finished run directory: one curve of validation accuracy per run, epochs of ``dt`` seconds."""
    root.mkdir(parents=True)
    lines = []
    for r, vals in enumerate(curves):
        for e, v in enumerate(vals):
            if pp:  # the pre-propagation trainer's older records: per-epoch parts, no time_s
                lines.append({"run": r, "seed": r, "epoch": e, "loss": 1.0, "val_acc": v,
                              "epoch_time_s": dt * 0.8, "eval_time_s": dt * 0.2})
            else:
                lines.append({"run": r, "seed": r, "epoch": e, "loss": 1.0, "val_acc": v, "test_acc": v,
                              "step_time_s": dt * 0.8, "time_s": dt * (e + 1)})
    (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if pp:
        summary = {"strategy": "pp", "model": model, "runs": [{"run": r} for r in range(len(curves))],
                   "test_acc_mean": test, "test_acc_std": 0.01, "val_acc_mean": 0.8,
                   "epoch_time_median_s": dt * 0.8, "peak_rss_bytes": 300 * 2**20, "peak_rss_anon_bytes": 100 * 2**20,
                   "preprocess_seconds": 1.5}
        config = {"model": model, "target_acc": target}
    else:
        summary = {"status": "complete", "metric": "acc", "task": "multiclass", "runs": len(curves), "model": model,
                   "strategy": strategy, "test_acc_mean": test, "test_acc_std": 0.02, "val_acc_mean": 0.8,
                   "epoch_time_s_median": dt * 0.8, "peak_rss_mb": 400.0, "peak_rss_anon_mb": 200.0,
                   "device": "cpu"}
        config = {"model": model, "strategy": strategy, "target_acc": target}
    (root / "summary.json").write_text(json.dumps(summary))
    (root / "config.json").write_text(json.dumps(config))
    return root


# fast epochs, many of them  vs  slow epochs, few of them
FAST = [0.2, 0.4, 0.5, 0.6, 0.65, 0.7, 0.72, 0.74, 0.75, 0.76, 0.77, 0.78, 0.78, 0.78, 0.78]
SLOW = [0.3, 0.6, 0.72, 0.76, 0.78, 0.78, 0.78, 0.78]


def test_fast_epochs_win_on_time_slow_epochs_on_epochs(tmp_path):
    a = write_run(tmp_path / "fast", [FAST, FAST], dt=0.1, strategy="mini")
    b = write_run(tmp_path / "slow", [SLOW], dt=1.0, model="gat")
    result, rds = compare_runs([a, b], target=0.75)
    ra, rb = result["rows"]
    assert ra["name"] == "fast" and ra["strategy"] == "mini" and ra["runs"] == 2
    assert ra["epochs_to_target"] == [9, 9] and ra["time_to_target_s_mean"] == pytest.approx(0.9)
    assert rb["epochs_to_target_mean"] == 4 and rb["time_to_target_s_mean"] == pytest.approx(4.0)
    assert result["first_to_target"] == "fast" and result["fewest_epochs_to_target"] == "slow"
    assert ra["epoch_wall_s"] == pytest.approx(0.1) and ra["epoch_time_s"] == pytest.approx(0.08)
    assert ra["peak_rss_anon_mb"] == 200.0 and ra["test_mean"] == 0.8
    text = format_table(result)
    assert "first to val acc 0.75: fast in 0.90 s" in text and "slow 4.00 s" in text
    assert "fewest epochs to the target: slow" in text
    assert "0.8000 ± 0.0200" in text.splitlines()[2] and "0.8000 ±" not in text.splitlines()[3]  # one run: no spread
    png = plot_compare(result, rds, tmp_path / "sub" / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(result)  # JSON-ready


def test_target_from_the_runs_and_mismatches(tmp_path):
    a = write_run(tmp_path / "a", [FAST], dt=0.1, target=0.7)
    b = write_run(tmp_path / "b", [SLOW], dt=1.0, target=0.7)
    c = write_run(tmp_path / "c", [SLOW], dt=1.0, target=0.9)
    result, _ = compare_runs([a, b])
    assert result["target"] == 0.7 and result["first_to_target"] == "a"
    result, _ = compare_runs([a, c])
    assert result["first_to_target"] is None and "different --target-acc" in result["note"]
    assert compare_runs([a, c], target=0.7)[0]["first_to_target"] == "a"  # --target overrides
    result, _ = compare_runs([a, b], target=0.9)  # nobody gets there
    assert result["first_to_target"] is None and "no run directory reached" in result["note"]
    assert result["rows"][0]["runs_reaching_target"] == 0 and "never" in format_table(result)
    result, _ = compare_runs([write_run(tmp_path / "n", [FAST], dt=0.1)])
    assert result["target"] is None and "no target" in result["note"]
    assert "time_to_target_s" not in result["rows"][0]


def test_a_run_dir_where_one_run_misses_the_target_is_not_ranked(tmp_path):
    a = write_run(tmp_path / "a", [FAST, [0.1] * 15], dt=0.1)
    b = write_run(tmp_path / "b", [SLOW], dt=1.0)
    result, _ = compare_runs([a, b], target=0.75)
    assert result["rows"][0]["runs_reaching_target"] == 1 and result["rows"][0]["time_to_target_s_mean"] is None
    assert result["first_to_target"] == "b"


def test_pp_run_dirs(tmp_path):
    pp = write_run(tmp_path / "pp", [SLOW, SLOW], dt=0.5, model="sign", pp=True, target=0.75)
    rd = load_run_dir(pp)
    assert rd.strategy == "pp" and rd.metric == "acc" and rd.target == 0.75
    result, rds = compare_runs([pp, write_run(tmp_path / "full", [FAST], dt=0.1)], target=0.75)
    row = result["rows"][0]
    assert row["runs"] == 2 and row["model"] == "sign"
    assert row["time_to_target_s"] == [pytest.approx(2.0)] * 2  # epoch + eval parts summed
    assert row["epoch_time_s"] == pytest.approx(0.4) and row["peak_rss_anon_mb"] == pytest.approx(100.0)
    assert row["preprocess_s"] == 1.5 and "pp: plus 1.50 s of one-off preprocessing" in format_table(result)
    plot_compare(result, rds, tmp_path / "c.png")


def test_duplicate_names_use_the_path(tmp_path):
    a = write_run(tmp_path / "x" / "run", [FAST], dt=0.1)
    b = write_run(tmp_path / "y" / "run", [SLOW], dt=1.0)
    names = [r["name"] for r in compare_runs([a, b], 0.7)[0]["rows"]]
    assert names == [str(a), str(b)]


def test_bad_run_dirs(tmp_path):
    with pytest.raises(TrellisUserError, match="no such run directory"):
        load_run_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrellisUserError, match="empty: not a run directory"):
        load_run_dir(tmp_path / "empty")
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "config.json").write_text("{}")
    (inc / "metrics.jsonl").write_text("")
    with pytest.raises(TrellisUserError, match=r"inc: the run is incomplete .*--resume"):
        load_run_dir(inc)
    sweep = tmp_path / "sweep"
    (sweep / "configs").mkdir(parents=True)
    with pytest.raises(TrellisUserError, match="sweep directory"):
        load_run_dir(sweep)
    bad = write_run(tmp_path / "bad", [FAST], dt=0.1)
    (bad / "metrics.jsonl").write_text('{"run": 0}\nnot json\n')
    with pytest.raises(TrellisUserError, match=r"bad/metrics.jsonl: line 2 is not JSON"):
        load_run_dir(bad)
    (bad / "metrics.jsonl").write_text('{"run": 0, "epoch": 0, "val_f1": 0.5}\n')
    with pytest.raises(TrellisUserError, match="no val_acc values"):
        load_run_dir(bad)
    (bad / "summary.json").write_text("{")
    with pytest.raises(TrellisUserError, match="bad/summary.json: unreadable"):
        load_run_dir(bad)
    with pytest.raises(TrellisUserError, match=r"--target must be in \(0, 1\]"):
        compare_runs([write_run(tmp_path / "ok", [FAST], dt=0.1)], target=1.5)


def test_a_run_reaching_the_target_in_some_seeds_is_not_never(tmp_path):
    """4 of 5 seeds reached the target: the table gives their mean and says 4/5, never 'never'."""
    low = [0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5]
    a = write_run(tmp_path / "mostly", [FAST, FAST, FAST, FAST, low], dt=0.1, target=0.75)
    b = write_run(tmp_path / "all", [SLOW], dt=1.0, target=0.75)
    result, _ = compare_runs([a, b])
    row = next(r for r in result["rows"] if r["name"] == "mostly")
    assert row["runs_reaching_target"] == 4 and row["epochs_to_target_mean"] is None
    text = format_table(result)
    line = next(ln for ln in text.splitlines() if ln.startswith("mostly"))
    assert "never" not in line and "9.0 (4/5)" in line
    assert "mostly not in every run (4/5 reached it)" in text


def test_runs_of_different_metrics_each_name_theirs(tmp_path):
    """The column read "test metric" and the cells were bare numbers: an accuracy beside a micro-F1."""
    a = write_run(tmp_path / "acc", [FAST], dt=0.1)
    b = write_run(tmp_path / "f1", [SLOW], dt=1.0, test=0.7)
    metrics = (b / "metrics.jsonl").read_text().replace('"val_acc"', '"val_f1_micro"').replace('"test_acc"',
                                                                                             '"test_f1_micro"')
    (b / "metrics.jsonl").write_text(metrics)
    summary = json.loads((b / "summary.json").read_text())
    summary.update(metric="f1_micro", task="multilabel", test_f1_micro_mean=0.7, test_f1_micro_std=0.0)
    (b / "summary.json").write_text(json.dumps(summary))
    lines = format_table(compare_runs([a, b])[0]).splitlines()
    assert "test metric" in lines[0]
    assert "0.8000 acc" in lines[2] and "0.7000 f1_micro" in lines[3]
    same = format_table(compare_runs([a, a])[0]).splitlines()
    assert "test acc" in same[0] and "0.8000 acc" not in same[2]
