"""OGB node-property importer for the raw layout of an unpacked OGB dataset (no ``ogb`` package needed).

Layout (``.csv.gz`` or plain ``.csv``)::

    ROOT/raw/edge.csv.gz            src,dst per line, no header (one graph)
    ROOT/raw/num-node-list.csv.gz   node count (optional; default: feature/label rows or largest id + 1)
    ROOT/raw/node-feat.csv.gz       N rows of F comma-separated floats (optional)
    ROOT/raw/node-label.csv.gz      N rows: a class id (NaN = unlabelled) or C 0/1 columns (optional)
    ROOT/raw/edge-feat.csv.gz       E rows of D floats, row i = edge line i (optional)
    ROOT/split/<name>/{train,valid,test}.csv.gz   node ids, one per line

The graph is symmetrized by default (as ogbn-arxiv is used in practice); ``--no-symmetrize`` keeps it
directed. Edge lines are streamed in chunks, so very large edge files use bounded memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trellis.data.csr import DEFAULT_CHUNK_EDGES
from trellis.data.importers.common import GraphInput, check_features, check_labels, write_graph
from trellis.data.store import check_output
from trellis.data.textio import TextEdgeSource, read_table
from trellis.errors import TrellisUserError


def _find(folder: Path, stem: str) -> Path | None:
    for suffix in (".csv.gz", ".csv"):
        p = folder / f"{stem}{suffix}"
        if p.is_file():
            return p
    return None


def import_ogb(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    name: str | None = None,
    split_name: str | None = None,
    symmetrize: bool = True,
    lcc: bool = False,
    overwrite: bool = False,
    streaming: bool | None = None,
    chunk_edges: int = DEFAULT_CHUNK_EDGES,
    progress: bool = True,
) -> Path:
    """Import an OGB node-property dataset from its raw files.

    Args:
        src: Dataset root holding ``raw/`` and ``split/``.
        out: Store directory to create.
        name: Dataset name (default: the root folder's name).
        split_name: Which ``split/<name>`` folder (default: the first, alphabetically).
        symmetrize: Make the graph undirected (default: True).
        lcc: Keep only the largest connected component (default: False).
        overwrite: Replace an existing store (default: False).
        streaming: Bounded-memory edge import (default: when edge.csv exceeds 512 MiB).
        chunk_edges: Edges per chunk in streaming mode.
        progress: Show progress bars (default: True).

    Returns:
        The store path.
    """
    check_output(out, overwrite=overwrite)
    root = Path(src)
    raw = root / "raw"
    if not raw.is_dir():
        raise TrellisUserError(f"{root}: no raw/ folder; point at the OGB dataset root (holding raw/ and split/)")
    edge_path = _find(raw, "edge")
    if edge_path is None:
        raise TrellisUserError(f"{raw}: missing edge.csv.gz (src,dst per line); is this an OGB node-property dataset?")

    n: int | None = None
    nn_path = _find(raw, "num-node-list")
    if nn_path is not None:
        counts = read_table(nn_path, dtype=np.int64, ncols=1, what="a node count")
        if counts.shape[0] != 1:
            raise TrellisUserError(f"{nn_path}: holds {counts.shape[0]} graphs; only single-graph (node-property) "
                                   "datasets can be imported")
        n = int(counts[0, 0])
        if n < 1:
            raise TrellisUserError(f"{nn_path}: the node count must be at least 1 (got {n})")
    x = None
    feat_path = _find(raw, "node-feat")
    if feat_path is not None:
        x = read_table(feat_path, dtype=np.float32, what="node features")
        n = x.shape[0] if n is None else n
        check_features(x, n, str(feat_path))
    y = None
    where: dict[str, str] = {}
    label_path = _find(raw, "node-label")
    if label_path is not None:
        y = read_table(label_path, dtype=np.float64, what="node labels")
        n = y.shape[0] if n is None else n
        y = check_labels(y, n, str(label_path))
    edge_feat = None
    ef_path = _find(raw, "edge-feat")
    if ef_path is not None:
        edge_feat = read_table(ef_path, dtype=np.float32, what="edge features")
        where["edge_feat"] = str(ef_path)

    splits = None
    split_root = root / "split"
    if split_root.is_dir():
        choices = sorted(p.name for p in split_root.iterdir() if p.is_dir())
        if split_name is not None and split_name not in choices:
            raise TrellisUserError(f"{split_root}: no split {split_name!r}; available: {', '.join(choices) or 'none'}")
        chosen = split_name or (choices[0] if choices else None)
        if chosen is not None:
            splits = {}
            for ogb_key, key in (("train", "train"), ("valid", "val"), ("test", "test")):
                p = _find(split_root / chosen, ogb_key)
                if p is None:
                    raise TrellisUserError(f"{split_root / chosen}: missing {ogb_key}.csv.gz (node ids, one per line)")
                splits[key] = read_table(p, dtype=np.int64, ncols=1, what="a node id")[:, 0]
                where[key] = str(p)
            split_name = chosen
    elif split_name is not None:
        raise TrellisUserError(f"{root}: no split/ folder, so --split-name {split_name} cannot be used")

    edges = TextEdgeSource(edge_path, chunk_edges=chunk_edges)
    inp = GraphInput(edges=edges, num_nodes=n, x=x, y=y, splits=splits, edge_feat=edge_feat,
                     name=name or root.resolve().name, where=where,
                     source={"importer": "ogb", "path": str(root.resolve()), "split": split_name})
    return write_graph(inp, out, symmetrize=symmetrize, lcc=lcc, overwrite=overwrite, streaming=streaming,
                       chunk_edges=chunk_edges, progress=progress)
