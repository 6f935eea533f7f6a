"""Quality of a partition: edge cut, balance, replication, halo sizes and the exchange a GNN layer costs.

All figures come from one streaming pass over the store's edges in chunks; the only O(N) state is a
bitmask per node of the parts that need it as a halo node (``ceil(P/64)`` words per node), so the
report is as memory-bounded as the streaming partitioners it judges.

Definitions (``E`` stored edges, ``N`` nodes, ``P`` parts):

* ``edge_cut_frac``: stored edges whose endpoints lie in different parts, over ``E`` (self loops are
  never cut). For a symmetric store this equals the undirected fraction.
* ``balance``: largest part (nodes) over ``N / P``; ``edge_balance``: the same over stored edges per part.
* **halo** of part ``p``: the remote nodes ``p`` needs, which depends on edge ownership — the sources of
  its in-edges (``dst``), the destinations of its out-edges (``src``), both (``reverse``), or the
  mirrors of the nodes whose edges it holds (``vertex-cut``).
* ``replication_factor``: ``(N + sum of halo sizes) / N`` — copies of a node's state per node.
* **exchange** for one full-batch layer of width ``F`` (float32): the rows :mod:`trellis.distributed` sends, 4F
  bytes per (node, remote part) pair that is *in use* (GraphTheta §4.1: only masters in use are
  synchronized). The distributed engine's measured bytes per layer equal these figures:

  ============  ==========================================  =============================================
  ownership     forward                                     backward
  ============  ==========================================  =============================================
  dst (pull)    halo sources fetched from their owners      their gradient sums sent back: same count
  src (push)    partial sums of halo destinations, to the   the owners' gradient rows back to the holders:
                owners (1 row per (dst, part))              1 row per (halo destination, part)
  reverse       as ``src``                                  partial gradients of the reversed in-edges'
                                                            halo sources, to their owners
  vertex-cut    master -> mirror rows of mirrors used as    the mirror image of both halves
                sources, plus mirror -> master partial
                sums of mirrors used as destinations
  ============  ==========================================  =============================================

  Lotan §5.1 prices source ownership's backward per cut edge (its engine ships per-edge gradient maps,
  ``d``× the forward vectors); that figure is kept as ``exchange_bwd_bytes_per_edge``. Once gradients
  are summed per node before they travel, as here, ``src`` and ``reverse`` send one row per (node, part)
  both ways; on a symmetric graph their halo sets coincide, so reverse placement no longer reduces the
  bytes — it changes the direction (owners push partial gradients instead of holders fetching gradient
  rows) at the cost of a second copy of the edges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.partition.base import PartitionBook
from trellis.partition.edges import edge_ranges
from trellis.utils.numba import njit

#: Edges per chunk of the evaluation pass.
DEFAULT_CHUNK_EDGES = 1 << 20
FLOAT_BYTES = 4


@njit(cache=True, nogil=True)
def mark_parts(nodes: np.ndarray, at_parts: np.ndarray, owner: np.ndarray, mask: np.ndarray) -> None:
    """Set bit ``at_parts[k]`` of ``mask[nodes[k]]`` when that part is not the node's owner."""
    for k in range(nodes.shape[0]):
        v = nodes[k]
        p = at_parts[k]
        if owner[v] != p:
            mask[v, p >> 6] |= np.uint64(1) << np.uint64(p & 63)


@njit(cache=True, nogil=True)
def count_parts(mask: np.ndarray, num_parts: int) -> np.ndarray:
    """``int64 [P]``: how many nodes have bit ``p`` set (halo size of each part)."""
    out = np.zeros(num_parts, dtype=np.int64)
    for v in range(mask.shape[0]):
        for p in range(num_parts):
            if (mask[v, p >> 6] >> np.uint64(p & 63)) & np.uint64(1):
                out[p] += 1
    return out


def new_mask(num_nodes: int, num_parts: int) -> np.ndarray:
    """Zeroed ``uint64 [N, ceil(P/64)]`` part bitmask."""
    return np.zeros((num_nodes, max(1, -(-num_parts // 64))), dtype=np.uint64)


def exchange_bytes(ownership: str, width: int, halo_in: int, halo_out: int) -> tuple[int, int]:
    """``(forward, backward)`` bytes one layer of width ``width`` exchanges (module table).

    ``halo_in``: (node, part) pairs where a part's edges read a remote node as a source; ``halo_out``:
    pairs where they write a remote node as a destination (under vertex-cut, the mirrors in each role).
    """
    vec = FLOAT_BYTES * int(width)
    if ownership == "dst":
        return vec * halo_in, vec * halo_in
    if ownership == "src":
        return vec * halo_out, vec * halo_out
    if ownership == "reverse":
        return vec * halo_out, vec * halo_in
    return vec * (halo_in + halo_out), vec * (halo_in + halo_out)


@dataclass
class PartitionQuality:
    """The quality report (``to_dict`` is what ``trellis partition --json`` prints)."""

    method: str
    num_parts: int
    num_nodes: int
    num_edges: int
    ownership: str
    edge_cut: int
    edge_cut_frac: float
    balance: float
    edge_balance: float
    replication_factor: float
    width: int
    exchange_fwd_bytes: int
    exchange_bwd_bytes: int
    exchange_bwd_bytes_per_edge: int | None = None
    time_s: float | None = None
    peak_rss_mb: float | None = None
    peak_rss_anon_mb: float | None = None
    part_nodes: list[int] = field(default_factory=list)
    part_halo: list[int] = field(default_factory=list)
    part_edges: list[int] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    #: Training nodes of each part (empty for a store without a training split): the work and batch count of
    #: the rank that trains the part, which ``--balance train`` evens out.
    part_train: list[int] = field(default_factory=list)
    #: Largest part's training nodes over the mean (None without a training split).
    train_balance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON-ready dict (written to the partition report and the layout manifest)."""
        return asdict(self)

    def table(self, max_rows: int = 32) -> str:
        """Human-readable summary plus a per-part table (first ``max_rows`` parts)."""
        def mb(x: float | None) -> str:
            return "-" if x is None else f"{x:,.1f} MB"

        lines = [
            f"method             {self.method} (edges owned by: {self.ownership})",
            f"parts              {self.num_parts}   nodes {self.num_nodes:,}   edges {self.num_edges:,}",
            f"edge cut           {self.edge_cut:,} ({100 * self.edge_cut_frac:.2f}%)",
            f"balance            {self.balance:.3f} nodes, {self.edge_balance:.3f} edges"
            + ("" if self.train_balance is None else f", {self.train_balance:.3f} training nodes") + " (max / mean)",
            f"replication factor {self.replication_factor:.3f}",
            f"exchange (F={self.width})  forward {self.exchange_fwd_bytes / 2**20:,.1f} MiB, "
            f"backward {self.exchange_bwd_bytes / 2**20:,.1f} MiB per layer"
            + ("" if self.exchange_bwd_bytes_per_edge is None else
               f" (Lotan's per-edge gradient maps: {self.exchange_bwd_bytes_per_edge / 2**20:,.1f} MiB)"),
            f"time               {'-' if self.time_s is None else f'{self.time_s:.2f} s'}",
            f"peak memory        RSS {mb(self.peak_rss_mb)}, RssAnon {mb(self.peak_rss_anon_mb)}",
            "",
            f"{'part':>6} {'local':>12} {'halo':>12} {'edges':>14}" + (f" {'train':>10}" if self.part_train else ""),
        ]
        for p in range(min(self.num_parts, max_rows)):
            lines.append(f"{p:>6} {self.part_nodes[p]:>12,} {self.part_halo[p]:>12,} {self.part_edges[p]:>14,}"
                         + (f" {self.part_train[p]:>10,}" if self.part_train else ""))
        if self.num_parts > max_rows:
            lines.append(f"   ... {self.num_parts - max_rows} more parts")
        return "\n".join(lines)


def evaluate(store: GraphStore, book: PartitionBook, *, width: int = 256,
             chunk_edges: int = DEFAULT_CHUNK_EDGES) -> PartitionQuality:
    """Compute the quality report of ``book`` on ``store`` in one chunked pass over the edges.

    Args:
        store: The graph the book partitions.
        book: The partition.
        width: Feature width ``F`` for the exchange estimate (default: 256).
        chunk_edges: Edges per chunk of the pass (default: 1M).
    """
    n, num_parts = store.num_nodes, book.num_parts
    parts = np.asarray(book.node_parts)
    own = book.ownership
    mask_in = new_mask(n, num_parts) if own in ("dst", "reverse", "vertex-cut") else None
    mask_out = new_mask(n, num_parts) if own in ("src", "reverse", "vertex-cut") else None
    cut = 0
    part_edges = np.zeros(num_parts, dtype=np.int64)
    for src, dst, _ in edge_ranges(store.indptr, store.indices, chunk_edges):
        ps, pd = parts[src], parts[dst]
        cut += int(np.count_nonzero(ps != pd))
        if own == "vertex-cut":  # mirrors by role: read as a source, written as a destination
            ep = book.edge_parts(src, dst)
            part_edges += np.bincount(ep, minlength=num_parts)
            mark_parts(src, ep, parts, mask_in)
            mark_parts(dst, ep, parts, mask_out)
            continue
        if mask_in is not None:  # the part of the destination needs the source
            mark_parts(src, pd, parts, mask_in)
        if mask_out is not None:  # the part of the source pushes to the destination
            mark_parts(dst, ps, parts, mask_out)
        part_edges += np.bincount(book.edge_parts(src, dst), minlength=num_parts)
        if own == "reverse":  # the reversed copy lives with the destination
            part_edges += np.bincount(pd, minlength=num_parts)
    halo_in = count_parts(mask_in, num_parts) if mask_in is not None else np.zeros(num_parts, np.int64)
    halo_out = count_parts(mask_out, num_parts) if mask_out is not None else np.zeros(num_parts, np.int64)
    if own in ("reverse", "vertex-cut"):
        assert mask_in is not None and mask_out is not None
        halo = count_parts(mask_in | mask_out, num_parts)
    else:
        halo = halo_in + halo_out
    sizes = book.part_sizes()
    fwd, bwd = exchange_bytes(own, width, int(halo_in.sum()), int(halo_out.sum()))
    per_edge = FLOAT_BYTES * int(width) * cut if own in ("src", "reverse") else None
    e = store.num_edges
    mean_edges = part_edges.sum() / num_parts
    train = np.asarray(store.split("train")) if store.has("train_idx") else None
    part_train = np.bincount(parts[train], minlength=num_parts) if train is not None and train.size else None
    return PartitionQuality(
        method=book.method, num_parts=num_parts, num_nodes=n, num_edges=e, ownership=own,
        edge_cut=cut, edge_cut_frac=cut / e if e else 0.0,
        balance=float(sizes.max() * num_parts / n),
        edge_balance=float(part_edges.max() / mean_edges) if mean_edges else 1.0,
        replication_factor=float((n + halo.sum()) / n), width=int(width),
        exchange_fwd_bytes=int(fwd), exchange_bwd_bytes=int(bwd), exchange_bwd_bytes_per_edge=per_edge,
        time_s=book.stats.get("time_s"), peak_rss_mb=book.stats.get("peak_rss_mb"),
        peak_rss_anon_mb=book.stats.get("peak_rss_anon_mb"),
        part_nodes=sizes.tolist(), part_halo=halo.tolist(), part_edges=part_edges.tolist(),
        params=dict(book.params),
        part_train=[] if part_train is None else part_train.tolist(),
        train_balance=None if part_train is None else float(part_train.max() * num_parts / part_train.sum()),
    )
