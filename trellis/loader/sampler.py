"""Neighbor sampling into nested blocks (GraphSAGE's sampler, and LABOR), and the neighbour batch source.

Why numba and not torch: batch preparation -- multi-hop sampling plus gathering input features -- is
what dominates mini-batch training on CPUs (Armada §2, Fig. 1), and it is a loop over seeds with a
short, data-dependent loop inside (pick ``k`` of ``deg`` neighbours). Vectorized torch code has to
materialize ``[num_seeds, max_degree]`` tensors or sort; a compiled loop touches only what it picks.
Every kernel is ``nogil`` so the prefetching worker really runs beside the trainer, and the per-seed
loops are ``prange`` so both cores sample.

Determinism: every random choice comes from a counter-based hash of ``(batch seed, layer, node id)``,
never from a shared generator state, so the sample is the same for any thread count and any schedule.

Relabeling (global -> local ids) uses a reusable ``int32 [N]`` map per thread (reset after each batch
by touching only the entries it set): an O(sampled) pass with no sort and no hash table. The first
``num_dst`` local ids of every block are its destinations (DGL's ``to_block`` convention), so the
blocks of one batch are prefixes of one id list (see :mod:`trellis.loader.blocks`).

LABOR (Balin & Çatalyürek, 2023; PP-GNN §2.3) is LABOR-0 here: each candidate source ``t`` draws one
uniform variate ``r_t`` per layer, *shared by all seeds of the batch*, and seed ``s`` keeps ``t`` iff
``r_t < fanout / deg(s)``. Each seed still gets ``fanout`` neighbours in expectation (every neighbour is
kept with the same probability, so a mean aggregation needs no reweighting), but seeds that share
neighbours tend to pick the same ones, so far fewer distinct nodes -- and feature rows -- are sampled.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trellis.errors import TrellisUserError
from trellis.loader.blocks import Batch, attach_edge_data, parse_fanouts
from trellis.loader.features import FeatureGather, FeatureSource, expand_ranges, np_int64
from trellis.loader.prefetch import Prefetcher
from trellis.loader.source import iter_epoch
from trellis.ops.graph import CSRGraph
from trellis.utils.numba import get_num_threads, njit, prange, set_num_threads

# ---- counter-based random numbers --------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_LABOR_SALT = np.uint64(0x632BE59BD9B4E019)
_MASK64 = (1 << 64) - 1


@njit(inline="always", cache=True)
def _mix(z: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """splitmix64's finalizer: a bijective 64-bit hash with full avalanche."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(inline="always", cache=True)
def _unit(z: np.uint64) -> float:  # pragma: no cover - compiled
    """Top 53 bits of a hash as a float in ``[0, 1)``."""
    return float(z >> _S11) * _INV53


def mix64(*values: int) -> int:
    """Hash integers into one 64-bit value (Python side of the same splitmix64 finalizer).

    Used to derive per-epoch and per-batch seeds from the base seed, so batch ``i`` of epoch ``e`` is
    reproducible on its own (a prefetching worker or a resumed run regenerates it without replaying the
    batches before it).
    """
    h = 0x2545F4914F6CDD1D
    for v in values:
        z = (h ^ (int(v) & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h


def batch_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of batch ``index`` of ``epoch`` under base ``seed`` (63-bit, non-negative)."""
    return mix64(seed, epoch, index) >> 1


# ---- kernels -----------------------------------------------------------------------------------------
def _count_py(indptr, indices, dst, fanout, labor, key):  # pragma: no cover - compiled
    """Per-destination sample size: ``min(fanout, deg)`` (uniform) or the LABOR draw."""
    n = dst.shape[0]
    counts = np.empty(n, dtype=np.int64)
    for i in prange(n):
        v = dst[i]
        start = indptr[v]
        deg = indptr[v + 1] - start
        if fanout < 0 or deg <= fanout:
            counts[i] = deg
        elif not labor:
            counts[i] = fanout
        else:
            c = 0
            for p in range(deg):
                r = _unit(_mix(key ^ (np.uint64(indices[start + p]) * _GOLDEN)))
                if r * deg < fanout:
                    c += 1
            counts[i] = c
    return counts


def _pick_py(indptr, indices, dst, fanout, labor, key, offsets, out_nbr, out_eid):  # pragma: no cover
    """Write each destination's sampled (global) sources and edge ids into its slice of the output.

    Uniform without replacement: Floyd's algorithm (O(k^2) compares, no scratch) when ``k`` is small
    against the degree, else selection sampling (Knuth's algorithm S, one pass over the neighbours).
    """
    n = dst.shape[0]
    for i in prange(n):
        v = dst[i]
        start = indptr[v]
        deg = indptr[v + 1] - start
        o = offsets[i]
        if fanout < 0 or deg <= fanout:
            for p in range(deg):
                out_nbr[o + p] = indices[start + p]
                out_eid[o + p] = start + p
        elif labor:
            c = 0
            for p in range(deg):
                r = _unit(_mix(key ^ (np.uint64(indices[start + p]) * _GOLDEN)))
                if r * deg < fanout:
                    out_nbr[o + c] = indices[start + p]
                    out_eid[o + c] = start + p
                    c += 1
        else:
            k = fanout
            state = _mix(key ^ (np.uint64(v) * _GOLDEN))
            if 10 * k + k * k < 10 * deg:
                # Floyd: for j in [deg-k, deg) draw t in [0, j]; take t unless taken, then j.
                m = 0
                for j in range(deg - k, deg):
                    state += _GOLDEN
                    t = int(_unit(_mix(state)) * (j + 1))
                    if t > j:
                        t = j
                    for q in range(m):
                        if out_eid[o + q] == start + t:
                            t = j
                            break
                    out_eid[o + m] = start + t
                    out_nbr[o + m] = indices[start + t]
                    m += 1
            else:
                # Algorithm S: keep position p with probability needed / remaining.
                needed = k
                m = 0
                for p in range(deg):
                    state += _GOLDEN
                    if _unit(_mix(state)) * (deg - p) < needed:
                        out_eid[o + m] = start + p
                        out_nbr[o + m] = indices[start + p]
                        m += 1
                        needed -= 1
                        if needed == 0:
                            break


@njit(nogil=True, cache=True)
def _relabel(nbr, local_of, node_ids, n, num_nodes):  # pragma: no cover - compiled
    """Map global ids to local ids, appending unseen nodes to ``node_ids``; returns (local, new n).

    The nodes first seen in this call get consecutive local ids in (bucketed) ascending global-id order:
    a counting sort on the high bits, with about one bucket per new node. Gathering their feature rows
    (and walking their neighbour lists at the next layer) then reads memory front to back instead of at
    random -- 2-2.5x faster for the feature gather, which dominates batch preparation -- for two O(new)
    passes and one extra O(edges) pass.
    """
    e_count = nbr.shape[0]
    new = np.empty(e_count, dtype=np.int64)
    m = 0
    for e in range(e_count):
        g = nbr[e]
        if local_of[g] == -1:
            local_of[g] = -2
            new[m] = g
            m += 1
    if m > 0:
        buckets = 1
        while buckets < m:
            buckets <<= 1
        shift = 0
        while ((num_nodes - 1) >> shift) >= buckets:
            shift += 1
        start = np.zeros(buckets + 1, dtype=np.int64)
        for i in range(m):
            start[(new[i] >> shift) + 1] += 1
        for b in range(buckets):
            start[b + 1] += start[b]
        for i in range(m):
            b = new[i] >> shift
            node_ids[n + start[b]] = new[i]
            start[b] += 1
        for i in range(m):
            local_of[node_ids[n + i]] = n + i
    out = np.empty(e_count, dtype=np.int64)
    for e in range(e_count):
        out[e] = local_of[nbr[e]]
    return out, n + m


@njit(nogil=True, cache=True)
def _assign_seeds(seeds, local_of, node_ids):  # pragma: no cover - compiled
    """Give seeds local ids 0..B-1; returns how many were new (fewer than B means duplicates)."""
    n = 0
    for i in range(seeds.shape[0]):
        g = seeds[i]
        if local_of[g] < 0:
            local_of[g] = n
            node_ids[n] = g
            n += 1
    return n


def _reset_py(local_of, node_ids):  # pragma: no cover - compiled
    for i in prange(node_ids.shape[0]):
        local_of[node_ids[i]] = -1


@njit(nogil=True, cache=True)
def reverse_csr(indptr, indices, num_src):  # pragma: no cover - compiled
    """Reverse a (local) CSR by counting sort: ``(rev_indptr, rev_indices, perm)``, stable in destination.

    O(E) with no sort; built in the sampler so the trainer's backward pass finds the reverse graph ready
    (the aggregation's backward runs on it) instead of building it on the critical path.
    """
    num_dst = indptr.shape[0] - 1
    e = indices.shape[0]
    rev_indptr = np.zeros(num_src + 1, dtype=np.int64)
    for k in range(e):
        rev_indptr[indices[k] + 1] += 1
    for s in range(num_src):
        rev_indptr[s + 1] += rev_indptr[s]
    fill = rev_indptr[:-1].copy()
    rev_indices = np.empty(e, dtype=np.int64)
    perm = np.empty(e, dtype=np.int64)
    for d in range(num_dst):
        for k in range(indptr[d], indptr[d + 1]):
            s = indices[k]
            pos = fill[s]
            rev_indices[pos] = d
            perm[pos] = k
            fill[s] = pos + 1
    return rev_indptr, rev_indices, perm


# Each parallel kernel is compiled twice: ``prange`` variants for large inputs and serial ones for small
# inputs, where waking a thread team costs more than the work (and, on a loaded 2-core machine, a
# descheduled team member stalls the whole region at its closing barrier).
_count_par = njit(nogil=True, parallel=True, cache=True)(_count_py)
_count_seq = njit(nogil=True, cache=True)(_count_py)
_pick_par = njit(nogil=True, parallel=True, cache=True)(_pick_py)
_pick_seq = njit(nogil=True, cache=True)(_pick_py)
_reset_par = njit(nogil=True, parallel=True, cache=True)(_reset_py)
_reset_seq = njit(nogil=True, cache=True)(_reset_py)

#: Work (edges or rows) below which the serial variant runs.
PARALLEL_MIN_WORK = 20_000


def _count(indptr, indices, dst, fanout, labor, key):
    work = dst.shape[0] * (abs(fanout) if labor else 1)
    f = _count_par if work >= PARALLEL_MIN_WORK else _count_seq
    return f(indptr, indices, dst, fanout, labor, key)


def _pick(indptr, indices, dst, fanout, labor, key, offsets, out_nbr, out_eid):
    f = _pick_par if out_nbr.shape[0] >= PARALLEL_MIN_WORK else _pick_seq
    f(indptr, indices, dst, fanout, labor, key, offsets, out_nbr, out_eid)


def _reset(local_of, node_ids):
    f = _reset_par if node_ids.shape[0] >= 4 * PARALLEL_MIN_WORK else _reset_seq
    f(local_of, node_ids)


# ---- sampler -----------------------------------------------------------------------------------------
def as_tensor(a: np.ndarray | Tensor | None) -> Tensor | None:
    """A tensor view of ``a`` (numpy arrays and memory maps are copied once into RAM)."""
    if a is None or isinstance(a, Tensor):
        return a
    return torch.from_numpy(np.array(a, copy=True))


class ThreadLocalMap:
    """A scratch ``[N]`` global -> local id map per thread (all -1 between uses).

    Why per thread: batches are then built by several threads at once without sharing scratch state.
    Pickles empty (a worker process builds its own).

    Args:
        num_nodes: Entries of each map.
    """

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = int(num_nodes)
        self._local = threading.local()

    def get(self) -> np.ndarray:
        """This thread's map (``int32``, or ``int64`` beyond 2**31 nodes), created on first use."""
        m = getattr(self._local, "map", None)
        if m is None:
            m = np.full(self.num_nodes, -1, dtype=np.int32 if self.num_nodes < 2**31 else np.int64)
            self._local.map = m
        return m

    def __getstate__(self) -> dict[str, int]:
        """Pickle the size only."""
        return {"num_nodes": self.num_nodes}

    def __setstate__(self, state: dict[str, int]) -> None:
        """Restore with no maps yet."""
        self.__init__(state["num_nodes"])  # type: ignore[misc]


class NeighborSampler:
    """Samples nested per-layer blocks around seed nodes.

    Args:
        indptr: ``int64 [N+1]`` in-edge CSR row pointers (row = destination); memory maps are read in place.
        indices: ``int64 [E]`` source of each in-edge.
        fanouts: Neighbours per destination per layer, **target layer first** (``[15, 10]``: 15 in-neighbours
            of each target, then 10 of each of those); ``-1`` = all neighbours.
        labor: LABOR-0 sampling instead of independent uniform sampling (default: False).
        reverse: Build the reverse CSR of every block but the input one in the sampler (default: True), so the
            backward pass finds it ready; the input block's is built on first use (:class:`LazyReverseBlock`).
            False: every block builds it on first use.
        degrees: Attach global in-degrees as ``src_degree``/``dst_degree`` of every block so GCN's
            normalization on a block equals the full graph's (default: True): True takes them from
            ``indptr``; an ``[N]`` array gives them (a graph with edges left out, as a partition buffer's
            state, still normalizes by the whole graph's degrees).
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, fanouts: Sequence[int], *, labor: bool = False,
                 reverse: bool = True, degrees: bool | np.ndarray = True) -> None:
        self.indptr = np_int64(indptr)
        self.indices = np_int64(indices)
        self.num_nodes = int(self.indptr.shape[0] - 1)
        self.fanouts = parse_fanouts(fanouts)
        self.labor = bool(labor)
        self.reverse = reverse
        if isinstance(degrees, np.ndarray):
            self._degree: np.ndarray | None = np.asarray(degrees, dtype=np.float32)
        else:
            self._degree = np.diff(self.indptr).astype(np.float32) if degrees else None
        self._scratch = ThreadLocalMap(self.num_nodes)

    @classmethod
    def from_store(cls, store: object, fanouts: Sequence[int], *, labor: bool = False, reverse: bool = True,
                   degrees: bool = True) -> NeighborSampler:
        """A sampler over a :class:`~trellis.data.store.GraphStore`'s in-edge CSR (memory-mapped, not copied)."""
        return cls(store.indptr, store.indices, fanouts, labor=labor, reverse=reverse,  # type: ignore[attr-defined]
                   degrees=degrees)

    def with_graph(self, indptr: np.ndarray, indices: np.ndarray) -> NeighborSampler:
        """This sampler over another in-edge CSR of the same nodes, sharing its scratch maps and degrees.

        Why: a partition buffer samples from a new graph at every state; a fresh sampler would allocate a new
        ``[N]`` scratch map per thread each time.
        """
        other = object.__new__(NeighborSampler)
        other.__dict__.update(self.__dict__)
        other.indptr, other.indices = np_int64(indptr), np_int64(indices)
        if other.indptr.shape[0] != self.indptr.shape[0]:
            raise ValueError("with_graph: the new CSR must have the same number of rows")
        return other

    def with_fanouts(self, fanouts: Sequence[int]) -> NeighborSampler:
        """This sampler over the same graph with other fanouts (a partition buffer's rehearsal batches)."""
        other = object.__new__(NeighborSampler)
        other.__dict__.update(self.__dict__)
        other.fanouts = parse_fanouts(fanouts)
        return other

    @property
    def num_layers(self) -> int:
        """Number of sampled layers (blocks per batch)."""
        return len(self.fanouts)

    def sample(self, seeds: np.ndarray | Tensor, seed: int = 0) -> Batch:
        """Sample the blocks of one batch.

        Args:
            seeds: Target node ids (global, unique).
            seed: The batch's seed; the same ``(seeds, seed)`` always gives the same blocks.

        Returns:
            A :class:`Batch` without features (see :class:`NeighborLoader` for the gather).
        """
        seeds = np_int64(seeds)
        if seeds.size and (seeds.min() < 0 or seeds.max() >= self.num_nodes):
            raise ValueError(f"seed ids must lie in [0, {self.num_nodes})")
        local_of = self._scratch.get()  # this thread's global -> local map
        node_ids = np.empty(seeds.shape[0], dtype=np.int64)
        n = _assign_seeds(seeds, local_of, node_ids)
        if n != seeds.shape[0]:
            _reset(local_of, node_ids[:n])
            raise ValueError("seed ids of a batch must be unique")
        base = np.uint64(mix64(seed) & _MASK64)
        blocks_top_down: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]] = []
        stats: dict[str, float] = {}
        try:
            num_dst = n
            for layer, fanout in enumerate(self.fanouts):
                key = np.uint64(mix64(int(base), layer, 1 if self.labor else 0))
                dst = node_ids[:num_dst]
                counts = _count(self.indptr, self.indices, dst, fanout, self.labor, key)
                indptr = np.zeros(num_dst + 1, dtype=np.int64)
                np.cumsum(counts, out=indptr[1:])
                e = int(indptr[-1])
                nbr = np.empty(e, dtype=np.int64)
                eid = np.empty(e, dtype=np.int64)
                _pick(self.indptr, self.indices, dst, fanout, self.labor, key, indptr, nbr, eid)
                grown = np.empty(num_dst + e, dtype=np.int64)
                grown[:n] = node_ids[:n]
                local, n = _relabel(nbr, local_of, grown, n, self.num_nodes)
                node_ids = grown
                blocks_top_down.append((indptr, local, eid, num_dst, n))
                stats[f"edges_l{layer}"] = float(e)
                num_dst = n
        finally:
            _reset(local_of, node_ids[:n])
        node_ids = node_ids[:n]
        ids_t = torch.from_numpy(node_ids)
        blocks: list[CSRGraph] = []
        for indptr, local, eid, _, num_src in reversed(blocks_top_down):
            # the input block's reverse is built only if a backward pass asks for it (LazyReverseBlock)
            blocks.append(self.block(indptr, local, eid, num_src, ids_t, lazy_reverse=not blocks))
        stats["inputs"] = float(n)
        return Batch(blocks=blocks, node_ids=ids_t, num_targets=int(seeds.shape[0]), seed=int(seed), stats=stats)

    def merge(self, batches: Sequence[Batch], positions: list[np.ndarray] | None = None) -> Batch:
        """Sampled batches side by side as one batch (a node in two of them stays two rows).

        Why: a partition buffer's step rehearses one small batch of every part not resident; as one batch
        they cost one forward and one backward pass instead of one per part (per-batch overhead was most of
        the rehearsal's time). Rows are ordered level by level (all batches' targets, then all their first
        hops, ...), so every block's sources stay a prefix of the rows, as :meth:`sample` makes them. Each
        batch's ``x`` (when all have one) and store edge ids are carried over; labels are not. ``positions``:
        :func:`merged_positions` of ``batches``, when the caller already has them.
        """
        depth = batches[0].num_layers
        lev = _levels(batches)
        pos = merged_positions(batches) if positions is None else positions
        total = int(lev[:, depth].sum())
        ids = np.empty(total, dtype=np.int64)
        for b, p in zip(batches, pos, strict=True):
            ids[p] = b.node_ids.numpy()
        ids_t = torch.from_numpy(ids)
        blocks: list[CSRGraph] = []
        for layer in range(depth):  # input block first
            k = depth - 1 - layer
            num_dst, num_src = int(lev[:, k].sum()), int(lev[:, k + 1].sum())
            gs = [b.blocks[layer] for b in batches]
            degs = [np.diff(g.indptr.numpy()) for g in gs]
            deg = np.zeros(num_dst, dtype=np.int64)
            for p, d in zip(pos, degs, strict=True):
                deg[p[:d.shape[0]]] = d
            indptr = np.zeros(num_dst + 1, dtype=np.int64)
            np.cumsum(deg, out=indptr[1:])
            indices = np.empty(int(indptr[-1]), dtype=np.int64)
            eid = np.zeros(int(indptr[-1]), dtype=np.int64)
            for g, p, d in zip(gs, pos, degs, strict=True):
                gp = g.indptr.numpy()
                slot = np.repeat(indptr[p[:d.shape[0]]] - gp[:-1], d) + np.arange(int(gp[-1]))
                indices[slot] = p[g.indices.numpy()]
                if g.edge_ids is not None:
                    eid[slot] = g.edge_ids.numpy()
            blocks.append(self.block(indptr, indices, eid, num_src, ids_t, lazy_reverse=layer == 0))
        merged = Batch(blocks=blocks, node_ids=ids_t, num_targets=int(lev[:, 0].sum()), seed=batches[0].seed)
        rows = [b.x for b in batches]
        if all(r is not None for r in rows):
            x = torch.empty((total, *rows[0].shape[1:]), dtype=rows[0].dtype)  # type: ignore[union-attr]
            for r, p in zip(rows, pos, strict=True):
                x[torch.from_numpy(p)] = r  # type: ignore[assignment]
            merged.x = x
        return merged

    def block(self, indptr: np.ndarray, local: np.ndarray, eid: np.ndarray, num_src: int,
              node_ids: Tensor, *, lazy_reverse: bool = False) -> CSRGraph:
        """One block as :meth:`sample` builds it: its reverse (unless lazy) and its sources' global degrees."""
        cls = LazyReverseBlock if lazy_reverse or not self.reverse else CSRGraph
        g = cls(torch.from_numpy(indptr), torch.from_numpy(local), int(num_src), node_ids=node_ids[:num_src])
        g.edge_ids = torch.from_numpy(eid)
        if self.reverse and not lazy_reverse:
            attach_reverse(g)
        if self._degree is not None:
            ids = node_ids.numpy()[:num_src]
            deg = torch.from_numpy(self._degree[ids])
            g.src_degree = deg
            g.dst_degree = deg[: g.num_dst]
        return g


def split_batch(batch: Batch, cuts: Sequence[tuple[int, int]]) -> list[tuple[Batch, np.ndarray]]:
    """The sub-batches of ``batch``'s targets ``[lo, hi)``, each with only its own targets' sampled neighbourhood.

    Why: a partition buffer keeps many small rehearsal batches per part; sampling them as one batch and
    splitting it costs one sampler call instead of one per small batch. A node sampled for two sub-batches
    keeps one neighbour sample in both (each alone would draw its own): independent across targets still,
    as every target's neighbours are drawn independently of the others'.

    Returns:
        Per cut, the sub-batch (its blocks hold their CSR, store edge ids and node ids; no reverse graphs or
        degrees: :meth:`NeighborSampler.merge` rebuilds them) and the positions of its rows in ``batch``'s
        rows, level by level as :meth:`NeighborSampler.sample` orders them (its first ``hi - lo`` are the
        targets).
    """
    where = np.full(batch.num_inputs, -1, dtype=np.int64)
    out = []
    for lo, hi in cuts:
        rows = np.arange(lo, hi, dtype=np.int64)
        blocks: list[CSRGraph] = []
        for g in reversed(batch.blocks):  # the target block first: each block's sources are the next's rows
            ip, ix = g.indptr.numpy(), g.indices.numpy()
            edges = expand_ranges(ip[rows], ip[rows + 1])
            src = ix[edges]
            where[rows] = 1
            seen = np.unique(src[where[src] < 0])  # sources that are not destinations, after them
            where[rows] = -1
            srcs = np.concatenate([rows, seen])
            where[srcs] = np.arange(srcs.shape[0])
            local = where[src]
            where[srcs] = -1
            indptr = np.zeros(rows.shape[0] + 1, dtype=np.int64)
            np.cumsum(ip[rows + 1] - ip[rows], out=indptr[1:])
            eid = None if g.edge_ids is None else g.edge_ids[torch.from_numpy(edges)]
            blocks.insert(0, CSRGraph(torch.from_numpy(indptr), torch.from_numpy(local), int(srcs.shape[0]),
                                      edge_ids=eid))
            rows = srcs
        ids = batch.node_ids[torch.from_numpy(rows)]
        for g in blocks:
            g.node_ids = ids[:g.num_src]
        out.append((Batch(blocks=blocks, node_ids=ids, num_targets=hi - lo, seed=batch.seed), rows))
    return out


def _levels(batches: Sequence[Batch]) -> np.ndarray:
    """``lev[i, k]``: batch i's rows up to level k (k = 0: targets; k: the sources of the k-th block from the top)."""
    depth = batches[0].num_layers
    return np.array([[b.num_targets] + [b.blocks[depth - 1 - k].num_src for k in range(depth)] for b in batches],
                    dtype=np.int64)


def merged_positions(batches: Sequence[Batch]) -> list[np.ndarray]:
    """Where each row of each batch lands in :meth:`NeighborSampler.merge`'s batch (level by level)."""
    lev = _levels(batches)
    depth = lev.shape[1] - 1
    seg = np.diff(lev, axis=1, prepend=0)  # rows of batch i first seen at level k
    start = (np.cumsum(seg.T.reshape(-1)) - seg.T.reshape(-1)).reshape(depth + 1, len(batches))
    return [np.concatenate([start[k, i] + np.arange(seg[i, k]) for k in range(depth + 1)])
            for i in range(len(batches))]


def attach_reverse(g: CSRGraph) -> CSRGraph:
    """Build ``g``'s reverse CSR with the O(E) numba kernel and attach it (``g.rev``, ``g.perm``)."""
    rip, rix, perm = reverse_csr(g.indptr.cpu().numpy(), g.indices.cpu().numpy(), g.num_src)
    dev = g.device
    g.rev = CSRGraph(torch.from_numpy(rip).to(dev), torch.from_numpy(rix).to(dev), g.num_dst)
    g.perm = torch.from_numpy(perm).to(dev)
    g.rev.rev = g
    return g


class LazyReverseBlock(CSRGraph):
    """A block whose reverse CSR is built on first use, by the O(E) counting-sort kernel.

    Why: the reverse graph serves only backward passes that need a gradient w.r.t. the block's *source*
    rows. The input block's sources are the raw features, which need none in GraphSAGE/GCN/GIN, so
    building its reverse (the largest of the batch) in the sampler would be wasted work; attention layers
    do need it, and then it is built here, still far cheaper than a sort.
    """

    def reverse(self) -> CSRGraph:
        if self.rev is None:
            attach_reverse(self)
        assert self.rev is not None
        return self.rev


# ---- loader ------------------------------------------------------------------------------------------
@dataclass
class SeedPlan:
    """The batches of one epoch: a seeded permutation of the target ids cut into batches (random access).

    Attributes:
        order: The epoch's target ids in batch order.
        batch_size: Targets per batch (the last batch may be smaller).
        epoch: The epoch seed the permutation was drawn from.
    """

    order: np.ndarray
    batch_size: int
    epoch: int

    def __len__(self) -> int:
        """Number of batches."""
        return -(-self.order.shape[0] // self.batch_size)

    def seeds(self, index: int) -> np.ndarray:
        """Target ids of batch ``index``."""
        return self.order[index * self.batch_size:(index + 1) * self.batch_size]


def fill_batch(loader: Any, batch: Batch, slot: int | None = None, *, features: bool = True,
               edge_weight: Tensor | None = None, edge_feat: Tensor | None = None) -> Batch:
    """Gather ``batch``'s input rows and target labels from ``loader`` (and move it to the loader's device).

    ``loader`` has ``features`` (a :class:`~trellis.loader.features.FeatureGather` or None), ``y`` and
    ``device``; the edge data given is attached to the blocks. ``features=False`` leaves the input rows to the
    caller (a sampler process gathers them straight into the batch's message:
    :func:`~trellis.loader.producer.build_message`).
    """
    if features and loader.features is not None:
        batch.x = loader.features.gather(batch.node_ids, slot)
    if loader.y is not None:
        batch.y = loader.y.index_select(0, batch.targets.to(loader.y.device))
    attach_edge_data(batch.blocks, edge_weight, edge_feat)
    if loader.device.type != "cpu":
        return batch.to(loader.device, non_blocking=True)
    return batch


class NeighborLoader:
    """Mini-batches for an epoch: shuffled target ids, sampled blocks, gathered features and labels.

    A :class:`~trellis.loader.source.BatchSource`: ``get(plan, i)`` builds batch ``i`` of the epoch's
    plan from scratch (its seeds from the epoch's seeded permutation, its sampling seed from
    :func:`batch_seed`), so batches can be built out of order by prefetching workers and still be
    identical to a sequential pass.

    Args:
        sampler: The :class:`NeighborSampler`.
        ids: Target node ids to iterate (e.g. the training split).
        batch_size: Targets per batch (the last batch may be smaller).
        x: Node features to gather: an array, memory map, tensor or any
            :class:`~trellis.loader.features.FeatureSource` (None = blocks only).
        y: Labels indexed by global node id (None = no labels).
        seed: Base seed of the shuffles and samples (default: 0).
        shuffle: Shuffle ids every epoch (default: True).
        device: Where batches are delivered (default: cpu); CUDA gets pinned buffers and async copies.
        prefetch: Batches prepared ahead by the background worker (0 = none) (default: 2).
        workers: Threads preparing batches (default: 1).
        edge_weight: ``[E]`` edge weights, gathered onto each block's sampled edges (None = none).
        edge_feat: ``[E, D]`` edge features, gathered the same way (None = none).
        threads: numba threads each preparing thread uses (default: None = numba's setting). Beside a
            trainer that uses every core, 1 avoids oversubscribing them.
    """

    def __init__(self, sampler: NeighborSampler, ids: np.ndarray | Tensor, batch_size: int, *,
                 x: np.ndarray | Tensor | FeatureSource | None = None, y: np.ndarray | Tensor | None = None,
                 seed: int = 0, shuffle: bool = True, device: torch.device | str = "cpu", prefetch: int = 2,
                 workers: int = 1, edge_weight: np.ndarray | Tensor | None = None,
                 edge_feat: np.ndarray | Tensor | None = None, threads: int | None = None) -> None:
        if int(batch_size) <= 0:
            raise TrellisUserError(f"--batch-size must be a positive integer (got {batch_size})")
        self.sampler = sampler
        self.ids = np_int64(ids)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.device = torch.device(device)
        self.prefetch = max(0, int(prefetch))
        self.workers = max(1, int(workers))
        self.threads = threads
        slots = self.prefetch + self.workers + 2
        self.features = None if x is None else FeatureGather(x, slots=slots, pin=self.device.type == "cuda")
        if y is not None and isinstance(y, Tensor):
            self.y: Tensor | None = y
        else:
            self.y = None if y is None else torch.from_numpy(np.ascontiguousarray(y))
        self.edge_weight = as_tensor(edge_weight)
        self.edge_feat = as_tensor(edge_feat)

    def plan(self, epoch_seed: int) -> SeedPlan:
        """The epoch's order of targets (a permutation seeded by ``(seed, epoch_seed)``)."""
        if self.shuffle:
            rng = np.random.default_rng(mix64(self.seed, epoch_seed, 0x5EED) >> 1)
            order = self.ids[rng.permutation(self.ids.shape[0])]
        else:
            order = self.ids
        return SeedPlan(order, self.batch_size, epoch_seed)

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-self.ids.shape[0] // self.batch_size)

    def get(self, plan: SeedPlan, index: int, *, gather: bool = True) -> Batch:
        """Build batch ``index`` of ``plan``'s epoch (sampling, then the feature and label gather)."""
        if self.threads is not None and get_num_threads() != self.threads:
            set_num_threads(self.threads)  # per calling thread: only this preparing thread changes
        bseed = batch_seed(self.seed, plan.epoch, index)
        batch = self.sampler.sample(plan.seeds(index), bseed)
        batch.index = index
        if gather:
            batch = self.fill(batch, slot=index)  # on an accelerator, fill returns the moved copy
        return batch

    def fill(self, batch: Batch, slot: int | None = None, *, features: bool = True) -> Batch:
        """Gather ``batch``'s input features, target labels and edge data (see :func:`fill_batch`)."""
        return fill_batch(self, batch, slot, features=features, edge_weight=self.edge_weight,
                          edge_feat=self.edge_feat)

    def epoch(self, epoch: int, *, gather: bool = True) -> Prefetcher[Batch]:
        """Iterate the batches of ``epoch`` in order, prepared ``prefetch`` ahead by background workers."""
        return iter_epoch(self, epoch, get=lambda plan, i: self.get(plan, i, gather=gather))


__all__ = ["NeighborLoader", "NeighborSampler", "SeedPlan", "ThreadLocalMap", "attach_reverse", "batch_seed",
           "fill_batch", "mix64", "parse_fanouts", "reverse_csr"]

