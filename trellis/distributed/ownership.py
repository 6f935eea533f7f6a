"""A rank's graph, its graph view and its exchange, one per edge ownership of the partitioned layout.

Every ownership becomes two optional halo exchanges around the same local SpMM
(see :mod:`trellis.distributed.halo`):

=============  ======================================  =============================================
ownership      before the layer (graph view: Fetch)    after the local aggregation (exchange: Reduce)
=============  ======================================  =============================================
dst (pull)     halo sources, from their owners          —
src (push)     —                                        partial sums of halo destinations, to owners
reverse        —                                        as push; backward pushes partial gradients
                                                        computed on the layout's reversed in-edges
vertex-cut     mirrors used as sources, from masters    mirrors' partial sums, to masters
=============  ======================================  =============================================

Each ownership is one class (:data:`OWNERSHIPS`, keyed by the layout's ownership) that builds its rank's
graphs and routes and implements the graph engine's :class:`~trellis.ops.graph.Exchange` protocol.
GCN, SAGE and GIN layers run on a graph of the ``L`` owned rows whose exchange completes each
aggregation (:func:`trellis.nn.executor.aggregate` hands it the layer's rows after the planner's transform,
so rows travel at the plan's width): it fetches halo sources, runs the local SpMM (under pull, the part's
pull graph, which holds every in-edge of its rows), sends halo destinations' partial sums to their owners
and adds the self term once, at the owner. Models that aggregate by themselves (GAT) run on the pull graph,
whose view appends the halo rows of each layer's input, or where in-edges are split on the exchange's
two-phase softmax (:meth:`OwnershipExchange.attention`, :mod:`trellis.distributed.attention`). The pull
exchange also runs the overlapped and stale schedules (:meth:`PullExchange.set_schedule`,
:mod:`trellis.distributed.schedule`). Normalization always uses the layout's global
degrees: GCN's weights come from the layer's own ``gcn_norm`` on a graph carrying them, and a split mean
is a sum divided by the global in-degree after the reduction. Max needs the argmax's edge at the owner and
is refused where in-edges are split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from trellis.distributed.attention import SplitAttention
from trellis.distributed.comm import Comm
from trellis.distributed.halo import Fetch, Reduce, Route, Traffic, reduce_rows
from trellis.distributed.schedule import PullSplit, StaleBuffers, split_aggregate
from trellis.errors import TrellisUserError
from trellis.ops import spmm
from trellis.ops.graph import Aggregation, CSRGraph
from trellis.ops.norm import inv_degree
from trellis.ops.spmm import prim_spmm_sum
from trellis.partition.base import methods_of_ownership
from trellis.partition.layout import LocalGraph


class HaloView:
    """The graph view of a rank: owned rows in, owned plus fetched halo rows out (pull, mirror-reduce).

    Under push and reverse it returns the owned rows as they are (the exchange runs after the aggregation)
    but still tells the traffic counter which layer runs. The undropped first-layer input (``constant``)
    has its halo rows fetched once and reused.
    """

    def __init__(self, route: Route | None, num_rows: int, traffic: Traffic) -> None:
        self.route, self.num_rows, self.traffic = route, num_rows, traffic
        self.constant: Tensor | None = None
        self._fetched: Tensor | None = None

    def layer_input(self, layer: int, graph: CSRGraph, x: Tensor) -> Tensor:
        """``x`` with the halo rows ``graph``'s edges read appended (see :mod:`trellis.nn.view`)."""
        self.traffic.layer = layer
        if self.route is None:
            return x
        if layer == 0 and x is self.constant and not x.requires_grad:
            if self._fetched is None:
                self._fetched = Fetch.apply(x, self.route, self.num_rows, self.traffic)
            return self._fetched
        return Fetch.apply(x, self.route, self.num_rows, self.traffic)


class OwnershipExchange:
    """How a rank completes a layer's aggregation with its peers under one edge ownership.

    The layers hand over their input rows *after* the planner's transform (:attr:`CSRGraph.exchange`), so
    rows travel at the width the plan chose: ``Â(XW)`` exchanges ``XW``, ``(ÂX)W`` exchanges ``X``.
    A subclass builds, from its part, what its aggregation needs (collective: every rank builds its
    exchange in the same order, since routes are agreed by a handshake).

    Attributes:
        ownership: The layout ownership the class serves (``dst``, ``src``, ``reverse``, ``vertex-cut``).
        mode: Its exchange's name (``pull``, ``push``, ``reverse``, ``mirror-reduce``).
        node_ids: ``int64 [L + H]`` global id of every local row (owned rows first).
        num_local: ``L``.
        weights: What a layer's aggregation (GCN's norm) is computed on: the local CSR with ``L + H``
            source rows and the global degrees.
        fetch: Owner -> holder route of the halo rows read as sources (None: the ownership fetches none).
        pull_graph: The part's pull graph (``L`` rows over ``L + H`` sources) where the layout has one
            (destination ownership), for models that aggregate by themselves; else None.
        traffic: Byte counter shared with the rank's views.
    """

    ownership: ClassVar[str]
    mode: ClassVar[str]

    def __init__(self, part: LocalGraph, comm: Comm, device: torch.device, traffic: Traffic) -> None:
        self.comm, self.traffic = comm, traffic
        self.node_ids = np.asarray(part.local_to_global, dtype=np.int64)
        self.num_local = part.num_local
        self.owners = np.asarray(part.halo_owner)
        degree = np.asarray(part.in_degree)
        in_degree = torch.from_numpy(degree[: self.num_local].astype(np.float32)).to(device)
        self.inv_degree = torch.where(in_degree > 0, 1.0 / in_degree.clamp_min(1), torch.zeros_like(in_degree))
        self.fetch: Route | None = None
        self.pull_graph: CSRGraph | None = None
        self.weights: CSRGraph

    @property
    def num_rows(self) -> int:
        """``L + H``: owned and halo rows."""
        return int(self.node_ids.shape[0])

    def _sources_route(self, indices: np.ndarray) -> Route:
        """The owner -> holder route of the halo rows ``indices`` reads."""
        used = np.unique(indices)
        return _route(self.comm, self.owners, self.node_ids, self.num_local, used[used >= self.num_local])

    def _fetched(self, x: Tensor) -> Tensor:
        """``x`` (owned rows) with the halo sources appended (every rank takes part in a fetch)."""
        if self.fetch is None or self.comm.world_size == 1:
            return x
        return Fetch.apply(x, self.fetch, self.num_rows, self.traffic)

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Aggregation], reduce: str) -> Tensor:
        """The layer's aggregation of the owned rows ``x``, completed with the peers' rows or partial sums."""
        raise NotImplementedError

    def _split_finish(self, out: Tensor, x: Tensor, agg: Aggregation, reduce: str) -> Tensor:
        """A split aggregation's owner-side end: a mean divides by the global in-degree, the self term once."""
        if reduce == "mean":
            out = out * self.inv_degree.to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
        if agg.self_weight is not None:
            sw = agg.self_weight[: self.num_local].to(out.dtype)
            out = out + sw.view(-1, *([1] * (out.dim() - 1))) * x[: self.num_local]
        return out

    def _refuse_max(self, reduce: str) -> None:
        if reduce == "max":
            raise TrellisUserError("max aggregation needs each maximum's edge at the owner and cannot be split "
                                   f"across parts: use a destination-owned partition ({', '.join(dst_methods())}) "
                                   "or --model-args '{\"aggregate\": \"mean\"}'")

    def describe(self) -> dict[str, Any]:
        """Rows this rank sends per fetch and per reduce."""
        return {"fetch_rows": 0 if self.fetch is None else self.fetch.rows_sent, "reduce_rows": 0}

    def attention(self) -> SplitAttention | None:
        """None: attention runs on the pull graph, whose view appends the halo rows (see the module docstring)."""
        return None


#: Layout ownership -> its exchange class. A new ownership is one subclass registered here.
OWNERSHIPS: dict[str, type[OwnershipExchange]] = {}


def register_ownership(cls: type[OwnershipExchange]) -> type[OwnershipExchange]:
    """Class decorator: ``cls`` serves layouts of ``cls.ownership``."""
    OWNERSHIPS[cls.ownership] = cls
    return cls


def dst_methods() -> list[str]:  # noqa: N802 - reads as the constant it stands for
    """Partitioning methods whose layouts hold every in-edge of a node at its owner (pull)."""
    return methods_of_ownership("dst")


@register_ownership
class PullExchange(OwnershipExchange):
    """Destination ownership: every in-edge of an owned row is here; halo sources are fetched, then one SpMM.

    The local graph is the part's pull graph with its halo rows grouped by owner, so the rows each owner
    sends land in one contiguous block (a fetch receives straight into its output: no scatter). Only the
    column ids change; each row's edges keep their order, so every sum is the single process's.
    """

    ownership, mode = "dst", "pull"

    def __init__(self, part: LocalGraph, comm: Comm, device: torch.device, traffic: Traffic) -> None:
        super().__init__(part, comm, device, traffic)
        #: Overlapped or stale schedules (:meth:`set_schedule`); None: blocking.
        self.split: PullSplit | None = None
        self.buffers: StaleBuffers | None = None
        graph = CSRGraph.from_partition(part)
        num_local = self.num_local
        order = np.argsort(self.owners, kind="stable")  # new halo position -> layout halo position
        new_of_old = np.empty_like(order)
        new_of_old[order] = np.arange(order.shape[0])
        local = np.concatenate([np.arange(num_local), num_local + new_of_old])
        rows = np.concatenate([np.arange(num_local), num_local + order])
        graph.indices = torch.from_numpy(local)[graph.indices]
        self.node_ids = self.node_ids[rows]
        graph.node_ids = torch.from_numpy(self.node_ids)
        assert graph.src_degree is not None
        graph.src_degree = graph.src_degree[torch.from_numpy(rows)]
        self.owners = self.owners[order]
        self.pull_graph = self.weights = graph.to(device)
        self.fetch = self._sources_route(self.pull_graph.indices.cpu().numpy())

    def set_schedule(self, overlap: bool, staleness: int) -> None:
        """Run training aggregations overlapped with their fetch, or on halo rows up to ``staleness`` epochs old.

        See :mod:`trellis.distributed.schedule`; ``staleness`` 0 without ``overlap`` is the blocking engine.
        """
        if (overlap or staleness > 0) and self.fetch is not None and self.comm.world_size > 1:
            self.split = PullSplit(self.weights, self.fetch)
            self.buffers = StaleBuffers(staleness) if staleness > 0 else None

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Aggregation], reduce: str) -> Tensor:
        """The single process's SpMM on the part's rows, after the halo sources arrive (or by the schedule)."""
        agg = aggregation_of(self.weights)
        ew, sw = agg.edge_weight, agg.self_weight
        trained = any(t is not None and t.requires_grad for t in (ew, sw))
        if self.split is not None and torch.is_grad_enabled() and reduce != "max" and not trained:
            rscale = inv_degree(self.weights, x.dtype) if reduce == "mean" else None
            return split_aggregate(x, ew, sw, rscale, self.split, self.traffic, self.buffers)
        return spmm(self.weights, self._fetched(x), ew, reduce=reduce, self_weight=sw)


class _SplitExchange(OwnershipExchange):
    """Ownerships that split a node's in-edges: partial sums of halo destinations travel to their owners."""

    def __init__(self, part: LocalGraph, comm: Comm, device: torch.device, traffic: Traffic) -> None:
        super().__init__(part, comm, device, traffic)
        indptr, indices = np.asarray(part.indptr), np.asarray(part.indices)
        degree = np.asarray(part.in_degree)
        with_edges = np.flatnonzero(np.diff(indptr[self.num_local:]) > 0) + self.num_local
        #: Owner -> holder route of the halo destinations, run backwards by the reduce.
        self.route = _route(comm, self.owners, self.node_ids, self.num_local, with_edges)
        self.weights = _csr(indptr, indices, self.num_rows, device, src_degree=degree, dst_degree=degree)
        self.indices = indices
        self._part, self._device = part, device
        self._attention: SplitAttention | None = None

    def attention(self) -> SplitAttention:
        """The two-phase edge softmax's exchanges over this part's edges (built on first use)."""
        if self._attention is None:
            part = self._part
            ef = None if part.edge_feat is None else np.asarray(part.edge_feat, dtype=np.float32)
            sources = self.num_rows if self.fetch is not None else self.num_local  # push: owned sources only
            graph = _csr(np.asarray(part.indptr), self.indices, sources, self._device,
                         node_ids=self.node_ids, edge_ids=np.asarray(part.edge_ids, dtype=np.int64),
                         edge_feat=None if ef is None else ef.reshape(ef.shape[0], -1))
            self._attention = SplitAttention(graph, self.num_local, self.route, self.fetch, self.traffic)
        return self._attention

    def describe(self) -> dict[str, Any]:
        """Rows this rank sends per fetch and per reduce."""
        return {**super().describe(), "reduce_rows": self.route.reversed().rows_sent}


@register_ownership
class PushExchange(_SplitExchange):
    """Source ownership: sums over the part's out-edges; halo destinations' partial sums go to their owners."""

    ownership, mode = "src", "push"

    def __init__(self, part: LocalGraph, comm: Comm, device: torch.device, traffic: Traffic) -> None:
        super().__init__(part, comm, device, traffic)
        if self.indices.size and int(self.indices.max()) >= self.num_local:
            raise TrellisUserError(f"part {part.part}: out-edges from halo rows in a source-owned layout; "
                                   "re-run `trellis partition`")
        #: The same arrays as :attr:`weights`, over the owned sources only.
        self.local = CSRGraph(self.weights.indptr, self.weights.indices, self.num_local)

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Aggregation], reduce: str) -> Tensor:
        """Local partial sums, reduced at the owners."""
        self._refuse_max(reduce)
        agg = aggregation_of(self.weights)
        out = Reduce.apply(spmm(self.local, x, agg.edge_weight, reduce="sum"), self.route, self.num_local,
                           self.traffic)
        return self._split_finish(out, x, agg, reduce)


@register_ownership
class ReverseExchange(PushExchange):
    """Lotan's reverse placement: push forward, and the backward pass pushes partial gradients too.

    The backward runs on the layout's reversed in-edges (the part's pull graph of its sources) and sends
    halo sources' partial gradients to their owners: no gradient rows travel from owners to holders.
    """

    ownership, mode = "reverse", "reverse"

    def __init__(self, part: LocalGraph, comm: Comm, device: torch.device, traffic: Traffic) -> None:
        super().__init__(part, comm, device, traffic)
        self.pull = CSRGraph.from_partition(part).to(device)
        self.pull_route = self._sources_route(self.pull.indices.cpu().numpy())

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Aggregation], reduce: str) -> Tensor:
        """Push forward, pushed partial gradients backward."""
        self._refuse_max(reduce)
        agg = aggregation_of(self.weights)
        out = _PushForwardPullBackward.apply(x, agg.edge_weight, aggregation_of(self.pull).edge_weight, self)
        return self._split_finish(out, x, agg, reduce)


@register_ownership
class MirrorReduceExchange(_SplitExchange):
    """Vertex-cut: mirrors used as sources are fetched from their masters, mirrors' partial sums reduced there."""

    ownership, mode = "vertex-cut", "mirror-reduce"

    def __init__(self, part: LocalGraph, comm: Comm, device: torch.device, traffic: Traffic) -> None:
        super().__init__(part, comm, device, traffic)
        self.fetch = self._sources_route(self.indices)

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Aggregation], reduce: str) -> Tensor:
        """Fetch mirrors, local partial sums, reduce at the masters."""
        self._refuse_max(reduce)
        agg = aggregation_of(self.weights)
        partial = spmm(self.weights, self._fetched(x), agg.edge_weight, reduce="sum")
        out = Reduce.apply(partial, self.route, self.num_local, self.traffic)
        return self._split_finish(out, x, agg, reduce)


class _PushForwardPullBackward(torch.autograd.Function):
    """:class:`ReverseExchange`'s aggregation: push forward, pushed partial gradients backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ew: Tensor | None, ew_pull: Tensor | None, ex: ReverseExchange) -> Tensor:
        ctx.ex, ctx.ew_pull, ctx.layer = ex, ew_pull, ex.traffic.layer
        partial = spmm(ex.local, x, ew, reduce="sum")
        return reduce_rows(partial, ex.route, ex.num_local, ex.traffic, ctx.layer, "fwd")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        ex: ReverseExchange = ctx.ex
        rev = ex.pull.reverse()
        partial = prim_spmm_sum(rev, g.contiguous(), ctx.ew_pull, eid=ex.pull.perm)  # [L + H]: per source row
        gx = reduce_rows(partial, ex.pull_route, ex.num_local, ex.traffic, ctx.layer, "bwd")
        return gx, None, None, None


@dataclass
class RankGraph:
    """What one rank trains on.

    Attributes:
        graph: The graph GCN, SAGE and GIN layers run on: ``L`` owned rows in and out, its
            :class:`Exchange` completing each aggregation (at the plan's width).
        view: The view :attr:`graph` is run with: it only tells the byte counter which layer runs.
        pull_graph: Destination ownership only: the part's pull graph (``L`` rows over ``L + H``
            sources), for models that aggregate by themselves (attention) and need their input's halo rows.
        pull_view: The view :attr:`pull_graph` is run with: it appends those halo rows before each layer.
        mode: ``pull``, ``push``, ``reverse`` or ``mirror-reduce``.
        node_ids: ``int64 [L + H]`` global id of every local row (owned rows first).
        num_local: ``L``.
        traffic: Bytes sent per layer and direction.
        exchange: The ownership's exchange (the one :attr:`graph` carries).
    """

    graph: CSRGraph
    view: HaloView
    pull_graph: CSRGraph | None
    pull_view: HaloView | None
    mode: str
    node_ids: np.ndarray
    num_local: int
    traffic: Traffic
    exchange: OwnershipExchange

    def describe(self) -> dict[str, Any]:
        """Rows and routes, for the banner and the summary."""
        return {"mode": self.mode, "num_local": self.num_local,
                "num_halo": int(self.node_ids.shape[0]) - self.num_local, **self.exchange.describe()}


def _csr(indptr: np.ndarray, indices: np.ndarray, num_src: int, device: torch.device, **kw: Any) -> CSRGraph:
    return CSRGraph.from_numpy(np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64), num_src,
                               **kw).to(device)


def _route(comm: Comm, owners: np.ndarray, node_ids: np.ndarray, num_local: int, rows: np.ndarray) -> Route:
    """The owner -> holder route of the halo rows ``rows`` (``owners``: owner of every halo row)."""
    return Route.owner_to_holders(comm, node_ids, num_local, rows, owners[rows - num_local]).to(comm.device)


def build_rank_graph(part: LocalGraph, comm: Comm, device: torch.device) -> RankGraph:
    """The graph, views and exchange of ``part`` under its layout's ownership (see the module table).

    Collective: every rank calls it once, in the same order (routes are agreed by a handshake).
    """
    traffic = Traffic()
    ex = OWNERSHIPS[part.ownership](part, comm, device, traffic)
    num_local, node_ids = ex.num_local, ex.node_ids
    graph = CSRGraph(torch.zeros(num_local + 1, dtype=torch.int64, device=device),
                     torch.zeros(0, dtype=torch.int64, device=device), num_local,
                     node_ids=torch.from_numpy(node_ids[:num_local].copy()).to(device), exchange=ex)
    pull_view = HaloView(ex.fetch, ex.num_rows, traffic) if ex.pull_graph is not None else None
    return RankGraph(graph, HaloView(None, ex.num_rows, traffic), ex.pull_graph, pull_view, ex.mode, node_ids,
                     num_local, traffic, ex)
