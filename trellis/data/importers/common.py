"""What every importer shares.

Input checks that name the file, the largest connected component, and :func:`write_graph`, which turns
a :class:`GraphInput` into a store in memory or in bounded memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.csr import (
    DEFAULT_CHUNK_EDGES,
    EdgeCSR,
    EdgeSource,
    as_node_ids,
    build_csr_chunked,
    check_finite,
    edges_to_csr,
    read_all_edges,
)
from trellis.data.store import SPLIT_CODES, SPLITS, label_meta, split_set_ids, store_writer, write_store
from trellis.errors import TrellisUserError

#: Edge files larger than this are imported with the bounded-memory chunked builder (``streaming=None``).
STREAMING_BYTES = 512 * 1024 * 1024
_COPY_ROWS = 262_144


@dataclass
class GraphInput:
    """A graph as an importer read it, before cleaning (symmetrize, dedup, LCC) and writing.

    Attributes:
        edges: The edge list (streamed; read once in memory mode, twice in streaming mode).
        num_nodes: Node count, or None for largest id + 1.
        x: ``[N, F]`` features (may be a memory map).
        y: ``int [N]`` labels (-1 = unlabelled) or ``[N, C]`` multilabel 0/1.
        splits: ``{"train"|"val"|"test": node ids}``.
        split_sets: ``int8 [S, N]`` fixed splits (``store.SPLIT_CODES``); the store's split is ``splits``
            where given (one of them), else the first.
        edge_weight: ``[E_in]`` per input edge.
        edge_feat: ``[E_in, D]`` per input edge.
        name: Dataset name for the manifest.
        source: Provenance for the manifest.
        where: File named in messages about splits and edge data (``{"train": "…/train.npy",
            "edge_weight": "…/edge_weights.npy"}``).
    """

    edges: EdgeSource
    num_nodes: int | None = None
    x: np.ndarray | None = None
    y: np.ndarray | None = None
    splits: dict[str, np.ndarray] | None = None
    split_sets: np.ndarray | None = None
    edge_weight: np.ndarray | None = None
    edge_feat: np.ndarray | None = None
    name: str = "graph"
    source: dict[str, Any] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)


# ---- checks that name the file ------------------------------------------------------------------
def check_features(x: np.ndarray, num_nodes: int | None, where: str) -> np.ndarray:
    """Check ``[N, F]`` numeric features with the right row count and no NaN/Inf."""
    if x.ndim != 2:
        raise TrellisUserError(f"{where}: features must be a 2-D array [nodes, features] but have shape "
                               f"{tuple(x.shape)}; reshape to [N, F]")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
        raise TrellisUserError(f"{where}: features have dtype {x.dtype}; save them as float32")
    if num_nodes is not None and x.shape[0] != num_nodes:
        raise TrellisUserError(f"{where}: features have {x.shape[0]} rows but the graph has {num_nodes} nodes; "
                               "give one feature row per node (row i = node i)")
    check_finite(x, f"{where}: features", chunk_rows=_COPY_ROWS)
    return x


def check_multilabel(y: np.ndarray, where: str) -> np.ndarray:
    """Check an ``[N, C]`` label matrix: 0/1 entries; a row entirely -1 (or NaN) is an unlabelled node.

    Returns float32 with unlabelled rows set to -1 (the store's marker; NaN is refused there). A row
    that mixes -1/NaN with 0/1 is refused: a missing label for one class has no meaning in the loss.
    """
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
        raise TrellisUserError(f"{where}: multilabel labels have dtype {y.dtype}; give a numeric 0/1 matrix [N, C]")
    yf = y.astype(np.float32)
    unlabelled = (np.isnan(yf) | (yf == -1)).all(axis=1)
    bad = ~(((yf == 0) | (yf == 1)).all(axis=1) | unlabelled)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        vals = yf[row][(yf[row] != 0) & (yf[row] != 1)]
        raise TrellisUserError(f"{where}: multilabel row {row} has the value {vals[0].item():g}; labels must be a "
                               "0/1 matrix [N, C] (a row of -1 marks an unlabelled node)")
    yf[unlabelled] = -1
    return yf


#: Class ids beyond both this and twice the node count are refused as a stray id (see :func:`check_labels`).
MAX_SPARSE_CLASSES = 100_000


def check_labels(y: np.ndarray, num_nodes: int | None, where: str) -> np.ndarray:
    """Check labels: ``int [N]`` classes (-1 = unlabelled; integral floats accepted) or ``[N, C]`` 0/1.

    An ``[N, C]`` matrix goes through :func:`check_multilabel`; ``[N, 1]`` is a vector.
    """
    y = np.asarray(y)
    if num_nodes is not None and y.shape[0] != num_nodes:
        raise TrellisUserError(f"{where}: labels have {y.shape[0]} rows but the graph has {num_nodes} nodes; "
                               "give one label per node (-1 for unlabelled)")
    if y.ndim == 2:
        if y.shape[1] == 1:
            y = y[:, 0]
        else:
            return check_multilabel(y, where)
    if y.ndim != 1:
        raise TrellisUserError(f"{where}: labels must be [N] class ids or [N, C] 0/1 but have shape {y.shape}")
    if y.dtype == np.bool_:
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        bad = np.flatnonzero(np.isfinite(y) & (y != np.round(y)))
        if bad.size:
            raise TrellisUserError(f"{where}: label row {int(bad[0])} is {y[bad[0]].item()!r}, not a class id; "
                                   "labels must be integers (-1 = unlabelled)")
        if np.isinf(y).any():
            row = int(np.flatnonzero(np.isinf(y))[0])
            raise TrellisUserError(f"{where}: label row {row} is Inf; labels must be integers (-1 = unlabelled)")
        y = np.where(np.isnan(y), -1, y)
    elif not np.issubdtype(y.dtype, np.integer):
        raise TrellisUserError(f"{where}: labels have dtype {y.dtype}; give integer class ids")
    y = y.astype(np.int64)
    bad = np.flatnonzero(y < -1)
    if bad.size:
        raise TrellisUserError(f"{where}: label row {int(bad[0])} is {int(y[bad[0]])}; class ids must be >= 0 "
                               "(-1 = unlabelled)")
    if y.size:
        top = int(y.max())
        # the classes are 0..max: a stray huge id (1e9) made a model of a billion outputs that training could not
        # allocate (64 GB); ids are 0..C-1, and a graph has no use for more classes than its nodes
        if top >= max(MAX_SPARSE_CLASSES, 2 * y.shape[0]):
            row = int(np.argmax(y))
            raise TrellisUserError(f"{where}: label row {row} is class {top}, so the store would have {top + 1:,} "
                                   f"classes for {y.shape[0]:,} nodes; number the classes 0..C-1")
    return y


def check_split(ids: np.ndarray, num_nodes: int | None, where: str) -> np.ndarray:
    """Split ids as int64: a boolean mask of length N or integer node ids in ``[0, N)``."""
    ids = np.asarray(ids)
    if ids.dtype == np.bool_:
        if ids.ndim != 1:  # flat positions of an [N, k] mask are not node ids
            raise TrellisUserError(f"{where}: split mask has shape {list(ids.shape)}; give one split's mask, one "
                                   "entry per node (e.g. the column mask[:, 0] of a multi-split mask)")
        if num_nodes is not None and ids.shape[0] != num_nodes:
            raise TrellisUserError(f"{where}: split mask has {ids.shape[0]} entries but the graph has {num_nodes} "
                                   "nodes; give one entry per node or a list of node ids")
        return np.flatnonzero(ids).astype(np.int64)
    if ids.ndim != 1:
        ids = ids.reshape(-1)
    out = as_node_ids(ids, where, num_nodes)
    uniq, counts = np.unique(out, return_counts=True)
    if uniq.shape[0] != out.shape[0]:  # a node counted several times in the loss (or a 0/1 mask read as ids)
        node = int(uniq[np.argmax(counts)])
        mask = out.shape[0] > 2 and uniq.shape[0] <= 2 and set(uniq.tolist()) <= {0, 1}
        raise TrellisUserError(
            f"{where}: node {node} appears {int(counts.max())} times in the split"
            + ("; it looks like a 0/1 mask (older PyG and DGL save them as uint8): save it as bool, or give the "
               "node ids" if mask else "; give each node once"))
    return out


def split_sets_from_masks(masks: dict[str, np.ndarray], num_nodes: int, names: dict[str, str],
                          where: str = "") -> np.ndarray:
    """``int8 [S, N]`` fixed splits (``store.SPLIT_CODES``) from each split's boolean masks ``[S, N]``.

    A split given once (``[N]`` or ``[1, N]``) is the same in every set: WikiCS, for one, has 20 train and
    validation masks beside one test mask. Messages name split ``k``'s array ``names[k]``, after ``where`` (a
    file's ``"PATH: "``).

    Raises:
        TrellisUserError: A mask of another width, splits with different set counts, or a node in two splits
            of one set.
    """
    rows = {}
    for k, m in masks.items():
        m = np.asarray(m)
        m = m[None, :] if m.ndim == 1 else m
        if m.ndim != 2 or m.shape[1] != num_nodes:
            raise TrellisUserError(f"{where}{names[k]} has shape {tuple(np.shape(masks[k]))}; it must be "
                                   f"[splits, {num_nodes}] (one boolean per node)")
        rows[k] = m.astype(bool)
    counts = {m.shape[0] for m in rows.values()} - {1}
    if len(counts) > 1:
        raise TrellisUserError(f"{where}{', '.join(names[k] for k in rows)} hold different numbers of splits "
                               f"({', '.join(str(m.shape[0]) for m in rows.values())}); give one mask per split "
                               "each (or one mask that every split shares)")
    sets = np.zeros((counts.pop() if counts else 1, num_nodes), dtype=np.int8)
    for k, m in rows.items():
        both = m & (sets != 0)
        if both.any():
            s, node = (int(v[0]) for v in np.nonzero(both))
            raise TrellisUserError(f"{where}{names[k]}: node {node} is in split {s}'s {k} mask and in another of its "
                                   "masks; a node belongs to one of train, val and test per split")
        sets[np.broadcast_to(m, sets.shape)] = SPLIT_CODES[k]
    return sets


# ---- largest connected component -----------------------------------------------------------------
def largest_component(csr: EdgeCSR) -> np.ndarray:
    """Sorted node ids of the largest weakly connected component (the lowest-labelled one on a tie)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    n = csr.num_nodes
    adj = csr_matrix((np.ones(csr.num_edges, dtype=np.int8), csr.indices, csr.indptr), shape=(n, n))
    _, labels = connected_components(adj, directed=True, connection="weak")
    big = int(np.argmax(np.bincount(labels)))
    return np.flatnonzero(labels == big).astype(np.int64)


def restrict(csr: EdgeCSR, keep: np.ndarray) -> EdgeCSR:
    """The subgraph on ``keep`` (sorted ids, closed under edges, e.g. a component), renumbered 0..k-1.

    Row order and each row's neighbor order are preserved, and edge data follows its edges.
    """
    n = csr.num_nodes
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[keep] = np.arange(keep.size, dtype=np.int64)
    edge_mask = np.repeat(new_id >= 0, np.diff(csr.indptr))
    indices = new_id[csr.indices[edge_mask]]
    if (indices < 0).any():
        raise ValueError("restrict: kept nodes have edges leaving the kept set")
    deg = np.diff(csr.indptr)[keep]
    indptr = np.zeros(keep.size + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    return EdgeCSR(
        indptr=indptr,
        indices=indices,
        num_nodes=int(keep.size),
        edge_ids=csr.edge_ids[edge_mask],
        edge_weight=None if csr.edge_weight is None else csr.edge_weight[edge_mask],
        edge_feat=None if csr.edge_feat is None else csr.edge_feat[edge_mask],
    )


def _remap_splits(splits: dict[str, np.ndarray], keep: np.ndarray, n: int) -> dict[str, np.ndarray]:
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[keep] = np.arange(keep.size, dtype=np.int64)
    out = {}
    for k, ids in splits.items():
        mapped = new_id[ids]
        out[k] = mapped[mapped >= 0]
    return out


# ---- writing ------------------------------------------------------------------------------------
def _resolve_streaming(edges: EdgeSource, streaming: bool | None) -> bool:
    if streaming is not None:
        return bool(streaming)
    nbytes = getattr(edges, "nbytes", None)
    return nbytes is not None and nbytes > STREAMING_BYTES


def write_graph(
    inp: GraphInput,
    out: str | os.PathLike[str],
    *,
    symmetrize: bool = True,
    dedup: bool = True,
    remove_self_loops: bool = True,
    lcc: bool = False,
    make_splits: Callable[[np.ndarray | None, int], dict[str, np.ndarray] | None] | None = None,
    allow_empty: bool = False,
    overwrite: bool = False,
    streaming: bool | None = None,
    chunk_edges: int = DEFAULT_CHUNK_EDGES,
    progress: bool = True,
) -> Path:
    """Clean ``inp`` (self loops, symmetrize, dedup, LCC), add splits and write the store atomically.

    Args:
        inp: The graph as read.
        out: Store directory.
        symmetrize: Make the graph undirected (default: True).
        dedup: Drop repeated edges, keeping the first (default: True).
        remove_self_loops: Drop ``u -> u`` (default: True).
        lcc: Keep only the largest connected component, renumbered (default: False).
        make_splits: ``f(y, num_nodes) -> splits`` called after the LCC when ``inp.splits`` is None.
        allow_empty: Accept an edge list with no edges (default: False: that is an input error).
        overwrite: Replace an existing store (default: False).
        streaming: Use the bounded-memory chunked builder (default: when the edge file exceeds 512 MiB).
        chunk_edges: Edges per chunk in streaming mode.
        progress: Show progress bars on a terminal (default: True).

    Returns:
        The store path.
    """
    source = {**inp.source, "symmetrize": symmetrize, "dedup": dedup, "remove_self_loops": remove_self_loops,
              "lcc": lcc}
    if _resolve_streaming(inp.edges, streaming):
        if lcc:
            raise TrellisUserError("--lcc needs the graph in memory; import with --no-lcc or without --streaming")
        return _write_streaming(inp, out, symmetrize=symmetrize, dedup=dedup, remove_self_loops=remove_self_loops,
                                make_splits=make_splits, allow_empty=allow_empty, overwrite=overwrite,
                                chunk_edges=chunk_edges, progress=progress, source=source)

    src, dst = read_all_edges(inp.edges, inp.num_nodes)
    if src.size == 0 and not allow_empty:
        raise TrellisUserError(f"{inp.edges.name}: no edges found; the graph is empty (check the file)")
    csr = edges_to_csr(src, dst, inp.num_nodes, symmetrize=symmetrize, dedup=dedup,
                       remove_self_loops=remove_self_loops, edge_weight=inp.edge_weight, edge_feat=inp.edge_feat,
                       where=inp.edges.name, data_names=inp.where)
    del src, dst
    n = csr.num_nodes
    x = None if inp.x is None else np.asarray(inp.x)
    y = inp.y
    splits = {k: check_split(v, n, inp.where.get(k, f"{k} split")) for k, v in (inp.splits or {}).items()}
    sets = inp.split_sets
    node_ids = None
    if lcc:
        keep = largest_component(csr)
        source["lcc_nodes_dropped"] = int(n - keep.size)
        if keep.size < n:
            csr = restrict(csr, keep)
            x = None if x is None else x[keep]
            y = None if y is None else y[keep]
            sets = None if sets is None else sets[:, keep]
            splits = _remap_splits(splits, keep, n)
            n = csr.num_nodes
            node_ids = keep  # the imported data's id of each kept node: predictions map back through it
    if sets is not None and inp.splits is None:
        splits = split_set_ids(sets[0])
    elif inp.splits is None and make_splits is not None:
        splits = make_splits(y, n) or {}
    return write_store(out, indptr=csr.indptr, indices=csr.indices, x=x, y=y, splits=splits or None,
                       split_sets=sets, edge_weight=csr.edge_weight, edge_feat=csr.edge_feat, name=inp.name,
                       source=source, node_ids=node_ids, overwrite=overwrite)


def _write_streaming(inp: GraphInput, out: str | os.PathLike[str], *, symmetrize: bool, dedup: bool,
                     remove_self_loops: bool, make_splits: Callable[..., Any] | None, allow_empty: bool,
                     overwrite: bool, chunk_edges: int, progress: bool, source: dict[str, Any]) -> Path:
    with store_writer(out, overwrite=overwrite) as w:
        info = build_csr_chunked(inp.edges, w, num_nodes=inp.num_nodes, symmetrize=symmetrize, dedup=dedup,
                                 remove_self_loops=remove_self_loops, edge_weight=inp.edge_weight,
                                 edge_feat=inp.edge_feat, chunk_edges=chunk_edges, progress=progress,
                                 data_names=inp.where)
        if info.num_input_edges == 0 and not allow_empty:
            raise TrellisUserError(f"{inp.edges.name}: no edges found; the graph is empty (check the file)")
        n = info.num_nodes
        splits = {k: check_split(v, n, inp.where.get(k, f"{k} split")) for k, v in (inp.splits or {}).items()}
        if inp.split_sets is not None:
            splits = splits if inp.splits is not None else split_set_ids(inp.split_sets[0])
            w.add("split_sets", np.asarray(inp.split_sets, dtype=np.int8))
        elif inp.splits is None and make_splits is not None:
            splits = make_splits(inp.y, n) or {}
        if inp.x is not None:
            xo = w.create("x", tuple(inp.x.shape), np.float32)
            for r0 in range(0, inp.x.shape[0], _COPY_ROWS):
                xo[r0:r0 + _COPY_ROWS] = np.asarray(inp.x[r0:r0 + _COPY_ROWS], dtype=np.float32)
            xo.flush()
            del xo
        y = inp.y
        if y is not None:
            w.add("y", np.asarray(y, dtype=np.int64 if y.ndim == 1 else np.float32))
        for k in SPLITS:
            if k in splits:
                w.add(f"{k}_idx", np.asarray(splits[k], dtype=np.int64))
        task, num_classes = label_meta(y)
        return w.commit(num_nodes=n, num_edges=info.num_edges, name=inp.name, task=task,
                        num_classes=num_classes, source={**source, "streaming": True})
