"""Edge lists to the store's in-edge CSR (row = destination, indices = source), in memory or in chunks.

Two builders with one semantics:

* :func:`edges_to_csr` — vectorized numpy for edge lists that fit in memory.
* :func:`build_csr_chunked` — bounded memory, O(N + chunk), for edge lists larger than memory. Pass 1
  counts in-degrees, pass 2 scatters source ids into a scratch memory map at per-row cursors, pass 3
  sorts (and deduplicates) each block of rows in place, then the reverse CSR is built the same way.

Semantics shared by both (tests check that they produce identical arrays):

* Rows are sorted by source id. Ties (parallel edges, kept when ``dedup=False``) stay in input order.
* ``remove_self_loops`` drops ``u -> u`` before anything else.
* ``symmetrize`` adds ``v -> u`` for every ``u -> v`` (a self loop is not doubled). Edge data follows its
  edge: both directions of an input edge carry that edge's weight/features.
* ``dedup`` keeps the first occurrence in input order. With ``symmetrize`` the graph is undirected, so
  ``u -> v`` and ``v -> u`` are the same edge: the first input row naming ``{u, v}`` in either direction
  gives the data of both directions.
* ``edge_ids[k]`` is the input row of CSR edge ``k``: any per-edge array is carried with ``data[edge_ids]``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from trellis.data.store import StoreWriter
from trellis.errors import TrellisUserError
from trellis.utils.csr import add_counts, group_ranks, reverse_csr_into, row_segments, stable_argsort
from trellis.utils.diskmap import new_map
from trellis.utils.numba import WITH_NUMBA
from trellis.utils.sizes import format_size, machine_memory

#: Edges per chunk of the chunked builder (about 16 MiB of int64 pairs per array).
DEFAULT_CHUNK_EDGES = 2_000_000
#: ``rows * cols`` below this packs ``(row, col)`` into one int64 sort key; above it a lexsort is used.
_KEY_LIMIT = 2**62


@dataclass
class EdgeCSR:
    """An in-edge CSR built from an edge list.

    Attributes:
        indptr: ``int64 [N+1]`` row pointers (row = destination node).
        indices: ``int64 [E]`` source node of each in-edge, sorted within each row.
        num_nodes: ``N``.
        edge_ids: ``int64 [E]`` input row of each CSR edge (edge data follows with ``data[edge_ids]``).
        edge_weight: ``float32 [E]`` carried weights, or None.
        edge_feat: ``float32 [E, D]`` carried edge features, or None.
    """

    indptr: np.ndarray
    indices: np.ndarray
    num_nodes: int
    edge_ids: np.ndarray
    edge_weight: np.ndarray | None = None
    edge_feat: np.ndarray | None = None

    @property
    def num_edges(self) -> int:
        """Number of edges ``E`` (the length of ``indices``)."""
        return int(self.indices.shape[0])

    def dst(self) -> np.ndarray:
        """Destination node of each edge (``int64 [E]``)."""
        return np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.indptr))


@dataclass
class EdgeChunk:
    """A block of input edges: ``src[i] -> dst[i]`` is input row ``start + i``."""

    src: np.ndarray
    dst: np.ndarray
    start: int


class EdgeSource(Protocol):
    """Anything that can stream its edges more than once (the chunked builder reads them twice)."""

    name: str

    def chunks(self, num_nodes: int | None = None) -> Iterator[EdgeChunk]:
        """Yield edge chunks in input order; raise :class:`TrellisUserError` naming the row of a bad id."""
        ...


class ArrayEdgeSource:
    """An :class:`EdgeSource` over in-memory (or memory-mapped) ``src``/``dst`` arrays."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, *, chunk_edges: int = DEFAULT_CHUNK_EDGES,
                 name: str = "edges") -> None:
        if np.shape(src) != np.shape(dst):
            raise TrellisUserError(f"{name}: src has {np.shape(src)} entries but dst has {np.shape(dst)}; "
                                   "give one source and one destination per edge")
        self.src, self.dst, self.chunk_edges, self.name = src, dst, max(1, int(chunk_edges)), name

    def chunks(self, num_nodes: int | None = None) -> Iterator[EdgeChunk]:
        """Yield ``chunk_edges``-sized slices of the arrays as validated int64 node ids, in input order."""
        for start in range(0, len(self.src), self.chunk_edges):
            stop = start + self.chunk_edges
            src = as_node_ids(self.src[start:stop], f"{self.name} src", num_nodes, row_offset=start)
            dst = as_node_ids(self.dst[start:stop], f"{self.name} dst", num_nodes, row_offset=start)
            yield EdgeChunk(src, dst, start)


# ---- validation ---------------------------------------------------------------------------------
def as_node_ids(ids: np.ndarray, where: str, num_nodes: int | None = None, *, row_offset: int = 0) -> np.ndarray:
    """Return ``ids`` as int64 after checking they are integers in ``[0, num_nodes)``.

    Integral floats (``3.0``) are accepted; a fraction, NaN, a negative id or one at or past
    ``num_nodes`` raises :class:`TrellisUserError` naming ``where`` and the row (``row_offset`` + i).
    """
    arr = np.asarray(ids)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TrellisUserError(f"{where}: node ids have dtype {arr.dtype}; give integer node ids 0..N-1")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise TrellisUserError(f"{where}: row {row_offset + i} has non-integer node id {arr.flat[i].item()!r}; "
                                   "node ids must be integers 0..N-1")
    if np.issubdtype(arr.dtype, np.unsignedinteger) and arr.size and arr.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise TrellisUserError(f"{where}: row {row_offset + i} has node id {int(arr.flat[i])}, beyond 64-bit signed "
                               "ids; node ids must be 0..N-1 (renumber them)")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        bad = np.flatnonzero(arr < 0)
        if bad.size:
            i = int(bad[0])
            raise TrellisUserError(f"{where}: row {row_offset + i} has negative node id {int(arr[i])}; "
                                   "node ids must be 0..N-1")
        if num_nodes is None:
            top = int(arr.max())
            check_inferred_count(top, f"{where}: row {row_offset + int(np.argmax(arr == top))}")
        if num_nodes is not None:
            bad = np.flatnonzero(arr >= num_nodes)
            if bad.size:
                i = int(bad[0])
                raise TrellisUserError(
                    f"{where}: row {row_offset + i} has node id {int(arr[i])} but the graph has {num_nodes} "
                    f"nodes (ids 0..{num_nodes - 1}); renumber the nodes or give the right node count")
    return arr


#: Bytes per node of an import's own per-node arrays (in-degree counts and ``indptr``, int64 each).
_NODE_BYTES = 16


def check_inferred_count(top: int, at: str) -> None:
    """Refuse a largest id ``top`` whose inferred node count (``top + 1``) cannot fit this machine's memory.

    Why: a graph's node count is its largest id + 1 when no count is given, so one stray id (a hash, a
    timestamp) asked for tens of GiB and ended in a MemoryError traceback, or the OOM killer.

    Args:
        top: The largest node id.
        at: Where it is (``"FILE: line 3"``).
    """
    need = (top + 1) * _NODE_BYTES
    if need > machine_memory():
        raise TrellisUserError(f"{at} has node id {top:,}, so the graph would have {top + 1:,} nodes, and their "
                               f"arrays alone ({format_size(need)}) exceed this machine's "
                               f"{format_size(machine_memory())} of memory; node ids must be 0..N-1: renumber them")


def _check_edge_data(data: np.ndarray | None, rows: int, label: str, *, ndim: int,
                     edges: str) -> np.ndarray | None:
    if data is None:
        return None
    arr = np.asarray(data) if not isinstance(data, np.memmap) else data
    if arr.ndim != ndim:
        raise TrellisUserError(f"{label}: expected a {ndim}-D array ({'[E]' if ndim == 1 else '[E, D]'}) "
                               f"but got shape {tuple(arr.shape)}")
    if arr.shape[0] != rows:
        raise TrellisUserError(f"{label}: has {arr.shape[0]} rows but the edge list {edges} has {rows} edges; "
                               "give one row per input edge, in edge-list order")
    return arr


def _check_all_edge_data(w: np.ndarray | None, f: np.ndarray | None, rows: int, where: str,
                         names: dict[str, str] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    names = names or {}
    wn = names.get("edge_weight", f"{where} edge weights")
    fn = names.get("edge_feat", f"{where} edge features")
    w = _check_edge_data(w, rows, wn, ndim=1, edges=where)
    f = _check_edge_data(f, rows, fn, ndim=2, edges=where)
    if w is not None:
        check_finite(w, wn)
    if f is not None:
        check_finite(f, fn)
    return w, f


def check_finite(arr: np.ndarray, label: str, *, chunk_rows: int = 1_000_000) -> None:
    """Raise :class:`TrellisUserError` naming the first row of ``arr`` holding NaN or Inf (chunked)."""
    if not np.issubdtype(arr.dtype, np.floating):
        if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise TrellisUserError(f"{label}: dtype {arr.dtype} is not numeric; save it as float32")
        return
    wide = arr.dtype.itemsize > 4  # stored as float32: a finite float64 beyond its range would become Inf
    top = float(np.finfo(np.float32).max)
    for start in range(0, arr.shape[0], chunk_rows):
        block = np.asarray(arr[start:start + chunk_rows])
        finite = np.isfinite(block)
        if not finite.all():
            row = start + int(np.argwhere(~finite)[0][0])
            raise TrellisUserError(f"{label}: row {row} contains NaN or Inf; clean or impute it")
        if wide:
            big = np.abs(block) > top
            if big.any():
                at = np.argwhere(big)[0]
                raise TrellisUserError(f"{label}: row {start + int(at[0])} holds {float(block[tuple(at)]):g}, beyond "
                                       f"float32 (at most {top:.3g} in magnitude), which a store holds; rescale it")


# ---- sorting ------------------------------------------------------------------------------------
def _sorted_order(rows: np.ndarray, cols: np.ndarray, num_rows: int, num_cols: int, dedup: bool) -> np.ndarray:
    """Positions sorting ``(rows, cols)`` lexicographically, ties in position order.

    With ``dedup`` only the first position of each distinct pair is returned.
    """
    m = rows.size
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    small = num_rows <= 4 * m + 1024 and num_cols <= 4 * m + 1024
    if WITH_NUMBA and m > 1024 and small:  # LSD radix (counting sorts): by column, then stably by row
        by_col = stable_argsort(cols, int(num_cols))
        order = by_col[stable_argsort(rows[by_col], int(num_rows))]
    elif int(num_rows) * int(max(num_cols, 1)) < _KEY_LIMIT:
        order = np.argsort(rows * np.int64(num_cols) + cols, kind="stable").astype(np.int64, copy=False)
    else:
        order = np.lexsort((cols, rows)).astype(np.int64, copy=False)
    if dedup and m > 1:
        r, c = rows[order], cols[order]
        keep = np.ones(m, dtype=bool)
        keep[1:] = (r[1:] != r[:-1]) | (c[1:] != c[:-1])
        order = order[keep]
    return order


# ---- in-memory builder --------------------------------------------------------------------------
def _expand_symmetric(src: np.ndarray, dst: np.ndarray, eid: np.ndarray) -> tuple[np.ndarray, ...]:
    """Both directions of every edge, interleaved so positions stay in input order (self loops once)."""
    m = src.shape[0]
    s = np.empty(2 * m, dtype=np.int64)
    d = np.empty(2 * m, dtype=np.int64)
    s[0::2], s[1::2] = src, dst
    d[0::2], d[1::2] = dst, src
    e = np.repeat(eid, 2)
    loops = src == dst
    if loops.any():
        keep = np.ones(2 * m, dtype=bool)
        keep[1::2] = ~loops
        s, d, e = s[keep], d[keep], e[keep]
    return s, d, e


def _indptr_from_sorted_rows(rows: np.ndarray, num_rows: int) -> np.ndarray:
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=indptr[1:])
    return indptr


def edges_to_csr(
    src: np.ndarray,
    dst: np.ndarray,
    num_nodes: int | None = None,
    *,
    symmetrize: bool = False,
    dedup: bool = True,
    remove_self_loops: bool = True,
    edge_weight: np.ndarray | None = None,
    edge_feat: np.ndarray | None = None,
    where: str = "edges",
    data_names: dict[str, str] | None = None,
) -> EdgeCSR:
    """Build the in-edge CSR of ``src[i] -> dst[i]`` (vectorized; see the module doc for semantics).

    Args:
        src: Source node of each input edge (integers).
        dst: Destination node of each input edge.
        num_nodes: Node count ``N`` (default: largest id + 1).
        symmetrize: Add the reverse of every edge (default: False).
        dedup: Keep only the first occurrence of each edge (default: True).
        remove_self_loops: Drop ``u -> u`` edges (default: True).
        edge_weight: ``[E]`` per-input-edge weights carried to the CSR edges.
        edge_feat: ``[E, D]`` per-input-edge features carried to the CSR edges.
        where: Name used in error messages (a file name).
        data_names: Names of the edge-data files for messages (``{"edge_weight": …, "edge_feat": …}``).

    Returns:
        The :class:`EdgeCSR`.

    Raises:
        TrellisUserError: Non-integer, negative or out-of-range ids; edge data of the wrong length or
            with NaN/Inf; no nodes.
    """
    src = as_node_ids(np.asarray(src).reshape(-1), f"{where} src", num_nodes)
    dst = as_node_ids(np.asarray(dst).reshape(-1), f"{where} dst", num_nodes)
    if src.shape != dst.shape:
        raise TrellisUserError(f"{where}: {src.size} sources but {dst.size} destinations; give one of each per edge")
    e_in = src.shape[0]
    if num_nodes is None:
        if e_in == 0:
            raise TrellisUserError(f"{where}: the edge list is empty and no node count was given; "
                                   "give at least one edge or the number of nodes")
        num_nodes = int(max(src.max(), dst.max())) + 1
    n = int(num_nodes)
    if n <= 0:
        raise TrellisUserError(f"{where}: the graph has no nodes; give at least one node")
    w, f = _check_all_edge_data(edge_weight, edge_feat, e_in, where, data_names)

    eid = np.arange(e_in, dtype=np.int64)
    if remove_self_loops:
        keep = src != dst
        if not keep.all():
            src, dst, eid = src[keep], dst[keep], eid[keep]
    if symmetrize:
        if dedup:  # one representative per undirected pair: the first input row naming it
            lo, hi = np.minimum(src, dst), np.maximum(src, dst)
            first = _sorted_order(lo, hi, n, n, dedup=True)
            first.sort()
            src, dst, eid = lo[first], hi[first], eid[first]
        src, dst, eid = _expand_symmetric(src, dst, eid)
        order = _sorted_order(dst, src, n, n, dedup=False)
    else:
        order = _sorted_order(dst, src, n, n, dedup=dedup)
    indices, rows, edge_ids = src[order], dst[order], eid[order]
    indptr = _indptr_from_sorted_rows(rows, n)
    return EdgeCSR(
        indptr=indptr,
        indices=indices,
        num_nodes=n,
        edge_ids=edge_ids,
        edge_weight=None if w is None else np.asarray(w[edge_ids], dtype=np.float32),
        edge_feat=None if f is None else np.asarray(f[edge_ids], dtype=np.float32),
    )


def read_all_edges(source: EdgeSource, num_nodes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate every chunk of ``source`` (validated against ``num_nodes``) into ``(src, dst)``."""
    srcs, dsts = [], []
    for chunk in source.chunks(num_nodes):
        srcs.append(chunk.src)
        dsts.append(chunk.dst)
    if not srcs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(srcs), np.concatenate(dsts)


# ---- chunked (bounded-memory) builder -----------------------------------------------------------
@dataclass
class ChunkedCSRInfo:
    """What :func:`build_csr_chunked` wrote: node and edge counts (input edges before cleaning)."""

    num_nodes: int
    num_edges: int
    num_input_edges: int


def _scratch(writer: StoreWriter, name: str, shape: tuple[int, ...], dtype: type) -> tuple[np.memmap, Path]:
    path = writer.tmp / f"_scratch_{name}.npy"
    return new_map(path, shape, dtype, "free space or write the store elsewhere"), path


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="edge", unit_scale=True, disable=None if progress else True,
                leave=False)


def build_csr_chunked(
    source: EdgeSource,
    writer: StoreWriter,
    *,
    num_nodes: int | None = None,
    symmetrize: bool = False,
    dedup: bool = True,
    remove_self_loops: bool = True,
    edge_weight: np.ndarray | None = None,
    edge_feat: np.ndarray | None = None,
    chunk_edges: int = DEFAULT_CHUNK_EDGES,
    progress: bool = True,
    data_names: dict[str, str] | None = None,
) -> ChunkedCSRInfo:
    """Stream ``source`` into ``writer`` as ``indptr``/``indices`` (+ edge data, + reverse CSR).

    Memory is O(N + chunk): only degree counters, cursors and one chunk live in RAM; neighbor lists
    are filled into memory maps in the writer's temporary directory. The result is identical to
    :func:`edges_to_csr` with the same options.

    Args:
        source: Edge chunks (read twice).
        writer: An open :class:`StoreWriter`; the caller adds node data and commits.
        num_nodes: Node count (default: largest id + 1); ids at or past it are refused with their row.
        symmetrize: Add the reverse of every edge (default: False).
        dedup: Keep the first occurrence of each edge (default: True).
        remove_self_loops: Drop ``u -> u`` (default: True).
        edge_weight: ``[E_in]`` weights per input row (may be a memory map).
        edge_feat: ``[E_in, D]`` features per input row (may be a memory map).
        chunk_edges: Edges per chunk (default: 2,000,000).
        progress: Show tqdm progress bars on a terminal (default: True).
        data_names: Names of the edge-data files for messages (``{"edge_weight": …, "edge_feat": …}``).

    Returns:
        Node, edge and input-edge counts.
    """
    chunk_edges = max(1, int(chunk_edges))
    # pass 1: in-degree counts (and the largest id)
    counts = np.zeros(0 if num_nodes is None else int(num_nodes), dtype=np.int64)
    e_in = 0
    top = 0  # one past the largest id seen (a node named only by a removed self loop still exists)
    with _bar(0, "count degrees", progress) as bar:
        for ch in source.chunks(num_nodes):
            e_in = ch.start + ch.src.size
            src, dst = ch.src, ch.dst
            if src.size:
                top = max(top, int(src.max()) + 1, int(dst.max()) + 1)
            if remove_self_loops:
                keep = src != dst
                src, dst = src[keep], dst[keep]
            counts = add_counts(counts, dst)
            if symmetrize:
                counts = add_counts(counts, src[src != dst])
            bar.update(ch.src.size)
    if num_nodes is None:
        if e_in == 0:
            raise TrellisUserError(f"{source.name}: the edge list is empty and no node count was given; "
                                   "give at least one edge or the number of nodes")
        num_nodes = top
    n = int(num_nodes)
    counts = counts[:n] if counts.shape[0] >= n else np.concatenate([counts, np.zeros(n - counts.shape[0], np.int64)])
    w, f = _check_all_edge_data(edge_weight, edge_feat, e_in, source.name, data_names)
    carry = w is not None or f is not None

    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    e_raw = int(indptr[-1])
    del counts

    # pass 2: scatter sources into per-row slots, in input order
    nbr, nbr_path = _scratch(writer, "nbr", (e_raw,), np.int64)
    eid, eid_path = _scratch(writer, "eid", (e_raw,), np.int64) if carry else (None, None)
    cursor = indptr[:-1].copy()
    with _bar(e_in, "fill neighbors", progress) as bar:
        for ch in source.chunks(n):
            src, dst = ch.src, ch.dst
            ids = np.arange(ch.start, ch.start + src.size, dtype=np.int64)
            if remove_self_loops:
                keep = src != dst
                src, dst, ids = src[keep], dst[keep], ids[keep]
            if symmetrize:
                src, dst, ids = _expand_symmetric(src, dst, ids)
            order = np.argsort(dst, kind="stable")
            d = dst[order]
            if d.size:
                ranks, run_keys, run_lengths = group_ranks(d)
                pos = cursor[d] + ranks
                nbr[pos] = src[order]
                if eid is not None:
                    eid[pos] = ids[order]
                cursor[run_keys] += run_lengths
            bar.update(ch.src.size)
    del cursor

    # pass 3: sort each row by source (ties keep input order), drop duplicates, compact in place
    new_counts = np.zeros(n, dtype=np.int64)
    out = 0
    with _bar(e_raw, "sort rows", progress) as bar:
        for r0, r1, p0, seg, rows in row_segments(indptr, nbr, chunk_edges):
            p1 = p0 + seg.shape[0]
            order = _sorted_order(rows, seg, r1 - r0, n, dedup=dedup)
            k = order.size
            nbr[out:out + k] = seg[order]
            if eid is not None:
                eseg = np.array(eid[p0:p1])
                eid[out:out + k] = eseg[order]
            new_counts[r0:r1] = np.bincount(rows[order], minlength=r1 - r0)
            out += k
            bar.update(p1 - p0)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(new_counts, out=indptr[1:])
    del new_counts
    e = int(indptr[-1])

    # copy out the final arrays (exact length) and carry edge data
    writer.add("indptr", indptr)
    indices = writer.create("indices", (e,), np.int64)
    wout = writer.create("edge_weight", (e,), np.float32) if w is not None else None
    fout = writer.create("edge_feat", (e, f.shape[1]), np.float32) if f is not None else None
    for p0 in range(0, e, chunk_edges):
        p1 = min(e, p0 + chunk_edges)
        indices[p0:p1] = nbr[p0:p1]
        if eid is not None:
            ids = np.array(eid[p0:p1])
            if wout is not None and w is not None:
                wout[p0:p1] = np.asarray(w[ids], dtype=np.float32)
            if fout is not None and f is not None:
                fout[p0:p1] = np.asarray(f[ids], dtype=np.float32)
    del nbr, eid
    for p in (nbr_path, eid_path):
        if p is not None:
            os.unlink(p)
    for arr in (indices, wout, fout):
        if arr is not None:
            arr.flush()
    write_reverse_csr_chunked(writer, indptr, indices, n, chunk_edges=chunk_edges, progress=progress)
    return ChunkedCSRInfo(num_nodes=n, num_edges=e, num_input_edges=e_in)


def write_reverse_csr_chunked(
    writer: StoreWriter,
    indptr: np.ndarray,
    indices: np.ndarray,
    num_nodes: int,
    *,
    chunk_edges: int = DEFAULT_CHUNK_EDGES,
    progress: bool = True,
) -> None:
    """Write ``rev_indptr``/``rev_indices``/``rev_perm`` in O(N + chunk) memory.

    Identical to :func:`trellis.utils.csr.build_reverse_csr`: forward edges are visited in id order,
    so each reverse row lists its destinations in ascending edge-id (hence destination) order.
    """
    e = int(indices.shape[0])
    rev_indices = writer.create("rev_indices", (e,), np.int64)
    rev_perm = writer.create("rev_perm", (e,), np.int64)
    with _bar(e, "reverse CSR", progress) as bar:
        rev_indptr = reverse_csr_into(indptr, indices, num_nodes, rev_indices, rev_perm, chunk_edges=chunk_edges,
                                      progress=bar.update)
    writer.add("rev_indptr", rev_indptr)
    rev_indices.flush()
    rev_perm.flush()
