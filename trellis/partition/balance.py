"""Part-size caps after a partitioner ran: nodes, and with ``--balance train`` training nodes too.

Why a pass of its own: a min-cut partition of a homophilous graph follows its classes, and a training split
drawn per class (Shchur et al.'s protocol) then lands unevenly on the parts, so data-parallel ranks training
them get unequal targets and batch counts. pymetis has no multi-constraint partitioning and the streaming
methods balance node counts only, so every destination-owned method gets the same greedy repair: surplus
training nodes move first, then surplus other nodes (which leaves the training counts as they are), each to
the part with room that holds most of its neighbours.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.utils.numba import njit

#: ``--balance`` choices: what every part gets an equal share of (within ``--imbalance``).
BALANCES = ("nodes", "train")


def train_mask(store: GraphStore) -> np.ndarray:
    """``bool [N]``: the store's training nodes.

    Raises:
        TrellisUserError: The store has no training split.
    """
    train = store.split("train")
    if train is None or len(train) == 0:
        raise TrellisUserError(f"--balance train: {store.path} has no training split to balance; use --balance nodes")
    mask = np.zeros(store.num_nodes, dtype=bool)
    mask[np.asarray(train, dtype=np.int64)] = True
    return mask


@njit(cache=True, nogil=True)
def _enforce_cap(xadj: np.ndarray, adjncy: np.ndarray, parts: np.ndarray, caps: np.ndarray,
                 order: np.ndarray, weight: np.ndarray) -> int:
    num_parts = caps.shape[0]
    sizes = np.zeros(num_parts, dtype=np.int64)
    for v in range(parts.shape[0]):
        sizes[parts[v]] += weight[v]
    cnt = np.zeros(num_parts, dtype=np.int64)
    moved = 0
    for v in order:
        p = parts[v]
        if sizes[p] <= caps[p]:
            continue
        for k in range(xadj[v], xadj[v + 1]):
            cnt[parts[adjncy[k]]] += 1
        best = -1
        for q in range(num_parts):
            if sizes[q] < caps[q] and (best < 0 or cnt[q] > cnt[best]
                                       or (cnt[q] == cnt[best] and sizes[q] < sizes[best])):
                best = q
        for q in range(num_parts):
            cnt[q] = 0
        if best >= 0:
            parts[v] = best
            sizes[p] -= weight[v]
            sizes[best] += weight[v]
            moved += 1
    return moved


def enforce_cap(xadj: np.ndarray, adjncy: np.ndarray, parts: np.ndarray, caps: np.ndarray, seed: int,
                movable: np.ndarray | None = None, counted: np.ndarray | None = None) -> int:
    """Move nodes out of parts above ``caps[p]`` into parts with room; returns how many moved.

    Visits nodes in a seeded random order and sends each surplus node to the part with room that holds
    most of its neighbours, so the cut grows as little as a single greedy pass allows. ``movable`` and
    ``counted`` (boolean masks, default: every node) restrict which nodes may move and which count towards a
    part's size.
    """
    caps = np.asarray(caps, dtype=np.int64)
    weight = np.ones(parts.shape[0], dtype=np.int64) if counted is None else counted.astype(np.int64)
    if np.all(np.bincount(parts, weights=weight, minlength=caps.shape[0]) <= caps):
        return 0
    order = np.random.default_rng(seed).permutation(parts.shape[0])
    if movable is not None:
        order = order[movable[order]]
    return int(_enforce_cap(xadj, adjncy, parts, caps, order, weight))


def balance_train(store: GraphStore, parts: np.ndarray, num_parts: int, imbalance: float, seed: int,
                  node_cap: int) -> dict[str, Any]:
    """Give every part at most its share of training nodes (and of nodes), moving nodes in place in ``parts``.

    Neighbour counts come from the store's in-edge CSR (memory-mapped, so a streaming partitioner's memory
    stays flat). Returns what moved, for the book's ``params``.
    """
    train = train_mask(store)
    cap = int(np.ceil(int(train.sum()) / num_parts * (1.0 + imbalance)))
    indptr, indices = np.asarray(store.indptr), np.asarray(store.indices)
    moved_train = enforce_cap(indptr, indices, parts, np.full(num_parts, cap), seed, movable=train, counted=train)
    moved = enforce_cap(indptr, indices, parts, np.full(num_parts, node_cap), seed, movable=~train)
    return {"balance": "train", "rebalanced_train": moved_train, "rebalanced_other": moved}
