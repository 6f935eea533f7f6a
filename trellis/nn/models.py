"""Models built from the layers, and the registry ``build_model`` resolves names against.

A model is called as ``model(graph, x)``: ``graph`` is one :class:`CSRGraph` (full graph or a cluster)
used by every layer, or a list of per-layer graphs (a mini-batch's bipartite blocks, a partition's local
graphs), so the same model code runs under every training strategy. ``model(graph, x, view=...)`` takes a
:class:`~trellis.nn.view.GraphView` that supplies each layer's input rows (halo rows, tiles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from trellis.nn.layers import GATConv, GCNConv, GINConv, MessagePassing, SAGEConv
from trellis.nn.view import IDENTITY, GraphView
from trellis.ops.dropout import dropout as hash_dropout
from trellis.ops.graph import CSRGraph
from trellis.plan.ir import format_plans

Graphs = CSRGraph | Sequence[CSRGraph]


def per_layer(graph: Graphs, depth: int) -> list[CSRGraph]:
    """One graph per layer: ``graph`` repeated, or the per-layer list checked against the depth."""
    if isinstance(graph, CSRGraph):
        return [graph] * depth
    if len(graph) != depth:
        raise ValueError(f"got {len(graph)} blocks for a {depth}-layer model")
    return list(graph)


class GNN(nn.Module):
    """A stack of message-passing layers with dropout before each layer and an activation between them."""

    def __init__(self, convs: Sequence[nn.Module], dropout: float = 0.5, activation: Callable = F.relu) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.dropout = dropout
        self.activation = activation

    def forward(self, graph: Graphs, x: Tensor, return_embedding: bool = False,
                view: GraphView | None = None) -> Tensor:
        """Logits for every destination node (or the last hidden layer's output with ``return_embedding``).

        Args:
            graph: One graph for every layer, or one per layer.
            x: The first layer's input rows (all its sources, or only the owned rows when ``view`` adds the rest).
            return_embedding: Return the last layer's input (before its dropout and view) instead.
            view: Supplies each layer's input rows after its dropout (default: the identity).
        """
        view = IDENTITY if view is None else view
        for i, (conv, g) in enumerate(zip(self.convs, per_layer(graph, len(self.convs)))):
            if return_embedding and i == len(self.convs) - 1:
                return x
            x = hash_dropout(x, self.dropout, self.training)
            x = conv(g, view.layer_input(i, g, x))
            if i < len(self.convs) - 1:
                x = self.activation(x)
        return x

    def explain(self, graph: Graphs) -> str:
        """The operator plan of every layer with estimated FLOPs and bytes."""
        plans = []
        for conv, g in zip(self.convs, per_layer(graph, len(self.convs))):
            if isinstance(conv, MessagePassing):
                if isinstance(conv, GATConv):
                    g = g.with_self_loops()
                plans.append(conv.plan(g))
        return format_plans(plans)


class GAT(GNN):
    """GAT uses ELU between layers (Veličković et al.)."""

    def __init__(self, convs: Sequence[nn.Module], dropout: float = 0.6) -> None:
        super().__init__(convs, dropout, F.elu)


class MLP(nn.Module):
    """Graph-agnostic baseline: the same call signature, the graph is ignored."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int, dropout: float) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout

    def forward(self, graph: Graphs, x: Tensor, return_embedding: bool = False,
                view: GraphView | None = None) -> Tensor:
        """Logits of the destination rows of ``x`` (a graph view is not needed: no neighbour is read)."""
        n = graph.num_dst if isinstance(graph, CSRGraph) else graph[-1].num_dst
        x = x[:n]
        for i, lin in enumerate(self.lins):
            if return_embedding and i == len(self.lins) - 1:
                return x
            x = lin(hash_dropout(x, self.dropout, self.training))
            if i < len(self.lins) - 1:
                x = F.relu(x)
        return x

    def explain(self, graph: Graphs) -> str:
        """No graph ops to plan."""
        return "mlp: dense layers only, no graph ops"


def _dims(in_dim: int, hidden: int, out_dim: int, layers: int) -> list[tuple[int, int]]:
    dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
    return list(zip(dims[:-1], dims[1:]))


def _gcn(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, **_: object) -> nn.Module:
    return GNN([GCNConv(a, b) for a, b in _dims(in_dim, hidden, out_dim, layers)], dropout)


def _sage(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, **_: object) -> nn.Module:
    return GNN([SAGEConv(a, b) for a, b in _dims(in_dim, hidden, out_dim, layers)], dropout)


def _gin(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, **_: object) -> nn.Module:
    return GNN([GINConv(a, b) for a, b in _dims(in_dim, hidden, out_dim, layers)], dropout)


def _gat_stack(in_dim: int, out_dim: int, *, hidden: int, layers: int, heads: int, dropout: float,
               out_heads: int = 1, edge_dim: int = 0, attn_dropout: float | None = None) -> nn.Module:
    ad = dropout if attn_dropout is None else attn_dropout
    convs: list[nn.Module] = []
    d = in_dim
    for _ in range(layers - 1):
        convs.append(GATConv(d, hidden, heads, concat=True, dropout=ad, edge_dim=edge_dim))
        d = hidden * heads
    convs.append(GATConv(d, out_dim, out_heads, concat=False, dropout=ad, edge_dim=edge_dim))
    return GAT(convs, dropout)


def _gat(in_dim: int, out_dim: int, *, hidden: int, layers: int, heads: int, dropout: float,
         out_heads: int = 1, attn_dropout: float | None = None, **_: object) -> nn.Module:
    return _gat_stack(in_dim, out_dim, hidden=hidden, layers=layers, heads=heads, dropout=dropout,
                      out_heads=out_heads, attn_dropout=attn_dropout)


def _gate(in_dim: int, out_dim: int, *, hidden: int, layers: int, heads: int, dropout: float, edge_dim: int = 0,
          out_heads: int = 1, attn_dropout: float | None = None, **_: object) -> nn.Module:
    if edge_dim <= 0:
        raise ValueError("gate (GAT with edge features) needs a graph with edge features")
    return _gat_stack(in_dim, out_dim, hidden=hidden, layers=layers, heads=heads, dropout=dropout,
                      out_heads=out_heads, edge_dim=edge_dim, attn_dropout=attn_dropout)


def _mlp(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, **_: object) -> nn.Module:
    return MLP(in_dim, hidden, out_dim, layers, dropout)


#: Model registry: name -> builder. A new model is one builder registered here.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "gcn": _gcn,
    "sage": _sage,
    "gin": _gin,
    "gat": _gat,
    "gate": _gate,
    "mlp": _mlp,
}


def build_model(name: str, in_dim: int, out_dim: int, *, hidden: int = 64, layers: int = 2, heads: int = 1,
                dropout: float = 0.5, edge_dim: int = 0, **extra: object) -> nn.Module:
    """Build a registered model.

    Args:
        name: One of :data:`MODELS` (gcn, sage, gin, gat, gate, mlp).
        in_dim: Input feature width.
        out_dim: Output width (classes).
        hidden: Hidden width (per head for attention models) (default: 64).
        layers: Number of layers (default: 2).
        heads: Attention heads of hidden layers (default: 1).
        dropout: Dropout before every layer (and on attention coefficients) (default: 0.5).
        edge_dim: Edge feature width, for models that read edge features (default: 0).
        **extra: Model-specific options (``out_heads``, ``attn_dropout``).
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if layers < 1:
        raise ValueError("a model needs at least one layer")
    return MODELS[name](in_dim, out_dim, hidden=hidden, layers=layers, heads=heads, dropout=dropout,
                        edge_dim=edge_dim, **extra)
