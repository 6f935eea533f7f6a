"""The pre-propagation cache (``PP_DIR``): ``[X, BX, …, B^R X]`` on disk, keyed and reused.

Layout::

    PP_DIR/
      manifest.json   store checksum, operator key, R, row order, split row ranges, file layout
      hop_0.npy …     float32 [M, F] per hop; data starts at a 4096-byte boundary (chunk-aligned)
      rows.npy        int64 [M]: the node id of each cache row
      y.npy           labels of each cache row (training needs no store access)
      COMPLETE        written last: the sha256 of manifest.json; without it the cache is incomplete

Why this row order ("split-major"): rows are ``train`` (shuffled once with a recorded seed), then
``val``, ``test``, then every other node. Each split is then one contiguous row range of every hop file,
so chunk reshuffling (PP-GNN §4.2) and storage-backed loading (§4.3) read whole contiguous chunks, and
keeping only split rows (§6.4, ``split_rows_only``) is a truncation. The one-time shuffle of the training
rows makes a chunk a random sample even when the store's node order follows classes or communities (a
generated SBM, a crawl order); otherwise chunk = batch would give single-class batches.

Why per-hop files: they are written one hop at a time while the next hop is being computed, and the
storage-backed loader issues independent reads per hop (PP-GNN §4.3 splits hops for parallel access).

Why a marker and a temporary directory: a build is written to a hidden sibling directory and renamed
into place after the ``COMPLETE`` marker, so a killed run never leaves a ``PP_DIR`` that looks complete;
a ``PP_DIR`` without a valid marker is treated as interrupted and rebuilt, and a complete one built from
another store or other settings is refused rather than silently mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.store import FORMAT as STORE_FORMAT
from trellis.data.store import GraphStore, open_store
from trellis.errors import TrellisUserError
from trellis.ops.propagate import (
    FEATURE_NORMS,
    KERNEL,
    OperatorSpec,
    Scratch,
    default_block_rows,
    gather_rows,
    iter_hops,
    normalize_rows,
)
from trellis.utils.atomic import MANIFEST, replace_dir, temp_sibling
from trellis.utils.caller import keeps_caller_state
from trellis.utils.manifest import PP_FORMAT, ManifestField, what_it_is
from trellis.utils.sizes import format_size

#: The cache's manifest: format, version and the messages of a missing or foreign one.
PP_MANIFEST = PP_FORMAT
FORMAT = PP_MANIFEST.name
VERSION = PP_MANIFEST.version
MARKER = "COMPLETE"
#: Byte alignment of every hop file's data (page size: chunk reads start on page boundaries).
ALIGN = 4096
SPLITS = ("train", "val", "test")


# ---------------------------------------------------------------------------------------------------
# aligned .npy files
# ---------------------------------------------------------------------------------------------------


def npy_header(shape: tuple[int, ...], dtype: Any, align: int = ALIGN) -> bytes:
    """A version-1.0 ``.npy`` header padded so the data starts at a multiple of ``align`` bytes.

    The format allows any padding that keeps the total a multiple of 64, so ``np.load`` reads these
    files unchanged; the alignment lets chunk reads (and ``O_DIRECT`` readers) start on page boundaries.
    """
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
         "shape": tuple(int(s) for s in shape)}
    body = repr(d).encode("latin1")
    magic = b"\x93NUMPY\x01\x00"
    used = len(magic) + 2 + len(body) + 1
    body += b" " * ((-used) % align) + b"\n"
    return magic + struct.pack("<H", len(body)) + body


def create_aligned_npy(path: Path, shape: tuple[int, ...], dtype: Any, align: int = ALIGN) -> int:
    """Create ``path`` as an aligned ``.npy`` of ``shape`` (sparse, zero-filled); return the data offset."""
    header = npy_header(shape, dtype, align)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + nbytes)
    return len(header)


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """Write all of ``data``'s bytes at ``offset`` (loops over short writes)."""
    mv = np.ascontiguousarray(data).data.cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


# ---------------------------------------------------------------------------------------------------
# settings and the cache view
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PPSettings:
    """What a cache is built with.

    Attributes:
        operator: The propagation operator.
        hops: ``R >= 1``.
        split_rows_only: Keep only rows of nodes in some split (None = automatic: keep all rows unless
            only the split rows fit the free disk space).
        shuffle_seed: Seed of the one-time shuffle of training rows (default: 0).
        feature_norm: ``auto``, ``none``, ``row`` or ``l2`` (L1 or L2 row normalization of X before
            propagating; auto = chosen from the features' content, the full-batch trainer's rule) (default: auto).
    """

    operator: OperatorSpec = field(default_factory=OperatorSpec)
    hops: int = 3
    split_rows_only: bool | None = None
    shuffle_seed: int = 0
    feature_norm: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.hops, bool) or not isinstance(self.hops, int) or self.hops < 1:
            raise TrellisUserError(f"--hops {self.hops!r} must be an integer >= 1 (R = number of propagation steps)")
        if isinstance(self.shuffle_seed, bool) or not isinstance(self.shuffle_seed, int) or self.shuffle_seed < 0:
            raise TrellisUserError(f"--shuffle-seed {self.shuffle_seed!r} must be an integer >= 0")
        if self.feature_norm not in FEATURE_NORMS:
            raise TrellisUserError(
                f"unknown --feature-norm {self.feature_norm!r}; use one of {', '.join(FEATURE_NORMS)}")

    def key(self) -> dict[str, Any]:
        """The settings that determine the cache's content (row pruning is checked separately)."""
        return {**self.operator.key(), "hops": int(self.hops), "shuffle_seed": int(self.shuffle_seed),
                "feature_norm": self.feature_norm}

    def resolved(self, store: GraphStore) -> PPSettings:
        """These settings with ``feature_norm="auto"`` resolved against ``store``'s features."""
        if self.feature_norm != "auto" or store.x is None:
            return self
        return replace(self, feature_norm=store.preferred_feature_norm)


def _describe_key(key: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in key.items())


class PPCache:
    """A read-only view of a complete ``PP_DIR`` (open it with :func:`open_pp`).

    Attributes:
        path: The directory.
        manifest: Parsed ``manifest.json``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        state = inspect_pp(self.path)
        if state != "complete":
            raise TrellisUserError(_state_message(self.path, state))
        self.manifest: dict[str, Any] = PP_MANIFEST.read(self.path)
        self._cache: dict[str, np.ndarray] = {}
        self._pos: np.ndarray | None = None

    # ---- metadata ---------------------------------------------------------------------------------
    hops = ManifestField(int, "settings", "hops", doc="``R``: the cache holds hops ``0..R``.")
    num_features = ManifestField(int, "num_features", doc="Features per row of every hop.")
    num_rows = ManifestField(
        int, "num_rows", doc="Rows per hop (split rows first; every node unless built with split rows only).")
    num_nodes = ManifestField(int, "store", "num_nodes", doc="Nodes of the store the cache was built from.")
    dtype = ManifestField(np.dtype, "dtype", doc="Element type of the hop files.")

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of one hop."""
        return self.num_features * self.dtype.itemsize

    split_rows_only = ManifestField(
        bool, "split_rows_only", doc="Whether only the split rows were propagated (no rows for other nodes).")
    store_checksum = ManifestField(
        str, "store", "checksum", doc="Checksum of the store the cache was built from (reuse is keyed on it).")

    @property
    def operator(self) -> OperatorSpec:
        """The propagation operator the hops were built with."""
        key = self.manifest["settings"]
        return OperatorSpec(name=key["operator"], **{k: key[k] for k in ("alpha", "t", "iters") if k in key})

    @property
    def feature_norm(self) -> str:
        """The feature normalization applied before propagating."""
        return str(self.manifest["settings"].get("feature_norm", "none"))

    @property
    def num_classes(self) -> int | None:
        """Classes of the store's labels (None when unknown)."""
        nc = self.manifest["store"].get("num_classes")
        return None if nc is None else int(nc)

    @property
    def task(self) -> str | None:
        """The store's task (None when unknown)."""
        return self.manifest["store"].get("task")

    def split_range(self, split: str) -> tuple[int, int]:
        """``[a, b)``: the cache rows of ``split`` (empty range when the store has no such split)."""
        a, b = self.manifest["splits"].get(split, (0, 0))
        return int(a), int(b)

    def hop_path(self, r: int) -> Path:
        """The file holding hop ``r``."""
        return self.path / self.manifest["hop_files"][r]["file"]

    def hop_offset(self, r: int) -> int:
        """Byte offset of row 0 of hop ``r`` in its file."""
        return int(self.manifest["hop_files"][r]["offset"])

    def hop(self, r: int) -> np.ndarray:
        """Hop ``r`` as a read-only memory map ``[M, F]``."""
        name = f"hop_{r}"
        if name not in self._cache:
            if not 0 <= r <= self.hops:
                raise TrellisUserError(f"{self.path}: hop {r} is not in 0..{self.hops}")
            self._cache[name] = np.load(self.hop_path(r), mmap_mode="r")
        return self._cache[name]

    @property
    def rows(self) -> np.ndarray:
        """``int64 [M]``: node id of each cache row."""
        if "rows" not in self._cache:
            self._cache["rows"] = np.load(self.path / "rows.npy", mmap_mode="r")
        return self._cache["rows"]

    @property
    def y(self) -> np.ndarray | None:
        """Labels of each cache row (None when the store has none)."""
        if not (self.path / "y.npy").is_file():
            return None
        if "y" not in self._cache:
            self._cache["y"] = np.load(self.path / "y.npy", mmap_mode="r")
        return self._cache["y"]

    def nbytes(self, hops: int | None = None, rows: int | None = None) -> int:
        """Bytes of ``rows`` rows (default: all) of ``hops`` hops (default: all ``R+1``)."""
        h = self.hops + 1 if hops is None else hops
        m = self.num_rows if rows is None else rows
        return int(h) * int(m) * self.row_bytes

    # ---- checks -----------------------------------------------------------------------------------
    def check_store(self, store: GraphStore) -> None:
        """Refuse a cache built from another store (content checksum differs)."""
        if store.checksum != self.store_checksum:
            raise TrellisUserError(
                f"{self.path} was preprocessed from another store (checksum {self.store_checksum[:12]}…, "
                f"built from {self.manifest['store'].get('path')}) than {store.path} "
                f"(checksum {store.checksum[:12]}…); run `trellis preprocess {store.path} --out NEW_DIR` "
                "or `trellis preprocess ... --overwrite` to rebuild it"
            )

    def rows_for_nodes(self, nodes: np.ndarray) -> np.ndarray:
        """Cache row of each node id (first occurrence).

        Raises:
            TrellisUserError: A node's row was pruned (the cache was built with ``--split-rows-only``).
        """
        if self._pos is None:
            pos = np.full(self.num_nodes, -1, dtype=np.int64)
            rows = np.asarray(self.rows)
            pos[rows[::-1]] = np.arange(rows.shape[0] - 1, -1, -1, dtype=np.int64)
            self._pos = pos
        nodes = np.asarray(nodes, dtype=np.int64)
        if nodes.size and (nodes.min() < 0 or nodes.max() >= self.num_nodes):
            raise TrellisUserError(f"node ids must be in [0, {self.num_nodes})")
        out = self._pos[nodes]
        missing = np.flatnonzero(out < 0)
        if missing.size:
            raise TrellisUserError(
                f"{self.path} has no row for node {int(nodes[missing[0]])} ({missing.size} nodes missing): it "
                "was built with --split-rows-only, which keeps only train/val/test rows; rebuild it without "
                "--split-rows-only (`trellis preprocess ... --all-rows --overwrite`) to predict other nodes"
            )
        return out

    def __repr__(self) -> str:
        return (f"PPCache({str(self.path)!r}, {_describe_key(self.manifest['settings'])}, rows={self.num_rows}, "
                f"features={self.num_features})")


def open_pp(path: str | os.PathLike[str], store: GraphStore | None = None) -> PPCache:
    """Open a complete cache; with ``store``, also refuse one built from another store."""
    cache = PPCache(path)
    if store is not None:
        cache.check_store(store)
    return cache


# ---------------------------------------------------------------------------------------------------
# state of a directory
# ---------------------------------------------------------------------------------------------------


def _sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def inspect_pp(path: str | os.PathLike[str]) -> str:
    """Classify ``path``: ``missing``, ``complete``, ``incomplete``, ``store`` or ``foreign``.

    ``complete`` requires the marker to hold the manifest's sha256, every hop file to have the size the
    manifest says, and ``rows.npy`` (and a labelled store's ``y.npy``) to be readable with one entry per
    row (a cache missing its labels trained as if it had none; a damaged ``rows.npy`` crashed predict).
    Anything else with a cache manifest is ``incomplete`` (an interrupted or damaged build).
    An empty directory counts as ``missing``.
    """
    p = Path(path)
    if not p.exists():
        return "missing"
    if not p.is_dir():
        return "foreign"
    mpath = p / MANIFEST
    if not mpath.is_file():
        return "missing" if not any(p.iterdir()) else "foreign"
    raw = mpath.read_bytes()
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError:
        return "foreign"
    if manifest.get("format") == STORE_FORMAT:
        return "store"
    if manifest.get("format") != FORMAT:
        return "foreign"
    marker = p / MARKER
    if manifest.get("version") != VERSION or not marker.is_file():
        return "incomplete"
    try:
        if json.loads(marker.read_text()).get("manifest_sha256") != _sha256_bytes(raw):
            return "incomplete"
        itemsize = np.dtype(manifest["dtype"]).itemsize
        for hf in manifest["hop_files"]:
            want = int(hf["offset"]) + int(manifest["num_rows"]) * int(manifest["num_features"]) * itemsize
            if (p / hf["file"]).stat().st_size != want:
                return "incomplete"
        rows = np.load(p / "rows.npy", mmap_mode="r")  # a missing or damaged file raises: incomplete
        if rows.shape != (int(manifest["num_rows"]),) or rows.dtype.kind not in "iu":
            return "incomplete"
        if manifest["store"].get("task") is not None:  # a labelled store's cache holds its rows' labels
            y = np.load(p / "y.npy", mmap_mode="r")
            if y.ndim < 1 or y.shape[0] != rows.shape[0]:
                return "incomplete"
    except (OSError, KeyError, ValueError, EOFError, json.JSONDecodeError):
        return "incomplete"
    return "complete"


def _state_message(path: Path, state: str) -> str:
    return {
        "missing": f"{path}: no pre-propagated cache here; create it with `trellis preprocess STORE --out {path}`",
        "incomplete": f"{path}: the cache is incomplete (an interrupted `trellis preprocess`?); run "
                      "`trellis preprocess` again with the same --out to redo it",
        "store": f"{path} is a Trellis graph store, not a pre-propagation cache; give another --pp-dir/--out",
        "foreign": f"{path} exists and is not a pre-propagation cache{what_it_is(path)}; give the --pp-dir of a "
                   "`trellis preprocess` output (to build one there, choose another --out)",
    }.get(state, f"{path}: not a complete cache ({state})")



# ---------------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------------


def split_major_rows(store: GraphStore, shuffle_seed: int, *, split_rows_only: bool) -> tuple[
        np.ndarray, dict[str, tuple[int, int]]]:
    """Cache row order: shuffled train, val, test, then (unless ``split_rows_only``) all other nodes."""
    parts: list[np.ndarray] = []
    ranges: dict[str, tuple[int, int]] = {}
    at = 0
    in_split = np.zeros(store.num_nodes, dtype=bool)
    for split in SPLITS:
        ids = store.split(split)
        ids = np.zeros(0, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        if split == "train":
            ids = ids[np.random.default_rng(shuffle_seed).permutation(ids.shape[0])]
        parts.append(ids)
        in_split[ids] = True
        ranges[split] = (at, at + int(ids.shape[0]))
        at += int(ids.shape[0])
    if not split_rows_only:
        parts.append(np.flatnonzero(~in_split).astype(np.int64))
    return np.concatenate(parts), ranges


def estimate_bytes(store: GraphStore, settings: PPSettings, split_rows: int) -> dict[str, int]:
    """Disk bytes of the output (all rows / split rows only) and of the scratch iterates."""
    f = store.num_features
    n = store.num_nodes
    per_hop_all = n * f * 4
    iterates = {"sym": 2, "rw": 2, "ppr": 3, "heat": 4}[settings.operator.name]
    iterates += settings.feature_norm in ("row", "l2")  # the normalized copy of X
    return {
        "all_rows": (settings.hops + 1) * per_hop_all,
        "split_rows": (settings.hops + 1) * split_rows * f * 4,
        "scratch": iterates * per_hop_all,
    }


def build_pp(store: GraphStore, out: str | os.PathLike[str], settings: PPSettings, *,
             block_rows: int | None = None, progress: bool = True, kernel: str | None = None,
             log: Callable[[str], None] | None = print) -> PPCache:
    """Preprocess ``store`` into ``out`` (replacing whatever is there) and return the opened cache.

    Hops are computed in node order into scratch files (:func:`trellis.ops.propagate.iter_hops`) and each
    is copied in cache-row order into its aligned hop file; the whole build lives in a hidden sibling
    directory until the marker is written and it is renamed into place.
    """
    out = Path(out)
    if store.x is None:
        raise TrellisUserError(f"{store.path}: the store has no node features (x); pre-propagation needs them")
    t0 = time.perf_counter()
    settings = settings.resolved(store)
    split_only = settings.split_rows_only
    rows_all, _ = split_major_rows(store, settings.shuffle_seed, split_rows_only=True)
    est = estimate_bytes(store, settings, int(rows_all.shape[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if split_only is None:
        split_only = est["all_rows"] + est["scratch"] > free and est["split_rows"] + est["scratch"] <= free
        if split_only and log:
            log(f"keeping only the {rows_all.shape[0]:,} train/val/test rows: all {store.num_nodes:,} rows "
                f"({_gib(est['all_rows'])}) do not fit the free disk space ({_gib(free)}); "
                "pass --all-rows to insist")
    need = (est["split_rows"] if split_only else est["all_rows"]) + est["scratch"]
    if need > free:
        raise TrellisUserError(
            f"{out.parent}: preprocessing needs about {_gib(need)} of disk (output and scratch) but "
            f"{_gib(free)} is free; free space, lower --hops, or use --split-rows-only"
        )
    rows, ranges = split_major_rows(store, settings.shuffle_seed, split_rows_only=bool(split_only))
    m = int(rows.shape[0])
    f = store.num_features
    tmp = temp_sibling(out, tag="pp-tmp")  # removes a killed writer's first
    try:
        np.save(tmp / "rows.npy", rows)
        y = store.y
        if y is not None:
            np.save(tmp / "y.npy", np.asarray(y)[rows])
        brows = int(block_rows) if block_rows is not None else default_block_rows(f)
        if brows < 1:
            raise TrellisUserError(f"--block-rows {brows} must be >= 1")
        nb_graph = max(1, -(-store.num_nodes // brows))
        nb_out = max(1, -(-m // brows))
        total = settings.hops * settings.operator.passes_per_hop() * nb_graph + (settings.hops + 1) * nb_out
        bar = _progress_bar(total, f"preprocess {settings.operator.name} R={settings.hops}", progress)
        hop_files = []
        x = store.x
        if settings.feature_norm in ("row", "l2"):  # a normalized copy of X is hop 0 and the start of propagation
            x = normalize_rows(x, Scratch(tmp / "scratch").new((store.num_nodes, f)), settings.feature_norm,
                               block_rows=brows)  # blocks of the run's bytes, not 65,536 rows of any width
        try:
            for r, h in iter_hops(store.indptr, store.indices, x, settings.operator, settings.hops,
                                  edge_weight=store.edge_weight, scratch_dir=tmp / "scratch",
                                  block_rows=brows, kernel=kernel, progress=bar):
                name = f"hop_{r}.npy"
                off = create_aligned_npy(tmp / name, (m, f), np.float32)
                _write_rows(tmp / name, off, h, rows, brows, bar)
                hop_files.append({"file": name, "offset": off, "shape": [m, f]})
        finally:
            if bar is not None:
                bar.close()
        shutil.rmtree(tmp / "scratch", ignore_errors=True)
        seconds = time.perf_counter() - t0
        manifest = PP_MANIFEST.manifest({
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "store": {"checksum": store.checksum, "path": str(store.path), "name": store.name,
                      "num_nodes": store.num_nodes, "num_edges": store.num_edges,
                      "num_classes": store.num_classes, "task": store.task,
                      "weighted": store.edge_weight is not None},
            "settings": settings.key(),
            "split_rows_only": bool(split_only),
            "num_rows": m,
            "num_features": f,
            "dtype": "float32",
            "align": ALIGN,
            "row_order": "split-major: train (shuffled with shuffle_seed), val, test, then other nodes",
            "splits": {k: list(v) for k, v in ranges.items()},
            "hop_files": hop_files,
            "build": {"seconds": round(seconds, 3), "kernel": kernel or KERNEL, "block_rows": brows},
        })
        raw = PP_MANIFEST.write(tmp, manifest)
        for fpath in tmp.iterdir():  # data must be on disk before the marker says it is
            fd = os.open(fpath, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        (tmp / MARKER).write_text(json.dumps({"manifest_sha256": _sha256_bytes(raw),
                                              "completed": manifest["created"]}))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PPCache(out)


def _write_rows(path: Path, offset: int, h: np.ndarray, rows: np.ndarray, block_rows: int, bar: Any) -> None:
    """Copy ``h[rows]`` (node order → cache-row order) into the hop file, one block at a time."""
    f = h.shape[1]
    buf = np.empty((min(block_rows, max(1, rows.shape[0])), f), dtype=np.float32)
    src = np.asarray(h)
    row_bytes = f * 4
    fd = os.open(path, os.O_WRONLY)
    try:
        for a in range(0, rows.shape[0], block_rows):
            b = min(a + block_rows, rows.shape[0])
            blk = buf[: b - a]
            gather_rows(src, rows[a:b], blk)
            pwrite_all(fd, blk, offset + a * row_bytes)
            if bar is not None:
                bar.update(1)
    finally:
        os.close(fd)


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (a log file would get one line per update)
    return tqdm(total=total, desc=desc, unit="block", dynamic_ncols=True, disable=None)


def _gib(n: float) -> str:
    return format_size(n, unit="GiB")


def ensure_pp(store: GraphStore | str | os.PathLike[str], out: str | os.PathLike[str], settings: PPSettings, *,
              overwrite: bool = False, block_rows: int | None = None, progress: bool = True,
              kernel: str | None = None, log: Callable[[str], None] | None = print) -> tuple[PPCache, str]:
    """Return a cache for ``(store, settings)`` at ``out``: reuse, build, or rebuild an interrupted one.

    Returns:
        ``(cache, action)`` with action ``reused``, ``built`` or ``rebuilt``.

    Raises:
        TrellisUserError: ``out`` holds a complete cache of another store or other settings (and not
            ``overwrite``), a graph store, or anything else that is not a cache (even with ``overwrite``).
    """
    if not isinstance(store, GraphStore):
        store = open_store(store)
    settings = settings.resolved(store)
    out = Path(out)
    state = inspect_pp(out)
    if state == "store":
        raise TrellisUserError(_state_message(out, state))
    if state == "foreign":  # --overwrite never deletes what is not a cache: a mistyped --out keeps its files
        only = "; --overwrite replaces only a cache" if overwrite else ""
        raise TrellisUserError(_state_message(out, state) + only)
    if state == "complete":
        cache = PPCache(out)
        problem = mismatch(cache, store, settings)
        if problem is None:
            if log:
                log(f"reusing {out}: complete cache of this store with {_describe_key(settings.key())}")
            return cache, "reused"
        if not overwrite:
            raise TrellisUserError(
                f"{out} holds a cache {problem}; refusing to mix them: pass --overwrite to rebuild it or "
                "choose another --out"
            )
        if log:
            log(f"rebuilding {out} (--overwrite): it held a cache {problem}")
        build_pp(store, out, settings, block_rows=block_rows, progress=progress, kernel=kernel, log=log)
        return PPCache(out), "rebuilt"
    if state == "incomplete" and log:
        log(f"{out} is an incomplete cache (an interrupted run); redoing it")
    build_pp(store, out, settings, block_rows=block_rows, progress=progress, kernel=kernel, log=log)
    return PPCache(out), "rebuilt" if state == "incomplete" else "built"


def mismatch(cache: PPCache, store: GraphStore, settings: PPSettings) -> str | None:
    """Why ``cache`` cannot serve ``(store, settings)``, or None when it can."""
    if cache.store_checksum != store.checksum:
        return (f"of another store ({cache.manifest['store'].get('path')}, checksum "
                f"{cache.store_checksum[:12]}… vs {store.checksum[:12]}…)")
    have, want = cache.manifest["settings"], settings.key()
    if have != want:
        diff = ", ".join(f"{k}: {have.get(k)!r} there vs {want.get(k)!r} asked"
                         for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
        return f"with other settings ({diff})"
    if settings.split_rows_only is False and cache.split_rows_only:
        return "with only split rows (--split-rows-only) but all rows were asked for"
    return None


@keeps_caller_state
def preprocess(store: GraphStore | str | os.PathLike[str], out: str | os.PathLike[str], *, operator: str = "sym",
               hops: int = 3, alpha: float = 0.1, t: float = 3.0, iters: int | None = None,
               split_rows_only: bool | None = None, block_rows: int | None = None, feature_norm: str = "auto",
               shuffle_seed: int = 0, overwrite: bool = False, progress: bool = False,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``trellis preprocess`` as a function: build (or reuse) the pre-propagation cache of ``store`` at ``out``.

    Args:
        store: A store path or :class:`GraphStore`.
        out: The cache directory (PP_DIR) to create or reuse.
        operator: ``sym``, ``rw``, ``ppr`` or ``heat``.
        hops: R, propagation steps (hops 0..R are kept).
        alpha: PPR teleport probability.
        t: Heat-kernel diffusion time.
        iters: PPR power iterations / heat Taylor terms (None: 10 / 20).
        split_rows_only: Keep only train/val/test rows (None: all rows unless only those fit the free disk).
        block_rows: Destination rows per block (None: about 32 MiB of output per block).
        feature_norm: ``auto``, ``none``, ``row`` or ``l2``.
        shuffle_seed: Seed of the one-time shuffle of training rows.
        overwrite: Replace a cache built from another store or settings.
        progress: Progress bars.
        log: Where progress lines go (None: nowhere).

    Returns:
        What ``trellis preprocess --json`` prints: the action (``built``, ``reused``, ``rebuilt``), paths, sizes.
    """
    from trellis.ops.propagate import OperatorSpec

    if hops < 1:
        raise TrellisUserError(f"--hops {hops} must be >= 1 (R = number of propagation steps)")
    graph = store if isinstance(store, GraphStore) else open_store(store)
    spec = OperatorSpec(name=operator, alpha=alpha, t=t, iters=iters)
    settings = PPSettings(operator=spec, hops=hops, split_rows_only=split_rows_only, shuffle_seed=shuffle_seed,
                          feature_norm=feature_norm)
    cache, action = ensure_pp(graph, out, settings, overwrite=overwrite, block_rows=block_rows, progress=progress,
                              log=log if log is not None else (lambda _msg: None))
    return {"action": action, "pp_dir": str(cache.path), "store": str(graph.path),
            "settings": cache.manifest["settings"], "rows": cache.num_rows, "split_rows_only": cache.split_rows_only,
            "features": cache.num_features, "bytes": cache.nbytes(), "seconds": cache.manifest["build"]["seconds"],
            "kernel": cache.manifest["build"]["kernel"]}
