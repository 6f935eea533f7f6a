"""Edge-list importer: a folder of plain files, the simplest way to bring your own graph.

Files (only the edges are required)::

    edges.npy                int [E, 2] (src, dst), or
    edges.txt|.csv|.tsv      "src dst" per line (comma, tab or space; # comments; .gz allowed)
    features.npy             float [N, F], row i = node i
    labels.npy               int [N] (-1 = unlabelled) or 0/1 [N, C] (multilabel)
    train.npy / val.npy / test.npy   node ids, or boolean masks of length N
    edge_weights.npy         float [E], row i = edge row i
    edge_features.npy        float [E, D], row i = edge row i

The node count is ``--num-nodes``, else the rows of ``features.npy``/``labels.npy``, else the largest id
+ 1. ``.npy`` files are memory-mapped and edge files larger than 512 MiB are streamed in chunks, so the
import runs in O(N + chunk) memory for graphs larger than RAM.

Edge data (``edge_weights.npy``, ``edge_features.npy``; a 1-D feature file is one feature per edge) has
one row per line of the edge list, comments and blank lines not counted, and follows its edge through
cleaning (:mod:`trellis.data.csr`):

* a dropped self loop drops its row;
* symmetrizing adds ``v -> u`` for each row ``u -> v``, carrying *the same* row (an undirected edge has
  one set of attributes, whichever direction a message crosses it);
* deduplication keeps the *first* occurrence in file order -- with symmetrization ``u v`` and ``v u`` are
  the same edge, so the first row naming the pair in either direction gives both directions their data.
  First, not the mean: averaging would invent values no input row holds (and a categorical code
  averaged is meaningless); deduplicate upstream if another rule is wanted.

A feature file whose row count is not the edge count, that is not ``[E]``/``[E, D]``, or that holds
NaN/Inf is refused with the file, the counts or the row (exit 2, nothing written).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trellis.data.csr import DEFAULT_CHUNK_EDGES, EdgeSource
from trellis.data.importers.common import GraphInput, check_features, check_labels, write_graph
from trellis.data.splits import random_split
from trellis.data.store import check_output
from trellis.data.textio import NpyEdgeSource, TextEdgeSource, load_npy
from trellis.errors import TrellisUserError

EDGE_FILES = ("edges.npy", "edges.txt", "edges.csv", "edges.tsv", "edges.txt.gz", "edges.csv.gz", "edges.tsv.gz")


def find_edge_file(folder: Path) -> Path:
    """The edge file in ``folder`` (exactly one of :data:`EDGE_FILES`)."""
    found = [folder / f for f in EDGE_FILES if (folder / f).is_file()]
    if not found:
        raise TrellisUserError(f"{folder}: no edge file; add one of {', '.join(EDGE_FILES[:4])}")
    if len(found) > 1:
        raise TrellisUserError(f"{folder}: several edge files ({', '.join(p.name for p in found)}); keep one")
    return found[0]


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """``"0.5,0.25,0.25"`` (or three numbers): train, val and test fractions summing to 1."""
    try:
        values = [float(v) for v in (split.split(",") if isinstance(split, str) else split)]
    except ValueError:
        raise TrellisUserError(f"--split {split}: expected three fractions TRAIN,VAL,TEST, e.g. "
                               "0.5,0.25,0.25") from None
    if len(values) != 3 or any(not 0 <= v <= 1 for v in values) or abs(sum(values) - 1) > 1e-6:
        raise TrellisUserError(f"--split {split}: expected three fractions in [0, 1] summing to 1 (TRAIN,VAL,TEST), "
                               "e.g. 0.5,0.25,0.25")
    return values[0], values[1], values[2]


def edge_source(path: Path, chunk_edges: int = DEFAULT_CHUNK_EDGES) -> EdgeSource:
    """A chunked edge source for an ``.npy`` or text edge file."""
    if path.suffix == ".npy":
        return NpyEdgeSource(path, chunk_edges=chunk_edges)
    return TextEdgeSource(path, chunk_edges=chunk_edges)


def import_edgelist(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    name: str | None = None,
    num_nodes: int | None = None,
    symmetrize: bool = True,
    dedup: bool = True,
    remove_self_loops: bool = True,
    lcc: bool = False,
    overwrite: bool = False,
    streaming: bool | None = None,
    chunk_edges: int = DEFAULT_CHUNK_EDGES,
    progress: bool = True,
    split: str | Sequence[float] | None = None,
    split_seed: int | None = None,
) -> Path:
    """Import a folder of edge-list files (or a single edge file).

    Args:
        src: The folder (or an edges file).
        out: Store directory to create.
        name: Dataset name (default: the folder name).
        num_nodes: Node count (default: feature/label rows, else largest id + 1).
        symmetrize: Make the graph undirected (default: True).
        dedup: Drop repeated edges, keeping the first (default: True).
        remove_self_loops: Drop ``u -> u`` (default: True).
        lcc: Keep only the largest connected component (default: False).
        overwrite: Replace an existing store (default: False).
        streaming: Bounded-memory import (default: when the edge file exceeds 512 MiB).
        chunk_edges: Edges per chunk in streaming mode.
        progress: Show progress bars (default: True).
        split: A random split ``"train,val,test"`` fractions summing to 1 (e.g. ``"0.5,0.25,0.25"``) of the
            labelled nodes, instead of train/val/test files.
        split_seed: Seed of that split (default: 0).

    Returns:
        The store path.
    """
    fractions = parse_split(split) if split is not None else None
    if split_seed is not None and fractions is None:
        raise TrellisUserError("--split-seed seeds --split: give --split TRAIN,VAL,TEST (e.g. 0.5,0.25,0.25) too")
    check_output(out, overwrite=overwrite)
    src = Path(src)
    if src.is_file():
        folder, edge_path = src.parent, src
    elif src.is_dir():
        folder, edge_path = src, find_edge_file(src)
    else:
        raise TrellisUserError(f"{src}: not found; give a folder with edges.npy/edges.txt or an edge file")
    edges = edge_source(edge_path, chunk_edges)

    def optional(fname: str) -> Path | None:
        p = folder / fname
        return p if src.is_dir() and p.is_file() else None

    feat_path, label_path = optional("features.npy"), optional("labels.npy")
    ew_path, ef_path = optional("edge_weights.npy"), optional("edge_features.npy")
    n = num_nodes
    x = None
    if feat_path is not None:
        x = load_npy(feat_path)
        if label_path is not None and n is None:
            rows = load_npy(label_path).shape[0]
            if rows != x.shape[0]:
                raise TrellisUserError(f"{feat_path} has {x.shape[0]} rows but {label_path} has {rows}; give one "
                                       "feature row and one label per node (or pass --num-nodes)")
        n = x.shape[0] if n is None else n
        check_features(x, n, str(feat_path))
    y = None
    if label_path is not None:
        y_raw = load_npy(label_path, mmap=False)
        n = y_raw.shape[0] if n is None else n
        y = check_labels(y_raw, n, str(label_path))
    splits: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for key in ("train", "val", "test"):
        p = optional(f"{key}.npy")
        if p is not None:
            splits[key] = load_npy(p, mmap=False)
            where[key] = str(p)
    if fractions is not None:
        if splits:
            raise TrellisUserError(f"--split: {folder} has split files ({', '.join(sorted(where))}); use one or the "
                                   "other")
        if n is None:
            raise TrellisUserError("--split needs the node count: add features.npy or labels.npy, or pass --num-nodes")
        labelled = np.arange(n, dtype=np.int64) if y is None else np.flatnonzero(
            (y >= 0) if y.ndim == 1 else (y >= 0).all(axis=1)).astype(np.int64)  # multilabel: -1 rows unlabelled
        parts = random_split(labelled.shape[0], fractions[0], fractions[1], seed=split_seed or 0)
        splits = {k: labelled[v] for k, v in parts.items()}
        where = {k: f"--split {k}" for k in splits}
    ew = None if ew_path is None else load_npy(ew_path)
    ef = None if ef_path is None else load_npy(ef_path)
    if ef is not None and ef.ndim == 1:
        ef = ef.reshape(-1, 1)
    if ew_path is not None:
        where["edge_weight"] = str(ew_path)
    if ef_path is not None:
        where["edge_feat"] = str(ef_path)
    if ew is not None and ew.ndim != 1:
        raise TrellisUserError(f"{ew_path}: edge weights must be a 1-D array [E] but have shape {ew.shape}")

    inp = GraphInput(edges=edges, num_nodes=n, x=x, y=y, splits=splits or None, edge_weight=ew, edge_feat=ef,
                     name=name or (folder.resolve().name if src.is_dir() else edge_path.name.split(".")[0]),
                     where=where, source={"importer": "edgelist", "path": str(src.resolve())})
    counted_by = None if num_nodes is not None else feat_path or label_path
    try:
        return write_graph(inp, out, symmetrize=symmetrize, dedup=dedup, remove_self_loops=remove_self_loops,
                           lcc=lcc, overwrite=overwrite, streaming=streaming, chunk_edges=chunk_edges,
                           progress=progress)
    except TrellisUserError as exc:
        if counted_by is None or f"but the graph has {n} nodes" not in str(exc) \
                or edge_path.name not in str(exc).split(":", 1)[0]:  # a split or data file's own error: as it is
            raise
        # the edges are fine if the node count is wrong: name the file the count came from
        raise TrellisUserError(f"{counted_by} has {n} rows, so the graph has {n} nodes, but the edges name more "
                               f"({exc}); give {counted_by.name} one row per node, or pass --num-nodes") from None
