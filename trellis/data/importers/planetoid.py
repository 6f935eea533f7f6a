"""Planetoid importer: the original ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}`` files.

Follows PyG's ``read_planetoid_data`` (Yang et al. 2016 / Kipf & Welling 2017 public split):

* nodes ``0..len(allx)-1`` take the rows of ``allx``/``ally``; test node ``test.index[i]`` takes row ``i``
  of ``tx``/``ty``;
* CiteSeer fix: ids in the test range missing from ``test.index`` (isolated nodes) get zero features
  and label -1 (PyG gives them label 0; they are in no split, so accuracy is unaffected);
* splits: train = ``range(len(y))``, val = ``range(len(y), len(y) + 500)``, test = sorted ``test.index``;
* edges: the adjacency dict, self loops removed, symmetrized and deduplicated (Cora: 2708 nodes,
  10556 directed edges; CiteSeer: 3327 nodes, 9104 edges — PyG's counts);
* features stored raw (row normalization is a model/trainer option).

The files are Python-2 pickles. They are read with an unpickler that only admits the numpy/scipy
classes these files use, so a tampered file cannot run code.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.csr import ArrayEdgeSource
from trellis.data.importers.common import GraphInput, write_graph
from trellis.data.store import check_output
from trellis.errors import TrellisUserError

PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")

_ALLOWED = {
    ("__builtin__", "list"), ("__builtin__", "dict"), ("__builtin__", "set"), ("__builtin__", "tuple"),
    ("builtins", "list"), ("builtins", "dict"), ("builtins", "set"), ("builtins", "tuple"),
    ("collections", "defaultdict"), ("collections", "OrderedDict"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"),
}
_SPARSE = {"csr_matrix", "csc_matrix", "coo_matrix", "lil_matrix", "dok_matrix"}


class _PlanetoidUnpickler(pickle.Unpickler):
    """Admits only the classes Planetoid pickles use (no arbitrary code from a tampered file)."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("scipy.sparse") and name in _SPARSE:
            import scipy.sparse

            return getattr(scipy.sparse, name)
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module == "numpy.core.multiarray":  # numpy 2 moved it; avoid the deprecation shim
            module = "numpy._core.multiarray"
        return super().find_class(module, name)


def _load_pickle(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _PlanetoidUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise TrellisUserError(f"{path}: not a readable Planetoid pickle ({exc}); re-download the original file") \
            from exc


def detect_name(folder: Path) -> str:
    """The dataset name from ``ind.<name>.x`` (an error if none or several)."""
    names = sorted(p.name[len("ind."):-len(".x")] for p in folder.glob("ind.*.x"))
    if not names:
        raise TrellisUserError(f"{folder}: no Planetoid files (ind.<name>.x, ...) found; point at the folder "
                               "holding them")
    if len(names) > 1:
        raise TrellisUserError(f"{folder}: several Planetoid datasets ({', '.join(names)}); choose one with --name")
    return names[0]


def _checked(m: Any, path: Path) -> Any:
    """A sparse matrix whose structure is sound.

    A damaged pickle's (a non-monotone ``indptr``) crashed ``toarray`` with a segmentation fault.
    """
    if hasattr(m, "check_format"):
        try:
            m.check_format(full_check=True)
        except (ValueError, TypeError, IndexError) as exc:
            raise TrellisUserError(f"{path}: the sparse matrix is damaged ({exc}); copy the file again from its "
                                   "source") from None
    return m


def _dense(m: Any, path: Path) -> np.ndarray:
    if hasattr(m, "toarray"):
        return np.asarray(_checked(m, path).toarray(), dtype=np.float32)
    arr = np.asarray(m)
    if arr.ndim != 2:
        raise TrellisUserError(f"{path}: expected a matrix but found shape {arr.shape}")
    return arr.astype(np.float32)


def _labels(onehot: Any, path: Path) -> np.ndarray:
    m = np.asarray(_checked(onehot, path).toarray() if hasattr(onehot, "toarray") else onehot)
    if m.ndim != 2:
        raise TrellisUserError(f"{path}: expected one-hot labels [rows, classes] but found shape {m.shape}")
    y = m.argmax(axis=1).astype(np.int64)
    y[m.max(axis=1) <= 0] = -1  # a row with no class is unlabelled
    return y


def load_planetoid(folder: str | os.PathLike[str], name: str | None = None) -> dict[str, Any]:
    """Read Planetoid files into ``{"x", "y", "src", "dst", "splits", "name", "num_nodes"}`` (PyG semantics).

    Args:
        folder: Directory holding ``ind.<name>.*`` (or the path of one of those files).
        name: Dataset prefix (default: detected from ``ind.<name>.x``).
    """
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise TrellisUserError(f"{folder}: directory not found; point at the folder holding ind.<name>.* files")
    name = name or detect_name(folder)
    paths = {part: folder / f"ind.{name}.{part}" for part in PARTS}
    for part, p in paths.items():
        if not p.is_file():
            raise TrellisUserError(f"{p}: missing Planetoid file '{part}'; all of ind.{name}."
                                   "{x,y,tx,ty,allx,ally,graph,test.index} are needed")
    items = {part: _load_pickle(p) for part, p in paths.items() if part != "test.index"}
    try:
        test_index = np.loadtxt(paths["test.index"], dtype=np.int64, ndmin=1)
    except ValueError as exc:
        raise TrellisUserError(f"{paths['test.index']}: expected one integer node id per line ({exc})") from exc

    allx, tx = _dense(items["allx"], paths["allx"]), _dense(items["tx"], paths["tx"])
    ally, ty = _labels(items["ally"], paths["ally"]), _labels(items["ty"], paths["ty"])
    n_y = int(np.shape(items["y"])[0])
    if tx.shape[0] != test_index.size or ty.shape[0] != test_index.size:
        raise TrellisUserError(f"{paths['tx']}: {tx.shape[0]} test rows but test.index lists {test_index.size} "
                               "ids; the files belong to different datasets")
    if allx.shape[0] != ally.shape[0]:
        raise TrellisUserError(f"{paths['allx']}: {allx.shape[0]} rows but ally has {ally.shape[0]}")
    sorted_test = np.sort(test_index)
    lo, hi = int(sorted_test[0]), int(sorted_test[-1])
    if lo != allx.shape[0]:
        raise TrellisUserError(f"{paths['test.index']}: test ids start at {lo} but allx has {allx.shape[0]} rows "
                               "(test ids must follow them); the files belong to different datasets")
    graph_keys = items["graph"].keys() if isinstance(items["graph"], dict) else ()
    graph_n = max((int(k) for k in graph_keys), default=-1) + 1
    if graph_n and hi >= graph_n:  # before sizing the padded rows by it (one bad id made a 5.4 GB store)
        raise TrellisUserError(f"{paths['test.index']}: test id {hi} but the graph has {graph_n} nodes; the file is "
                               "damaged or belongs to another dataset")
    # PyG extends tx/ty to the full test id range for CiteSeer (isolated test nodes absent from test.index);
    # doing it always is a no-op for datasets whose test ids are contiguous (Cora, PubMed).
    span = hi - lo + 1
    tx_ext = np.zeros((span, tx.shape[1]), dtype=np.float32)
    ty_ext = np.full(span, -1, dtype=np.int64)
    tx_ext[sorted_test - lo] = tx
    ty_ext[sorted_test - lo] = ty
    x = np.concatenate([allx, tx_ext])
    y = np.concatenate([ally, ty_ext])
    x[test_index] = x[sorted_test]
    y[test_index] = y[sorted_test]
    n = x.shape[0]

    graph = items["graph"]
    if not isinstance(graph, dict):
        raise TrellisUserError(f"{paths['graph']}: expected a dict of adjacency lists but found {type(graph).__name__}")
    keys = np.fromiter(graph.keys(), dtype=np.int64, count=len(graph))
    lengths = np.fromiter((len(v) for v in graph.values()), dtype=np.int64, count=len(graph))
    src = np.repeat(keys, lengths)
    dst = np.fromiter((int(u) for v in graph.values() for u in v), dtype=np.int64, count=int(lengths.sum()))
    val_end = min(n_y + 500, n)
    splits = {
        "train": np.arange(n_y, dtype=np.int64),
        "val": np.arange(n_y, val_end, dtype=np.int64),
        "test": sorted_test.astype(np.int64),
    }
    return {"x": x, "y": y, "src": src, "dst": dst, "splits": splits, "name": name, "num_nodes": n,
            "graph_path": str(paths["graph"])}


def import_planetoid(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    name: str | None = None,
    symmetrize: bool = True,
    lcc: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Import a Planetoid dataset (Cora, CiteSeer, PubMed) with its public split.

    Args:
        src: Directory holding ``ind.<name>.*``.
        out: Store directory to create.
        name: Dataset prefix (default: detected).
        symmetrize: Make the graph undirected (default: True, as PyG).
        lcc: Keep only the largest connected component; the public split is restricted to it (default: False).
        overwrite: Replace an existing store (default: False).
        progress: Show progress bars (default: True).

    Returns:
        The store path.
    """
    check_output(out, overwrite=overwrite)
    d = load_planetoid(src, name)
    inp = GraphInput(
        edges=ArrayEdgeSource(d["src"], d["dst"], name=d["graph_path"]),
        num_nodes=d["num_nodes"], x=d["x"], y=d["y"], splits=d["splits"], name=d["name"],
        source={"importer": "planetoid", "path": str(Path(src).resolve()), "split": "public"},
    )
    return write_graph(inp, out, symmetrize=symmetrize, lcc=lcc, overwrite=overwrite, progress=progress)
