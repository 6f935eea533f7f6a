import numpy as np

from trellis.partition import part_cap, partition_graph
from trellis.partition.metis import enforce_cap, run_metis, symmetric_adjacency

from .conftest import csr_from_edges, cut_frac


def test_symmetric_adjacency_drops_loops_and_weights_duplicates():
    indptr, indices = csr_from_edges(3, np.array([0, 1, 2, 2]), np.array([1, 0, 2, 0]))
    xadj, adjncy, w = symmetric_adjacency(indptr, indices, 3)
    rows = np.repeat(np.arange(3), np.diff(xadj))
    got = {(int(r), int(c)): int(x) for r, c, x in zip(rows, adjncy, w)}
    assert got == {(0, 1): 2, (1, 0): 2, (0, 2): 1, (2, 0): 1}


def test_metis_recovers_planted_partition(planted_store):
    store, truth = planted_store
    book = partition_graph(store, "metis", 4, measure=False)
    assert cut_frac(store, book.node_parts) <= cut_frac(store, truth) + 0.005
    assert book.part_sizes().max() <= part_cap(store.num_nodes, 4, 0.05)


def test_enforce_cap_moves_surplus_nodes():
    indptr, indices = csr_from_edges(6, np.array([0, 1, 2, 3, 4]), np.array([1, 2, 3, 4, 5]))
    xadj, adjncy, _ = symmetric_adjacency(indptr, indices, 6)
    parts = np.zeros(6, dtype=np.int32)
    moved = enforce_cap(xadj, adjncy, parts, np.array([3, 3]), seed=0)
    assert moved == 3 and np.bincount(parts, minlength=2).tolist() == [3, 3]
    assert enforce_cap(xadj, adjncy, parts, np.array([3, 3]), seed=0) == 0


def test_run_metis_without_edges_deals_round_robin():
    parts = run_metis(np.zeros(5, dtype=np.int64), np.zeros(0, dtype=np.int64), None, 2, imbalance=0.0, seed=0)
    assert np.bincount(parts).tolist() == [2, 2]
