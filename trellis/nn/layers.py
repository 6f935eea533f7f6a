"""GNN layers on the graph engine: GCN, GraphSAGE (mean), GIN, GAT and GAT-E.

Each layer declares itself (:meth:`MessagePassing.declare`) and executes the plan the planner chose for
the graph at hand (pushdown to SpMM, transform/aggregate order). GCN, GraphSAGE and GIN are
:class:`PushdownConv` layers: they state their decomposition once (what is aggregated, the transform
before, the epilogue after) and :func:`trellis.nn.executor.run_layer` runs it, for this layer alone or for
K model-batched configurations. GAT and GAT-E keep their own ``forward`` (attention is a parameterized
message). The same layer runs on the full graph, on a sampled bipartite block (``num_src >= num_dst``,
destinations first), on a cluster subgraph and on a partition whose sources are owned rows then halo rows.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.nn import user
from trellis.nn.executor import run_layer
from trellis.ops import edge_softmax, gcn_norm, sddmm, segment_reduce, spmm
from trellis.ops.dropout import dropout
from trellis.ops.graph import Aggregation, CSRGraph, SplitAttention
from trellis.ops.norm import weighted_mean_norm
from trellis.ops.sparse_rows import head_rows, is_sparse, linear
from trellis.plan import GraphStats, LayerDecl, LayerPlan, plan_layer, plan_layer_step

#: Plans a layer keeps, per graph shape and mode: sampled blocks differ in shape every batch, so the memo
#: is bounded (it starts over when full).
PLAN_CACHE_SIZE = 1024


class MessagePassing(nn.Module):
    """Base of all graph layers, built-in and user-defined: a declaration, and the plans the planner makes of it.

    **A user layer** subclasses this and writes Lotan's three functions in torch (see :mod:`trellis.nn.user`)::

        class MyGCN(trellis.nn.MessagePassing):
            aggregate = "sum"                        # Γ: sum, mean or max
            transform = "lin"                        # a bias-free nn.Linear applied to every source row

            def __init__(self, in_dim, out_dim):
                super().__init__()
                self.lin = nn.Linear(in_dim, out_dim, bias=False)
                self.bias = nn.Parameter(torch.zeros(out_dim))

            def edge_weights(self, graph):           # fixed per-edge weights (and self-loop weights)
                return trellis.ops.gcn_norm(graph)

            def message(self, x_j, edge_weight):     # φ, per edge
                return edge_weight.unsqueeze(-1) * x_j

            def update(self, aggr, x):               # ψ, per destination (x: its own input row)
                return aggr + self.bias

    The planner reads the message: an unparameterized copy or weighted message with a linear aggregate is
    pushed down into one SpMM and reordered with the transform, like the built-in layers (and such a layer is
    model-batchable); any other message gets the general plan (gather, apply per edge, segment-reduce). The
    planner tells a copy by probing ``message`` (random rows of several scales, in training and in evaluation
    mode); a layer whose message must run as written whatever the probes show sets ``general_plan = True``.

    **Built-in layers** override :meth:`declare` and ``forward``. Calling ``layer(graph, x)`` runs the layer's
    step plan for this input (:meth:`step_plan`); ``layer(graph, x, plan=...)`` runs a given plan (a
    model-level planner's, or a test's).
    """

    #: Γ of a user layer: ``sum``, ``mean`` or ``max``.
    aggregate: str = "sum"
    #: Name of a user layer's transform: a bias-free ``nn.Linear`` submodule applied to every source row.
    transform: ClassVar[str | None] = None
    #: True: never push a user layer's message down into one SpMM (probes are evidence, not proof, that a message
    #: copies its source rows); the general plan runs it as written.
    general_plan: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self._plan_memo: dict[tuple[GraphStats, bool, bool] | GraphStats, LayerPlan] = {}

    # ---- what a user writes ----------------------------------------------------------------------
    def message(self, x_j: Tensor) -> Tensor:
        """φ: the message along each edge (a user layer overrides it)."""
        raise NotImplementedError

    def update(self, aggr: Tensor) -> Tensor:
        """ψ: the destination's output from its aggregated messages (default: the aggregate itself)."""
        return aggr

    def edge_weights(self, graph: CSRGraph) -> Tensor | tuple[Tensor, Tensor | None] | None:
        """Fixed per-edge weights for ``message(edge_weight=...)``, or ``(edge, self-loop)`` weights; None = 1."""
        return None

    @property
    def user_defined(self) -> bool:
        """Whether the layer is written as message / aggregate / update (not a built-in)."""
        return type(self).message is not MessagePassing.message

    def declare(self) -> LayerDecl:
        """The layer in message / aggregate / update form (see :class:`LayerDecl`); read from a user layer's code."""
        if not self.user_defined:
            raise TrellisUserError(f"{type(self).__name__} has no message: a layer writes message (and optionally "
                                   "aggregate, update, transform, edge_weights)")
        return user.declare(self)

    @property
    def pushdown(self) -> bool:
        """Whether the layer runs as one SpMM (an unparameterized message with a linear aggregate)."""
        return self.declare().unparameterized_message and self.declare().aggregate in ("sum", "mean")

    @property
    def family(self) -> str:
        """The model-batching family of a user layer: its class (configurations of one class share a batch)."""
        return f"user:{type(self).__qualname__}"

    def forward(self, graph: CSRGraph, x: Tensor, plan: LayerPlan | None = None) -> Tensor:
        """A user layer on ``graph``: its pushdown plan (one SpMM, either order) or the general plan."""
        if self.pushdown:
            return run_layer([self], graph, [x], plan if plan is not None else self.step_plan(graph, x))[0]
        return user.run_general(self, graph, x)

    # ---- a pushed-down user layer as the executor sees it (trellis.nn.executor.PushdownLayer) -------
    def aggregation(self, graph: CSRGraph) -> Aggregation:
        """What is aggregated: the ``edge_weights`` hook's weights (none for a copy message)."""
        return user.aggregation(self, graph)

    def transform_weight(self) -> Tensor:
        """The declared transform's weight."""
        lin = user.transform_of(self)
        assert lin is not None, "a layer without a transform always aggregates first"
        return lin.weight

    def epilogue(self, a: Tensor, h: Tensor, z: Tensor | None, aggregate_first: bool, n: int) -> Tensor:
        """``update`` of the aggregation (transformed first when the plan aggregated the untransformed rows)."""
        lin = user.transform_of(self)
        if aggregate_first and lin is not None:
            a = linear(a, lin.weight)
        return user.finish(self, a, h, n)

    def output_bias(self) -> Tensor | None:
        """None: a user layer adds its bias in ``update``."""
        return None

    def plan(self, graph: CSRGraph) -> LayerPlan:
        """The planner's forward plan for this layer on ``graph`` (what ``--explain`` prints)."""
        stats = GraphStats.of(graph)
        plan = self._plan_memo.get(stats)
        if plan is None:
            plan = self._remember(stats, plan_layer(self.declare(), stats))
        return plan

    def step_plan(self, graph: CSRGraph, x: Tensor) -> LayerPlan:
        """The plan this call runs: planner v2's for this input (:func:`trellis.plan.plan_layer_step`).

        The order is chosen on the training-step cost given whether ``x`` needs a gradient (the features do
        not, so aggregating them first costs no backward SpMM) — the same choice
        :func:`trellis.plan.planner.plan_model` makes for this layer in a model-batched sweep, so a solo run
        performs the same floating-point operations as its configuration in the sweep (Adam's and Adagrad's
        first steps turn even last-bit differences of tiny gradients into ``±lr`` updates).
        """
        key = (GraphStats.of(graph), bool(x.requires_grad), self.training)
        plan = self._plan_memo.get(key)
        if plan is None:
            plan = self._remember(key, plan_layer_step(self.declare(), key[0], input_grad=key[1], training=key[2]))
        return plan

    def _remember(self, key: tuple[GraphStats, bool, bool] | GraphStats, plan: LayerPlan) -> LayerPlan:
        if len(self._plan_memo) >= PLAN_CACHE_SIZE:
            self._plan_memo.clear()
        self._plan_memo[key] = plan
        return plan


def _glorot(t: Tensor) -> None:
    nn.init.xavier_uniform_(t)


class PushdownConv(MessagePassing):
    """A layer whose message and aggregate are one SpMM, decomposed once for :func:`run_layer`.

    Subclasses supply the pieces of :class:`trellis.nn.executor.PushdownLayer` (:meth:`aggregation`,
    :meth:`transform_weight`, :meth:`epilogue`, :meth:`output_bias`) and their model family's name; the
    forward pass, whichever order the plan chose, is the executor's.
    """

    #: Model family name (``gcn``, ``sage``, ``gin``): configurations of one family share a model batch.
    family: ClassVar[str]

    def aggregation(self, graph: CSRGraph) -> Aggregation:
        """What is aggregated on ``graph``: edge weights, self weight, reduce."""
        raise NotImplementedError

    def transform_weight(self) -> Tensor:
        """The weight a transform-first plan applies before aggregating."""
        raise NotImplementedError

    def epilogue(self, a: Tensor, h: Tensor, z: Tensor | None, aggregate_first: bool, n: int) -> Tensor:
        """Layer output (before :meth:`output_bias`) from the aggregation ``a``, input ``h``, pre-transform ``z``."""
        raise NotImplementedError

    def output_bias(self) -> Tensor | None:
        """A bias added after the epilogue (None when the layer adds it inside a linear map)."""
        return None

    def forward(self, graph: CSRGraph, x: Tensor, plan: LayerPlan | None = None) -> Tensor:
        """``[graph.num_dst, out]`` from ``x`` ``[graph.num_src, in]``, by ``plan`` (default: :meth:`step_plan`)."""
        out = run_layer([self], graph, [x], plan if plan is not None else self.step_plan(graph, x))[0]
        bias = self.output_bias()
        return out if bias is None else out + bias


class GCNConv(PushdownConv):
    """Kipf & Welling: ``D^-1/2 (A + I) D^-1/2 X W + b``; the self loop is a diagonal term of the SpMM."""

    family = "gcn"

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, edge_weight: bool = False) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.edge_weight = in_dim, out_dim, edge_weight
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        _glorot(self.lin.weight)

    def declare(self) -> LayerDecl:
        """A weighted copy message summed with a self loop: pushed down to one SpMM."""
        return LayerDecl("gcn", self.in_dim, self.out_dim, message="weighted", aggregate="sum", root="self_loop")

    def aggregation(self, graph: CSRGraph) -> Aggregation:
        """The symmetric normalization as edge weights plus the self loop's diagonal (weighted: PyG's form)."""
        ew, sw = gcn_norm(graph, add_self_loops=True, weighted=self.edge_weight)
        return Aggregation(ew, sw, "sum")

    def transform_weight(self) -> Tensor:
        """``W``."""
        return self.lin.weight

    def epilogue(self, a: Tensor, h: Tensor, z: Tensor | None, aggregate_first: bool, n: int) -> Tensor:
        """``(ÂX) W`` aggregating first; ``Â(XW)`` is the aggregation itself otherwise."""
        return self.lin(a) if aggregate_first else a

    def output_bias(self) -> Tensor | None:
        """``b``, added after the aggregation (fusable with the activation and dropout)."""
        return self.bias


class SAGEConv(PushdownConv):
    """Hamilton et al. (mean): ``W_l mean_j x_j + W_r x_i``."""

    family = "sage"

    def __init__(self, in_dim: int, out_dim: int, aggregate: str = "mean", edge_weight: bool = False) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.aggregate, self.edge_weight = in_dim, out_dim, aggregate, edge_weight
        self.lin_l = nn.Linear(in_dim, out_dim, bias=True)
        self.lin_r = nn.Linear(in_dim, out_dim, bias=False)

    def declare(self) -> LayerDecl:
        """A copy message reduced by ``aggregate`` with a separate root transform."""
        return LayerDecl("sage", self.in_dim, self.out_dim, message="copy", aggregate=self.aggregate, root="linear")

    def aggregation(self, graph: CSRGraph) -> Aggregation:
        """The neighbour rows reduced by ``aggregate``; weighted: ``sum_j w_ij x_j / sum_j w_ij`` (a weighted mean)."""
        if self.edge_weight and graph.edge_weight is not None and self.aggregate == "mean":
            return Aggregation(weighted_mean_norm(graph), None, "sum")
        return Aggregation(None, None, self.aggregate)

    def transform_weight(self) -> Tensor:
        """``W_l`` (its bias is added after the aggregation)."""
        return self.lin_l.weight

    def epilogue(self, a: Tensor, h: Tensor, z: Tensor | None, aggregate_first: bool, n: int) -> Tensor:
        """``W_l a + b_l`` (or ``a + b_l`` when ``a`` is already transformed) plus the root term ``W_r x_i``."""
        neigh = self.lin_l(a) if aggregate_first else a + self.lin_l.bias
        return neigh + linear(head_rows(h, n), self.lin_r.weight)


class GINConv(PushdownConv):
    """Xu et al.: ``MLP((1 + eps) x_i + sum_j x_j)``; the MLP's first linear map commutes with the sum."""

    family = "gin"

    def __init__(self, in_dim: int, out_dim: int, eps: float = 0.0, train_eps: bool = False,
                 mlp_hidden: int | None = None) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        width = mlp_hidden or out_dim  # the MLP's hidden width (default: the layer's output width)
        self.lin1 = nn.Linear(in_dim, width)
        self.lin2 = nn.Linear(width, out_dim)
        self.eps = nn.Parameter(torch.tensor(float(eps)), requires_grad=train_eps)

    def declare(self) -> LayerDecl:
        """A copy message summed, a ``(1 + eps)`` root and an MLP update."""
        return LayerDecl("gin", self.in_dim, self.lin1.out_features, message="copy", aggregate="sum", root="eps",
                         update="mlp")

    def aggregation(self, graph: CSRGraph) -> Aggregation:
        """The unweighted neighbour rows, summed."""
        return Aggregation(None, None, "sum")

    def transform_weight(self) -> Tensor:
        """The MLP's first weight ``W_1`` (it commutes with the sum and the root term)."""
        return self.lin1.weight

    def epilogue(self, a: Tensor, h: Tensor, z: Tensor | None, aggregate_first: bool, n: int) -> Tensor:
        """``lin2(relu(lin1(a + (1 + eps) x_i)))``, or with the root term taken from the transformed rows."""
        if aggregate_first:  # a kept batch's fixed aggregation: the input rows may be sparse (a bag-of-words batch)
            rows = head_rows(h, n)
            hid = self.lin1(a + (1 + self.eps) * (rows.to_dense() if is_sparse(rows) else rows))
        else:
            assert z is not None
            hid = a + (1 + self.eps) * z[:n] + self.lin1.bias
        return self.lin2(F.relu(hid))


#: The layers model batching can run, by family name.
PUSHDOWN_LAYERS: dict[str, type[PushdownConv]] = {c.family: c for c in (GCNConv, SAGEConv, GINConv)}


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
        """Attention (with edge features for GAT-E): a parameterized message, the general plan."""
        return LayerDecl("gate" if self.edge_dim else "gat", self.in_dim, self.heads * self.out_dim, heads=self.heads,
                         message="edge_attention" if self.edge_dim else "attention", message_params=True,
                         edge_dim=self.edge_dim)

    def forward(self, graph: CSRGraph, x: Tensor, plan: LayerPlan | None = None) -> Tensor:
        """``[graph.num_dst, heads * out]`` (or ``[.., out]`` averaged over heads) from ``[graph.num_src, in]``.

        Attention is a parameterized message, so this layer runs its own ops; ``plan`` is accepted for the
        common ``layer(graph, x, plan=...)`` call and not read (:meth:`plan` of the graph with self loops
        describes these ops, and is what ``explain`` prints).
        """
        split = graph.exchange.attention() if graph.exchange is not None else None
        return self._attend(split if split is not None else _WholeGraph(graph.with_self_loops()), x)

    def _attend(self, att: SplitAttention, x: Tensor) -> Tensor:
        """The layer over ``att``: one process's whole graph, or a rank's edges whose in-edges are split.

        ``x`` holds the rows ``att`` calls owned; ``att`` supplies other processes' rows and completes the
        softmax's normalization and the aggregation (see :mod:`trellis.distributed.attention`).
        """
        g = att.graph
        h, d = self.heads, self.out_dim
        z = linear(x, self.lin.weight).view(-1, h, d)
        zs = att.sources(z)
        logits = sddmm(g, (zs * self.att_src).sum(-1), att.destinations((z * self.att_dst).sum(-1)), op="add")
        ef = None
        if self.edge_dim:
            if g.edge_feat is None:
                raise ValueError("GAT-E needs edge features: the graph has none (import edge_features.npy)")
            ef = g.edge_feat
            logits = logits + ef @ self.att_edge
        alpha = att.softmax(F.leaky_relu(logits, self.negative_slope))
        alpha = dropout(alpha, self.dropout, self.training, rows="edges")  # [E, heads]: counter-based
        out = att.reduce(spmm(g, zs, alpha))
        if ef is not None:
            agg_e = att.reduce(segment_reduce(g, alpha.unsqueeze(-1) * ef.unsqueeze(1)))  # [n, heads, edge_dim]
            out = out + torch.einsum("nhe,hed->nhd", agg_e, self.lin_edge)
        out = out.reshape(-1, h * d) if self.concat else out.mean(1)
        return out + self.bias


class _WholeGraph:
    """Attention over a graph that holds every in-edge of its destinations (one process, a pull rank)."""

    def __init__(self, graph: CSRGraph) -> None:
        self.graph = graph

    def sources(self, z: Tensor) -> Tensor:
        return z

    def destinations(self, t: Tensor) -> Tensor:
        return t[: self.graph.num_dst]

    def softmax(self, logits: Tensor) -> Tensor:
        return edge_softmax(self.graph, logits)

    def reduce(self, partial: Tensor) -> Tensor:
        return partial
