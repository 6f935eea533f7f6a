"""Prediction tasks: what the model's logits mean, how they are scored and how they become predictions.

Why a task object: the trainer loop is the same for every node-level task; only the loss, the metrics
and the label format differ (softmax cross entropy and accuracy for multiclass; sigmoid losses, ROC-AUC
or F1 for binary and multilabel). Each task registers itself by name in :data:`TASKS`, so a new one is
one class here and the trainer, the config and the CLI pick it up unchanged.

Label formats (what importers write to ``y.npy`` and the store manifest records as ``task``):

- ``multiclass``: ``int [N]`` class ids, ``-1`` = unlabelled. Softmax cross entropy; ``acc`` (default),
  ``f1_macro``.
- ``binary``: ``int [N]`` with values 0/1, ``-1`` = unlabelled. One output logit, BCE-with-logits;
  ``auc`` (default), ``acc`` and ``f1`` (of the positive class) at the 0.5 probability threshold.
- ``multilabel``: ``[N, C]`` 0/1 matrix; a row of ``-1`` marks an unlabelled node (a row mixing ``-1``
  with 0/1 is refused). ``C`` output logits, BCE-with-logits; ``f1_micro`` (default), ``f1_macro``,
  ``auc_macro`` (mean ROC-AUC over the labels that have both classes in the split) and ``acc``, the
  exact-match (subset) accuracy.

Only nodes in a split are ever scored, so an unlabelled node outside every split is harmless; one
inside a split is refused by :meth:`Task.check_labels`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trellis.data.store import infer_task
from trellis.errors import TrellisUserError
from trellis.train import metrics as M

#: Task registry: name -> class. ``trellis train --task`` and ``task="auto"`` resolve against it.
TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator that registers a :class:`Task` subclass under ``name``."""

    def deco(cls: type[Task]) -> type[Task]:
        cls.name = name
        TASKS[name] = cls
        return cls

    return deco


class Task(ABC):
    """A node-level prediction task.

    Subclasses set :attr:`default_metric` and :attr:`metric_names` and implement the label check, the
    loss, the metrics and the conversion of logits to predictions. Every method works on whole tensors
    (no per-node Python loops).

    Attributes:
        name: Registry name (set by :func:`register_task`).
        default_metric: Metric used for early stopping and the summary when ``--metric`` is not given.
        metric_names: Every metric :meth:`metrics` returns; ``--metric`` must be one of them.
        higher_is_better: Whether larger values of the selection metric are better, per metric.
        num_outputs: Width of the model's output layer.
        prediction_kind: What :meth:`predict`'s first tensor holds (``trellis predict`` reports it).
    """

    name: str = ""
    default_metric: str = ""
    metric_names: tuple[str, ...] = ()
    higher_is_better: dict[str, bool] = {}
    prediction_kind: str = "class_ids"

    def __init__(self, num_outputs: int) -> None:
        self.num_outputs = int(num_outputs)

    @classmethod
    @abstractmethod
    def from_labels(cls, y: np.ndarray, num_classes: int | None) -> Task:
        """Build the task for labels ``y`` (``num_classes`` from the store manifest, when recorded)."""

    @abstractmethod
    def check_labels(self, y: np.ndarray, split_ids: dict[str, np.ndarray], where: str) -> None:
        """Raise :class:`TrellisUserError` when a split node has no usable label."""

    @abstractmethod
    def labels_tensor(self, y: np.ndarray) -> Tensor:
        """Labels as the tensor :meth:`loss` and :meth:`metrics` expect."""

    @abstractmethod
    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """Mean training loss of ``logits`` against ``y`` (rows already restricted to a split)."""

    @abstractmethod
    def metrics(self, logits: Tensor, y: Tensor) -> dict[str, float]:
        """Every metric in :attr:`metric_names` for ``logits`` against ``y``."""

    @abstractmethod
    def predict(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(predictions, probabilities)``: class ids (or 0/1 labels) and their probabilities."""

    def describe(self) -> dict[str, Any]:
        """JSON-ready description recorded in the summary."""
        return {"task": self.name, "num_outputs": self.num_outputs}

    def select_metric(self, metric: str | None) -> str:
        """The metric early stopping and model selection use: ``metric`` (``--metric``) or the default.

        Raises:
            TrellisUserError: ``metric`` is not one this task reports (e.g. ``auc`` for multiclass).
        """
        if metric is None:
            return self.default_metric
        check_metric(self.name, metric)
        return metric


def _need_one_label_per_node(y: np.ndarray, needs: str) -> None:
    """Refuse a label matrix where the task ``needs`` one label per node (pointing at ``--task multilabel``)."""
    if y.ndim != 1:
        raise TrellisUserError(f"labels have shape {list(y.shape)} but {needs}; "
                               "use --task multilabel for a [N, C] label matrix")


def _first_bad_label(y: np.ndarray, split_ids: dict[str, np.ndarray],
                     is_bad: Callable[[np.ndarray], np.ndarray]) -> tuple[str, int, np.ndarray] | None:
    """``(split, node id, its label)`` of the first split node whose label ``is_bad`` flags, or None."""
    for split, ids in split_ids.items():
        labels = np.asarray(y[ids])
        bad = np.flatnonzero(is_bad(labels))
        if bad.size:
            return split, int(ids[bad[0]]), labels[bad[0]]
    return None


def _unlabelled_split_node(where: str, split: str, node: int, what: str, fix: str) -> TrellisUserError:
    return TrellisUserError(f"{where}: {split} node {node} {what}; {fix}")


@register_task("multiclass")
class MulticlassTask(Task):
    """One class per node: softmax cross entropy; accuracy (default) and macro-F1.

    Labels are ``int64 [N]`` with ``-1`` for unlabeled nodes (only split nodes must be labeled).
    """

    default_metric = "acc"
    metric_names = ("acc", "f1_macro")
    higher_is_better = {"acc": True, "f1_macro": True}
    prediction_kind = "class_ids"

    @classmethod
    def from_labels(cls, y: np.ndarray, num_classes: int | None) -> MulticlassTask:
        """A multiclass task with ``num_classes`` outputs (the largest label + 1 when not recorded)."""
        _need_one_label_per_node(y, "the multiclass task needs one class id per node")
        if num_classes is None:
            num_classes = int(y.max()) + 1 if y.size else 0
        if num_classes < 2:
            raise TrellisUserError(f"labels have {num_classes} class(es); a classifier needs at least two")
        return cls(num_classes)

    def check_labels(self, y: np.ndarray, split_ids: dict[str, np.ndarray], where: str) -> None:
        """Refuse a split node whose label is not a class id in ``[0, num_outputs)`` (including -1)."""
        found = _first_bad_label(y, split_ids, lambda labels: (labels < 0) | (labels >= self.num_outputs))
        if found is not None:
            split, node, label = found
            raise _unlabelled_split_node(where, split, node, f"has label {int(label)} outside [0, {self.num_outputs})",
                                         "every split node needs a class id (re-import with a clean split)")

    def labels_tensor(self, y: np.ndarray) -> Tensor:
        """``int64 [N]`` class ids, copied because store arrays are read-only memory maps."""
        return torch.from_numpy(np.array(y, dtype=np.int64))  # a copy: store arrays are read-only maps

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """Softmax cross entropy over the class ids."""
        return F.cross_entropy(logits, y)

    def metrics(self, logits: Tensor, y: Tensor) -> dict[str, float]:
        """Accuracy and macro-F1 of the argmax class."""
        pred = logits.argmax(dim=-1)
        return {"acc": M.accuracy(pred, y), "f1_macro": M.f1_macro_multiclass(pred, y, self.num_outputs)}

    def predict(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(argmax class ids [N], softmax probabilities [N, C])``."""
        return logits.argmax(dim=-1), torch.softmax(logits, dim=-1)


@register_task("binary")
class BinaryTask(Task):
    """Two classes scored by one logit: BCE-with-logits; ROC-AUC (default), accuracy and F1.

    Why a dedicated task rather than two-class softmax: AUC ranks nodes by one score, the positive
    class's logit, and the imbalanced graphs binary tasks come from (fraud, churn) are judged by AUC,
    not accuracy. Labels are ``int [N]`` with values 0/1 and ``-1`` for unlabelled nodes. Accuracy and
    F1 threshold the probability at 0.5 (logit 0); F1 is the positive class's.
    """

    default_metric = "auc"
    metric_names = ("auc", "acc", "f1")
    higher_is_better = {"auc": True, "acc": True, "f1": True}
    prediction_kind = "labels"

    @classmethod
    def from_labels(cls, y: np.ndarray, num_classes: int | None) -> BinaryTask:
        """A one-output task; labels other than 0/1/-1 are refused."""
        _need_one_label_per_node(y, "the binary task needs one 0/1 label per node")
        values = np.unique(y[y >= 0])
        if values.size and not np.isin(values, (0, 1)).all():
            shown = ", ".join(str(int(v)) for v in values[:5]) + (", ..." if values.size > 5 else "")
            raise TrellisUserError(
                f"--task binary: labels take the values {shown} but a binary task needs 0/1 (-1 = unlabelled); "
                "use --task multiclass or relabel the positive class 1 and the negative 0")
        return cls(1)

    def check_labels(self, y: np.ndarray, split_ids: dict[str, np.ndarray], where: str) -> None:
        """Refuse a split node whose label is not 0 or 1."""
        found = _first_bad_label(y, split_ids, lambda labels: (labels != 0) & (labels != 1))
        if found is not None:
            split, node, label = found
            raise _unlabelled_split_node(where, split, node, f"has label {int(label)}",
                                         "every split node needs a 0/1 label (re-import with a clean split)")

    def labels_tensor(self, y: np.ndarray) -> Tensor:
        """``float32 [N]`` labels: BCE takes float targets (-1 never reaches it, split nodes are checked)."""
        return torch.from_numpy(np.array(y, dtype=np.float32))  # BCE takes float targets; -1 never reaches it

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """BCE-with-logits of the single logit against the 0/1 label."""
        return F.binary_cross_entropy_with_logits(logits.reshape(-1), y.to(logits.dtype))

    def metrics(self, logits: Tensor, y: Tensor) -> dict[str, float]:
        """ROC-AUC of the logit, and accuracy and positive-class F1 at logit 0 (probability 0.5)."""
        score = logits.reshape(-1)
        pred = (score > 0).to(y.dtype)
        return {"auc": M.roc_auc(score, y), "acc": M.accuracy(pred, y), "f1": M.f1_binary(pred, y)}

    def predict(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(labels int64 [N] 0/1, probability of the positive class [N])``."""
        score = logits.reshape(-1)
        return (score > 0).to(torch.int64), torch.sigmoid(score)


@register_task("multilabel")
class MultilabelTask(Task):
    """Any number of ``C`` labels per node: BCE-with-logits; micro-F1 (default), macro-F1/AUC, accuracy.

    Labels are an ``[N, C]`` 0/1 matrix; a row of ``-1`` is an unlabelled node. ``acc`` is the subset
    accuracy (every label of the row right), as ``sklearn.metrics.accuracy_score``; per-label accuracy
    would be dominated by the many easy negatives of sparse label sets. ``auc_macro`` skips labels that
    are all 0 or all 1 within the split, where AUC is undefined.
    """

    default_metric = "f1_micro"
    metric_names = ("f1_micro", "f1_macro", "auc_macro", "acc")
    higher_is_better = {"f1_micro": True, "f1_macro": True, "auc_macro": True, "acc": True}
    prediction_kind = "label_matrix"

    @classmethod
    def from_labels(cls, y: np.ndarray, num_classes: int | None) -> MultilabelTask:
        """A task with one output per label column; refuses labels that are not an ``[N, C]`` matrix."""
        if y.ndim != 2:
            raise TrellisUserError(
                f"--task multilabel: labels have shape {list(y.shape)} but a multilabel task needs an [N, C] "
                "0/1 matrix; use --task multiclass or binary for one label per node")
        if y.shape[1] < 1:
            raise TrellisUserError("--task multilabel: the label matrix has no columns; give at least one label")
        return cls(int(y.shape[1]))

    def check_labels(self, y: np.ndarray, split_ids: dict[str, np.ndarray], where: str) -> None:
        """Refuse a split node whose label row is unlabelled (-1) or holds values other than 0/1."""
        found = _first_bad_label(y, split_ids, lambda labels: ((labels != 0) & (labels != 1)).any(axis=1))
        if found is not None:
            split, node, row = found
            what = ("is unlabelled (a row of -1)" if (row == -1).all()
                    else f"has label values {sorted({float(v) for v in np.unique(row)})}")
            raise _unlabelled_split_node(where, split, node, what,
                                         "every split node needs a 0/1 label row (re-import with clean labels)")

    def labels_tensor(self, y: np.ndarray) -> Tensor:
        """``float32 [N, C]`` label matrix, the target type BCE needs."""
        return torch.from_numpy(np.array(y, dtype=np.float32))

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """Independent BCE-with-logits per label, averaged over nodes and labels."""
        return F.binary_cross_entropy_with_logits(logits, y.to(logits.dtype))

    def metrics(self, logits: Tensor, y: Tensor) -> dict[str, float]:
        """Micro/macro-F1 and exact-match accuracy at logit 0, and macro ROC-AUC of the logits."""
        pred = (logits > 0).to(y.dtype)
        return {"f1_micro": M.f1_micro(pred, y), "f1_macro": M.f1_macro_multilabel(pred, y),
                "auc_macro": M.roc_auc_macro(logits, y), "acc": M.exact_match(pred, y)}

    def predict(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(0/1 uint8 [N, C], per-label probabilities [N, C])``."""
        return (logits > 0).to(torch.uint8), torch.sigmoid(logits)


def check_metric(task: str, metric: str) -> None:
    """Refuse a ``--metric`` that ``task`` does not report, with the ones it does.

    ``task`` may be ``auto``: then any task's metric passes here and the trainer checks again once the
    store's task is known.
    """
    if task == "auto":
        known = sorted({m for t in TASKS.values() for m in t.metric_names})
        if metric not in known:
            raise TrellisUserError(f"--metric {metric!r} is not a metric of any task; choose one of "
                                   f"{', '.join(known)}")
        return
    cls = TASKS[task]
    if metric in cls.metric_names:
        return
    fits = sorted(name for name, t in TASKS.items() if metric in t.metric_names)
    hint = (f"; {metric} is reported by the {' and '.join(fits)} task{'s' if len(fits) > 1 else ''}"
            if fits else "")
    if task == "multiclass" and metric.startswith("auc"):
        hint = ("; ROC-AUC scores one output against 0/1 targets, so it needs --task binary or multilabel "
                "(one-vs-rest AUC over classes is not offered)")
    raise TrellisUserError(f"--metric {metric} does not fit --task {task}: it reports "
                           f"{', '.join(cls.metric_names)}{hint}")


def resolve_task(name: str, store_task: str | None, y: np.ndarray, num_classes: int | None) -> Task:
    """Build the task named by ``--task``; ``auto`` takes the store's recorded task, else infers it.

    Inference (:func:`trellis.data.store.infer_task`, the rule importers record in the manifest): an
    ``[N, C]`` matrix is multilabel; an integer vector whose labelled values are exactly 0 and 1 is
    binary; any other integer vector is multiclass.

    Raises:
        TrellisUserError: Unknown task name, or labels that do not fit the task.
    """
    if name == "auto":
        name = store_task or infer_task(y)
    if name not in TASKS:
        raise TrellisUserError(
            f"--task {name}: unknown task (available: {', '.join(sorted(TASKS))}); pass --task explicitly")
    return TASKS[name].from_labels(y, num_classes)


def split_metrics(task: Task, logits_of: Callable[[str], Tensor], y: Tensor,
                  splits: dict[str, Tensor]) -> dict[str, float]:
    """``<split>_<metric>`` for every split and metric, plus ``val_loss``; ``logits_of(split)`` gives its rows."""
    out: dict[str, float] = {}
    for split, idx in splits.items():
        logits = logits_of(split)
        for name, value in task.metrics(logits, y[idx]).items():
            out[f"{split}_{name}"] = value
        if split == "val":
            out["val_loss"] = float(task.loss(logits, y[idx]))
    return out


def evaluate_logits(task: Task, logits: Tensor, y: Tensor, splits: dict[str, Tensor]) -> dict[str, float]:
    """Every split's metrics and ``val_loss`` from the logits of all nodes (full-batch and the sweep)."""
    return split_metrics(task, lambda s: logits[splits[s]], y, splits)
