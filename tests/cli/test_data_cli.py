from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trellis.cli.main import main
from trellis.data.store import open_store


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in err, err


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_import_planetoid_and_info(capsys, dataset, tmp_path):
    out = tmp_path / "cora"
    rc, stdout, err = run(capsys, "data", "import", str(dataset("cora")), "--format", "planetoid", "--out", str(out))
    assert rc == 0, err
    assert "2,708 nodes, 10,556 edges, 1433 features, 7 classes; train 140 / val 500 / test 1000" in stdout
    rc, stdout, _ = run(capsys, "data", "info", str(out))
    assert rc == 0 and "2,708" in stdout and "in-degree" in stdout and "symmetric" in stdout
    rc, stdout, _ = run(capsys, "data", "info", str(out), "--json", "--verify")
    info = json.loads(stdout)
    assert rc == 0 and info["num_edges"] == 10556 and info["verified"] and info["splits"]["val"] == 500


def test_import_npz_json_with_seed(capsys, dataset, tmp_path):
    out = tmp_path / "am"
    rc, stdout, err = run(capsys, "data", "import", str(dataset("amazon-computers")), "--out", str(out),
                          "--split-seed", "1", "--json")
    assert rc == 0, err
    summary = json.loads(stdout)
    assert (summary["num_nodes"], summary["num_edges"]) == (13381, 491556)
    assert summary["splits"] == {"train": 200, "val": 300, "test": 12881}
    assert open_store(out).manifest["source"]["split_seed"] == 1


def test_import_edgelist_flags(capsys, tmp_path):
    src = tmp_path / "g"
    src.mkdir()
    (src / "edges.txt").write_text("0 1\n1 2\n2 0\n")
    rc, stdout, err = run(capsys, "data", "import", str(src), "--out", str(tmp_path / "d"), "--no-symmetrize",
                          "--num-nodes", "4", "--streaming", "--chunk-edges", "1")
    assert rc == 0, err
    s = open_store(tmp_path / "d")
    assert s.num_nodes == 4 and s.num_edges == 3 and s.manifest["source"]["streaming"]


def test_generate_and_info(capsys, tmp_path):
    out = tmp_path / "sbm"
    rc, stdout, err = run(capsys, "data", "generate", "sbm", "--nodes", "400", "--avg-degree", "6", "--features",
                          "8", "--classes", "3", "--seed", "5", "--homophily", "0.9", "--out", str(out), "--json")
    assert rc == 0, err
    summary = json.loads(stdout)
    assert summary["num_nodes"] == 400 and summary["num_classes"] == 3 and summary["splits"]["train"] == 40
    rc, _, err = run(capsys, "data", "generate", "rmat", "--nodes", "256", "--out", str(tmp_path / "r"),
                     "--avg-degree", "4", "--a", "0.6")
    assert rc == 0, err
    assert open_store(tmp_path / "r").manifest["source"]["a"] == 0.6


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["data", "import", "{tmp}/nope", "--out", "{out}"], ["nope: not found"]),
        (["data", "import", "{tmp}", "--out", "{out}", "--format", "graphml"], ["invalid choice: 'graphml'"]),
        (["data", "import", "{tmp}/empty", "--out", "{out}"], ["cannot tell the format", "--format"]),
        (["data", "import", "{tmp}/edges.txt", "--out", "{out}"], ["edges.txt: line 2: 'a' is not an integer"]),
        (["data", "import", "{tmp}/empty", "--format", "planetoid", "--out", "{out}"], ["no Planetoid files"]),
        (["data", "generate", "sbm", "--nodes", "10", "--avg-degree", "50", "--out", "{out}"], ["too dense"]),
        (["data", "generate", "rmat", "--nodes", "100", "--homophily", "0.5", "--out", "{out}"],
         ["--homophily applies to sbm only"]),
        (["data", "generate", "sbm", "--nodes", "-5", "--out", "{out}"], ["-5 must be > 0"]),
        (["data", "generate", "sbm", "--nodes", "50", "--avg-degree", "2", "--edge-features", "-2", "--out", "{out}"],
         ["--edge-features must be >= 0"]),
        (["data", "generate", "sbm", "--nodes", "50", "--node-features", "none", "--out", "{out}"],
         ["--node-features", "invalid choice: 'none'"]),
        (["data", "info", "{tmp}"], ["not a Trellis store"]),
        (["data"], ["required"]),
    ],
)
def test_user_errors_exit_2_and_write_nothing(capsys, tmp_path, argv, fragments):
    (tmp_path / "edges.txt").write_text("0 1\na b\n")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    argv = [a.format(tmp=tmp_path, out=out) for a in argv]
    rc, _, err = run(capsys, *argv)
    assert_user_error(rc, err, *fragments)
    assert_nothing_written(out)


def test_bad_arrays_exit_2(capsys, tmp_path):
    src = tmp_path / "g"
    src.mkdir()
    np.save(src / "edges.npy", np.array([[0, 1], [1, 2]]))
    np.save(src / "features.npy", np.array([[0.0], [np.inf], [1.0]]))
    out = tmp_path / "out"
    rc, _, err = run(capsys, "data", "import", str(src), "--out", str(out))
    assert_user_error(rc, err, "features.npy", "row 1 contains NaN or Inf")
    assert_nothing_written(out)
    np.save(src / "features.npy", np.ones((3, 1)))
    np.save(src / "train.npy", np.array([0, 3]))
    rc, _, err = run(capsys, "data", "import", str(src), "--out", str(out))
    assert_user_error(rc, err, "train.npy", "row 1 has node id 3 but the graph has 3 nodes")
    assert_nothing_written(out)


def test_generate_edge_features_and_bad_edge_feature_files(capsys, tmp_path):
    out = tmp_path / "e"
    rc, stdout, err = run(capsys, "data", "generate", "sbm", "--nodes", "300", "--avg-degree", "4", "--features",
                          "4", "--edge-features", "5", "--edge-feature-noise", "0.5", "--node-features", "noise",
                          "--out", str(out))
    assert rc == 0, err
    s = open_store(out)
    assert s.edge_feat.shape == (s.num_edges, 5)
    assert s.manifest["source"]["edge_feature_noise"] == 0.5 and s.manifest["source"]["node_features"] == "noise"
    rc, stdout, _ = run(capsys, "data", "info", str(out))
    assert "features (5)" in stdout
    src = tmp_path / "g"
    src.mkdir()
    (src / "edges.txt").write_text("0 1\n1 2\n2 0\n")
    bad = tmp_path / "bad"
    np.save(src / "edge_features.npy", np.ones((2, 3)))
    rc, _, err = run(capsys, "data", "import", str(src), "--out", str(bad))
    assert_user_error(rc, err, "edge_features.npy", "has 2 rows", "has 3 edges")
    assert_nothing_written(bad)
    np.save(src / "edge_features.npy", np.array([[0.0], [1.0], [np.nan]]))
    rc, _, err = run(capsys, "data", "import", str(src), "--out", str(bad))
    assert_user_error(rc, err, "edge_features.npy", "row 2 contains NaN or Inf")
    assert_nothing_written(bad)


def test_existing_output_needs_overwrite(capsys, tmp_path):
    args = ["data", "generate", "sbm", "--nodes", "50", "--avg-degree", "2", "--out", str(tmp_path / "s")]
    assert run(capsys, *args)[0] == 0
    rc, _, err = run(capsys, *args)
    assert_user_error(rc, err, "already exists", "--overwrite")
    rc, _, err = run(capsys, *args, "--overwrite", "--seed", "1")
    assert rc == 0, err


def test_every_command_that_shows_progress_takes_no_progress(tmp_path, dataset, capsys):
    """A script passing --no-progress to every command was refused by `data generate`, `data import`,
    `partition` and `demo`, which had no such flag (train, sweep, tune and preprocess did)."""
    store = tmp_path / "g"
    assert main(["data", "generate", "sbm", "--nodes", "200", "--out", str(store), "--no-progress"]) == 0
    assert main(["data", "import", str(dataset("cora")), "--out", str(tmp_path / "cora"), "--no-progress"]) == 0
    assert main(["partition", str(store), "--parts", "2", "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    assert main(["preprocess", str(store), "--out", str(tmp_path / "pp"), "--hops", "1", "--no-progress"]) == 0
    for command in ("demo", "train", "sweep", "tune"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0 and "--no-progress" in capsys.readouterr().out, command
