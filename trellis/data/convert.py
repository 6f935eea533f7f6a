"""Python adapters: write a store from arrays, a scipy sparse matrix, a networkx graph or a PyG ``Data``.

:func:`from_arrays` symmetrizes by default, as ``trellis data import`` does for edge lists (a GNN over a
social or citation graph almost always wants both directions; ``symmetrize=False`` keeps the edges as given).
:func:`from_scipy` and :func:`from_pyg` take the graph as given (a matrix or a PyG dataset already says which
directions exist), and :func:`from_networkx` symmetrizes undirected graphs. Self loops stay unless
``remove_self_loops=True``; only exact duplicate edges are dropped, keeping the first (``dedup=False`` keeps
them). Every adapter validates like the importers and ends in an atomic store write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.csr import ArrayEdgeSource
from trellis.data.importers.common import (
    GraphInput,
    check_features,
    check_labels,
    check_split,
    split_sets_from_masks,
    write_graph,
)
from trellis.data.store import check_output, split_set_ids
from trellis.errors import TrellisUserError

#: A PyG ``Data``'s split attributes: split -> the attribute names read for it, first found wins.
PYG_MASKS = (("train", ("train_mask",)), ("val", ("val_mask", "valid_mask")), ("test", ("test_mask",)))


def _numpy(value: Any) -> np.ndarray | None:
    """A numpy array from a numpy array, a torch tensor (any device) or a sequence; None stays None."""
    if value is None:
        return None
    if hasattr(value, "detach"):  # torch.Tensor without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def from_arrays(
    src: Any,
    dst: Any,
    num_nodes: int | None = None,
    *,
    out: str | os.PathLike[str],
    x: Any = None,
    y: Any = None,
    splits: dict[str, Any] | None = None,
    split_index: int = 0,
    edge_weight: Any = None,
    edge_feat: Any = None,
    symmetrize: bool = True,
    dedup: bool = True,
    remove_self_loops: bool = False,
    name: str = "graph",
    overwrite: bool = False,
) -> Path:
    """Write a store from edge arrays ``src[i] -> dst[i]``.

    Args:
        src: Source node ids ``[E]`` (numpy, torch or a sequence).
        dst: Destination node ids ``[E]``.
        num_nodes: Node count (default: feature/label rows, else largest id + 1).
        out: Store directory to create.
        x: Node features ``[N, F]``.
        y: Labels ``int [N]`` (-1 = unlabelled) or ``[N, C]`` 0/1.
        splits: ``{"train"|"val"|"test": node ids or boolean masks}``. Masks of shape ``[N, S]`` (PyG's
            multi-split masks) give the store ``S`` fixed splits, all kept: ``trellis train --split-seed K``
            (``split_seed=K``) trains on split ``K`` and ``trellis tune --splits`` averages over them. A
            split given once beside them (``[N]``, or ids) is the same in every split.
        split_index: Which of ``S`` fixed splits is the store's own (default: 0, the first).
        edge_weight: ``[E]`` per input edge.
        edge_feat: ``[E, D]`` per input edge.
        symmetrize: Add reverse edges (default: True, like ``trellis data import``; False keeps the edges as
            given).
        dedup: Drop repeated edges, keeping the first (default: True).
        remove_self_loops: Drop ``u -> u`` (default: False).
        name: Dataset name (default: ``"graph"``).
        overwrite: Replace an existing store (default: False).

    Returns:
        The store path.
    """
    check_output(out, overwrite=overwrite)
    src_a, dst_a = _numpy(src), _numpy(dst)
    if src_a is None or dst_a is None:
        raise TrellisUserError("give both src and dst edge arrays")
    xa, ya = _numpy(x), _numpy(y)
    n = num_nodes
    if xa is not None:
        n = xa.shape[0] if n is None else n
        check_features(xa, n, "x")
    if ya is not None:
        n = ya.shape[0] if n is None else n
        ya = check_labels(ya, n, "y")
    split_arrays = None if splits is None else {k: a for k, v in splits.items() if (a := _numpy(v)) is not None}
    for k in split_arrays or {}:
        if k not in ("train", "val", "test"):
            raise TrellisUserError(f"unknown split {k!r}; use train, val or test")
    split_sets = None
    if split_arrays and any(a.ndim == 2 for a in split_arrays.values()):
        n = next(a.shape[0] for a in split_arrays.values() if a.ndim == 2) if n is None else n
        split_sets = _split_sets(split_arrays, n)
        if not 0 <= split_index < split_sets.shape[0]:
            raise TrellisUserError(f"split_index {split_index} is out of range: the masks hold {split_sets.shape[0]} "
                                   f"splits (0 to {split_sets.shape[0] - 1})")
        split_arrays = split_set_ids(split_sets[split_index])
    ef = _numpy(edge_feat)
    if ef is not None and ef.ndim == 1:
        ef = ef.reshape(-1, 1)
    inp = GraphInput(
        edges=ArrayEdgeSource(src_a.reshape(-1), dst_a.reshape(-1), name="edges"),
        num_nodes=n, x=xa, y=ya, splits=split_arrays, split_sets=split_sets, edge_weight=_numpy(edge_weight),
        edge_feat=ef, name=name,
        where={k: f"{k} split" for k in (split_arrays or {})} | {"edge_weight": "edge_weight",
                                                                 "edge_feat": "edge_feat"},
        source={"importer": "python"},
    )
    return write_graph(inp, out, symmetrize=symmetrize, dedup=dedup, remove_self_loops=remove_self_loops,
                       allow_empty=n is not None, overwrite=overwrite, streaming=False)


def _split_sets(splits: dict[str, np.ndarray], n: int) -> np.ndarray:
    """``int8 [S, N]`` fixed splits from ``[N, S]`` boolean masks; a 1-D mask or ids is every split's."""
    masks = {}
    for k, a in splits.items():
        where = f"{k} split"
        if a.ndim == 2:
            if a.dtype != np.bool_ and not (np.issubdtype(a.dtype, np.integer) and np.isin(a, (0, 1)).all()):
                raise TrellisUserError(f"{where}: a 2-D split must be boolean masks [nodes, splits] (got dtype "
                                       f"{a.dtype})")
            if a.shape[0] != n:
                raise TrellisUserError(f"{where}: masks of shape {list(a.shape)} for {n} nodes; give them as "
                                       f"[nodes, splits] ([{n}, S])")
            masks[k] = a.astype(bool).T
        else:
            mask = np.zeros(n, dtype=bool)
            mask[check_split(a, n, where)] = True
            masks[k] = mask
    return split_sets_from_masks(masks, n, {k: f"{k} split" for k in masks})


def from_scipy(
    adj: Any,
    x: Any = None,
    y: Any = None,
    splits: dict[str, Any] | None = None,
    *,
    out: str | os.PathLike[str],
    weighted: bool = False,
    symmetrize: bool = False,
    dedup: bool = True,
    remove_self_loops: bool = False,
    name: str = "graph",
    overwrite: bool = False,
) -> Path:
    """Write a store from a scipy sparse adjacency: ``adj[i, j] != 0`` is an edge ``i -> j``.

    The matrix is scipy's: a COO input's repeated entries are summed first (so ``dedup`` finds none), and an
    entry that sums to zero is no edge.

    Args:
        adj: Square scipy sparse matrix (or array) ``[N, N]``.
        x: Node features ``[N, F]``.
        y: Labels.
        splits: ``{"train"|"val"|"test": ids or masks}``.
        out: Store directory to create.
        weighted: Keep ``adj``'s values as edge weights (default: False).
        symmetrize: Add reverse edges (default: False).
        dedup: Drop repeated entries, keeping the first (default: True).
        remove_self_loops: Drop the diagonal (default: False).
        name: Dataset name.
        overwrite: Replace an existing store.

    Returns:
        The store path.
    """
    import scipy.sparse as sp

    coo = sp.coo_matrix(adj, copy=True)
    if coo.shape[0] != coo.shape[1]:
        raise TrellisUserError(f"adjacency has shape {coo.shape}; it must be square [N, N]")
    # scipy's matrix holds the sum of a COO's repeated entries (what ``adj[i, j]`` and ``tocsr`` give): keeping
    # the first of them imported another weight than the matrix the caller passed
    coo.sum_duplicates()
    nz = coo.data != 0
    return from_arrays(coo.row[nz], coo.col[nz], int(coo.shape[0]), out=out, x=x, y=y, splits=splits,
                       edge_weight=coo.data[nz] if weighted else None, symmetrize=symmetrize, dedup=dedup,
                       remove_self_loops=remove_self_loops, name=name, overwrite=overwrite)


def from_networkx(
    graph: Any,
    *,
    out: str | os.PathLike[str],
    x: Any = None,
    y: Any = None,
    splits: dict[str, Any] | None = None,
    feature_attr: str | None = None,
    label_attr: str | None = None,
    weight_attr: str | None = None,
    symmetrize: bool | None = None,
    dedup: bool = True,
    remove_self_loops: bool = False,
    name: str = "graph",
    overwrite: bool = False,
) -> Path:
    """Write a store from a networkx graph; node ``k`` of the store is the k-th node of ``graph.nodes``.

    Args:
        graph: A networkx ``Graph``/``DiGraph``/``MultiGraph`` (duck-typed; networkx is not imported).
        out: Store directory to create.
        x: Node features ``[N, F]`` in ``graph.nodes`` order (or use ``feature_attr``).
        y: Labels in ``graph.nodes`` order (or use ``label_attr``).
        splits: ``{"train"|"val"|"test": store node ids or masks}``.
        feature_attr: Node attribute holding a feature vector.
        label_attr: Node attribute holding a label.
        weight_attr: Edge attribute holding a weight.
        symmetrize: Add reverse edges (default: True for undirected graphs, False for directed).
        dedup: Drop parallel edges, keeping the first (default: True).
        remove_self_loops: Drop ``u -> u`` (default: False).
        name: Dataset name.
        overwrite: Replace an existing store.

    Returns:
        The store path.
    """
    nodes = list(graph.nodes)
    index = {v: i for i, v in enumerate(nodes)}
    edges = list(graph.edges(data=weight_attr, default=1.0) if weight_attr else graph.edges())
    src = np.fromiter((index[e[0]] for e in edges), dtype=np.int64, count=len(edges))
    dst = np.fromiter((index[e[1]] for e in edges), dtype=np.int64, count=len(edges))
    weight = np.fromiter((float(e[2]) for e in edges), dtype=np.float64, count=len(edges)) if weight_attr else None
    if feature_attr is not None:
        missing = next((v for v in nodes if feature_attr not in graph.nodes[v]), None)
        if missing is not None:  # (the KeyError names the attribute, not the node)
            raise TrellisUserError(f"node {missing!r} has no attribute {feature_attr!r}; give every node its "
                                   "features")
        x = np.stack([np.asarray(graph.nodes[v][feature_attr], dtype=np.float32) for v in nodes])
    if label_attr is not None:
        try:
            y = np.asarray([graph.nodes[v][label_attr] for v in nodes])
        except KeyError:
            raise TrellisUserError(f"a node has no attribute {label_attr!r}; give every node a label") from None
    if symmetrize is None:
        symmetrize = not graph.is_directed()
    return from_arrays(src, dst, len(nodes), out=out, x=x, y=y, splits=splits, edge_weight=weight,
                       symmetrize=symmetrize, dedup=dedup, remove_self_loops=remove_self_loops, name=name,
                       overwrite=overwrite)


def from_pyg(
    data: Any,
    out: str | os.PathLike[str],
    *,
    split_index: int = 0,
    symmetrize: bool = False,
    dedup: bool = True,
    remove_self_loops: bool = False,
    name: str = "graph",
    overwrite: bool = False,
) -> Path:
    """Write a store from a PyG-style ``Data`` object (duck-typed; torch_geometric is not imported).

    Reads ``edge_index [2, E]``, ``num_nodes``, ``x``, ``y``, ``train_mask``/``val_mask``/``test_mask``
    (boolean masks or id tensors; ``[N, S]`` masks of S splits are all kept as the store's fixed splits, as
    :func:`from_arrays` keeps them, and column ``split_index`` is its own),
    ``edge_weight [E]`` and ``edge_attr`` (``[E]`` becomes the edge weight when there is none, ``[E, D]``
    the edge features).

    Args:
        data: The graph.
        out: Store directory to create.
        split_index: Which column of multi-split masks is the store's own split (default: 0).
        symmetrize: Add reverse edges (default: False: PyG datasets are already undirected).
        dedup: Drop repeated edges (default: True).
        remove_self_loops: Drop ``u -> u`` (default: False).
        name: Dataset name.
        overwrite: Replace an existing store.

    Returns:
        The store path.
    """
    edge_index = _numpy(getattr(data, "edge_index", None))
    if edge_index is None or edge_index.ndim != 2 or edge_index.shape[0] != 2:
        shape = None if edge_index is None else edge_index.shape
        raise TrellisUserError(f"data.edge_index must have shape [2, E] (got {shape})")
    x, y = _numpy(getattr(data, "x", None)), _numpy(getattr(data, "y", None))
    n = getattr(data, "num_nodes", None)
    n = int(n) if n is not None else None
    splits: dict[str, np.ndarray] = {}
    for key, names in PYG_MASKS:
        for attr in names:
            mask = _numpy(getattr(data, attr, None))
            if mask is not None:
                splits[key] = mask
                break
    weight = _numpy(getattr(data, "edge_weight", None))
    edge_attr = _numpy(getattr(data, "edge_attr", None))
    edge_feat = None
    if edge_attr is not None:
        if edge_attr.ndim == 1 and weight is None:
            weight = edge_attr
        else:
            edge_feat = edge_attr.reshape(edge_attr.shape[0], -1)
    return from_arrays(edge_index[0], edge_index[1], n, out=out, x=x, y=y, splits=splits or None,
                       split_index=split_index, edge_weight=weight, edge_feat=edge_feat, symmetrize=symmetrize,
                       dedup=dedup, remove_self_loops=remove_self_loops, name=name, overwrite=overwrite)
