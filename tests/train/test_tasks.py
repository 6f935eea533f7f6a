from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.errors import TrellisUserError
from trellis.train.optim import OPTIMIZERS, build_optimizer
from trellis.train.tasks import TASKS, MulticlassTask, Task, register_task, resolve_task


def _f1_macro_reference(pred, y, c):
    """scikit-learn's macro F1: the mean over classes that occur in ``y`` or ``pred``."""
    scores = []
    for k in range(c):
        if not ((y == k).any() or (pred == k).any()):
            continue
        tp = np.sum((pred == k) & (y == k))
        denom = np.sum(pred == k) + np.sum(y == k)
        scores.append(2 * tp / denom if denom else 0.0)
    return float(np.mean(scores))


def test_multiclass_metrics_match_reference():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(500, 5)))
    y = torch.from_numpy(rng.integers(0, 4, 500))  # class 4 never occurs
    task = MulticlassTask(5)
    m = task.metrics(logits, y)
    pred = logits.argmax(1).numpy()
    assert m["acc"] == pytest.approx(float(np.mean(pred == y.numpy())))
    assert m["f1_macro"] == pytest.approx(_f1_macro_reference(pred, y.numpy(), 5))
    assert task.loss(logits.float(), y).item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    ids, prob = task.predict(logits)
    assert torch.equal(ids, logits.argmax(1)) and torch.allclose(prob.sum(1), torch.ones(500, dtype=prob.dtype))


def test_check_labels_names_node():
    task = MulticlassTask(3)
    y = np.array([0, 1, -1, 2])
    task.check_labels(y, {"train": np.array([0, 1])}, "store")
    with pytest.raises(TrellisUserError, match="train node 2 has label -1"):
        task.check_labels(y, {"train": np.array([0, 2])}, "store")


def test_resolve_task():
    y = np.array([0, 1, 1, 0])
    assert resolve_task("auto", "binary", y, 2).name == "binary"
    assert resolve_task("multiclass", "binary", y, 2).num_outputs == 2  # a binary store trains as 2 classes too
    assert resolve_task("auto", None, np.array([0, 1, 2]), None).num_outputs == 3
    assert resolve_task("auto", "multilabel", np.zeros((4, 3)), 3).num_outputs == 3
    with pytest.raises(TrellisUserError, match="at least two"):
        resolve_task("multiclass", None, np.zeros(4, dtype=np.int64), None)
    with pytest.raises(TrellisUserError, match="--task regression"):
        resolve_task("regression", None, y, None)


def test_registry_accepts_new_task():
    @register_task("dummy-test")
    class Dummy(MulticlassTask):
        pass

    try:
        assert TASKS["dummy-test"] is Dummy and Dummy.name == "dummy-test"
        assert issubclass(Dummy, Task)
        assert resolve_task("auto", "dummy-test", np.array([0, 1, 2]), 3).name == "dummy-test"
    finally:
        del TASKS["dummy-test"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_by_name(name):
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer(name, [p], lr=0.1, weight_decay=0.0)
    p.sum().backward()
    opt.step()
    assert (p < 1).all()


def test_optimizer_errors():
    p = [torch.nn.Parameter(torch.ones(1))]
    with pytest.raises(TrellisUserError, match="--optimizer rmsprop"):
        build_optimizer("rmsprop", p, lr=0.1, weight_decay=0.0)
    with pytest.raises(TrellisUserError, match="invalid optimizer_args"):
        build_optimizer("adam", p, lr=0.1, weight_decay=0.0, momentum=0.9)


# ---- binary and multilabel -----------------------------------------------------------------------------
@pytest.mark.parametrize(("y", "task"), [
    (np.array([0, 1, -1, 1]), "binary"),
    (np.array([0, 1, 1, 2]), "multiclass"),
    (np.array([1, 2, 2, -1]), "multiclass"),  # two values, but not 0/1: which is positive is the user's call
    (np.array([0, 0, -1]), "multiclass"),
    (np.zeros((3, 4)), "multilabel"),
])
def test_task_inference(y, task):
    from trellis.data.store import infer_task

    assert infer_task(y) == task
    if y.ndim == 2 or np.unique(y[y >= 0]).size >= 2:  # a single class is refused (tested above)
        assert resolve_task("auto", None, y, None).name == task


def test_binary_task():
    rng = np.random.default_rng(0)
    task = resolve_task("binary", None, np.array([0, 1, -1]), 2)
    assert task.num_outputs == 1 and task.default_metric == "auc" and task.metric_names == ("auc", "acc", "f1")
    y_np = rng.integers(0, 2, 300)
    y = task.labels_tensor(y_np)
    logits = torch.from_numpy(rng.normal(size=(300, 1)) + y_np[:, None]).float()
    m = task.metrics(logits, y)
    score = logits[:, 0].numpy()
    assert m["acc"] == pytest.approx(float(np.mean((score > 0) == y_np)))
    assert 0.6 < m["auc"] <= 1.0 and 0 < m["f1"] <= 1
    assert task.loss(logits, y).item() == pytest.approx(
        torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], y).item(), rel=1e-6)
    pred, prob = task.predict(logits)
    assert pred.dtype == torch.int64 and pred.shape == (300,) and set(pred.unique().tolist()) <= {0, 1}
    assert torch.allclose(prob, torch.sigmoid(logits[:, 0]))
    with pytest.raises(TrellisUserError, match="binary task needs 0/1"):
        resolve_task("binary", None, np.array([0, 1, 2]), 3)
    with pytest.raises(TrellisUserError, match="multilabel"):
        resolve_task("binary", None, np.zeros((3, 2)), 2)
    with pytest.raises(TrellisUserError, match="val node 2 has label -1"):
        task.check_labels(np.array([0, 1, -1]), {"train": np.array([0, 1]), "val": np.array([2])}, "store")


def test_multilabel_task():
    rng = np.random.default_rng(0)
    y_np = (rng.random((200, 5)) < 0.3).astype(np.float32)
    task = resolve_task("multilabel", None, y_np, 5)
    assert task.num_outputs == 5 and task.default_metric == "f1_micro"
    assert set(task.metric_names) == {"f1_micro", "f1_macro", "auc_macro", "acc"}
    y = task.labels_tensor(y_np)
    logits = torch.from_numpy(rng.normal(size=(200, 5)) + 2 * y_np - 1).float()
    m = task.metrics(logits, y)
    assert set(m) == set(task.metric_names) and m["auc_macro"] > 0.7 and 0 <= m["acc"] <= m["f1_micro"] <= 1
    pred, prob = task.predict(logits)
    assert pred.dtype == torch.uint8 and pred.shape == (200, 5) and torch.allclose(prob, torch.sigmoid(logits))
    assert task.loss(logits, y).item() == pytest.approx(
        torch.nn.functional.binary_cross_entropy_with_logits(logits, y).item(), rel=1e-6)
    with pytest.raises(TrellisUserError, match=r"--task multilabel.*\[N, C\]"):
        resolve_task("multilabel", None, np.array([0, 1, 2]), 3)
    y_bad = y_np.copy()
    y_bad[7] = -1  # an unlabelled row: fine outside the splits, refused inside
    task.check_labels(y_bad, {"train": np.arange(7)}, "store")
    with pytest.raises(TrellisUserError, match="train node 7 is unlabelled"):
        task.check_labels(y_bad, {"train": np.arange(10)}, "store")
    y_bad[7] = 2
    with pytest.raises(TrellisUserError, match="test node 7 has label values"):
        task.check_labels(y_bad, {"test": np.array([3, 7])}, "store")


def test_metric_must_fit_task():
    from trellis.train.tasks import check_metric

    check_metric("binary", "auc")
    check_metric("auto", "f1_micro")  # checked again once the store's task is known
    with pytest.raises(TrellisUserError, match=r"--metric auc does not fit --task multiclass.*--task binary"):
        check_metric("multiclass", "auc")
    with pytest.raises(TrellisUserError, match="--metric f1_micro does not fit --task binary.*multilabel"):
        check_metric("binary", "f1_micro")
    with pytest.raises(TrellisUserError, match="--metric 'aucc' is not a metric of any task"):
        check_metric("auto", "aucc")
    assert MulticlassTask(3).select_metric(None) == "acc"
    with pytest.raises(TrellisUserError, match="--metric auc does not fit --task multiclass"):
        MulticlassTask(3).select_metric("auc")


# ---- end to end through the CLI: generated binary and multilabel graphs -------------------------------
def _cli(capsys, *argv):
    from trellis.cli.main import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def task_stores(tmp_path_factory):
    """Small SBM graphs whose labels are planted functions of the classes (strong feature signal)."""
    from trellis.data.generate import generate_sbm

    root = tmp_path_factory.mktemp("task-stores")
    common = {"nodes": 400, "features": 16, "feature_noise": 0.7, "progress": False}
    return {"binary": generate_sbm(root / "bin", task="binary", **common),
            "multilabel": generate_sbm(root / "ml", task="multilabel", labels=5, **common),
            "multiclass": generate_sbm(root / "mc", **common)}


@pytest.mark.parametrize(("task", "metric", "auc"), [("binary", "auc", "auc"), ("multilabel", "f1_micro", "auc_macro")])
@pytest.mark.parametrize("strategy", ["full", "mini", "cluster", "pp"])
def test_train_and_predict_binary_multilabel(capsys, tmp_path, task_stores, task, metric, auc, strategy):
    """Every strategy trains and predicts both tasks (pre-propagation refused multilabel stores before)."""
    import json

    from trellis.loader.ppcache import preprocess

    torch.set_num_threads(1)
    store, out = task_stores[task], tmp_path / "run"
    extra = ["--clusters", 8, "--clusters-per-batch", 2] if strategy == "cluster" else []
    if strategy == "pp":
        preprocess(store, tmp_path / "pp", hops=2, progress=False)
        extra = ["--model", "sign", "--pp-dir", tmp_path / "pp", "--batch-size", 64]
    rc, stdout, err = _cli(capsys, "train", store, "--epochs", 30 if strategy in ("full", "pp") else 8, "--lr", 0.05,
                           "--strategy", strategy, "--out", out, "--no-progress", "--json", *extra)
    assert rc == 0, err
    s = json.loads(stdout.strip().splitlines()[-1])
    assert s["task"] == task and s["metric"] == metric
    for name in TASKS[task].metric_names:
        for split in ("train", "val", "test")[strategy == "pp":]:  # pp scores the held-out splits only
            assert f"{split}_{name}_mean" in s
    assert s[f"test_{auc}_mean"] > 0.75, s  # planted signal: clearly above chance (0.5)
    rc, stdout, err = _cli(capsys, "predict", out, store, "--out", tmp_path / "p.npy", "--json")
    assert rc == 0, err
    pred = np.load(tmp_path / "p.npy")
    rc, _, err = _cli(capsys, "predict", out, store, "--out", tmp_path / "q.npy", "--proba")
    prob = np.load(tmp_path / "q.npy")
    assert rc == 0 and set(np.unique(pred)) <= {0, 1} and ((prob >= 0) & (prob <= 1)).all()
    assert pred.shape == prob.shape == ((400,) if task == "binary" else (400, 5))
    np.testing.assert_array_equal(pred, (prob > 0.5).astype(pred.dtype))


def test_sweep_binary_ranks_by_auc(capsys, tmp_path, task_stores):
    import json

    torch.set_num_threads(1)
    rc, stdout, err = _cli(capsys, "sweep", task_stores["binary"], "--model", "gcn", "--grid", "lr=0.05,0.01",
                           "--epochs", 5, "--out", tmp_path / "sw", "--json", "--no-progress")
    assert rc == 0, err
    board = json.loads(stdout.strip().splitlines()[-1])
    assert board["metric"] == "auc" and board["task"] == "binary" and len(board["rows"]) == 2
    assert {"val_auc", "val_f1", "test_acc"} <= set(board["rows"][0]["metrics"])


@pytest.mark.parametrize(("store", "argv", "needle"), [
    ("multiclass", ["--metric", "auc"], "--metric auc does not fit --task multiclass"),
    ("multiclass", ["--task", "multiclass", "--metric", "auc"], "--metric auc does not fit --task multiclass"),
    ("binary", ["--metric", "f1_micro"], "--metric f1_micro does not fit --task binary"),
    ("multiclass", ["--task", "binary"], "binary task needs 0/1"),
    ("binary", ["--task", "multilabel"], "--task multilabel: labels have shape [400]"),
    ("multilabel", ["--task", "binary"], "use --task multilabel"),
    ("multilabel", ["--metric", "aucc"], "--metric 'aucc'"),
    ("binary", ["--task", "regression"], "--task 'regression' is not one of"),
])
@pytest.mark.parametrize("command", ["train", "sweep"])
def test_bad_task_or_metric_exits_2_writing_nothing(capsys, tmp_path, task_stores, store, argv, needle, command):
    out = tmp_path / "run"
    if command == "sweep":
        argv = ["--grid", "lr=0.05,0.01", *(f"--set={a.lstrip('-')}={b}" for a, b in zip(argv[::2], argv[1::2]))]
    rc, _, err = _cli(capsys, command, task_stores[store], "--epochs", 2, "--out", out, "--no-progress", *argv)
    assert rc == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".run")]


def test_an_undefined_val_auc_selects_by_val_loss(tmp_path):
    """A binary store whose val split holds one class: val AUC is NaN every epoch; training still selects."""
    import trellis
    from trellis.data import from_arrays

    rng = np.random.default_rng(1)
    n = 300
    y = rng.integers(0, 2, n)
    y[100:150] = 1
    store = from_arrays(rng.integers(0, n, 1500), rng.integers(0, n, 1500), n, out=tmp_path / "s",
                        x=rng.normal(size=(n, 8)).astype(np.float32), y=y, remove_self_loops=True,
                        splits={"train": np.arange(100), "val": np.arange(100, 150), "test": np.arange(150, 300)})
    run = trellis.train(store, epochs=4, patience=2, runs=2)
    assert run.metric == "auc" and run.summary["undefined_val_metric"] == [0, 1]
    val_loss = [r["val_loss"] for r in run.history if r["run"] == 0]
    assert run.summary["best_epoch"][0] == int(np.argmin(val_loss))
