import numpy as np
import pytest

from trellis.partition import PartitionBook, evaluate, partition_graph
from trellis.partition.quality import count_parts, exchange_bytes, mark_parts, new_mask

from .conftest import edge_dst


def brute_force_halo(store, book):
    """Per part, the set of remote nodes it needs, straight from the definitions (tiny graphs only)."""
    parts = book.node_parts
    src, dst = np.asarray(store.indices), edge_dst(store.indptr)
    need = [set() for _ in range(book.num_parts)]
    for u, v in zip(src.tolist(), dst.tolist()):
        if book.ownership in ("dst", "reverse") and parts[u] != parts[v]:
            need[parts[v]].add(u)
        if book.ownership in ("src", "reverse") and parts[u] != parts[v]:
            need[parts[u]].add(v)
        if book.ownership == "vertex-cut":
            p = int(book.edge_parts(np.array([u]), np.array([v]))[0])
            for x in (u, v):
                if parts[x] != p:
                    need[p].add(x)
    return need


@pytest.mark.parametrize("method", ["metis", "hash", "hash-dst", "reverse", "vertex-cut", "grem"])
def test_report_matches_definitions(make_store, method):
    rng = np.random.default_rng(4)
    n = 60
    store = make_store(n, rng.integers(0, n, 300), rng.integers(0, n, 300))  # directed, with self loops
    book = partition_graph(store, method, 4, measure=False)
    q = evaluate(store, book, width=8, chunk_edges=37)
    src, dst = np.asarray(store.indices), edge_dst(store.indptr)
    cut = int(np.count_nonzero(book.node_parts[src] != book.node_parts[dst]))
    assert q.edge_cut == cut and q.edge_cut_frac == pytest.approx(cut / store.num_edges)
    need = brute_force_halo(store, book)
    assert q.part_halo == [len(s) for s in need]
    assert q.replication_factor == pytest.approx((n + sum(len(s) for s in need)) / n)
    sizes = np.bincount(book.node_parts, minlength=4)
    assert q.part_nodes == sizes.tolist() and q.balance == pytest.approx(sizes.max() * 4 / n)
    copies = 2 if book.ownership == "reverse" else 1
    assert sum(q.part_edges) == copies * store.num_edges
    assert q.to_dict()["edge_cut_frac"] == q.edge_cut_frac
    assert "edge cut" in q.table() and "RssAnon" in q.table()


def test_report_counts_training_nodes_per_part(make_store):
    """``--balance train`` evens out the parts' training nodes, but the report did not show them."""
    rng = np.random.default_rng(5)
    n = 80
    src, dst = rng.integers(0, n, 400), rng.integers(0, n, 400)
    train = rng.choice(n, 30, replace=False)
    store = make_store(n, src, dst, y=rng.integers(0, 3, n), splits={"train": train})
    book = partition_graph(store, "metis", 4, measure=False)
    q = evaluate(store, book)
    want = np.bincount(book.node_parts[train], minlength=4)
    assert q.part_train == want.tolist() and q.train_balance == pytest.approx(want.max() * 4 / 30)
    assert "training nodes" in q.table() and f"{want[0]:>10,}" in q.table().splitlines()[-4]
    bare = evaluate(make_store(n, src, dst), book)
    assert bare.part_train == [] and bare.train_balance is None and "training nodes" not in bare.table()


def test_exchange_formulas():
    assert exchange_bytes("dst", 2, 10, 0) == (80, 80)
    assert exchange_bytes("src", 2, 0, 10) == (80, 80)  # gradients summed per node: one row per (dst, part)
    assert exchange_bytes("reverse", 2, 7, 10) == (80, 56)
    assert exchange_bytes("vertex-cut", 2, 3, 5) == (64, 64)  # mirrors read as sources + written as destinations


def test_bitmask_beyond_64_parts():
    mask = new_mask(3, 130)
    owner = np.zeros(3, dtype=np.int32)
    mark_parts(np.array([0, 0, 2, 1]), np.array([129, 64, 3, 0]), owner, mask)
    counts = count_parts(mask, 130)
    assert counts[129] == 1 and counts[64] == 1 and counts[3] == 1 and counts[0] == 0  # own part not marked
    assert counts.sum() == 3


def test_single_part_has_no_cut(make_store):
    store = make_store(5, np.array([0, 1, 2]), np.array([1, 2, 3]))
    q = evaluate(store, PartitionBook(np.zeros(5), 1, "manual"))
    assert q.edge_cut == 0 and q.replication_factor == 1.0 and q.exchange_fwd_bytes == 0
