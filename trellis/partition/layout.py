"""The partitioned layout on disk (``PART_DIR``) and the Python API that training code reads it with.

Layout (every array a plain ``.npy``, described with dtype/shape/sha256 in ``manifest.json``)::

    PART_DIR/
      manifest.json           format, counts, method, ownership, store checksum, quality, per-part counts
      book.json               the PartitionBook's metadata (method, ownership, params, stats)
      node_parts.npy          int32 [N]      part (master) of every node
      buckets/offsets.npy     int64 [P*P+1]  bucket (i, j) = rows offsets[i*P+j] : offsets[i*P+j+1]
      buckets/edges.npy       int64 [E, 2]   (src, dst) global ids, grouped by (part(src), part(dst))
      buckets/edge_ids.npy    int64 [E]      forward-CSR edge id of each bucket row (edge data follows it)
      buckets/edge_weight.npy float32 [E]    when the store has edge weights
      buckets/edge_feat.npy   float32 [E,D]  when the store has edge features
      part-00000/
        local_to_global.npy   int64 [L+H]    local ids: the part's L nodes (ascending), then H halo nodes
        halo_owner.npy        int32 [H]      owner (master) part of each halo node
        indptr.npy            int64 [L+H+1]  local CSR of in-edges: row = destination local id
        indices.npy           int64 [M]      source local id of each edge
        edge_ids.npy          int64 [M]      global edge id (into the store's CSR)
        edge_weight.npy       float32 [M]    optional, in local edge order
        edge_feat.npy         float32 [M,D]  optional, in local edge order
        in_degree.npy         int64 [L+H]    global in-degree of every local and halo node
        out_degree.npy        int64 [L+H]    global out-degree
        mirror_indptr.npy     int64 [L+1]    for each local node, the parts holding it as a halo node
        mirror_parts.npy      int32 [...]
        x.npy                 float32 [L,F]  the part's node features, contiguous (Armada §3)
        y.npy                 labels of the L local nodes
        train_idx.npy, ...    local ids of the part's split nodes
        rev_indptr.npy, rev_indices.npy, rev_edge_ids.npy (+ rev_edge_weight / rev_edge_feat)
                              ``reverse`` ownership only: the reversed in-edges of the part's nodes,
                              rows = original source (local or halo), columns = local destination

Which edges a part holds follows the book's ownership: its nodes' in-edges (``dst``), their out-edges
(``src``; halo rows then hold partial sums to push), out-edges plus reversed in-edges (``reverse``), or
the edges the grid hash gives it (``vertex-cut``; halo nodes are mirrors). In every case the local CSR
has a row for each local id; rows that hold no edges are empty (the halo rows under ``dst``), so
``indptr[:L + 1]`` is the destination-only CSR a pull-based engine wants.

Writing is bounded in memory: per part, the edges are read in chunks (rows of the part's nodes, or
shuffled through a counting sort), with O(N) scratch and memory-mapped outputs; the directory is built
under a temporary name and renamed into place only when complete, as the store is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trellis.data.store import SPLITS, GraphStore, sha256_file
from trellis.errors import TrellisUserError
from trellis.partition.base import BOOK_FILE, NODE_PARTS_FILE, PartitionBook, methods_of_ownership, partition_dir
from trellis.partition.edges import edge_ranges, row_edges
from trellis.partition.quality import PartitionQuality, mark_parts, new_mask
from trellis.utils.atomic import MANIFEST
from trellis.utils.csr import build_reverse_csr
from trellis.utils.diskmap import new_map
from trellis.utils.manifest import LAYOUT_FORMAT, ManifestField, format_of
from trellis.utils.numba import njit

#: The layout's manifest: format ``trellis-partition`` v1.
LAYOUT = LAYOUT_FORMAT
#: Layouts whose arrays sum to less than this are hashed in full on open (``verify="auto"``).
AUTO_VERIFY_BYTES = 512 * 1024 * 1024
DEFAULT_CHUNK_EDGES = 1 << 20
_NODE_CHUNK = 1 << 16

EdgeChunks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]]


def part_dir_name(part: int) -> str:
    """Directory name of part ``part`` inside a layout (``part-00003``)."""
    return f"part-{part:05d}"


@njit(cache=True, nogil=True)
def _scatter(rows: np.ndarray, cols: np.ndarray, eids: np.ndarray, cursor: np.ndarray, out_cols: np.ndarray,
             out_eids: np.ndarray) -> None:
    """Counting-sort placement: edge ``k`` goes to ``cursor[rows[k]]`` (then the cursor advances)."""
    for k in range(rows.shape[0]):
        r = rows[k]
        at = cursor[r]
        out_cols[at] = cols[k]
        out_eids[at] = eids[k]
        cursor[r] = at + 1


@njit(cache=True, nogil=True)
def _scatter_pairs(keys: np.ndarray, src: np.ndarray, dst: np.ndarray, eids: np.ndarray, cursor: np.ndarray,
                   out_edges: np.ndarray, out_eids: np.ndarray) -> None:
    """Counting-sort placement of ``(src, dst)`` rows by bucket key."""
    for k in range(keys.shape[0]):
        at = cursor[keys[k]]
        out_edges[at, 0] = src[k]
        out_edges[at, 1] = dst[k]
        out_eids[at] = eids[k]
        cursor[keys[k]] = at + 1


@njit(cache=True, nogil=True)
def _mirror_lists(mask: np.ndarray, nodes: np.ndarray, num_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the parts whose bit is set in ``mask[v]`` for each node of ``nodes``."""
    indptr = np.zeros(nodes.shape[0] + 1, dtype=np.int64)
    for i in range(nodes.shape[0]):
        c = 0
        for p in range(num_parts):
            if (mask[nodes[i], p >> 6] >> np.uint64(p & 63)) & np.uint64(1):
                c += 1
        indptr[i + 1] = indptr[i] + c
    out = np.empty(indptr[-1], dtype=np.int32)
    for i in range(nodes.shape[0]):
        at = indptr[i]
        for p in range(num_parts):
            if (mask[nodes[i], p >> 6] >> np.uint64(p & 63)) & np.uint64(1):
                out[at] = p
                at += 1
    return indptr, out


class _ArrayWriter:
    """Creates ``.npy`` files under a directory and remembers them for the manifest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: list[str] = []

    def save(self, rel: str, array: np.ndarray) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.ascontiguousarray(array))
        self.files.append(rel)

    def create(self, rel: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A writable memory map (or, for an empty array, a saved empty array)."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        self.files.append(rel)
        if int(np.prod(shape)) == 0:
            np.save(path, np.empty(shape, dtype=dtype))
            return np.empty(shape, dtype=dtype)
        return new_map(path, shape, dtype, "free space or write the layout elsewhere (--out)")

    def manifest_arrays(self) -> dict[str, dict[str, Any]]:
        out = {}
        for rel in sorted(set(self.files)):
            arr = np.load(self.root / rel, mmap_mode="r")
            out[rel] = {"dtype": str(arr.dtype), "shape": list(arr.shape), "sha256": sha256_file(self.root / rel)}
        return out


def _gather_rows_to(dest: np.ndarray, source: np.ndarray, ids: np.ndarray, chunk: int) -> None:
    """``dest[k] = source[ids[k]]`` in chunks (``source`` may be a memory map)."""
    for a in range(0, ids.shape[0], chunk):
        dest[a:a + chunk] = source[ids[a:a + chunk]]


class _LayoutBuilder:
    """Writes one layout; holds the O(N) scratch shared by all parts."""

    def __init__(self, store: GraphStore, book: PartitionBook, w: _ArrayWriter, chunk_edges: int) -> None:
        self.store, self.book, self.w, self.chunk = store, book, w, chunk_edges
        self.parts = np.asarray(book.node_parts)
        self.indptr = np.asarray(store.indptr)
        self.indices = store.indices
        self.rindptr, self.rindices, self.rperm = store.reverse_csr()
        n = store.num_nodes
        self.in_deg = np.diff(self.indptr)
        self.out_deg = np.diff(np.asarray(self.rindptr))
        self.g2l = np.full(n, -1, dtype=np.int64)
        self.mark = np.zeros(n, dtype=np.bool_)
        self.mirrors = new_mask(n, book.num_parts)

    # ---- edge streams: (row global id, column global id, edge id) ---------------------------------
    def _in_edges(self, nodes: np.ndarray, transpose: bool = False) -> EdgeChunks:
        def gen() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            for pos, rows in row_edges(self.indptr, nodes, self.chunk):
                src = np.asarray(self.indices[pos])
                yield (src, rows, pos) if transpose else (rows, src, pos)
        return gen

    def _out_edges(self, nodes: np.ndarray) -> EdgeChunks:
        def gen() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            for pos, rows in row_edges(self.rindptr, nodes, self.chunk):
                yield np.asarray(self.rindices[pos]), rows, np.asarray(self.rperm[pos])
        return gen

    def _grid_edges(self, part: int) -> EdgeChunks:
        def gen() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            for src, dst, eid in edge_ranges(self.indptr, self.indices, self.chunk):
                keep = self.book.edge_parts(src, dst) == part
                yield dst[keep], src[keep], eid[keep]
        return gen

    def structures(self, part: int, nodes: np.ndarray) -> dict[str, EdgeChunks]:
        """The edge sets part ``part`` stores: ``""`` (forward local CSR) and, for reverse, ``"rev_"``."""
        own = self.book.ownership
        if own == "dst":
            return {"": self._in_edges(nodes)}
        if own == "src":
            return {"": self._out_edges(nodes)}
        if own == "reverse":
            return {"": self._out_edges(nodes), "rev_": self._in_edges(nodes, transpose=True)}
        return {"": self._grid_edges(part)}

    # ---- one part ------------------------------------------------------------------------------
    def write_part(self, part: int) -> dict[str, Any]:
        d = part_dir_name(part)
        nodes = self.book.nodes(part)
        structs = self.structures(part, nodes)
        for gen in structs.values():  # pass 1: halo = endpoints owned elsewhere
            for rows, cols, _ in gen():
                ends = np.concatenate([rows, cols])
                self.mark[ends[self.parts[ends] != part]] = True
        halo = np.flatnonzero(self.mark)
        self.mark[halo] = False
        n_loc, n_halo = nodes.shape[0], halo.shape[0]
        l2g = np.concatenate([nodes, halo]).astype(np.int64)
        self.g2l[l2g] = np.arange(n_loc + n_halo, dtype=np.int64)
        mark_parts(halo, np.full(n_halo, part, dtype=np.int32), self.parts, self.mirrors)
        self.w.save(f"{d}/local_to_global.npy", l2g)
        self.w.save(f"{d}/halo_owner.npy", self.parts[halo].astype(np.int32))
        self.w.save(f"{d}/in_degree.npy", self.in_deg[l2g])
        self.w.save(f"{d}/out_degree.npy", self.out_deg[l2g])
        info: dict[str, Any] = {"part": part, "num_local": int(n_loc), "num_halo": int(n_halo)}
        for prefix, gen in structs.items():
            info[f"num_{prefix}edges"] = self._write_csr(f"{d}/{prefix}", gen, n_loc + n_halo)
        self._write_nodes(d, part, nodes)
        self.g2l[l2g] = -1
        return info

    def _write_csr(self, base: str, gen: EdgeChunks, num_rows: int) -> int:
        counts = np.zeros(num_rows, dtype=np.int64)
        for rows, _, _ in gen():  # pass 2: row lengths
            counts += np.bincount(self.g2l[rows], minlength=num_rows)
        indptr = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        m = int(indptr[-1])
        self.w.save(f"{base}indptr.npy", indptr)
        out_cols = self.w.create(f"{base}indices.npy", (m,), np.int64)
        out_eids = self.w.create(f"{base}edge_ids.npy", (m,), np.int64)
        cursor = indptr[:-1].copy()
        for rows, cols, eids in gen():  # pass 3: counting-sort placement into the memory maps
            _scatter(self.g2l[rows], self.g2l[cols], eids, cursor, np.asarray(out_cols), np.asarray(out_eids))
        self._flush(out_cols, out_eids)
        self._write_edge_data(base, np.asarray(out_eids), m)
        return m

    def _write_edge_data(self, base: str, eids: np.ndarray, m: int) -> None:
        ew, ef = self.store.edge_weight, self.store.edge_feat
        if ew is not None:
            out = self.w.create(f"{base}edge_weight.npy", (m,), np.float32)
            _gather_rows_to(out, ew, eids, self.chunk)
            self._flush(out)
        if ef is not None:
            out = self.w.create(f"{base}edge_feat.npy", (m, ef.shape[1]), np.float32)
            _gather_rows_to(out, ef, eids, max(1, self.chunk // max(1, ef.shape[1])))
            self._flush(out)

    def _write_nodes(self, d: str, part: int, nodes: np.ndarray) -> None:
        x, y = self.store.x, self.store.y
        if x is not None:
            out = self.w.create(f"{d}/x.npy", (nodes.shape[0], x.shape[1]), np.float32)
            _gather_rows_to(out, x, nodes, max(1, self.chunk // max(1, x.shape[1])))
            self._flush(out)
        if y is not None:
            self.w.save(f"{d}/y.npy", np.asarray(y[nodes]))
        for split in SPLITS:
            ids = self.store.split(split)
            if ids is not None:
                ids = np.asarray(ids)
                self.w.save(f"{d}/{split}_idx.npy", self.g2l[ids[self.parts[ids] == part]])

    def write_mirrors(self, part: int) -> None:
        indptr, plist = _mirror_lists(self.mirrors, self.book.nodes(part), self.book.num_parts)
        self.w.save(f"{part_dir_name(part)}/mirror_indptr.npy", indptr)
        self.w.save(f"{part_dir_name(part)}/mirror_parts.npy", plist)

    # ---- edge buckets (Armada §3) -------------------------------------------------------------
    def write_buckets(self) -> None:
        num_parts = self.book.num_parts
        nb = num_parts * num_parts
        counts = np.zeros(nb, dtype=np.int64)
        for src, dst, _ in edge_ranges(self.indptr, self.indices, self.chunk):
            counts += np.bincount(self.parts[src].astype(np.int64) * num_parts + self.parts[dst], minlength=nb)
        offsets = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        e = self.store.num_edges
        self.w.save("buckets/offsets.npy", offsets)
        edges = self.w.create("buckets/edges.npy", (e, 2), np.int64)
        eids = self.w.create("buckets/edge_ids.npy", (e,), np.int64)
        cursor = offsets[:-1].copy()
        for src, dst, eid in edge_ranges(self.indptr, self.indices, self.chunk):
            key = self.parts[src].astype(np.int64) * num_parts + self.parts[dst]
            _scatter_pairs(key, src, dst, eid, cursor, np.asarray(edges), np.asarray(eids))
        self._flush(edges, eids)
        if self.store.edge_weight is not None:
            out = self.w.create("buckets/edge_weight.npy", (e,), np.float32)
            _gather_rows_to(out, self.store.edge_weight, np.asarray(eids), self.chunk)
            self._flush(out)
        ef = self.store.edge_feat
        if ef is not None:  # edge features travel with their edges here too (GAT-E reads them per edge)
            out = self.w.create("buckets/edge_feat.npy", (e, ef.shape[1]), np.float32)
            _gather_rows_to(out, ef, np.asarray(eids), max(1, self.chunk // max(1, ef.shape[1])))
            self._flush(out)

    @staticmethod
    def _flush(*arrays: np.ndarray) -> None:
        for a in arrays:
            if isinstance(a, np.memmap):
                a.flush()


def write_layout(store: GraphStore, book: PartitionBook, out: str | os.PathLike[str], *,
                 overwrite: bool = False, quality: PartitionQuality | None = None,
                 chunk_edges: int = DEFAULT_CHUNK_EDGES, progress: bool = False) -> Path:
    """Write the partitioned layout of ``store`` under ``book`` to ``out`` (atomically).

    Args:
        store: The graph.
        book: Its partition (``book.num_nodes`` must equal the store's node count).
        out: Directory to create.
        overwrite: Replace an existing directory (default: False).
        quality: Report to record in the manifest (default: None).
        chunk_edges: Edges read per chunk (default: 1M); bounds the writer's memory with O(N) scratch.
        progress: Show a progress bar over parts (default: False).
    """
    out = Path(out)
    if book.num_nodes != store.num_nodes:
        raise TrellisUserError(f"the partition has {book.num_nodes} nodes but {store.path} has {store.num_nodes}")
    with partition_dir(out, overwrite=overwrite) as tmp:
        w = _ArrayWriter(tmp)
        w.files += book.write_into(tmp)[:1]  # node_parts.npy is hashed; book.json is described below
        builder = _LayoutBuilder(store, book, w, chunk_edges)
        parts_info = []
        for p in tqdm(range(book.num_parts), desc="layout", unit="part", disable=not progress or None,
                      leave=False):
            parts_info.append(builder.write_part(p))
        for p in range(book.num_parts):
            builder.write_mirrors(p)
        builder.write_buckets()
        LAYOUT.write(tmp, {
            "num_nodes": store.num_nodes, "num_edges": store.num_edges, "num_parts": book.num_parts,
            "method": book.method, "ownership": book.ownership,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "store": {"path": str(Path(store.path).resolve()), "name": store.name, "checksum": store.checksum},
            "num_features": store.num_features,
            "has_edge_weight": store.edge_weight is not None, "has_edge_feat": store.edge_feat is not None,
            "parts": parts_info,
            "quality": None if quality is None else quality.to_dict(),
            "arrays": w.manifest_arrays(),
        })
    return out


# ---- reading -----------------------------------------------------------------------------------


@dataclass
class LocalGraph:
    """One partition as training code sees it: a local CSR over local ids plus the map to global ids.

    Local ids ``[0, num_local)`` are the part's own nodes (ascending global id), ``[num_local,
    num_local + num_halo)`` its halo nodes, whose values an exchange must supply from ``halo_owner``.
    Arrays are read-only memory maps.

    Attributes:
        part: Part index.
        ownership: Edge ownership of the layout (see :data:`trellis.partition.base.OWNERSHIPS`).
        num_local: Nodes the part owns.
        local_to_global: ``int64 [L+H]``.
        halo_owner: ``int32 [H]`` owner part of each halo node.
        indptr / indices / edge_ids: Local in-edge CSR (rows = destination local id) and global edge ids.
        in_degree / out_degree: Global degrees of every local and halo node (normalisations need them).
        mirror_indptr / mirror_parts: For each local node, the parts that hold it as a halo node.
        edge_weight / edge_feat: Edge data in local edge order, when the store has it.
        x / y: Node features and labels of the local nodes, when the store has them.
        splits: ``{"train"|"val"|"test": local ids}`` of the split nodes this part owns.
        rev: ``(rev_indptr, rev_indices, rev_edge_ids)`` under ``reverse`` ownership, else None.
        rev_edge_weight / rev_edge_feat: Edge data of the reversed copies, when present.
    """

    part: int
    ownership: str
    num_local: int
    local_to_global: np.ndarray
    halo_owner: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray
    edge_ids: np.ndarray
    in_degree: np.ndarray
    out_degree: np.ndarray
    mirror_indptr: np.ndarray
    mirror_parts: np.ndarray
    edge_weight: np.ndarray | None = None
    edge_feat: np.ndarray | None = None
    x: np.ndarray | None = None
    y: np.ndarray | None = None
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    rev: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    rev_edge_weight: np.ndarray | None = None
    rev_edge_feat: np.ndarray | None = None

    @property
    def num_halo(self) -> int:
        """Halo nodes ``H``: sources of the part's edges owned by other parts."""
        return int(self.halo_owner.shape[0])

    @property
    def num_nodes(self) -> int:
        """Local plus halo nodes (the number of rows of the local CSR)."""
        return int(self.local_to_global.shape[0])

    @property
    def num_edges(self) -> int:
        """Edges of the forward local CSR."""
        return int(self.indices.shape[0])

    @property
    def halo_nodes(self) -> np.ndarray:
        """Global ids of the halo nodes."""
        return self.local_to_global[self.num_local:]

    def global_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """``(src, dst)`` global ids of the forward edges this part stores, in local edge order."""
        dst_local = np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.indptr))
        return self.local_to_global[self.indices], self.local_to_global[dst_local]

    def pull_csr(self) -> PullCSR:
        """The part as the graph engine runs it: every in-edge of its own rows, over local + halo sources.

        Why: a pull engine computes each owned node's output from its in-edges' sources, some of which are
        halo rows an exchange supplies; with that CSR and global degrees, a layer's output on the owned rows
        equals the whole graph's. :meth:`trellis.ops.graph.CSRGraph.from_partition` wraps the result (the
        partition layer sits below ``ops`` and does not import it).

        Row and column order: destinations are the ``L`` owned rows (local ids ``[0, L)``, ascending global
        id); sources are all ``L + H`` local ids, owned rows first in the same order, then the halo rows in
        the layout's order (ascending global id). Destination ``i`` is therefore source row ``i``, which GCN's
        self term and SAGE's root term (``x[:num_dst]``) rely on. Degrees are the layout's *global*
        in-degrees, so GCN's normalization matches the whole graph's; every in-edge of an owned row is held,
        so the local in-degree (SAGE's mean, GAT's softmax) equals the global one too.

        Supported ownerships: ``dst`` (the stored CSR's first ``L`` rows, edges in stored order) and
        ``reverse`` (its reversed in-edge copy ``rev_*`` transposed back; within a row, edges are ordered by
        source local id, and halo rows that only the out-edges need are present but unused).

        Raises:
            TrellisUserError: For ``src`` and ``vertex-cut`` ownership, where a part does not hold every
                in-edge of its rows (those need a push or mirror-reduce engine, not a pull graph).
        """
        num_local = self.num_local
        if self.ownership == "dst":
            indptr = np.asarray(self.indptr[: num_local + 1])
            if int(indptr[-1]) != self.num_edges:
                raise TrellisUserError(f"part {self.part}: halo rows hold edges, so this is not a destination-"
                                       "owned layout; re-run `trellis partition`")
            return PullCSR(indptr, np.asarray(self.indices), self.local_to_global, np.asarray(self.in_degree),
                           np.asarray(self.edge_ids), self.edge_weight, self.edge_feat, num_local)
        if self.ownership == "reverse":
            if self.rev is None:
                raise TrellisUserError(f"part {self.part}: a reverse-owned layout without rev_* arrays; re-run "
                                       "`trellis partition`")
            # cols: the owned destination of each reversed edge
            rev_indptr, cols, rev_eids = (np.asarray(a) for a in self.rev)
            if cols.size and int(cols.max()) >= num_local:
                raise TrellisUserError(f"part {self.part}: reversed edges point at halo rows; re-run "
                                       "`trellis partition`")
            # rev rows are sources: transposing them back (a stable sort) orders a row's edges by source id
            indptr, src, order = build_reverse_csr(rev_indptr, cols, num_local)
            ew, ef = self.rev_edge_weight, self.rev_edge_feat
            return PullCSR(indptr, src, self.local_to_global, np.asarray(self.in_degree), rev_eids[order],
                           None if ew is None else np.asarray(ew)[order],
                           None if ef is None else np.asarray(ef)[order], num_local)
        raise TrellisUserError(
            f"part {self.part}: ownership {self.ownership!r} splits a node's in-edges across parts, so a part "
            "has no pull graph (it needs a push or mirror-reduce exchange); partition with a destination-owned "
            f"method ({', '.join(methods_of_ownership('dst'))}) or reverse")


@dataclass
class PullCSR:
    """A part's pull graph in the graph engine's convention, as numpy arrays (see :meth:`LocalGraph.pull_csr`).

    Attributes:
        indptr: ``int64 [L + 1]`` in-edge CSR of the owned rows.
        indices: ``int64 [M]`` source local id of each edge, in ``[0, L + H)``.
        node_ids: ``int64 [L + H]`` global id of every source row (owned rows first, then halo rows).
        in_degree: ``[L + H]`` global in-degree of every source row; its first ``L`` entries are the
            destinations' (the engine's ``src_degree`` and ``dst_degree``).
        edge_ids: ``int64 [M]`` global edge id (into the store's CSR) of each local edge.
        edge_weight / edge_feat: Edge data in local edge order, when the store has it.
        num_local: ``L``, the number of destination rows.
    """

    indptr: np.ndarray
    indices: np.ndarray
    node_ids: np.ndarray
    in_degree: np.ndarray
    edge_ids: np.ndarray
    edge_weight: np.ndarray | None
    edge_feat: np.ndarray | None
    num_local: int

    @property
    def num_src(self) -> int:
        """Number of source rows (owned plus halo)."""
        return int(self.node_ids.shape[0])


@dataclass
class EdgeBucket:
    """Edges from part ``src_part`` to part ``dst_part`` (global ids), read as one sequential slice."""

    src_part: int
    dst_part: int
    src: np.ndarray
    dst: np.ndarray
    edge_ids: np.ndarray
    edge_weight: np.ndarray | None = None
    edge_feat: np.ndarray | None = None

    @property
    def num_edges(self) -> int:
        """Edges in the bucket."""
        return int(self.src.shape[0])


def layout_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What names a layout's partition: its method, part count and its node-to-part map's checksum.

    Read from the manifest: nothing is hashed here. ``{}`` when ``path`` holds no readable layout (its reader
    says why).
    """
    try:
        m = LAYOUT.read(Path(path))
    except (OSError, ValueError, TrellisUserError):
        return {}
    return {"method": m.get("method"), "num_parts": m.get("num_parts"),
            "node_parts": m.get("arrays", {}).get("node_parts.npy", {}).get("sha256")}


class PartitionedGraph:
    """Read access to a layout directory written by :func:`write_layout` / ``trellis partition``.

    Args:
        path: The layout directory.
        verify: Check every array's sha256 against the manifest: True, False, or ``"auto"`` (only when
            the arrays sum to less than 512 MiB; shapes and dtypes are always checked) (default: auto).
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool | str = "auto") -> None:
        self.path = Path(path)
        self.manifest: dict[str, Any] = LAYOUT.read(self.path)
        total = 0
        for rel, meta in self.manifest["arrays"].items():
            fpath = self.path / rel
            if not fpath.is_file():
                raise TrellisUserError(f"{fpath}: listed in the manifest but missing; re-run `trellis partition`")
            try:
                arr = np.load(fpath, mmap_mode="r")
            except (ValueError, OSError) as exc:  # a truncated file: its header promises more than it holds
                raise TrellisUserError(f"{fpath}: unreadable ({exc}); the layout is damaged, re-run "
                                       "`trellis partition`") from exc
            if str(arr.dtype) != meta["dtype"] or list(arr.shape) != meta["shape"]:
                raise TrellisUserError(f"{fpath}: dtype/shape do not match the manifest; re-run `trellis partition`")
            total += fpath.stat().st_size
        if verify == "auto":
            verify = total <= AUTO_VERIFY_BYTES
        if verify:
            self.verify()
        self.book = PartitionBook.load(self.path, mmap=True)
        self._offsets: np.ndarray | None = None

    def verify(self) -> None:
        """Hash every array and compare with the manifest."""
        for rel, meta in self.manifest["arrays"].items():
            if sha256_file(self.path / rel) != meta["sha256"]:
                raise TrellisUserError(f"{self.path / rel}: sha256 does not match the manifest (modified or "
                                       "damaged); re-run `trellis partition`")

    num_parts = ManifestField(int, "num_parts", doc="Number of parts ``P``.")
    num_nodes = ManifestField(int, "num_nodes", doc="Nodes of the whole graph.")
    num_edges = ManifestField(int, "num_edges", doc="Edges of the whole graph.")
    ownership = ManifestField(
        str, "ownership", doc="Edge ownership of the layout (see :data:`trellis.partition.base.OWNERSHIPS`).")

    @property
    def quality(self) -> dict[str, Any] | None:
        """The quality report recorded when the layout was written (None when none was)."""
        return self.manifest.get("quality")

    def _arr(self, rel: str) -> np.ndarray | None:
        return np.load(self.path / rel, mmap_mode="r") if rel in self.manifest["arrays"] else None

    def _need(self, rel: str) -> np.ndarray:
        a = self._arr(rel)
        if a is None:
            raise TrellisUserError(f"{self.path}: layout lacks {rel}; re-run `trellis partition`")
        return a

    def part(self, part: int) -> LocalGraph:
        """The local graph (with halo) of partition ``part``."""
        if not 0 <= part < self.num_parts:
            raise IndexError(f"part {part} outside [0, {self.num_parts})")
        d = part_dir_name(part)
        info = self.manifest["parts"][part]
        splits = {s: a for s in SPLITS if (a := self._arr(f"{d}/{s}_idx.npy")) is not None}
        rev = None
        if self.ownership == "reverse":
            rev = (self._need(f"{d}/rev_indptr.npy"), self._need(f"{d}/rev_indices.npy"),
                   self._need(f"{d}/rev_edge_ids.npy"))
        return LocalGraph(
            part=part, ownership=self.ownership, num_local=int(info["num_local"]),
            local_to_global=self._need(f"{d}/local_to_global.npy"), halo_owner=self._need(f"{d}/halo_owner.npy"),
            indptr=self._need(f"{d}/indptr.npy"), indices=self._need(f"{d}/indices.npy"),
            edge_ids=self._need(f"{d}/edge_ids.npy"), in_degree=self._need(f"{d}/in_degree.npy"),
            out_degree=self._need(f"{d}/out_degree.npy"), mirror_indptr=self._need(f"{d}/mirror_indptr.npy"),
            mirror_parts=self._need(f"{d}/mirror_parts.npy"), edge_weight=self._arr(f"{d}/edge_weight.npy"),
            edge_feat=self._arr(f"{d}/edge_feat.npy"), x=self._arr(f"{d}/x.npy"), y=self._arr(f"{d}/y.npy"),
            splits=splits, rev=rev, rev_edge_weight=self._arr(f"{d}/rev_edge_weight.npy"),
            rev_edge_feat=self._arr(f"{d}/rev_edge_feat.npy"),
        )

    @property
    def bucket_offsets(self) -> np.ndarray:
        """``int64 [P*P+1]``: bucket ``(i, j)`` is rows ``offsets[i*P+j] : offsets[i*P+j+1]``."""
        if self._offsets is None:
            self._offsets = np.asarray(self._need("buckets/offsets.npy"))
        return self._offsets

    def bucket(self, i: int, j: int) -> EdgeBucket:
        """Edges from part ``i`` to part ``j`` (one contiguous slice of the bucket files)."""
        num_parts = self.num_parts
        if not (0 <= i < num_parts and 0 <= j < num_parts):
            raise IndexError(f"bucket ({i}, {j}) outside [0, {num_parts})^2")
        a, b = (int(x) for x in self.bucket_offsets[i * num_parts + j:i * num_parts + j + 2])
        edges = self._need("buckets/edges.npy")[a:b]
        ew = self._arr("buckets/edge_weight.npy")
        ef = self._arr("buckets/edge_feat.npy")
        return EdgeBucket(i, j, edges[:, 0], edges[:, 1], self._need("buckets/edge_ids.npy")[a:b],
                          None if ew is None else ew[a:b], None if ef is None else ef[a:b])

    def iter_buckets(self, parts: Sequence[int] | None = None) -> Iterator[EdgeBucket]:
        """Buckets ``(i, j)`` with ``i`` and ``j`` in ``parts`` (default: all), in file order."""
        chosen = sorted(set(range(self.num_parts) if parts is None else (int(p) for p in parts)))
        for i in chosen:
            for j in chosen:
                yield self.bucket(i, j)

    def edges_among(self, parts: Sequence[int]) -> EdgeBucket:
        """All edges whose endpoints both lie in ``parts``, concatenated (``src_part = dst_part = -1``)."""
        bs = list(self.iter_buckets(parts))
        ew = [b.edge_weight for b in bs if b.edge_weight is not None]
        ef = [b.edge_feat for b in bs if b.edge_feat is not None]
        return EdgeBucket(-1, -1, np.concatenate([b.src for b in bs]) if bs else np.empty(0, np.int64),
                          np.concatenate([b.dst for b in bs]) if bs else np.empty(0, np.int64),
                          np.concatenate([b.edge_ids for b in bs]) if bs else np.empty(0, np.int64),
                          np.concatenate(ew) if bs and len(ew) == len(bs) else None,
                          np.concatenate(ef) if bs and len(ef) == len(bs) else None)


def open_partitioned(path: str | os.PathLike[str], verify: bool | str = "auto") -> PartitionedGraph:
    """Open a layout directory (see :class:`PartitionedGraph`)."""
    return PartitionedGraph(path, verify=verify)


def open_layout_of(path: str | os.PathLike[str], store: GraphStore) -> PartitionedGraph:
    """Open the layout ``--parts-dir PATH`` and refuse one made from another store than ``store``.

    Args:
        path: The layout directory.
        store: The store the run trains on.

    Raises:
        TrellisUserError: The layout is missing or damaged, or its recorded store checksum differs (the message
            names the store it was made from, and the command that partitions this one into a new directory).
    """
    try:
        layout = PartitionedGraph(path)
    except TrellisUserError as exc:
        hint = (f"; {path} is a store: partition it with `trellis partition {path} --out PART_DIR` and pass PART_DIR"
                if format_of(Path(path) / MANIFEST) == "trellis-store" else "")
        raise TrellisUserError(f"--parts-dir {path}: {exc}{hint}") from None
    made = layout.manifest.get("store", {})
    if made.get("checksum") != store.checksum:
        raise TrellisUserError(f"--parts-dir {path}: the layout was made from another store ({made.get('path', '?')}, "
                               f"checksum {str(made.get('checksum'))[:12]}…; {store.path} has "
                               f"{str(store.checksum)[:12]}…); train on that store, or partition this one: "
                               f"`trellis partition {store.path} --parts {layout.num_parts} --out NEW_PART_DIR`")
    return layout


def load_partition_book(path: str | os.PathLike[str]) -> PartitionBook:
    """Load the :class:`PartitionBook` of a layout (or of a directory written by ``PartitionBook.save``)."""
    return PartitionBook.load(path)


__all__ = ["EdgeBucket", "LocalGraph", "PullCSR", "PartitionedGraph", "write_layout", "open_partitioned",
           "open_layout_of",
           "load_partition_book", "BOOK_FILE", "NODE_PARTS_FILE"]
