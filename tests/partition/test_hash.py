import numpy as np

from trellis.partition import partition_graph
from trellis.partition.hashing import hash_parts, mix64

from .conftest import cut_frac


def test_random_is_exactly_balanced_and_seeded(planted_store):
    store, _ = planted_store
    a = partition_graph(store, "random", 7, seed=1, measure=False)
    b = partition_graph(store, "random", 7, seed=2, measure=False)
    sizes = a.part_sizes()
    assert sizes.max() - sizes.min() <= 1
    assert not np.array_equal(a.node_parts, b.node_parts)
    assert a.ownership == "dst"


def test_hash_is_a_pure_function_of_ids():
    assert np.array_equal(hash_parts(1000, 8, 5), hash_parts(1000, 8, 5))
    assert not np.array_equal(hash_parts(1000, 8, 5), hash_parts(1000, 8, 6))
    parts = hash_parts(100_000, 8, 0)
    assert np.bincount(parts).min() > 0.9 * 100_000 / 8  # well mixed
    assert mix64(np.array([1, 2]), 0).dtype == np.uint64


def test_hash_ownership_by_source_and_by_destination(planted_store):
    store, _ = planted_store
    by_src = partition_graph(store, "hash", 4, measure=False)
    by_dst = partition_graph(store, "hash-dst", 4, measure=False)
    assert by_src.ownership == "src" and by_dst.ownership == "dst"
    assert np.array_equal(by_src.node_parts, by_dst.node_parts)  # same placement, different edge owner
    assert cut_frac(store, by_src.node_parts) > 0.6  # structure-blind: ~ (P-1)/P of edges cut


def test_hash_on_a_small_graph_leaves_no_part_empty(make_store):
    n = 40
    src = np.arange(n)
    store = make_store(n, src, (src + 1) % n)
    assert (np.bincount(hash_parts(n, 32, 0), minlength=32) == 0).any()  # the hash alone leaves parts empty
    book = partition_graph(store, "hash", 32, measure=False)
    sizes = np.bincount(book.node_parts, minlength=32)
    assert sizes.min() >= 1 and sizes.sum() == n
    assert book.params["filled_empty_parts"] == int((np.bincount(hash_parts(n, 32, 0), minlength=32) == 0).sum())
    again = partition_graph(store, "hash", 32, measure=False)
    assert np.array_equal(book.node_parts, again.node_parts)
