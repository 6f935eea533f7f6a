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

