"""``trellis train --target-acc`` and ``trellis compare``: success paths and bad input -> exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from tests.train.stubmodel import make_sbm_store, stub_build
from trellis.cli.main import main

pytestmark = pytest.mark.usefixtures("stub_model")  # one torch thread; the stub is passed as model_factory


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(make_sbm_store(tmp_path_factory.mktemp("cmp") / "sbm"))


@pytest.fixture(scope="module")
def two_runs(store, tmp_path_factory):
    """Two finished runs with --target-acc: a wide model for 12 epochs and a narrow one for 20."""
    import torch

    root = tmp_path_factory.mktemp("runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, hidden, epochs in (("wide", "64", "12"), ("narrow", "8", "20")):
            assert main(["train", store, "--out", str(root / name), "--epochs", epochs, "--hidden", hidden,
                         "--lr", "0.03", "--runs", "2", "--target-acc", "0.6", "--no-progress"],
                        model_factory=stub_build) == 0
    finally:
        torch.set_num_threads(threads)
    return root / "wide", root / "narrow"


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("bad", ["0", "-0.1", "1.01", "nan", "inf", "abc"])
def test_bad_target_acc_exits_2_nothing_written(capsys, tmp_path, store, bad):
    rc, out, err = run(capsys, "train", store, "--out", tmp_path / "r", "--target-acc", bad, "--epochs", "2")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --target-acc must be"), err
    assert not (tmp_path / "r").exists()


def test_summary_has_target_fields(two_runs):
    s = json.loads((two_runs[0] / "summary.json").read_text())
    assert s["target_acc"] == 0.6 and len(s["time_to_target_s"]) == 2 and len(s["epochs_to_target"]) == 2
    assert json.loads((two_runs[0] / "config.json").read_text())["target_acc"] == 0.6


def test_compare_table_json_and_png(capsys, tmp_path, two_runs):
    png = tmp_path / "c.png"
    rc, out, err = run(capsys, "compare", *two_runs, "--out", png)
    assert rc == 0, err
    assert out.splitlines()[0].split()[:4] == ["run", "model", "strategy", "runs"]
    assert "wide" in out and "narrow" in out and f"curves: {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    rc, out, err = run(capsys, "compare", *two_runs, "--json", "--target", "0.5", "--no-plot")
    assert rc == 0, err
    res = json.loads(out)
    assert res["target"] == 0.5 and res["plot"] is None and [r["name"] for r in res["rows"]] == ["wide", "narrow"]
    for row, d in zip(res["rows"], two_runs):
        s = json.loads((d / "summary.json").read_text())
        assert row["runs"] == 2 and row["test_mean"] == s["test_acc_mean"]
        assert row["epoch_at_99pct_peak_val_mean"] == s["epoch_at_99pct_peak_val_mean"]
    done = [r for r in res["rows"] if r["time_to_target_s_mean"] is not None]
    if done:
        assert res["first_to_target"] == min(done, key=lambda r: r["time_to_target_s_mean"])["name"]
    # the runs' own --target-acc is the default target
    rc, out, err = run(capsys, "compare", *two_runs, "--json", "--no-plot")
    assert json.loads(out)["rows"][0]["target"] == 0.6


@pytest.mark.parametrize(("args", "needle"), [
    (["{tmp}/nope"], "nope: no such run directory"),
    (["{tmp}"], "not a run directory"),
    (["{inc}"], "the run is incomplete"),
    (["{wide}", "--target", "0"], "--target must be in (0, 1]"),
    (["{wide}", "--target", "x"], "expected a number"),
    (["{wide}", "--out", "{tmp}/c.pdf"], "must end in .png"),
    ([], "the following arguments are required: RUN_DIR"),
])
def test_compare_bad_input(capsys, tmp_path, two_runs, args, needle):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "config.json").write_text("{}")
    argv = [a.format(tmp=tmp_path, inc=inc, wide=two_runs[0]) for a in args]
    rc, out, err = run(capsys, "compare", *argv, *([] if "--out" in args else ["--out", tmp_path / "c.png"]))
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not list(tmp_path.glob("c.*"))


def test_a_priced_run_reports_cost_and_value_and_compare_shows_them(capsys, tmp_path, store):
    out = tmp_path / "priced"
    assert main(["train", store, "--out", str(out), "--epochs", "3", "--hidden", "8", "--no-progress",
                 "--price-per-hour", "0.34"], model_factory=stub_build) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["machines"] == 1 and s["price"] == "$0.34/machine-hour"
    assert s["cost_per_epoch_usd"] == pytest.approx(0.34 * s["epoch_time_s_median"] / 3600)
    assert s["value"] == pytest.approx(1 / (s["epoch_time_s_median"] * s["cost_per_epoch_usd"]))
    capsys.readouterr()
    rc, text, _ = run(capsys, "compare", out, "--no-plot")
    assert rc == 0 and "$/epoch" in text and "value" in text
    rc, _, err = run(capsys, "train", store, "--out", tmp_path / "never", "--price-per-hour", "cheap")
    assert rc == 2 and "--price-per-hour 'cheap'" in err and not (tmp_path / "never").exists()
