"""GNN layers on the graph engine: GCN, GraphSAGE (mean), GIN, GAT and GAT-E.

Each layer declares itself (:meth:`MessagePassing.declare`) and executes the plan the planner chose for
the graph at hand (pushdown to SpMM, transform/aggregate order). The same layer runs on the full graph,
on a sampled bipartite block (``num_src >= num_dst``, destinations first) and on a cluster subgraph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.nn.decl import LayerDecl
from trellis.ops import edge_softmax, gcn_norm, sddmm, segment_reduce, spmm
from trellis.ops.dropout import dropout
from trellis.ops.graph import CSRGraph
from trellis.plan import GraphStats, LayerPlan, plan_layer
from trellis.plan.planner import choose_order


class MessagePassing(nn.Module):
    """Base of all graph layers: a declaration plus a plan cached per graph shape."""

    def __init__(self) -> None:
        super().__init__()
        self._plans: dict[GraphStats, LayerPlan] = {}
        self._orders: dict[tuple[GraphStats, bool, bool], bool] = {}

    def declare(self) -> LayerDecl:
        """The layer in message / aggregate / update form (see :class:`LayerDecl`)."""
        raise NotImplementedError

    def plan(self, graph: CSRGraph) -> LayerPlan:
        """The planner's plan for this layer on ``graph`` (cached by graph statistics)."""
        stats = GraphStats.of(graph)
        if stats not in self._plans:
            self._plans[stats] = plan_layer(self.declare(), stats)
        return self._plans[stats]

    def aggregate_first(self, graph: CSRGraph, x: Tensor) -> bool:
        """Whether this call aggregates before transforming: planner v2's choice for this input.

        The order is chosen on the training-step cost given whether ``x`` needs a gradient (the features do
        not, so aggregating them first costs no backward SpMM) — the same choice
        :func:`trellis.plan.planner.plan_model` makes for this layer in a model-batched sweep, so a solo run
        performs the same floating-point operations as its configuration in the sweep (Adam's and Adagrad's
        first steps turn even last-bit differences of tiny gradients into ``±lr`` updates).
        """
        stats = GraphStats.of(graph)
        key = (stats, bool(x.requires_grad), self.training)
        order = self._orders.get(key)
        if order is None:
            d = self.declare()
            order = (choose_order(d, stats, input_grad=key[1], training=key[2])[0] if d.unparameterized_message
                     else self.plan(graph).aggregate_first)
            self._orders[key] = order
        return order


def _glorot(t: Tensor) -> None:
    nn.init.xavier_uniform_(t)


class GCNConv(MessagePassing):
    """Kipf & Welling: ``D^-1/2 (A + I) D^-1/2 X W + b``; the self loop is a diagonal term of the SpMM."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        _glorot(self.lin.weight)

    def declare(self) -> LayerDecl:
        return LayerDecl("gcn", self.in_dim, self.out_dim, message="weighted", aggregate="sum", root="self_loop")

    def forward(self, graph: CSRGraph, x: Tensor) -> Tensor:
        ew, sw = gcn_norm(graph, add_self_loops=True)
        if self.aggregate_first(graph, x):
            out = self.lin(spmm(graph, x, ew, self_weight=sw))
        else:
            out = spmm(graph, self.lin(x), ew, self_weight=sw)
        return out if self.bias is None else out + self.bias


class SAGEConv(MessagePassing):
    """Hamilton et al. (mean): ``W_l mean_j x_j + W_r x_i``."""

    def __init__(self, in_dim: int, out_dim: int, aggregate: str = "mean") -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.aggregate = in_dim, out_dim, aggregate
        self.lin_l = nn.Linear(in_dim, out_dim, bias=True)
        self.lin_r = nn.Linear(in_dim, out_dim, bias=False)

    def declare(self) -> LayerDecl:
        return LayerDecl("sage", self.in_dim, self.out_dim, message="copy", aggregate=self.aggregate, root="linear")

    def forward(self, graph: CSRGraph, x: Tensor) -> Tensor:
        if self.aggregate_first(graph, x):
            neigh = self.lin_l(spmm(graph, x, reduce=self.aggregate))
        else:
            neigh = spmm(graph, F.linear(x, self.lin_l.weight), reduce=self.aggregate) + self.lin_l.bias
        return neigh + self.lin_r(x[: graph.num_dst])


class GINConv(MessagePassing):
    """Xu et al.: ``MLP((1 + eps) x_i + sum_j x_j)``; the MLP's first linear map commutes with the sum."""

    def __init__(self, in_dim: int, out_dim: int, eps: float = 0.0, train_eps: bool = False) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.lin1 = nn.Linear(in_dim, out_dim)
        self.lin2 = nn.Linear(out_dim, out_dim)
        self.eps = nn.Parameter(torch.tensor(float(eps)), requires_grad=train_eps)

    def declare(self) -> LayerDecl:
        return LayerDecl("gin", self.in_dim, self.out_dim, message="copy", aggregate="sum", root="eps", update="mlp")

    def forward(self, graph: CSRGraph, x: Tensor) -> Tensor:
        n = graph.num_dst
        if self.aggregate_first(graph, x):
            h = self.lin1(spmm(graph, x) + (1 + self.eps) * x[:n])
        else:
            z = F.linear(x, self.lin1.weight)
            h = spmm(graph, z) + (1 + self.eps) * z[:n] + self.lin1.bias
        return self.lin2(F.relu(h))


class GATConv(MessagePassing):
    """Veličković et al., multi-head; with ``edge_dim > 0`` it is GraphTheta's GAT-E.

    GAT-E (a simplified GIPA): edge attributes enter the attention logits *and* the messages,
    ``m_ij = W h_j + W_e e_ij``. Because ``sum_j a_ij W_e e_ij = W_e sum_j a_ij e_ij``, the edge part is
    aggregated at the edge-feature width and embedded once per node, so no ``[E, heads, D]`` tensor exists.
    """

    def __init__(self, in_dim: int, out_dim: int, heads: int = 1, concat: bool = True, dropout: float = 0.0,
                 negative_slope: float = 0.2, edge_dim: int = 0) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.heads, self.concat = in_dim, out_dim, heads, concat
        self.dropout, self.negative_slope, self.edge_dim = dropout, negative_slope, edge_dim
        self.lin = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_dim))
        self.bias = nn.Parameter(torch.zeros(heads * out_dim if concat else out_dim))
        for p in (self.lin.weight, self.att_src, self.att_dst):
            _glorot(p)
        if edge_dim:
            self.att_edge = nn.Parameter(torch.empty(edge_dim, heads))
            self.lin_edge = nn.Parameter(torch.empty(heads, edge_dim, out_dim))
            _glorot(self.att_edge)
            nn.init.uniform_(self.lin_edge, -1 / math.sqrt(edge_dim), 1 / math.sqrt(edge_dim))

    def declare(self) -> LayerDecl:
        return LayerDecl("gate" if self.edge_dim else "gat", self.in_dim, self.heads * self.out_dim, heads=self.heads,
                         message="edge_attention" if self.edge_dim else "attention", message_params=True,
                         edge_dim=self.edge_dim)

    def forward(self, graph: CSRGraph, x: Tensor) -> Tensor:
        g = graph.with_self_loops()
        self.plan(g)
        h, d = self.heads, self.out_dim
        z = self.lin(x).view(-1, h, d)
        logits = sddmm(g, (z * self.att_src).sum(-1), (z[: g.num_dst] * self.att_dst).sum(-1), op="add")
        ef = None
        if self.edge_dim:
            if g.edge_feat is None:
                raise ValueError("GAT-E needs edge features: the graph has none (import edge_features.npy)")
            ef = g.edge_feat
            logits = logits + ef @ self.att_edge
        alpha = edge_softmax(g, F.leaky_relu(logits, self.negative_slope))
        alpha = dropout(alpha, self.dropout, self.training)  # [E, heads]: the counter-based kernel
        out = spmm(g, z, alpha)
        if ef is not None:
            agg_e = segment_reduce(g, alpha.unsqueeze(-1) * ef.unsqueeze(1))  # [num_dst, heads, edge_dim]
            out = out + torch.einsum("nhe,hed->nhd", agg_e, self.lin_edge)
        out = out.reshape(-1, h * d) if self.concat else out.mean(1)
        return out + self.bias
