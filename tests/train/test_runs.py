from __future__ import annotations

import json
from xml.etree import ElementTree

import pytest

from trellis.errors import TrellisUserError
from trellis.train.runs import MetricsLog, plot_curves, prepare_run_dir, read_jsonl, write_json_atomic


def test_write_json_atomic_leaves_no_temp(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": 1})
    write_json_atomic(tmp_path / "a.json", {"x": 2})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_metrics_log_truncates_to_offset(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write({"epoch": 0, "v": float("nan")})
    offset = log.offset
    log.write({"epoch": 1})
    log.close()
    log = MetricsLog(tmp_path / "m.jsonl", offset=offset)
    log.write({"epoch": 1, "again": True})
    log.close()
    assert read_jsonl(tmp_path / "m.jsonl") == [{"epoch": 0, "v": None}, {"epoch": 1, "again": True}]


def test_prepare_run_dir_refuses_existing(tmp_path):
    paths = prepare_run_dir(tmp_path / "run")
    assert paths.checkpoints.is_dir() and paths.models.is_dir()
    paths.config.write_text("{}")
    with pytest.raises(TrellisUserError, match="already exists.*--resume"):
        prepare_run_dir(tmp_path / "run")
    prepare_run_dir(tmp_path / "run", overwrite=True)


def test_plot_curves(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    for run in range(2):
        for epoch in range(5):
            log.write({"run": run, "epoch": epoch, "loss": 1.0 / (epoch + 1), "val_acc": 0.1 * epoch,
                       "test_acc": None})
    log.close()
    plot_curves(tmp_path / "m.jsonl", tmp_path / "c.svg", "acc")
    root = ElementTree.parse(tmp_path / "c.svg").getroot()
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 4  # per run: its loss and its val curve; the test curve is all None (not drawn)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"loss", "acc (solid: val, dashed: test)", "run 0", "val, run 1", "test, run 1"} <= set(texts)


def test_a_sweep_or_tune_directory_given_for_a_run_names_its_runs(tmp_path, capsys):
    """`trellis predict` and `train --resume` of a tune said only "not a run directory (no config.json)", and
    `compare` called a tune's directory a sweep's and pointed at its candidates (which hold no summary.json)."""
    from trellis.cli.main import main

    tune, sweep = tmp_path / "tune", tmp_path / "sweep"
    (tune / "final" / "configs").mkdir(parents=True)
    (tune / "tune.json").write_text("{}")
    (sweep / "configs").mkdir(parents=True)
    (sweep / "leaderboard.json").write_text("{}")
    cases = [(["predict", str(tune), "--out", str(tmp_path / "p.npy")], "a tune directory, not a run directory; the "
              "chosen configuration's runs are its final/configs/<run>/ directories"),
             (["compare", str(tune)], "a tune directory, not a run directory; the chosen configuration's runs"),
             (["train", "--resume", str(tune)], f"continue an interrupted tune with `trellis tune --resume {tune}`"),
             (["predict", str(sweep), "--out", str(tmp_path / "p.npy")], "a sweep directory, not a run directory; "
              "pass its configs/<id>/ directories"),
             (["compare", str(sweep)], "a sweep directory, not a run directory; pass its configs/<id>/")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "p.npy").exists()
