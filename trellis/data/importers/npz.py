"""``.npz`` importer: Shchur et al. (2018) and Platonov et al. (2023) files.

Shchur et al.'s files (Amazon Computers/Photo, Coauthor CS/Physics, Cora-ML, ...):

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

Platonov et al.'s files (roman-empire, amazon-ratings, minesweeper, tolokers, questions, and the filtered
chameleon/squirrel of "A Critical Look at the Evaluation of GNNs under Heterophily"): ``node_features [N, F]``,
``node_labels [N]``, ``edges [E, 2]`` (each undirected edge stored once) and ``train_masks / val_masks /
test_masks [S, N]``, their fixed splits. Their protocol: the graph made undirected (the default here; a
``*_directed`` file wants ``--no-symmetrize``), every node kept (the LCC is off by default), features as given,
and results over the S splits. The store's split is the first; all S are kept (``split_sets.npy``), and
``--split-seed K`` in ``trellis train`` / ``--splits`` in ``trellis tune`` select among them.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.csr import ArrayEdgeSource
from trellis.data.importers.common import (
    GraphInput,
    check_features,
    check_labels,
    split_sets_from_masks,
    write_graph,
)
from trellis.data.splits import per_class_split, random_split
from trellis.data.store import SPLIT_CODES, check_output
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
        m = sp.csr_matrix((z[f"{prefix}_data"], z[f"{prefix}_indices"], z[f"{prefix}_indptr"]), shape=shape)
        m.check_format(full_check=True)  # scipy checks index ranges only later (a traceback in tocoo)
        return m
    except (KeyError, ValueError, TypeError) as exc:
        raise TrellisUserError(f"{path}: cannot build the {prefix} matrix from {prefix}_data/indices/indptr/shape "
                               f"({exc}); is this a Shchur et al. npz file?") from exc


#: Keys of a Platonov et al. (2023) file.
FIXED_SPLIT_KEYS = ("node_features", "node_labels", "edges", "train_masks", "val_masks", "test_masks")


def _fixed_split_sets(z: Any, n: int, path: Path) -> np.ndarray:
    """``int8 [S, N]`` split codes from ``train_masks / val_masks / test_masks`` (``[S, N]`` or ``[N]``)."""
    return split_sets_from_masks({k: np.asarray(z[f"{k}_masks"]) for k in SPLIT_CODES}, n,
                                 {k: f"{k}_masks" for k in SPLIT_CODES}, f"{path}: ")


def _load_fixed_split(z: Any, path: Path) -> dict[str, Any]:
    x = check_features(np.asarray(z["node_features"]), None, f"{path} (node_features)")
    n = int(x.shape[0])
    edges = np.asarray(z["edges"])
    if edges.ndim != 2 or edges.shape[1] != 2 or not np.issubdtype(edges.dtype, np.integer):
        raise TrellisUserError(f"{path}: edges has shape {tuple(edges.shape)} and dtype {edges.dtype}; it must be "
                               "integer [E, 2] (source, destination)")
    y = check_labels(z["node_labels"], n, f"{path} (node_labels)")
    return {"src": edges[:, 0].astype(np.int64), "dst": edges[:, 1].astype(np.int64), "x": x.astype(np.float32),
            "y": y, "num_nodes": n, "path": path, "split_sets": _fixed_split_sets(z, n, path)}


def load_npz(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an npz into ``{"src", "dst", "x", "y", "num_nodes", "path"}`` (raw, before cleaning).

    Platonov et al.'s files add ``"split_sets"`` (``int8 [S, N]``, their fixed splits).
    """
    path = _find_npz(Path(path))
    try:
        z = np.load(path, allow_pickle=False)
        keys = set(z.files)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise TrellisUserError(f"{path}: not a readable .npz file ({exc})") from exc
    try:  # members are read lazily below: a damaged one (a bad CRC) surfaces there
        return _read_npz(z, keys, path)
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise TrellisUserError(f"{path}: a member of the .npz file is damaged ({exc}); copy the file again from its "
                               "source") from None


def _read_npz(z: Any, keys: set[str], path: Path) -> dict[str, Any]:
    """:func:`load_npz` of an opened file."""
    if "node_features" in keys or "train_masks" in keys:
        missing = [k for k in FIXED_SPLIT_KEYS if k not in keys]
        if missing:
            raise TrellisUserError(f"{path}: a Platonov et al. npz file needs {', '.join(FIXED_SPLIT_KEYS)}; "
                                   f"{', '.join(missing)} missing")
        return _load_fixed_split(z, path)
    if "adj_indptr" not in keys and "adj_matrix" not in keys:
        raise TrellisUserError(f"{path}: no adjacency (adj_data/adj_indices/adj_indptr/adj_shape, or Platonov et "
                               "al.'s edges); is this a Shchur et al. or Platonov et al. npz file?")
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
    split_seed: int | None = None,
    train_per_class: int | None = None,
    val_per_class: int | None = None,
    lcc: bool | None = None,
    symmetrize: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Import an npz with its authors' protocol.

    Shchur et al.: LCC, ``train_per_class`` / ``val_per_class`` per class, the rest test. Platonov et al.:
    every node, their fixed splits (the first is the store's; the split options do not apply).

    Args:
        src: The ``.npz`` file (or a directory holding exactly one).
        out: Store directory to create.
        name: Dataset name (default: the file stem).
        split_seed: Seed of the random per-class split (default: 0).
        train_per_class: Training nodes per class (default: 20).
        val_per_class: Validation nodes per class (default: 30).
        lcc: Keep only the largest connected component (default: True for Shchur et al.'s files, False for
            Platonov et al.'s).
        symmetrize: Make the graph undirected (default: True).
        overwrite: Replace an existing store (default: False).
        progress: Show progress bars (default: True).

    Returns:
        The store path.
    """
    check_output(out, overwrite=overwrite)
    d = load_npz(src)
    path: Path = d["path"]
    sets = d.get("split_sets")
    if sets is not None:
        given = [flag for flag, v in (("--split-seed", split_seed), ("--train-per-class", train_per_class),
                                      ("--val-per-class", val_per_class)) if v is not None]
        if given:
            raise TrellisUserError(f"{path}: {given[0]} does not apply: the file holds {sets.shape[0]} fixed splits "
                                   "(all are imported; `trellis train --split-seed K` trains on split K)")
        inp = GraphInput(
            edges=ArrayEdgeSource(d["src"], d["dst"], name=f"{path} (edges)"), num_nodes=d["num_nodes"], x=d["x"],
            y=d["y"], split_sets=sets, name=name or path.stem,
            source={"importer": "npz", "path": str(path.resolve()), "split": "fixed", "num_splits": int(sets.shape[0])})
        return write_graph(inp, out, symmetrize=symmetrize, lcc=bool(lcc), overwrite=overwrite, progress=progress)

    split_seed = 0 if split_seed is None else split_seed
    train_per_class = 20 if train_per_class is None else train_per_class
    val_per_class = 30 if val_per_class is None else val_per_class

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
    return write_graph(inp, out, symmetrize=symmetrize, lcc=True if lcc is None else lcc, make_splits=make_splits,
                       overwrite=overwrite, progress=progress)
