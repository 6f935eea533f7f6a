"""Early stopping on the validation metric, with the best weights kept: one object for every loop.

The rule (the trainer's since the start, now the sweep's and ``pp``'s too): an epoch is better when its
validation metric is better, or equal with a lower validation loss; a run stops after ``patience`` epochs
without a better one; at the end the best epoch's weights are restored and its metrics reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class EarlyStopping:
    """Tracks the best epoch of one run.

    Attributes:
        metric: Selection metric (``val_<metric>`` is read from each evaluation).
        patience: Epochs without improvement after which :attr:`should_stop` is true.
        higher_is_better: Direction of the metric.
        best_epoch: Best epoch so far (-1 before the first).
        best_value: Its metric, signed so that larger is better.
        best_val_loss: Its validation loss (the tie-breaker).
        best_metrics: Its whole evaluation record.
        best_state: A copy of the model's weights at that epoch.
        bad_epochs: Epochs since the best one (counted in epochs, so evaluating every few epochs keeps
            ``patience`` in epochs).
    """

    metric: str
    patience: int
    higher_is_better: bool = True
    best_epoch: int = -1
    best_value: float = -math.inf
    best_val_loss: float = math.inf
    best_metrics: dict[str, float] = field(default_factory=dict)
    best_state: dict[str, Tensor] | None = None
    bad_epochs: int = 0

    def update(self, epoch: int, evaluation: dict[str, float], model: nn.Module) -> bool:
        """Record an epoch's evaluation; returns whether it is the new best (its weights are then copied)."""
        sign = 1.0 if self.higher_is_better else -1.0
        value = sign * evaluation[f"val_{self.metric}"]
        if math.isnan(value):  # undefined (AUC over a val split of one class): the validation loss decides
            value = -math.inf
        val_loss = evaluation.get("val_loss", math.inf)
        if value > self.best_value or (value == self.best_value and val_loss < self.best_val_loss):
            self.best_epoch, self.best_value, self.best_val_loss = epoch, value, val_loss
            self.best_metrics = dict(evaluation)
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.bad_epochs = 0
            return True
        self.bad_epochs = epoch - self.best_epoch  # one per epoch when every epoch is evaluated
        return False

    @property
    def should_stop(self) -> bool:
        """Patience is exhausted."""
        return self.bad_epochs >= self.patience

    def restore(self, model: nn.Module) -> None:
        """Load the best epoch's weights into ``model`` (nothing when no epoch ran)."""
        if self.best_state is not None:
            model.load_state_dict(self.best_state)

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints (``torch.load(weights_only=True)`` accepts it)."""
        return {"epoch": self.best_epoch, "value": self.best_value, "val_loss": self.best_val_loss,
                "metrics": self.best_metrics, "state": self.best_state, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        """Restore what :meth:`state_dict` saved, moving the weights to ``device``."""
        self.best_epoch, self.best_value = int(state["epoch"]), float(state["value"])
        self.best_val_loss, self.best_metrics = float(state["val_loss"]), dict(state["metrics"])
        best = state["state"]
        self.best_state = None if best is None else {k: v.to(device) for k, v in best.items()}
        self.bad_epochs = int(state.get("bad_epochs", 0))
