"""A rank's graph, its graph view and its exchange, one per edge ownership of the partitioned layout.

Every ownership becomes two optional halo exchanges around the same local SpMM (see :mod:`trellis.distributed.halo`):

=============  ======================================  =============================================
ownership      before the layer (graph view: Fetch)    after the local aggregation (exchange: Reduce)
=============  ======================================  =============================================
dst (pull)     halo sources, from their owners          —
src (push)     —                                        partial sums of halo destinations, to owners
reverse        —                                        as push; backward pushes partial gradients
                                                        computed on the layout's reversed in-edges
vertex-cut     mirrors used as sources, from masters    mirrors' partial sums, to masters
=============  ======================================  =============================================

GCN, SAGE and GIN layers run on a graph of the ``L`` owned rows whose :class:`Exchange` completes each
aggregation (:func:`trellis.nn.executor.aggregate` hands it the layer's rows after the planner's transform,
so rows travel at the plan's width): it fetches halo sources, runs the local SpMM (under pull, the part's
pull graph, which holds every in-edge of its rows), sends halo destinations' partial sums to their owners
and adds the self term once, at the owner. Models that aggregate by themselves (GAT) run on the pull graph,
whose view appends the halo rows of each layer's input. Normalization always uses the layout's global
degrees: GCN's weights come from the layer's own ``gcn_norm`` on a graph carrying them, and a split mean
is a sum divided by the global in-degree after the reduction. Max needs the argmax's edge at the owner and
is refused where in-edges are split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trellis.distributed.comm import Comm
from trellis.distributed.halo import Fetch, Reduce, Route, Traffic, reduce_rows
from trellis.errors import TrellisUserError
from trellis.ops import spmm
from trellis.ops.graph import CSRGraph
from trellis.ops.spmm import prim_spmm_sum
from trellis.partition.layout import LocalGraph

#: The exchange each edge ownership uses.
MODES = {"dst": "pull", "src": "push", "reverse": "reverse", "vertex-cut": "mirror-reduce"}


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


class _PushForwardPullBackward(torch.autograd.Function):
    """Lotan's reverse placement: push forward, and backward pushes partial gradients too.

    Forward sums over the part's out-edges and sends halo destinations' partial sums to their owners;
    backward runs on the layout's reversed in-edges and sends halo sources' partial gradients to their
    owners (no gradient rows travel from owners to holders).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, ew: Tensor | None, ew_pull: Tensor | None, ex: Exchange) -> Tensor:
        ctx.ex, ctx.ew_pull, ctx.layer = ex, ew_pull, ex.traffic.layer
        assert ex.route is not None
        partial = spmm(ex.local, x, ew, reduce="sum")
        return reduce_rows(partial, ex.route, ex.num_local, ex.traffic, ctx.layer, "fwd")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        ex: Exchange = ctx.ex
        assert ex.pull is not None and ex.pull_route is not None
        rev = ex.pull.reverse()
        partial = prim_spmm_sum(rev, g.contiguous(), ctx.ew_pull, eid=ex.pull.perm)  # [L + H]: per source row
        gx = reduce_rows(partial, ex.pull_route, ex.num_local, ex.traffic, ctx.layer, "bwd")
        return gx, None, None, None


class Exchange:
    """How a rank completes a layer's aggregation with its peers (the graph's :attr:`CSRGraph.exchange`).

    The layers hand over their input rows *after* the planner's transform, so rows travel at the width
    the plan chose: ``Â(XW)`` exchanges ``XW``, ``(ÂX)W`` exchanges ``X``.

    Args:
        mode: ``pull``, ``push``, ``reverse`` or ``mirror-reduce``.
        local: CSR the local SpMM runs on: the pull graph (``L`` rows over ``L + H`` sources) under pull;
            every row the part holds edges for (``L + H`` rows) otherwise, over ``L`` sources (push,
            reverse) or ``L + H`` (mirror-reduce).
        weights: What the layer's aggregation (GCN's norm) is computed on: ``local`` with ``L + H``
            source rows and the global degrees.
        fetch: Owner -> holder route of the halo rows read as sources (pull, mirror-reduce).
        route: Owner -> holder route of the halo destinations, run backwards by the reduce (push,
            reverse, mirror-reduce).
        in_degree: ``float [L]`` global in-degree of the owned rows (a split mean divides by it).
        traffic: Byte counter.
        pull, pull_route: Reverse ownership only: the pull graph on the reversed in-edges and the route
            of its halo sources, for the backward pass.
    """

    def __init__(self, mode: str, local: CSRGraph, weights: CSRGraph, fetch: Route | None, route: Route | None,
                 in_degree: Tensor, traffic: Traffic, pull: CSRGraph | None = None,
                 pull_route: Route | None = None) -> None:
        self.mode, self.local, self.weights, self.fetch, self.route = mode, local, weights, fetch, route
        self.traffic = traffic
        self.num_local = int(in_degree.shape[0])
        self.inv_degree = torch.where(in_degree > 0, 1.0 / in_degree.clamp_min(1), torch.zeros_like(in_degree))
        self.pull, self.pull_route = pull, pull_route

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Any], reduce: str) -> Tensor:
        """The layer's aggregation of the owned rows ``x``, completed with the peers' rows or partial sums."""
        agg = aggregation_of(self.weights)
        rows = self.local.num_src
        if self.fetch is not None and self.fetch.comm.world_size > 1:  # (every rank must take part in a fetch)
            x = Fetch.apply(x, self.fetch, rows, self.traffic)
        if self.mode == "pull":  # every in-edge is here: the single process's SpMM on the part's rows
            return spmm(self.local, x, agg.edge_weight, reduce=reduce, self_weight=agg.self_weight)
        if reduce == "max":
            raise TrellisUserError("max aggregation needs each maximum's edge at the owner and cannot be split "
                                   "across parts: use a destination-owned partition (metis, grem, ldg, fennel, "
                                   "random, hash-dst) or --model-args '{\"aggregate\": \"mean\"}'")
        if self.pull is None:
            out = Reduce.apply(spmm(self.local, x, agg.edge_weight, reduce="sum"), self.route, self.num_local,
                               self.traffic)
        else:
            ew_pull = aggregation_of(self.pull).edge_weight
            out = _PushForwardPullBackward.apply(x, agg.edge_weight, ew_pull, self)
        if reduce == "mean":
            out = out * self.inv_degree.to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
        if agg.self_weight is not None:
            sw = agg.self_weight[: self.num_local].to(out.dtype)
            out = out + sw.view(-1, *([1] * (out.dim() - 1))) * x[: self.num_local]
        return out


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
    """

    graph: CSRGraph
    view: HaloView
    pull_graph: CSRGraph | None
    pull_view: HaloView | None
    mode: str
    node_ids: np.ndarray
    num_local: int
    traffic: Traffic

    def describe(self) -> dict[str, Any]:
        """Rows and routes, for the banner and the summary."""
        ex: Exchange = self.graph.exchange
        return {"mode": self.mode, "num_local": self.num_local,
                "num_halo": int(self.node_ids.shape[0]) - self.num_local,
                "fetch_rows": 0 if ex.fetch is None else ex.fetch.rows_sent,
                "reduce_rows": 0 if ex.route is None else ex.route.reversed().rows_sent}


def _csr(indptr: np.ndarray, indices: np.ndarray, num_src: int, device: torch.device, **kw: Any) -> CSRGraph:
    return CSRGraph.from_numpy(np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64), num_src,
                               **kw).to(device)


def _route(comm: Comm, owners: np.ndarray, node_ids: np.ndarray, num_local: int, rows: np.ndarray) -> Route:
    """The owner -> holder route of the halo rows ``rows`` (``owners``: owner of every halo row)."""
    return Route.owner_to_holders(comm, node_ids, num_local, rows, owners[rows - num_local]).to(comm.device)


def _halo_sources(comm: Comm, owners: np.ndarray, node_ids: np.ndarray, num_local: int,
                  indices: np.ndarray) -> Route:
    used = np.unique(indices)
    return _route(comm, owners, node_ids, num_local, used[used >= num_local])


def _pull_graph(part: LocalGraph, device: torch.device) -> tuple[CSRGraph, np.ndarray, np.ndarray]:
    """The part's pull graph with its halo rows grouped by owner: ``(graph, node_ids, halo owners)``.

    Why regroup: the rows each owner sends then land in one contiguous block of the local rows, so a fetch
    receives straight into its output (no receive buffer, no scatter). Only the column ids change; each
    row's edges keep their order, so every sum is the same as on the layout's order.
    """
    graph = CSRGraph.from_partition(part)
    num_local = part.num_local
    owners = np.asarray(part.halo_owner)
    order = np.argsort(owners, kind="stable")  # new halo position -> layout halo position
    new_of_old = np.empty_like(order)
    new_of_old[order] = np.arange(order.shape[0])
    local = np.concatenate([np.arange(num_local), num_local + new_of_old])
    rows = np.concatenate([np.arange(num_local), num_local + order])
    graph.indices = torch.from_numpy(local)[graph.indices]
    node_ids = np.asarray(part.local_to_global, dtype=np.int64)[rows]
    graph.node_ids = torch.from_numpy(node_ids)
    assert graph.src_degree is not None
    graph.src_degree = graph.src_degree[torch.from_numpy(rows)]
    return graph.to(device), node_ids, owners[order]


def build_rank_graph(part: LocalGraph, comm: Comm, device: torch.device) -> RankGraph:
    """The graph, view and exchange of ``part`` under its layout's ownership (see the module table).

    Collective: every rank calls it once, in the same order (routes are agreed by a handshake).
    """
    mode = MODES[part.ownership]
    traffic = Traffic()
    node_ids = np.asarray(part.local_to_global, dtype=np.int64)
    num_local, num_rows = part.num_local, part.num_nodes
    degree = np.asarray(part.in_degree)
    owned_degree = torch.from_numpy(degree[:num_local].astype(np.float32)).to(device)
    owners = np.asarray(part.halo_owner)
    pull_graph = pull = pull_route = route = fetch = None
    if mode == "pull":
        pull_graph, node_ids, owners = _pull_graph(part, device)
        local = weights = pull_graph
        fetch = _halo_sources(comm, owners, node_ids, num_local, pull_graph.indices.cpu().numpy())
    else:
        indptr, indices = np.asarray(part.indptr), np.asarray(part.indices)
        with_edges = np.flatnonzero(np.diff(indptr[num_local:]) > 0) + num_local
        route = _route(comm, owners, node_ids, num_local, with_edges)
        weights = _csr(indptr, indices, num_rows, device, src_degree=degree, dst_degree=degree)
        if mode == "mirror-reduce":
            local = weights
            fetch = _halo_sources(comm, owners, node_ids, num_local, indices)
        else:
            if indices.size and int(indices.max()) >= num_local:
                raise TrellisUserError(f"part {part.part}: out-edges from halo rows in a source-owned layout; "
                                       "re-run `trellis partition`")
            local = CSRGraph(weights.indptr, weights.indices, num_local)  # the same arrays, owned sources only
            if mode == "reverse":
                pull = CSRGraph.from_partition(part).to(device)
                pull_route = _halo_sources(comm, owners, node_ids, num_local, pull.indices.cpu().numpy())
    ex = Exchange(mode, local, weights, fetch, route, owned_degree, traffic, pull, pull_route)
    graph = CSRGraph(torch.zeros(num_local + 1, dtype=torch.int64, device=device),
                     torch.zeros(0, dtype=torch.int64, device=device), num_local,
                     node_ids=torch.from_numpy(node_ids[:num_local].copy()).to(device), exchange=ex)
    pull_view = HaloView(fetch, num_rows, traffic) if pull_graph is not None else None
    return RankGraph(graph, HaloView(None, num_rows, traffic), pull_graph, pull_view, mode, node_ids, num_local,
                     traffic)
