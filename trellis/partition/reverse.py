"""Lotan's GNN-centric partitioning (Lotan §5.1, "Reverse Graph Backpropagation").

Start from 1D source hashing: nodes hashed to parts, every edge kept with its source. Forward
propagation then ships one vector per (remote destination, part) — the per-part partial aggregate. But
back-propagation runs the other way, and under source ownership the gradients arriving for a node are
per-edge maps, ``d`` times larger than the forward vectors. Lotan's fix: place the nodes by hashing the
**reversed** graph's nodes, and partition the reversed graph's edges by *their* source too — i.e. every
original edge is kept with its source for the forward pass, and a reversed copy is kept with its
destination for the backward pass, which runs on the reverse graph. Both directions then exchange single
vectors, never per-edge maps.

Node placement is a function of node ids only, so it equals the hash placement; what differs is the
ownership (``reverse``), which the layout honours by storing both the forward edges of each part's nodes
(rows = destinations, halo included) and the reversed in-edges (rows = sources, halo included), and which
the quality report prices (see :func:`trellis.partition.quality.exchange_bytes`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.partition.base import Partitioner, register
from trellis.partition.hashing import hash_parts


@register("reverse")
class ReversePartitioner(Partitioner):
    """Hash node placement of the reversed graph; edges with their source in both directions."""

    ownership = "reverse"
    balanced = False

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """The same node hash as ``hash``; only the ``reverse`` ownership differs, so no extra params."""
        return hash_parts(store.num_nodes, self.num_parts, self.seed), {}
