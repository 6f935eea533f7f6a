"""Fixtures of the distributed tests: a small store with edge features and its layouts, one per ownership."""

from __future__ import annotations

from pathlib import Path

import pytest

from trellis.data.store import GraphStore
from trellis.partition import evaluate, partition_graph
from trellis.partition.layout import write_layout

#: (method, parts) of the layouts the tests train on: one partitioner of each ownership, at 1, 2 and 4 parts
#: (vertex-cut at 4: at 2 parts its grid is 1x2 and degenerates to destination ownership).
LAYOUTS = (("metis", 1), ("metis", 2), ("metis", 4), ("hash", 2), ("hash", 4), ("reverse", 4),
           ("vertex-cut", 4))


@pytest.fixture(scope="session")
def dist_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 600-node, 4-class SBM store with 16 features, 3 edge features and splits (seed 0)."""
    from trellis.data.generate import generate_sbm

    out = tmp_path_factory.mktemp("dist") / "sbm"
    return generate_sbm(out, nodes=600, avg_degree=8, features=16, classes=4, seed=0, edge_features=3,
                        progress=False)


@pytest.fixture(scope="session")
def layouts(dist_store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    """``(method, parts) -> PART_DIR`` for every entry of :data:`LAYOUTS`."""
    store = GraphStore(dist_store)
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for method, parts in LAYOUTS:
        book = partition_graph(store, method, parts, measure=False)
        out[(method, parts)] = write_layout(store, book, root / f"{method}-{parts}",
                                            quality=evaluate(store, book, width=16))
    return out
