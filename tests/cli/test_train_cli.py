from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.train.stubmodel import make_sbm_store, stub_build
from trellis.cli.main import main

pytestmark = pytest.mark.usefixtures("stub_model")  # one torch thread; the stub is passed as model_factory


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(make_sbm_store(tmp_path_factory.mktemp("cli") / "sbm"))


def run(capsys, *argv, real: bool = False):
    """``trellis ARGV`` in process: the stub model unless ``real`` (trellis.nn's models)."""
    rc = main(list(argv), model_factory=None if real else stub_build)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(("argv", "needle"), [
    (["train"], "STORE is required"),
    (["train", "{store}", "--hidden", "abc"], "--hidden must be an integer"),
    (["train", "{store}", "--hidden", "0"], "--hidden must be an integer >= 1"),
    (["train", "{store}", "--lr", "-1"], "--lr must be a positive"),
    (["train", "{store}", "--model", "gcnn"], "did you mean 'gcn'"),
    (["train", "{store}", "--optimizer", "rmsprop"], "--optimizer 'rmsprop' is not one of"),
    (["train", "{store}", "--device", "tpu"], "--device must be"),
    (["train", "{store}", "--bogus"], "unrecognized argument --bogus"),
    (["train", "{store}", "--set", "lr"], "expected KEY=VALUE"),
    (["train", "{store}", "--set", "lrr=0.1"], "did you mean 'lr'"),
    (["train", "{store}", "--config", "/nonexistent.json"], "no such file"),
    (["train", "/nonexistent/store", "--out", "{tmp}/r"], "not a Trellis store"),
    (["train", "{store}", "--model-args", "{{bad"], "--model-args must be a JSON object"),
    (["predict", "{tmp}", "{store}", "--out", "{tmp}/p.npy"], "not a run directory"),
    (["predict", "{tmp}", "{store}", "--out", "{tmp}/p.npy", "--run", "-1"], "run number >= 0"),
])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, store, argv, needle):
    argv = [a.format(store=store, tmp=tmp_path) for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_json_last_line_and_run_dir(capsys, tmp_path, store):
    rc, out, err = run(capsys, "train", store, "--out", str(tmp_path / "run"), "--epochs", "5", "--runs", "2",
                       "--json", "--no-progress", "--set", "lr=0.02", "hidden=8")
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    for key in ("test_acc", "test_acc_mean", "test_acc_std", "val_acc_mean", "epoch_time_s_median", "peak_rss_mb",
                "peak_rss_anon_mb"):
        assert key in summary
    assert len(summary["test_acc"]) == 2
    assert summary["config"]["lr"] == 0.02 and summary["config"]["hidden"] == 8
    assert "test acc" in err  # the human summary goes to stderr with --json


def test_human_output_without_json(capsys, tmp_path, store):
    rc, out, err = run(capsys, "train", store, "--out", str(tmp_path / "run"), "--epochs", "3", "--no-progress")
    assert rc == 0
    assert out.startswith("test acc") and "run directory" in out


def test_precedence_config_then_flags_then_set(capsys, tmp_path, store):
    (tmp_path / "c.json").write_text(json.dumps({"store": store, "epochs": 4, "lr": 0.5, "hidden": 4}))
    rc, out, err = run(capsys, "train", "--config", str(tmp_path / "c.json"), "--lr", "0.02", "--hidden", "6",
                       "--set", "hidden=7", "--out", str(tmp_path / "run"), "--json", "--no-progress")
    assert rc == 0, err
    cfg = json.loads(out.strip().splitlines()[-1])["config"]
    assert (cfg["epochs"], cfg["lr"], cfg["hidden"]) == (4, 0.02, 7)
    # A run's config.json repeats the run.
    rc, out2, err = run(capsys, "train", "--config", str(tmp_path / "run" / "config.json"), "--out",
                        str(tmp_path / "again"), "--json", "--no-progress")
    assert rc == 0, err
    a, b = json.loads(out.strip().splitlines()[-1]), json.loads(out2.strip().splitlines()[-1])
    assert a["test_acc"] == b["test_acc"]


def test_resume_refuses_changed_options(capsys, tmp_path, store):
    assert run(capsys, "train", store, "--out", str(tmp_path / "run"), "--epochs", "2", "--no-progress")[0] == 0
    rc, out, err = run(capsys, "train", "--resume", str(tmp_path / "run"), "--lr", "0.1")
    assert rc == 2 and "--lr cannot change when resuming" in err
    rc, out, err = run(capsys, "train", "--resume", str(tmp_path / "run"), "--json")
    assert rc == 0 and "already complete" in err
    assert json.loads(out.strip().splitlines()[-1])["status"] == "complete"


def test_explain(capsys, store):
    rc, out, err = run(capsys, "train", store, "--explain")
    assert rc == 0 and out.startswith("stub plan")


def test_predict(capsys, tmp_path, store):
    assert run(capsys, "train", store, "--out", str(tmp_path / "run"), "--epochs", "5", "--runs", "2",
               "--no-progress")[0] == 0
    rc, out, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "pred.npy"),
                       "--json")
    assert rc == 0, err
    info = json.loads(out.strip().splitlines()[-1])
    pred = np.load(tmp_path / "pred.npy")
    emb = np.load(tmp_path / "pred_emb.npy")
    assert pred.shape == (300,) and pred.dtype == np.int64 and emb.shape == (300, 16)
    assert info["embedding_source"] == "penultimate"
    rc, out, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "p.npy"), "--proba",
                       "--run", "1")
    assert rc == 0
    prob = np.load(tmp_path / "p.npy")
    assert prob.shape == (300, 3) and np.allclose(prob.sum(1), 1, atol=1e-5)
    rc, out, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "p.txt"))
    assert rc == 2 and "must end in .npy" in err
    rc, out, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "p.npy"),
                       "--run", "5")
    assert rc == 2 and "does not exist" in err
    before = (tmp_path / "p.npy").read_bytes()
    rc, out, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "p.npy"))
    assert rc == 2 and "exists; choose another --out or pass --overwrite" in err
    assert (tmp_path / "p.npy").read_bytes() == before
    rc, out, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "p.npy"), "--overwrite")
    assert rc == 0 and np.load(tmp_path / "p.npy").shape == (300,)


def test_predict_defaults_to_the_store_the_run_trained_on(capsys, tmp_path, store):
    """STORE was required, though the run records its store: the usual prediction named it twice."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    assert run(capsys, "train", str(copy), "--out", str(tmp_path / "run"), "--epochs", "3", "--no-progress")[0] == 0
    rc, _, err = run(capsys, "predict", str(tmp_path / "run"), "--out", str(tmp_path / "a.npy"))
    assert rc == 0, err
    assert run(capsys, "predict", str(tmp_path / "run"), str(copy), "--out", str(tmp_path / "b.npy"))[0] == 0
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    rc, _, err = run(capsys, "predict", str(copy), str(tmp_path / "run"), "--out", str(tmp_path / "c.npy"))
    assert rc == 2 and "not a run directory (no config.json) (it is a Trellis store)" in err  # the order swapped
    shutil.rmtree(copy)
    rc, _, err = run(capsys, "predict", str(tmp_path / "run"), "--out", str(tmp_path / "c.npy"))
    assert rc == 2 and f"the store it trained on, {copy}, is gone; give the STORE" in err
    assert not (tmp_path / "c.npy").exists()


def test_help_lists_generated_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--weight-decay", "--feature-norm", "--json, --no-json", "--config", "--set", "--resume"):
        assert flag in out


def test_demo_small_with_real_models(capsys, tmp_path):
    rc, out, err = run(capsys, "demo", "--nodes", "3000", "--epochs", "30", "--keep", str(tmp_path / "d"), "--json",
                       real=True)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["nodes"] == 3000 and res["test_acc"] > 0.5  # 8 classes: chance is 0.125
    assert (tmp_path / "d" / "run" / "summary.json").is_file()
    rc, out, err = run(capsys, "demo", "--keep", str(tmp_path / "d"))
    assert rc == 2 and "not empty" in err


def test_explain_with_real_gcn(capsys, store):
    rc, out, err = run(capsys, "train", store, "--model", "gcn", "--explain", real=True)
    assert rc == 0 and "spmm" in out
    # planner v2: training step and evaluation pass, with the rewrites and the cost estimates
    assert "training step, 1 configuration(s)" in out and "evaluation pass" in out
    assert "share_constant_aggregation" in out and "est. peak" in out
    rc, out, err = run(capsys, "train", store, "--model", "gat", "--explain", real=True)
    assert rc == 0 and ("sddmm" in out.lower() or "softmax" in out.lower())


def test_config_records_the_store_absolute(capsys, tmp_path, store, monkeypatch):
    """`--resume RUN_DIR` from another directory must find the store: config.json holds its absolute path."""
    monkeypatch.chdir(Path(store).parent)
    rc, _, err = run(capsys, "train", Path(store).name, "--out", str(tmp_path / "r"), "--epochs", "2", "--no-progress")
    assert rc == 0, err
    recorded = json.loads((tmp_path / "r" / "config.json").read_text())["store"]
    assert Path(recorded).is_absolute() and Path(recorded) == Path(store).resolve()


@pytest.mark.parametrize("argv, message", [
    (["train", "STORE", "--hiden", "8"], "trellis train: unrecognized argument --hiden; did you mean --hidden? "
                                          "(see `trellis train --help`)"),
    (["partition", "STORE", "--parts", "2", "--metod", "grem"], "did you mean --method? (see `trellis partition"),
    # sweep and tune take training options through --set: `--strategy pp` was only "unrecognized"
    (["sweep", "STORE", "--strategy", "pp", "--grid", "lr=0.1"],
     "trellis sweep: --strategy is a `trellis train` option; pass it as --set strategy=pp"),
    (["tune", "STORE", "--pp-dir=cache"], "--pp-dir is a `trellis train` option; pass it as --set pp_dir=cache"),
    (["sweep", "STORE", "--stratgy", "pp"], "unrecognized argument --stratgy; training options go through --set: "
                                            "did you mean --set strategy=pp?"),
    # an invocation's own flag is no configuration's: `--set explain=VALUE` was advised, and ignored
    (["tune", "STORE", "--explain"], "trellis tune: unrecognized argument --explain (see `trellis tune --help`)"),
])
def test_unknown_flags_get_a_did_you_mean(capsys, store, argv, message):
    rc, _, err = run(capsys, *[store if a == "STORE" else a for a in argv])
    assert rc == 2 and message in err


def test_a_starved_trainer_is_told_about_samplers(capsys, tmp_path, store):
    from trellis.cli.train import STARVED_SHARE, format_summary

    rc, out, _ = run(capsys, "train", store, "--strategy", "mini", "--model", "sage", "--hidden", "8", "--out",
                     str(tmp_path / "run"), "--epochs", "2", "--json", "--no-progress", real=True)
    assert rc == 0
    s = json.loads(out.strip().splitlines()[-1])
    assert 0.0 <= s["batch_wait_share"] <= 1.0  # measured by the mini-batch strategy, median over epochs
    starved = {**s, "batch_wait_share": STARVED_SHARE + 0.1, "threads": 16}
    assert "--samplers K" in format_summary(starved)
    for fed in ({**starved, "batch_wait_share": STARVED_SHARE - 0.1},  # the loader keeps up
                {**starved, "threads": 2},  # no cores to spare for sampler processes
                {**starved, "config": {**s["config"], "samplers": 2}}):  # already there
        assert "--samplers" not in format_summary(fed)
    # one run has no spread: "± 0.0000 over 1 run(s)" read as a measured zero
    first = format_summary(s).splitlines()[0]
    assert first.startswith(f"test acc {s['test_acc_mean']:.4f} (one run, seed 0); val acc") and "±" not in first
    three = format_summary({**s, "seeds": [0, 1, 2], "test_acc_std": 0.0123}).splitlines()[0]
    assert "± 0.0123 over 3 runs (seeds 0..2)" in three


def test_omp_num_threads_holds_for_the_whole_run(sbm_store, tmp_path):
    """OMP_NUM_THREADS=1: torch and the numba kernels train on one thread (numba's OpenMP start, at the first
    dropout kernel, reset torch's shared count to every core, and the summary recorded it)."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    env.pop("NUMBA_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-m", "trellis.cli", "train", str(sbm_store), "--epochs", "1", "--hidden",
                           "8", "--dropout", "0.5", "--out", str(tmp_path / "run"), "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["threads"] == 1


def test_an_out_the_file_system_refuses_is_one_line(tmp_path, capsys):
    """--out under a regular file (or an unwritable or full file system): one line naming the path, exit 2."""
    store = make_sbm_store(tmp_path / "s", n=60)
    (tmp_path / "afile").write_text("x")
    rc = main(["train", str(store), "--epochs", "1", "--out", str(tmp_path / "afile" / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "afile" in err and len(err.strip().splitlines()) == 1


def test_a_full_disk_while_predicting_is_one_line_and_leaves_no_half_pair(capsys, tmp_path, store, monkeypatch):
    """numpy's short write (OSError without an errno) was a traceback, and predict left the predictions without
    their embeddings (a re-run then refused: the file exists)."""
    from trellis.train import predict as predict_mod

    assert run(capsys, "train", store, "--out", str(tmp_path / "run"), "--epochs", "2", "--no-progress")[0] == 0
    save = predict_mod._save_npy_atomic

    def fill_up(path, array):
        if path.name == "p.npy":
            raise OSError("43328 requested and 19424 written")
        save(path, array)

    monkeypatch.setattr(predict_mod, "_save_npy_atomic", fill_up)
    rc, _, err = run(capsys, "predict", str(tmp_path / "run"), store, "--out", str(tmp_path / "p.npy"))
    assert rc == 2 and "the file system is full" in err and "Traceback" not in err
    assert not (tmp_path / "p.npy").exists() and not (tmp_path / "p_emb.npy").exists()
