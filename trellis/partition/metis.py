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
from trellis.partition.balance import enforce_cap
from trellis.partition.base import Partitioner, register


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
    """

    ownership = "dst"

    def __init__(self, num_parts: int, *, seed: int = 0, imbalance: float = 0.05, progress: bool = False,
                 recursive: bool | None = None) -> None:
        super().__init__(num_parts, seed=seed, imbalance=imbalance, progress=progress)
        self.recursive = recursive

    def options(self) -> dict[str, Any]:
        """Base options plus ``recursive`` (bisection vs k-way), recorded in the book."""
        return {**super().options(), "recursive": self.recursive}

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """METIS on the symmetrised graph, then :func:`enforce_cap`; extra params report ``rebalanced_nodes``."""
        n = store.num_nodes
        xadj, adjncy, w = symmetric_adjacency(store.indptr, store.indices, n)
        parts = run_metis(xadj, adjncy, w, self.num_parts, imbalance=self.imbalance, seed=self.seed,
                          recursive=self.recursive)
        moved = enforce_cap(xadj, adjncy, parts, self.num_parts, self.cap(n), self.seed)
        return parts, {"rebalanced_nodes": moved}
