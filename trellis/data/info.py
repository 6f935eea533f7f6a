"""Describe a store: counts, task, splits, degree statistics, graph hygiene and sizes.

Everything is computed from the memory-mapped arrays in blocks of rows, so ``trellis data info`` runs in
O(N + chunk) memory on stores larger than RAM.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from trellis.data.csr import DEFAULT_CHUNK_EDGES, _sorted_order
from trellis.data.store import AUTO_VERIFY_BYTES, SPLITS, GraphStore, open_store
from trellis.utils.csr import row_segments
from trellis.utils.sizes import format_size


def _degree_stats(deg: np.ndarray) -> dict[str, float]:
    if deg.size == 0:
        return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
    return {"min": int(deg.min()), "mean": float(deg.mean()), "median": float(np.median(deg)), "max": int(deg.max())}


def _edge_scan(store: GraphStore, chunk_edges: int) -> dict[str, Any]:
    """Self loops, duplicate edges, sorted rows and symmetry, one block of rows at a time."""
    indptr = np.asarray(store.indptr)
    indices = store.indices
    rev_indptr, rev_indices, _ = store.reverse_csr()
    n = store.num_nodes
    self_loops = duplicates = 0
    sorted_rows = True
    symmetric = bool(np.array_equal(indptr, np.asarray(rev_indptr)))
    for r0, r1, p0, seg, rows in row_segments(indptr, indices, chunk_edges):
        p1 = p0 + seg.shape[0]
        self_loops += int(np.count_nonzero(seg == rows + r0))
        if sorted_rows:
            same_row = rows[1:] == rows[:-1]
            sorted_rows = bool(np.all(seg[1:][same_row] >= seg[:-1][same_row]))
        order = _sorted_order(rows, seg, r1 - r0, n, dedup=False)
        s_rows, s_seg = rows[order], seg[order]
        dup = (s_rows[1:] == s_rows[:-1]) & (s_seg[1:] == s_seg[:-1])
        duplicates += int(np.count_nonzero(dup))
        if symmetric:  # same multiset per row in the forward and reverse CSR (reverse rows are sorted)
            symmetric = bool(np.array_equal(s_seg, np.asarray(rev_indices[p0:p1])))
    return {"self_loops": self_loops, "duplicate_edges": duplicates, "sorted_rows": sorted_rows,
            "symmetric": symmetric}


def store_info(store: GraphStore | str | os.PathLike[str], *, verify: bool = False,
               chunk_edges: int = DEFAULT_CHUNK_EDGES) -> dict[str, Any]:
    """Summarize a store as a JSON-ready dict.

    Args:
        store: An open :class:`GraphStore` or a store path.
        verify: Hash every array against the manifest first (default: False; small stores are hashed
            on open anyway).
        chunk_edges: Edges per block when scanning.

    Returns:
        ``name, path, num_nodes, num_edges, num_features, num_classes, task, splits, edge_weight,
        edge_feat_dim, in_degree, out_degree, isolated_nodes, self_loops, duplicate_edges, sorted_rows,
        symmetric, disk_bytes, memory_bytes, arrays, verified, source``.
    """
    if not isinstance(store, GraphStore):
        store = open_store(store, verify=True if verify else "auto")
        verified = verify or store.nbytes() <= AUTO_VERIFY_BYTES  # "auto" hashes small stores on open
    else:
        if verify:
            store.verify()
        verified = verify
    indptr = np.asarray(store.indptr)
    in_deg = np.diff(indptr)
    out_deg = np.diff(np.asarray(store.reverse_csr()[0]))
    arrays = store.manifest["arrays"]
    memory = {name: int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
              for name, meta in arrays.items()}
    y = store.y
    labelled = None
    if y is not None and y.ndim == 1:
        labelled = int(np.count_nonzero(np.asarray(y) >= 0))
    ef = store.edge_feat
    info: dict[str, Any] = {
        "name": store.name,
        "path": str(store.path),
        "num_nodes": store.num_nodes,
        "num_edges": store.num_edges,
        "num_features": store.num_features,
        "num_classes": store.num_classes,
        "task": store.task,
        "labelled_nodes": labelled,
        "splits": {k: (None if (ids := store.split(k)) is None else int(ids.shape[0])) for k in SPLITS},
        "fixed_splits": None if (sets := store.split_sets) is None else int(sets.shape[0]),
        "edge_weight": store.has("edge_weight"),
        "edge_feat_dim": None if ef is None else int(ef.shape[1]),
        "in_degree": _degree_stats(in_deg),
        "out_degree": _degree_stats(out_deg),
        "isolated_nodes": int(np.count_nonzero((in_deg == 0) & (out_deg == 0))),
        **_edge_scan(store, chunk_edges),
        "disk_bytes": store.nbytes(),
        "moved": {k: m["moved_to"] for k, m in sorted(arrays.items()) if m.get("moved_to")},
        "memory_bytes": int(sum(memory.values())),
        "arrays": {k: {"dtype": arrays[k]["dtype"], "shape": arrays[k]["shape"], "bytes": memory[k]}
                   for k in sorted(arrays)},
        "verified": bool(verified),
        "checksum": store.checksum,
        "source": store.manifest.get("source", {}),
    }
    return info


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (one decimal: the store summary's style)."""
    return format_size(n, digits=1)


def format_info(info: dict[str, Any]) -> str:
    """Render :func:`store_info`'s dict as an aligned, human-readable table."""
    def deg(d: dict[str, float]) -> str:
        return f"min {d['min']}  mean {d['mean']:.2f}  median {d['median']:g}  max {d['max']}"

    n = info["num_nodes"]
    splits = "  ".join(f"{k} {v}" for k, v in info["splits"].items() if v is not None) or "none"
    if info.get("fixed_splits"):
        splits += f"  (split 0 of {info['fixed_splits']} fixed splits: --split-seed K trains on split K)"
    edge_data = []
    if info["edge_weight"]:
        edge_data.append("weights")
    if info["edge_feat_dim"]:
        edge_data.append(f"features ({info['edge_feat_dim']})")
    rows = [
        ("store", info["path"]),
        ("name", info["name"]),
        ("nodes", f"{n:,}" + (f" (renumbered from the imported {dropped + n:,}: node_ids.npy maps them back)"
                              if "node_ids" in info["arrays"] and (dropped := info["source"].get("lcc_nodes_dropped"))
                              else "")),
        ("edges", f"{info['num_edges']:,} (directed; {'symmetric' if info['symmetric'] else 'not symmetric'})"),
        ("features", str(info["num_features"])),
        ("classes", f"{info['num_classes']} ({info['task']})" if info["task"] else "none"),
        ("labelled", "-" if info["labelled_nodes"] is None else f"{info['labelled_nodes']:,}"),
        ("splits", splits),
        ("edge data", ", ".join(edge_data) or "none"),
        ("in-degree", deg(info["in_degree"])),
        ("out-degree", deg(info["out_degree"])),
        ("isolated nodes", f"{info['isolated_nodes']:,}"),
        ("self loops", f"{info['self_loops']:,}"),
        ("duplicate edges", f"{info['duplicate_edges']:,}"),
        ("on disk", human_bytes(info["disk_bytes"])
         + "".join(f"; {k} moved to {where}" for k, where in info.get("moved", {}).items())),
        ("in memory", f"{human_bytes(info['memory_bytes'])} (all arrays loaded)"),
        ("verified", "sha256 ok" if info["verified"] else "not checked (use --verify)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
