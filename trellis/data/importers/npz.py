"""Shchur et al. (2018) ``.npz`` importer (Amazon Computers/Photo, Coauthor CS/Physics, Cora-ML, ...).

Protocol of "Pitfalls of GNN Evaluation": the adjacency is symmetrized, self loops removed and its
values ignored (binary graph, no edge weights), the largest connected component is kept (default), and a
random split is drawn with ``--split-seed``: 20 training and 30 validation nodes per class, every other
node a test node. A class with fewer than 50 nodes gives what it has (training first) and no test nodes.
Multilabel files (an ``[N, C]`` 0/1 label matrix) get a random 10% / 10% / 80% split of the labelled nodes
instead, since per-class counts do not apply to label sets.

Keys read: ``adj_data/adj_indices/adj_indptr/adj_shape`` (CSR adjacency, row = source), features from
``attr_data/attr_indices/attr_indptr/attr_shape`` or a dense ``attr_matrix`` (stored dense float32),
labels from ``labels`` or ``label_data/label_indices/label_indptr/label_shape`` (multilabel). Object
arrays (``class_names``) are never unpickled.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.csr import ArrayEdgeSource
from trellis.data.importers.common import GraphInput, check_features, check_labels, write_graph
from trellis.data.splits import per_class_split, random_split
from trellis.data.store import check_output
from trellis.errors import TrellisUserError


def _find_npz(src: Path) -> Path:
    if src.is_dir():
        files = sorted(src.glob("*.npz"))
        if len(files) != 1:
            found = ", ".join(p.name for p in files) or "none"
            raise TrellisUserError(f"{src}: expected exactly one .npz file but found {found}; pass the file itself")
        return files[0]
    if not src.is_file():
        raise TrellisUserError(f"{src}: file not found; check the path")
    return src


def _csr(z: Any, prefix: str, path: Path) -> Any:
    import scipy.sparse as sp

    try:
        shape = tuple(int(v) for v in z[f"{prefix}_shape"])
        return sp.csr_matrix((z[f"{prefix}_data"], z[f"{prefix}_indices"], z[f"{prefix}_indptr"]), shape=shape)
    except (KeyError, ValueError, TypeError) as exc:
        raise TrellisUserError(f"{path}: cannot build the {prefix} matrix from {prefix}_data/indices/indptr/shape "
                               f"({exc}); is this a Shchur et al. npz file?") from exc


def load_npz(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Shchur et al. npz into ``{"src", "dst", "x", "y", "num_nodes"}`` (raw, before cleaning)."""
    path = _find_npz(Path(path))
    try:
        z = np.load(path, allow_pickle=False)
        keys = set(z.files)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise TrellisUserError(f"{path}: not a readable .npz file ({exc})") from exc
    if "adj_indptr" not in keys and "adj_matrix" not in keys:
        raise TrellisUserError(f"{path}: no adjacency (adj_data/adj_indices/adj_indptr/adj_shape); is this a "
                               "Shchur et al. npz file?")
    if "adj_indptr" in keys:
        adj = _csr(z, "adj", path)
    else:
        import scipy.sparse as sp

        adj = sp.csr_matrix(z["adj_matrix"])
    if adj.shape[0] != adj.shape[1]:
        raise TrellisUserError(f"{path}: adjacency has shape {adj.shape}; it must be square [N, N]")
    n = int(adj.shape[0])
    coo = adj.tocoo()
    x = None
    if "attr_indptr" in keys:
        x = np.asarray(_csr(z, "attr", path).toarray(), dtype=np.float32)
    elif "attr_matrix" in keys:
        x = np.asarray(z["attr_matrix"], dtype=np.float32)
    if x is not None:
        check_features(x, n, f"{path} (attr)")
    y = None
    if "labels" in keys:
        y = check_labels(z["labels"], n, f"{path} (labels)")
    elif "label_indptr" in keys:
        y = check_labels(_csr(z, "label", path).toarray(), n, f"{path} (labels)")
    return {"src": coo.row.astype(np.int64), "dst": coo.col.astype(np.int64), "x": x, "y": y, "num_nodes": n,
            "path": path}


def import_npz(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    name: str | None = None,
    split_seed: int = 0,
    train_per_class: int = 20,
    val_per_class: int = 30,
    lcc: bool = True,
    symmetrize: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Import a Shchur et al. npz with their protocol (LCC, 20/30 per class, rest test).

    Args:
        src: The ``.npz`` file (or a directory holding exactly one).
        out: Store directory to create.
        name: Dataset name (default: the file stem).
        split_seed: Seed of the random per-class split (default: 0).
        train_per_class: Training nodes per class (default: 20).
        val_per_class: Validation nodes per class (default: 30).
        lcc: Keep only the largest connected component (default: True).
        symmetrize: Make the graph undirected (default: True).
        overwrite: Replace an existing store (default: False).
        progress: Show progress bars (default: True).

    Returns:
        The store path.
    """
    check_output(out, overwrite=overwrite)
    d = load_npz(src)
    path: Path = d["path"]

    def make_splits(y: np.ndarray | None, n: int) -> dict[str, np.ndarray] | None:
        if y is None:
            return None
        if y.ndim == 2:  # per-class counts have no meaning for label sets: a random 10/10/80 split instead
            labelled = np.flatnonzero((y >= 0).all(axis=1))
            parts = random_split(labelled.size, 0.1, 0.1, split_seed)
            return {k: labelled[ids] for k, ids in parts.items()}
        return per_class_split(y, train_per_class, val_per_class, split_seed)

    inp = GraphInput(
        edges=ArrayEdgeSource(d["src"], d["dst"], name=f"{path} (adj)"),
        num_nodes=d["num_nodes"], x=d["x"], y=d["y"], name=name or path.stem,
        source={"importer": "npz", "path": str(path.resolve()),
                "split": "random-10/10/80" if d["y"] is not None and d["y"].ndim == 2 else "per-class",
                "train_per_class": train_per_class, "val_per_class": val_per_class, "split_seed": split_seed},
    )
    return write_graph(inp, out, symmetrize=symmetrize, lcc=lcc, make_splits=make_splits, overwrite=overwrite,
                       progress=progress)
