from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.data.csr import (
    ArrayEdgeSource,
    _sorted_order,
    build_csr_chunked,
    edges_to_csr,
)
from trellis.data.store import open_store, store_writer
from trellis.errors import TrellisUserError
from trellis.utils.csr import build_reverse_csr, stable_argsort


def reference_csr(src, dst, n, *, symmetrize, dedup, remove_self_loops):
    """Per-edge Python reference of the documented semantics: (indptr, indices, edge_ids)."""
    rows = []  # (dst, src, input row) in expansion order
    seen = {}
    for i, (s, d) in enumerate(zip(src, dst)):
        s, d = int(s), int(d)
        if remove_self_loops and s == d:
            continue
        if dedup:
            key = (min(s, d), max(s, d)) if symmetrize else (d, s)
            if key in seen:
                continue
            seen[key] = i
        rows.append((d, s, i))
        if symmetrize and s != d:
            rows.append((s, d, i))
    rows.sort(key=lambda t: (t[0], t[1]))  # stable: ties stay in input order
    indptr = np.zeros(n + 1, dtype=np.int64)
    for d, _, _ in rows:
        indptr[d + 1] += 1
    return np.cumsum(indptr), np.array([s for _, s, _ in rows], dtype=np.int64), \
        np.array([i for _, _, i in rows], dtype=np.int64)


graphs = st.integers(1, 12).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=40))
)
flags = st.tuples(st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=150, deadline=None)
@given(graphs, flags)
def test_matches_reference(graph, opts):
    n, edges = graph
    symmetrize, dedup, remove_loops = opts
    src = np.array([e[0] for e in edges], dtype=np.int64)
    dst = np.array([e[1] for e in edges], dtype=np.int64)
    csr = edges_to_csr(src, dst, n, symmetrize=symmetrize, dedup=dedup, remove_self_loops=remove_loops)
    indptr, indices, eids = reference_csr(src, dst, n, symmetrize=symmetrize, dedup=dedup,
                                          remove_self_loops=remove_loops)
    np.testing.assert_array_equal(csr.indptr, indptr)
    np.testing.assert_array_equal(csr.indices, indices)
    np.testing.assert_array_equal(csr.edge_ids, eids)


def test_matches_reference_on_numba_sized_input():
    rng = np.random.default_rng(0)
    n, e = 300, 5000  # > 1024 edges and a small id range: the counting-sort path
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    for symmetrize in (False, True):
        for dedup in (False, True):
            csr = edges_to_csr(src, dst, n, symmetrize=symmetrize, dedup=dedup, remove_self_loops=True)
            indptr, indices, eids = reference_csr(src, dst, n, symmetrize=symmetrize, dedup=dedup,
                                                  remove_self_loops=True)
            np.testing.assert_array_equal(csr.indptr, indptr)
            np.testing.assert_array_equal(csr.indices, indices)
            np.testing.assert_array_equal(csr.edge_ids, eids)


@settings(max_examples=150, deadline=None)
@given(graphs, st.booleans(), st.booleans(), st.integers(1, 3))
def test_edge_features_follow_their_edges(graph, symmetrize, dedup, dim):
    n, edges = graph
    src = np.array([e[0] for e in edges], dtype=np.int64)
    dst = np.array([e[1] for e in edges], dtype=np.int64)
    e = len(edges)
    feat = np.arange(e * dim, dtype=np.float32).reshape(e, dim) + 0.5  # row i is unique to input edge i
    weight = np.arange(e, dtype=np.float32) * 10
    csr = edges_to_csr(src, dst, n, symmetrize=symmetrize, dedup=dedup, edge_feat=feat, edge_weight=weight)
    dst_of = csr.dst()
    by_pair = {}
    for k in range(csr.num_edges):
        u, v = int(csr.indices[k]), int(dst_of[k])
        i = int(csr.edge_ids[k])
        # the carried row is the input edge's own row
        np.testing.assert_array_equal(csr.edge_feat[k], feat[i])
        assert csr.edge_weight[k] == weight[i]
        # ... and that input edge names this pair (in either direction when symmetrized)
        assert (src[i], dst[i]) == (u, v) or (symmetrize and (src[i], dst[i]) == (v, u))
        if dedup:
            naming = [j for j in range(e) if (src[j], dst[j]) == (u, v) or (symmetrize and (src[j], dst[j]) == (v, u))]
            assert i == min(naming)  # the first occurrence wins
        by_pair[(u, v)] = csr.edge_feat[k]
    if symmetrize and dedup:  # both directions of an undirected edge carry the same features
        for (u, v), f in by_pair.items():
            np.testing.assert_array_equal(f, by_pair[(v, u)])


def _chunked(src, dst, n, chunk, tmp: Path, **opts):
    out = tmp / "chunked"
    ew = opts.pop("edge_weight", None)
    ef = opts.pop("edge_feat", None)
    with store_writer(out) as w:
        info = build_csr_chunked(ArrayEdgeSource(src, dst, chunk_edges=chunk), w, num_nodes=n, chunk_edges=chunk,
                                 edge_weight=ew, edge_feat=ef, progress=False, **opts)
        w.commit(num_nodes=info.num_nodes, num_edges=info.num_edges)
    assert not list(out.glob("_scratch*"))
    return open_store(out), info


@settings(max_examples=40, deadline=None)
@given(graphs, flags, st.integers(1, 7), st.booleans())
def test_chunked_equals_in_memory(graph, opts, chunk, given_n):
    n, edges = graph
    if not edges:
        return
    symmetrize, dedup, remove_loops = opts
    src = np.array([e[0] for e in edges], dtype=np.int64)
    dst = np.array([e[1] for e in edges], dtype=np.int64)
    feat = np.arange(2 * len(edges), dtype=np.float32).reshape(-1, 2)
    weight = np.arange(len(edges), dtype=np.float32)
    num_nodes = n if given_n else None
    mem = edges_to_csr(src, dst, num_nodes, symmetrize=symmetrize, dedup=dedup, remove_self_loops=remove_loops,
                       edge_feat=feat, edge_weight=weight)
    with tempfile.TemporaryDirectory() as tmp:
        store, info = _chunked(src, dst, num_nodes, chunk, Path(tmp), symmetrize=symmetrize, dedup=dedup,
                               remove_self_loops=remove_loops, edge_feat=feat, edge_weight=weight)
        assert info.num_nodes == mem.num_nodes and info.num_edges == mem.num_edges
        np.testing.assert_array_equal(store.indptr, mem.indptr)
        np.testing.assert_array_equal(store.indices, mem.indices)
        np.testing.assert_array_equal(store.edge_feat, mem.edge_feat)
        np.testing.assert_array_equal(store.edge_weight, mem.edge_weight)
        for got, want in zip(store.reverse_csr(), build_reverse_csr(mem.indptr, mem.indices, mem.num_nodes)):
            np.testing.assert_array_equal(got, want)


def test_chunked_large_random_graph(tmp_path):
    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, 2000, 20000), rng.integers(0, 2000, 20000)
    mem = edges_to_csr(src, dst, symmetrize=True)
    store, _ = _chunked(src, dst, None, 3001, tmp_path, symmetrize=True)
    np.testing.assert_array_equal(store.indptr, mem.indptr)
    np.testing.assert_array_equal(store.indices, mem.indices)


def test_numpy_fallback_gives_the_same_csr(monkeypatch):
    from trellis.data import csr as csr_mod
    from trellis.utils import csr as ucsr

    rng = np.random.default_rng(4)
    src, dst = rng.integers(0, 200, 3000), rng.integers(0, 200, 3000)
    fast = edges_to_csr(src, dst, symmetrize=True, dedup=False)
    want = build_reverse_csr(fast.indptr, fast.indices, 200)
    monkeypatch.setattr(csr_mod, "WITH_NUMBA", False)
    monkeypatch.setattr(ucsr, "WITH_NUMBA", False)
    slow = edges_to_csr(src, dst, symmetrize=True, dedup=False)
    for a, b in ((fast.indptr, slow.indptr), (fast.indices, slow.indices), (fast.edge_ids, slow.edge_ids)):
        np.testing.assert_array_equal(a, b)
    for got, ref in zip(build_reverse_csr(fast.indptr, fast.indices, 200), want):
        np.testing.assert_array_equal(got, ref)


def test_stable_argsort_matches_numpy():
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 100, 10000)
    np.testing.assert_array_equal(stable_argsort(keys, 100), np.argsort(keys, kind="stable"))


def test_lexsort_path_for_huge_id_space():
    rows = np.array([3, 1, 3, 1, 0], dtype=np.int64) * (2**40)
    cols = np.array([5, 2, 5, 1, 9], dtype=np.int64) * (2**40)
    order = _sorted_order(rows, cols, 2**45, 2**45, dedup=False)
    np.testing.assert_array_equal(order, [4, 3, 1, 0, 2])
    np.testing.assert_array_equal(_sorted_order(rows, cols, 2**45, 2**45, dedup=True), [4, 3, 1, 0])


def test_simple_example():
    csr = edges_to_csr([0, 1, 2, 2, 1], [1, 2, 0, 0, 1], symmetrize=True, edge_weight=np.arange(5.0))
    np.testing.assert_array_equal(csr.indptr, [0, 2, 4, 6])
    np.testing.assert_array_equal(csr.indices, [1, 2, 0, 2, 0, 1])
    np.testing.assert_array_equal(csr.edge_weight, [0, 2, 0, 1, 2, 1])


def test_isolated_trailing_nodes_and_empty_edges():
    csr = edges_to_csr([0], [1], 5)
    assert csr.num_nodes == 5 and list(np.diff(csr.indptr)) == [0, 1, 0, 0, 0]
    empty = edges_to_csr([], [], 3)
    assert empty.num_edges == 0 and empty.num_nodes == 3


@pytest.mark.parametrize(
    ("src", "dst", "n", "match"),
    [
        ([0, -1], [1, 2], None, "row 1 has negative node id -1"),
        ([0, 1.5], [1, 2], None, "row 1 has non-integer node id 1.5"),
        ([0, 1], [1, 7], 5, "row 1 has node id 7 but the graph has 5 nodes"),
        ([], [], None, "edge list is empty"),
        (["a"], ["b"], None, "dtype"),
    ],
)
def test_bad_ids(src, dst, n, match):
    with pytest.raises(TrellisUserError, match=match):
        edges_to_csr(np.array(src), np.array(dst), n)


def test_bad_edge_data():
    with pytest.raises(TrellisUserError, match="has 1 rows but the edge list edges has 2 edges"):
        edges_to_csr([0, 1], [1, 0], edge_weight=np.ones(1))
    with pytest.raises(TrellisUserError, match="row 1 contains NaN"):
        edges_to_csr([0, 1], [1, 0], edge_feat=np.array([[1.0], [np.nan]]))
