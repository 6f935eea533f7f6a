"""Cluster-batch training batches (Cluster-GCN; GraphTheta §2.3 and appendix B).

The graph is split once into ``--clusters`` clusters by a min-edge-cut partitioner (METIS or GREM from
:mod:`trellis.partition`; ``hash`` is a balanced random split, Cluster-GCN's baseline). Each step takes a
random group of ``--clusters-per-batch`` clusters and restores *all* edges among them -- the induced
subgraph -- as one :class:`~trellis.ops.graph.CSRGraph`. Grouping several clusters per batch puts back
the between-cluster edges the partition cut and lowers the variance of the gradient (Cluster-GCN §3.2).
Every epoch visits each cluster exactly once, so each node is a target exactly once per epoch.

GraphTheta's extension (appendix B): ``--boundary-hops h`` adds the nodes up to ``h`` in-edge hops
outside the group as extra *source* rows. They contribute messages but carry no loss. Nodes are ordered
by hop distance (cluster nodes, then hop 1, then hop 2), so every layer's block is a row prefix of one
square CSR: the layer that produces the targets needs only cluster rows, the layer below it also rows
of hop 1, and so on -- a node at hop ``d`` only has in-neighbours at hop ``<= d + 1``, so each prefix's
sources are exactly the previous layer's rows. With ``h = 0`` every layer shares the one square graph.

Normalization follows Cluster-GCN: GCN's degrees are those of the batch's subgraph (the induced
in-degree), not the global ones -- the subgraph is the graph the model is trained on at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trellis.errors import TrellisUserError
from trellis.loader.blocks import Batch, attach_edge_data
from trellis.loader.features import FeatureGather, FeatureSource, np_int64
from trellis.loader.prefetch import Prefetcher
from trellis.loader.sampler import ThreadLocalMap, as_tensor, attach_reverse, fill_batch, mix64
from trellis.loader.source import iter_epoch
from trellis.ops.graph import CSRGraph
from trellis.partition.base import partition_graph
from trellis.utils.numba import njit, prange

#: ``--cluster-method`` choices: partitioners of :mod:`trellis.partition`, plus ``hash`` (random, balanced).
CLUSTER_METHODS = ("metis", "grem", "hash")


def cluster_assignment(store: object, num_clusters: int, method: str = "metis", *, seed: int = 0) -> np.ndarray:
    """``int32 [N]`` cluster of every node, from a partitioner of :mod:`trellis.partition`.

    Args:
        store: The :class:`~trellis.data.store.GraphStore`.
        num_clusters: Number of clusters (``--clusters``).
        method: ``metis``, ``grem`` or ``hash`` (default: metis).
        seed: Seed of the partitioner (default: 0).

    Raises:
        TrellisUserError: Unknown method, or more clusters than nodes.
    """
    num_nodes = int(store.num_nodes)  # type: ignore[attr-defined]
    if method not in CLUSTER_METHODS:
        raise TrellisUserError(f"--cluster-method {method!r} is not one of {', '.join(CLUSTER_METHODS)}")
    if not 1 <= num_clusters <= num_nodes:
        raise TrellisUserError(f"--clusters {num_clusters}: need between 1 and the graph's {num_nodes} nodes")
    if method == "hash":
        return hash_clusters(num_nodes, num_clusters, seed)
    book = partition_graph(store, method, num_clusters, measure=False, seed=seed)  # type: ignore[arg-type]
    return np.asarray(book.node_parts, dtype=np.int32)


def hash_clusters(num_nodes: int, num_clusters: int, seed: int = 0) -> np.ndarray:
    """Balanced random clusters: a seeded permutation dealt round-robin (sizes differ by at most one)."""
    rng = np.random.default_rng(mix64(seed, num_clusters) >> 1)
    parts = np.empty(num_nodes, dtype=np.int32)
    parts[rng.permutation(num_nodes)] = np.arange(num_nodes, dtype=np.int64) % num_clusters
    return parts


# ---- kernels -----------------------------------------------------------------------------------------
@njit(nogil=True, cache=True)
def _mark(nodes, local_of):  # pragma: no cover - compiled
    for i in range(nodes.shape[0]):
        local_of[nodes[i]] = i


@njit(nogil=True, cache=True)
def _expand(indptr, indices, lo, hi, local_of, node_ids, n):  # pragma: no cover - compiled
    """Append the unseen in-neighbours of rows ``node_ids[lo:hi]`` (one boundary hop); returns new n."""
    for r in range(lo, hi):
        v = node_ids[r]
        for k in range(indptr[v], indptr[v + 1]):
            t = indices[k]
            if local_of[t] < 0:
                local_of[t] = n
                node_ids[n] = t
                n += 1
    return n


@njit(nogil=True, parallel=True, cache=True)
def _induced_counts(indptr, indices, nodes, local_of):  # pragma: no cover - compiled
    counts = np.zeros(nodes.shape[0], dtype=np.int64)
    for r in prange(nodes.shape[0]):
        v = nodes[r]
        c = 0
        for k in range(indptr[v], indptr[v + 1]):
            if local_of[indices[k]] >= 0:
                c += 1
        counts[r] = c
    return counts


@njit(nogil=True, parallel=True, cache=True)
def _induced_fill(indptr, indices, nodes, local_of, out_indptr, out_indices, out_eid):  # pragma: no cover
    for r in prange(nodes.shape[0]):
        v = nodes[r]
        o = out_indptr[r]
        for k in range(indptr[v], indptr[v + 1]):
            loc = local_of[indices[k]]
            if loc >= 0:
                out_indices[o] = loc
                out_eid[o] = k
                o += 1


@njit(nogil=True, cache=True)
def _unmark(nodes, local_of):  # pragma: no cover - compiled
    for i in range(nodes.shape[0]):
        local_of[nodes[i]] = -1


def induced_subgraph(indptr: np.ndarray, indices: np.ndarray, nodes: np.ndarray, *, boundary_hops: int = 0,
                     local_of: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                   list[int]]:
    """The subgraph induced by ``nodes`` plus their ``boundary_hops``-hop in-neighbourhood.

    Args:
        indptr: ``int64 [N+1]`` in-edge CSR of the graph.
        indices: ``int64 [E]`` sources.
        nodes: Global ids of the core nodes (unique); they get local ids ``0..len(nodes)-1``.
        boundary_hops: In-edge hops of boundary nodes to add (default: 0).
        local_of: Scratch ``[N]`` map, all ``-1``; returned all ``-1`` (default: a new one).

    Returns:
        ``(sub_indptr, sub_indices, eid, node_ids, hop_ends)``: a square CSR over local ids (rows in the
        order of ``node_ids``), each edge's id in the graph, the local -> global map, and ``hop_ends[d]`` =
        number of nodes within ``d`` hops (``hop_ends[0] == len(nodes)``).
    """
    if local_of is None:
        local_of = np.full(indptr.shape[0] - 1, -1, dtype=np.int32)
    nodes = np_int64(nodes)
    n = nodes.shape[0]
    cap = n
    node_ids = nodes.copy()
    _mark(nodes, local_of)
    hop_ends = [n]
    try:
        lo = 0
        for _ in range(boundary_hops):
            hi = n
            extra = int((indptr[node_ids[lo:hi] + 1] - indptr[node_ids[lo:hi]]).sum())
            if n + extra > cap:
                cap = n + extra
                grown = np.empty(cap, dtype=np.int64)
                grown[:n] = node_ids[:n]
                node_ids = grown
            n = _expand(indptr, indices, lo, hi, local_of, node_ids, n)
            hop_ends.append(n)
            lo = hi
        node_ids = node_ids[:n]
        counts = _induced_counts(indptr, indices, node_ids, local_of)
        sub_indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=sub_indptr[1:])
        e = int(sub_indptr[-1])
        sub_indices = np.empty(e, dtype=np.int64)
        eid = np.empty(e, dtype=np.int64)
        _induced_fill(indptr, indices, node_ids, local_of, sub_indptr, sub_indices, eid)
    finally:
        _unmark(node_ids[:n], local_of)
    return sub_indptr, sub_indices, eid, node_ids, hop_ends


def prefix_blocks(indptr: np.ndarray, indices: np.ndarray, hop_ends: list[int], num_layers: int,
                  node_ids: Tensor) -> list[CSRGraph]:
    """Per-layer blocks (input layer first) as row prefixes of one hop-ordered square CSR.

    Layer ``l`` of ``L`` produces rows of the nodes within ``min(h, L - 1 - l)`` hops, reading the rows the
    layer below produced (all nodes for the input layer). With no boundary (``h = 0``) every layer gets
    the same square graph object.
    """
    h = len(hop_ends) - 1
    n = int(hop_ends[-1])
    if h == 0:
        g = CSRGraph(torch.from_numpy(indptr), torch.from_numpy(indices), n, node_ids=node_ids)
        return [attach_reverse(g)] * num_layers
    deg = torch.from_numpy(np.diff(indptr).astype(np.float32))
    blocks: list[CSRGraph] = []
    num_src = n
    for layer in range(num_layers):
        rows = int(hop_ends[min(h, num_layers - 1 - layer)])
        e = int(indptr[rows])
        g = CSRGraph(torch.from_numpy(indptr[: rows + 1]), torch.from_numpy(indices[:e]), num_src,
                     node_ids=node_ids[:num_src])
        g.src_degree = deg[:num_src]
        g.dst_degree = deg[:rows]
        blocks.append(attach_reverse(g))
        num_src = rows
    return blocks


@dataclass
class ClusterPlan:
    """One epoch's groups of clusters (a seeded permutation of cluster ids cut into groups).

    Attributes:
        groups: Cluster ids of each batch (ascending within a group).
        epoch: The epoch seed the permutation was drawn from.
    """

    groups: list[np.ndarray]
    epoch: int

    def __len__(self) -> int:
        """Number of batches."""
        return len(self.groups)


class ClusterLoader:
    """Cluster-batches over a fixed clustering: a :class:`~trellis.loader.source.BatchSource`.

    Batch ``i`` of a plan depends only on ``(plan, i)`` (each preparing thread has its own scratch map),
    so ``workers`` threads yield exactly the batches of one, in the same order.

    Args:
        indptr: ``int64 [N+1]`` in-edge CSR (memory maps are read in place).
        indices: ``int64 [E]`` sources.
        parts: ``int [N]`` cluster of every node (:func:`cluster_assignment`).
        clusters_per_batch: Clusters merged into one batch (``--clusters-per-batch``).
        num_layers: Model layers (the number of blocks per batch).
        boundary_hops: 0, 1 or 2 hops of boundary source nodes (default: 0).
        x: Node features to gather: an array, memory map, tensor or any
            :class:`~trellis.loader.features.FeatureSource` (None = none).
        y: Labels by global id (None = none).
        loss_nodes: Bool ``[N]`` or node ids that carry the loss (e.g. the training split); None = all.
        edge_weight: ``[E]`` edge weights to carry with each batch's edges (None = none).
        edge_feat: ``[E, D]`` edge features, carried the same way (None = none).
        seed: Base seed of the cluster shuffles (default: 0).
        device: Where batches are delivered (default: cpu).
        prefetch: Batches prepared ahead by background workers (0 = none) (default: 2).
        workers: Threads preparing batches (default: 1); the numba kernels release the GIL.
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, parts: np.ndarray, clusters_per_batch: int, *,
                 num_layers: int, boundary_hops: int = 0, x: np.ndarray | Tensor | FeatureSource | None = None,
                 y: np.ndarray | Tensor | None = None, loss_nodes: np.ndarray | Tensor | None = None,
                 edge_weight: np.ndarray | Tensor | None = None, edge_feat: np.ndarray | Tensor | None = None,
                 seed: int = 0, device: torch.device | str = "cpu", prefetch: int = 2, workers: int = 1) -> None:
        self.indptr = np_int64(indptr)
        self.indices = np_int64(indices)
        n = self.indptr.shape[0] - 1
        parts = np.asarray(parts, dtype=np.int64)
        if parts.shape != (n,):
            raise ValueError(f"parts must have one entry per node ({n}), got shape {parts.shape}")
        self.num_clusters = int(parts.max()) + 1 if n else 0
        if int(clusters_per_batch) < 1:
            raise TrellisUserError(f"--clusters-per-batch must be at least 1 (got {clusters_per_batch})")
        if int(clusters_per_batch) > self.num_clusters:
            raise TrellisUserError(f"--clusters-per-batch {clusters_per_batch} exceeds --clusters "
                                   f"{self.num_clusters}; a batch cannot hold more clusters than there are")
        if boundary_hops not in (0, 1, 2):
            raise TrellisUserError(f"--boundary-hops must be 0, 1 or 2 (got {boundary_hops})")
        order = np.argsort(parts, kind="stable")
        self.cluster_nodes = order.astype(np.int64)
        self.cluster_ptr = np.zeros(self.num_clusters + 1, dtype=np.int64)
        np.cumsum(np.bincount(parts, minlength=self.num_clusters), out=self.cluster_ptr[1:])
        self.clusters_per_batch = int(clusters_per_batch)
        self.num_layers = int(num_layers)
        self.boundary_hops = int(boundary_hops)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.prefetch = max(0, int(prefetch))
        self.workers = max(1, int(workers))
        self.features = None if x is None else FeatureGather(x, slots=self.prefetch + self.workers + 2,
                                                             pin=self.device.type == "cuda")
        self.y = None if y is None else (y if isinstance(y, Tensor) else torch.from_numpy(np.ascontiguousarray(y)))
        if loss_nodes is None:
            self.loss_mask = None
        else:
            ln = loss_nodes.cpu().numpy() if isinstance(loss_nodes, Tensor) else np.asarray(loss_nodes)
            if ln.dtype == np.bool_:
                mask = ln.astype(np.bool_)
            else:
                mask = np.zeros(n, dtype=np.bool_)
                mask[ln.astype(np.int64)] = True
            self.loss_mask = torch.from_numpy(mask)
        self.edge_weight = as_tensor(edge_weight)
        self.edge_feat = as_tensor(edge_feat)
        self._scratch = ThreadLocalMap(n)

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-self.num_clusters // self.clusters_per_batch)

    def plan(self, epoch_seed: int) -> ClusterPlan:
        """The epoch's random groups of clusters (seeded by ``(seed, epoch_seed)``)."""
        rng = np.random.default_rng(mix64(self.seed, epoch_seed, 0xC1) >> 1)
        perm = rng.permutation(self.num_clusters)
        k = self.clusters_per_batch
        return ClusterPlan([np.sort(perm[i:i + k]) for i in range(0, self.num_clusters, k)], epoch_seed)

    def nodes_of(self, clusters: np.ndarray) -> np.ndarray:
        """Global ids of the nodes of ``clusters`` (cluster by cluster, ascending within each)."""
        return np.concatenate([self.cluster_nodes[self.cluster_ptr[c]:self.cluster_ptr[c + 1]] for c in clusters])

    def get(self, plan: ClusterPlan, index: int, *, gather: bool = True) -> Batch:
        """Build batch ``index`` of ``plan``'s epoch: induced subgraph, blocks, features, labels."""
        clusters = plan.groups[index]
        nodes = self.nodes_of(clusters)
        sub_indptr, sub_indices, eid, node_ids, hop_ends = induced_subgraph(
            self.indptr, self.indices, nodes, boundary_hops=self.boundary_hops, local_of=self._scratch.get())
        ids_t = torch.from_numpy(node_ids)
        blocks = prefix_blocks(sub_indptr, sub_indices, hop_ends, self.num_layers, ids_t)
        eid_t = torch.from_numpy(eid)
        for b in blocks:
            b.edge_ids = eid_t[: b.num_edges]
        attach_edge_data(blocks, self.edge_weight, self.edge_feat)
        batch = Batch(blocks=blocks, node_ids=ids_t, num_targets=int(nodes.shape[0]), index=index,
                      seed=int(mix64(self.seed, plan.epoch, index) >> 1),
                      stats={"edges": float(sub_indices.shape[0]), "inputs": float(node_ids.shape[0]),
                             "clusters": float(len(clusters))})
        if self.loss_mask is not None:
            batch.loss_mask = self.loss_mask[batch.targets]
        return self.fill(batch, slot=index) if gather else batch

    def fill(self, batch: Batch, slot: int | None = None, *, features: bool = True) -> Batch:
        """Gather ``batch``'s input features and target labels (:func:`~trellis.loader.sampler.fill_batch`).

        Its edge data is attached when the batch is built, whether or not it is filled.
        """
        return fill_batch(self, batch, slot, features=features)

    def epoch(self, epoch: int, *, gather: bool = True) -> Prefetcher[Batch]:
        """Iterate the batches of ``epoch`` in order, prepared ``prefetch`` ahead on ``workers`` threads."""
        return iter_epoch(self, epoch, get=lambda plan, i: self.get(plan, i, gather=gather))
