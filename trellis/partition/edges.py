"""Reading a store's edge list in bounded chunks: sequential ranges, shuffled blocks, rows of a node set.

Every partitioner and the layout writer read edges through these helpers so that no code path holds
the whole edge list: a chunk is at most ``chunk_edges`` edges, and the state kept between chunks is
O(N). The store is a CSR of in-edges sorted by destination; the destination of edge ``e`` is the row
``r`` with ``indptr[r] <= e < indptr[r+1]``, found by a binary search over ``indptr`` (kept in memory,
O(N)) and then a walk, in numba.

Why shuffled blocks: GREM's cut analysis (Armada §4.2) assumes edges arrive in random order; a stream
sorted by destination would show the seed step only the first few thousand nodes. A random
permutation of all edge ids would cost O(E) memory, so the edge list is cut into blocks of
``block_edges`` consecutive edges and the *blocks* are visited in a seeded random order: each chunk is
many small sequential reads from all over the graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from trellis.utils.numba import njit

#: Default upper bound on a block's size for the shuffled stream.
MAX_BLOCK_EDGES = 4096


@njit(cache=True, nogil=True)
def _fill_range(indptr: np.ndarray, indices: np.ndarray, e0: int, e1: int, src: np.ndarray,
                dst: np.ndarray, eid: np.ndarray, at: int) -> int:
    """Write edges ``[e0, e1)`` into ``src/dst/eid`` from ``at`` (``eid`` of length 0: not wanted)."""
    if e1 <= e0:
        return at
    lo, hi = 0, indptr.shape[0] - 1  # find the row r with indptr[r] <= e0 < indptr[r+1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if indptr[mid] <= e0:
            lo = mid
        else:
            hi = mid
    r = lo
    want_eid = eid.shape[0] > 0
    for e in range(e0, e1):
        while indptr[r + 1] <= e:
            r += 1
        src[at] = indices[e]
        dst[at] = r
        if want_eid:
            eid[at] = e
        at += 1
    return at


@njit(cache=True, nogil=True)
def _gather_blocks(indptr: np.ndarray, indices: np.ndarray, blocks: np.ndarray, block_edges: int,
                   num_edges: int, src: np.ndarray, dst: np.ndarray, eid: np.ndarray) -> int:
    at = 0
    for b in blocks:
        e0 = b * block_edges
        e1 = min(e0 + block_edges, num_edges)
        at = _fill_range(indptr, indices, e0, e1, src, dst, eid, at)
    return at


@njit(cache=True, nogil=True)
def _gather_rows(indptr: np.ndarray, nodes: np.ndarray, start_node: int, start_off: int, limit: int,
                 out: np.ndarray, rows: np.ndarray) -> tuple[int, int, int]:
    """Copy up to ``limit`` edge positions of the rows of ``nodes`` from ``(start_node, start_off)``.

    Returns ``(count, next_node, next_offset)``; a row longer than ``limit`` is split across calls, so a
    hub never makes a chunk larger than ``limit``.
    """
    k = 0
    i = start_node
    off = start_off
    while i < nodes.shape[0] and k < limit:
        v = nodes[i]
        a = indptr[v] + off
        b = indptr[v + 1]
        take = min(b - a, limit - k)
        for t in range(take):
            out[k + t] = a + t
            rows[k + t] = v
        k += take
        if a + take >= b:
            i += 1
            off = 0
        else:
            off += take
    return k, i, off


def edge_ranges(indptr: np.ndarray, indices: np.ndarray, chunk_edges: int
                ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(src, dst, eid)`` for consecutive ranges of at most ``chunk_edges`` edges, in CSR order."""
    num_edges = int(indices.shape[0])
    chunk_edges = max(1, int(chunk_edges))
    indptr = np.asarray(indptr)
    for e0 in range(0, num_edges, chunk_edges):
        e1 = min(e0 + chunk_edges, num_edges)
        src = np.empty(e1 - e0, dtype=np.int64)
        dst = np.empty(e1 - e0, dtype=np.int64)
        eid = np.empty(e1 - e0, dtype=np.int64)
        _fill_range(indptr, np.asarray(indices), e0, e1, src, dst, eid, 0)
        yield src, dst, eid


def default_block_edges(chunk_edges: int) -> int:
    """Block size for the shuffled stream: at least 64 blocks per chunk, at most 4096 edges per block."""
    return int(max(1, min(MAX_BLOCK_EDGES, chunk_edges // 64)))


def shuffled_chunks(indptr: np.ndarray, indices: np.ndarray, chunk_edges: int, *, seed: int,
                    block_edges: int | None = None, dtype: Any = np.int64
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(src, dst)`` chunks of about ``chunk_edges`` edges covering every edge once, blocks shuffled.

    The arrays are views of two buffers reused for every chunk (the stream allocates only once); copy
    them to keep a chunk past the next iteration.

    Args:
        indptr: In-edge CSR row pointers (``[N+1]``).
        indices: Source of each edge (``[E]``; a memory map is read block by block).
        chunk_edges: Edges per chunk; the last chunk may be smaller.
        seed: Seed of the block order (same seed, same stream).
        block_edges: Consecutive edges per block (default: :func:`default_block_edges`).
        dtype: Integer type of the yielded node ids (int32 halves the chunk when ``N < 2**31``).
    """
    num_edges = int(indices.shape[0])
    chunk_edges = max(1, int(chunk_edges))
    block_edges = int(block_edges or default_block_edges(chunk_edges))
    num_blocks = -(-num_edges // block_edges)
    order = np.random.default_rng(seed).permutation(num_blocks)
    per_chunk = max(1, chunk_edges // block_edges)
    indptr = np.asarray(indptr)
    indices = np.asarray(indices)
    cap = per_chunk * block_edges
    src = np.empty(cap, dtype=dtype)
    dst = np.empty(cap, dtype=dtype)
    eid = np.empty(0, dtype=np.int64)
    for c in range(0, num_blocks, per_chunk):
        n = _gather_blocks(indptr, indices, order[c:c + per_chunk], block_edges, num_edges, src, dst, eid)
        yield src[:n], dst[:n]


def num_shuffled_chunks(num_edges: int, chunk_edges: int, block_edges: int | None = None) -> int:
    """Number of chunks :func:`shuffled_chunks` yields (for progress bars)."""
    chunk_edges = max(1, int(chunk_edges))
    block_edges = int(block_edges or default_block_edges(chunk_edges))
    num_blocks = -(-num_edges // block_edges)
    per_chunk = max(1, chunk_edges // block_edges)
    return -(-num_blocks // per_chunk)


def row_edges(indptr: np.ndarray, nodes: np.ndarray, chunk_edges: int
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(positions, rows)``: CSR edge positions of the rows of ``nodes`` (in order), ≤ chunk_edges each.

    ``rows[k]`` is the row (node) that position ``positions[k]`` belongs to. Used to read the in-edges
    (forward CSR) or out-edges (reverse CSR) of one partition's nodes without reading the rest. The
    arrays are views of reused buffers, valid until the next iteration.
    """
    chunk_edges = max(1, int(chunk_edges))
    indptr = np.asarray(indptr)
    nodes = np.ascontiguousarray(nodes, dtype=np.int64)
    pos = np.empty(chunk_edges, dtype=np.int64)
    rows = np.empty(chunk_edges, dtype=np.int64)
    i = off = 0
    while i < nodes.shape[0]:
        k, i, off = _gather_rows(indptr, nodes, i, off, chunk_edges, pos, rows)
        if k:
            yield pos[:k], rows[:k]
