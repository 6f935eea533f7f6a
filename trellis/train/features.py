"""Node inputs for graphs without (useful) features: ``--features store|none|degree|embedding:D``.

Why here and not in the store: a featureless graph is a training choice (Dorylus §7.1 trains graphs that
come without features), so the store stays as imported and the run records what it used. ``none`` and
``degree`` are fixed inputs computed once from the graph; ``embedding:D`` is a learnable ``[N, D]`` table,
one row per node, that the model looks up by node id.

How the table reaches every strategy unchanged: the data's input matrix becomes one column holding each
node's id (float64, exact up to 2^53), so full-batch, mini-batch and cluster-batch loaders gather it like any
feature, and :class:`NodeEmbedding` turns the gathered ids into table rows in front of the wrapped model.
Only the rows of a batch's nodes get a gradient (``sparse=True``), so the table is updated by a sparse-aware
optimizer (:class:`SplitOptimizer`: SparseAdam for adam/adamw, the dense optimizer's own sparse path for
sgd/adagrad) while the rest of the model keeps the configured one.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.train.optim import eager

#: Degree-encoding width: one-hot of ``floor(log2(1 + in-degree))`` over this many buckets, plus
#: ``log1p(in-degree)`` and ``log1p(out-degree)``.
DEGREE_BUCKETS = 16


def parse_features(spec: str) -> tuple[str, int]:
    """``store`` / ``none`` / ``degree`` / ``embedding:D`` -> ``(kind, D)`` (D = 0 unless an embedding).

    Raises:
        TrellisUserError: Anything else, naming ``--features``.
    """
    if spec in ("store", "none", "degree"):
        return spec, 0
    m = re.fullmatch(r"embedding:(\d+)", spec)
    if m and int(m.group(1)) >= 1:
        return "embedding", int(m.group(1))
    raise TrellisUserError(f"--features {spec!r}: expected store, none, degree or embedding:D with D >= 1 "
                           "(e.g. embedding:64)")


def degree_encoding(indptr: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``float32 [N, DEGREE_BUCKETS + 2]``: bucketed in-degree one-hot, ``log1p`` in- and out-degree."""
    n = indptr.shape[0] - 1
    indeg = np.diff(np.asarray(indptr)).astype(np.int64)
    outdeg = np.bincount(np.asarray(indices), minlength=n)[:n]
    x = np.zeros((n, DEGREE_BUCKETS + 2), dtype=np.float32)
    bucket = np.minimum(np.floor(np.log2(1 + indeg)).astype(np.int64), DEGREE_BUCKETS - 1)
    x[np.arange(n), bucket] = 1.0
    x[:, DEGREE_BUCKETS] = np.log1p(indeg)
    x[:, DEGREE_BUCKETS + 1] = np.log1p(outdeg)
    return x


def node_inputs(kind: str, num_nodes: int, indptr: np.ndarray, indices: np.ndarray) -> Tensor:
    """The input matrix for ``kind`` (not ``store``): constant ones, degree encoding, or node ids (float64)."""
    if kind == "none":
        return torch.ones((num_nodes, 1), dtype=torch.float32)
    if kind == "degree":
        return torch.from_numpy(degree_encoding(indptr, indices))
    if kind == "embedding":
        return torch.arange(num_nodes, dtype=torch.float64).unsqueeze(1)
    raise ValueError(f"no computed inputs for features kind {kind!r}")


#: What layer-wise inference (``trellis.loader.inference``) and the engines that walk a stack read of a model:
#: its layers, what comes before and after each (activation; pre-norm, normalization, residual), the jumping
#: knowledge readout and a pre-norm input layer. An embedding model passes them all through: with only
#: ``convs`` and ``activation``, mini- and cluster-batch evaluation ran a plain stack (residual, normalization
#: ignored: metrics of another function than the model) or crashed (jumping knowledge, pre-norm).
LAYERWISE = ("convs", "activation", "pre", "post", "readout", "encoder", "encode", "jk")


class NodeEmbedding(nn.Module):
    """A learnable ``[N, D]`` input table in front of a model; inputs are node-id columns.

    Exposes what layer-wise inference reads of the wrapped model (:data:`LAYERWISE`), so exact layer-wise
    inference still applies, and :meth:`embed_inputs` for it to look the ids up first.
    """

    def __init__(self, model: nn.Module, num_nodes: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(num_nodes, dim, sparse=True)
        nn.init.normal_(self.table.weight, std=dim ** -0.5)
        self.model = model

    def __getattr__(self, name: str) -> Any:
        """What layer-wise inference reads of a stack (:data:`LAYERWISE`): the wrapped model's.

        Raises AttributeError where the wrapped model has none, as a plain model would.
        """
        if name in LAYERWISE:
            return getattr(self._modules["model"], name)
        return super().__getattr__(name)

    def embed_inputs(self, ids: Tensor) -> Tensor:
        """Table rows of the node ids in column 0 of ``ids``."""
        return self.table(ids[:, 0].to(device=self.table.weight.device, dtype=torch.int64))

    def forward(self, graph: Any, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Look up the node-id column's table rows, then run the wrapped model on them."""
        return self.model(graph, self.embed_inputs(x), *args, **kwargs)

    def explain(self, graph: Any) -> str:
        """The wrapped model's explanation, headed by the embedding table's shape."""
        inner = getattr(self.model, "explain", None)
        head = (f"input: embedding table [{self.table.num_embeddings}, {self.table.embedding_dim}] "
                "(sparse gradients, looked up per batch)")
        return head + ("\n" + str(inner(graph)) if inner is not None else "")


class SplitOptimizer:
    """The configured optimizer over dense parameters plus a sparse-aware one over embedding tables.

    Behaves like one ``torch.optim.Optimizer`` for the trainer (``zero_grad``, ``step``, ``state_dict``,
    ``load_state_dict``), so checkpoints and resume cover both.
    """

    def __init__(self, dense: torch.optim.Optimizer, sparse: torch.optim.Optimizer) -> None:
        self.dense, self.sparse = dense, sparse
        self.param_groups = dense.param_groups + sparse.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of both optimizers."""
        self.dense.zero_grad(set_to_none=set_to_none)
        self.sparse.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Step both optimizers: the dense one on the model, the sparse one on the embedding tables."""
        self.dense.step()
        self.sparse.step()

    def state_dict(self) -> dict[str, Any]:
        """Both optimizers' states under ``dense`` and ``sparse`` (checkpoints store it as one)."""
        return {"dense": self.dense.state_dict(), "sparse": self.sparse.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore both optimizers from :meth:`state_dict`'s output."""
        self.dense.load_state_dict(state["dense"])
        self.sparse.load_state_dict(state["sparse"])


def sparse_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer of embedding tables: SparseAdam for adam/adamw, sparse SGD/Adagrad otherwise.

    No weight decay: an L2 penalty would touch every row each step and defeat the sparse update.
    """
    if name in ("adam", "adamw"):
        return eager(torch.optim.SparseAdam)(params, lr=lr)
    if name == "adagrad":
        return eager(torch.optim.Adagrad)(params, lr=lr)
    return eager(torch.optim.SGD)(params, lr=lr)
