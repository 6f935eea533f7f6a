import numpy as np
import pytest

from trellis.partition.edges import edge_ranges, num_shuffled_chunks, row_edges, shuffled_chunks

from .conftest import csr_from_edges, edge_dst


@pytest.fixture()
def graph():
    rng = np.random.default_rng(0)
    n = 50
    src, dst = rng.integers(0, n, 700), rng.integers(0, n, 700)
    dst[:40] = 7  # a hub row longer than the chunks below
    indptr, indices = csr_from_edges(n, src, dst)
    return n, indptr, indices


def test_edge_ranges_cover_every_edge_in_order(graph):
    _, indptr, indices = graph
    chunks = list(edge_ranges(indptr, indices, 33))
    assert all(c[0].shape[0] <= 33 for c in chunks)
    src = np.concatenate([c[0] for c in chunks])
    dst = np.concatenate([c[1] for c in chunks])
    eid = np.concatenate([c[2] for c in chunks])
    assert np.array_equal(eid, np.arange(indices.shape[0]))
    assert np.array_equal(src, indices) and np.array_equal(dst, edge_dst(indptr))


@pytest.mark.parametrize("chunk,block", [(64, None), (100, 7), (1, 1), (5000, None)])
def test_shuffled_chunks_cover_every_edge_once(graph, chunk, block):
    _, indptr, indices = graph
    pairs = [(s.copy(), d.copy()) for s, d in shuffled_chunks(indptr, indices, chunk, seed=3, block_edges=block)]
    assert len(pairs) == num_shuffled_chunks(indices.shape[0], chunk, block)
    assert all(s.shape[0] <= max(chunk, block or 1) for s, _ in pairs)
    got = sorted(zip(np.concatenate([s for s, _ in pairs]).tolist(), np.concatenate([d for _, d in pairs]).tolist()))
    want = sorted(zip(indices.tolist(), edge_dst(indptr).tolist()))
    assert got == want


def test_shuffled_chunks_are_deterministic_and_seeded(graph):
    _, indptr, indices = graph

    def stream(seed):
        return np.concatenate([s.copy() for s, _ in shuffled_chunks(indptr, indices, 64, seed=seed, block_edges=4)])

    assert np.array_equal(stream(1), stream(1))
    assert not np.array_equal(stream(1), stream(2))
    assert not np.array_equal(stream(1), indices)  # not the destination-sorted order


def test_row_edges_split_hubs_and_keep_order(graph):
    n, indptr, indices = graph
    nodes = np.array([7, 3, 9, 0])
    chunks = [(p.copy(), r.copy()) for p, r in row_edges(indptr, nodes, 16)]
    assert all(p.shape[0] <= 16 for p, _ in chunks)
    pos = np.concatenate([p for p, _ in chunks])
    rows = np.concatenate([r for _, r in chunks])
    want = np.concatenate([np.arange(indptr[v], indptr[v + 1]) for v in nodes])
    assert np.array_equal(pos, want)
    assert np.array_equal(rows, np.repeat(nodes, np.diff(indptr)[nodes]))


def test_empty_graph_streams_nothing():
    indptr, indices = np.zeros(4, dtype=np.int64), np.zeros(0, dtype=np.int64)
    assert list(shuffled_chunks(indptr, indices, 10, seed=0)) == []
    assert list(edge_ranges(indptr, indices, 10)) == []
    assert list(row_edges(indptr, np.arange(3), 10)) == []
