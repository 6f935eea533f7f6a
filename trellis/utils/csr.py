"""CSR building blocks every layer shares: a stable counting argsort, the reverse CSR, row blocks.

Why a leaf module: the store's writer, the edge-list builder, the graph engine and the partitioners all
need the reverse CSR (the backward pass of every aggregation runs on it) and all walk a CSR in blocks of
rows. Four copies of each existed and ``trellis.data.csr`` and ``trellis.data.store`` imported each other
to share them. Everything here is a pure function of numpy arrays.

The reverse CSR is defined once: ``rev_perm = stable_argsort(indices)``, so each reverse row lists its
forward edges in ascending edge id (hence destination) order; the in-memory and the chunked builders
produce bit-identical arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from trellis.utils.numba import WITH_NUMBA, njit

__all__ = ["add_counts", "build_reverse_csr", "group_ranks", "reverse_csr_into", "row_blocks", "row_ranges",
           "row_segments", "stable_argsort"]


@njit(cache=True, nogil=True)
def _counting_argsort(keys: np.ndarray, num_keys: int) -> np.ndarray:  # pragma: no cover - compiled
    """Stable argsort of ``keys`` in ``[0, num_keys)`` by counting (O(n + num_keys))."""
    n = keys.shape[0]
    starts = np.zeros(num_keys + 1, dtype=np.int64)
    for i in range(n):
        starts[keys[i] + 1] += 1
    for k in range(num_keys):
        starts[k + 1] += starts[k]
    perm = np.empty(n, dtype=np.int64)
    for i in range(n):
        k = keys[i]
        perm[starts[k]] = i
        starts[k] += 1
    return perm


def stable_argsort(keys: np.ndarray, num_keys: int, *, use_numba: bool | None = None) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for int keys in ``[0, num_keys)``, as ``int64``.

    A counting sort, O(n + num_keys), when numba is active and the key range is not much larger than the
    array; numpy's stable argsort otherwise (same result).

    Args:
        keys: Integer keys in ``[0, num_keys)``.
        num_keys: One past the largest possible key.
        use_numba: Force (True) or forbid (False) the counting sort (default: :data:`WITH_NUMBA`).
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    fast = WITH_NUMBA if use_numba is None else use_numba and WITH_NUMBA
    if fast and keys.size > 1024 and num_keys <= 4 * keys.size + 1024:
        return _counting_argsort(keys, int(num_keys))
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def build_reverse_csr(indptr: np.ndarray, indices: np.ndarray, num_src: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reverse a CSR in memory: returns ``(rev_indptr, rev_indices, rev_perm)``.

    ``rev_perm[k]`` is the forward edge id of reverse edge ``k``, so edge weights and edge features are
    permuted into reverse order with one gather. The stable sort keeps each reverse row ordered by
    destination, which makes the result deterministic (and equal to :func:`reverse_csr_into`'s).

    Args:
        indptr: ``[num_dst + 1]`` row pointers (rows = destinations).
        indices: ``[E]`` source of each edge.
        num_src: Number of sources (rows of the reverse CSR).
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    num_dst = indptr.shape[0] - 1
    rev_perm = stable_argsort(indices, num_src)
    rev_indptr = np.zeros(num_src + 1, dtype=np.int64)
    np.cumsum(np.bincount(indices, minlength=num_src), out=rev_indptr[1:])
    rev_indices = np.repeat(np.arange(num_dst, dtype=np.int64), np.diff(indptr))[rev_perm]
    return rev_indptr, rev_indices, rev_perm


def add_counts(counts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``counts[ids] += 1`` for every id, growing ``counts`` as needed; O(chunk) time when ids are sparse.

    Returns:
        ``counts`` (a new, larger array when an id was past its end).
    """
    if ids.size == 0:
        return counts
    top = int(ids.max()) + 1
    if top > counts.shape[0]:
        grown = np.zeros(max(top, 2 * counts.shape[0]), dtype=np.int64)
        grown[: counts.shape[0]] = counts
        counts = grown
    if top <= 4 * ids.size:
        counts[:top] += np.bincount(ids, minlength=top)
    else:
        uniq, cnt = np.unique(ids, return_counts=True)
        counts[uniq] += cnt
    return counts


def group_ranks(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sorted keys: the rank of each element within its run, plus the run keys and run lengths."""
    m = sorted_keys.size
    starts = np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))
    lengths = np.diff(np.append(starts, m))
    ranks = np.arange(m, dtype=np.int64) - np.repeat(starts, lengths)
    return ranks, sorted_keys[starts], lengths


def row_blocks(indptr: np.ndarray, max_edges: int) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges ``[r0, r1)`` each holding at most ``max_edges`` edges (or one bigger row).

    Why by edges: a block's memory is its edges; an even split of rows would give one block all hubs.
    """
    n = indptr.shape[0] - 1
    r0 = 0
    while r0 < n:
        r1 = int(np.searchsorted(indptr, indptr[r0] + max_edges, side="right")) - 1
        r1 = min(max(r1, r0 + 1), n)
        yield r0, r1
        r0 = r1


def row_segments(indptr: np.ndarray, indices: np.ndarray, max_edges: int
                 ) -> Iterator[tuple[int, int, int, np.ndarray, np.ndarray]]:
    """Each non-empty :func:`row_blocks` block as ``(r0, r1, p0, seg, rows)``.

    ``seg`` is a copy of ``indices[p0:p1]`` (so a caller may overwrite ``indices`` in place, as a compacting
    pass does) and ``rows[k]`` the block-local row (``0..r1-r0-1``) of edge ``p0 + k``.
    """
    for r0, r1 in row_blocks(indptr, max_edges):
        p0, p1 = int(indptr[r0]), int(indptr[r1])
        if p1 == p0:
            continue
        rows = np.repeat(np.arange(r1 - r0, dtype=np.int64), np.diff(indptr[r0:r1 + 1]))
        yield r0, r1, p0, np.array(indices[p0:p1]), rows


def row_ranges(n: int, block_rows: int) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges ``[a, b)`` of ``block_rows`` rows (the last one shorter) covering ``n`` rows."""
    for a in range(0, n, block_rows):
        yield a, min(a + block_rows, n)


def reverse_csr_into(indptr: np.ndarray, indices: np.ndarray, num_src: int, rev_indices: np.ndarray,
                     rev_perm: np.ndarray, *, chunk_edges: int,
                     progress: Callable[[int], object] | None = None) -> np.ndarray:
    """Fill ``rev_indices``/``rev_perm`` (e.g. writable memory maps) in O(N + chunk) memory.

    Identical to :func:`build_reverse_csr`: forward edges are visited in id order, so each reverse row
    lists its destinations in ascending edge-id order. For graphs whose edges do not fit in memory.

    Args:
        indptr: ``[num_dst + 1]`` row pointers (in memory).
        indices: ``[E]`` sources (may be a memory map; read one block at a time).
        num_src: Number of sources.
        rev_indices: ``[E]`` output: destination of each reverse edge.
        rev_perm: ``[E]`` output: forward edge id of each reverse edge.
        chunk_edges: Edges per block.
        progress: Called with the number of edges of each finished block (default: none).

    Returns:
        ``rev_indptr`` (``int64 [num_src + 1]``).
    """
    e = int(indices.shape[0])
    counts = np.zeros(num_src, dtype=np.int64)
    for p0 in range(0, e, chunk_edges):
        counts = add_counts(counts, np.asarray(indices[p0:p0 + chunk_edges]))
    rev_indptr = np.zeros(num_src + 1, dtype=np.int64)
    np.cumsum(counts[:num_src], out=rev_indptr[1:])
    del counts
    cursor = rev_indptr[:-1].copy()
    for r0, _, p0, s, rows in row_segments(indptr, indices, chunk_edges):
        d = rows + r0
        order = np.argsort(s, kind="stable")
        ss = s[order]
        ranks, run_keys, run_lengths = group_ranks(ss)
        pos = cursor[ss] + ranks
        rev_indices[pos] = d[order]
        rev_perm[pos] = p0 + order
        cursor[run_keys] += run_lengths
        if progress is not None:
            progress(s.shape[0])
    return rev_indptr
