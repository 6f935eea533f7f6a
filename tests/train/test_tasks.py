from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.errors import TrellisUserError
from trellis.train.optim import OPTIMIZERS, build_optimizer
from trellis.train.tasks import TASKS, MulticlassTask, Task, register_task, resolve_task


def _f1_macro_reference(pred, y, c):
    scores = []
    for k in range(c):
        if not (y == k).any():
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
    assert resolve_task("auto", "binary", y, 2).name == "multiclass"  # until a binary task is registered
    assert resolve_task("auto", None, np.array([0, 1, 2]), None).num_outputs == 3
    with pytest.raises(TrellisUserError, match="multilabel"):
        resolve_task("auto", "multilabel", np.zeros((4, 3)), 3)
    with pytest.raises(TrellisUserError, match="at least two"):
        resolve_task("multiclass", None, np.zeros(4, dtype=np.int64), None)


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
