"""Synthetic graphs with labels, features and splits: planted partitions (SBM) and R-MAT power laws.

Both generators are vectorized (no per-edge Python loop; a 1M-node, 10M-edge graph takes seconds),
deterministic from ``seed`` (independent random streams for labels, edges, features and splits, so
changing the feature width does not change the graph), and write a store with
:func:`trellis.data.store.store_writer`.

Features are ``x = mu[y] + feature_noise * N(0, I)`` with class means ``mu ~ N(0, I / F)``: two class
means are about ``sqrt(2)`` apart while the per-dimension noise is ``feature_noise``, so a feature-only
model (MLP) is well above chance but far from perfect, while averaging over same-class neighbors (a GCN
on a homophilous graph) removes most of the noise. On an SBM with 8 classes, degree 10, homophily 0.8
and the default noise 1.5, a linear model on raw features reaches about 20% test accuracy and one on
2-hop propagated features about 90%.

``avg_degree`` is the number of directed edges per node after symmetrization (``E ≈ N * avg_degree``);
self loops and duplicates are removed.

Edge features (``edge_features=D``, for GAT-E) plant the class signal in the edges: the undirected edge
``{u, v}`` carries ``nu[y_u] + nu[y_v] + edge_feature_noise * N(0, I)`` with class vectors
``nu ~ N(0, I / D)``, and both directions carry the same row -- exactly what the importers make of an edge
list with ``edge_features.npy`` (a symmetrized edge keeps its input row's features). Every in-edge of
``v`` therefore holds ``nu[y_v]`` plus its neighbor's class vector (mostly the same class on a
homophilous graph), so a node's class is recoverable from its incoming edges' features alone. With
``node_features="noise"`` the node features are ``feature_noise * N(0, I)`` and carry no class signal:
a model that ignores edge features (GAT) is at chance while one that reads them (GAT-E) is not.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trellis.data.csr import EdgeCSR, edges_to_csr
from trellis.data.splits import random_split
from trellis.data.store import StoreWriter, check_output, store_writer
from trellis.errors import TrellisUserError
from trellis.utils.csr import build_reverse_csr

#: Edge pairs generated per vectorized step (fixed so results do not depend on memory settings).
_EDGE_BLOCK = 4_000_000
_FEATURE_BLOCK = 65_536
DEFAULT_FEATURE_NOISE = 1.5
GENERATORS = ("sbm", "rmat")
#: ``task`` choices: the labels written (see :func:`_task_labels`); edges and features follow the classes.
TASK_KINDS = ("multiclass", "binary", "multilabel")
#: ``node_features`` modes: ``signal`` (class means plus noise) or ``noise`` (no class signal).
NODE_FEATURE_MODES = ("signal", "noise")


def _check_common(nodes: int, avg_degree: float, features: int, classes: int, feature_noise: float,
                  edge_features: int = 0, edge_feature_noise: float | None = None,
                  node_features: str = "signal") -> None:
    if nodes < 1:
        raise TrellisUserError(f"--nodes must be >= 1 (got {nodes})")
    for flag, value in (("--avg-degree", avg_degree), ("--feature-noise", feature_noise),
                        ("--edge-feature-noise", edge_feature_noise)):
        if value is not None and not math.isfinite(value):  # NaN passes `< 0` and wrote an unreadable store
            raise TrellisUserError(f"{flag} must be a finite number (got {value})")
    if avg_degree < 0:
        raise TrellisUserError(f"--avg-degree must be >= 0 (got {avg_degree})")
    if nodes > 1 and avg_degree > 0.5 * (nodes - 1):
        raise TrellisUserError(f"--avg-degree {avg_degree} is too dense for {nodes} nodes; use at most "
                               f"{0.5 * (nodes - 1):g} (half of N-1) so random edges stay distinct")
    if features < 0:
        raise TrellisUserError(f"--features must be >= 0 (got {features})")
    if not 1 <= classes <= nodes:
        raise TrellisUserError(f"--classes must be between 1 and the node count (got {classes})")
    if feature_noise < 0:
        raise TrellisUserError(f"--feature-noise must be >= 0 (got {feature_noise})")
    if edge_features < 0:
        raise TrellisUserError(f"--edge-features must be >= 0 (got {edge_features})")
    if edge_feature_noise is not None and edge_feature_noise < 0:
        raise TrellisUserError(f"--edge-feature-noise must be >= 0 (got {edge_feature_noise})")
    if node_features not in NODE_FEATURE_MODES:
        raise TrellisUserError(f"--node-features must be one of {', '.join(NODE_FEATURE_MODES)} "
                               f"(got {node_features!r})")
    if node_features == "noise" and features == 0:
        raise TrellisUserError("--node-features noise needs --features > 0 (noise of which width?)")


def _streams(seed: int) -> dict[str, np.random.Generator]:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise TrellisUserError(f"--seed must be a non-negative integer (got {seed!r})")
    # New streams go at the end: SeedSequence children are keyed by position, so earlier streams (and
    # every store generated before a stream was added) stay the same.
    names = ("labels", "edges", "features", "splits", "permute", "edge_features")
    return {k: np.random.default_rng(s) for k, s in zip(names, np.random.SeedSequence(seed).spawn(len(names)))}


def _bar(total: int, desc: str, progress: bool, unit: str = "edge") -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None if progress else True, leave=False)


def _edge_source(node_features: str, edge_features: int, edge_feature_noise: float | None) -> dict[str, Any]:
    """Manifest entries for the feature options, only when they differ from the defaults.

    Why: stores generated before these options existed keep byte-identical manifests' ``source``.
    """
    out: dict[str, Any] = {}
    if node_features != "signal":
        out["node_features"] = node_features
    if edge_features:
        out["edge_features"] = edge_features
        if edge_feature_noise is not None:
            out["edge_feature_noise"] = edge_feature_noise
    return out


def _write_edge_features(w: StoreWriter, csr: EdgeCSR, rev_perm: np.ndarray, y: np.ndarray, num_classes: int,
                         dim: int, noise: float, rng: np.random.Generator, progress: bool) -> None:
    """Write ``edge_feat [E, dim]``: ``nu[y_u] + nu[y_v] + noise`` per undirected edge, same row both ways.

    Why two passes: the generated graph is symmetric with sorted rows, so its reverse CSR has the forward
    CSR's structure and ``rev_perm[p]`` is the twin ``u -> v`` of forward edge ``p`` (``v <- u``). Pass 1
    draws the features of the edges with ``u < v`` block by block (fixed blocks: deterministic, bounded
    memory); pass 2 copies each ``u > v`` edge's row from its twin.
    """
    e = csr.num_edges
    nu = (rng.standard_normal((num_classes, dim)) / math.sqrt(dim)).astype(np.float32)
    ef = w.create("edge_feat", (e, dim), np.float32)
    indptr, indices = csr.indptr, csr.indices
    with _bar(2 * e, "edge features", progress) as bar:
        for second in (False, True):
            for p0 in range(0, e, _FEATURE_BLOCK):
                p1 = min(e, p0 + _FEATURE_BLOCK)
                pos = np.arange(p0, p1, dtype=np.int64)
                dst = np.searchsorted(indptr, pos, side="right") - 1
                src = indices[p0:p1]
                if second:
                    upper = np.flatnonzero(src > dst)
                    ef[p0 + upper] = ef[rev_perm[p0 + upper]]
                else:
                    lower = np.flatnonzero(src < dst)
                    u, v = src[lower], dst[lower]
                    eps = rng.standard_normal((lower.size, dim), dtype=np.float32)
                    ef[p0 + lower] = nu[y[u]] + nu[y[v]] + np.float32(noise) * eps
                bar.update(p1 - p0)
    ef.flush()
    del ef


def _check_task(task: str, labels: int | None, classes: int) -> None:
    if task not in TASK_KINDS:
        raise TrellisUserError(f"--task must be one of {', '.join(TASK_KINDS)} (got {task!r})")
    if task == "binary" and classes < 2:
        raise TrellisUserError("--task binary needs --classes >= 2 (the label is the planted class's parity)")
    if labels is not None and task != "multilabel":
        raise TrellisUserError(f"--labels sets the label count of --task multilabel (got --task {task})")
    if labels is not None and labels < 1:
        raise TrellisUserError(f"--labels must be >= 1 (got {labels})")


def _task_labels(y: np.ndarray, num_classes: int, task: str, labels: int | None,
                 rng: np.random.Generator) -> tuple[np.ndarray, int, dict[str, Any]]:
    """The stored labels of ``task`` derived from the planted classes ``y`` (which shape edges and features).

    Why derived: the graph and the features carry the planted classes, so any label that is a function of
    the class is learnable from them. ``binary``: 1 for odd classes, 0 for even (balanced for an even
    class count). ``multilabel``: each class switches each of the ``labels`` labels (default: one per class)
    on with probability 0.3 (every label on for at least one class), and each node's label bit flips with
    probability 0.1, so labels are correlated, noisy and recoverable only through the class.

    Returns:
        ``(y, num_classes, source entries)``; source entries are empty for ``multiclass`` so the manifests
        of stores generated before this option stay the same.
    """
    if task == "binary":
        return (y % 2).astype(np.int64), 2, {"task": task}
    if task == "multilabel":
        c = int(labels or num_classes)
        profile = rng.random((num_classes, c)) < 0.3
        profile[rng.integers(0, num_classes, c), np.arange(c)] = True
        flip = rng.random((y.shape[0], c)) < 0.1
        return (profile[y] ^ flip).astype(np.float32), c, {"task": task, "labels": c}
    return y.astype(np.int64), num_classes, {}


def _write(out: str | os.PathLike[str], csr: EdgeCSR, y: np.ndarray, num_classes: int, features: int,
           feature_noise: float, rng: dict[str, np.random.Generator], splits: dict[str, np.ndarray], name: str,
           source: dict[str, Any], overwrite: bool, progress: bool, *, node_features: str = "signal",
           edge_features: int = 0, edge_feature_noise: float | None = None, task: str = "multiclass",
           labels: int | None = None) -> Path:
    """Write the graph, generating features block by block straight into the store (bounded memory)."""
    n = csr.num_nodes
    y_out, num_labels, task_source = _task_labels(y, num_classes, task, labels, rng["labels"])
    with store_writer(out, overwrite=overwrite) as w:
        w.add("indptr", csr.indptr)
        w.add("indices", csr.indices)
        rev = build_reverse_csr(csr.indptr, csr.indices, n)
        for k, arr in zip(("rev_indptr", "rev_indices", "rev_perm"), rev):
            w.add(k, arr)
        if features > 0:
            frng = rng["features"]
            mu = (frng.standard_normal((num_classes, features)) / math.sqrt(features)).astype(np.float32)
            if node_features == "noise":
                mu[:] = 0.0  # drawn anyway so the noise that follows is the same as in "signal" mode
            x = w.create("x", (n, features), np.float32)
            with _bar(n, "features", progress, unit="node") as bar:
                for r0 in range(0, n, _FEATURE_BLOCK):
                    r1 = min(n, r0 + _FEATURE_BLOCK)
                    noise = frng.standard_normal((r1 - r0, features), dtype=np.float32)
                    x[r0:r1] = mu[y[r0:r1]] + np.float32(feature_noise) * noise
                    bar.update(r1 - r0)
            x.flush()
            del x
        if edge_features > 0:
            if not (np.array_equal(rev[0], csr.indptr) and np.array_equal(rev[1], csr.indices)):
                raise ValueError("generated graphs are symmetric; the reverse CSR must mirror the forward one")
            _write_edge_features(w, csr, rev[2], y, num_classes, edge_features,
                                 feature_noise if edge_feature_noise is None else edge_feature_noise,
                                 rng["edge_features"], progress)
        w.add("y", y_out)
        for k, ids in splits.items():
            w.add(f"{k}_idx", ids)
        return w.commit(num_nodes=n, num_edges=csr.num_edges, name=name, task=task,
                        num_classes=num_labels, source={**source, **task_source})


def sbm_edges(y: np.ndarray, num_pairs: int, homophily: float, rng: np.random.Generator,
              progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Planted-partition edge pairs, vectorized in fixed-size blocks.

    Each pair has a uniform source and a destination in the source's class with probability
    ``homophily``, else uniform over the nodes of the other classes.

    Args:
        y: Class of each node.
        num_pairs: Number of (undirected) pairs to draw.
        homophily: Probability that a pair joins two nodes of the same class.
        rng: Random generator.
        progress: Show a progress bar.

    Returns:
        ``(src, dst)`` int64 arrays of length ``num_pairs`` (may hold self loops and repeats).
    """
    n = y.shape[0]
    num_classes = int(y.max()) + 1
    order = np.argsort(y, kind="stable").astype(np.int64)  # nodes grouped by class
    sizes = np.bincount(y, minlength=num_classes).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    src_parts, dst_parts = [], []
    with _bar(num_pairs, "sbm edges", progress) as bar:
        for start in range(0, num_pairs, _EDGE_BLOCK):
            m = min(_EDGE_BLOCK, num_pairs - start)
            u = rng.integers(0, n, m, dtype=np.int64)
            intra = rng.random(m) < homophily
            r = rng.random(m)
            cu = y[u]
            size_u, off_u = sizes[cu], offsets[cu]
            others = n - size_u
            intra |= others == 0  # a single class has no "other" nodes
            idx_in = off_u + np.minimum((r * size_u).astype(np.int64), size_u - 1)
            k = np.minimum((r * others).astype(np.int64), np.maximum(others - 1, 0))
            idx_out = k + (k >= off_u) * size_u  # skip over the source's own class block
            v = order[np.where(intra, idx_in, idx_out)]
            src_parts.append(u)
            dst_parts.append(v)
            bar.update(m)
    if not src_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(src_parts), np.concatenate(dst_parts)


def generate_sbm(
    out: str | os.PathLike[str],
    *,
    nodes: int,
    avg_degree: float = 10.0,
    features: int = 32,
    classes: int = 4,
    seed: int = 0,
    homophily: float = 0.8,
    feature_noise: float = DEFAULT_FEATURE_NOISE,
    train_frac: float = 0.1,
    val_frac: float = 0.1,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    node_features: str = "signal",
    edge_features: int = 0,
    edge_feature_noise: float | None = None,
    task: str = "multiclass",
    labels: int | None = None,
) -> Path:
    """Generate a planted-partition (stochastic block model) graph and write it as a store.

    Args:
        out: Store directory to create.
        nodes: Number of nodes.
        avg_degree: Directed edges per node after symmetrization (default: 10).
        features: Feature width; 0 writes no features (default: 32).
        classes: Number of planted classes, assigned uniformly at random (default: 4).
        seed: Random seed; the same seed gives the same store arrays (default: 0).
        homophily: Fraction of edges inside a class (default: 0.8).
        feature_noise: Per-dimension feature noise; class means are ~sqrt(2) apart (default: 1.5).
        train_frac: Fraction of nodes in the training split (default: 0.1).
        val_frac: Fraction of nodes in the validation split (default: 0.1; the rest is test).
        name: Dataset name (default: ``sbm-<nodes>``).
        overwrite: Replace an existing store (default: False).
        progress: Show progress bars on a terminal (default: True).
        node_features: ``signal`` (class means plus noise) or ``noise`` (pure noise, so the class signal
            lives only in the edge features) (default: ``signal``).
        edge_features: Edge feature width; 0 writes none (default: 0). See the module doc.
        edge_feature_noise: Per-dimension edge feature noise (default: ``feature_noise``).
        task: Labels to write: ``multiclass`` (the planted classes), ``binary`` or ``multilabel``
            (derived from the classes; see :func:`_task_labels`) (default: ``multiclass``).
        labels: ``multilabel``: number of labels (default: ``classes``).

    Returns:
        The store path.
    """
    _check_common(nodes, avg_degree, features, classes, feature_noise, edge_features, edge_feature_noise,
                  node_features)
    _check_task(task, labels, classes)
    check_output(out, overwrite=overwrite)
    if not 0 <= homophily <= 1:
        raise TrellisUserError(f"--homophily must be in [0, 1] (got {homophily})")
    rng = _streams(seed)
    splits = random_split(nodes, train_frac, val_frac, seed=int(rng["splits"].integers(2**63 - 1)))
    y = rng["labels"].integers(0, classes, nodes, dtype=np.int64)
    pairs = int(round(nodes * avg_degree / 2))
    src, dst = sbm_edges(y, pairs, homophily, rng["edges"], progress)
    csr = edges_to_csr(src, dst, nodes, symmetrize=True, dedup=True, remove_self_loops=True, where="sbm")
    del src, dst
    source = {"generator": "sbm", "nodes": nodes, "avg_degree": avg_degree, "features": features,
              "classes": classes, "seed": seed, "homophily": homophily, "feature_noise": feature_noise,
              "train_frac": train_frac, "val_frac": val_frac, **_edge_source(node_features, edge_features,
                                                                               edge_feature_noise)}
    return _write(out, csr, y, classes, features, feature_noise, rng, splits, name or f"sbm-{nodes}", source,
                  overwrite, progress, node_features=node_features, edge_features=edge_features,
                  edge_feature_noise=edge_feature_noise, task=task, labels=labels)


def rmat_pairs(scale: int, m: int, a: float, b: float, c: float, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """``m`` R-MAT edge pairs on ``2**scale`` ids: one quadrant choice per bit level, vectorized over edges."""
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    ab, abc = a + b, a + b + c
    for level in range(scale):
        r = rng.random(m, dtype=np.float32)
        bit = np.int64(1) << np.int64(scale - 1 - level)
        src_bit = r >= ab  # quadrants c, d
        dst_bit = ((r >= a) & (r < ab)) | (r >= abc)  # quadrants b, d
        src |= src_bit * bit
        dst |= dst_bit * bit
    return src, dst


def generate_rmat(
    out: str | os.PathLike[str],
    *,
    nodes: int,
    avg_degree: float = 10.0,
    features: int = 32,
    classes: int = 4,
    seed: int = 0,
    a: float = 0.57,
    b: float = 0.19,
    c: float = 0.19,
    feature_noise: float = DEFAULT_FEATURE_NOISE,
    train_frac: float = 0.1,
    val_frac: float = 0.1,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    node_features: str = "signal",
    edge_features: int = 0,
    edge_feature_noise: float | None = None,
    task: str = "multiclass",
    labels: int | None = None,
) -> Path:
    """Generate an R-MAT (Chakrabarti et al. 2004) power-law graph and write it as a store.

    Edges are drawn in rounds until ``nodes * avg_degree / 2`` distinct undirected pairs exist (R-MAT
    repeats many pairs; the first occurrences in generation order are kept). Node ids are randomly
    permuted so hubs are spread over the id range. Labels are planted communities of the recursive
    structure: class = position of the node's pre-permutation id in ``classes`` equal id ranges (pairs
    inside a top-level quadrant are more likely, so labels are mildly homophilous). Features as in
    :func:`generate_sbm`.

    Args:
        out: Store directory to create.
        nodes: Number of nodes.
        avg_degree: Directed edges per node after symmetrization (default: 10).
        features: Feature width; 0 writes no features (default: 32).
        classes: Number of classes (default: 4).
        seed: Random seed (default: 0).
        a: Probability of the top-left quadrant (default: 0.57).
        b: Top-right (default: 0.19).
        c: Bottom-left (default: 0.19); ``d = 1 - a - b - c``.
        feature_noise: Per-dimension feature noise (default: 1.5).
        train_frac: Fraction of nodes for training (default: 0.1).
        val_frac: Fraction of nodes for validation (default: 0.1).
        name: Dataset name (default: ``rmat-<nodes>``).
        overwrite: Replace an existing store (default: False).
        progress: Show progress bars on a terminal (default: True).
        node_features: ``signal`` (class means plus noise) or ``noise`` (pure noise, so the class signal
            lives only in the edge features) (default: ``signal``).
        edge_features: Edge feature width; 0 writes none (default: 0). See the module doc.
        edge_feature_noise: Per-dimension edge feature noise (default: ``feature_noise``).
        task: Labels to write: ``multiclass`` (the planted classes), ``binary`` or ``multilabel``
            (derived from the classes; see :func:`_task_labels`) (default: ``multiclass``).
        labels: ``multilabel``: number of labels (default: ``classes``).

    Returns:
        The store path.
    """
    _check_common(nodes, avg_degree, features, classes, feature_noise, edge_features, edge_feature_noise,
                  node_features)
    _check_task(task, labels, classes)
    check_output(out, overwrite=overwrite)
    d = 1.0 - a - b - c
    if not all(math.isfinite(v) for v in (a, b, c)) or min(a, b, c, d) < 0:
        raise TrellisUserError(f"R-MAT probabilities a={a} b={b} c={c} must be >= 0 and sum to at most 1")
    rng = _streams(seed)
    splits = random_split(nodes, train_frac, val_frac, seed=int(rng["splits"].integers(2**63 - 1)))
    scale = max(1, math.ceil(math.log2(max(nodes, 2))))
    target = int(round(nodes * avg_degree / 2))
    keys = np.zeros(0, dtype=np.int64)  # canonical lo * N + hi of distinct pairs, in generation order
    inflation = 1.2
    with _bar(target, "rmat edges", progress) as bar:
        for _ in range(64):
            missing = target - keys.size
            if missing <= 0:
                break
            m = min(int(missing * inflation) + 1024, 4 * _EDGE_BLOCK)
            s, t = rmat_pairs(scale, m, a, b, c, rng["edges"])
            ok = (s < nodes) & (t < nodes) & (s != t)
            s, t = s[ok], t[ok]
            new = np.minimum(s, t) * np.int64(nodes) + np.maximum(s, t)
            merged = np.concatenate([keys, new])
            _, first = np.unique(merged, return_index=True)
            first.sort()
            gained = first.size - keys.size
            keys = merged[first[:target]]
            bar.update(keys.size - bar.n)
            inflation = min(64.0, max(1.2, m / max(gained, 1)))
    if keys.size < target:  # a skewed a/b/c concentrates the draws on a few pairs: say so, do not write a sparser graph
        raise TrellisUserError(f"R-MAT with a={a} b={b} c={c} drew only {keys.size:,} distinct undirected pairs of the "
                               f"{target:,} asked for ({nodes:,} nodes, --avg-degree {avg_degree}) in 64 rounds; "
                               "use less skewed probabilities (the default 0.57 0.19 0.19) or a lower --avg-degree")
    lo, hi = keys // nodes, keys % nodes
    del keys
    y_raw = (np.arange(nodes, dtype=np.int64) * classes) // nodes  # community = id range before permuting
    perm = rng["permute"].permutation(nodes).astype(np.int64)  # old id -> new id
    y = np.empty(nodes, dtype=np.int64)
    y[perm] = y_raw
    csr = edges_to_csr(perm[lo], perm[hi], nodes, symmetrize=True, dedup=True, remove_self_loops=True, where="rmat")
    del lo, hi
    source = {"generator": "rmat", "nodes": nodes, "avg_degree": avg_degree, "features": features,
              "classes": classes, "seed": seed, "a": a, "b": b, "c": c, "feature_noise": feature_noise,
              "train_frac": train_frac, "val_frac": val_frac, **_edge_source(node_features, edge_features,
                                                                               edge_feature_noise)}
    return _write(out, csr, y, classes, features, feature_noise, rng, splits, name or f"rmat-{nodes}", source,
                  overwrite, progress, node_features=node_features, edge_features=edge_features,
                  edge_feature_noise=edge_feature_noise, task=task, labels=labels)


def generate(kind: str, out: str | os.PathLike[str], **options: Any) -> Path:
    """Dispatch to :func:`generate_sbm` (``"sbm"``) or :func:`generate_rmat` (``"rmat"``)."""
    if kind == "sbm":
        return generate_sbm(out, **options)
    if kind == "rmat":
        return generate_rmat(out, **options)
    raise TrellisUserError(f"unknown generator {kind!r}; use one of {', '.join(GENERATORS)}")
