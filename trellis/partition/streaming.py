"""One-pass streaming greedy partitioners with fixed assignments: LDG and Fennel.

Nodes arrive in a seeded random order; each is placed once, for good, in the part holding most of its
already-placed neighbours, discounted by how full that part is:

* **LDG** (Stanton & Kliot 2012): ``score_i = n_i * (1 - |S_i| / C)``.
* **Fennel** (Tsourakakis et al. 2014): ``score_i = n_i - alpha * gamma * |S_i|^(gamma-1)`` with
  ``gamma = 1.5`` and ``alpha = sqrt(P) * m / N^1.5``.

``n_i`` counts neighbours in both directions (in-edges from the CSR, out-edges from the store's cached
reverse CSR), so directed graphs are partitioned as undirected ones; on a symmetric store each neighbour
is counted twice, and ``m`` is the stored edge count, which keeps Fennel's two terms on the same scale.
Parts never exceed the cap ``C`` (:func:`trellis.partition.base.part_cap`); ties go to the smaller part.

State is O(N + P) (the placement and the node order); the CSR rows are read from the memory-mapped store.
These are the "fixed greedy assignments" that GREM's refinement improves on (Armada §4.1, Fig. 6).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.partition.base import Partitioner, register
from trellis.utils.numba import njit

LDG, FENNEL = 0, 1
FENNEL_GAMMA = 1.5


@njit(cache=True, nogil=True, inline="always")
def greedy_score(mode: int, count: float, size: float, cap: float, alpha: float, gamma: float) -> float:
    """LDG or Fennel score of placing a node with ``count`` neighbours in a part of ``size`` nodes."""
    if mode == LDG:
        return count * (1.0 - size / cap)
    return count - alpha * gamma * size ** (gamma - 1.0)


@njit(cache=True, nogil=True)
def _stream_assign(indptr: np.ndarray, indices: np.ndarray, rindptr: np.ndarray, rindices: np.ndarray,
                   order: np.ndarray, num_parts: int, cap: int, mode: int, alpha: float, gamma: float,
                   parts: np.ndarray) -> None:
    sizes = np.zeros(num_parts, dtype=np.int64)
    cnt = np.zeros(num_parts, dtype=np.float64)
    for v in order:
        for k in range(indptr[v], indptr[v + 1]):
            p = parts[indices[k]]
            if p >= 0:
                cnt[p] += 1.0
        for k in range(rindptr[v], rindptr[v + 1]):
            p = parts[rindices[k]]
            if p >= 0:
                cnt[p] += 1.0
        best = -1
        best_score = -np.inf
        for p in range(num_parts):
            if sizes[p] >= cap:
                continue
            s = greedy_score(mode, cnt[p], sizes[p], cap, alpha, gamma)
            if s > best_score or (s == best_score and sizes[p] < sizes[best]):
                best = p
                best_score = s
        for p in range(num_parts):
            cnt[p] = 0.0
        parts[v] = best
        sizes[best] += 1


def fennel_alpha(num_parts: int, num_edges: int, num_nodes: int) -> float:
    """Fennel's ``alpha = sqrt(P) * m / N^1.5`` (``m`` = stored edges; see the module docstring)."""
    return math.sqrt(num_parts) * max(num_edges, 1) / max(num_nodes, 1) ** 1.5


class _StreamingPartitioner(Partitioner):
    mode: int = LDG

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        n = store.num_nodes
        parts = np.full(n, -1, dtype=np.int32)
        order = np.random.default_rng(self.seed).permutation(n)
        rindptr, rindices, _ = store.reverse_csr()
        alpha = fennel_alpha(self.num_parts, store.num_edges, n)
        _stream_assign(np.asarray(store.indptr), np.asarray(store.indices), np.asarray(rindptr),
                       np.asarray(rindices), order, self.num_parts, self.cap(n), self.mode, alpha,
                       FENNEL_GAMMA, parts)
        extra: dict[str, Any] = {"order": "random"}
        if self.mode == FENNEL:
            extra.update(alpha=alpha, gamma=FENNEL_GAMMA)
        return parts, extra


@register("ldg")
class LDGPartitioner(_StreamingPartitioner):
    """Linear Deterministic Greedy over a random node stream (fixed assignments)."""

    mode = LDG


@register("fennel")
class FennelPartitioner(_StreamingPartitioner):
    """Fennel over a random node stream (fixed assignments)."""

    mode = FENNEL
