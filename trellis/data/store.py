"""The on-disk graph store: a directory of ``.npy`` arrays described by ``manifest.json``.

Layout (all arrays are plain ``.npy`` files so numpy can memory-map them)::

    STORE/
      manifest.json      format version, counts, task, dtype/shape/sha256 of every array
      indptr.npy         int64 [N+1]   CSR of in-edges: row = destination node
      indices.npy        int64 [E]     source node of each in-edge
      rev_indptr.npy     int64 [N+1]   reverse CSR (out-edges): row = source node
      rev_indices.npy    int64 [E]     destination node of each out-edge
      rev_perm.npy       int64 [E]     forward edge id of each reverse edge (edge data follows its edge)
      edge_weight.npy    float32 [E]   optional
      edge_feat.npy      float32 [E,D] optional, row i belongs to forward edge i
      x.npy              float32 [N,F] optional node features
      y.npy              int64 [N] (multiclass/binary) or float32/uint8 [N,C] (multilabel), optional
      train_idx.npy / val_idx.npy / test_idx.npy   int64 node ids, optional
      node_ids.npy       int64 [N]     optional: node i's id in the imported data, where the import dropped
                                       nodes (``--lcc``); predictions are in the store's order, this maps them back

Why this shape: the backward pass of every aggregation runs on the reverse graph (Dorylus, GraphTheta),
so the reverse CSR is built once at write time and cached with the store; it is a pure function of the
forward CSR. Writes go to a temporary sibling directory that is renamed into place only after every
array and the manifest are complete, so an interrupted import never leaves a store that opens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, overload

import numpy as np

from trellis.errors import TrellisUserError
from trellis.utils.atomic import check_output as check_output  # re-exported: importers guard --out with it
from trellis.utils.atomic import replace_dir, temp_sibling
from trellis.utils.csr import build_reverse_csr
from trellis.utils.diskmap import new_map
from trellis.utils.manifest import STORE_FORMAT, ManifestField

#: The store's manifest: format, version and the messages of a missing or foreign one.
STORE_MANIFEST = STORE_FORMAT
FORMAT = STORE_MANIFEST.name
VERSION = STORE_MANIFEST.version
SPLITS = ("train", "val", "test")
#: Codes of ``split_sets.npy`` (``int8 [S, N]``, a store's fixed splits): 0 = in no split of that set.
SPLIT_CODES = {"train": 1, "val": 2, "test": 3}


def split_set_ids(codes: np.ndarray) -> dict[str, np.ndarray]:
    """``{"train"|"val"|"test": node ids}`` of one row of ``split_sets`` (see :data:`SPLIT_CODES`)."""
    codes = np.asarray(codes)
    return {k: np.flatnonzero(codes == c).astype(np.int64) for k, c in SPLIT_CODES.items()}
TASKS = ("multiclass", "binary", "multilabel")
#: Stores whose arrays sum to less than this are hashed in full on open (``verify="auto"``).
AUTO_VERIFY_BYTES = 512 * 1024 * 1024
_HASH_BLOCK = 16 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """Stream a file through sha256 in 16 MiB blocks (memory stays flat for any file size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _array_meta(path: Path) -> dict[str, Any]:
    arr = np.load(path, mmap_mode="r")
    return {"file": path.name, "dtype": str(arr.dtype), "shape": list(arr.shape), "sha256": sha256_file(path)}


class StoreWriter:
    """Builds a store in a temporary directory and renames it into place on :meth:`commit`.

    Use :func:`write_store` for in-memory arrays; use this class directly when arrays are produced in
    chunks (``create`` returns a writable memory map, so an edge list larger than memory is filled
    without holding it).
    """

    def __init__(self, out: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        self.out = Path(out)
        check_output(self.out, overwrite=overwrite)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.overwrite = overwrite
        self.tmp = temp_sibling(self.out)
        self.meta: dict[str, Any] = {}
        self._arrays: list[str] = []

    def add(self, name: str, array: np.ndarray) -> None:
        """Write ``array`` as ``name.npy``."""
        np.save(self.tmp / f"{name}.npy", np.ascontiguousarray(array))
        self._arrays.append(name)

    def create(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.memmap:
        """Create ``name.npy`` and return it as a writable memory map to be filled in chunks."""
        self._arrays.append(name)
        return new_map(self.tmp / f"{name}.npy", shape, dtype, "free space or write the store elsewhere")

    def abort(self) -> None:
        """Remove everything written so far."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, *, num_nodes: int, num_edges: int, **meta: Any) -> Path:
        """Add the reverse CSR if missing, hash every array, write the manifest and rename into place."""
        if "rev_indptr" not in self._arrays and "indptr" in self._arrays:
            indptr = np.load(self.tmp / "indptr.npy", mmap_mode="r")
            indices = np.load(self.tmp / "indices.npy", mmap_mode="r")
            for name, arr in zip(("rev_indptr", "rev_indices", "rev_perm"),
                                 build_reverse_csr(indptr, indices, num_nodes)):
                self.add(name, arr)
        STORE_MANIFEST.write(self.tmp, {
            "num_nodes": int(num_nodes),
            "num_edges": int(num_edges),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **meta,
            "arrays": {name: _array_meta(self.tmp / f"{name}.npy") for name in sorted(set(self._arrays))},
        })
        replace_dir(self.tmp, self.out)
        return self.out


@contextmanager
def store_writer(out: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[StoreWriter]:
    """Context manager around :class:`StoreWriter` that aborts (removes the temp dir) on any error."""
    w = StoreWriter(out, overwrite=overwrite)
    try:
        yield w
    except BaseException:
        w.abort()
        raise


def write_store(
    out: str | os.PathLike[str],
    *,
    indptr: np.ndarray,
    indices: np.ndarray,
    x: np.ndarray | None = None,
    y: np.ndarray | None = None,
    splits: dict[str, np.ndarray] | None = None,
    split_sets: np.ndarray | None = None,
    edge_weight: np.ndarray | None = None,
    edge_feat: np.ndarray | None = None,
    name: str = "graph",
    task: str | None = None,
    num_classes: int | None = None,
    source: dict[str, Any] | None = None,
    node_ids: np.ndarray | None = None,
    overwrite: bool = False,
) -> Path:
    """Validate and write a store from in-memory arrays (CSR of in-edges: row = destination).

    Args:
        out: Store directory to create.
        indptr: ``int64 [N+1]`` row pointers of the in-edge CSR.
        indices: ``int64 [E]`` source node of each in-edge.
        x: Node features ``[N, F]`` (stored as float32), or None for a featureless graph.
        y: Labels: ``int [N]`` (multiclass/binary; -1 = unlabeled) or ``[N, C]`` 0/1 (multilabel).
        splits: ``{"train"|"val"|"test": node ids}``.
        split_sets: ``int8 [S, N]`` fixed splits (:data:`SPLIT_CODES`; e.g. Platonov et al.'s ten masks), of
            which ``splits`` is normally the first; ``--split-seed K`` trains on set ``K``.
        edge_weight: ``[E]`` weights in CSR edge order.
        edge_feat: ``[E, D]`` edge features in CSR edge order.
        name: Dataset name recorded in the manifest.
        task: ``multiclass|binary|multilabel``; inferred from ``y`` when None.
        num_classes: Number of classes (inferred from ``y`` when None).
        source: Provenance recorded in the manifest (importer, file, options).
        node_ids: ``int [N]``: each node's id in the data it was imported from, where the import renumbered
            (``--lcc``); written as ``node_ids.npy``.
        overwrite: Replace an existing store (default: False).
    """
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    n = int(indptr.shape[0] - 1)
    e = int(indices.shape[0])
    validate_arrays(n, indptr, indices, x=x, y=y, splits=splits, split_sets=split_sets, edge_weight=edge_weight,
                    edge_feat=edge_feat)
    if node_ids is not None and np.asarray(node_ids).shape != (n,):
        raise TrellisUserError(f"node_ids has shape {np.asarray(node_ids).shape}; it must hold one id per node ({n})")
    inferred_task, inferred_classes = label_meta(y)
    task = task or inferred_task
    num_classes = inferred_classes if num_classes is None else num_classes
    with store_writer(out, overwrite=overwrite) as w:
        w.add("indptr", indptr)
        w.add("indices", indices)
        if edge_weight is not None:
            w.add("edge_weight", np.asarray(edge_weight, dtype=np.float32))
        if edge_feat is not None:
            ef = np.asarray(edge_feat, dtype=np.float32)
            w.add("edge_feat", ef.reshape(e, -1))
        if x is not None:
            w.add("x", np.asarray(x, dtype=np.float32))
        if y is not None:
            w.add("y", np.asarray(y, dtype=np.int64 if y.ndim == 1 else np.float32))
        for split, ids in (splits or {}).items():
            w.add(f"{split}_idx", np.asarray(ids, dtype=np.int64))
        if split_sets is not None:
            w.add("split_sets", np.asarray(split_sets, dtype=np.int8))
        if node_ids is not None:
            w.add("node_ids", np.asarray(node_ids, dtype=np.int64))
        return w.commit(num_nodes=n, num_edges=e, name=name, task=task, num_classes=num_classes,
                        source=source or {})


#: Row norms ``||x||_2 / ||x||_1`` below this mean rows of more than ~100 active words, where L1
#: normalization shrinks every input so far that training stalls (see :func:`feature_norm_of`).
L1_TOO_SMALL = 0.1


def feature_norm_of(x: np.ndarray, sample_rows: int = 20_000, sample_values: int = 1 << 24) -> tuple[str, str]:
    """``--feature-norm auto``: ``row``, ``l2`` or ``none`` from what the features look like, and why.

    * Signed or mostly non-zero features (embeddings, measurements, the generators' Gaussian features) are
      left alone: scaling a row would erase magnitudes that carry information.
    * Non-negative features that are mostly zeros are bag-of-words or counts. Their rows get the GCN paper's
      L1 normalization, unless an L1-normalized row would be tiny: its L2 norm is ``||x||_2 / ||x||_1``
      (``1/sqrt(words)`` for binary rows), and below :data:`L1_TOO_SMALL` (Amazon Computers' ~200-word rows:
      0.07) Adam's coupled L2 penalty outweighs the data gradient and training stalls — measured on
      Computers with the GCN paper's settings, test accuracy 52.1 (row) vs 76.7 ± 3.9 (none, single runs
      from 33.6 in earlier sessions) vs 81.0 ± 0.9 (l2). Such rows are scaled to unit L2 norm instead.

    Only evenly spaced rows are read, at most ``sample_rows`` of them and ``sample_values`` values, a block of
    rows at a time: a memory-mapped store is not read whole, and the check holds a few MiB whatever the width
    (it runs inside ``--memory-budget`` runs; 20,000 rows of Coauthor CS's 6,805 words were 1 GB in float64).
    """
    n = x.shape[0]
    width = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    if n == 0 or width == 0:
        return "none", "no feature rows"
    step = max(1, n // sample_rows, -(-n * width // sample_values))
    picked = np.arange(0, n, step)
    block = max(1, (1 << 20) // width)  # rows per block: about 8 MiB of float64
    zeros, negative = 0, False
    l1, l2 = np.empty(len(picked)), np.empty(len(picked))
    for a in range(0, len(picked), block):
        rows = np.asarray(x[picked[a:a + block]], dtype=np.float64).reshape(-1, width)
        zeros += int(np.count_nonzero(rows == 0))
        negative = negative or bool((rows < 0).any())
        l1[a:a + block] = rows.sum(axis=1)
        l2[a:a + block] = np.sqrt((rows * rows).sum(axis=1))
    zero = zeros / (len(picked) * width)
    if negative or zero < 0.5:
        return "none", (f"{'signed' if negative else 'dense'} features ({100 * (1 - zero):.0f}% non-zero): "
                        "left as they are")
    ok = l1 > 0
    ratio = float(np.median(l2[ok] / l1[ok])) if ok.any() else 1.0
    if ratio >= L1_TOO_SMALL:
        return "row", f"non-negative sparse rows (bag-of-words), median L2/L1 {ratio:.3f}: L1 row normalization"
    return "l2", (f"non-negative sparse rows with many active entries (median L2/L1 {ratio:.3f} < {L1_TOO_SMALL}): "
                  "L1 would shrink them too far, unit L2 norm instead")


def label_meta(y: np.ndarray | None) -> tuple[str | None, int | None]:
    """``(task, num_classes)`` of labels as the manifest records them (``(None, None)`` without labels)."""
    if y is None:
        return None, None
    task = infer_task(y)
    if y.ndim == 2:
        return task, int(y.shape[1])
    return task, int(np.max(y)) + 1 if (y >= 0).any() else 0


def infer_task(y: np.ndarray) -> str:
    """Infer the task from labels, the rule the manifest's ``task`` records.

    An ``[N, C]`` matrix is ``multilabel``; an integer vector whose labelled values (``>= 0``) are
    exactly 0 and 1 is ``binary``; any other vector is ``multiclass``. Two values other than 0/1 (say
    1 and 2) stay multiclass: which one is "positive" is the user's call, made by relabelling.
    """
    if y.ndim == 2:
        return "multilabel"
    values = np.unique(y[y >= 0])
    return "binary" if values.size == 2 and values[0] == 0 and values[1] == 1 else "multiclass"


def validate_arrays(
    n: int,
    indptr: np.ndarray,
    indices: np.ndarray,
    *,
    x: np.ndarray | None = None,
    y: np.ndarray | None = None,
    splits: dict[str, np.ndarray] | None = None,
    split_sets: np.ndarray | None = None,
    edge_weight: np.ndarray | None = None,
    edge_feat: np.ndarray | None = None,
    where: str = "input",
) -> None:
    """Check arrays for the errors users make; raise :class:`TrellisUserError` naming what and where."""
    if n <= 0:
        raise TrellisUserError(f"{where}: the graph has no nodes; give at least one node")
    if indptr[0] != 0 or indptr[-1] != indices.shape[0] or np.any(np.diff(indptr) < 0):
        raise TrellisUserError(f"{where}: CSR indptr is not monotone from 0 to the edge count")
    if indices.size:
        bad = np.flatnonzero((indices < 0) | (indices >= n))
        if bad.size:
            raise TrellisUserError(
                f"{where}: edge {int(bad[0])} has node id {int(indices[bad[0]])} outside [0, {n}); "
                "renumber nodes to 0..N-1 or pass the right node count"
            )
    e = indices.shape[0]
    for label, arr, rows in (("features", x, n), ("labels", y, n), ("edge weights", edge_weight, e),
                             ("edge features", edge_feat, e)):
        if arr is None:
            continue
        if arr.shape[0] != rows:
            raise TrellisUserError(
                f"{where}: {label} have {arr.shape[0]} rows but the graph has {rows} "
                f"{'nodes' if rows == n and label in ('features', 'labels') else 'edges'}; "
                "give one row per node/edge"
            )
        if np.issubdtype(arr.dtype, np.floating):
            finite = np.isfinite(arr)
            if not finite.all():
                row = int(np.argwhere(~finite)[0][0])
                raise TrellisUserError(f"{where}: {label} row {row} contains NaN or Inf; clean or impute it")
    for split, ids in (splits or {}).items():
        if split not in SPLITS:
            raise TrellisUserError(f"{where}: unknown split {split!r}; use one of {', '.join(SPLITS)}")
        ids = np.asarray(ids)
        if ids.size and (not np.issubdtype(ids.dtype, np.integer)):
            raise TrellisUserError(f"{where}: {split} split ids must be integers")
        bad = np.flatnonzero((ids < 0) | (ids >= n))
        if bad.size:
            raise TrellisUserError(
                f"{where}: {split} split row {int(bad[0])} has node id {int(ids[bad[0]])} outside [0, {n}); "
                "split files must hold node ids of this graph"
            )
        if y is not None and y.ndim == 1 and ids.size and (np.asarray(y)[ids] < 0).any():
            node = int(ids[np.argmax(np.asarray(y)[ids] < 0)])
            raise TrellisUserError(f"{where}: {split} node {node} has no label (-1); every split node needs a "
                                   "class id: label it or leave it out of the split")
    named = [(k, np.asarray(v)) for k, v in (splits or {}).items()]
    for i, (a, ia) in enumerate(named):
        for b, ib in named[i + 1:]:
            both = np.intersect1d(ia, ib)
            if both.size:
                raise TrellisUserError(f"{where}: node {int(both[0])} is in both the {a} and the {b} split "
                                       f"({both.size} shared node{'s' if both.size > 1 else ''}); splits must not "
                                       "overlap")
    if split_sets is not None:
        sets = np.asarray(split_sets)
        if sets.ndim != 2 or sets.shape[1] != n:
            raise TrellisUserError(f"{where}: split sets have shape {tuple(sets.shape)}; they must be [sets, {n}]")
        if sets.size and (sets.min() < 0 or sets.max() > max(SPLIT_CODES.values())):
            raise TrellisUserError(f"{where}: split set codes must be 0 (no split), 1 (train), 2 (val) or 3 (test)")


#: Elements per block of the checks at open (about 32 MiB of int64).
CHECK_BLOCK = 1 << 22


def _blocks(length: int, step: int) -> Iterator[tuple[int, int]]:
    """``[a, b)`` blocks of ``step`` covering ``range(length)``."""
    for a in range(0, length, step):
        yield a, min(a + step, length)


class _OptionalArray:
    """An optional store array read as an attribute named like it: ``store.get(name)``, None when absent."""

    def __init__(self, *, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _OptionalArray: ...

    @overload
    def __get__(self, obj: GraphStore, owner: type | None = None) -> np.ndarray | None: ...

    def __get__(self, obj: GraphStore | None, owner: type | None = None) -> np.ndarray | None | _OptionalArray:
        return self if obj is None else obj.get(self.name)


class GraphStore:
    """A read-only, memory-mapped view of a store directory.

    Arrays are opened lazily with ``np.load(mmap_mode="r")``: nothing is read until used. Opening
    checks that every file in the manifest exists with the recorded dtype and shape; with
    ``verify=True`` (or ``"auto"`` on stores below 512 MiB) it also checks every sha256.
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool | str = "auto") -> None:
        self.path = Path(path)
        self.manifest: dict[str, Any] = STORE_MANIFEST.read(self.path)
        self._cache: dict[str, np.ndarray] = {}
        self._feature_norm: str | None = None
        self._feature_density: float | None = None
        self._check(verify)

    def _check(self, verify: bool | str) -> None:
        arrays = self.manifest["arrays"]
        total = 0
        for name, meta in arrays.items():
            if meta.get("moved_to"):  # kept in the manifest (and the checksum), stored in a layout now
                continue
            fpath = self.path / meta["file"]
            if not fpath.is_file():
                raise TrellisUserError(f"{fpath}: array {name!r} listed in the manifest is missing; re-import")
            try:
                arr = np.load(fpath, mmap_mode="r")
            except (ValueError, OSError) as exc:
                raise TrellisUserError(f"{fpath}: unreadable ({exc}); the store is damaged, re-import") from exc
            if str(arr.dtype) != meta["dtype"] or list(arr.shape) != meta["shape"]:
                raise TrellisUserError(
                    f"{fpath}: dtype/shape {arr.dtype}{list(arr.shape)} do not match the manifest "
                    f"({meta['dtype']}{meta['shape']}); the store is damaged, re-import"
                )
            total += fpath.stat().st_size
        self._check_shapes()
        if verify == "auto":
            verify = total <= AUTO_VERIFY_BYTES
        if verify:
            self.verify()
            self._check_contents()

    def _damaged(self, what: str) -> TrellisUserError:
        return TrellisUserError(f"{self.path}: {what}; the store is damaged, re-import it")

    def _check_shapes(self) -> None:
        """The arrays agree with each other and the node and edge counts (manifest shapes and two reads).

        Why: each array is checked against its own manifest entry only, so a store whose arrays disagree (a hand
        edit, a partial copy, bit rot in a store too large to hash at open) reached the kernels: tracebacks,
        and METIS aborted the process on a non-monotone CSR.
        """
        m = self.manifest
        for key in ("num_nodes", "num_edges"):
            if not isinstance(m.get(key), int) or m[key] < 0:
                raise self._damaged(f"manifest.json has no valid {key!r}")
        n, e = int(m["num_nodes"]), int(m["num_edges"])
        rows = {"indptr": n + 1, "rev_indptr": n + 1, "indices": e, "rev_indices": e, "rev_perm": e, "x": n,
                "y": n, "edge_weight": e, "edge_feat": e, "node_ids": n}
        arrays = m["arrays"]
        for name in ("indptr", "indices"):
            if name not in arrays:
                raise self._damaged(f"manifest.json lists no {name!r} array")
        for name, want in rows.items():
            meta = arrays.get(name)
            if meta is not None and (not meta["shape"] or meta["shape"][0] != want):
                raise self._damaged(f"array {name!r} has {meta['shape'][0] if meta['shape'] else 0} rows but the "
                                    f"graph has {n} nodes and {e} edges")
        for name in ("indptr", "rev_indptr"):
            if name in arrays:
                ptr = self.array(name)
                if int(ptr[0]) != 0 or int(ptr[-1]) != e:
                    raise self._damaged(f"{name} runs from {int(ptr[0])} to {int(ptr[-1])}, not from 0 to the "
                                        f"{e} edges")

    def _check_contents(self) -> None:
        """Every array's values, where the store is read whole anyway (hashed at open).

        The CSR and its reverse (monotone, ids in range, the reverse the same edges), features finite, splits valid.
        Block by block (about 32 MiB each): a whole-array temporary at every open would raise the peak memory of
        budgeted runs (a boolean copy of Coauthor CS's features alone is 125 MiB).
        """
        n = self.num_nodes
        indptr, indices = self.array("indptr"), self.array("indices")
        self._check_csr(indptr, indices, "its CSR")
        if self.has("x") and not self.moved_to("x"):
            x = self.array("x")
            rows = max(1, CHECK_BLOCK // max(1, int(np.prod(x.shape[1:]))))
            if np.issubdtype(x.dtype, np.floating):
                for a, b in _blocks(x.shape[0], rows):
                    finite = np.isfinite(x[a:b]).reshape(b - a, -1).all(axis=1)
                    if not finite.all():
                        raise self._damaged(f"features row {a + int(np.argmin(finite))} contains NaN or Inf")
        try:  # labels and splits: O(N), checked as at import
            validate_arrays(n, np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), y=self.get("y"),
                            where="its arrays", splits={k: self.array(f"{k}_idx") for k in SPLITS
                                                        if self.has(f"{k}_idx")})
        except TrellisUserError as exc:
            raise self._damaged(str(exc)) from None
        if self.has("rev_indptr"):
            rp, ri, perm = self.reverse_csr()
            self._check_csr(rp, ri, "its reverse CSR")
            for a, b in _blocks(perm.shape[0], CHECK_BLOCK):  # the reverse holds the CSR's edges, each once
                p = np.asarray(perm[a:b])
                if p.size and (p.min() < 0 or p.max() >= perm.shape[0]):
                    raise self._damaged("its reverse CSR's edge ids are out of range")
                src = np.searchsorted(rp, np.arange(a, b), side="right") - 1
                dst = np.searchsorted(indptr, p, side="right") - 1
                if not (np.array_equal(np.asarray(indices)[p], src) and np.array_equal(dst, np.asarray(ri[a:b]))):
                    raise self._damaged("its reverse CSR does not hold the same edges as its CSR")

    def _check_csr(self, indptr: np.ndarray, indices: np.ndarray, what: str) -> None:
        """``indptr`` monotone, every id of ``indices`` a node (block by block)."""
        n = self.num_nodes
        for a, b in _blocks(indptr.shape[0] - 1, CHECK_BLOCK):
            if np.any(np.diff(indptr[a:b + 1]) < 0):
                raise self._damaged(f"{what}: indptr is not monotone from 0 to the edge count")
        for a, b in _blocks(indices.shape[0], CHECK_BLOCK):
            blk = np.asarray(indices[a:b])
            bad = (blk < 0) | (blk >= n)
            if bad.any():
                i = int(np.argmax(bad))
                raise self._damaged(f"{what}: edge {a + i} has node id {int(blk[i])} outside [0, {n})")

    def verify(self) -> None:
        """Hash every array and compare with the manifest (raises on the first mismatch)."""
        for name, meta in self.manifest["arrays"].items():
            if meta.get("moved_to"):
                continue
            fpath = self.path / meta["file"]
            if sha256_file(fpath) != meta["sha256"]:
                raise TrellisUserError(
                    f"{fpath}: sha256 does not match the manifest (array {name!r} was modified or "
                    "damaged); re-import the store"
                )

    # ---- metadata -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Dataset name from the manifest (the directory name when none is recorded)."""
        return str(self.manifest.get("name", self.path.name))

    num_nodes = ManifestField(int, "num_nodes", doc="Number of nodes ``N``.")
    num_edges = ManifestField(int, "num_edges", doc="Number of stored (directed) edges ``E``.")

    @property
    def task(self) -> str | None:
        """Label task recorded at import (``multiclass``, ``binary``, ``multilabel``), or None without labels."""
        return self.manifest.get("task")

    @property
    def num_classes(self) -> int | None:
        """Number of classes (label columns for multilabel) recorded at import, or None without labels."""
        nc = self.manifest.get("num_classes")
        return None if nc is None else int(nc)

    @property
    def num_features(self) -> int:
        """Feature width ``F`` of ``x``, or 0 for a featureless store."""
        meta = self.manifest["arrays"].get("x")
        return 0 if meta is None else int(meta["shape"][1])

    @property
    def preferred_feature_norm(self) -> str:
        """What ``--feature-norm auto`` resolves to for this store: ``row``, ``l2`` or ``none``.

        Decided by the features' content (:func:`feature_norm_of`), not by the importer; a manifest may still
        state ``feature_norm``. The decision is cached per store object.
        """
        explicit = self.manifest.get("feature_norm")
        if explicit in ("row", "l2", "none"):
            return str(explicit)
        if self.moved_to("x") is not None:
            return "none"  # recorded by --move-features before the rows left; older moves default to none
        if self._feature_norm is None:
            self._feature_norm = feature_norm_of(self.x)[0] if self.x is not None else "none"
        return self._feature_norm

    @property
    def feature_density(self) -> float | None:
        """The share of the features' values that are non-zero, from evenly spaced rows; None without features.

        At most ``2**22`` values are read, so a memory-mapped store is not read whole. Recorded in the manifest
        when the features move to a layout (``--move-features``), as the feature norm is. The batch strategies
        give a message-passing model's first layer sparse rows when this is at most
        :data:`trellis.ops.sparse_rows.MAX_DENSITY` (bag-of-words features), as full-batch does.
        """
        recorded = self.manifest.get("feature_density")
        if recorded is not None:
            return float(recorded)
        if self.moved_to("x") is not None:
            return None  # moved before the density was recorded: taken as dense
        if self._feature_density is None and self.x is not None:
            x = self.x
            n, width = x.shape[0], int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
            if n and width:
                picked = np.arange(0, n, max(1, -(-n * width // (1 << 22))))
                block = max(1, (1 << 20) // width)
                nonzero = sum(int(np.count_nonzero(x[picked[a:a + block]])) for a in range(0, len(picked), block))
                self._feature_density = nonzero / (len(picked) * width)
        return self._feature_density

    @property
    def checksum(self) -> str:
        """One digest of all array digests: identifies the store's content (caches key on it)."""
        h = hashlib.sha256()
        for name in sorted(self.manifest["arrays"]):
            h.update(name.encode())
            h.update(self.manifest["arrays"][name]["sha256"].encode())
        return h.hexdigest()

    def move_features(self, layout: str | os.PathLike[str]) -> int:
        """Record that ``x`` now lives only in ``layout`` and delete the store's copy; returns the bytes freed.

        Why: a graph beyond memory is also large on disk, and the partition buffer reads the layout's per-part
        features only; two copies would double the disk a run needs. The manifest keeps ``x``'s entry (so the
        store's checksum, which layouts and caches are keyed on, is unchanged) marked ``moved_to``, and records
        the resolved ``feature_norm`` and ``feature_density`` (deciding them later would need the rows). The
        manifest is replaced atomically before the file is removed, so an interruption leaves at worst an
        orphaned file.
        """
        from trellis.utils.atomic import write_json_atomic

        meta = self.manifest["arrays"].get("x")
        if meta is None or meta.get("moved_to"):
            return 0
        manifest = json.loads(json.dumps(self.manifest))
        manifest.setdefault("feature_norm", self.preferred_feature_norm)
        if self.feature_density is not None:
            manifest.setdefault("feature_density", self.feature_density)
        manifest["arrays"]["x"]["moved_to"] = str(Path(layout).resolve())
        fpath = self.path / meta["file"]
        size = fpath.stat().st_size
        write_json_atomic(self.path / "manifest.json", manifest)
        self._cache.pop("x", None)
        fpath.unlink()
        self.manifest = manifest
        return size

    # ---- arrays ---------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether the manifest lists array ``name`` (optional arrays such as ``x`` or ``val_idx`` may be absent)."""
        return name in self.manifest["arrays"]

    def moved_to(self, name: str) -> str | None:
        """The layout directory array ``name`` was moved to (``trellis partition --move-features``), or None."""
        meta = self.manifest["arrays"].get(name)
        return None if meta is None else meta.get("moved_to")

    def array(self, name: str) -> np.ndarray:
        """Memory-mapped array ``name`` (read-only); raises KeyError if absent.

        Raises:
            TrellisUserError: The array was moved into a partitioned layout (names the layout and what reads it).
        """
        if name not in self._cache:
            meta = self.manifest["arrays"][name]
            if meta.get("moved_to"):
                raise TrellisUserError(f"{self.path}: its {name!r} array was moved to the partitioned layout "
                                       f"{meta['moved_to']} (`trellis partition --move-features`), and this reads "
                                       f"the store's copy; use what reads the layout (--parts-dir "
                                       f"{meta['moved_to']}: training, and predicting with a mini- or "
                                       "cluster-batch run), or re-import the store")
            self._cache[name] = np.load(self.path / meta["file"], mmap_mode="r")
        return self._cache[name]

    def get(self, name: str) -> np.ndarray | None:
        """Memory-mapped array ``name``, or None when the store does not have it."""
        return self.array(name) if self.has(name) else None

    @property
    def indptr(self) -> np.ndarray:
        """``int64 [N+1]`` row pointers of the in-edge CSR (row = destination node)."""
        return self.array("indptr")

    @property
    def indices(self) -> np.ndarray:
        """``int64 [E]`` source node of each in-edge, in CSR order."""
        return self.array("indices")

    x = _OptionalArray(doc="``float32 [N, F]`` node features, or None for a featureless store.")
    y = _OptionalArray(
        doc="Labels: ``int64 [N]`` (multiclass/binary; -1 = unlabelled) or ``[N, C]`` (multilabel), or None.")
    edge_weight = _OptionalArray(doc="``float32 [E]`` edge weights in CSR edge order, or None when unweighted.")
    edge_feat = _OptionalArray(doc="``float32 [E, D]`` edge features in CSR edge order, or None.")
    split_sets = _OptionalArray(doc="``int8 [S, N]`` fixed splits (:data:`SPLIT_CODES`), or None.")

    def split(self, name: str) -> np.ndarray | None:
        """Node ids of split ``train|val|test`` or None when the store has no such split."""
        return self.get(f"{name}_idx")

    def reverse_csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rev_indptr, rev_indices, rev_perm)`` cached in the store at write time."""
        return self.array("rev_indptr"), self.array("rev_indices"), self.array("rev_perm")

    def nbytes(self) -> int:
        """Bytes on disk of the arrays the store holds (an array moved to a layout is counted there)."""
        return sum((self.path / m["file"]).stat().st_size for m in self.manifest["arrays"].values()
                   if not m.get("moved_to"))

    def __repr__(self) -> str:
        return (f"GraphStore({str(self.path)!r}, nodes={self.num_nodes}, edges={self.num_edges}, "
                f"features={self.num_features}, classes={self.num_classes}, task={self.task})")


def open_store(path: str | os.PathLike[str], verify: bool | str = "auto") -> GraphStore:
    """Open a store directory (see :class:`GraphStore`).

    Raises:
        TrellisUserError: ``path`` is not a path: a graph object (a PyG ``Data``, arrays) is named, with how to
            write it as a store first (a layout and a pre-propagation cache refer to their store on disk).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TrellisUserError(f"a store is a directory path, not a {type(path).__name__}; write the graph as a "
                               "store first (trellis.data.from_pyg(data, out=DIR), from_arrays(..., out=DIR)) and "
                               "pass DIR")
    return GraphStore(path, verify=verify)
