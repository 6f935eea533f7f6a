"""Optimizers chosen by name.

Why a registry: the config names the optimizer as a string (``--optimizer adam``) so that configs stay
plain JSON, sweeps can list optimizers (``optimizer=adam,adagrad``) and a new optimizer is one entry
here. Each factory receives the parameters, learning rate, weight decay and any extra keyword options
from ``--set optimizer_args={...}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trellis.errors import TrellisUserError

Params = Iterable[nn.Parameter] | Iterable[dict[str, Any]]
OptimizerFactory = Callable[..., torch.optim.Optimizer]

#: Optimizer registry: name -> factory ``(params, lr=, weight_decay=, **extra) -> Optimizer``.
OPTIMIZERS: dict[str, OptimizerFactory] = {}


def register_optimizer(name: str) -> Callable[[OptimizerFactory], OptimizerFactory]:
    """Decorator registering an optimizer factory under ``name``."""

    def deco(fn: OptimizerFactory) -> OptimizerFactory:
        OPTIMIZERS[name] = fn
        return fn

    return deco


@register_optimizer("adam")
def _adam(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    # L2 penalty added to the gradient, as in the GCN and GAT papers (not decoupled like AdamW).
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, **extra)


@register_optimizer("adamw")
def _adamw(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **extra)


@register_optimizer("sgd")
def _sgd(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    extra.setdefault("momentum", 0.9)  # plain SGD without momentum rarely converges in a GNN's epoch budget
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **extra)


@register_optimizer("adagrad")
def _adagrad(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay, **extra)


def build_optimizer(name: str, params: Params, *, lr: float, weight_decay: float,
                    **extra: Any) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name``.

    Args:
        name: One of :data:`OPTIMIZERS` (adam, adamw, sgd, adagrad).
        params: Model parameters or parameter groups.
        lr: Learning rate.
        weight_decay: L2 penalty (decoupled for ``adamw``).
        **extra: Optimizer-specific options (e.g. ``momentum``, ``betas``).

    Raises:
        TrellisUserError: Unknown name, or options the optimizer does not accept.
    """
    if name not in OPTIMIZERS:
        raise TrellisUserError(f"--optimizer {name}: unknown optimizer; choose one of {', '.join(OPTIMIZERS)}")
    try:
        return OPTIMIZERS[name](params, lr=lr, weight_decay=weight_decay, **extra)
    except (TypeError, ValueError) as exc:
        raise TrellisUserError(f"--optimizer {name}: invalid optimizer_args {extra} ({exc})") from exc
