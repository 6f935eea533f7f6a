"""``trellis.train`` / ``trellis.load_run`` / ``Run.predict``: the library front door (trellis/train/api.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trellis
from tests.train.helpers import summary_without_timing
from trellis.cli.main import main
from trellis.errors import TrellisUserError

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]


def test_train_returns_a_run_and_writes_nothing(sbm_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    options = {"epochs": 4, "hidden": 8, "lr": 0.01}
    seen_handlers = []
    from trellis.train import trainer as trainer_mod

    real = trainer_mod.Trainer._run

    def spy(self, *a, **k):  # the handlers while an epoch trains
        seen_handlers.append({s: signal.getsignal(s) for s in handlers})
        return real(self, *a, **k)

    monkeypatch.setattr(trainer_mod.Trainer, "_run", spy)
    run = trellis.train(sbm_store, model="gcn", **options)
    assert options == {"epochs": 4, "hidden": 8, "lr": 0.01}
    assert list(tmp_path.iterdir()) == []  # no runs/ directory
    assert seen_handlers == [handlers]
    assert run.run_dir is None and run.summary["run_dir"] is None
    assert len(run.history) == 4 and [r["epoch"] for r in run.history] == [0, 1, 2, 3]
    assert isinstance(run.model, torch.nn.Module) and len(run.models) == 1
    assert run.config.epochs == 4 and run.config.model == "gcn"
    assert 0.0 <= run.test_score() <= 1.0
    pred = run.predict()
    assert pred.shape == (500,) and pred.dtype == torch.int64
    proba = run.predict(proba=True)
    assert proba.shape == (500, 4) and torch.allclose(proba.sum(1), torch.ones(500), atol=1e-5)
    assert torch.equal(proba.argmax(1), pred)
    # the best-validation model's test accuracy, recomputed from its predictions
    y = torch.from_numpy(np.load(Path(sbm_store) / "y.npy"))
    test = torch.from_numpy(np.load(Path(sbm_store) / "test_idx.npy"))
    assert abs(float((pred[test] == y[test]).float().mean()) - run.test_score()) < 1e-6


def test_same_summary_as_the_cli(sbm_store, tmp_path):
    args = ["--epochs", "3", "--hidden", "8", "--seed", "2"]
    assert main(["train", str(sbm_store), *args, "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    run = trellis.train(sbm_store, epochs=3, hidden=8, seed=2, out=tmp_path / "api")
    assert run.run_dir == tmp_path / "api"
    assert summary_without_timing(tmp_path / "api") == summary_without_timing(tmp_path / "cli")
    cli_cfg = json.loads((tmp_path / "cli" / "config.json").read_text())
    api_cfg = json.loads((tmp_path / "api" / "config.json").read_text())
    assert {k: v for k, v in api_cfg.items() if k != "out"} == {k: v for k, v in cli_cfg.items() if k != "out"}
    # the CLI's predictions file equals Run.predict
    assert main(["predict", str(tmp_path / "cli"), str(sbm_store), "--out", str(tmp_path / "p.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "p.npy"), run.predict().numpy())
    again = trellis.load_run(tmp_path / "api")
    assert again.summary == run.summary and len(again.history) == 3
    assert torch.equal(again.predict(), run.predict())


def test_config_file_as_the_cli_s_config_flag(sbm_store, tmp_path):
    """docs/api.md: every `trellis train` flag by its field name; config= (--config) was refused as unknown."""
    assert main(["train", str(sbm_store), "--epochs", "3", "--hidden", "8", "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0
    saved = tmp_path / "cli" / "config.json"
    assert main(["train", str(sbm_store), "--config", str(saved), "--lr", "0.02", "--out", str(tmp_path / "cli2"),
                 "--no-progress"]) == 0
    run = trellis.train(sbm_store, config=saved, lr=0.02)  # the options given win, as flags do
    assert run.run_dir is None  # the file's out (the first run's directory) is not used
    assert run.config.hidden == 8 and run.config.lr == 0.02
    cli = [json.loads(line)["loss"] for line in (tmp_path / "cli2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in run.history] == cli
    (tmp_path / "bad.json").write_text('{"hiden": 8}')
    with pytest.raises(TrellisUserError, match=r"config=.*bad\.json: unknown option 'hiden'; did you mean 'hidden'"):
        trellis.train(sbm_store, config=tmp_path / "bad.json")


def test_errors_are_the_cli_messages_as_exceptions(sbm_store, tmp_path):
    with pytest.raises(TrellisUserError, match="--lr must be a positive"):
        trellis.train(sbm_store, lr=-1)
    with pytest.raises(TrellisUserError, match="unknown option|did you mean|not an option"):
        trellis.train(sbm_store, learning_rate=0.1)
    with pytest.raises(TrellisUserError, match="not a Trellis store"):
        trellis.train(tmp_path / "missing")
    with pytest.raises(TrellisUserError, match="cannot train on a int"):
        trellis.train(3)
    with pytest.raises(TrellisUserError, match="pass the graph as the first argument"):
        trellis.train(sbm_store, store=str(sbm_store))
    with pytest.raises(TrellisUserError, match="lambda"):
        trellis.train(sbm_store, model=lambda i, o: torch.nn.Linear(i, o))
    assert list(tmp_path.iterdir()) == []


class LinearProbe(torch.nn.Module):
    """A user's own model: a linear map of the target rows."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(in_dim, out_dim)

    def forward(self, graph, x, **_):
        n = graph.num_dst if hasattr(graph, "num_dst") else graph[-1].num_dst
        return self.lin(x[:n])


def test_a_model_builder_and_arrays(sbm_store):
    run = trellis.train(sbm_store, model=LinearProbe, epochs=3)
    assert run.config.model == "linearprobe" and isinstance(run.model, LinearProbe)
    # a PyG-style Data object (duck-typed) and a dict of arrays train the same graph
    ptr, idx = np.load(Path(sbm_store) / "indptr.npy"), np.load(Path(sbm_store) / "indices.npy")
    dst = np.repeat(np.arange(500), np.diff(ptr))
    x = np.load(Path(sbm_store) / "x.npy")
    y = np.load(Path(sbm_store) / "y.npy")
    splits = {k: np.load(Path(sbm_store) / f"{k}_idx.npy") for k in ("train", "val", "test")}

    class Data:
        edge_index = torch.from_numpy(np.stack([idx, dst]))
        num_nodes = 500

    d = Data()
    d.x, d.y = torch.from_numpy(x), torch.from_numpy(y)
    for k, v in splits.items():
        mask = torch.zeros(500, dtype=torch.bool)
        mask[v] = True
        setattr(d, f"{k}_mask", mask)
    a = trellis.train(d, epochs=3, hidden=8)
    b = trellis.train({"src": idx, "dst": dst, "x": x, "y": y, "splits": splits}, epochs=3, hidden=8)
    c = trellis.train(sbm_store, epochs=3, hidden=8)
    assert a.summary["num_edges"] == b.summary["num_edges"] == c.summary["num_edges"]
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    assert abs(a.history[-1]["loss"] - c.history[-1]["loss"]) < 1e-5
    assert a.predict().shape == (500,)


def test_a_data_object_s_splits(sbm_store):
    """[N, S] masks: split_seed=K trains on column K, as a Data holding that column alone does (only column 0 was
    kept, and split_seed=K was refused as "fixed"). A Data or dict without a split is named as such (not as the
    temporary store's missing val_idx.npy, with `trellis data import` advice); one to predict on needs none."""
    ptr, idx = np.load(Path(sbm_store) / "indptr.npy"), np.load(Path(sbm_store) / "indices.npy")
    dst = np.repeat(np.arange(500), np.diff(ptr))
    x, y = torch.from_numpy(np.load(Path(sbm_store) / "x.npy")), torch.from_numpy(np.load(Path(sbm_store) / "y.npy"))
    order = np.random.default_rng(0).permuted(np.tile(np.arange(500), (3, 1)), axis=1).T  # [500, 3]
    masks = {k: torch.from_numpy((order >= lo) & (order < hi)) for k, lo, hi in
             (("train", 0, 100), ("val", 100, 200), ("test", 200, 500))}

    def data(**kw):
        return type("Data", (), {"edge_index": torch.from_numpy(np.stack([idx, dst])), "num_nodes": 500,
                                 "x": x, "y": y, **kw})()

    multi = trellis.train(data(**{f"{k}_mask": m for k, m in masks.items()}), epochs=3, hidden=8, split_seed=2)
    alone = trellis.train(data(**{f"{k}_mask": m[:, 2] for k, m in masks.items()}), epochs=3, hidden=8)
    first = trellis.train(data(**{f"{k}_mask": m[:, 0] for k, m in masks.items()}), epochs=3, hidden=8)
    assert [r["loss"] for r in multi.history] == [r["loss"] for r in alone.history] != \
        [r["loss"] for r in first.history]
    with pytest.raises(TrellisUserError, match="--split-seed 3: .* holds 3 fixed splits; give a split number from 0"):
        trellis.train(data(**{f"{k}_mask": m for k, m in masks.items()}), epochs=1, split_seed=3)
    with pytest.raises(TrellisUserError, match="the Data has no val_mask: training needs train_mask, val_mask"):
        trellis.train(data(train_mask=masks["train"][:, 0], test_mask=masks["test"][:, 0]), epochs=1)
    with pytest.raises(TrellisUserError, match="it has no 'test' split"):
        trellis.train({"src": idx, "dst": dst, "x": x, "y": y, "splits": {"train": [0], "val": [1]}}, epochs=1)
    assert multi.predict(data()).shape == (500,)
    assert torch.equal(multi.predict({"src": idx, "dst": dst, "x": x}), multi.predict())
    # partition and preprocess write files that refer to their store on disk: a graph object is named, not a
    # TypeError from pathlib
    for call in (lambda: trellis.partition(data(), 2), lambda: trellis.preprocess(data(), Path(sbm_store) / "pp")):
        with pytest.raises(TrellisUserError, match=r"a store is a directory path, not a Data; .*from_pyg\(data, "):
            call()


def test_fresh_interpreter_needs_no_cli(sbm_store):
    code = ("import sys, trellis; run = trellis.train(sys.argv[1], epochs=2, hidden=8); "
            "assert not [m for m in sys.modules if m.startswith('trellis.cli')], 'cli imported'; "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported (1.8 s)'; "
            "print(run.history[-1]['epoch'])")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, str(sbm_store)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_partition_is_callable_like_the_cli(sbm_store, tmp_path, capsys):
    report, quality = trellis.partition(sbm_store, 4, out=tmp_path / "p4")
    assert (tmp_path / "p4" / "manifest.json").is_file()
    assert main(["partition", str(sbm_store), "--parts", "4", "--out", str(tmp_path / "c4"), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    skip = {"time_s", "layout_time_s", "out", "peak_rss_mb", "peak_rss_anon_mb"}
    assert {k: v for k, v in report.items() if k not in skip} == {k: v for k, v in cli.items() if k not in skip}
    assert "part" in quality.table()
    with pytest.raises(TrellisUserError, match="--parts must be at least 1"):
        trellis.partition(sbm_store, 0, out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    # the ranks' plan, as `trellis train --parts-dir --explain` prints it (it crashed in a world of one process)
    text = trellis.explain(sbm_store, model="gcn", parts_dir=str(tmp_path / "p4"), nproc=4)
    assert main(["train", str(sbm_store), "--parts-dir", str(tmp_path / "p4"), "--nproc", "4", "--explain"]) == 0
    assert text.startswith("distributed: 4 ranks") and capsys.readouterr().out.strip() == text.strip()


def test_sweep_tune_and_preprocess_are_functions(sbm_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    board = trellis.sweep(sbm_store, {"lr": [0.01, 0.005], "hidden": [8, 16]}, epochs=3)
    assert len(board["rows"]) == 4 and {r["hidden"] for r in board["rows"]} == {8, 16}
    tuned = trellis.tune(sbm_store, space={"lr": [0.01, 0.02], "hidden": [8]}, epochs=4, seeds=1)
    assert tuned["best"]["params"]["hidden"] == 8 and len(tuned["final"]) == 1
    assert list(tmp_path.iterdir()) == []  # no sweeps/ or tunes/ directory unless out= is given
    result = trellis.preprocess(sbm_store, tmp_path / "pp", hops=2)
    assert result["action"] == "built" and (tmp_path / "pp").is_dir()
    assert trellis.preprocess(sbm_store, tmp_path / "pp", hops=2)["action"] == "reused"
    with pytest.raises(TrellisUserError, match="--hops 0 must be >= 1"):
        trellis.preprocess(sbm_store, tmp_path / "pp2", hops=0)


def test_resume_and_explain(sbm_store, tmp_path):
    from trellis.train.config import TrainConfig
    from trellis.train.trainer import Trainer, TrainingInterrupted

    def stop(trainer, record):
        if record["epoch"] == 1:
            trainer.request_stop()

    cfg = TrainConfig(store=str(sbm_store), epochs=4, hidden=8, out=str(tmp_path / "cut"), progress=False)
    with pytest.raises(TrainingInterrupted):
        Trainer(cfg, callbacks=[stop], handle_signals=False).fit()
    resumed = trellis.resume(tmp_path / "cut")
    whole = trellis.train(sbm_store, epochs=4, hidden=8)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history]
    assert trellis.resume(tmp_path / "cut").summary == resumed.summary  # a finished run is returned as it is
    text = trellis.explain(sbm_store, model="gcn", hidden=8)
    assert "spmm" in text.lower()


def test_run_predict_goes_the_way_trellis_predict_goes(sbm_store, tmp_path, monkeypatch):
    """``Run.predict`` predicts as ``trellis predict`` does: a budgeted run tiles, a store that does not fit refuses."""
    from trellis.data.generate import generate_sbm

    monkeypatch.chdir(tmp_path)
    run = trellis.train(sbm_store, epochs=2, hidden=8, memory_budget="2G")
    assert list(tmp_path.iterdir()) == []  # no runs/<name>/ left by the spill root
    got = run.predict(logits=True)
    saved = trellis.train(sbm_store, epochs=2, hidden=8, memory_budget="2G", out=tmp_path / "r")
    trellis.predict(tmp_path / "r", sbm_store, tmp_path / "p.npy", proba=True)
    assert np.allclose(torch.softmax(got, 1).numpy(), np.load(tmp_path / "p.npy"), atol=1e-6)
    assert torch.equal(saved.predict(logits=True), got)
    narrow = generate_sbm(tmp_path / "narrow", nodes=200, avg_degree=4, features=8, classes=4, seed=1,
                          progress=False)
    with pytest.raises(TrellisUserError, match="features have width 8"):
        trellis.train(sbm_store, epochs=1, hidden=8).predict(narrow)
    with pytest.raises(TrellisUserError, match="embedding table of 500"):
        trellis.train(sbm_store, epochs=1, hidden=8, features="embedding:4").predict(narrow)
    with pytest.raises(TrellisUserError, match="run=3"):
        run.predict(run=3)


def test_options_a_strategy_or_model_does_not_read_are_refused(sbm_store, tmp_path):
    with pytest.raises(TrellisUserError, match="--fanouts does not apply to --strategy full"):
        trellis.train(sbm_store, fanouts="5,5")
    with pytest.raises(TrellisUserError, match="--batch-size does not apply to --strategy full"):
        trellis.train(sbm_store, batch_size=64)
    with pytest.raises(TrellisUserError, match="--heads applies to attention models"):
        trellis.train(sbm_store, heads=4)
    with pytest.raises(TrellisUserError, match="gcn has no option 'bogus' .--model-args."):
        trellis.train(sbm_store, model_args={"bogus": 1})
    with pytest.raises(TrellisUserError, match="--model-args pre_norm: it is a flag of its own"):
        trellis.train(sbm_store, model_args={"pre_norm": True})
    trellis.preprocess(sbm_store, tmp_path / "pp", hops=2)
    pp = {"strategy": "pp", "pp_dir": str(tmp_path / "pp"), "model": "sign"}
    with pytest.raises(TrellisUserError, match="--split-seed does not apply to --strategy pp"):
        trellis.train(sbm_store, split_seed=1, **pp)
    with pytest.raises(TrellisUserError, match="--feature-norm l2 does not apply to --strategy pp"):
        trellis.train(sbm_store, feature_norm="l2", **pp)
    with pytest.raises(TrellisUserError, match="sign has no option 'hops'"):
        trellis.train(sbm_store, model_args={"hops": 5}, **pp)
    run = trellis.train(sbm_store, epochs=1, **pp)
    assert run.summary["feature_norm"] == json.loads((tmp_path / "pp" / "manifest.json").read_text())[
        "settings"]["feature_norm"]


def test_python_spellings_and_mistakes_get_the_cli_rules(sbm_store, tmp_path, capsys):
    from trellis.train.config import TrainConfig

    cfg = TrainConfig.from_dict({"store": str(sbm_store), "strategy": "mini", "fanouts": (5, 3)})
    assert cfg.fanouts == "5,3"
    assert TrainConfig.from_dict({"store": str(sbm_store), "memory_budget": 400_000_000}).memory_budget == "400000000"
    with pytest.raises(TrellisUserError, match=r"--fanouts \[1.5, 2\]: give integers"):
        trellis.MiniOptions(fanouts=[1.5, 2])
    with pytest.raises(TrellisUserError, match="strategy= takes a name"):
        trellis.train(sbm_store, strategy={"name": "mini"})
    for parts in ("2", 2.5):
        with pytest.raises(TrellisUserError, match="--parts must be an integer"):
            trellis.partition(sbm_store, parts)

    def returns_text(in_dim, out_dim):
        return "a model"

    def plain_linear(in_dim, out_dim):
        return torch.nn.Linear(in_dim, out_dim)

    with pytest.raises(TrellisUserError, match="returned a str"):
        trellis.train(sbm_store, model=returns_text)
    with pytest.raises(TrellisUserError, match=r"cannot be called as model\(graph, x\)"):
        trellis.train(sbm_store, model=plain_linear)
    with pytest.raises(TrellisUserError, match=r"space=: lr"):
        trellis.tune(sbm_store, space={"lr": "bad"})
    with pytest.raises(TrellisUserError, match="needs splits="):
        trellis.train({"src": np.array([0, 1]), "dst": np.array([1, 2]), "x": np.ones((3, 2), np.float32),
                       "y": np.array([0, 1, 0])})
    board = trellis.sweep(sbm_store, {"lr": "0.01,0.02"}, epochs=1, hidden=8)  # the CLI's string form
    assert sorted(r["lr"] for r in board["rows"]) == [0.01, 0.02]
    capsys.readouterr()
    run = trellis.train(sbm_store, epochs=1, hidden=8, memory_budget="2G")  # prints no banner
    assert capsys.readouterr() == ("", "") and run.summary["run_dir"] is None


def test_a_user_model_run_read_back_without_its_builder_says_what_to_register(sbm_store, tmp_path):
    trellis.train(sbm_store, epochs=1, model=LinearProbe, out=tmp_path / "r")
    code = ("import sys, trellis\ntry:\n    trellis.load_run(sys.argv[1])\nexcept trellis.TrellisUserError as e:\n"
            "    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert "register_model('linearprobe', builder)" in out.stdout, out.stderr
    for argv in (["train", "--resume", str(tmp_path / "r")],  # suggested --model gcn ("did you mean")
                 ["predict", str(tmp_path / "r"), str(sbm_store), "--out", str(tmp_path / "p.npy")]):
        cli = subprocess.run([sys.executable, "-m", "trellis.cli", *argv], capture_output=True, text=True, env=env,
                             timeout=300)
        assert cli.returncode == 2 and "the trellis command knows only the built-in models" in cli.stderr, cli.stderr
        assert "trellis.resume" in cli.stderr and "Traceback" not in cli.stderr


# ---- the caller's process: what a call leaves of it, and what of it changes a call --------------------------------
def test_a_call_leaves_the_caller_s_generators_threads_and_flags_as_they_were(sbm_store):
    """A loop that draws its own random split before every trellis.train gets a fresh one each time; the torch
    generator, the deterministic flag (deterministic=True is the run's) and the default dtype come back too."""
    import random

    np.random.seed(123)
    random.seed(7)
    torch.manual_seed(11)
    expect_np, expect_py, expect_torch = np.random.rand(), random.random(), torch.rand(1)
    np.random.seed(123)
    random.seed(7)
    torch.manual_seed(11)
    before = torch.get_num_threads()
    trellis.train(sbm_store, model="gcn", epochs=1, hidden=8, deterministic=True)
    assert (np.random.rand(), random.random()) == (expect_np, expect_py)
    assert torch.equal(torch.rand(1), expect_torch)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == before and torch.get_default_dtype() == torch.float32
    draws = []
    for _ in range(2):  # the helper's notebook loop: each repetition a new permutation
        draws.append(np.random.permutation(50)[:5].tolist())
        trellis.sweep(sbm_store, {"lr": [0.01, 0.02]}, epochs=1, hidden=8)
    assert draws[0] != draws[1]


def test_the_caller_s_grad_mode_and_default_dtype_change_nothing(sbm_store):
    """Training inside torch.no_grad() or inference_mode(), or with float64 as the default dtype, trains the float32
    model the CLI trains (it failed with a raw torch error, or trained in float64)."""
    ref = trellis.train(sbm_store, model="sage", strategy="mini", fanouts="5,5", epochs=2, hidden=8)
    with torch.no_grad():
        a = trellis.train(sbm_store, model="sage", strategy="mini", fanouts="5,5", epochs=2, hidden=8)
    with torch.inference_mode():
        b = trellis.train(sbm_store, model="sage", strategy="mini", fanouts="5,5", epochs=2, hidden=8)
    torch.set_default_dtype(torch.float64)
    try:
        c = trellis.train(sbm_store, model="sage", strategy="mini", fanouts="5,5", epochs=2, hidden=8)
        pred = c.predict()
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    losses = [[r["loss"] for r in run.history] for run in (ref, a, b, c)]
    assert losses[1:] == [losses[0]] * 3
    assert next(c.model.parameters()).dtype == torch.float32
    assert torch.equal(pred, ref.predict())


def test_the_caller_s_thread_count_holds_for_the_run(sbm_store, tmp_path):
    """torch.set_num_threads(1) before trellis.train: the run trains on one thread and the process keeps one (numba's
    first parallel kernel reset torch's shared OpenMP count to every core). A fresh interpreter: numba not started."""
    code = ("import torch, trellis\n"
            "torch.set_num_threads(1)\n"
            f"run = trellis.train({str(sbm_store)!r}, model='gcn', epochs=1, hidden=8, dropout=0.5)\n"
            "print(run.summary['threads'], torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_run_predict_uses_the_run_s_own_module_not_a_builder_redefined_later(sbm_store):
    """A notebook cell redefining a builder under the same name must not change an earlier Run's predictions."""
    from trellis.nn import GNN, SAGEConv

    def mine(in_dim, out_dim, hidden=8):
        return GNN([SAGEConv(in_dim, hidden), SAGEConv(hidden, out_dim)], 0.0)

    first = trellis.train(sbm_store, model=mine, epochs=3)
    before = first.predict(logits=True)

    def mine(in_dim, out_dim, hidden=8):  # noqa: F811 - the redefinition under test
        return GNN([SAGEConv(in_dim, hidden), SAGEConv(hidden, hidden), SAGEConv(hidden, out_dim)], 0.0)

    trellis.train(sbm_store, model=mine, epochs=1)
    assert torch.equal(first.predict(logits=True), before)


def test_load_run_model_is_in_evaluation_mode(sbm_store, tmp_path):
    trellis.train(sbm_store, model="gcn", epochs=1, hidden=8, out=tmp_path / "run")
    assert not trellis.load_run(tmp_path / "run").model.training


def test_a_first_epoch_torch_error_leaves_no_run_directory(sbm_store, tmp_path):
    """A user's model that fails with a torch error in the first epoch: the error propagates, and no directory is
    left that a re-run would be told to --resume."""

    class Broken(torch.nn.Module):
        def __init__(self, in_dim, out_dim):
            super().__init__()
            self.lin = torch.nn.Linear(in_dim + 1, out_dim)

        def forward(self, graph, x):
            return self.lin(x)

    def broken(in_dim, out_dim):
        return Broken(in_dim, out_dim)

    with pytest.raises(RuntimeError):
        trellis.train(sbm_store, model=broken, epochs=1, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_copied_run_predicts_given_the_graph_and_says_so_without_it(tmp_path):
    """A Run trained on an in-memory graph: its copy does not own the temporary store, predicts when given the graph
    (as train takes it) and names the fix when not. Relative store paths survive a chdir."""
    import copy
    import gc

    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 60, 300), rng.integers(0, 60, 300)
    graph = {"src": src, "dst": dst, "x": rng.standard_normal((60, 4)).astype(np.float32),
             "y": rng.integers(0, 3, 60), "splits": {"train": np.arange(30), "val": np.arange(30, 45),
                                                     "test": np.arange(45, 60)}}
    run = trellis.train(graph, model="gcn", epochs=2, hidden=8)
    ref = run.predict()
    twin = copy.deepcopy(run)
    del run
    gc.collect()
    assert torch.equal(twin.predict(graph), ref)
    with pytest.raises(TrellisUserError, match=r"run\.predict\(graph\)"):
        twin.predict()


def test_a_store_given_relative_still_predicts_after_chdir(sbm_store, tmp_path, monkeypatch):
    monkeypatch.chdir(sbm_store.parent)
    run = trellis.train(sbm_store.name, model="gcn", epochs=1, hidden=8)
    monkeypatch.chdir(tmp_path)
    assert run.predict().shape == (500,)


def test_sweep_without_out_returns_no_removed_directory(sbm_store):
    board = trellis.sweep(sbm_store, {"lr": [0.01, 0.02]}, epochs=1, hidden=8)
    assert board["out"] is None


def test_ranks_launched_from_a_worker_thread_leak_no_descriptor(sbm_store, tmp_path):
    """A notebook's worker thread may train over ranks (signals reach only the main thread, so it forwards none),
    and the launcher's config file leaves no open descriptor behind."""
    import threading

    from trellis.data.store import GraphStore
    from trellis.partition.base import partition_graph
    from trellis.partition.layout import write_layout

    gs = GraphStore(sbm_store)
    layout = write_layout(gs, partition_graph(gs, "random", 2, measure=False), tmp_path / "p2")
    fds = len(os.listdir("/proc/self/fd"))
    got: list[object] = []

    def work() -> None:
        try:
            got.append(trellis.train(sbm_store, model="gcn", epochs=1, hidden=8, parts_dir=str(layout), nproc=2,
                                     out=tmp_path / "run"))
        except Exception as exc:  # noqa: BLE001 - reported below
            got.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=300)
    assert len(got) == 1 and isinstance(got[0], trellis.Run), got
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_budgeted_run_without_out_writes_nothing_where_it_runs(sbm_store, tmp_path, monkeypatch):
    """Its spills went under ./runs/STORE-MODEL/spill of the caller's working directory (a read-only one refused
    the run, naming a path the caller never chose)."""
    from trellis.train.strategies.outofcore import OutOfCoreFull
    from trellis.utils import spill as spill_mod

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 50)  # tiles, so spills, whatever the budget
    roots = []
    real = spill_mod.SpillDir.__init__

    def seen(self, root, *args, **kwargs):
        roots.append(Path(root).resolve())
        real(self, root, *args, **kwargs)

    monkeypatch.setattr(spill_mod.SpillDir, "__init__", seen)
    monkeypatch.chdir(tmp_path)
    run = trellis.train(sbm_store, model="gcn", epochs=1, hidden=8, memory_budget="2G")
    assert roots and not any(tmp_path.resolve() in r.parents for r in roots)  # a read-only cwd would have failed
    assert list(tmp_path.iterdir()) == [] and run.config.spill_dir is None
    assert run.predict().shape == (500,)
    assert list(tmp_path.iterdir()) == []


def test_tune_takes_the_cli_s_options(sbm_store, tmp_path, capsys):
    """splits, eta, min_epochs, batch_models, grid, search had no Python spelling (the error blamed --set), and
    budget=True was a one-second budget."""
    flags = ["--grid", "lr=0.01,0.02", "--search", "grid", "--eta", "2", "--min-epochs", "2", "--batch-models", "1",
             "--epochs", "4", "--patience", "4", "--seeds", "1", "--playoff", "1"]
    assert main(["tune", str(sbm_store), *flags, "--out", str(tmp_path / "cli")]) == 0
    board = trellis.tune(sbm_store, grid={"lr": [0.01, 0.02]}, search="grid", eta=2, min_epochs=2, batch_models=1,
                         epochs=4, patience=4, seeds=1, playoff=1)
    cli = json.loads((tmp_path / "cli" / "leaderboard.json").read_text())

    def rows(b):
        return [{k: v for k, v in r.items() if k != "time_s"} for r in b["rows"]]

    assert rows(board) == rows(cli) and board["best"]["params"] == cli["best"]["params"]
    for bad in (True, -5, "soon"):
        with pytest.raises(TrellisUserError, match="budget="):
            trellis.tune(sbm_store, grid={"lr": [0.01]}, budget=bad)
