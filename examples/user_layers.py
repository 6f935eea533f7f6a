"""User-defined layers, written as message / aggregate / update (docs/api.md, ``trellis.nn.MessagePassing``).

``UserGCN`` is Kipf & Welling's layer as a user writes it: the planner reads its message (a weighted copy of the
source row, no parameters) and runs it as one SpMM, reordered with its transform like the built-in GCN (equal to
it to 1e-6 on dense features, ``tests/nn/test_user.py``; as fast, ``benchmarks/bench_user_layers.py``; on a
bag-of-words store the built-in models take the sparse rows and a user's model the dense ones, so they agree to
rounding: 3.5e-6 in the losses of 30 epochs on Cora with residual and layer norm). ``EdgeMLP`` has a
parameterized message (an MLP of both endpoints' rows): it gets the general plan and trains under every strategy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trellis.nn import GNN, MessagePassing
from trellis.ops import gcn_norm
from trellis.ops.graph import CSRGraph


class UserGCN(MessagePassing):
    """``D^-1/2 (A + I) D^-1/2 X W + b`` as message / aggregate / update."""

    aggregate = "sum"
    transform = "lin"  # a bias-free linear map of every source row: the planner may apply it after aggregating

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim))
        nn.init.xavier_uniform_(self.lin.weight)  # the built-in's initialization (same random draws)

    def edge_weights(self, graph: CSRGraph) -> tuple[Tensor, Tensor | None]:
        """The symmetric normalization: per-edge weights and the self loop's weight."""
        return gcn_norm(graph)

    def message(self, x_j: Tensor, edge_weight: Tensor) -> Tensor:
        """The source row scaled by the edge's weight."""
        return edge_weight.unsqueeze(-1) * x_j

    def update(self, aggr: Tensor) -> Tensor:
        """Plus the bias."""
        return aggr + self.bias


class EdgeMLP(MessagePassing):
    """A parameterized message: ``mean_j MLP([x_i, x_j]) + W_r x_i``."""

    aggregate = "mean"

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim))
        self.root = nn.Linear(in_dim, out_dim)
        self.in_dim, self.out_dim = in_dim, out_dim  # the widths --explain prices it at (it has no transform)

    def message(self, x_j: Tensor, x_i: Tensor) -> Tensor:
        """An MLP of the destination's and the source's rows."""
        return self.mlp(torch.cat([x_i, x_j], -1))

    def update(self, aggr: Tensor, x: Tensor) -> Tensor:
        """Plus the root term of the destination's own row."""
        return aggr + self.root(x)


def user_gcn(in_dim: int, out_dim: int, hidden: int = 16, layers: int = 2, dropout: float = 0.5) -> GNN:
    """A stack of :class:`UserGCN` layers (a model builder for ``trellis.train(..., model=user_gcn)``)."""
    dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
    return GNN([UserGCN(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout)


def edge_mlp(in_dim: int, out_dim: int, hidden: int = 16, dropout: float = 0.5) -> GNN:
    """Two :class:`EdgeMLP` layers."""
    return GNN([EdgeMLP(in_dim, hidden), EdgeMLP(hidden, out_dim)], dropout)
