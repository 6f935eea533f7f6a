"""A graph's tensors for training: the store's graph, features, labels and splits on the training device.

Why apart from the trainer: what a run loads is the strategy's decision (the in-memory graph for full-batch;
memory maps for sampled and cluster batches; a pre-propagated cache for ``pp``), so loading lives beside
the strategies, below the loop that drives them.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from trellis.data.splits import per_class_split
from trellis.data.store import GraphStore, split_set_ids
from trellis.errors import TrellisUserError
from trellis.loader.features import ArrayRows, FeatureSource, NormalizedRows, normalize_rows_
from trellis.nn.models import SPARSE_ROW_MODELS
from trellis.ops.graph import CSRGraph
from trellis.ops.sparse_rows import MAX_DENSITY, to_sparse_rows
from trellis.train.features import node_inputs, parse_features
from trellis.train.tasks import Task, resolve_task

if TYPE_CHECKING:
    from trellis.train.config import TrainConfig

#: The splits every labelled store has, in the order summaries list them.
SPLITS = ("train", "val", "test")


@dataclass
class GraphData:
    """One graph's tensors on the training device, plus the task that reads its labels.

    ``graph`` is the whole graph in memory, or None for strategies that read the store's memory-mapped CSR
    themselves (sampled and cluster batches); ``edge_weight`` and ``edge_feat`` are on the device either way.
    ``x`` is a tensor on the device, or -- for strategies that read rows per batch -- a
    :class:`~trellis.loader.features.FeatureSource` over the store's memory map (row normalization applied
    to the rows gathered), so ``N x F`` is never held in memory.
    """

    store: GraphStore
    graph: CSRGraph | None
    x: Tensor | FeatureSource
    y: Tensor | None
    splits: dict[str, Tensor]
    task: Task | None
    feature_norm: str
    features: str = "store"
    embedding_dim: int = 0
    edge_weight: Tensor | None = None
    edge_feat: Tensor | None = None

    @property
    def in_dim(self) -> int:
        """Width of the model's input: the feature width, or the embedding table's for ``embedding:D``."""
        if self.embedding_dim:
            return self.embedding_dim
        return self.x.dim if isinstance(self.x, FeatureSource) else int(self.x.shape[1])

    @property
    def edge_dim(self) -> int:
        """Width of the edge features (0 = none)."""
        ef = self.edge_feat
        return 0 if ef is None else int(ef.reshape(ef.shape[0], -1).shape[1])


def check_edge_weights(store: GraphStore) -> None:
    """Refuse ``--edge-weight`` on a store without edge weights, or with negative ones.

    Why negative ones: GCN and SAGE divide by each node's weighted in-degree (PyG's ``edge_weight``), which
    negative weights can make zero or negative; the result was silently 0 for such a node (PyG's GCN: NaN).
    """
    if store.edge_weight is None:
        raise TrellisUserError(f"--edge-weight: the store {store.path} has no edge weights (import them with the "
                               "edges: edge_weights.npy beside an edge list, or edge_weight= of "
                               "trellis.data.from_arrays)")
    if not store.num_edges:
        return
    smallest = float(np.min(store.edge_weight))  # a reduction over the memory map: no edge-sized temporary
    if smallest < 0:
        negative = int(np.count_nonzero(np.asarray(store.edge_weight) < 0))
        raise TrellisUserError(
            f"--edge-weight: {negative} of the store's {store.num_edges} edge weights are negative (smallest "
            f"{smallest:g}); gcn and sage divide by each node's weighted in-degree, which negative weights can make "
            "zero or negative: give non-negative weights (a node whose in-edges all weigh 0 aggregates nothing)")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; refuse ``cuda`` on a machine without one."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise TrellisUserError(f"--device must be auto, cpu, cuda or cuda:N (got {name!r})")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrellisUserError(f"--device {name}: no CUDA device is available here; use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TrellisUserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
        return dev
    return torch.device(name)


def normalize_features(x: Tensor, mode: str) -> tuple[Tensor, str]:
    """Apply ``--feature-norm`` (already resolved to ``row`` or ``none``) in place; returns ``(x, mode)``.

    ``row`` divides each row by its L1 norm (Kipf & Welling's preprocessing of bag-of-words features).
    ``auto`` is resolved by the caller from the store (:attr:`GraphStore.preferred_feature_norm`).
    """
    normalize_rows_(x, mode)  # all-zero rows stay zero
    return x, mode


#: Bytes of dense rows :func:`sparse_rows_of` converts at a time.
SPARSE_CHUNK_BYTES = 32 * 2**20


def sparse_rows_of(x: np.ndarray, norm: str, max_density: float = MAX_DENSITY,
                   chunk_bytes: int = SPARSE_CHUNK_BYTES) -> Tensor | None:
    """The store's mostly-zero features as normalized CSR rows, built a chunk of rows at a time (else None).

    Why not the dense copy, normalized and then converted: that held the whole ``N × F`` float32 matrix twice
    over for a moment (Coauthor CS: 1.1 GiB of ``RssAnon`` to keep 13 MB of non-zeros), which is the run's
    peak. Here only one chunk is dense at a time; each row is normalized by the same code, so the values are
    the same bits as the dense path's (tested).
    """
    if x.ndim != 2 or not x.size or x.dtype.kind not in "fiub":  # floats, or counts stored as integers
        return None
    n, f = x.shape
    step = max(1, chunk_bytes // max(1, 4 * f))
    bounds = range(0, n, step)
    if sum(int(np.count_nonzero(x[a: a + step])) for a in bounds) > max_density * n * f:
        return None  # dense enough to stay dense
    counts, cols, vals = np.zeros(n + 1, dtype=np.int64), [], []
    for a in bounds:
        block = np.array(x[a: a + step], dtype=np.float32, copy=True)
        normalize_rows_(block, norm)
        rows, c = np.nonzero(block)
        counts[a + 1: a + 1 + block.shape[0]] = np.bincount(rows, minlength=block.shape[0])
        cols.append(c.astype(np.int64))
        vals.append(block[rows, c])
    crow = torch.from_numpy(np.cumsum(counts))
    with warnings.catch_warnings():  # "sparse CSR support is in beta" (trellis.ops.sparse_rows)
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, torch.from_numpy(np.concatenate(cols)),
                                       torch.from_numpy(np.concatenate(vals)), size=(n, f))


def sparse_rows_density(store: GraphStore, cfg: TrainConfig, device: torch.device) -> float | None:
    """The store's feature density when a run's first layer takes the rows sparse (:mod:`trellis.ops.sparse_rows`).

    The one rule of the strategies that read rows by batch, tile or part (mini, cluster, the partition buffer,
    out-of-core tiles, ranks): store features with at most :data:`~trellis.ops.sparse_rows.MAX_DENSITY` non-zeros
    (``GraphStore.feature_density``: sampled rows, or the manifest's record), a built-in message-passing model,
    the CPU, no pre-norm input layer. Decided from the store, so every process of a run decides alike. None:
    dense rows. (Full-batch in memory counts the non-zeros exactly as it converts, :func:`sparse_rows_of`.)
    """
    if cfg.model not in SPARSE_ROW_MODELS or device.type != "cpu" or cfg.pre_norm \
            or parse_features(cfg.features)[0] != "store":
        return None
    density = store.feature_density
    return density if density is not None and density <= MAX_DENSITY else None


def load_graph_data(store_path: str | os.PathLike[str], *, device: torch.device, task: str = "auto",
                    feature_norm: str = "auto", need_labels: bool = True, features: str = "store",
                    in_memory_graph: bool = True, split_seed: int | None = None,
                    sparse_rows: bool = False, mapped_features: bool = False) -> GraphData:
    """Open a store and move its graph, features, labels and splits to ``device``.

    Args:
        store_path: Store directory.
        device: Where the tensors live.
        task: ``--task`` (``auto`` = the store's).
        feature_norm: ``--feature-norm`` (``auto|none|row``).
        need_labels: Refuse a store without labels and train/val/test splits (training); prediction
            needs only the graph and features.
        features: ``--features`` (``store``, or computed inputs: :mod:`trellis.train.features`).
        in_memory_graph: Copy the CSR (and its cached reverse) into a :class:`CSRGraph` on the device;
            False leaves it memory-mapped in the store and loads only the edge data.
        split_seed: ``--split-seed`` (None: the store's split; see :func:`load_labels`).
        sparse_rows: Keep mostly-zero store features as a CSR tensor on CPU
            (:mod:`trellis.ops.sparse_rows`); only for callers that run the whole graph's first layer.
        mapped_features: Leave the store's features memory-mapped (a :class:`NormalizedRows` source that
            normalizes the rows it gathers) instead of copying them into memory; for per-batch readers on the CPU.
    """
    store = GraphStore(store_path)
    where = str(store.path)
    kind, emb_dim = parse_features(features)
    if kind == "store":
        if store.x is None:
            raise TrellisUserError(f"{where}: the store has no node features (x.npy); train with --features none, "
                                   "degree or embedding:D, or re-import it with features")
        if feature_norm == "auto":
            feature_norm = store.preferred_feature_norm
        if mapped_features and store.x.dtype == np.float32:
            x: Tensor | FeatureSource = NormalizedRows(ArrayRows(store.x), feature_norm)
            resolved_norm = feature_norm
        else:
            sparse = sparse_rows_of(store.x, feature_norm) if sparse_rows and device.type == "cpu" else None
            if sparse is not None:
                x, resolved_norm = sparse, feature_norm
            else:
                xt = torch.from_numpy(np.array(store.x, dtype=np.float32, copy=True))
                if xt.ndim == 1:
                    xt = xt.unsqueeze(1)
                xt, resolved_norm = normalize_features(xt, feature_norm)
                if sparse_rows and device.type == "cpu":
                    xt = to_sparse_rows(xt)
                x = xt
    else:
        x = node_inputs(kind, store.num_nodes, np.asarray(store.indptr), np.asarray(store.indices))
        resolved_norm = "none"
    if in_memory_graph:
        graph: CSRGraph | None = CSRGraph.from_store(store).to(device)
        assert graph is not None
        ew, ef = graph.edge_weight, graph.edge_feat
    else:
        graph = None
        ew, ef = (None if a is None else torch.from_numpy(np.array(a, dtype=np.float32)).to(device)
                  for a in (store.edge_weight, store.edge_feat))
    y_t: Tensor | None = None
    splits: dict[str, Tensor] = {}
    task_obj: Task | None = None
    if need_labels:
        y_t, splits, task_obj = load_labels(store, task, device, split_seed)
    x_dev = x if isinstance(x, FeatureSource) else x.to(device)
    return GraphData(store=store, graph=graph, x=x_dev, y=y_t, splits=splits, task=task_obj,
                     feature_norm=resolved_norm, features=features, embedding_dim=emb_dim,
                     edge_weight=ew, edge_feat=ef)




def load_labels(store: GraphStore, task: str, device: torch.device,
                split_seed: int | None = None) -> tuple[Tensor, dict[str, Tensor], Task]:
    """The store's labels and train/val/test ids on ``device``, and the task that reads them.

    ``split_seed`` re-draws the store's per-class split (Shchur et al.'s protocol, recorded by the npz
    importer: ``train_per_class`` and ``val_per_class`` nodes per class, the rest for testing) with another
    seed, as ``trellis data import --split-seed`` would have: the protocol's "several random splits" without
    one store per split. The importer's own seed gives the store's split back exactly. On a store with fixed
    splits (Platonov et al.'s files, ``split_sets.npy``) it is the number of the split, 0 the store's own.

    Raises:
        TrellisUserError: The store has no labels or lacks a split, the labels do not fit the task, or
            ``split_seed`` is given for a store with neither the per-class protocol nor fixed splits, or it
            is not one of the fixed splits.
    """
    where = str(store.path)
    y = store.y
    if y is None:
        raise TrellisUserError(f"{where}: the store has no labels (y.npy); training needs labels — re-import "
                               "it with labels")
    split_ids: dict[str, np.ndarray] = {}
    for s in SPLITS:
        ids = store.split(s)
        if ids is None or ids.size == 0:
            state = "no" if ids is None else "an empty"
            raise TrellisUserError(f"{where}: the store has {state} {s} split ({s}_idx.npy); re-import it with "
                                   "train/val/test node ids, or a split with a non-zero fraction each (`trellis "
                                   "data import ... --split 0.6,0.2,0.2`; npz imports draw a per-class split)")
        split_ids[s] = np.array(ids, dtype=np.int64)  # a copy: torch warns on read-only store maps
    y_np = np.asarray(y)
    if split_seed is not None:
        split_ids = redraw_split(store, y_np, split_seed)
    task_obj = resolve_task(task, store.task, y_np, store.num_classes)
    task_obj.check_labels(y_np, split_ids, where)
    y_t = task_obj.labels_tensor(y_np).to(device)
    return y_t, {s: torch.from_numpy(ids).to(device) for s, ids in split_ids.items()}, task_obj


def redraw_split(store: GraphStore, y: np.ndarray, split_seed: int) -> dict[str, np.ndarray]:
    """Split ``split_seed`` of the store: its per-class protocol drawn again, or that fixed split.

    See :func:`load_labels`.
    """
    sets = store.split_sets
    if sets is not None:
        if not 0 <= split_seed < sets.shape[0]:
            raise TrellisUserError(f"--split-seed {split_seed}: {store.path} holds {sets.shape[0]} fixed splits; give "
                                   f"a split number from 0 to {sets.shape[0] - 1}")
        return split_set_ids(sets[split_seed])
    source = store.manifest.get("source", {})
    if source.get("split") != "per-class" or y.ndim != 1:
        raise TrellisUserError(f"--split-seed {split_seed}: {store.path} does not record a per-class split protocol "
                               "(Shchur et al.'s npz imports do) nor fixed splits (Platonov et al.'s do); its split "
                               "is fixed — train without --split-seed")
    return per_class_split(y, int(source["train_per_class"]), int(source["val_per_class"]), split_seed)


def split_choices(store: GraphStore) -> int | None:
    """How many splits ``split_seed`` chooses among.

    The fixed splits' count, None for a per-class protocol (any seed), 0 when the store's split is its only one.
    """
    sets = store.split_sets
    if sets is not None:
        return int(sets.shape[0])
    y = store.y
    per_class = store.manifest.get("source", {}).get("split") == "per-class" and y is not None and y.ndim == 1
    return None if per_class else 0
