import json
import shutil

import numpy as np
import pytest

from trellis.errors import TrellisUserError
from trellis.partition import evaluate, load_partition_book, open_partitioned, partition_graph, write_layout
from trellis.partition import layout as layout_mod

from .conftest import edge_dst

METHODS = ["grem", "hash", "hash-dst", "reverse", "vertex-cut", "random"]


@pytest.fixture(scope="module")
def layouts(planted_store, tmp_path_factory):
    store, _ = planted_store
    out = {}
    for method in METHODS:
        book = partition_graph(store, method, 4, measure=False)
        path = tmp_path_factory.mktemp("layouts") / method
        write_layout(store, book, path, quality=evaluate(store, book), chunk_edges=5000)
        out[method] = (book, open_partitioned(path, verify=True))
    return store, out


@pytest.mark.parametrize("method", METHODS)
def test_local_graphs_reconstruct_the_global_graph(layouts, method):
    store, out = layouts
    book, pg = out[method]
    src, dst = np.asarray(store.indices), edge_dst(store.indptr)
    seen = []
    owned = np.zeros(store.num_nodes, dtype=np.int64)
    for p in range(pg.num_parts):
        lg = pg.part(p)
        l2g = np.asarray(lg.local_to_global)
        local = l2g[:lg.num_local]
        assert np.array_equal(local, book.nodes(p))  # the part's own nodes, ascending
        owned[local] += 1
        halo = lg.halo_nodes
        assert np.all(book.node_parts[halo] != p) and np.array_equal(lg.halo_owner, book.node_parts[halo])
        assert np.unique(l2g).shape[0] == l2g.shape[0]
        gs, gd = lg.global_edges()
        eid = np.asarray(lg.edge_ids)
        assert np.array_equal(gs, src[eid]) and np.array_equal(gd, dst[eid])  # each edge is the true edge
        assert np.array_equal(book.edge_parts(gs, gd), np.full(eid.shape, p))  # and is owned here
        # halo = exactly the remote endpoints of this part's stored (cut) edges
        ends = np.concatenate([gs, gd])
        want_halo = np.unique(ends[book.node_parts[ends] != p])
        if lg.rev is not None:
            rp, ri, re = (np.asarray(a) for a in lg.rev)
            rrow = l2g[np.repeat(np.arange(lg.num_nodes), np.diff(rp))]
            assert np.array_equal(rrow, src[re]) and np.array_equal(l2g[ri], dst[re])
            assert np.all(book.node_parts[dst[re]] == p)  # reversed copies live with the destination
            ends = np.concatenate([ends, rrow])
            want_halo = np.unique(ends[book.node_parts[ends] != p])
        assert np.array_equal(np.sort(halo), want_halo)
        assert np.array_equal(lg.in_degree, np.diff(store.indptr)[l2g])
        assert np.array_equal(lg.out_degree, np.diff(store.reverse_csr()[0])[l2g])
        assert np.allclose(lg.x, store.x[local]) and np.array_equal(lg.y, store.y[local])
        assert np.allclose(lg.edge_weight, store.edge_weight[eid]) and np.allclose(lg.edge_feat, store.edge_feat[eid])
        for split in ("train", "val", "test"):
            ids = np.asarray(store.split(split))
            assert np.array_equal(np.sort(l2g[lg.splits[split]]), np.sort(ids[book.node_parts[ids] == p]))
        seen.append(eid)
    assert np.all(owned == 1)  # every node in exactly one part
    every = np.sort(np.concatenate(seen))
    assert np.array_equal(every, np.arange(store.num_edges))  # every edge stored exactly once


@pytest.mark.parametrize("method", ["grem", "vertex-cut"])
def test_mirrors_list_the_parts_holding_a_halo_copy(layouts, method):
    _, out = layouts
    _, pg = out[method]
    holders = {}
    for q in range(pg.num_parts):
        for v in pg.part(q).halo_nodes.tolist():
            holders.setdefault(v, []).append(q)
    for p in range(pg.num_parts):
        lg = pg.part(p)
        for i, v in enumerate(lg.local_to_global[:lg.num_local].tolist()):
            got = lg.mirror_parts[lg.mirror_indptr[i]:lg.mirror_indptr[i + 1]].tolist()
            assert got == sorted(holders.get(v, []))


def test_buckets_cover_every_edge_once(layouts):
    store, out = layouts
    book, pg = out["grem"]
    src, dst = np.asarray(store.indices), edge_dst(store.indptr)
    parts = book.node_parts
    ids = []
    for b in pg.iter_buckets():
        assert np.all(parts[b.src] == b.src_part) and np.all(parts[b.dst] == b.dst_part)
        assert np.array_equal(src[b.edge_ids], b.src) and np.array_equal(dst[b.edge_ids], b.dst)
        assert np.allclose(b.edge_weight, store.edge_weight[b.edge_ids])
        ids.append(np.asarray(b.edge_ids))
    assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(store.num_edges))
    among = pg.edges_among([2, 0])
    mask = np.isin(parts[src], [0, 2]) & np.isin(parts[dst], [0, 2])
    assert np.array_equal(np.sort(among.edge_ids), np.flatnonzero(mask))
    offsets = pg.bucket_offsets
    assert offsets[0] == 0 and offsets[-1] == store.num_edges and np.all(np.diff(offsets) >= 0)


@pytest.mark.parametrize("method", METHODS)
def test_edge_features_travel_with_their_edges(layouts, method):
    """GAT-E on a part reads the store's feature row of every local edge, reversed copy and bucket row."""
    store, out = layouts
    _, pg = out[method]
    ef = np.asarray(store.edge_feat)
    assert pg.manifest["has_edge_feat"]
    for p in range(pg.num_parts):
        lg = pg.part(p)
        assert lg.edge_feat.shape == (lg.edge_ids.shape[0], ef.shape[1])
        np.testing.assert_array_equal(lg.edge_feat, ef[np.asarray(lg.edge_ids)].astype(np.float32))
        if lg.rev is not None:  # reverse ownership: the reversed in-edge copies carry their edge's row
            np.testing.assert_array_equal(lg.rev_edge_feat, ef[np.asarray(lg.rev[2])].astype(np.float32))
        else:
            assert lg.rev_edge_feat is None
    for b in pg.iter_buckets():
        np.testing.assert_array_equal(b.edge_feat, ef[np.asarray(b.edge_ids)].astype(np.float32))
    among = pg.edges_among([1, 3])
    np.testing.assert_array_equal(among.edge_feat, ef[among.edge_ids].astype(np.float32))


def test_manifest_and_book(layouts):
    store, out = layouts
    book, pg = out["grem"]
    m = pg.manifest
    assert m["format"] == "trellis-partition" and m["num_parts"] == 4 and m["ownership"] == "dst"
    assert m["store"]["checksum"] == store.checksum and m["quality"]["edge_cut_frac"] > 0
    assert all(meta["sha256"] for meta in m["arrays"].values())
    loaded = load_partition_book(pg.path)
    assert np.array_equal(loaded.node_parts, book.node_parts) and loaded.method == "grem"
    assert sum(info["num_local"] for info in m["parts"]) == store.num_nodes
    with pytest.raises(IndexError):
        pg.part(4)


def test_verify_detects_a_modified_array(layouts, tmp_path):
    _, out = layouts
    _, pg = out["hash"]
    copy = tmp_path / "copy"
    shutil.copytree(pg.path, copy)
    target = copy / "part-00001" / "indices.npy"
    arr = np.load(target)
    arr[0] = arr[0] + 1
    np.save(target, arr)
    with pytest.raises(TrellisUserError, match="sha256"):
        open_partitioned(copy, verify=True)
    (copy / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(TrellisUserError, match="is not trellis-partition v1; re-run `trellis partition`"):
        open_partitioned(copy)


def test_existing_output_and_failure_leave_nothing(planted_store, tmp_path, monkeypatch):
    store, _ = planted_store
    book = partition_graph(store, "hash", 2, measure=False)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("x")
    with pytest.raises(TrellisUserError, match="already exists"):
        write_layout(store, book, keep)
    with pytest.raises(TrellisUserError, match="refusing"):
        write_layout(store, book, keep, overwrite=True)  # not a layout: never deleted

    def boom(self):
        raise RuntimeError("disk full")

    monkeypatch.setattr(layout_mod._LayoutBuilder, "write_buckets", boom)
    with pytest.raises(RuntimeError):
        write_layout(store, book, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]  # no partial output, no temp dir


def test_overwrite_replaces_a_layout(planted_store, tmp_path):
    store, _ = planted_store
    write_layout(store, partition_graph(store, "hash", 2, measure=False), tmp_path / "l")
    write_layout(store, partition_graph(store, "random", 3, measure=False), tmp_path / "l", overwrite=True)
    assert open_partitioned(tmp_path / "l").num_parts == 3


def test_node_count_mismatch_rejected(planted_store, make_store, tmp_path):
    store, _ = planted_store
    other = make_store(5, np.array([0]), np.array([1]))
    with pytest.raises(TrellisUserError, match="nodes"):
        write_layout(other, partition_graph(store, "hash", 2, measure=False), tmp_path / "x")


def test_empty_parts_and_edgeless_graph(make_store, tmp_path):
    store = make_store(4, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    book = partition_graph(store, "hash", 4, measure=False)  # hash may leave a part empty
    write_layout(store, book, tmp_path / "l")
    pg = open_partitioned(tmp_path / "l", verify=True)
    assert sum(pg.part(p).num_local for p in range(4)) == 4
    assert all(pg.part(p).num_edges == 0 for p in range(4))
    assert pg.edges_among([0, 1, 2, 3]).num_edges == 0
