"""A rank's graph, its graph view and its exchange, one per edge ownership of the partitioned layout.

Every ownership becomes two optional halo exchanges around the same local SpMM (see :mod:`trellis.dist.halo`):

=============  ======================================  =============================================
ownership      before the layer (graph view: Fetch)    after the local aggregation (exchange: Reduce)
=============  ======================================  =============================================
dst (pull)     halo sources, from their owners          —
src (push)     —                                        partial sums of halo destinations, to owners
reverse        —                                        as push; backward pushes partial gradients
                                                        computed on the layout's reversed in-edges
vertex-cut     mirrors used as sources, from masters    mirrors' partial sums, to masters
=============  ======================================  =============================================

A pull rank's layer-facing graph is the part's pull graph (:meth:`CSRGraph.from_partition`), and the
layers run on it unchanged: the view appends the halo rows. The other ownerships split a node's in-edges
across parts, so their graph carries an :class:`PartialAggregation` as its exchange: the layers hand it
their aggregation (:func:`trellis.nn.executor.aggregate`) and it runs the local SpMM over every row the
part holds edges for, sends the halo rows' partial sums to their owners, and adds the self term once, at
the owner. Normalization always uses the layout's global degrees: GCN's weights come from the layer's own
``gcn_norm`` on a graph carrying them, and mean is a sum divided by the global in-degree after the
reduction. Max needs the argmax's edge at the owner and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trellis.dist.comm import Comm
from trellis.dist.halo import Fetch, Reduce, Route, Traffic, reduce_rows
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
    """Lotan's reverse placement: forward pushes partial sums over out-edges; backward pushes partial
    gradients over the reversed in-edges (no gradient rows travel from owners to holders)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ew: Tensor | None, ew_pull: Tensor | None, ex: PartialAggregation) -> Tensor:
        ctx.ex, ctx.ew_pull, ctx.layer = ex, ew_pull, ex.traffic.layer
        partial = spmm(ex.local, x, ew, reduce="sum")
        return reduce_rows(partial, ex.route, ex.num_local, ex.traffic, ctx.layer, "fwd")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        ex: PartialAggregation = ctx.ex
        assert ex.pull is not None and ex.pull_route is not None
        rev = ex.pull.reverse()
        partial = prim_spmm_sum(rev, g.contiguous(), ctx.ew_pull, eid=ex.pull.perm)  # [L + H]: per source row
        gx = reduce_rows(partial, ex.pull_route, ex.num_local, ex.traffic, ctx.layer, "bwd")
        return gx, None, None, None


class PartialAggregation:
    """The exchange of a rank whose parts split nodes' in-edges (push, reverse, mirror-reduce).

    Args:
        local: CSR of every row the part holds edges for (``L + H`` destination rows), over the rows the
            layer's input has (``L``, or ``L + H`` when the view fetched halo sources).
        weights: The same edges with ``L + H`` source rows and the global degrees: what the layer's
            aggregation (GCN's norm) is computed on.
        route: Owner -> holder route of the halo destinations (reduce runs it backwards).
        in_degree: ``float [L]`` global in-degree of the owned rows (mean divides by it).
        traffic: Byte counter.
        pull, pull_route: Reverse ownership only: the pull graph on the reversed in-edges and the route
            of its halo sources, for the backward pass.
    """

    def __init__(self, local: CSRGraph, weights: CSRGraph, route: Route, in_degree: Tensor, traffic: Traffic,
                 pull: CSRGraph | None = None, pull_route: Route | None = None) -> None:
        self.local, self.weights, self.route, self.traffic = local, weights, route, traffic
        self.num_local = int(in_degree.shape[0])
        self.inv_degree = torch.where(in_degree > 0, 1.0 / in_degree.clamp_min(1), torch.zeros_like(in_degree))
        self.pull, self.pull_route = pull, pull_route

    def aggregate(self, x: Tensor, aggregation_of: Callable[[CSRGraph], Any], reduce: str) -> Tensor:
        """The layer's aggregation of ``x`` on the owned rows, completed with the peers' partial sums."""
        if reduce == "max":
            raise TrellisUserError("max aggregation needs each maximum's edge at the owner and cannot be split "
                                   "across parts: use a destination-owned partition (metis, grem, ldg, fennel, "
                                   "random, hash-dst) or --model-args '{\"aggregate\": \"mean\"}'")
        agg = aggregation_of(self.weights)
        ew = agg.edge_weight
        if self.pull is None:
            partial = spmm(self.local, x, ew, reduce="sum")
            out = Reduce.apply(partial, self.route, self.num_local, self.traffic)
        else:
            ew_pull = aggregation_of(self.pull).edge_weight
            out = _PushForwardPullBackward.apply(x, ew, ew_pull, self)
        if reduce == "mean":
            out = out * self.inv_degree.to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
        if agg.self_weight is not None:
            sw = agg.self_weight[: self.num_local].to(out.dtype)
            out = out + sw.view(-1, *([1] * (out.dim() - 1))) * x[: self.num_local]
        return out


@dataclass
class RankGraph:
    """What one rank trains on: the layer-facing graph, its view and the byte counter.

    Attributes:
        graph: The graph every layer runs on (``num_dst = L`` owned rows).
        view: Supplies each layer's input rows.
        mode: ``pull``, ``push``, ``reverse`` or ``mirror-reduce``.
        node_ids: ``int64 [L + H]`` global id of every local row (owned rows first).
        traffic: Bytes sent per layer and direction.
    """

    graph: CSRGraph
    view: HaloView
    mode: str
    node_ids: np.ndarray
    num_local: int
    traffic: Traffic

    def describe(self) -> dict[str, Any]:
        """Rows and routes, for the run's summary."""
        v = self.view.route
        ex = self.graph.exchange
        return {"mode": self.mode, "num_local": self.num_local, "num_halo": int(self.node_ids.shape[0]) - self.num_local,
                "fetch_rows": 0 if v is None else v.rows_sent,
                "reduce_rows": 0 if ex is None else ex.route.reversed().rows_sent}


def _csr(indptr: np.ndarray, indices: np.ndarray, num_src: int, device: torch.device, **kw: Any) -> CSRGraph:
    return CSRGraph.from_numpy(np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64), num_src,
                               **kw).to(device)


def _route(comm: Comm, part: LocalGraph, node_ids: np.ndarray, rows: np.ndarray) -> Route:
    num_local = part.num_local
    owners = np.asarray(part.halo_owner)[rows - num_local]
    return Route.owner_to_holders(comm, node_ids, num_local, rows, owners)


def build_rank_graph(part: LocalGraph, comm: Comm, device: torch.device) -> RankGraph:
    """The graph, view and exchange of ``part`` under its layout's ownership (see the module table).

    Collective: every rank calls it once, in the same order (routes are agreed by a handshake).
    """
    mode = MODES[part.ownership]
    traffic = Traffic()
    node_ids = np.asarray(part.local_to_global, dtype=np.int64)
    num_local, num_rows = part.num_local, part.num_nodes
    degree = np.asarray(part.in_degree)
    if mode == "pull":
        graph = CSRGraph.from_partition(part).to(device)
        sources = np.unique(np.asarray(graph.indices.cpu().numpy()))
        fetch = _route(comm, part, node_ids, sources[sources >= num_local]).to(device)
        return RankGraph(graph, HaloView(fetch, num_rows, traffic), mode, node_ids, num_local, traffic)
    indptr, indices = np.asarray(part.indptr), np.asarray(part.indices)
    with_edges = np.flatnonzero(np.diff(indptr[num_local:]) > 0) + num_local
    route = _route(comm, part, node_ids, with_edges).to(device)
    deg = degree
    weights = _csr(indptr, indices, num_rows, device, src_degree=deg, dst_degree=deg)
    fetch = None
    num_src = num_local
    pull = pull_route = None
    if mode == "mirror-reduce":
        used = np.unique(indices)
        fetch = _route(comm, part, node_ids, used[used >= num_local]).to(device)
        num_src = num_rows
        local = weights
    else:
        if indices.size and int(indices.max()) >= num_local:
            raise TrellisUserError(f"part {part.part}: out-edges from halo rows in a source-owned layout; re-run "
                                   "`trellis partition`")
        local = _csr(indptr, indices, num_local, device)
        if mode == "reverse":
            pull = CSRGraph.from_partition(part).to(device)
            sources = np.unique(pull.indices.cpu().numpy())
            pull_route = _route(comm, part, node_ids, sources[sources >= num_local]).to(device)
    owned_degree = torch.from_numpy(degree[:num_local].astype(np.float32)).to(device)
    ex = PartialAggregation(local, weights, route, owned_degree, traffic, pull, pull_route)
    a = int(indptr[num_local])
    graph = CSRGraph.from_numpy(indptr[: num_local + 1].astype(np.int64), indices[:a].astype(np.int64), num_src,
                                node_ids=node_ids[:num_src]).to(device)
    graph.exchange = ex
    return RankGraph(graph, HaloView(fetch, num_rows, traffic), mode, node_ids, num_local, traffic)
