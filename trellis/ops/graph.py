"""The graph engine's one graph type: a CSR over local ids (a full graph, a sampled block, a cluster).

Why one type: full-batch, mini-batch, cluster-batch and a distributed partition with halo rows are all
"a CSR of in-edges over local ids plus the map to global ids" (GraphTheta's GraphView). Rows are
destination nodes (``num_dst``), column ids index source rows (``num_src`` ≥ ``num_dst`` for a
bipartite block whose first ``num_dst`` sources are the destinations themselves). The reverse CSR (rows =
sources) is what every aggregation's backward pass runs on; it keeps ``perm`` so per-edge data (weights,
features, attention) follows its edge. It is built once and cached on the object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(eq=False)
class CSRGraph:
    """CSR of in-edges: for destination ``i`` its sources are ``indices[indptr[i]:indptr[i+1]]``.

    Attributes:
        indptr: ``int64 [num_dst + 1]``.
        indices: ``int64 [E]`` source ids in ``[0, num_src)``.
        num_src: Number of source rows (equals ``num_dst`` for a square graph).
        edge_weight: Optional ``float [E]`` weights in edge order.
        edge_feat: Optional ``float [E, D]`` edge features in edge order.
        node_ids: Optional ``int64 [num_src]`` local -> global id map (None for the full graph).
        cache: Derived per-graph values (normalizations, degrees, reverse CSR) computed once.
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

    @property
    def num_dst(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def device(self) -> torch.device:
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
    ) -> CSRGraph:
        """Wrap numpy arrays (memory maps are copied into RAM once); ``rev`` reuses a cached reverse CSR."""
        def t(a: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
            if a is None:
                return None
            arr = np.ascontiguousarray(a)
            if not arr.flags.writeable:  # a read-only memory map: copy into RAM (torch needs writable memory)
                arr = np.array(arr)
            return torch.from_numpy(arr).to(dtype)

        g = cls(t(indptr, torch.int64), t(indices, torch.int64),
                int(num_src if num_src is not None else len(indptr) - 1),
                edge_weight=t(edge_weight, torch.float32), edge_feat=t(edge_feat, torch.float32))
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

    def reverse(self) -> CSRGraph:
        """The reverse CSR (rows = sources); ``self.perm`` maps its edges to this graph's edge ids."""
        if self.rev is None:
            from trellis.data.store import build_reverse_csr

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
        result gives each new edge's id in this graph (-1 for added loops).
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
        g = CSRGraph(indptr, torch.cat([src[keep], loops])[order], self.num_src, node_ids=self.node_ids)
        real = edge_map >= 0
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

    def to(self, device: torch.device | str) -> CSRGraph:
        """A copy on ``device`` (the reverse CSR moves with it)."""
        device = torch.device(device)
        if device == self.device:
            return self

        def mv(a: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None else a.to(device)

        g = CSRGraph(mv(self.indptr), mv(self.indices), self.num_src, mv(self.edge_weight),
                     mv(self.edge_feat), mv(self.node_ids))
        if self.rev is not None:
            g.rev = CSRGraph(mv(self.rev.indptr), mv(self.rev.indices), self.num_dst)
            g.perm = mv(self.perm)
            g.rev.rev = g
        return g
