"""2D grid vertex-cut (GraphTheta §5.4, PowerGraph's grid): edges are hashed onto a ``R x C`` grid of parts.

Each node ``v`` hashes to a grid row ``r(v)`` and column ``c(v)``. Edge ``u -> v`` goes to part
``r(u) * C + c(v)``: all out-edges of ``u`` stay in grid row ``r(u)``, all in-edges of ``v`` in column
``c(v)``, so a node is replicated in at most ``R + C - 1`` parts whatever its degree — the reason to pick
vertex-cut for skewed degree distributions. The node's **master** is part ``r(v) * C + c(v)``, which lies in
both its row and column; every other part holding one of its edges keeps a **mirror** (the layout's halo,
with the master as owner). Edges are balanced by the hash; node masters only in expectation.

No ``[E]`` array is kept: the edge → part map is recomputed from the endpoints whenever needed
(:meth:`PartitionBook.edge_parts`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.partition.base import Partitioner, register
from trellis.partition.hashing import grid_masters, grid_shape


@register("vertex-cut")
class VertexCutPartitioner(Partitioner):
    """2D grid hash over edges; node masters at the grid cell of their own row and column."""

    ownership = "vertex-cut"
    balanced = False

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """Node masters at their grid cell; extra params record the ``[rows, cols]`` grid the edges hash onto."""
        rows, cols = grid_shape(self.num_parts)
        return grid_masters(store.num_nodes, rows, cols, self.seed), {"grid": [rows, cols]}
