"""``trellis preprocess`` and ``trellis train --strategy pp``: success paths, reuse, and bad input → exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from trellis.cli.main import main
from trellis.data.store import open_store, write_store


def make_store(path: Path, seed: int = 0, n: int = 240) -> Path:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    # homophilous graph: 80% of edges inside a class, so propagation helps
    order = np.argsort(y, kind="stable")
    start = np.searchsorted(y[order], np.arange(3))
    size = np.bincount(y, minlength=3)
    src = rng.integers(0, n, 5 * n)
    c = y[src]
    same = order[start[c] + (rng.random(5 * n) * size[c]).astype(np.int64)]
    dst = np.where(rng.random(5 * n) < 0.8, same, rng.integers(0, n, 5 * n))
    a = sp.csr_matrix((np.ones(src.shape[0]), (dst, src)), shape=(n, n))
    a = ((a + a.T) > 0).astype(np.float32).tocsr()
    x = (rng.standard_normal((n, 8)) + np.eye(3)[y] @ rng.standard_normal((3, 8))).astype(np.float32)
    perm = rng.permutation(n)
    return write_store(path, indptr=a.indptr, indices=a.indices, x=x, y=y,
                       splits={"train": perm[:120], "val": perm[120:180], "test": perm[180:]})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("cli") / "store")


@pytest.fixture(scope="module")
def pp_dir(store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clipp") / "pp"
    assert main(["preprocess", str(store), "--hops", "2", "--out", str(out), "--no-progress"]) == 0
    return out


def test_preprocess_then_reuse(store, pp_dir, capsys) -> None:
    assert main(["preprocess", str(store), "--hops", "2", "--out", str(pp_dir), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["action"] == "reused" and res["rows"] == 240 and res["settings"]["hops"] == 2


def test_preprocess_operators_and_progress(store, tmp_path, capsys) -> None:
    for op in ("rw", "ppr", "heat"):
        out = tmp_path / op
        assert main(["preprocess", str(store), "--operator", op, "--hops", "1", "--out", str(out),
                     "--iters", "3", "--block-rows", "50", "--split-rows-only"]) == 0
        captured = capsys.readouterr()
        # no progress bar: stderr is not a terminal here (a log file would get one line per update)
        assert "built" in captured.out and "block" not in captured.err


def test_train_pp_end_to_end(store, pp_dir, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    rc = main(["train", str(store), "--strategy", "pp", "--pp-dir", str(pp_dir), "--model", "sign", "--hidden", "16",
               "--epochs", "30", "--batch-size", "32", "--runs", "2", "--out", str(run), "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "placement: memory" in captured.err
    # the one summary schema of every strategy: runs is a count, per_run the runs' records
    assert summary["runs"] == 2 and len(summary["per_run"]) == 2 and summary["test_acc_mean"] > 0.5
    assert summary["peak_rss_anon_mb"] > 0 and summary["epoch_time_s_median"] > 0
    assert {p.name for p in run.iterdir()} >= {"config.json", "metrics.jsonl", "summary.json"}
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == sum(summary["epochs_run"])
    # predict: every node, from the best-validation run's weights, scoring the test nodes as training did
    pred = tmp_path / "pred.npy"
    assert main(["predict", str(run), str(store), "--out", str(pred)]) == 0
    p = np.load(pred)
    st = open_store(store)
    test = np.asarray(st.split("test"))
    assert p.shape == (st.num_nodes,)
    best = summary["per_run"][summary["best_run"]]
    assert np.mean(p[test] == np.asarray(st.y)[test]) == pytest.approx(best["test_acc"], abs=1e-9)


def test_predict_refuses_a_split_rows_only_cache(store, tmp_path, capsys) -> None:
    pp = tmp_path / "pp-split"
    assert main(["preprocess", str(store), "--hops", "1", "--out", str(pp), "--split-rows-only", "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", str(store), "--strategy", "pp", "--pp-dir", str(pp), "--model", "sgc", "--epochs", "2",
                 "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["predict", str(run), str(store), "--out", str(tmp_path / "p.npy")]) == 2
    assert "--all-rows" in capsys.readouterr().err and not (tmp_path / "p.npy").exists()


@pytest.mark.parametrize("model,loader", [("sgc", "storage"), ("hoga", "chunk")])
def test_train_pp_models_and_loaders(store, pp_dir, model, loader, tmp_path, capsys) -> None:
    width = ["--hidden", "16"] if model != "sgc" else []  # sgc has no hidden layer (it refuses --hidden)
    rc = main(["train", str(store), "--strategy", "pp", "--pp-dir", str(pp_dir), "--model", model, *width,
               "--epochs", "3", "--batch-size", "32", "--chunk-size", "8", "--pp-loader", loader, "--json",
               "--out", str(tmp_path / "run")])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["placement"]["loader"] == loader


def err_of(capsys) -> str:
    return capsys.readouterr().err


def test_bad_hops(store, tmp_path, capsys) -> None:
    assert main(["preprocess", str(store), "--hops", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--hops 0 must be >= 1" in err_of(capsys)
    assert not (tmp_path / "x").exists()


def test_unknown_operator(store, tmp_path, capsys) -> None:
    assert main(["preprocess", str(store), "--operator", "laplace", "--out", str(tmp_path / "x")]) == 2
    assert "invalid choice: 'laplace'" in err_of(capsys)


def test_pp_dir_from_other_settings_refused(store, pp_dir, capsys) -> None:
    assert main(["preprocess", str(store), "--hops", "3", "--out", str(pp_dir)]) == 2
    err = err_of(capsys)
    assert "other settings (hops: 2 there vs 3 asked)" in err and "--overwrite" in err


def test_pp_dir_from_other_store_refused(pp_dir, tmp_path, capsys) -> None:
    other = make_store(tmp_path / "other", seed=1)
    assert main(["preprocess", str(other), "--hops", "2", "--out", str(pp_dir)]) == 2
    assert "another store" in err_of(capsys)
    assert main(["train", str(other), "--strategy", "pp", "--pp-dir", str(pp_dir), "--epochs", "1",
                 "--out", str(tmp_path / "run")]) == 2
    assert "preprocessed from another store" in err_of(capsys)
    assert not (tmp_path / "run").exists()


def test_budget_too_small_for_one_batch(store, pp_dir, capsys) -> None:
    assert main(["train", str(store), "--strategy", "pp", "--pp-dir", str(pp_dir), "--memory-budget", "4KiB",
                 "--epochs", "1"]) == 2
    err = err_of(capsys)
    assert "too small for one batch" in err and "--batch-size" in err
    assert main(["train", str(store), "--strategy", "pp", "--pp-dir", str(pp_dir), "--memory-budget", "lots"]) == 2
    assert "cannot read the size" in err_of(capsys)


def test_missing_or_incomplete_pp_dir(store, tmp_path, capsys) -> None:
    assert main(["train", str(store), "--strategy", "pp", "--pp-dir", str(tmp_path / "nope")]) == 2
    assert "trellis preprocess" in err_of(capsys)
    assert main(["preprocess", str(tmp_path / "nostore"), "--out", str(tmp_path / "pp")]) == 2
    assert "not a Trellis store" in err_of(capsys)


def test_pp_model_needs_pp_strategy_and_dir(store, pp_dir, tmp_path, capsys) -> None:
    assert main(["train", str(store), "--model", "sign", "--out", str(tmp_path / "r")]) == 2
    assert "--strategy pp --pp-dir" in err_of(capsys)
    assert main(["train", str(store), "--strategy", "pp", "--model", "gcn", "--pp-dir", str(pp_dir)]) == 2
    assert "--strategy pp trains sgc, sign, hoga" in err_of(capsys)
    assert main(["train", str(store), "--strategy", "pp", "--model", "sgc"]) == 2
    assert "needs --pp-dir" in err_of(capsys)
    assert main(["train", str(store), "--strategy", "pp", "--pp-dir", str(pp_dir), "--features", "degree"]) == 2
    assert "does not apply to --strategy pp" in err_of(capsys)
    assert not (tmp_path / "r").exists()


def test_train_pp_explain(store, pp_dir, capsys) -> None:
    assert main(["train", str(store), "--strategy", "pp", "--model", "sign", "--pp-dir", str(pp_dir),
                 "--explain", "--memory-budget", "1G"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "placement: memory" in out


@pytest.mark.parametrize("args,message", [
    (["--operator", "heat", "--t", "inf"], "--t inf must be a finite number > 0"),  # built an all-NaN cache
    (["--shuffle-seed", "-1"], "--shuffle-seed -1 must be an integer >= 0"),  # a ValueError traceback
    (["--block-rows", "0"], "--block-rows 0 must be >= 1"),  # read as "not given"
])
def test_bad_preprocess_values_are_one_line(store, tmp_path, capsys, args, message) -> None:
    assert main(["preprocess", str(store), *args, "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert message in err_of(capsys) and not (tmp_path / "x").exists()


def test_bad_preprocess_values_from_python(store, tmp_path) -> None:
    from trellis.errors import TrellisUserError
    from trellis.loader.ppcache import preprocess

    for kw, message in (({"hops": 2.5}, "--hops 2.5 must be an integer"), ({"shuffle_seed": -1}, "--shuffle-seed")):
        with pytest.raises(TrellisUserError, match=message):
            preprocess(str(store), tmp_path / "y", **kw)
