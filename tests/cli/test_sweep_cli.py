from __future__ import annotations

import csv
import json

import pytest

from tests.train.stubmodel import make_sbm_store
from trellis.cli.main import main
from trellis.errors import TrellisUserError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(make_sbm_store(tmp_path_factory.mktemp("sweepcli") / "sbm", n=200, features=8))


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_sweep_writes_a_leaderboard_and_prints_json(store, tmp_path, capsys):
    out = tmp_path / "sw"
    rc, stdout, err = run(capsys, "sweep", store, "--model", "gcn", "--grid", "lr=0.05,0.01", "hidden=8,16",
                          "--set", "dropout=0.5", "--epochs", "4", "--patience", "2", "--out", out, "--json",
                          "--no-progress")
    assert rc == 0, err
    board = json.loads(stdout.strip().splitlines()[-1])
    assert len(board["rows"]) == 4 and board["configs"] == 4 and board["metric"] == "acc"
    assert "val acc" in err and "test acc" in err  # the table goes to stderr with --json
    with open(out / "leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["config"] for r in rows) == ["c00", "c01", "c02", "c03"]
    assert {"lr", "hidden", "val_acc", "test_acc", "epochs", "time_s"} <= set(rows[0])
    for name in ("leaderboard.json", "leaderboard.png", "sweep.json"):
        assert (out / name).is_file()
    cfg = json.loads((out / "configs" / "c01" / "config.json").read_text())
    assert cfg["lr"] == 0.05 and cfg["hidden"] == 16 and cfg["dropout"] == 0.5 and cfg["epochs"] == 4


def test_explain_prints_the_choice_of_k_and_the_batched_plan(store, capsys):
    rc, out, _ = run(capsys, "sweep", store, "--grid", "hidden=8,16,32", "dropout=0,0.5", "--explain")
    assert rc == 0 and "6 configurations" in out and "model batching: K =" in out and "<- chosen" in out
    rc, out, _ = run(capsys, "sweep", store, "--grid", "hidden=8,16,32", "dropout=0,0.5", "--explain",
                     "--batch-models", "6")
    assert rc == 0 and "K = 6 (--batch-models 6)" in out
    assert "spmm" in out and "6 configurations, graph read once" in out and "cached: once" in out
    rc, out, _ = run(capsys, "sweep", store, "--grid", "hidden=8,16", "--batch-models", "1", "--explain")
    assert rc == 0 and "K = 1 (--batch-models 1)" in out


def test_explain_out_of_core_prints_the_batchs_tile_plan(store, capsys):
    """Under --memory-budget the sweep's --explain printed K and the batches, not the tiles K configurations share;
    the features are one array (the plan listed them K times wide), and the traffic is said to be measured."""
    from trellis.data.store import GraphStore

    g = GraphStore(store)
    rc, out, _ = run(capsys, "sweep", store, "--grid", "hidden=8,16", "dropout=0,0.5", "--memory-budget", "2G",
                     "--set", "feature_norm=row", "--explain")  # row-normalized: the features are spilled once
    assert rc == 0 and "plan of batch 0:" in out and "out-of-core plan: budget" in out and "row tiles" in out
    assert f"x              [{g.num_nodes} x {g.num_features}]" in out
    assert "spill traffic measured, not priced, for 4 configurations together" in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--grid"], "expected at least one argument"),
    ([], "--grid is empty"),
    (["--grid", "lr=0.1", "hiden=8"], "unknown hyperparameter 'hiden'; did you mean 'hidden'"),
    (["--grid", "lr=fast"], "lr value 'fast' is not a number"),
    (["--grid", "hidden=8,big"], "hidden value 'big' is not an integer"),
    (["--grid", "model=gcn,sage"], "different model families cannot share a batch"),
    (["--grid", "dropout=0.5,1.5"], "--dropout must be in [0, 1)"),
    (["--grid", "lr=0.1", "--batch-models", "0"], "--batch-models must be a positive integer"),
    (["--grid", "lr=0.1", "--batch-models", "two"], "--batch-models must be an integer"),
    (["--grid", "lr=0.1", "--epochs", "0"], "--epochs must be an integer >= 1"),
    (["--grid", "lr=0.1", "--set", "lr=0.2"], "--set lr and --grid lr"),
    (["--grid", "lr=0.1", "--set", "layers"], "expected KEY=VALUE"),
    # accepted and ignored (a tune with --set explain=true ran whole)
    (["--grid", "lr=0.1", "--set", "explain=true"], "--set explain: not an option of a configuration"),
    (["--grid", "lr=0.1", "--model", "gat", "--batch-models", "2"], "cannot be model-batched"),
    (["--grid", "lr=0.1", "--model", "nosuch"], "--model 'nosuch' is not one of"),
    (["--grid", "lr=0.1,0.2", "--memory-budget", "abc"], "error: --memory-budget: cannot read the size 'abc'"),
    (["--grid", "lr=0.1", "--set", "epochs=0"], "--set epochs: set by the sweep itself"),
])
def test_bad_input_is_one_line_and_exit_2(store, tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    rc, _, err = run(capsys, "sweep", store, *argv, "--out", out, "--no-progress")
    assert rc == 2
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_store_is_a_user_error(tmp_path, capsys):
    rc, _, err = run(capsys, "sweep", tmp_path / "nostore", "--grid", "lr=0.1", "--out", tmp_path / "o")
    assert rc == 2 and "not a Trellis store" in err


def test_overwrite_refuses_a_directory_that_is_not_a_sweep_and_deletes_nothing(store, tmp_path, capsys):
    out = tmp_path / "mydata"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    rc, _, err = run(capsys, "sweep", store, "--grid", "lr=0.05", "--epochs", "1", "--out", out, "--overwrite",
                     "--no-progress")
    assert rc == 2 and "--out" in err and "not a sweep directory" in err and "Traceback" not in err
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydata"]  # no temporary directory left either


def test_overwrite_replaces_a_previous_sweep(store, tmp_path, capsys):
    out = tmp_path / "sw"
    argv = ["sweep", store, "--grid", "hidden=8", "--epochs", "1", "--out", out, "--no-progress"]
    assert run(capsys, *argv)[0] == 0
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and "already exists" in err
    (out / "stale.txt").write_text("from the old sweep")
    assert run(capsys, *argv, "--overwrite")[0] == 0
    assert (out / "sweep.json").is_file() and not (out / "stale.txt").exists()


def test_memory_budget_is_every_configurations_budget(store):
    """``--memory-budget`` means what it means to ``trellis train``: one flag, one meaning in every command."""
    from trellis.cli.main import build_parser
    from trellis.cli.sweep import config_from_args

    args = build_parser().parse_args(["sweep", store, "--grid", "lr=0.1", "--memory-budget", "3G"])
    assert config_from_args(args).base == {"memory_budget": "3G"}
    args = build_parser().parse_args(["sweep", store, "--grid", "lr=0.1", "--memory-budget", "3G", "--set",
                                      "memory_budget=2G"])
    with pytest.raises(TrellisUserError, match="name the same option; give it once"):
        config_from_args(args)


@pytest.mark.parametrize(("flag", "needle"), [("lots", "cannot read the size"), ("0", "--memory-budget")])
def test_bad_memory_budget_is_a_user_error(store, tmp_path, capsys, flag, needle):
    rc, _, err = run(capsys, "sweep", store, "--grid", "lr=0.1", "--memory-budget", flag, "--out", tmp_path / "o")
    assert rc == 2 and needle in err and "--memory-budget" in err
    assert not (tmp_path / "o").exists()


def test_the_help_lists_every_sweepable_and_tunable_key():
    """The epilogs are text (the CLI modules do not import torch for a help screen): they must name GRID_KEYS."""
    from trellis.cli import sweep as sweep_cli
    from trellis.cli import tune as tune_cli
    from trellis.train.sweep import GRID_KEYS

    listed = set()
    for text in (sweep_cli._EPILOG, tune_cli._EPILOG):
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(("sweepable hyperparameters:", "tunable:")))
        listed.add(lines[at + 1].replace(" ", ""))
    assert listed == {",".join(GRID_KEYS)}


def test_help_descriptions_carry_no_markup():
    from trellis.cli.main import build_parser

    for name in ("sweep", "tune", "preprocess", "bench", "compare"):
        parser = build_parser([name])
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
        assert "``" not in sub.description and ":mod:" not in sub.description and ":data:" not in sub.description
