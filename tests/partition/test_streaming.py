import numpy as np
import pytest

from trellis.partition import part_cap, partition_graph
from trellis.partition.streaming import fennel_alpha

from .conftest import cut_frac


@pytest.mark.parametrize("method", ["ldg", "fennel"])
def test_streaming_beats_hash_within_cap(planted_store, method):
    store, _ = planted_store
    book = partition_graph(store, method, 4, measure=False)
    hashed = partition_graph(store, "hash", 4, measure=False)
    assert book.part_sizes().max() <= part_cap(store.num_nodes, 4, 0.05)
    assert cut_frac(store, book.node_parts) < cut_frac(store, hashed.node_parts) - 0.1
    assert book.params["order"] == "random"


def test_streaming_is_deterministic(planted_store):
    store, _ = planted_store
    a = partition_graph(store, "fennel", 3, seed=4, measure=False)
    b = partition_graph(store, "fennel", 3, seed=4, measure=False)
    assert np.array_equal(a.node_parts, b.node_parts)


def test_fennel_alpha():
    assert fennel_alpha(4, 1000, 100) == pytest.approx(2 * 1000 / 1000)
