"""Building a run's model and optimizer from its configuration, through a model factory the caller passes.

Why the factory is an argument: the trainer, the sweep and ``trellis predict`` build models the same way
(family, ``--init``, then ``--features``' embedding table, in a fixed order of random draws, so a sweep's
configuration starts from its solo run's weights), and tests train a small stub model through the real
loop by handing the trainer another factory — no module global to patch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from trellis.errors import TrellisUserError
from trellis.nn import build_model
from trellis.nn.init import init_parameters
from trellis.train.config import TrainConfig
from trellis.train.features import NodeEmbedding, SplitOptimizer, sparse_optimizer
from trellis.train.optim import build_optimizer

#: ``(name, in_dim, out_dim, *, edge_dim, **hparams) -> Module``; :func:`trellis.nn.build_model` by default.
ModelFactory = Callable[..., nn.Module]


def default_model_factory(name: str, in_dim: int, out_dim: int, **kwargs: Any) -> nn.Module:
    """The models of :mod:`trellis.nn` by name."""
    return build_model(name, in_dim, out_dim, **kwargs)


@dataclass(frozen=True)
class ModelSpec:
    """The widths a strategy's data gives the model: what the factory needs besides the hyperparameters.

    Attributes:
        in_dim: Input width (feature width, or the embedding table's for ``--features embedding:D``).
        out_dim: Outputs (classes, or 1 for a binary task).
        edge_dim: Edge-feature width (0 = none).
        num_nodes: Nodes of the graph (rows of an embedding table).
        embedding_dim: Width of a learnable node-embedding table (0 = none).
    """

    in_dim: int
    out_dim: int
    edge_dim: int = 0
    num_nodes: int = 0
    embedding_dim: int = 0


def make_model(factory: ModelFactory, name: str, in_dim: int, out_dim: int, *, edge_dim: int = 0,
               **kwargs: Any) -> nn.Module:
    """Build a model, turning a builder's complaint about the options into a user error naming ``--model``."""
    try:
        model = factory(name, in_dim, out_dim, edge_dim=edge_dim, **kwargs)
    except (KeyError, ValueError, TypeError) as exc:
        msg = exc.args[0] if exc.args else str(exc)
        raise TrellisUserError(f"--model {name}: {msg}") from exc
    if not isinstance(model, nn.Module):
        raise TrellisUserError(f"--model {name}: the builder returned a {type(model).__name__}; it must return a "
                               "torch.nn.Module")
    try:
        inspect.signature(model.forward).bind(None, None)
    except TypeError:
        raise TrellisUserError(f"--model {name}: {type(model).__name__}.forward cannot be called as model(graph, x); "
                               "a model takes the graph (a CSRGraph, or one block per layer) and the input rows"
                               ) from None
    except ValueError:
        pass  # no signature to read (a C function): the first step tells
    return model


def check_registered(model: str, where: str) -> None:
    """Refuse a saved run whose model this process cannot build: a user's builder not registered here.

    Raises:
        TrellisUserError: Names the model and ``trellis.nn.register_model``.
    """
    from trellis.nn import MODELS
    from trellis.nn.pp_models import PP_MODELS

    if model not in MODELS and model not in PP_MODELS:
        raise TrellisUserError(f"{where}: the run trained the model {model!r}, which this process does not know "
                               "(the trellis command knows only the built-in models); from Python, register its "
                               f"builder first: trellis.nn.register_model({model!r}, builder), then call "
                               "trellis.predict, trellis.load_run or trellis.resume")


def build_run_model(cfg: TrainConfig, spec: ModelSpec, factory: ModelFactory = default_model_factory) -> nn.Module:
    """A run's model: the family, ``--init``, then ``--features``' table (this order of random draws)."""
    model = make_model(factory, cfg.model, spec.in_dim, spec.out_dim, edge_dim=spec.edge_dim,
                       **cfg.model_kwargs())
    init_parameters(model, cfg.init)
    if spec.embedding_dim:
        model = NodeEmbedding(model, spec.num_nodes, spec.embedding_dim)
    return model


def build_run_optimizer(cfg: TrainConfig, model: nn.Module) -> Any:
    """``--optimizer`` (with ``--momentum``) over the model; embedding tables get a sparse-aware one."""
    extra = dict(cfg.optimizer_args)
    if cfg.momentum is not None:
        if cfg.optimizer == "sgd":
            extra["momentum"] = cfg.momentum
        else:  # adam / adamw: the first-moment decay
            extra["betas"] = (cfg.momentum, extra.get("betas", (0.9, 0.999))[1])
    tables = [cast(nn.Parameter, m.table.weight) for m in model.modules() if isinstance(m, NodeEmbedding)]
    table_ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    opt = build_optimizer(cfg.optimizer, dense, lr=cfg.lr, weight_decay=cfg.weight_decay, **extra)
    if not tables:
        return opt
    return SplitOptimizer(opt, sparse_optimizer(cfg.optimizer, tables, cfg.lr))
