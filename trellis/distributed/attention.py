"""Attention (GAT, GAT-E) where a node's in-edges are split across ranks: a two-phase edge softmax.

Under push, reverse and vertex-cut ownership a destination's in-edges live on several ranks, so no rank can
normalize its attention alone. Each rank holds its part's edges as a CSR over ``L + H`` destination rows
(owned rows with one self loop each, as :meth:`CSRGraph.with_self_loops` gives the single process, then halo
destinations), and:

1. scores its edges: the source side from its sources (owned rows; under vertex-cut, mirrors fetched from
   their masters), the destination side of halo destinations fetched from their owners;
2. **max**: takes each destination's partial maximum over its edges, reduces it at the owner (max) and sends
   it back. It is only a shift for stability (the softmax does not depend on it), so it carries no gradient;
3. **sum**: sums ``exp(score - max)`` per destination, reduces the partial sums at the owner (sum) and sends
   the total back; ``alpha = exp(score - max) / total``;
4. aggregates ``alpha``-weighted sources per destination and reduces the partial sums at the owners.

Steps 1, 3 and 4 run through the autograd exchanges of :mod:`trellis.distributed.halo` (fetch and reduce),
so the backward pass is exact by construction. The result equals the single process's up to the order of
floating-point sums. Dropout on ``alpha`` is keyed by each edge's position in the whole graph's self-looped
CSR (:func:`edge_keys`), so ranks draw the single process's masks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from trellis.distributed.comm import Comm
from trellis.distributed.halo import Fetch, Reduce, Route, Traffic, spread_rows
from trellis.ops.graph import CSRGraph


def owned_self_loops(graph: CSRGraph, num_local: int) -> CSRGraph:
    """``graph`` (rows ``L + H``) with existing self loops dropped and one appended to each of the ``L`` owned rows.

    As :meth:`CSRGraph.with_self_loops` for the owned rows (a loop closes its row, edge features of loops
    are zeros, ``edge_ids`` -1); halo rows get none: their loop is their owner's.
    """
    dst, src = graph.dst_of_edges(), graph.indices
    keep = torch.nonzero(src != dst).flatten()
    loops = torch.arange(num_local, device=graph.indptr.device)
    new_dst = torch.cat([dst[keep], loops])
    order = torch.sort(new_dst, stable=True).indices
    edge_map = torch.cat([keep, torch.full_like(loops, -1)])[order]
    counts = torch.bincount(new_dst, minlength=graph.num_dst)
    indptr = torch.zeros(graph.num_dst + 1, dtype=torch.int64, device=graph.indptr.device)
    torch.cumsum(counts, 0, out=indptr[1:])
    out = CSRGraph(indptr, torch.cat([src[keep], loops])[order], graph.num_src, node_ids=graph.node_ids)
    real = edge_map >= 0
    if graph.edge_ids is not None:
        out.edge_ids = torch.full_like(edge_map, -1)
        out.edge_ids[real] = graph.edge_ids[edge_map[real]]
    if graph.edge_feat is not None:
        ef = graph.edge_feat.new_zeros((out.num_edges, *graph.edge_feat.shape[1:]))
        ef[real] = graph.edge_feat[edge_map[real]]
        out.edge_feat = ef
    return out


class SplitAttention:
    """The exchanges of one rank's attention over split in-edges (see the module docstring).

    Args:
        graph: The part's local CSR: ``L + H`` destination rows over its source rows, with ``edge_ids``
            (global, into the store's CSR) and ``edge_feat`` when the store has them.
        num_local: ``L``.
        route: Owner -> holder route of the halo destinations that have edges here.
        fetch: Owner -> holder route of the halo sources (vertex-cut), or None (sources are owned rows).
        traffic: Byte counter.
    """

    def __init__(self, graph: CSRGraph, num_local: int, route: Route, fetch: Route | None,
                 traffic: Traffic) -> None:
        self.graph = owned_self_loops(graph, num_local)
        self.num_local, self.route, self.fetch, self.traffic = num_local, route, fetch, traffic
        #: Store ids of the self-loop edges this part held (dropped here, as one process drops them).
        self.loop_eids = self_loop_eids(graph)
        self.dst = self.graph.dst_of_edges()

    @property
    def num_rows(self) -> int:
        """``L + H`` destination rows."""
        return self.graph.num_dst

    def sources(self, z: Tensor) -> Tensor:
        """Source rows of the local edges from the owned rows ``z`` (mirrors fetched under vertex-cut)."""
        if self.fetch is None or self.route.comm.world_size == 1:
            return z
        return Fetch.apply(z, self.fetch, self.graph.num_src, self.traffic)

    def destinations(self, t: Tensor) -> Tensor:
        """``[L + H, ...]``: the owned rows ``t`` with the halo destinations' rows fetched from their owners."""
        if self.route.comm.world_size == 1:
            return t
        return Fetch.apply(t, self.route, self.num_rows, self.traffic)

    def reduce(self, partial: Tensor) -> Tensor:
        """``[L, ...]``: the owned rows of ``partial`` (``[L + H, ...]``) plus the holders' partial sums."""
        if self.route.comm.world_size == 1:
            return partial[: self.num_local]
        return Reduce.apply(partial, self.route, self.num_local, self.traffic)

    def _row_max(self, logits: Tensor) -> Tensor:
        """Each destination's maximum score over all its in-edges, on every rank that holds the row (no grad)."""
        with torch.no_grad():
            heads = logits.shape[1:]
            flat = logits.detach().reshape(logits.shape[0], -1)
            m = flat.new_full((self.num_rows, flat.shape[1]), -torch.inf)
            m.scatter_reduce_(0, self.dst.view(-1, 1).expand_as(flat), flat, "amax")
            if self.route.comm.world_size > 1:
                back = self.route.reversed()  # holders -> owners
                got = back.send(m.contiguous())
                owned = m[: self.num_local].clone()
                if got.shape[0]:
                    owned.index_reduce_(0, back.recv_idx, got, "amax")
                m = spread_rows(owned, self.route, self.num_rows, self.traffic, self.traffic.layer, "fwd")
            return m.view(self.num_rows, *heads)

    def softmax(self, logits: Tensor) -> Tensor:
        """``alpha [E, ...]``: each edge's softmax weight over its destination's in-edges on every rank."""
        e = torch.exp(logits - self._row_max(logits).index_select(0, self.dst))
        partial = e.new_zeros((self.num_rows, *e.shape[1:])).index_add(0, self.dst, e)
        total = self.destinations(self.reduce(partial))
        return e / total.index_select(0, self.dst)


def self_loop_eids(graph: CSRGraph) -> np.ndarray:
    """Store ids of ``graph``'s self-loop edges (local source = local destination), which attention drops."""
    if graph.edge_ids is None:
        return np.empty(0, np.int64)
    return graph.edge_ids[graph.indices == graph.dst_of_edges()].cpu().numpy()


def edge_keys(comm: Comm, looped: CSRGraph, loop_eids: np.ndarray, store_indptr: np.ndarray) -> np.ndarray:
    """Position of each edge of a rank's self-looped graph in the whole graph's self-looped CSR.

    ``looped`` is a rank's attention graph (a pull graph's :meth:`CSRGraph.with_self_loops`, or
    :attr:`SplitAttention.graph`): ``edge_ids`` of kept edges, -1 for added loops, and ``node_ids`` of its rows;
    ``loop_eids`` the store ids of the self-loop edges it dropped. In :meth:`CSRGraph.with_self_loops` of the
    store's CSR, row ``v`` holds its in-edges that are not self loops, in store order, then its loop; so a kept
    edge ``e`` of row ``v`` sits at ``e - SL(e) + v`` and the loop of ``v`` at ``indptr[v + 1] - SL(indptr[v + 1])
    + v``, where ``SL(k)`` counts the store's self-loop edges with id below ``k``. Those are spread over the
    ranks: one all-gather of their ids. Collective.
    """
    assert looped.edge_ids is not None and looped.node_ids is not None
    dst = looped.node_ids[looped.dst_of_edges()].cpu().numpy()
    eid = looped.edge_ids.cpu().numpy()
    mine = torch.from_numpy(np.ascontiguousarray(loop_eids, dtype=np.int64))
    loops = np.sort(torch.cat(comm.all_gather_rows(mine)).numpy())
    indptr = np.asarray(store_indptr, dtype=np.int64)
    keys = np.empty(eid.shape[0], dtype=np.int64)
    real = eid >= 0
    keys[real] = eid[real] - np.searchsorted(loops, eid[real]) + dst[real]
    ends = indptr[dst[~real] + 1]
    keys[~real] = ends - np.searchsorted(loops, ends) + dst[~real]
    return keys
