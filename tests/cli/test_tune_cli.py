"""``trellis tune`` bad input: one line naming the key or flag, exit 2, nothing written."""

from __future__ import annotations

import json
import re

import pytest

from tests.train.stubmodel import make_sbm_store
from trellis.cli.main import main


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(make_sbm_store(tmp_path_factory.mktemp("tunecli") / "sbm", n=120, features=4))


@pytest.mark.parametrize(("space", "match"), [
    ({"lr": [0.01], "hiden": [8]}, "unknown hyperparameter 'hiden'; did you mean 'hidden'?"),
    ({"lr": {"uniform": [0.1, 0.1]}}, "lr: the range .* is empty"),
    ({"dropout": []}, "dropout is an empty list"),
])
def test_bad_space_files_exit_2_naming_the_key(store, tmp_path, capsys, space, match):
    f = tmp_path / "space.json"
    f.write_text(json.dumps(space))
    out = tmp_path / "t"
    rc = main(["tune", store, "--space", str(f), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err
    assert not out.exists()


@pytest.mark.parametrize(("argv", "match"), [
    (["--budget", "soon"], "--budget 'soon'"),
    (["--eta", "1"], "--eta must be an integer >= 2"),
    (["--candidates", "0"], "--candidates must be an integer >= 1"),
    (["--splits", "3"], "--splits 3: .* records neither a per-class split protocol"),
    (["--grid", "lr=0.1", "--set", "lr=0.2"], "--set lr: it is also in the search space"),
    (["--model", "mlp"], "no default search space"),
    (["--search", "grid"], "--search grid: .* is a range"),
    (["--space", "space.json", "--grid", "lr=0.1,0.2"], "--space space.json and --grid are two ways to give the space"),
])
def test_bad_flags_exit_2_with_nothing_written(store, tmp_path, capsys, argv, match):
    out = tmp_path / "t"
    rc = main(["tune", store, *argv, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err), err
    assert not out.exists()


def test_resume_needs_a_tune_dir(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["tune", "--resume", str(tmp_path / "x")]) == 2
    assert "not a tune directory" in capsys.readouterr().err


def test_out_must_not_be_someone_elses_directory(store, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["tune", store, "--grid", "lr=0.1", "--epochs", "2", "--out", str(out), "--overwrite"]) == 2
    assert (out / "notes.txt").read_text() == "keep"


def test_resume_refuses_other_settings(store, tmp_path, capsys):
    """A resumed tune continues with its saved settings: a STORE or a flag given beside --resume was ignored."""
    for argv, name in ((["--resume", str(tmp_path), store], "STORE"),
                       (["--resume", str(tmp_path), "--candidates", "3"], "--candidates")):
        assert main(["tune", *argv]) == 2
        assert f"{name} cannot be given with --resume" in capsys.readouterr().err
