import numpy as np
import pytest

from trellis.partition import evaluate, partition_graph
from trellis.partition.hashing import grid_edge_parts, grid_masters, grid_shape

from .conftest import edge_dst


@pytest.mark.parametrize("p,shape", [(1, (1, 1)), (4, (2, 2)), (6, (2, 3)), (7, (1, 7)), (16, (4, 4))])
def test_grid_shape(p, shape):
    assert grid_shape(p) == shape


def test_edges_of_a_node_stay_in_its_row_and_column(planted_store):
    store, _ = planted_store
    book = partition_graph(store, "vertex-cut", 6, seed=2, measure=False)
    rows, cols = book.params["grid"]
    src, dst = np.asarray(store.indices), edge_dst(store.indptr)
    ep = book.edge_parts(src, dst)
    assert np.array_equal(ep, grid_edge_parts(src, dst, rows, cols, 2))
    masters = grid_masters(store.num_nodes, rows, cols, 2)
    assert np.array_equal(masters, book.node_parts)
    # every edge lies in the source's grid row and in the destination's grid column
    assert np.array_equal(ep // cols, masters[src] // cols)
    assert np.array_equal(ep % cols, masters[dst] % cols)


def test_replication_bounded_by_grid(planted_store):
    store, _ = planted_store
    book = partition_graph(store, "vertex-cut", 16, measure=False)
    q = evaluate(store, book)
    rows, cols = book.params["grid"]
    assert 1.0 <= q.replication_factor <= rows + cols - 1
    assert q.edge_balance < 1.2  # the hash spreads edges evenly
    assert q.ownership == "vertex-cut"
