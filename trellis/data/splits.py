"""Seeded train/val/test node splits.

Two protocols: Shchur et al.'s per-class split (a fixed number of labelled nodes per class for training
and validation, the rest for testing) and a random fraction split (used by the generators). Both are
deterministic functions of the seed and return sorted int64 node ids.
"""

from __future__ import annotations

import numpy as np

from trellis.errors import TrellisUserError


def per_class_split(
    y: np.ndarray,
    train_per_class: int = 20,
    val_per_class: int = 30,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Shchur et al. (2018) per-class split.

    Per class, ``train_per_class`` training and ``val_per_class`` validation nodes are drawn at random;
    every other labelled node is a test node.

    A class with fewer than ``train_per_class + val_per_class`` nodes gives what it has, training first
    (so a class of 25 nodes gives 20 training, 5 validation and no test nodes). Unlabelled nodes
    (label < 0) are in no split.

    Args:
        y: ``int [N]`` class labels (-1 = unlabelled).
        train_per_class: Training nodes per class (default: 20).
        val_per_class: Validation nodes per class (default: 30).
        seed: Random seed (default: 0).

    Returns:
        ``{"train": ids, "val": ids, "test": ids}``, each sorted.
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise TrellisUserError("per-class splits need one class label per node; multilabel data needs split files")
    if train_per_class < 0 or val_per_class < 0:
        raise TrellisUserError("--train-per-class and --val-per-class must be >= 0")
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in np.unique(y[y >= 0]):
        nodes = rng.permutation(np.flatnonzero(y == c))
        parts["train"].append(nodes[:train_per_class])
        parts["val"].append(nodes[train_per_class:train_per_class + val_per_class])
        parts["test"].append(nodes[train_per_class + val_per_class:])
    return {k: np.sort(np.concatenate(v)).astype(np.int64) if v else np.zeros(0, np.int64)
            for k, v in parts.items()}


def random_split(
    num_nodes: int,
    train_frac: float = 0.1,
    val_frac: float = 0.1,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Random node split: ``train_frac`` / ``val_frac`` of the nodes, the rest test.

    Args:
        num_nodes: Number of nodes.
        train_frac: Fraction of nodes for training (default: 0.1).
        val_frac: Fraction of nodes for validation (default: 0.1).
        seed: Random seed (default: 0).

    Returns:
        ``{"train": ids, "val": ids, "test": ids}``, each sorted.
    """
    if not (0 <= train_frac <= 1 and 0 <= val_frac <= 1 and train_frac + val_frac <= 1):
        raise TrellisUserError(f"split fractions train={train_frac} val={val_frac} must be in [0, 1] and sum to "
                               "at most 1")
    perm = np.random.default_rng(seed).permutation(num_nodes)
    n_train = int(round(train_frac * num_nodes))
    n_val = int(round(val_frac * num_nodes))
    return {
        "train": np.sort(perm[:n_train]).astype(np.int64),
        "val": np.sort(perm[n_train:n_train + n_val]).astype(np.int64),
        "test": np.sort(perm[n_train + n_val:]).astype(np.int64),
    }
