"""Prediction tasks: what the model's logits mean, how they are scored and how they become predictions.

Why a task object: the trainer loop is the same for every node-level task; only the loss, the metrics
and the label format differ (softmax cross entropy and accuracy for multiclass; sigmoid losses, ROC-AUC
or F1 for binary and multilabel). Each task registers itself by name in :data:`TASKS`, so a new one is
one class here and the trainer, the config and the CLI pick it up unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trellis.errors import TrellisUserError

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
    """

    name: str = ""
    default_metric: str = ""
    metric_names: tuple[str, ...] = ()
    higher_is_better: dict[str, bool] = {}

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


@register_task("multiclass")
class MulticlassTask(Task):
    """One class per node: softmax cross entropy; accuracy (default) and macro-F1.

    Labels are ``int64 [N]`` with ``-1`` for unlabeled nodes (only split nodes must be labeled).
    """

    default_metric = "acc"
    metric_names = ("acc", "f1_macro")
    higher_is_better = {"acc": True, "f1_macro": True}

    @classmethod
    def from_labels(cls, y: np.ndarray, num_classes: int | None) -> MulticlassTask:
        if y.ndim != 1:
            raise TrellisUserError(
                f"labels have shape {list(y.shape)} but the multiclass task needs one class id per node; "
                "use --task multilabel for a [N, C] label matrix")
        if num_classes is None:
            num_classes = int(y.max()) + 1 if y.size else 0
        if num_classes < 2:
            raise TrellisUserError(f"labels have {num_classes} class(es); a classifier needs at least two")
        return cls(num_classes)

    def check_labels(self, y: np.ndarray, split_ids: dict[str, np.ndarray], where: str) -> None:
        for split, ids in split_ids.items():
            labels = np.asarray(y[ids])
            bad = np.flatnonzero((labels < 0) | (labels >= self.num_outputs))
            if bad.size:
                raise TrellisUserError(
                    f"{where}: {split} node {int(ids[bad[0]])} has label {int(labels[bad[0]])} outside "
                    f"[0, {self.num_outputs}); every split node needs a class id (re-import with a clean split)")

    def labels_tensor(self, y: np.ndarray) -> Tensor:
        return torch.from_numpy(np.array(y, dtype=np.int64))  # a copy: store arrays are read-only maps

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits, y)

    def metrics(self, logits: Tensor, y: Tensor) -> dict[str, float]:
        if y.numel() == 0:
            return {"acc": float("nan"), "f1_macro": float("nan")}
        pred = logits.argmax(dim=-1)
        correct = pred == y
        c = self.num_outputs
        tp = torch.bincount(y[correct], minlength=c).to(torch.float64)
        pred_count = torch.bincount(pred, minlength=c).to(torch.float64)
        true_count = torch.bincount(y, minlength=c).to(torch.float64)
        denom = pred_count + true_count
        present = true_count > 0  # classes absent from the split would score an undefined 0/0
        f1 = torch.where(denom > 0, 2 * tp / denom.clamp(min=1), torch.zeros_like(tp))
        return {"acc": float(correct.to(torch.float64).mean()), "f1_macro": float(f1[present].mean())}

    def predict(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return logits.argmax(dim=-1), torch.softmax(logits, dim=-1)


def resolve_task(name: str, store_task: str | None, y: np.ndarray, num_classes: int | None) -> Task:
    """Build the task named by ``--task`` (``auto``: the store's recorded task).

    A store whose labels take two values is recorded as ``binary``; until a dedicated binary task is
    registered it trains as a two-class multiclass problem, which is an exact binary classifier.
    """
    if name == "auto":
        name = store_task or "multiclass"
        if name == "binary" and "binary" not in TASKS:
            name = "multiclass"
    if name not in TASKS:
        raise TrellisUserError(
            f"--task {name}: not supported yet (available: {', '.join(sorted(TASKS))}); "
            "pass --task explicitly or train on a store with class-id labels")
    return TASKS[name].from_labels(y, num_classes)
