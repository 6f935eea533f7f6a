import numpy as np

from trellis.partition import evaluate, partition_graph


def test_reverse_places_nodes_like_hash_but_owns_both_directions(planted_store):
    store, _ = planted_store
    rev = partition_graph(store, "reverse", 4, measure=False)
    src_hash = partition_graph(store, "hash", 4, measure=False)
    assert rev.ownership == "reverse"
    assert np.array_equal(rev.node_parts, src_hash.node_parts)


def test_reverse_ships_single_vectors_backward(planted_store):
    """Lotan §5.1: 1D source hashing ships per-edge gradient maps backward (kept as a labelled figure);
    summed per node, as Trellis sends them, source ownership and reverse both ship one row per (node, part)."""
    store, _ = planted_store
    q_rev = evaluate(store, partition_graph(store, "reverse", 4, measure=False), width=64)
    q_src = evaluate(store, partition_graph(store, "hash", 4, measure=False), width=64)
    assert q_rev.exchange_fwd_bytes == q_src.exchange_fwd_bytes
    assert q_src.exchange_bwd_bytes_per_edge == 4 * 64 * q_src.edge_cut
    assert q_src.exchange_bwd_bytes == q_src.exchange_fwd_bytes < q_src.exchange_bwd_bytes_per_edge
    assert q_rev.exchange_bwd_bytes < q_src.exchange_bwd_bytes_per_edge
    assert sum(q_rev.part_edges) == 2 * store.num_edges  # forward edges plus their reversed copies
