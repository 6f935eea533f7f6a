"""Node hashing shared by the hash-based partitioners and the partition book (no ``[E]`` array is kept).

Why a module of its own: :class:`trellis.partition.base.PartitionBook` recomputes a vertex-cut edge's part
from its endpoints, and ``hash``/``vertex-cut`` place nodes with the same SplitMix64 hash; keeping these
pure functions here lets ``base``, ``hash`` and ``vertex_cut`` import them without importing each other.
"""

from __future__ import annotations

import numpy as np

__all__ = ["grid_edge_parts", "grid_masters", "grid_shape", "hash_parts", "mix64"]

_NODE_CHUNK = 1 << 22


def mix64(x: np.ndarray, seed: int) -> np.ndarray:
    """SplitMix64 finaliser of ``x + seed``: a fast, well-mixed ``uint64`` hash of integer ids."""
    z = np.asarray(x).astype(np.uint64) + np.uint64((int(seed) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_parts(num_nodes: int, num_parts: int, seed: int) -> np.ndarray:
    """``int32 [N]``: ``mix64(v, seed) mod P`` for every node id, computed in chunks."""
    out = np.empty(num_nodes, dtype=np.int32)
    for a in range(0, num_nodes, _NODE_CHUNK):
        b = min(a + _NODE_CHUNK, num_nodes)
        out[a:b] = (mix64(np.arange(a, b, dtype=np.uint64), seed) % np.uint64(num_parts)).astype(np.int32)
    return out


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
