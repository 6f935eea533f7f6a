"""Property tests over every registered method on tiny graphs (empty rows, stars, cliques, isolated
nodes, self loops, duplicate edges, disconnected components)."""

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trellis.data.store import open_store, write_store
from trellis.partition import available_methods, evaluate, get_partitioner, part_cap, partition_graph

from .conftest import csr_from_edges, edge_dst

METHODS = sorted(available_methods())


@st.composite
def tiny_graphs(draw):
    n = draw(st.integers(1, 24))
    kind = draw(st.sampled_from(["random", "star", "clique", "components", "empty"]))
    if kind == "random":
        pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=90))
    elif kind == "star":
        pairs = [(0, v) for v in range(1, n)]
    elif kind == "clique":
        k = draw(st.integers(1, min(n, 8)))
        pairs = [(u, v) for u in range(k) for v in range(k) if u < v]
    elif kind == "components":
        half = n // 2
        pairs = [(u, u + 1) for u in range(half - 1)] + [(u, u + 1) for u in range(half, n - 1)]
    else:
        pairs = []
    if draw(st.booleans()):
        pairs = pairs + [(v, v) for v in draw(st.lists(st.integers(0, n - 1), max_size=3))]  # self loops
    symmetric = draw(st.booleans())
    src = [u for u, _ in pairs] + ([v for _, v in pairs] if symmetric else [])
    dst = [v for _, v in pairs] + ([u for u, _ in pairs] if symmetric else [])
    parts = draw(st.integers(1, n))
    return n, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), parts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=tiny_graphs(), method=st.sampled_from(METHODS), seed=st.integers(0, 3),
       chunk=st.sampled_from([None, 0.05, 0.5, 1.0]))
def test_every_node_in_exactly_one_part_within_cap(graph, method, seed, chunk):
    n, src, dst, parts = graph
    with tempfile.TemporaryDirectory() as tmp:
        indptr, indices = csr_from_edges(n, src, dst)
        write_store(Path(tmp) / "s", indptr=indptr, indices=indices)
        store = open_store(Path(tmp) / "s")
        opts = {"chunk_frac": chunk} if method == "grem" and chunk is not None else {}
        book = partition_graph(store, method, parts, seed=seed, measure=False, **opts)
        assert book.node_parts.shape == (n,) and book.node_parts.dtype == np.int32
        assert book.node_parts.min() >= 0 and book.node_parts.max() < parts
        assert book.part_sizes().sum() == n
        if get_partitioner(method).balanced:
            assert book.part_sizes().max() <= part_cap(n, parts, 0.05)
        q = evaluate(store, book)
        true_cut = int(np.count_nonzero(book.node_parts[indices] != book.node_parts[edge_dst(indptr)]))
        assert q.edge_cut == true_cut
        again = partition_graph(store, method, parts, seed=seed, measure=False, **opts)
        assert np.array_equal(again.node_parts, book.node_parts)  # deterministic from the seed
