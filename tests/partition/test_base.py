import json

import numpy as np
import pytest

from trellis.errors import TrellisUserError
from trellis.partition import (
    OWNERSHIPS,
    PartitionBook,
    available_methods,
    create_partitioner,
    get_partitioner,
    part_cap,
    partition_graph,
)
from trellis.partition.base import Partitioner, register

EXPECTED = {"random", "hash", "hash-dst", "vertex-cut", "reverse", "ldg", "fennel", "metis", "grem"}


def test_registry_lists_every_method():
    assert EXPECTED <= set(available_methods())
    assert get_partitioner("hash-src") is get_partitioner("hash")  # alias


def test_unknown_method_is_a_user_error_listing_methods():
    with pytest.raises(TrellisUserError, match="unknown partitioning method 'nope'.*grem"):
        get_partitioner("nope")


def test_option_that_does_not_apply_is_a_user_error():
    with pytest.raises(TrellisUserError, match="--chunk-frac does not apply to --method metis"):
        create_partitioner("metis", 2, chunk_frac=0.5)


@pytest.mark.parametrize("parts", [0, -3])
def test_parts_below_one_rejected(parts):
    with pytest.raises(TrellisUserError, match="at least 1"):
        create_partitioner("hash", parts)


def test_parts_above_nodes_rejected(make_store):
    store = make_store(3, [0, 1], [1, 2])
    with pytest.raises(TrellisUserError, match="exceeds the graph's 3 nodes"):
        partition_graph(store, "grem", 4, measure=False)


def test_part_cap():
    assert part_cap(100, 4, 0.05) == 26
    assert part_cap(10, 4, 0.0) == 3  # never below ceil(N / P)
    assert part_cap(7, 7, 0.5) == 1


def test_book_validation():
    with pytest.raises(ValueError):
        PartitionBook(np.array([0, 2]), 2, "x")
    with pytest.raises(ValueError):
        PartitionBook(np.array([0, 1]), 2, "x", ownership="diagonal")
    book = PartitionBook(np.array([1, 0, 1], dtype=np.int64), 2, "x")
    assert book.node_parts.dtype == np.int32
    assert book.part_sizes().tolist() == [1, 2]
    assert book.nodes(1).tolist() == [0, 2]


def test_edge_parts_follow_ownership():
    parts = np.array([0, 1, 2, 1], dtype=np.int32)
    src, dst = np.array([0, 2, 3]), np.array([1, 1, 0])
    assert PartitionBook(parts, 3, "x", "dst").edge_parts(src, dst).tolist() == [1, 1, 0]
    assert PartitionBook(parts, 3, "x", "src").edge_parts(src, dst).tolist() == [0, 2, 1]
    assert PartitionBook(parts, 3, "x", "reverse").edge_parts(src, dst).tolist() == [0, 2, 1]


def test_book_save_load_round_trip(tmp_path):
    book = PartitionBook(np.array([0, 1, 1, 0]), 2, "grem", "dst", {"seed": 3, "chunk_frac": 0.1},
                         {"time_s": 1.5})
    out = book.save(tmp_path / "book")
    loaded = PartitionBook.load(out)
    assert np.array_equal(loaded.node_parts, book.node_parts)
    assert loaded.metadata() == book.metadata()
    assert json.loads((out / "book.json").read_text())["method"] == "grem"
    with pytest.raises(TrellisUserError, match="already exists"):
        book.save(out)
    book.save(out, overwrite=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_load_rejects_non_partition_dir(tmp_path):
    with pytest.raises(TrellisUserError, match="not a partition directory"):
        PartitionBook.load(tmp_path)


def test_partition_graph_records_time_and_memory(make_store):
    store = make_store(6, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])
    book = partition_graph(store, "ldg", 2)
    assert book.stats["time_s"] >= 0
    assert book.stats["peak_rss_mb"] > 0 and book.stats["peak_rss_anon_mb"] > 0
    assert book.ownership in OWNERSHIPS and book.method == "ldg"


def test_register_adds_a_method(make_store):
    @register("all-zero-test")
    class AllZero(Partitioner):
        def assign(self, store):
            return np.zeros(store.num_nodes, dtype=np.int32), {"note": "test"}

    assert "all-zero-test" in available_methods()
    store = make_store(4, [0, 1], [1, 2])
    book = partition_graph(store, "all-zero-test", 1, measure=False)
    assert book.params["note"] == "test" and book.part_sizes().tolist() == [4]
