"""METIS through pymetis: the offline min-edge-cut baseline, and an option for GREM's seed step.

METIS needs the whole graph in memory as a symmetric adjacency without self loops, so this method is
O(E) in memory — exactly the cost GREM avoids (Armada Fig. 5), and the reason it is the baseline. The
store's in-edge CSR is symmetrised as ``A + A^T`` with integer edge weights (2 where both directions are
stored), which makes METIS's weighted cut equal to the number of stored edges cut.

METIS treats its balance tolerance (``ufactor``) as a target, not a bound; :func:`enforce_cap` then moves
the fewest nodes needed (those with the most neighbours in the receiving part) so the cap holds exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pymetis

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.partition.base import Partitioner, register
from trellis.utils.numba import njit


def symmetric_adjacency(indptr: np.ndarray, indices: np.ndarray, num_nodes: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(xadj, adjncy, weights)`` of ``A + A^T`` without the diagonal; weights count stored edges."""
    import scipy.sparse as sp  # imported here: streaming methods never need it (and save its memory)

    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    a = sp.csr_matrix((np.ones(indices.shape[0], dtype=np.int32), indices, indptr), shape=(num_nodes, num_nodes))
    s = (a + a.T).tocsr()
    s.setdiag(0)
    s.eliminate_zeros()
    s.sort_indices()
    return s.indptr.astype(np.int64), s.indices.astype(np.int64), s.data.astype(np.int64)


def run_metis(xadj: np.ndarray, adjncy: np.ndarray, weights: np.ndarray | None, num_parts: int, *,
              imbalance: float, seed: int, tpwgts: list[float] | None = None,
              vweights: np.ndarray | None = None, recursive: bool | None = None, ncuts: int = 1) -> np.ndarray:
    """Call pymetis and return ``int32`` parts (``ncuts``: METIS computes that many and keeps the best).

    A graph without edges cannot be cut; its nodes are dealt round-robin (all zeros for one part).
    """
    n = xadj.shape[0] - 1
    if num_parts == 1 or adjncy.shape[0] == 0:
        return (np.arange(n) % num_parts).astype(np.int32)
    opts = pymetis.Options(seed=int(seed), ufactor=max(1, int(round(imbalance * 1000))), ncuts=int(ncuts))
    # int64 matches pymetis's idx_t, so the arrays are passed without a copy
    xadj = np.ascontiguousarray(xadj, dtype=np.int64)
    adjncy = np.ascontiguousarray(adjncy, dtype=np.int64)
    weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.int64)
    vweights = None if vweights is None else np.ascontiguousarray(vweights, dtype=np.int64)
    if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025.2; passing xadj/adjncy is deprecated there
        _, membership = pymetis.part_graph(num_parts, pymetis.CSRAdjacency(xadj, adjncy), eweights=weights,
                                           vweights=vweights, tpwgts=tpwgts, options=opts, recursive=recursive)
    else:  # pragma: no cover - older pymetis
        _, membership = pymetis.part_graph(num_parts, xadj=xadj, adjncy=adjncy, eweights=weights, vweights=vweights,
                                           tpwgts=tpwgts, options=opts, recursive=recursive)
    return np.asarray(membership, dtype=np.int32)


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


@register("metis")
class MetisPartitioner(Partitioner):
    """METIS (pymetis) on the symmetrised graph; the whole graph is held in memory.

    Args:
        num_parts: Number of parts.
        seed: METIS's random seed (default: 0).
        imbalance: Allowed imbalance; METIS's ``ufactor`` and the enforced cap (default: 0.05).
        progress: Unused (METIS reports no progress).
        recursive: Recursive bisection (True) or direct k-way (False); None is pymetis's default,
            recursive up to 8 parts and k-way above (default: None). k-way cuts a little less on
            community graphs; recursive bisection cuts far less on R-MAT-like graphs with many
            isolated nodes.
        balance: What every part gets an equal share of: ``nodes``, or ``train`` (training nodes as well as
            nodes, so ranks training the parts get equal target and batch counts). pymetis has no
            multi-constraint partitioning, so ``train`` moves surplus training nodes, then surplus other
            nodes, greedily to the parts with room that hold most of their neighbours (default: ``nodes``).
    """

    ownership = "dst"

    def __init__(self, num_parts: int, *, seed: int = 0, imbalance: float = 0.05, progress: bool = False,
                 recursive: bool | None = None, balance: str = "nodes") -> None:
        super().__init__(num_parts, seed=seed, imbalance=imbalance, progress=progress)
        if balance not in BALANCES:
            raise TrellisUserError(f"--balance {balance!r}: choose one of {', '.join(BALANCES)}")
        self.recursive = recursive
        self.balance = balance

    def options(self) -> dict[str, Any]:
        """Base options plus ``recursive`` (bisection vs k-way) and ``balance``, recorded in the book."""
        return {**super().options(), "recursive": self.recursive, "balance": self.balance}

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """METIS on the symmetrised graph, then :func:`enforce_cap`; extra params report ``rebalanced_nodes``."""
        n = store.num_nodes
        xadj, adjncy, w = symmetric_adjacency(store.indptr, store.indices, n)
        parts = run_metis(xadj, adjncy, w, self.num_parts, imbalance=self.imbalance, seed=self.seed,
                          recursive=self.recursive)
        extra: dict[str, Any] = {}
        if self.balance == "train":  # training nodes first, then the other nodes (so they stay put)
            train = train_mask(store)
            cap = int(np.ceil(int(train.sum()) / self.num_parts * (1.0 + self.imbalance)))
            extra["rebalanced_train"] = enforce_cap(xadj, adjncy, parts, np.full(self.num_parts, cap), self.seed,
                                                    movable=train, counted=train)
            moved = enforce_cap(xadj, adjncy, parts, np.full(self.num_parts, self.cap(n)), self.seed, movable=~train)
        else:
            moved = enforce_cap(xadj, adjncy, parts, np.full(self.num_parts, self.cap(n)), self.seed)
        return parts, {"rebalanced_nodes": moved, **extra}
