"""GREM: streaming min-edge-cut partitioning with refinement (Armada §4, Algorithms 1–2).

The edge list is streamed from the store in chunks (``chunk_frac`` of the edges, or ``chunk_edges``) in
a seeded random order of edge blocks (see :mod:`trellis.partition.edges`): Armada's analysis assumes
a random edge order, and the store is sorted by destination. For a bisection:

1. On the **first chunk**, a seed partitioner (LDG, Fennel or METIS) splits the chunk's nodes, balanced
   within the chunk; each chunk node's neighbour counts per side are recorded (Alg. 1, lines 6–10).
2. For **every later chunk**, the chunk's nodes are visited in stream order; each node's neighbours in
   the chunk are counted per side using the current assignment. An unassigned node takes those counts;
   an assigned node averages them with its running estimate (``(old + new) / 2``, so chunk ``t``
   weighs ``2^-(age)``). The node then goes to the side with more estimated neighbours unless that side
   is full, and the estimate is saved (lines 11–19, ``assign`` / ``fix_sizes`` of Alg. 2). Re-assigning
   previously placed nodes is the **refinement**; ``refine=False`` fixes each node at its first
   placement, the plain streaming greedy of Armada Fig. 6.

One deliberate deviation from Alg. 2: a node seen for the first time with **no placed neighbour** in
its chunk is left unplaced until a later chunk shows it one, instead of going to the emptier side. Such a
placement is a coin flip, and with small chunks most early nodes are in that state; the guesses then
steer their neighbours' estimates. Waiting lets assignments grow outward from the seed (measured on a
planted 200k-node, 16-community graph at P=16, chunk 1%: 0.33 → 0.21 edge-cut fraction; no change at
10%). Nodes still unplaced when the pass ends go to the relatively emptier side.

The default seed is METIS on the first chunk, as in Armada's evaluation: its memory is that of the chunk,
not the graph, and it shrinks further because the chunk's leaves (nodes with one neighbour: most sources
of a sparse chunk) are folded into their neighbour's vertex weight (:func:`_group_core`). LDG and Fennel
seeds (run in breadth-first order over the chunk) cost less but bisect the sparse first chunk poorly, and
one pass of refinement does not recover from a poor top-level split.

``P > 2`` is recursive bisection. All groups of one recursion level are bisected together in one pass
over the stream (an edge counts only when both endpoints are in the same group), so ``P`` parts cost
``ceil(log2 P)`` passes. A group of ``k`` final parts splits into sides of ``ceil(k/2)`` and
``floor(k/2)`` parts whose caps are those counts times the final part cap, so every final part ends at
most ``part_cap(N, P, imbalance)`` nodes without compounding the tolerance over levels. Nodes that no
edge of their group ever touches (isolated nodes) go to the relatively emptier side at the level's end.

Memory: O(N) state — current group (int32), side (int8), two float32 estimates and an int32 scratch
per node, ~17 bytes — plus one chunk (~40 bytes per edge with 32-bit ids) plus the seed step on the first
chunk. The CSR's
row pointers and edges are read through the store's memory maps and never copied whole. Per-node work
runs in numba kernels; nothing loops over edges in Python.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tqdm import tqdm

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.partition.base import Partitioner, register
from trellis.partition.edges import default_block_edges, num_shuffled_chunks, shuffled_chunks
from trellis.partition.metis import run_metis
from trellis.partition.streaming import FENNEL, FENNEL_GAMMA, LDG, greedy_score
from trellis.utils.numba import njit

SEED_METHODS = ("metis", "ldg", "fennel")
#: Bisections METIS computes for the seed step, keeping the best (its ``ncuts``). A sparse first chunk can
#: mislead one bisection into splitting a community at the top level, which one pass of refinement cannot
#: repair (1 seed in 16 on the planted 16-community test graph); two tries removed it there.
SEED_METIS_TRIES = 2
DEFAULT_CHUNK_FRAC = 0.1

#: Graphs with at most this many edges are seeded whole by default (``chunk_frac`` and ``chunk_edges`` unset):
#: METIS then sees every edge and GREM's passes only refine. Why: with 10% chunks GREM's cut at P = 8 was 4.3
#: points worse than METIS on Coauthor CS (19.2% against 14.9%) and 1.2 worse on the 1M planted graph (19.9%
#: against 18.7%); seeded whole it is 14.7% and 18.7%. The price is METIS's memory (about 170 bytes per edge:
#: 1.7 GB at 10M edges, against GREM's 0.4 GB), which a graph this size affords and a larger one may not,
#: so larger graphs stream in 10% chunks. A fixed edge count, not the free memory, keeps results the same
#: on every machine.
WHOLE_GRAPH_EDGES = 16_000_000


@njit(cache=True, nogil=True, inline="always")
def _chunk_index(w: int, g: int, n: int, loc: np.ndarray, nodes: np.ndarray, cgrp: np.ndarray,
                 cindptr: np.ndarray) -> tuple[int, int]:
    """``(chunk index of node w, chunk size)``: ``w`` is appended to the chunk (group ``g``) if not in it yet."""
    a = loc[w]
    if a < 0:
        a = n
        loc[w] = n
        nodes[n] = w
        cgrp[n] = g
        cindptr[n + 1] = 0
        n += 1
    return a, n


@njit(cache=True, nogil=True)
def _chunk_graph(src: np.ndarray, dst: np.ndarray, part: np.ndarray, grp_of_lo: np.ndarray, loc: np.ndarray,
                 nodes: np.ndarray, cgrp: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray) -> tuple[int, int]:
    """Symmetric CSR over the chunk's nodes (first-appearance order) of its intra-group edges.

    Keeps edge ``u -> v`` when ``u != v``, both lie in the same group and that group is still being
    split. ``loc`` (``int32 [N]``, all -1) maps node → chunk index and is restored to -1 on return.
    Each kept edge's chunk indices are remembered (``eu``/``ev``, freed on return, so they are not alive
    during the seed step) and the fill pass reads nothing of size N.
    Returns ``(num_chunk_nodes, num_kept_edges)``.
    """
    eu = np.empty(src.shape[0], dtype=np.int32)
    ev = np.empty(src.shape[0], dtype=np.int32)
    n = 0
    kept = 0
    for e in range(src.shape[0]):
        u = src[e]
        v = dst[e]
        if u == v:
            continue
        pu = part[u]
        if pu != part[v]:
            continue
        g = grp_of_lo[pu]
        if g < 0:
            continue
        # destination first: its whole in-row is usually in this chunk
        a, n = _chunk_index(v, g, n, loc, nodes, cgrp, cindptr)
        b, n = _chunk_index(u, g, n, loc, nodes, cgrp, cindptr)
        cindptr[a + 1] += 1
        cindptr[b + 1] += 1
        eu[kept] = b
        ev[kept] = a
        kept += 1
    cindptr[0] = 0
    for i in range(n):
        cindptr[i + 1] += cindptr[i]
    for k in range(kept):  # fill, using cindptr[i] as row i's cursor ...
        a = ev[k]
        b = eu[k]
        cadj[cindptr[a]] = b
        cindptr[a] += 1
        cadj[cindptr[b]] = a
        cindptr[b] += 1
    for i in range(n, 0, -1):  # ... which leaves every row start shifted by one row
        cindptr[i] = cindptr[i - 1]
    cindptr[0] = 0
    for i in range(n):
        loc[nodes[i]] = -1
    return n, kept


@njit(cache=True, nogil=True)
def _group_core(members: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray, lmap: np.ndarray,
                seen_row: np.ndarray, seen_pos: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """METIS input for one group's chunk subgraph with its leaves folded into their neighbours.

    A *leaf* is a node with one distinct neighbour that itself has several; an optimal cut always puts
    it beside that neighbour, so it is left out of METIS and counted in the neighbour's vertex weight
    (balance stays exact). In a chunk most nodes are leaves — sources seen in a single row — so this
    shrinks METIS's graph, and its memory, several-fold. Duplicate edges become edge weights.
    ``lmap``/``seen_row``/``seen_pos`` are chunk-sized scratch (``seen_row`` all -1, restored).

    Returns ``(core, xadj, adjncy, eweights, vweights, anchor)``: ``core`` lists the member positions
    METIS sees; ``anchor[t]`` is the member position whose side member ``t`` takes (itself for core).
    """
    ng = members.shape[0]
    for t in range(ng):
        lmap[members[t]] = t
    ddeg = np.zeros(ng, dtype=np.int32)
    anchor = np.empty(ng, dtype=np.int32)
    for t in range(ng):  # distinct degree, and the neighbour of degree-1 nodes
        i = members[t]
        anchor[t] = t
        for k in range(cindptr[i], cindptr[i + 1]):
            j = cadj[k]
            if seen_row[j] != t:
                seen_row[j] = t
                ddeg[t] += 1
                if ddeg[t] == 1:
                    anchor[t] = lmap[j]
        for k in range(cindptr[i], cindptr[i + 1]):
            seen_row[cadj[k]] = -1
    cmap = np.full(ng, -1, dtype=np.int32)
    ncore = 0
    for t in range(ng):
        if ddeg[t] == 1 and ddeg[anchor[t]] >= 2:
            continue  # a leaf: follows anchor[t]
        anchor[t] = t
        cmap[t] = ncore
        ncore += 1
    core = np.empty(ncore, dtype=np.int64)
    vwgt = np.ones(ncore, dtype=np.int64)
    for t in range(ng):
        if cmap[t] >= 0:
            core[cmap[t]] = t
        else:
            vwgt[cmap[anchor[t]]] += 1
    xadj = np.zeros(ncore + 1, dtype=np.int64)
    for c in range(ncore):  # distinct core neighbours, so the METIS arrays are allocated at their size
        i = members[core[c]]
        d = 0
        for k in range(cindptr[i], cindptr[i + 1]):
            j = cadj[k]
            if cmap[lmap[j]] >= 0 and seen_row[j] != c:
                seen_row[j] = c
                d += 1
        xadj[c + 1] = xadj[c] + d
        for k in range(cindptr[i], cindptr[i + 1]):
            seen_row[cadj[k]] = -1
    adjncy = np.empty(xadj[ncore], dtype=np.int64)
    wgt = np.empty(xadj[ncore], dtype=np.int64)
    for c in range(ncore):
        i = members[core[c]]
        at = xadj[c]
        for k in range(cindptr[i], cindptr[i + 1]):
            j = cadj[k]
            cj = cmap[lmap[j]]
            if cj < 0:
                continue
            if seen_row[j] == c:
                wgt[seen_pos[j]] += 1
            else:
                seen_row[j] = c
                seen_pos[j] = at
                adjncy[at] = cj
                wgt[at] = 1
                at += 1
        for k in range(cindptr[i], cindptr[i + 1]):
            seen_row[cadj[k]] = -1
    return core, xadj, adjncy, wgt, vwgt, anchor


@njit(cache=True, nogil=True)
def _fix_sides(n: int, nodes: np.ndarray, cgrp: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray,
               side: np.ndarray, sizes: np.ndarray, caps: np.ndarray) -> None:
    """Move chunk nodes off any side above its cap (those with most neighbours across go first)."""
    for want in range(cindptr[n] + 1):  # sweep by how many neighbours a node has across: 0.. upward
        done = True
        for i in range(n):
            g = cgrp[i]
            s = side[nodes[i]]
            if sizes[g, s] <= caps[g, s]:
                continue
            done = False
            across = 0
            for k in range(cindptr[i], cindptr[i + 1]):
                if side[nodes[cadj[k]]] == 1 - s:
                    across += 1
            deg = cindptr[i + 1] - cindptr[i]
            if deg - across <= want and sizes[g, 1 - s] < caps[g, 1 - s]:
                side[nodes[i]] = 1 - s
                sizes[g, s] -= 1
                sizes[g, 1 - s] += 1
        if done:
            return


@njit(cache=True, nogil=True, inline="always")
def _choose(c0: float, c1: float, s0: int, s1: int, cap0: int, cap1: int, k0: int, k1: int, old: int) -> int:
    """Alg. 2 ``assign``: the side with more neighbours if it has room; otherwise stay, or the emptier side."""
    room0 = old == 0 or s0 < cap0
    room1 = old == 1 or s1 < cap1
    if c1 > c0 and room1:
        return 1
    if c0 > c1 and room0:
        return 0
    if old >= 0:  # a tie or a full preferred side: keep the placement rather than thrash
        return old
    if not room0:
        return 1
    if not room1:
        return 0
    return 0 if s0 * k1 <= s1 * k0 else 1  # s0/k0 <= s1/k1: relatively emptier side


@njit(cache=True, nogil=True)
def _grem_chunk(n: int, nodes: np.ndarray, cgrp: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray,
                cside: np.ndarray, side: np.ndarray, counts: np.ndarray, sizes: np.ndarray, caps: np.ndarray,
                kw: np.ndarray, refine: bool) -> int:
    """Alg. 1 lines 12–19 for one chunk; returns how many assigned nodes changed side.

    ``cside`` is a chunk-local copy of the sides, so counting a neighbour reads a chunk-sized array
    rather than chasing ``nodes`` into the N-sized one.
    """
    for i in range(n):
        cside[i] = side[nodes[i]]
    moved = 0
    for i in range(n):
        v = nodes[i]
        g = cgrp[i]
        c0 = 0.0
        c1 = 0.0
        for k in range(cindptr[i], cindptr[i + 1]):
            s = cside[cadj[k]]
            if s == 0:
                c0 += 1.0
            elif s == 1:
                c1 += 1.0
        old = cside[i]
        if old >= 0:
            if not refine:
                continue
            c0 = 0.5 * (counts[v, 0] + c0)
            c1 = 0.5 * (counts[v, 1] + c1)
        elif c0 == 0.0 and c1 == 0.0:
            continue  # no placed neighbour yet: wait for evidence instead of guessing (see module doc)
        new = _choose(c0, c1, sizes[g, 0], sizes[g, 1], caps[g, 0], caps[g, 1], kw[g, 0], kw[g, 1], old)
        if new != old:
            sizes[g, new] += 1
            if old >= 0:
                sizes[g, old] -= 1
                moved += 1
            side[v] = new
            cside[i] = new
        counts[v, 0] = c0
        counts[v, 1] = c1
    return moved


@njit(cache=True, nogil=True)
def _bfs_order(n: int, cindptr: np.ndarray, cadj: np.ndarray, order: np.ndarray) -> None:
    """Breadth-first order of the chunk graph, restarting at the next unvisited node in stream order."""
    seen = np.zeros(n, dtype=np.bool_)
    head = 0
    tail = 0
    for r in range(n):
        if seen[r]:
            continue
        seen[r] = True
        order[tail] = r
        tail += 1
        while head < tail:
            i = order[head]
            head += 1
            for k in range(cindptr[i], cindptr[i + 1]):
                j = cadj[k]
                if not seen[j]:
                    seen[j] = True
                    order[tail] = j
                    tail += 1


@njit(cache=True, nogil=True, inline="always")
def _side_counts(i: int, nodes: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray,
                 side: np.ndarray) -> tuple[float, float]:
    """Alg. 2 ``cnt_nbrs`` of chunk node ``i``: its chunk neighbours on side 0 and on side 1."""
    c0 = 0.0
    c1 = 0.0
    for k in range(cindptr[i], cindptr[i + 1]):
        s = side[nodes[cadj[k]]]
        if s == 0:
            c0 += 1.0
        elif s == 1:
            c1 += 1.0
    return c0, c1


@njit(cache=True, nogil=True)
def _seed_greedy(order: np.ndarray, nodes: np.ndarray, cgrp: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray,
                 side: np.ndarray, sizes: np.ndarray, caps: np.ndarray, kw: np.ndarray, mode: int,
                 alphas: np.ndarray, gamma: float) -> None:
    """LDG/Fennel bisection of every group's chunk nodes in ``order`` (fixed assignments, chunk-level caps)."""
    for i in order:
        v = nodes[i]
        g = cgrp[i]
        c0, c1 = _side_counts(i, nodes, cindptr, cadj, side)
        half = 0.5 * (kw[g, 0] + kw[g, 1])
        best = -1
        best_score = -np.inf
        for s in range(2):
            if sizes[g, s] >= caps[g, s]:
                continue
            cs = c0 if s == 0 else c1
            if mode == LDG:
                sc = greedy_score(mode, cs, sizes[g, s], caps[g, s], 0.0, gamma)
            else:  # Fennel on the size normalised to the side's share, so unequal sides fill evenly
                sc = greedy_score(mode, cs, sizes[g, s] * half / kw[g, s], 1.0, alphas[g], gamma)
            if best < 0 or sc > best_score or (sc == best_score
                                               and sizes[g, s] * kw[g, best] < sizes[g, best] * kw[g, s]):
                best = s
                best_score = sc
        side[v] = best
        sizes[g, best] += 1


@njit(cache=True, nogil=True)
def _count_chunk(n: int, nodes: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray, side: np.ndarray,
                 counts: np.ndarray) -> None:
    """Alg. 2 ``cnt_nbrs`` for every chunk node: neighbours per side in this chunk."""
    for i in range(n):
        c0, c1 = _side_counts(i, nodes, cindptr, cadj, side)
        counts[nodes[i], 0] = c0
        counts[nodes[i], 1] = c1


@njit(cache=True, nogil=True)
def _finish_level(part: np.ndarray, grp_of_lo: np.ndarray, side: np.ndarray, sizes: np.ndarray,
                  caps: np.ndarray, kw: np.ndarray) -> int:
    """Place nodes no edge reached (emptier side with room), then move side-1 nodes to the upper range."""
    filled = 0
    for v in range(part.shape[0]):
        g = grp_of_lo[part[v]]
        if g < 0:
            continue
        s = side[v]
        if s < 0:
            s = _choose(0.0, 0.0, sizes[g, 0], sizes[g, 1], caps[g, 0], caps[g, 1], kw[g, 0], kw[g, 1], -1)
            sizes[g, s] += 1
            filled += 1
        if s == 1:
            part[v] += kw[g, 0]
    return filled


class _Level:
    """The groups bisected at one recursion level: group ``g`` covers final parts ``[lo, lo + k0 + k1)``."""

    def __init__(self, ranges: list[tuple[int, int]], num_parts: int, cap: int) -> None:
        split = [(lo, hi) for lo, hi in ranges if hi - lo > 1]
        self.grp_of_lo = np.full(num_parts, -1, dtype=np.int32)
        self.kw = np.zeros((len(split), 2), dtype=np.int64)
        for g, (lo, hi) in enumerate(split):
            self.grp_of_lo[lo] = g
            self.kw[g] = ((hi - lo + 1) // 2, (hi - lo) // 2)
        self.caps = self.kw * cap
        self.sizes = np.zeros_like(self.kw)
        self.next_ranges: list[tuple[int, int]] = []
        for lo, hi in ranges:
            if hi - lo > 1:
                mid = lo + (hi - lo + 1) // 2
                self.next_ranges += [(lo, mid), (mid, hi)]
            else:
                self.next_ranges.append((lo, hi))

    @property
    def num_groups(self) -> int:
        return int(self.kw.shape[0])


@register("grem")
class GremPartitioner(Partitioner):
    """Armada's GREM: streaming edge chunks, seed on the first chunk, refined greedy re-assignment.

    Args:
        num_parts: Number of parts.
        seed: Seed of the block order and of the seed step (default: 0).
        imbalance: Allowed imbalance ε of the final parts (default: 0.05).
        progress: Show a tqdm bar over chunks (default: False).
        chunk_frac: Chunk size as a fraction of the edges, in (0, 1] (default, without ``chunk_edges``: the
            whole graph up to :data:`WHOLE_GRAPH_EDGES` edges, else 0.1).
        chunk_edges: Chunk size in edges (fixes memory whatever the graph's size; excludes ``chunk_frac``).
        refine: Re-assign nodes each time they reappear (default: True); False is fixed-assignment
            streaming greedy over the same chunks (Armada Fig. 6's comparison).
        seed_method: Seed partitioner on the first chunk: ``metis``, ``ldg`` or ``fennel`` (default: metis).
        block_edges: Consecutive edges per shuffled block (default: chunk/64, at most 4096).
        passes: Passes over the stream per recursion level (default: 1, as in Armada); later passes only
            refine.
    """

    ownership = "dst"

    def __init__(self, num_parts: int, *, seed: int = 0, imbalance: float = 0.05, progress: bool = False,
                 chunk_frac: float | None = None, chunk_edges: int | None = None, refine: bool = True,
                 seed_method: str = "metis", block_edges: int | None = None, passes: int = 1) -> None:
        super().__init__(num_parts, seed=seed, imbalance=imbalance, progress=progress)
        if chunk_frac is not None and chunk_edges is not None:
            raise TrellisUserError("give either --chunk-frac or --chunk-edges, not both")
        if chunk_frac is not None and not (0.0 < float(chunk_frac) <= 1.0):
            raise TrellisUserError(f"--chunk-frac must be in (0, 1] (got {chunk_frac})")
        if chunk_edges is not None and int(chunk_edges) < 1:
            raise TrellisUserError(f"--chunk-edges must be at least 1 (got {chunk_edges})")
        if seed_method not in SEED_METHODS:
            raise TrellisUserError(f"--seed-method must be one of {', '.join(SEED_METHODS)} (got {seed_method!r})")
        if int(passes) < 1:
            raise TrellisUserError(f"--passes must be at least 1 (got {passes})")
        if block_edges is not None and int(block_edges) < 1:
            raise TrellisUserError(f"block_edges must be at least 1 (got {block_edges})")
        self.chunk_frac = None if chunk_frac is None else float(chunk_frac)
        self.chunk_edges = None if chunk_edges is None else int(chunk_edges)
        self.refine = bool(refine)
        self.seed_method = seed_method
        self.block_edges = block_edges
        self.passes = int(passes)

    def options(self) -> dict[str, Any]:
        """Base options plus chunking, refinement, seed method and passes, so the book records how it was made."""
        return {**super().options(), "chunk_frac": self.chunk_frac, "chunk_edges": self.chunk_edges,
                "refine": self.refine, "seed_method": self.seed_method, "passes": self.passes}

    def chunk_size(self, num_edges: int) -> int:
        """Edges per chunk for a graph of ``num_edges`` edges."""
        if self.chunk_edges is not None:
            return self.chunk_edges
        frac = self.chunk_frac
        if frac is None:  # the default: whole graphs that METIS affords, else 10% chunks
            frac = 1.0 if num_edges <= WHOLE_GRAPH_EDGES else DEFAULT_CHUNK_FRAC
        return max(1, int(math.ceil(frac * num_edges)))

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """Recursive bisection over shuffled edge chunks; extra params report chunk sizes, levels and nodes moved."""
        n, e = store.num_nodes, store.num_edges
        indptr, indices = np.asarray(store.indptr), np.asarray(store.indices)
        chunk = self.chunk_size(e)
        block = int(self.block_edges or default_block_edges(chunk))
        cap = self.cap(n)
        part = np.zeros(n, dtype=np.int32)  # lower end of each node's current range of final parts
        side = np.empty(n, dtype=np.int8)
        counts = np.empty((n, 2), dtype=np.float32)
        loc = np.full(n, -1, dtype=np.int32)
        # chunk buffers, allocated once: at most `chunk` edges, 2 * chunk endpoints; 32-bit ids where they fit
        buf_edges = max(1, chunk // block) * block
        node_dt = np.int32 if n < 2**31 else np.int64
        nodes = np.empty(2 * buf_edges, dtype=node_dt)
        cgrp = np.empty(2 * buf_edges, dtype=np.int16 if self.num_parts < 2**16 else np.int32)  # < P/2 groups
        cindptr = np.zeros(2 * buf_edges + 1, dtype=np.int32 if 2 * buf_edges < 2**31 else np.int64)
        cadj = np.empty(2 * buf_edges, dtype=np.int32)
        cside = np.empty(2 * buf_edges, dtype=np.int8)

        ranges = [(0, self.num_parts)]
        levels: list[_Level] = []
        while any(hi - lo > 1 for lo, hi in ranges):
            levels.append(_Level(ranges, self.num_parts, cap))
            ranges = levels[-1].next_ranges
        n_chunks = num_shuffled_chunks(e, chunk, block)
        stats: dict[str, Any] = {"chunk_edges_used": chunk, "block_edges": block, "levels": len(levels),
                                 "chunks_per_pass": n_chunks, "max_chunk_edges": 0, "moved": 0, "filled": 0}
        bar = tqdm(total=len(levels) * self.passes * n_chunks, desc="grem", unit="chunk",
                   disable=not self.progress or None, leave=False)
        for li, level in enumerate(levels):
            side.fill(-1)
            counts.fill(0.0)
            seeded = False
            for pi in range(self.passes):
                stream = shuffled_chunks(indptr, indices, chunk, seed=self.seed * 1_000_003 + li * 101 + pi,
                                         block_edges=block, dtype=node_dt)
                for src, dst in stream:
                    stats["max_chunk_edges"] = max(stats["max_chunk_edges"], int(src.shape[0]))
                    m, kept = _chunk_graph(src, dst, part, level.grp_of_lo, loc, nodes, cgrp, cindptr, cadj)
                    if not seeded and kept:
                        self._seed(m, nodes, cgrp, cindptr, cadj, side, counts, level)
                        seeded = True
                    elif m:
                        stats["moved"] += int(_grem_chunk(m, nodes, cgrp, cindptr, cadj, cside, side, counts,
                                                          level.sizes, level.caps, level.kw, self.refine))
                    bar.update(1)
            stats["filled"] += int(_finish_level(part, level.grp_of_lo, side, level.sizes, level.caps, level.kw))
        bar.close()
        return part, stats

    def _seed(self, m: int, nodes: np.ndarray, cgrp: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray,
              side: np.ndarray, counts: np.ndarray, level: _Level) -> None:
        """Alg. 1 lines 7–10: seed-partition the first chunk's nodes, then record their neighbour counts."""
        grp = cgrp[:m]
        per_group = np.bincount(grp, minlength=level.num_groups)
        share = level.kw / level.kw.sum(axis=1, keepdims=True)
        seed_caps = np.minimum(level.caps, np.ceil(per_group[:, None] * share * (1 + self.imbalance)))
        seed_caps = seed_caps.astype(np.int64)
        sizes = np.zeros_like(level.sizes)
        if self.seed_method == "metis":
            self._seed_metis(m, nodes, grp, cindptr, cadj, side, sizes, seed_caps, level)
        else:
            deg = np.diff(cindptr[:m + 1])
            edges_g = np.bincount(grp, weights=deg, minlength=level.num_groups) / 2
            alphas = np.sqrt(2.0) * edges_g / np.maximum(per_group, 1) ** 1.5
            mode = LDG if self.seed_method == "ldg" else FENNEL
            order = np.empty(m, dtype=np.int64)
            _bfs_order(m, cindptr, cadj, order)
            _seed_greedy(order, nodes, cgrp, cindptr, cadj, side, sizes, seed_caps, level.kw, mode, alphas,
                         FENNEL_GAMMA)
        level.sizes += sizes
        _count_chunk(m, nodes, cindptr, cadj, side, counts)

    def _seed_metis(self, m: int, nodes: np.ndarray, grp: np.ndarray, cindptr: np.ndarray, cadj: np.ndarray,
                    side: np.ndarray, sizes: np.ndarray, seed_caps: np.ndarray, level: _Level) -> None:
        """METIS bisection of each group's chunk subgraph (with target weights for unequal sides).

        The METIS input is built group by group straight from the chunk CSR, leaves folded into vertex
        weights (:func:`_group_core`), so the seed step holds one group's reduced chunk graph plus
        METIS's work space — no sparse-matrix copies of the chunk.
        """
        for g in range(level.num_groups):
            members = np.flatnonzero(grp == g).astype(np.int32)
            if members.size == 0:
                continue
            scratch = (np.empty(m, dtype=np.int32), np.full(m, -1, dtype=np.int32), np.empty(m, dtype=np.int32))
            core, xadj, adjncy, ew, vw, anchor = _group_core(members, cindptr, cadj, *scratch)
            del scratch  # freed before METIS allocates its work space
            k0, k1 = (int(x) for x in level.kw[g])
            core_side = run_metis(xadj, adjncy, ew, 2, imbalance=self.imbalance, seed=self.seed,
                                  tpwgts=[k0 / (k0 + k1), k1 / (k0 + k1)], vweights=vw, ncuts=SEED_METIS_TRIES)
            member_side = np.empty(members.size, dtype=np.int8)
            member_side[core] = core_side
            member_side = member_side[anchor]
            side[nodes[members]] = member_side
            sizes[g] = np.bincount(member_side, minlength=2)
            del core, xadj, adjncy, ew, vw, anchor, core_side, member_side
        if np.any(sizes > seed_caps):
            _fix_sides(m, nodes, grp, cindptr, cadj, side, sizes, seed_caps)
