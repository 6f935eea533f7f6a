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
