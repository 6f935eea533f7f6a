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
from trellis.partition.hash import mix64

_NODE_CHUNK = 1 << 22


def grid_shape(num_parts: int) -> tuple[int, int]:
    """``(R, C)`` with ``R * C = P`` and ``R`` the largest divisor of ``P`` not above ``sqrt(P)``."""
    r = int(np.floor(np.sqrt(num_parts)))
    while num_parts % r:
        r -= 1
    return r, num_parts // r


def _row_col(nodes: np.ndarray, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    h = mix64(nodes, seed)
    return (h % np.uint64(rows)).astype(np.int64), ((h // np.uint64(rows)) % np.uint64(cols)).astype(np.int64)


def grid_edge_parts(src: np.ndarray, dst: np.ndarray, rows: int, cols: int, seed: int) -> np.ndarray:
    """``int32``: part ``r(src) * C + c(dst)`` of each edge."""
    r_src, _ = _row_col(src, rows, cols, seed)
    _, c_dst = _row_col(dst, rows, cols, seed)
    return (r_src * cols + c_dst).astype(np.int32)


def grid_masters(num_nodes: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """``int32 [N]``: master part ``r(v) * C + c(v)`` of every node."""
    out = np.empty(num_nodes, dtype=np.int32)
    for a in range(0, num_nodes, _NODE_CHUNK):
        b = min(a + _NODE_CHUNK, num_nodes)
        r, c = _row_col(np.arange(a, b, dtype=np.int64), rows, cols, seed)
        out[a:b] = r * cols + c
    return out


@register("vertex-cut")
class VertexCutPartitioner(Partitioner):
    """2D grid hash over edges; node masters at the grid cell of their own row and column."""

    ownership = "vertex-cut"
    balanced = False

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        rows, cols = grid_shape(self.num_parts)
        return grid_masters(store.num_nodes, rows, cols, self.seed), {"grid": [rows, cols]}
