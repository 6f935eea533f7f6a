"""Structure-blind baselines: balanced random placement and 1D hash placement (GraphTheta §4.1, §5.4).

``hash`` places node ``v`` by a seeded integer hash of its id and keeps each edge with its **source**
(GraphTheta's default "1D-edge" partition: a master and all its out-edges in one worker, so edge
attributes and edge attention are computed without communication). ``hash-dst`` uses the same node
placement but keeps each edge with its destination. ``random`` is a seeded, exactly balanced random
placement (a shuffled round robin). None of them reads an edge, so they cost O(N) time and memory; they
are the floor every structure-aware method must beat.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.partition.base import Partitioner, register
from trellis.partition.hashing import hash_parts


@register("random")
class RandomPartitioner(Partitioner):
    """Seeded random placement with exact balance (part sizes differ by at most one); edges with destination."""

    ownership = "dst"

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """A seeded shuffled round robin of part ids, so part sizes differ by at most one; no extra params."""
        n = store.num_nodes
        parts = np.empty(n, dtype=np.int32)
        parts[np.random.default_rng(self.seed).permutation(n)] = np.arange(n, dtype=np.int64) % self.num_parts
        return parts, {}


@register("hash", "hash-src")
class HashSrcPartitioner(Partitioner):
    """1D hash placement, edges with their source (GraphTheta's default; balanced only in expectation)."""

    ownership = "src"
    balanced = False

    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """Seeded hash of each node id; edges are not read, so O(N) time and memory; no extra params."""
        return hash_parts(store.num_nodes, self.num_parts, self.seed), {}


@register("hash-dst")
class HashDstPartitioner(HashSrcPartitioner):
    """1D hash placement, edges with their destination (GraphTheta's configurable alternative)."""

    ownership = "dst"
