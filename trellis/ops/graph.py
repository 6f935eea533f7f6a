"""The graph engine's one graph type: a CSR over local ids (a full graph, a sampled block, a cluster).

Why one type: full-batch, mini-batch, cluster-batch and a distributed partition with halo rows are all
"a CSR of in-edges over local ids plus the map to global ids" (GraphTheta's GraphView). Rows are
destination nodes (``num_dst``), column ids index source rows (``num_src`` ≥ ``num_dst`` for a
bipartite block whose first ``num_dst`` sources are the destinations themselves). The reverse CSR (rows =
sources) is what every aggregation's backward pass runs on; it keeps ``perm`` so per-edge data (weights,
features, attention) follows its edge. It is built once and cached on the object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from trellis.utils.csr import build_reverse_csr

if TYPE_CHECKING:
    from trellis.partition.layout import LocalGraph


@dataclass(frozen=True)
class Aggregation:
    """What a layer aggregates on one graph: ``reduce_j w_ij x_j (+ self_weight_i x_i)``.

    Attributes:
        edge_weight: ``[E]`` fixed per-edge weights (None = 1).
        self_weight: ``[num_dst]`` weight of each destination's own row, added after the reduction (None = none).
        reduce: ``sum``, ``mean`` or ``max``.
    """

    edge_weight: torch.Tensor | None
    self_weight: torch.Tensor | None
    reduce: str


class Exchange(Protocol):
    """Completes an aggregation whose in-edges are split across processes (a graph's :attr:`CSRGraph.exchange`).

    The executor hands it a layer's rows after the planner's transform and the layer's aggregation as a
    function of a graph (the exchange evaluates it on its own local graphs, so normalization sees the
    global degrees they carry); it returns the owned rows' aggregation, equal to the single process's.
    :mod:`trellis.distributed.ownership` implements one per edge ownership.
    """

    def aggregate(self, x: torch.Tensor, aggregation_of: Callable[[CSRGraph], Aggregation],
                  reduce: str) -> torch.Tensor:
        """The aggregation of the owned rows ``x`` (``sum``, ``mean`` or ``max``)."""
        ...

    def attention(self) -> SplitAttention | None:
        """How attention layers run where in-edges are split (None: on the graph as given)."""
        ...


class SplitAttention(Protocol):
    """An attention layer's exchanges where a destination's in-edges are split across processes.

    :mod:`trellis.distributed.attention` implements it (a two-phase edge softmax); GAT and GAT-E
    (:class:`trellis.nn.layers.GATConv`) run on it when their graph's exchange offers one.
    """

    #: The process's edges: ``L + H`` destination rows (owned rows with their self loops, then halo rows).
    graph: CSRGraph

    def sources(self, z: torch.Tensor) -> torch.Tensor:
        """Source rows of :attr:`graph` from the ``L`` owned rows ``z``."""
        ...

    def destinations(self, t: torch.Tensor) -> torch.Tensor:
        """``[L + H, ...]`` destination rows from the owned rows ``t``."""
        ...

    def softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each edge's softmax weight over all its destination's in-edges."""
        ...

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """``[L, ...]``: owned rows of the ``[L + H, ...]`` partial sums, completed with the other processes'."""
        ...


@dataclass(eq=False)
class CSRGraph:
    """CSR of in-edges: for destination ``i`` its sources are ``indices[indptr[i]:indptr[i+1]]``.

    Values that travel *between components* (a loader or a partition writes them, an operator reads them)
    are typed fields, so a producer and a consumer cannot disagree on a string key and ``to(device)``
    moves them with the graph: ``node_ids``, ``src_degree``, ``dst_degree`` and ``edge_ids``.
    ``cache`` holds only memos that a method of this module or of :mod:`trellis.ops` derives from the
    structure and may recompute at any time (``in_degree``, ``out_degree``, ``dst``, ``self_loops``,
    ``edge_map``, ``inv_degree:<dtype>``, ``row_norm``, ``gcn_norm:<bool>``, ``_coef``, ``_ones_<dtype>``,
    ``_row_chunks``); it is not moved by :meth:`to` and nobody outside ``ops`` should write to it.

    Attributes:
        indptr: ``int64 [num_dst + 1]``.
        indices: ``int64 [E]`` source ids in ``[0, num_src)``.
        num_src: Number of source rows (equals ``num_dst`` for a square graph).
        edge_weight: Optional ``float [E]`` weights in edge order.
        edge_feat: Optional ``float [E, D]`` edge features in edge order.
        node_ids: Optional ``int64 [num_src]`` local -> global id map (None for the full graph).
        rev: The reverse CSR (rows = sources), built on first use by :meth:`reverse`.
        perm: ``int64 [E]``: edge ``k`` of ``rev`` is edge ``perm[k]`` of this graph.
        cache: Internal memos (see above), computed once per graph.
        src_degree: Optional ``[num_src]`` *global* in-degree (without self loops) of each source row, set
            by a loader or a partition whose graph is a piece of a larger one, so that GCN's normalization
            (:func:`trellis.ops.norm.gcn_norm`) equals the whole graph's. None: the local degrees are used.
        dst_degree: Optional ``[num_dst]`` global in-degree of each destination row (same role).
        src_weighted_degree: Optional ``float64 [num_src]`` *global* weighted in-degree (the sum of the weights
            of each source row's in-edges, without self loops), for the weighted GCN's normalization on a piece
            whose destinations hold all their in-edges (exact inference's chunks). None: the weighted GCN uses
            the piece's own weights (DGL's convention on sampled blocks).
        edge_ids: Optional ``int64 [E]`` global id (into the store's CSR) of each local edge, so per-edge
            data (weights, features) can follow its edge into a subgraph; -1 for an edge that does not
            exist in the store (a self loop added by :meth:`with_self_loops`).
        exchange: Optional object that completes an aggregation whose in-edges are split across processes
            (a distributed rank under push or mirror-reduce ownership): layers hand it their aggregation
            (:func:`trellis.nn.executor.run_layer`) instead of calling :func:`trellis.ops.spmm` on this
            graph. None for a graph that holds every in-edge of its destinations.
        fixed_aggregation: Optional ``float [num_dst, F]``: a first layer's aggregation of this block's
            sources, computed once from the constant input features (undropped). A partition buffer keeps its
            rehearsal batches this way (:class:`trellis.loader.buffer.Kept`): the block then has no edges and
            its sources are only its destinations, whose rows the root terms read; a pushed-down layer
            (:func:`trellis.nn.executor.run_layer`) reads the aggregation instead of computing one. Only valid
            for the layer whose aggregation it is (the loader is told which, by the model).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src: int
    edge_weight: torch.Tensor | None = None
    edge_feat: torch.Tensor | None = None
    node_ids: torch.Tensor | None = None
    rev: CSRGraph | None = field(default=None, repr=False)
    perm: torch.Tensor | None = field(default=None, repr=False)
    cache: dict[str, Any] = field(default_factory=dict, repr=False)
    src_degree: torch.Tensor | None = field(default=None, repr=False, kw_only=True)
    dst_degree: torch.Tensor | None = field(default=None, repr=False, kw_only=True)
    src_weighted_degree: torch.Tensor | None = field(default=None, repr=False, kw_only=True)
    edge_ids: torch.Tensor | None = field(default=None, repr=False, kw_only=True)
    exchange: Exchange | None = field(default=None, repr=False, kw_only=True)
    fixed_aggregation: torch.Tensor | None = field(default=None, repr=False, kw_only=True)

    @property
    def num_dst(self) -> int:
        """Number of destination rows."""
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        """Number of edges (CSR positions)."""
        return int(self.indices.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of the structure (``indptr``)."""
        return self.indptr.device

    @classmethod
    def from_numpy(
        cls,
        indptr: np.ndarray,
        indices: np.ndarray,
        num_src: int | None = None,
        *,
        rev: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        edge_weight: np.ndarray | None = None,
        edge_feat: np.ndarray | None = None,
        node_ids: np.ndarray | None = None,
        src_degree: np.ndarray | None = None,
        dst_degree: np.ndarray | None = None,
        edge_ids: np.ndarray | None = None,
    ) -> CSRGraph:
        """Wrap numpy arrays (memory maps are copied into RAM once); ``rev`` reuses a cached reverse CSR.

        Ids become ``int64``, edge data and degrees ``float32`` (the dtypes the loaders give them too).
        """
        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            arr = np.ascontiguousarray(a)
            if not arr.flags.writeable:  # a read-only memory map: copy into RAM (torch needs writable memory)
                arr = np.array(arr)
            return torch.from_numpy(arr).to(dtype)

        def o(a: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
            return None if a is None else t(a, dtype)

        g = cls(t(indptr, torch.int64), t(indices, torch.int64),
                int(num_src if num_src is not None else len(indptr) - 1),
                edge_weight=o(edge_weight, torch.float32), edge_feat=o(edge_feat, torch.float32),
                node_ids=o(node_ids, torch.int64), src_degree=o(src_degree, torch.float32),
                dst_degree=o(dst_degree, torch.float32), edge_ids=o(edge_ids, torch.int64))
        if rev is not None:
            g.rev = CSRGraph(t(rev[0], torch.int64), t(rev[1], torch.int64), g.num_dst)
            g.perm = t(rev[2], torch.int64)
            g.rev.rev, g.rev.perm = g, None
        return g

    @classmethod
    def from_store(cls, store: Any) -> CSRGraph:
        """The full graph of a :class:`trellis.data.store.GraphStore`, with its cached reverse CSR."""
        return cls.from_numpy(store.indptr, store.indices, store.num_nodes, rev=store.reverse_csr(),
                              edge_weight=store.edge_weight, edge_feat=store.edge_feat)

    @classmethod
    def from_partition(cls, part: LocalGraph) -> CSRGraph:
        """The pull graph of one part of a partitioned layout, with global degrees and edge ids.

        Destinations are the part's owned rows; sources are its owned rows (first, same order) then its
        halo rows, whose values an exchange (the graph view between layers) must supply; ``node_ids`` maps
        every source row to its global id. ``src_degree`` / ``dst_degree`` are the *global* in-degrees, so
        GCN's normalization on the part equals the whole graph's on the same edges. See
        :meth:`trellis.partition.layout.LocalGraph.pull_csr` for the ownerships that have a pull graph.
        """
        p = part.pull_csr()
        return cls.from_numpy(p.indptr, p.indices, p.num_src, edge_weight=p.edge_weight, edge_feat=p.edge_feat,
                              node_ids=p.node_ids, src_degree=p.in_degree, dst_degree=p.in_degree[: p.num_local],
                              edge_ids=p.edge_ids)

    def reverse(self) -> CSRGraph:
        """The reverse CSR (rows = sources); ``self.perm`` maps its edges to this graph's edge ids."""
        if self.rev is None:
            rip, rix, perm = build_reverse_csr(self.indptr.cpu().numpy(), self.indices.cpu().numpy(),
                                               self.num_src)
            dev = self.device
            self.rev = CSRGraph(torch.from_numpy(rip).to(dev), torch.from_numpy(rix).to(dev), self.num_dst)
            self.perm = torch.from_numpy(perm).to(dev)
            self.rev.rev = self
        elif self.perm is None and self.rev.perm is not None:
            # This graph is itself a reverse CSR: its perm is the inverse of its forward graph's, so an
            # aggregation over it (and that aggregation's backward) maps edge data correctly too.
            fwd_perm = self.rev.perm
            self.perm = torch.empty_like(fwd_perm)
            self.perm[fwd_perm] = torch.arange(fwd_perm.shape[0], device=fwd_perm.device)
        return self.rev

    def edge_perm(self) -> torch.Tensor:
        """This graph's edge id of each edge of :meth:`reverse` (builds the reverse CSR when needed)."""
        self.reverse()
        assert self.perm is not None
        return self.perm

    def in_degree(self) -> torch.Tensor:
        """Number of in-edges per destination (float32, cached)."""
        if "in_degree" not in self.cache:
            self.cache["in_degree"] = (self.indptr[1:] - self.indptr[:-1]).to(torch.float32)
        return self.cache["in_degree"]

    def out_degree(self) -> torch.Tensor:
        """Number of out-edges per source (float32, cached)."""
        if "out_degree" not in self.cache:
            self.cache["out_degree"] = torch.bincount(self.indices, minlength=self.num_src).to(torch.float32)
        return self.cache["out_degree"]

    def dst_of_edges(self) -> torch.Tensor:
        """Destination id of every edge (``int64 [E]``, cached); used by per-edge tensor paths."""
        if "dst" not in self.cache:
            self.cache["dst"] = torch.repeat_interleave(
                torch.arange(self.num_dst, device=self.device), self.indptr[1:] - self.indptr[:-1])
        return self.cache["dst"]

    def with_self_loops(self) -> CSRGraph:
        """This graph with exactly one self loop per destination (existing ones dropped), cached.

        Attention layers need the self edge inside the softmax, so it cannot be folded into a diagonal
        term the way GCN's is. Edge features of the new self loops are zeros; ``cache["edge_map"]`` of the
        result gives each new edge's id in this graph (-1 for added loops). The typed fields follow:
        ``edge_ids`` of kept edges are this graph's, of added loops -1 (they are in no store); ``node_ids``,
        ``src_degree`` and ``dst_degree`` are this graph's unchanged, because the degrees describe the
        graph without self loops (GCN counts its loop separately, see :func:`trellis.ops.norm.gcn_norm`).
        """
        if "self_loops" in self.cache:
            return self.cache["self_loops"]
        dst, src = self.dst_of_edges(), self.indices
        keep = torch.nonzero(src != dst).flatten()
        loops = torch.arange(self.num_dst, device=self.device)
        new_dst = torch.cat([dst[keep], loops])
        order = torch.sort(new_dst, stable=True).indices
        edge_map = torch.cat([keep, torch.full_like(loops, -1)])[order]
        counts = torch.bincount(new_dst, minlength=self.num_dst)
        indptr = torch.zeros(self.num_dst + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        g = CSRGraph(indptr, torch.cat([src[keep], loops])[order], self.num_src, node_ids=self.node_ids,
                     src_degree=self.src_degree, dst_degree=self.dst_degree)
        real = edge_map >= 0
        if self.edge_ids is not None:
            g.edge_ids = torch.full_like(edge_map, -1)
            g.edge_ids[real] = self.edge_ids[edge_map[real]]
        for name in ("edge_weight", "edge_feat"):
            value = getattr(self, name)
            if value is not None:
                new = value.new_zeros((g.num_edges, *value.shape[1:]))
                new[real] = value[edge_map[real]]
                setattr(g, name, new)
        g.cache["edge_map"] = edge_map
        g.cache["self_loops"] = g
        self.cache["self_loops"] = g
        return g

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> CSRGraph:
        """A copy on ``device``: structure, edge data and the typed fields (the reverse CSR moves with it).

        ``cache`` is not copied: its memos are recomputed on the new device when first asked for.
        ``non_blocking`` as in :meth:`torch.Tensor.to` (asynchronous only from page-locked memory).
        """
        device = torch.device(device)
        if device == self.device:
            return self

        def mv(a: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None else a.to(device, non_blocking=non_blocking)

        nb = non_blocking
        g = CSRGraph(self.indptr.to(device, non_blocking=nb), self.indices.to(device, non_blocking=nb), self.num_src,
                     mv(self.edge_weight), mv(self.edge_feat), mv(self.node_ids), src_degree=mv(self.src_degree),
                     dst_degree=mv(self.dst_degree), edge_ids=mv(self.edge_ids), exchange=self.exchange,
                     src_weighted_degree=mv(self.src_weighted_degree),
                     fixed_aggregation=mv(self.fixed_aggregation))
        if self.rev is not None:
            g.rev = CSRGraph(self.rev.indptr.to(device, non_blocking=nb), self.rev.indices.to(device, non_blocking=nb),
                             self.num_dst)
            g.perm = mv(self.perm)
            g.rev.rev = g
        return g
