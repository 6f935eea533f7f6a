"""The partition buffer: mini-batch training over a partitioned layout with K of its P parts in memory.

Why a buffer and not a memory map: a sampled batch reads about a hundred feature rows per target, scattered
over the graph. Read through a memory map on a graph beyond memory, every row is a 4 KiB random read, and
storage does about 12k of those a second against about 1 GB/s sequentially (NOTES.md). So the buffer reads
each partition whole, in one sequential read of its feature rows and one of its in-edges (Armada §3: rows
stored contiguously per partition), and an epoch visits *buffer states* in which every batch is built from
memory (Armada §5, MariusGNN's ``getDispersedNodePartitionOrdering``):

* the first state is K parts drawn at random; each following state swaps one resident part (drawn at random)
  for the next part of a random order, so an epoch has ``P - K + 1`` states and reads every part exactly
  once (parts still resident from the previous epoch's last state are not read again);
* every training node is assigned to one state that holds its part, drawn uniformly among them, so it is a
  target exactly once per epoch; inside a state the targets keep the order of the epoch's permutation of the
  training ids (with one state, the order and every batch equal ``--strategy mini``'s);
* the buffer has ``K + 1`` slots: the part of the next state is read into the spare slot while the current
  state's batches are prepared and trained (MariusGNN drains its pipeline at every swap; this does not).

Neighbours outside the buffer. A batch is sampled from the in-edges of resident nodes whose sources are
*available*: resident, or held by a fixed cache of the rows most likely to be sampled (ranked by their
analytical inclusion probability, SALIENT++'s VIP, within the budget). With no cache this is MariusGNN's
in-buffer sampling, which costs it accuracy; the cache is what narrows the gap (docs/minibatch.md measures
both). Normalizations still see global degrees.

Layout: ``loader/`` sits above ``partition/`` and reads the layout's arrays directly (``part-*/x.npy``,
``indptr.npy``, ``indices.npy``, ``local_to_global.npy``), so a run needs only the layout's copy of the
features, not the store's.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trellis.errors import TrellisUserError
from trellis.loader.blocks import Batch, attach_edge_data
from trellis.loader.cluster import induced_subgraph, prefix_blocks
from trellis.loader.features import FeatureGather, FeatureSource, expand_ranges, gather_rows, normalize_rows_, np_int64
from trellis.loader.prefetch import prefetch_iter
from trellis.loader.sampler import NeighborSampler, batch_seed, merged_positions, mix64, split_batch
from trellis.ops.graph import CSRGraph
from trellis.partition.layout import PartitionedGraph, part_dir_name
from trellis.utils.memory import proc_io
from trellis.utils.numba import njit


# ---- reading whole arrays sequentially ---------------------------------------------------------------
def _npy_data_offset(f: object) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and byte offset of a ``.npy`` file's data (the file position is left after the header)."""
    major, _ = np.lib.format.read_magic(f)  # type: ignore[arg-type]
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)  # type: ignore[arg-type]
    if fortran:
        raise TrellisUserError(f"{getattr(f, 'name', '?')}: Fortran-ordered array; re-run `trellis partition`")
    return tuple(shape), np.dtype(dtype), f.tell()  # type: ignore[attr-defined]


def _drop_cache(fd: int) -> None:
    """Tell the kernel the file's pages will not be read again (the buffer holds them now)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_npy(path: Path, out: np.ndarray | None = None) -> np.ndarray:
    """Read a ``.npy`` file with one sequential read, into ``out`` (a C-contiguous prefix is used) when given.

    The file's page-cache pages are dropped afterwards: the rows now live in the buffer, and a second copy in
    the cache would only push the process toward its memory limit (a cgroup counts the cache).

    Raises:
        TrellisUserError: The file is missing, truncated or not what ``out`` expects.
    """
    try:
        with open(path, "rb", buffering=0) as f:
            shape, dtype, _ = _npy_data_offset(f)
            n = int(np.prod(shape, dtype=np.int64))
            if out is None:
                arr = np.empty(shape, dtype=dtype)
            else:
                if out.dtype != dtype or out.size < n or not out.flags.c_contiguous:
                    raise TrellisUserError(f"{path}: holds {dtype} {shape}, which does not fit the buffer's slot "
                                           f"({out.dtype} {out.shape}); re-run `trellis partition`")
                arr = out.reshape(-1)[:n]
            view = memoryview(arr.view(np.uint8).reshape(-1)) if n else memoryview(b"")  # type: ignore[arg-type]
            got = 0
            while got < view.nbytes:
                k = f.readinto(view[got:])
                if not k:
                    raise TrellisUserError(f"{path}: truncated ({got} of {view.nbytes} data bytes); re-run "
                                           "`trellis partition`")
                got += k
            _drop_cache(f.fileno())
            return arr
    except FileNotFoundError as exc:
        raise TrellisUserError(f"{path}: missing partition file; re-run `trellis partition`") from exc
    except ValueError as exc:  # a damaged header
        raise TrellisUserError(f"{path}: not a valid .npy file ({exc}); re-run `trellis partition`") from exc


#: O_DIRECT's unit: reads start on a multiple of it, at a memory address that is one, for a multiple of it.
DIRECT_BLOCK = 4096
#: The ``.npy`` header length the buffer's slots are aligned for (NumPy writes 128 bytes for these arrays).
NPY_HEADER = 128


def direct_slot_stride(rows: int, row_bytes: int) -> int:
    """Rows per buffer slot so that each slot can take one O_DIRECT read of a part's ``.npy`` file of ``rows``.

    The read lands the file's header just before the slot's first row and up to a block past its last, so a slot
    holds two blocks of slack, and its stride is a whole number of blocks (every slot aligned as the first).
    """
    per_block = DIRECT_BLOCK // math.gcd(max(1, row_bytes), DIRECT_BLOCK)  # rows in a whole number of blocks
    slack = -(-(2 * DIRECT_BLOCK) // max(1, row_bytes))
    return -(-(rows + slack) // per_block) * per_block


def read_npy_direct(path: Path, raw: np.ndarray, at: int, out: np.ndarray) -> bool:
    """Read ``path`` (a ``.npy`` array) into ``out`` with one O_DIRECT read; False if that cannot be done here.

    ``out`` lies at byte ``at`` of ``raw`` (a ``uint8`` buffer); the read also writes the file's header into the
    bytes before ``at`` and up to a block past the data: the slot stride of :func:`direct_slot_stride` keeps
    those bytes free. Why: the page cache's copy costs CPU time (3.1 ms of a core per 31 MB part on this
    project's machine, against 0.9 ms read directly: ``benchmarks/bench_direct_read.py``) and, under a memory
    cgroup, memory the run is charged for.
    Falls back (returns False, nothing read) where O_DIRECT is missing or refused (tmpfs), where the header is
    not :data:`NPY_HEADER` bytes, or where the addresses do not align.

    Raises:
        TrellisUserError: The file is truncated or not what ``out`` expects.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except FileNotFoundError as exc:
        raise TrellisUserError(f"{path}: missing partition file; re-run `trellis partition`") from exc
    except OSError:
        return False
    try:
        with open(path, "rb") as f:  # the header, through the page cache (one block)
            shape, dtype, offset = _npy_data_offset(f)
        n = int(np.prod(shape, dtype=np.int64))
        if dtype != out.dtype or n != out.size or not out.flags.c_contiguous:
            raise TrellisUserError(f"{path}: holds {dtype} {shape}, which does not fit the buffer's slot "
                                   f"({out.dtype} {out.shape}); re-run `trellis partition`")
        start = at - offset
        end = start + -(-(offset + out.nbytes) // DIRECT_BLOCK) * DIRECT_BLOCK
        if (offset != NPY_HEADER or start < 0 or end > raw.shape[0] or (raw.ctypes.data + start) % DIRECT_BLOCK
                or out.ctypes.data != raw.ctypes.data + at):
            return False
        view = memoryview(raw[start:end])  # type: ignore[arg-type]
        want = offset + out.nbytes
        got = 0
        while got < want:
            try:
                k = os.preadv(fd, [view[got:]], got)
            except OSError:
                if got:
                    raise
                return False  # refused at the first read: the buffered path reads it
            if not k:
                raise TrellisUserError(f"{path}: truncated ({max(0, got - offset)} of {out.nbytes} data bytes); "
                                       "re-run `trellis partition`")
            got += k
        return True
    finally:
        os.close(fd)


# ---- the epoch's buffer states -----------------------------------------------------------------------
@dataclass
class BufferState:
    """One phase of an epoch: the resident parts and the targets trained while they are resident.

    Attributes:
        parts: Resident parts (sorted).
        enters: The part read for this state (None for the epoch's first state, which may read several).
        leaves: The part evicted when this state begins (None for the first state).
        targets: Global ids of this state's targets, in batch order.
        first_batch: Index (within the epoch) of the state's first batch.
        cuts: The state's batches as ``(start, stop, step_end, weight)`` over ``targets`` (see
            :func:`cut_steps`).
    """

    parts: tuple[int, ...]
    enters: int | None
    leaves: int | None
    targets: np.ndarray
    first_batch: int = 0
    cuts: list[tuple[int, int, bool, float]] = field(default_factory=list)

    @property
    def num_batches(self) -> int:
        """Batches of this state (its ``cuts``)."""
        return len(self.cuts)


def cut_steps(states: Sequence[BufferState], batch_size: int) -> None:
    """Cut the epoch's targets, in state order, into optimizer steps of ``batch_size``; set each state's ``cuts``.

    Why steps span states: a state holds about ``T / (P - K + 1)`` targets; cut per state, an epoch would take
    many more, smaller and more skewed optimizer steps than in memory (on a small training set, one tiny step
    per state). Here step ``j`` is targets ``[jB, (j+1)B)`` of the concatenation, and a step that crosses a
    state boundary is cut into one piece per state (``weight`` is a piece's share of the step's targets;
    ``step_end`` marks the step's last piece); each piece is sampled in its state and the pieces are trained
    as one batch (:meth:`PartitionBuffer._whole_step`). With one state every batch is a whole step, as
    ``--strategy mini`` cuts them.
    """
    total = sum(int(s.targets.shape[0]) for s in states)
    start = 0
    for s in states:
        n = int(s.targets.shape[0])
        s.cuts = []
        a = 0
        while a < n:
            pos = start + a
            step = pos // batch_size
            step_lo, step_hi = step * batch_size, min((step + 1) * batch_size, total)
            b = min(n, step_hi - start)
            s.cuts.append((a, b, start + b == step_hi, (b - a) / (step_hi - step_lo)))
            a = b
        start += n


@dataclass
class BufferEpoch:
    """An epoch of buffer states (an :class:`~trellis.loader.source.EpochPlan`): ``len`` = batches."""

    epoch: int
    states: list[BufferState]
    batch_size: int

    def __len__(self) -> int:
        """Number of batches in the epoch."""
        return sum(s.num_batches for s in self.states)


def buffer_states(num_parts: int | Sequence[int], capacity: int, part_of: np.ndarray, order: np.ndarray,
                  rng: np.random.Generator, first: Sequence[int] | None = None) -> list[BufferState]:
    """The dispersed ordering: ``P - K + 1`` states, each part read once, each target in one state.

    Args:
        num_parts: ``P``, or the ``P`` part ids the buffer holds (a distributed rank's parts of a larger layout).
        capacity: ``K`` resident parts per state (``1 <= K <= P``).
        part_of: Part of every target in ``order``.
        order: The epoch's targets in batch order (a permutation of the training ids).
        rng: The epoch's generator (the ordering and the assignment are drawn from it).
        first: The first state's parts (default: ``K`` drawn at random). The buffer passes the previous
            epoch's last state, which is still resident: the epoch then starts without a read.
    """
    ids = np.arange(num_parts) if isinstance(num_parts, int) else np.asarray(num_parts, dtype=np.int64)
    perm = ids[rng.permutation(ids.shape[0])]
    if first is not None and len(first) == capacity:
        chosen = {int(p) for p in first}
        perm = np.concatenate([np.array(sorted(chosen), dtype=perm.dtype), [p for p in perm if int(p) not in chosen]])
    resident = sorted(int(p) for p in perm[:capacity])
    states = [BufferState(tuple(resident), None, None, np.empty(0, np.int64))]
    for q in perm[capacity:]:
        out = int(resident[int(rng.integers(len(resident)))])
        resident = sorted([p for p in resident if p != out] + [int(q)])
        states.append(BufferState(tuple(resident), int(q), out, np.empty(0, np.int64)))
    # part p is resident in states enter[p] .. leave[p] (an evicted part never returns within an epoch)
    size = int(ids.max()) + 1 if ids.size else 0
    enter = np.zeros(size, dtype=np.int64)
    leave = np.full(size, len(states) - 1, dtype=np.int64)
    for i, s in enumerate(states[1:], start=1):
        assert s.enters is not None and s.leaves is not None
        enter[s.enters] = i
        leave[s.leaves] = i - 1
    lo, hi = enter[part_of], leave[part_of]
    which = lo + np.floor(rng.random(order.shape[0]) * (hi - lo + 1)).astype(np.int64)
    which = np.minimum(which, hi)
    by_state = np.argsort(which, kind="stable")  # targets keep the permutation's order inside a state
    bounds = np.searchsorted(which[by_state], np.arange(len(states) + 1))
    for i, s in enumerate(states):
        s.targets = order[by_state[bounds[i]:bounds[i + 1]]]
    return states


# ---- the state's sampling graph ----------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _count_available(rows, indptr, src, local, avail, skip, counts):  # pragma: no cover - compiled
    """``counts[rows[i]] += #available sources of row i`` (rows with ``skip`` set contribute nothing).

    With ``local`` (a resident part's local source ids), a source among the part's own rows (local id below
    ``len(rows)``) is available without a look-up: most sources of a min-cut part are its own.
    """
    own = rows.shape[0] if local.shape[0] > 0 else 0
    kept = 0
    for i in range(rows.shape[0]):
        v = rows[i]
        if skip[v]:
            continue
        c = 0
        for k in range(indptr[i], indptr[i + 1]):
            if (own > 0 and local[k] < own) or avail[src[k]]:
                c += 1
        counts[v + 1] += c
        kept += c
    return kept


@njit(cache=True, nogil=True)
def _place_available(rows, indptr, src, local, eid, avail, skip, out_ptr, out_src, out_eid):  # pragma: no cover
    """Scatter each row's available sources (in stored order) to its slice of the state's CSR.

    Each row comes from one piece, so its slice starts at ``out_ptr[v]`` and is filled in one go. Store edge
    ids are written only when the piece has them (``eid`` not empty).
    """
    own = rows.shape[0] if local.shape[0] > 0 else 0
    with_eid = eid.shape[0] > 0
    for i in range(rows.shape[0]):
        v = rows[i]
        if skip[v]:
            continue
        at = out_ptr[v]
        for k in range(indptr[i], indptr[i + 1]):
            s = src[k]
            if (own > 0 and local[k] < own) or avail[s]:
                out_src[at] = s
                if with_eid:
                    out_eid[at] = eid[k]
                at += 1


@dataclass
class PartRows:
    """One part's in-edges over global ids, as the buffer keeps them beside its feature rows.

    Attributes:
        part: Part index (-1 for the cache's rows).
        rows: ``int64 [L]`` global ids of the destinations (ascending).
        indptr: ``int64 [L + 1]`` CSR over ``rows``.
        src: ``int64 [M]`` global source of each in-edge, in the store's order within a row.
        eid: ``int64 [M]`` the store's edge id of each in-edge; empty when the run has no edge data.
        local: ``[M]`` a part's local source ids, as its layout stores them (its own rows first, then its
            halo): a state's graph takes a source among the part's own rows without looking it up. Empty
            for the cache's rows.
    """

    part: int
    rows: np.ndarray
    indptr: np.ndarray
    src: np.ndarray
    eid: np.ndarray
    local: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self.rows.nbytes + self.indptr.nbytes + self.src.nbytes + self.eid.nbytes + self.local.nbytes)


#: A state's graph: ``(indptr, indices, edge_ids, kept, total)`` (see :class:`StateGraphs`).
StateGraph = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]


class StateGraphs:
    """Builds the in-edge CSR over global ids that each buffer state samples from, reusing its ``O(N)`` arrays.

    Rows are the pieces' destinations -- a cache piece's (``part < 0``) rows set in ``cache_skip`` are left out:
    a resident part holds those rows itself -- and each row keeps its sources with ``avail`` set, in stored
    order. With every part resident and no cache this is the store's CSR itself.

    Why a builder: a state's graph needs ``N + 1`` row pointers; allocated and zeroed afresh for each of an
    epoch's states they cost more than the edges (measured: 3.1 s of an 18.5 s epoch at 8M nodes). The counts
    are reset through the rows that set them, so a state costs ``O(N)`` for one prefix sum and ``O(edges)``
    otherwise. The row pointers are reused: a state's graph is valid until the next :meth:`build`.

    Args:
        num_nodes: ``N``.
    """

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = int(num_nodes)
        self._counts = np.zeros(self.num_nodes + 1, dtype=np.int32)  # a row's count; the pointers are int64
        self._indptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        self._no_skip = np.zeros(self.num_nodes, dtype=bool)

    def build(self, pieces: Sequence[PartRows], avail: np.ndarray,
              cache_skip: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        """``(indptr, indices, edge_ids, kept, total)`` of the state (``indptr`` is reused by the next build)."""
        counts = self._counts
        kept = 0
        total = 0
        skips = [cache_skip if p.part < 0 else self._no_skip for p in pieces]
        for p, skip in zip(pieces, skips):
            kept += int(_count_available(p.rows, p.indptr, p.src, p.local, avail, skip, counts))
            total += int(p.src.shape[0])
        indptr = np.cumsum(counts, out=self._indptr, dtype=np.int64)
        for p in pieces:
            counts[p.rows + 1] = 0
        indices = np.empty(kept, dtype=np.int64)
        eids = np.empty(kept if any(p.eid.shape[0] for p in pieces) else 0, dtype=np.int64)
        for p, skip in zip(pieces, skips):
            _place_available(p.rows, p.indptr, p.src, p.local, p.eid, avail, skip, indptr, indices, eids)
        return indptr, indices, eids, kept, total


def state_graph(num_nodes: int, pieces: Sequence[PartRows], avail: np.ndarray,
                cache_skip: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """One state's graph with fresh arrays (see :class:`StateGraphs`)."""
    return StateGraphs(num_nodes).build(pieces, avail, cache_skip)


# ---- inclusion probabilities (the cache's ranking) ---------------------------------------------------
def inclusion_probability(pieces: Callable[[], Iterator[PartRows]], num_nodes: int, degree: np.ndarray,
                          targets: np.ndarray,
                          fanouts: Sequence[int], batch_size: int) -> np.ndarray:
    """Probability that each node is an input of a batch (SALIENT++'s ``vip_analytical``), hop by hop.

    A batch draws ``batch_size`` of the ``len(targets)`` targets; a destination sampled with probability ``p``
    keeps each of its ``d`` in-neighbours with probability ``min(1, fanout / d)``, so a source's chance of being
    reached at the next hop is ``1 - prod (1 - p_v min(1, f / d_v))`` over its out-neighbours ``v``. Summed in
    log space with one scatter per hop over the edges (``pieces()`` streams the edges once per hop).

    Returns:
        ``float64 [N]`` probability of being sampled at hop 1 or beyond (targets' own hop 0 is left out: a
        target is always resident).
    """
    p = np.zeros(num_nodes, dtype=np.float64)
    p[targets] = min(1.0, batch_size / max(1, targets.shape[0]))
    miss = np.ones(num_nodes, dtype=np.float64)  # prod over hops of (1 - p_hop)
    deg = np.maximum(degree.astype(np.float64), 1.0)
    for fanout in fanouts:
        keep = p * (1.0 if fanout < 0 else np.minimum(1.0, fanout / deg))
        log_miss = np.zeros(num_nodes, dtype=np.float64)
        for piece in pieces():
            dst = np.repeat(piece.rows, np.diff(piece.indptr))
            with np.errstate(divide="ignore"):
                w = np.log1p(-np.minimum(keep[dst], 1.0 - 1e-12))
            log_miss += np.bincount(piece.src, weights=w, minlength=num_nodes)
        p = 1.0 - np.exp(log_miss)
        miss *= 1.0 - p
    return 1.0 - miss


def vip(indptr: np.ndarray, indices: np.ndarray, targets: np.ndarray, fanouts: Sequence[int],
        batch_size: int) -> np.ndarray:
    """:func:`inclusion_probability` over a whole in-edge CSR (one piece): each node's chance of being sampled."""
    indptr_np, indices_np = np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64)
    n = indptr_np.shape[0] - 1
    whole = PartRows(0, np.arange(n, dtype=np.int64), indptr_np, indices_np, np.empty(0, dtype=np.int64))
    return inclusion_probability(lambda: iter([whole]), n, np.diff(indptr_np), np.asarray(targets, dtype=np.int64),
                                 fanouts, batch_size)


# ---- the buffer ----------------------------------------------------------------------------------------
@dataclass
class BufferStats:
    """Counters of one epoch (reset by :meth:`PartitionBuffer.epoch`)."""

    parts_loaded: int = 0
    bytes_read: int = 0
    load_wait_s: float = 0.0
    inputs: int = 0
    cache_inputs: int = 0
    edges_kept: int = 0
    edges_total: int = 0
    states: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        """The epoch's buffer metrics for ``metrics.jsonl``."""
        return {"parts_loaded": float(self.parts_loaded), "buffer_bytes_read": float(self.bytes_read),
                "load_wait_s": self.load_wait_s, "buffer_states": float(self.states),
                "cache_hit_rate": self.cache_inputs / max(1, self.inputs),
                "neighbours_kept": self.edges_kept / max(1, self.edges_total), **self.extra}


class LayoutRows(FeatureSource):
    """Feature rows of a partitioned layout by global id, read from its per-part ``x.npy`` memory maps.

    Why: exact evaluation reads every node's row once per pass in id order; this serves it from the layout
    (the run needs no copy of the features in the store) without loading the table.

    Args:
        path: Layout directory.
        node_part: ``int32 [N]`` part of every node.
    """

    def __init__(self, path: Path, node_part: np.ndarray) -> None:
        num_parts = int(node_part.max()) + 1 if node_part.size else 0
        self.maps = [np.load(path / part_dir_name(p) / "x.npy", mmap_mode="r") for p in range(num_parts)]
        self.maps = [m.reshape(m.shape[0], -1) for m in self.maps]
        self.node_part = node_part
        order = np.argsort(node_part, kind="stable")
        starts = np.searchsorted(node_part[order], np.arange(num_parts))
        self.row_in_part = np.empty(node_part.shape[0], dtype=np.int32 if order.shape[0] < 2**31 else np.int64)
        self.row_in_part[order] = np.arange(order.shape[0], dtype=np.int64) - starts[node_part[order]]
        self.num_rows = int(node_part.shape[0])
        self.dim = int(self.maps[0].shape[1]) if self.maps else 0
        self.dtype = torch.from_numpy(np.empty(0, dtype=self.maps[0].dtype)).dtype if self.maps else torch.float32

    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """Rows of ``ids`` (any order), part by part."""
        ids_np = np_int64(ids)
        n = ids_np.shape[0]
        rows = torch.empty((n, self.dim), dtype=self.dtype) if out is None else out[: n * self.dim].view(n, self.dim)
        parts = self.node_part[ids_np]
        for p in np.unique(parts):
            at = np.flatnonzero(parts == p)
            local = self.row_in_part[ids_np[at]]
            block = np.empty((at.shape[0], self.dim), dtype=self.maps[p].dtype)
            gather_rows(self.maps[p], local, block)
            rows[torch.from_numpy(at)] = torch.from_numpy(block)
        return rows


class ArenaRows(FeatureSource):
    """Feature rows of the buffer's resident parts and cache: one arena, one ``[N]`` map to its rows.

    ``slot_of[v]`` is node ``v``'s row in the arena, or -1 when it is not resident. Rows are row-normalized
    once when they are read (the normalization of a row depends on that row only).
    """

    def __init__(self, arena: np.ndarray, slot_of: np.ndarray) -> None:
        self.arena = arena
        self.slot_of = slot_of
        self.num_rows = int(slot_of.shape[0])
        self.dim = int(arena.shape[1])
        self.dtype = torch.from_numpy(np.empty(0, dtype=arena.dtype)).dtype

    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """Rows of ``ids`` (all resident) from the arena."""
        ids_np = np_int64(ids)
        n = ids_np.shape[0]
        rows = torch.empty((n, self.dim), dtype=self.dtype) if out is None else out[: n * self.dim].view(n, self.dim)
        if n:
            where = self.slot_of[ids_np]
            gather_rows(self.arena, where, rows.numpy())
        return rows


#: Quantization levels each side of zero of a kept rehearsal row (4 bits: -7 .. 7 times the row's scale).
KEPT_LEVELS = 7


@njit(nogil=True, cache=True)
def _unpack4_into(q, scale, levels, width, out, at):  # pragma: no cover - compiled
    """Row ``r`` of the packed 4-bit rows ``q`` (two values a byte), dequantized into ``out[at[r]]``."""
    half = width // 2
    for r in range(q.shape[0]):
        s = scale[r]
        row = q[r]
        dst = out[at[r]]
        for j in range(half):
            b = np.int32(row[j])
            dst[2 * j] = np.float32((b & 15) - levels - 1) * s
            dst[2 * j + 1] = np.float32((b >> 4) - levels - 1) * s
        if width % 2:
            dst[width - 1] = np.float32((np.int32(row[half]) & 15) - levels - 1) * s


@dataclass
class Kept:
    """A rehearsal batch kept while its part is away, in as few bytes as it can be rebuilt from.

    Its blocks hold only their CSR (int32 local ids; store edge ids where the run has edge data): the
    reverse graphs and degrees are rebuilt when the step's rehearsal batches are merged
    (:meth:`~trellis.loader.sampler.NeighborSampler.merge`). Its rows are 4-bit integers with one scale
    per row, two to a byte: the rows are what limits how many targets a buffer can rehearse within a budget,
    and 4 bits hold them in an eighth of float32's bytes with an error of at most half a step
    (``max |row| / 14``). Measured on the 1M planted graph (docs/minibatch.md): the same accuracy as float32
    rows (85.05 against 85.04) and int8 rows (85.01).

    **Collapsed** (``fixed`` rows): when the model's first layer is pushed down, the batch keeps that
    layer's aggregation of its input rows (computed once, :class:`trellis.nn.executor.InputAggregation`)
    and only its first hop's own rows; its input block has no edges and carries the aggregation
    (:attr:`~trellis.ops.graph.CSRGraph.fixed_aggregation`). Its rows are then the first hop's rows followed
    by their aggregations.
    """

    batch: Batch
    q: Tensor
    scale: Tensor
    width: int = 0
    #: Rows that are inputs (the rest, in a collapsed batch, are the input block's fixed aggregation).
    inputs: int = -1

    def __post_init__(self) -> None:
        if self.inputs < 0:
            self.inputs = int(self.q.shape[0])

    @property
    def collapsed(self) -> bool:
        """Whether the batch keeps its first layer's aggregation instead of that layer's input rows."""
        return self.inputs < self.q.shape[0]

    @classmethod
    def of(cls, batch: Batch, rows: np.ndarray, *, edge_ids: bool, fixed: np.ndarray | None = None) -> Kept:
        """``batch``'s CSR and ``rows`` (float ``[n, F]``, quantized); its store edge ids if ``edge_ids``.

        With ``fixed`` (``[n1, F]``, the first layer's aggregation on ``batch.blocks[0]``), the collapsed form:
        the input block becomes one without edges over its ``n1`` destinations, and only their rows are kept
        (``rows`` may then hold only those).
        """
        blocks = [CSRGraph(b.indptr, b.indices.to(torch.int32), b.num_src,
                           edge_ids=b.edge_ids if edge_ids else None) for b in batch.blocks]
        node_ids = batch.node_ids
        inputs = rows.shape[0]
        if fixed is not None:
            n1 = blocks[0].num_dst
            blocks[0] = CSRGraph(torch.zeros(n1 + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), n1,
                                 edge_ids=torch.zeros(0, dtype=torch.int64) if edge_ids else None)
            node_ids, inputs = node_ids[:n1].clone(), n1
            rows = np.concatenate([rows[:n1], np.asarray(fixed, dtype=np.float32)])
        light = Batch(blocks=blocks, node_ids=node_ids, num_targets=batch.num_targets, seed=batch.seed,
                      replay=True)
        top = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(rows.shape[0], dtype=np.float32)
        scale = np.where(top > 0, top / KEPT_LEVELS, 1.0).astype(np.float32)
        q = np.rint(rows / scale[:, None]).astype(np.int16) + KEPT_LEVELS + 1  # 1 .. 2 * levels + 1
        width = int(rows.shape[1])
        if width % 2:
            q = np.concatenate([q, np.zeros((q.shape[0], 1), dtype=q.dtype)], axis=1)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two values per byte
        return cls(light, torch.from_numpy(packed), torch.from_numpy(scale), width, inputs)

    def _unpack(self, lo: int, hi: int, out: np.ndarray | None, at: np.ndarray | None) -> Tensor:
        if out is None:
            out = np.empty((hi - lo, self.width), dtype=np.float32)
            at = np.arange(hi - lo, dtype=np.int64)
        assert at is not None
        _unpack4_into(self.q.numpy()[lo:hi], self.scale.numpy()[lo:hi], KEPT_LEVELS, self.width, out, at)
        return torch.from_numpy(out)

    def rows(self, out: np.ndarray | None = None, at: np.ndarray | None = None) -> Tensor:
        """The input rows, dequantized (float32): new, or written to rows ``at`` of ``out`` (returned)."""
        return self._unpack(0, self.inputs, out, at)

    def fixed(self, out: np.ndarray | None = None, at: np.ndarray | None = None) -> Tensor:
        """A collapsed batch's first-layer aggregation, dequantized like :meth:`rows`."""
        return self._unpack(self.inputs, int(self.q.shape[0]), out, at)

    @property
    def nbytes(self) -> int:
        """Bytes it holds: rows, scales, node ids and the blocks' CSR."""
        tensors = [self.q, self.scale, self.batch.node_ids]
        for g in self.batch.blocks:
            tensors += [t for t in (g.indptr, g.indices, g.edge_ids) if t is not None]
        return int(sum(t.numel() * t.element_size() for t in tensors))


def default_replay_fanouts(fanouts: Sequence[int]) -> list[int]:
    """Rehearsal batches' fanouts by default: the run's, with the target layer's halved (rounded up; -1 stays).

    Why: a rehearsal's training cost is its first hop's rows (its input layer is collapsed, :class:`Kept`), and
    the target layer's fanout sets how many there are. A rehearsal batch is there to keep every part's
    targets in each step's gradient, not to estimate their neighbourhoods as finely as a live batch. Measured
    on the 1M planted graphs (1 of 16 parts resident, fanouts 10,5, docs/minibatch.md): 5,5 instead of
    10,5 cut the epoch from 1.61-1.65x to 1.50-1.54x in-memory's and stayed within 0.35 points of its accuracy.
    """
    out = [int(f) for f in fanouts]
    if out and out[0] > 0:
        out[0] = max(1, math.ceil(out[0] / 2))
    return out


class PartitionBuffer:
    """K of P parts (plus a cache) in memory, swapped one at a time; the neighbour batches of an epoch.

    Args:
        layout: The partitioned layout (destination-owned).
        capacity: ``K``, parts resident per state.
        fanouts: Per-layer fanouts, target layer first.
        train_ids: Training node ids (global), in the store's order.
        batch_size: Targets per batch.
        y: Labels by global id (a tensor on the training device), or None.
        degree: ``[N]`` global in-degrees (GCN's normalization on a block).
        feature_norm: ``row``, ``l2`` or ``none``, applied to rows as they are read.
        cache_rows: Rows of the VIP cache (0 = in-buffer sampling only).
        labor: LABOR-0 sampling.
        seed: Base seed of shuffles and samples (as :class:`~trellis.loader.sampler.NeighborLoader`'s).
        device: Where batches are delivered.
        prefetch: Batches prepared ahead on the producer thread.
        edge_weight / edge_feat: Edge data by the store's edge id (None = none).
        cluster_layers: Cluster-batch mode for a model of this many layers (0 = neighbour batches): every
            buffer state is one batch, the subgraph induced by its resident parts (GraphTheta's cluster-batch
            with clusters = parts), with the loss on the state's targets.
        replay: Rehearsal targets kept per part (0 = none): each step also trains on the kept batches of the
            parts not resident, so a state whose parts hold few classes (min-cut parts of a homophilous
            graph) does not drive the model to those classes (see ``docs/minibatch.md``). A part's batches
            are replaced each time the part is resident and kept across epochs (:meth:`state_dict` holds them).
        replay_share: Targets a step rehearses, as a fraction of ``batch_size``: each step trains one kept
            batch of every part not resident, of ``replay_share * batch_size / (P - K)`` targets (default: 1,
            as many as it trains; measured in ``docs/minibatch.md``).
        replay_fanouts: Fanouts of the rehearsal batches (default: :func:`default_replay_fanouts`).
        parts: The parts this buffer reads and draws its states from (default: every part of the layout): a
            distributed rank's parts. Its targets must lie in them; the cache may hold rows of any part.
    """

    def __init__(self, layout: PartitionedGraph, capacity: int, fanouts: Sequence[int], train_ids: np.ndarray,
                 batch_size: int, *, y: Tensor | None, degree: np.ndarray, feature_norm: str = "none",
                 cache_rows: int = 0, labor: bool = False, seed: int = 0, device: torch.device | str = "cpu",
                 prefetch: int = 2, edge_weight: Tensor | None = None, edge_feat: Tensor | None = None,
                 cluster_layers: int = 0, replay: int = 0, replay_share: float = 1.0,
                 replay_fanouts: Sequence[int] | None = None, parts: Sequence[int] | None = None) -> None:
        self.layout = layout
        self.path = Path(layout.path)
        self.num_parts = layout.num_parts
        self.num_nodes = layout.num_nodes
        self.parts = list(range(self.num_parts)) if parts is None else sorted(int(p) for p in parts)
        if not 1 <= capacity <= len(self.parts):
            whose = "the layout's parts" if parts is None else "this rank's parts"
            raise TrellisUserError(f"--buffer-parts {capacity}: give 1 to {len(self.parts)} ({whose})")
        self.capacity = int(capacity)
        self.fanouts = list(fanouts)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.prefetch = max(0, int(prefetch))
        self.feature_norm = feature_norm
        self.y = y
        self.edge_weight, self.edge_feat = edge_weight, edge_feat
        self.cluster_layers = int(cluster_layers)
        self.replay = int(replay)
        # a step rehearses replay_share of a batch's targets, one kept batch per part not resident
        away = max(1, len(self.parts) - int(capacity))
        self.replay_batch = max(1, math.ceil(float(replay_share) * int(batch_size) / away))
        self.replay_fanouts = default_replay_fanouts(self.fanouts) if replay_fanouts is None else list(replay_fanouts)
        if len(self.replay_fanouts) != len(self.fanouts):
            raise ValueError(f"replay_fanouts {self.replay_fanouts}: give one per layer ({len(self.fanouts)})")
        parts_info = layout.manifest["parts"]
        self.part_rows = np.array([int(p["num_local"]) for p in parts_info], dtype=np.int64)
        self.max_rows = int(self.part_rows[self.parts].max()) if self.parts else 0
        x0 = np.load(self.path / part_dir_name(0) / "x.npy", mmap_mode="r")
        self.dim = int(np.prod(x0.shape[1:])) if x0.ndim > 1 else 1
        self.train_ids = np_int64(train_ids)
        self.node_part = np.asarray(np.load(self.path / "node_parts.npy"), dtype=np.int32)
        # arena: K + 1 part slots (each with slack for one O_DIRECT read of its part), then the cache's rows
        slots = min(self.capacity + 1, len(self.parts))
        row_bytes = self.dim * 4
        self.slot_stride = direct_slot_stride(self.max_rows, row_bytes)
        rows = slots * self.slot_stride + int(cache_rows)
        self._raw = np.empty(rows * row_bytes + 2 * DIRECT_BLOCK, dtype=np.uint8)
        # slot 0's first row sits NPY_HEADER bytes past a block boundary, with a block or more before it
        first = (NPY_HEADER - self._raw.ctypes.data) % DIRECT_BLOCK + DIRECT_BLOCK
        self._arena_at = first
        self.arena = self._raw[first: first + rows * row_bytes].view(np.float32).reshape(rows, self.dim)
        self.slot_of = np.full(self.num_nodes, -1, dtype=np.int64)
        self.free_slots = list(range(slots))
        self.slot_of_part: dict[int, int] = {}
        self.pieces: dict[int, PartRows] = {}
        self.degree = np.asarray(degree, dtype=np.float32)
        self.sampler = NeighborSampler(np.zeros(self.num_nodes + 1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                                       self.fanouts, labor=labor, degrees=self.degree)
        self.features = FeatureGather(ArenaRows(self.arena, self.slot_of), slots=self.prefetch + 3,
                                      pin=self.device.type == "cuda")
        self.cached = np.zeros(self.num_nodes, dtype=bool)
        self._in_parts = np.zeros(self.num_nodes, dtype=bool)  # node's part is resident
        self._avail = np.zeros(self.num_nodes, dtype=bool)  # resident or cached
        self._builders = (StateGraphs(self.num_nodes), StateGraphs(self.num_nodes))
        self._flip = 0
        self.cache_base = self.arena.shape[0] - int(cache_rows)
        self.cache_piece: PartRows | None = None
        self.stats = BufferStats()
        #: The previous epoch's last state: the next epoch starts from it (its parts are still resident). Part
        #: of a run's checkpointed state (:meth:`state_dict`), so a resumed run plans the same epochs.
        self.carry: tuple[int, ...] | None = None
        #: Part -> its rehearsal batches (``replay``), kept across epochs and checkpointed with the carry.
        self.pool: dict[int, list[Kept]] = {}
        #: The model's first-layer aggregation (``(block, rows) -> [num_dst, F]``), set by the strategy when
        #: that layer is pushed down: rehearsal batches are then kept collapsed (:class:`Kept`).
        self.collapse: Callable[[CSRGraph, Tensor], Tensor] | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-buffer-io")
        self._slots_used = 0  # rotating gather buffers handed out (:meth:`_next_slot`)
        self._lock = threading.Lock()
        if cache_rows > 0:
            self._fill_cache(int(cache_rows))

    # -- reading parts ---------------------------------------------------------------------------------
    def _part_file(self, part: int, name: str) -> Path:
        return self.path / part_dir_name(part) / name

    def read_edges(self, part: int) -> PartRows:
        """Part ``part``'s in-edges over global ids (one sequential read per array)."""
        nl = int(self.part_rows[part])
        l2g = read_npy(self._part_file(part, "local_to_global.npy"))
        indptr = read_npy(self._part_file(part, "indptr.npy"))
        indices = read_npy(self._part_file(part, "indices.npy"))
        need_eid = self.edge_weight is not None or self.edge_feat is not None
        eid = read_npy(self._part_file(part, "edge_ids.npy")) if need_eid else np.zeros(0, dtype=np.int64)
        self._count(l2g, indptr, indices, eid)
        if int(indptr[nl]) != indices.shape[0]:
            raise TrellisUserError(f"{self.path}: part {part} is not destination-owned (its halo rows hold edges); "
                                   "partition with a destination-owned method (grem, metis, ldg, fennel, random)")
        src = l2g[indices]
        return PartRows(part, np.ascontiguousarray(l2g[:nl]), np.ascontiguousarray(indptr[: nl + 1]), src, eid,
                        local=indices)

    def _count(self, *arrays: np.ndarray) -> None:
        with self._lock:
            self.stats.bytes_read += int(sum(a.nbytes for a in arrays))

    def _load(self, part: int, slot: int) -> PartRows:
        """Read part ``part`` into ``slot``: its rows (normalized) and its in-edges."""
        t0 = time.perf_counter()
        try:
            return self._read_part(part, slot)
        finally:
            with self._lock:
                self.stats.extra["read_s"] = self.stats.extra.get("read_s", 0.0) + time.perf_counter() - t0

    def _read_part(self, part: int, slot: int) -> PartRows:
        nl = int(self.part_rows[part])
        rows = self.arena[slot * self.slot_stride: slot * self.slot_stride + nl]
        path = self._part_file(part, "x.npy")
        if not read_npy_direct(path, self._raw, self._arena_at + slot * self.slot_stride * self.dim * 4, rows):
            read_npy(path, rows)
        self._count(rows)
        normalize_rows_(rows, self.feature_norm)
        piece = self.read_edges(part)
        with self._lock:
            self.stats.parts_loaded += 1
        return piece

    def _activate(self, part: int, slot: int, piece: PartRows) -> None:
        """Point the part's (uncached) nodes at their rows in ``slot``."""
        nodes = piece.rows
        local = np.arange(nodes.shape[0], dtype=np.int64) + slot * self.slot_stride
        keep = ~self.cached[nodes]
        self.slot_of[nodes[keep]] = local[keep]
        self._in_parts[nodes] = True
        self._avail[nodes] = True
        self.slot_of_part[part] = slot
        self.pieces[part] = piece

    def _evict(self, part: int) -> None:
        slot = self.slot_of_part.pop(part)
        piece = self.pieces.pop(part)
        nodes = piece.rows
        self.slot_of[nodes[~self.cached[nodes]]] = -1
        self._in_parts[nodes] = False
        self._avail[nodes] = self.cached[nodes]
        self.free_slots.append(slot)

    def iter_all_edges(self) -> Iterator[PartRows]:
        """Every part's in-edges, one part at a time (a streaming pass)."""
        for p in range(self.num_parts):
            yield self.read_edges(p)

    def _fill_cache(self, rows: int) -> None:
        """Rank nodes by inclusion probability and read the top ``rows`` into the cache (one pass over the parts).

        The cache keeps each chosen node's feature row and its in-edges, so a cached neighbour can also be
        expanded at the next hop.
        """
        t0 = time.perf_counter()
        prob = inclusion_probability(self.iter_all_edges, self.num_nodes, self.degree, self.train_ids, self.fanouts,
                                     self.batch_size)
        rows = min(rows, self.num_nodes)
        chosen = np.sort(np.argpartition(-prob, rows - 1)[:rows]) if rows < self.num_nodes else np.arange(rows)
        self.cached[chosen] = True
        self._avail[chosen] = True
        self.slot_of[chosen] = self.cache_base + np.arange(rows, dtype=np.int64)
        lens, srcs, eids = [], [], []
        for p in range(self.num_parts):
            mine = chosen[self.node_part[chosen] == p]
            if mine.size == 0:
                continue
            piece = self.read_edges(p)
            local = np.searchsorted(piece.rows, mine)
            x = np.load(self._part_file(p, "x.npy"), mmap_mode="r")
            block = np.asarray(x[local], dtype=np.float32).reshape(mine.shape[0], -1)
            self._count(block)
            normalize_rows_(block, self.feature_norm)
            self.arena[self.slot_of[mine]] = block
            take = expand_ranges(piece.indptr[local], piece.indptr[local + 1])
            lens.append(np.diff(piece.indptr)[local])
            srcs.append(piece.src[take])
            eids.append(piece.eid[take] if piece.eid.shape[0] else np.zeros(0, dtype=np.int64))
        indptr = np.zeros(rows + 1, dtype=np.int64)
        if lens:
            np.cumsum(np.concatenate(lens), out=indptr[1:])
        cat = (lambda a: np.concatenate(a) if a else np.zeros(0, dtype=np.int64))  # noqa: E731
        # chosen is sorted and grouped by part in the loop's order: re-sort rows by id with their edges
        by_part = np.concatenate([chosen[self.node_part[chosen] == p] for p in range(self.num_parts)])
        piece = PartRows(-1, by_part, indptr, cat(srcs), cat(eids))
        self.cache_piece = piece
        self.cache_fill_s = time.perf_counter() - t0
        self.cache_probability = float(prob[chosen].sum() / max(float(prob.sum()), 1e-300))

    # -- epochs ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch (about; each state's last batch may be smaller)."""
        return -(-self.train_ids.shape[0] // self.batch_size)

    def plan(self, epoch_seed: int) -> BufferEpoch:
        """The epoch's buffer states and targets (a pure function of the seeds)."""
        rng = np.random.default_rng(mix64(self.seed, epoch_seed, 0x5EED) >> 1)
        order = self.train_ids[rng.permutation(self.train_ids.shape[0])]  # as NeighborLoader.plan draws it
        srng = np.random.default_rng(mix64(self.seed, epoch_seed, 0xB0FF) >> 1)
        states = buffer_states(self.parts, self.capacity, self.node_part[order], order, srng, first=self.carry)
        cut_steps(states, self.batch_size)
        first = 0
        for s in states:
            s.first_batch = first
            first += s.num_batches
        return BufferEpoch(epoch_seed, states, self.batch_size)

    def _state_graph(self, state: BufferState, entering: PartRows | None = None) -> StateGraph:
        """The graph ``state`` samples from; ``entering``: built ahead, for the state after the current one.

        Built ahead (on the reading thread, while the current state's batches train), the availability is the
        current one with the leaving part's rows taken out and the entering part's put in, and the row pointers
        go to the other of two alternating builders (the current state's graph is still in use).
        """
        in_parts, avail = self._in_parts, self._avail  # kept up to date by _activate and _evict
        pieces = [self.pieces[p] for p in state.parts if entering is None or p != entering.part]
        if entering is not None:
            assert state.leaves is not None
            in_parts, avail = in_parts.copy(), avail.copy()
            gone = self.pieces[state.leaves].rows
            in_parts[gone] = False
            avail[gone] = self.cached[gone]
            in_parts[entering.rows] = True
            avail[entering.rows] = True
            pieces.append(entering)
        if self.cache_piece is not None:  # the cache's rows whose part is not resident come from the cache
            pieces.append(self.cache_piece)
        self._flip ^= 1
        return self._builders[self._flip].build(pieces, avail, in_parts)

    def _load_ahead(self, state: BufferState, slot: int) -> tuple[PartRows, StateGraph, float]:
        """Read ``state``'s entering part into ``slot`` and build ``state``'s graph (the reading thread's job)."""
        assert state.enters is not None
        piece = self._load(state.enters, slot)
        t0 = time.perf_counter()
        graph = self._state_graph(state, piece)
        return piece, graph, time.perf_counter() - t0

    def _build(self, sampler: NeighborSampler, eids: np.ndarray, state: BufferState, plan: BufferEpoch,
               j: int, *, alone: bool = True) -> Batch:
        """Batch ``j`` of ``state``; unless it is a whole step (``alone`` and its step's end), a piece of one."""
        index = state.first_batch + j
        lo, hi, step_end, weight = state.cuts[j]
        batch = sampler.sample(state.targets[lo:hi], batch_seed(self.seed, plan.epoch, index))
        batch.index = index
        batch.step_end, batch.step_weight = step_end, weight
        ids = batch.node_ids.numpy()
        with self._lock:
            self.stats.inputs += int(ids.shape[0])
            if self.cache_piece is not None:
                self.stats.cache_inputs += int(np.count_nonzero(self.slot_of[ids] >= self.cache_base))
        if step_end and alone:
            batch.x = self.features.gather(batch.node_ids, self._next_slot())
            return self._finish(batch, eids)
        # a piece of a step, merged on the CPU into a new batch: its rows are not in the rotating buffers
        batch.x = self.features.gather(batch.node_ids)
        return self._finish(batch, eids, move=False)

    def _next_slot(self) -> int:
        """The rotating gather buffer for the next batch yielded with its rows in one.

        Why a count and not the batch's index: pieces of a step that spans states take no buffer and are not
        yielded, so indices skip; two batches in the prefetch window could then share a buffer (batch 0 and
        batch 4 when 1 and 3 were pieces), and the later gather overwrote rows still being trained on.
        """
        self._slots_used += 1
        return self._slots_used

    def _whole_step(self, pieces: list[Batch]) -> Batch:
        """The pieces of a step that spans buffer states (each sampled in its own state) as one batch.

        Why: one forward and backward pass instead of one per piece (the trainer's accumulated gradient is
        the same: each piece weighed its share of the step's targets).
        """
        merged = self.sampler.merge(pieces)  # rows carried over; store edge ids already
        merged.index = pieces[-1].index
        merged.step_end, merged.step_weight = True, 1.0
        return self._finish(merged, None)

    def _finish(self, batch: Batch, eids: np.ndarray | None, *, move: bool = True) -> Batch:
        """Labels, edge data (``eids``: the state CSR's positions -> store edge ids; None: already store ids)."""
        if self.y is not None:
            batch.y = self.y.index_select(0, batch.targets.to(self.y.device))
        if self.edge_weight is not None or self.edge_feat is not None:
            if eids is not None:
                for b in {id(b): b for b in batch.blocks}.values():
                    assert b.edge_ids is not None
                    b.edge_ids = torch.from_numpy(eids[b.edge_ids.numpy()])
            attach_edge_data(batch.blocks, self.edge_weight, self.edge_feat)
        if move and self.device.type != "cpu":
            return batch.to(self.device, non_blocking=True)
        return batch

    def _rehearse(self, sampler: NeighborSampler, eids: np.ndarray, state: BufferState, plan: BufferEpoch, k: int,
                  pool: dict[int, list[Kept]]) -> None:
        """Keep up to ``replay`` of ``state``'s targets per resident part as that part's rehearsal batches.

        The targets, in random order, are sampled from the state's graph as one batch, which is split into
        batches of ``replay_batch`` (:func:`~trellis.loader.sampler.split_batch`); their rows are copied out of
        the arena (in 4 bits, :class:`Kept`), so they stay valid after the part is evicted.
        """
        rng = np.random.default_rng(mix64(self.seed, plan.epoch, 0x4E91, k) >> 1)
        of_part = self.node_part[state.targets]
        fresh: dict[int, list[Kept]] = {}
        edge_data = self.edge_weight is not None or self.edge_feat is not None
        rehearsal = sampler.with_fanouts(self.replay_fanouts)
        for p in state.parts:
            mine = state.targets[of_part == p]
            if mine.shape[0] == 0:
                continue
            pick = mine[rng.choice(mine.shape[0], size=min(self.replay, mine.shape[0]), replace=False)]
            rb = rehearsal.sample(pick, int(rng.integers(0, 2**62)))
            for b in rb.blocks if edge_data else ():  # the state CSR's positions -> store edge ids
                assert b.edge_ids is not None
                b.edge_ids = torch.from_numpy(eids[b.edge_ids.numpy()])
            rows = self.arena[self.slot_of[rb.node_ids.numpy()]]
            fixed = self._input_aggregation(rb.blocks[0], rows)
            cuts = [(c, min(c + self.replay_batch, pick.shape[0])) for c in range(0, pick.shape[0], self.replay_batch)]
            kept = []
            for sub, at in split_batch(rb, cuts):
                if fixed is not None:  # collapsed: only the first hop's rows and their aggregations
                    at = at[:sub.blocks[0].num_dst]
                kept.append(Kept.of(sub, rows[at], edge_ids=edge_data, fixed=None if fixed is None else fixed[at]))
            fresh[int(p)] = kept
        with self._lock:  # the producer thread reads the pool's other parts meanwhile
            pool.update(fresh)

    def _input_aggregation(self, block: CSRGraph, rows: np.ndarray) -> np.ndarray | None:
        """The first layer's aggregation of ``rows`` on ``block`` (:attr:`collapse`), on the CPU; None without one."""
        if self.collapse is None:
            return None
        if self.edge_weight is not None:  # a weighted aggregation reads the block's own weights
            assert block.edge_ids is not None
            block.edge_weight = self.edge_weight.index_select(0, block.edge_ids.to(self.edge_weight.device)).cpu()
        return self.collapse(block, torch.from_numpy(rows)).cpu().numpy()

    def _with_replay(self, batch: Batch, state: BufferState, pool: dict[int, list[Kept]]) -> Iterator[Batch]:
        """``batch``, then (at a step's end) one rehearsal batch of every part not resident, as one batch.

        Each part's rehearsal targets weigh as one resident part's share of the step, so every part weighs
        the same in the step's gradient whichever parts are resident.
        """
        with self._lock:  # the reading thread may be keeping a resident part's batches
            away = [p for p in sorted(pool) if p not in state.parts] if batch.step_end else []
            kept = [pool[p][batch.index % len(pool[p])] for p in away]
        if not kept:
            yield batch
            return
        batch.step_end = False
        yield batch
        parts = [c.batch for c in kept]
        positions = merged_positions(parts)
        merged = self.sampler.merge(parts, positions)
        x = np.empty((merged.num_inputs, self.dim), dtype=np.float32)
        for c, at in zip(kept, positions, strict=True):
            c.rows(x, at)  # each kept batch's rows straight into their places
        merged.x = torch.from_numpy(x)
        if kept[0].collapsed:  # their inputs are their first hops: the aggregations go where those rows went
            fixed = np.empty((merged.blocks[0].num_dst, self.dim), dtype=np.float32)
            for c, at in zip(kept, positions, strict=True):
                c.fixed(fixed, at)
            merged.blocks[0].fixed_aggregation = torch.from_numpy(fixed)
        merged.index, merged.replay = batch.index, True
        merged.step_weight = len(away) / max(1, len(state.parts))
        yield self._finish(merged, None)

    def _cluster_batch(self, sampler: NeighborSampler, eids: np.ndarray, state: BufferState, plan: BufferEpoch,
                       k: int) -> Batch:
        """The state as one cluster-batch: the subgraph induced by its resident parts, loss on its targets."""
        nodes = np.concatenate([self.pieces[p].rows for p in state.parts])
        sub_ip, sub_ix, pos, node_ids, hop_ends = induced_subgraph(sampler.indptr, sampler.indices, nodes,
                                                                   local_of=sampler._scratch.get())
        ids_t = torch.from_numpy(node_ids)
        blocks = prefix_blocks(sub_ip, sub_ix, hop_ends, self.cluster_layers, ids_t)
        if self.edge_weight is not None or self.edge_feat is not None:
            blocks[0].edge_ids = torch.from_numpy(eids[pos])
            attach_edge_data(blocks, self.edge_weight, self.edge_feat)
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[state.targets] = True
        batch = Batch(blocks=blocks, node_ids=ids_t, num_targets=int(node_ids.shape[0]),
                      loss_mask=torch.from_numpy(mask[node_ids]), index=k,
                      seed=int(batch_seed(self.seed, plan.epoch, k)))
        with self._lock:
            self.stats.inputs += int(node_ids.shape[0])
        batch.x = self.features.gather(batch.node_ids, self._next_slot())
        if self.y is not None:
            batch.y = self.y.index_select(0, batch.targets.to(self.y.device))
        return batch.to(self.device, non_blocking=True) if self.device.type != "cpu" else batch

    def _ensure(self, parts: Sequence[int]) -> None:
        """Make ``parts`` resident (the epoch's first state): evict others, read the missing ones."""
        for p in [p for p in self.slot_of_part if p not in parts]:
            self._evict(p)
        for p in parts:
            if p not in self.slot_of_part:
                slot = self.free_slots.pop()
                self._activate(p, slot, self._load(p, slot))

    def release(self) -> None:
        """Evict every resident part (their slots are free for other use; the next epoch reads them again)."""
        for p in list(self.slot_of_part):
            self._evict(p)

    def _produce(self, plan: BufferEpoch) -> Iterator[Batch]:
        stats = self.stats
        t0 = time.perf_counter()
        self._ensure(plan.states[0].parts)
        stats.load_wait_s += time.perf_counter() - t0
        pending: Future[tuple[PartRows, StateGraph, float]] | None = None
        pending_slot = -1
        rehearsing: Future[None] | None = None  # the current state's rehearsal batches, kept on the reading thread
        pool = self.pool
        pieces: list[Batch] = []  # the batches so far of a step that spans buffer states
        t0 = time.perf_counter()
        graph = self._state_graph(plan.states[0])
        stats.extra["state_build_s"] = time.perf_counter() - t0
        try:
            for k, state in enumerate(plan.states):
                if k > 0:
                    assert pending is not None and state.leaves is not None and state.enters is not None
                    t0 = time.perf_counter()
                    if rehearsing is not None:  # the leaving part's rows are read until its batches are kept
                        rehearsing.result()
                        rehearsing = None
                    piece, graph, build_s = pending.result()
                    pending = None
                    stats.load_wait_s += time.perf_counter() - t0
                    stats.extra["state_build_s"] += build_s
                    self._evict(state.leaves)  # every batch of the previous state is built: its slot is free
                    self._activate(state.enters, pending_slot, piece)
                indptr, indices, eids, kept, total = graph
                sampler = self.sampler.with_graph(indptr, indices)
                if self.replay and not self.cluster_layers:
                    # Kept on the reading thread while this state's batches are built: the kept batches of a
                    # resident part are not read before it leaves, and the state's graph and rows stay valid
                    # until then (the next state's graph goes to the other builder).
                    rehearsing = self._io.submit(self._rehearse, sampler, eids, state, plan, k, pool)
                if k + 1 < len(plan.states):  # read the next state's part while this state's batches train
                    pending_slot = self.free_slots.pop()
                    pending = self._io.submit(self._load_ahead, plan.states[k + 1], pending_slot)
                stats.edges_kept += kept
                stats.edges_total += total
                stats.states += 1
                if self.cluster_layers:
                    yield self._cluster_batch(sampler, eids, state, plan, k)
                    continue
                for j in range(state.num_batches):
                    batch = self._build(sampler, eids, state, plan, j, alone=not pieces)
                    if not batch.step_end:
                        pieces.append(batch)
                        continue
                    if pieces:
                        batch = self._whole_step([*pieces, batch])
                        pieces = []
                    if self.replay:
                        yield from self._with_replay(batch, state, pool)
                    else:
                        yield batch
            if rehearsing is not None:  # the last state's, before the epoch counts as produced
                rehearsing.result()
                rehearsing = None
        finally:
            if rehearsing is not None:  # stopped early: its rows stay valid until it ends
                rehearsing.result()
            if pending is not None:  # stopped early: the slot being read is free again once the read ends
                try:
                    pending.result()
                finally:
                    self.free_slots.append(pending_slot)

    def epoch(self, epoch_seed: int) -> Iterator[Batch]:
        """The epoch's batches in order, prepared ``prefetch`` ahead; resets :attr:`stats`."""
        self.stats = BufferStats()
        io0 = proc_io().get("read_bytes", 0)
        plan = self.plan(epoch_seed)
        stats = self.stats
        yield from prefetch_iter(self._produce(plan), self.prefetch)
        self.carry = plan.states[-1].parts  # only once the whole epoch was produced
        stats.extra["storage_bytes_read"] = float(proc_io().get("read_bytes", 0) - io0)
        if self.replay:  # what the rehearsal batches hold (their rows count against the budget)
            kept = [c for chunks in self.pool.values() for c in chunks]
            stats.extra["replay_rows"] = float(sum(c.q.shape[0] for c in kept))
            stats.extra["replay_bytes"] = float(sum(c.nbytes for c in kept))

    def reset(self) -> None:
        """A new run: the first epoch draws its first state, and no part has a rehearsal batch yet."""
        self.carry = None
        self.pool = {}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to produce the same epochs: the last state's parts and the rehearsal batches.

        Only tensors, numbers and lists (a checkpoint loads with ``weights_only=True``): a rehearsal batch is
        its :class:`Kept` tensors.
        """
        pool = {str(p): [{"node_ids": c.batch.node_ids, "xq": c.q, "xs": c.scale, "width": c.width,
                          "num_targets": c.batch.num_targets, "inputs": c.inputs,
                          "blocks": [{"indptr": g.indptr, "indices": g.indices, "num_src": g.num_src,
                                      "edge_ids": g.edge_ids} for g in c.batch.blocks]}
                         for c in chunks]
                for p, chunks in self.pool.items()}
        return {"carry": [] if self.carry is None else list(self.carry), "pool": pool}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty carry: the next epoch draws its first state)."""
        carry = state.get("carry") or []
        self.carry = tuple(int(p) for p in carry) if carry else None
        self.pool = {}
        for p, chunks in (state.get("pool") or {}).items():
            self.pool[int(p)] = [self._restore(d) for d in chunks]

    @staticmethod
    def _restore(d: dict[str, Any]) -> Kept:
        """A rehearsal batch from :meth:`state_dict`."""
        blocks = [CSRGraph(g["indptr"], g["indices"], int(g["num_src"]), edge_ids=g["edge_ids"]) for g in d["blocks"]]
        batch = Batch(blocks=blocks, node_ids=d["node_ids"], num_targets=int(d["num_targets"]), replay=True)
        return Kept(batch, d["xq"], d["xs"], int(d["width"]), int(d.get("inputs", -1)))

    def close(self) -> None:
        """Stop the reading thread."""
        self._io.shutdown(wait=True, cancel_futures=True)


__all__ = ["KEPT_LEVELS", "ArenaRows", "BufferEpoch", "BufferState", "BufferStats", "Kept", "LayoutRows", "PartRows",
           "PartitionBuffer", "StateGraphs", "buffer_states", "cut_steps", "inclusion_probability", "read_npy",
           "state_graph"]
