"""Optimizers chosen by name.

Why a registry: the config names the optimizer as a string (``--optimizer adam``) so that configs stay
plain JSON, sweeps can list optimizers (``optimizer=adam,adagrad``) and a new optimizer is one entry
here. Each factory receives the parameters, learning rate, weight decay and any extra keyword options
from ``--set optimizer_args={...}``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

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
    return eager(torch.optim.Adam)(params, lr=lr, weight_decay=weight_decay, **extra)


@register_optimizer("adamw")
def _adamw(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    return eager(torch.optim.AdamW)(params, lr=lr, weight_decay=weight_decay, **extra)


@register_optimizer("sgd")
def _sgd(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    extra.setdefault("momentum", 0.9)  # plain SGD without momentum rarely converges in a GNN's epoch budget
    return eager(torch.optim.SGD)(params, lr=lr, weight_decay=weight_decay, **extra)


@register_optimizer("adagrad")
def _adagrad(params: Params, *, lr: float, weight_decay: float, **extra: Any) -> torch.optim.Optimizer:
    return eager(torch.optim.Adagrad)(params, lr=lr, weight_decay=weight_decay, **extra)


@functools.cache
def _defer_dynamo_import() -> None:
    """Let ``torch.optim.Optimizer``'s methods run without importing ``torch._dynamo`` while nothing compiles.

    Why: torch marks ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` with
    ``torch._disable_dynamo``, which imports ``torch._dynamo`` on the first call so that a compiler never traces
    them, and every ``step`` imports it too (see :func:`eager`). That import took 1.8 s on this 2-core machine,
    as long as importing torch, and every ``trellis`` command that trains paid it, every rank too, while Trellis
    compiles nothing. Until someone imports ``torch._dynamo`` no compiler can be tracing, so the undecorated
    method does what the decorated one would; from then on the real ``torch._dynamo.disable`` wrapper is built
    and used, as torch itself would. Torch's wrapper looks for that wrapper on the function
    (``__dynamo_disable``); here it finds one that waits for the import.
    """
    probe = getattr(torch, "_disable_dynamo", None)
    if probe is None:
        return
    code = probe(lambda: None).__code__
    for attr in vars(torch.optim.Optimizer).values():
        if getattr(attr, "__code__", None) is not code or not hasattr(attr, "__wrapped__"):
            continue
        fn = attr.__wrapped__
        if getattr(fn, "__dynamo_disable", None) is not None:
            continue
        free = dict(zip(attr.__code__.co_freevars, attr.__closure__ or (), strict=True))
        recursive = free["recursive"].cell_contents if "recursive" in free else True
        setattr(fn, "__dynamo_disable", _until_dynamo(fn, recursive))


def _until_dynamo(fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)
        setattr(fn, "__dynamo_disable", disabled)
        return disabled(*args, **kwargs)

    return call


_EAGER: dict[type, type] = {}
O = TypeVar("O", bound=torch.optim.Optimizer)


def eager(cls: type[O]) -> type[O]:
    """``cls`` whose ``step`` imports ``torch._dynamo`` only where it is imported already.

    Why: torch wraps each optimizer's ``step`` in ``_use_grad_for_differentiable``, which imports
    ``torch._dynamo`` on every call for two ``graph_break()`` markers that only a compiler reads (see
    :func:`_defer_dynamo_import`). The subclass runs the same undecorated step under the same grad mode; once
    ``torch._dynamo`` is imported, it runs torch's decorated step. Where torch's step is not wrapped that way
    (another torch version), ``cls`` itself is returned.
    """
    _defer_dynamo_import()
    if cls not in _EAGER:
        wrapped = cls.step
        inner = getattr(wrapped, "__wrapped__", None)
        if getattr(wrapped, "__code__", None) is None or wrapped.__code__.co_name != "_use_grad" or inner is None:
            _EAGER[cls] = cls
        else:
            def step(self: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> Any:
                if "torch._dynamo" in sys.modules:
                    return wrapped(self, closure)
                before = torch.is_grad_enabled()
                try:
                    torch.set_grad_enabled(self.defaults["differentiable"])
                    return inner(self, closure)
                finally:
                    torch.set_grad_enabled(before)

            _EAGER[cls] = type(cls.__name__, (cls,), {"step": step, "__doc__": cls.__doc__})
    return _EAGER[cls]


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
